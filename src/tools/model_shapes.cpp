// model_shapes.cpp: GPT and Llama parameter lists with their real tensor sizes.
#include "model_shapes.hpp"

#include "shardopt/error.hpp"

namespace shardopt::tools {

namespace {

// Registers a tensor with its shape (rows x cols) and whether it is a Muon matrix.
void add(ModelParams& m, const std::string& name, std::size_t rows, std::size_t cols,
         bool matrix) {
  m.layout.add(name, rows * cols, 0, 0, Shape2D{rows, cols});
  m.matrix.push_back(matrix);
}
// A 1-D tensor (norm weight or bias): element-wise.
void add(ModelParams& m, const std::string& name, std::size_t numel) {
  m.layout.add(name, numel, 0);
  m.matrix.push_back(false);
}

}  // namespace

ModelParams gpt_model(const GptShape& s) {
  const std::size_t d = s.d_model;
  ModelParams m;
  add(m, "wte", s.vocab, d, false);
  add(m, "wpe", s.context, d, false);
  for (std::size_t i = 0; i < s.n_layer; ++i) {
    std::string h = "h";  // appended, not "h" + ...: avoids a GCC 12 -Wrestrict false positive
    h += std::to_string(i) + ".";
    add(m, h + "ln_1.weight", d);
    add(m, h + "ln_1.bias", d);
    add(m, h + "attn.c_attn.weight", d, 3 * d, true);  // Conv1D: in x out
    add(m, h + "attn.c_attn.bias", 3 * d);
    add(m, h + "attn.c_proj.weight", d, d, true);
    add(m, h + "attn.c_proj.bias", d);
    add(m, h + "ln_2.weight", d);
    add(m, h + "ln_2.bias", d);
    add(m, h + "mlp.c_fc.weight", d, 4 * d, true);
    add(m, h + "mlp.c_fc.bias", 4 * d);
    add(m, h + "mlp.c_proj.weight", 4 * d, d, true);
    add(m, h + "mlp.c_proj.bias", d);
  }
  add(m, "ln_f.weight", d);
  add(m, "ln_f.bias", d);
  return m;
}

ModelParams llama_model(const LlamaShape& s) {
  const std::size_t d = s.d_model;
  ModelParams m;
  add(m, "tok_embeddings", s.vocab, d, false);
  for (std::size_t i = 0; i < s.n_layer; ++i) {
    std::string h = "layers.";
    h += std::to_string(i) + ".";
    add(m, h + "attention_norm", d);
    add(m, h + "wq", d, d, true);  // nn.Linear: out x in
    add(m, h + "wk", s.d_kv, d, true);
    add(m, h + "wv", s.d_kv, d, true);
    add(m, h + "wo", d, d, true);
    add(m, h + "ffn_norm", d);
    add(m, h + "w1", s.d_ffn, d, true);
    add(m, h + "w3", s.d_ffn, d, true);
    add(m, h + "w2", d, s.d_ffn, true);
  }
  add(m, "norm", d);
  if (!s.tied) add(m, "output", s.vocab, d, false);
  return m;
}

FlatLayout gpt_layout(const GptShape& s) { return gpt_model(s).layout; }
FlatLayout llama_layout(const LlamaShape& s) { return llama_model(s).layout; }

namespace {

struct Preset {
  const char* name;
  const char* description;
  bool llama;
  GptShape gpt;
  LlamaShape ll;
};

// Shapes as published (GPT-2: Radford et al. 2019; GPT-3: Brown et al. 2020; Llama 2:
// Touvron et al. 2023; Llama 3: Dubey et al. 2024; Llama 3.2 1B: its model card's config,
// tied embeddings).
constexpr Preset kPresets[] = {
    {"gpt2-124m", "GPT-2 small: 12 layers, d 768", false, {12, 768, 50257, 1024}, {}},
    {"gpt2-1.5b", "GPT-2 XL: 48 layers, d 1600", false, {48, 1600, 50257, 1024}, {}},
    {"gpt3-175b", "GPT-3: 96 layers, d 12288, context 2048", false, {96, 12288, 50257, 2048}, {}},
    {"llama3.2-1b", "Llama 3.2 1B: 16 layers, d 2048, ffn 8192, 8 KV heads, tied embeddings", true,
     {}, {16, 2048, 8192, 512, 128256, true}},
    {"llama2-7b", "Llama 2 7B: 32 layers, d 4096, ffn 11008", true, {}, {32, 4096, 11008, 4096, 32000}},
    {"llama2-70b", "Llama 2 70B: 80 layers, d 8192, ffn 28672, 8 KV heads", true, {},
     {80, 8192, 28672, 1024, 32000}},
    {"llama3-405b", "Llama 3.1 405B: 126 layers, d 16384, ffn 53248, 8 KV heads", true, {},
     {126, 16384, 53248, 1024, 128256}},
};

}  // namespace

std::vector<NamedModel> known_models() {
  std::vector<NamedModel> out;
  for (const Preset& p : kPresets) out.push_back({p.name, p.description});
  return out;
}

FlatLayout model_layout(std::string_view name) { return model_params(name).layout; }

ModelParams model_params(std::string_view name) {
  for (const Preset& p : kPresets)
    if (name == p.name) return p.llama ? llama_model(p.ll) : gpt_model(p.gpt);
  std::string names;
  for (const Preset& p : kPresets) names += std::string(names.empty() ? "" : ", ") + p.name;
  throw Error(Status::InvalidArgument,
              "unknown model '" + std::string(name) + "' (known: " + names + ")");
}

}  // namespace shardopt::tools
