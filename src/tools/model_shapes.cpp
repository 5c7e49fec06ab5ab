// model_shapes.cpp: GPT and Llama parameter lists with their real tensor sizes.
#include "model_shapes.hpp"

#include "shardopt/error.hpp"

namespace shardopt::tools {

FlatLayout gpt_layout(const GptShape& s) {
  const std::size_t d = s.d_model;
  FlatLayout l;
  l.add("wte", s.vocab * d, 0);
  l.add("wpe", s.context * d, 0);
  for (std::size_t i = 0; i < s.n_layer; ++i) {
    std::string h = "h";  // appended, not "h" + ...: avoids a GCC 12 -Wrestrict false positive
    h += std::to_string(i) + ".";
    l.add(h + "ln_1.weight", d, 0);
    l.add(h + "ln_1.bias", d, 0);
    l.add(h + "attn.c_attn.weight", 3 * d * d, 0);
    l.add(h + "attn.c_attn.bias", 3 * d, 0);
    l.add(h + "attn.c_proj.weight", d * d, 0);
    l.add(h + "attn.c_proj.bias", d, 0);
    l.add(h + "ln_2.weight", d, 0);
    l.add(h + "ln_2.bias", d, 0);
    l.add(h + "mlp.c_fc.weight", 4 * d * d, 0);
    l.add(h + "mlp.c_fc.bias", 4 * d, 0);
    l.add(h + "mlp.c_proj.weight", 4 * d * d, 0);
    l.add(h + "mlp.c_proj.bias", d, 0);
  }
  l.add("ln_f.weight", d, 0);
  l.add("ln_f.bias", d, 0);
  return l;
}

FlatLayout llama_layout(const LlamaShape& s) {
  const std::size_t d = s.d_model;
  FlatLayout l;
  l.add("tok_embeddings", s.vocab * d, 0);
  for (std::size_t i = 0; i < s.n_layer; ++i) {
    std::string h = "layers.";
    h += std::to_string(i) + ".";
    l.add(h + "attention_norm", d, 0);
    l.add(h + "wq", d * d, 0);
    l.add(h + "wk", d * s.d_kv, 0);
    l.add(h + "wv", d * s.d_kv, 0);
    l.add(h + "wo", d * d, 0);
    l.add(h + "ffn_norm", d, 0);
    l.add(h + "w1", s.d_ffn * d, 0);
    l.add(h + "w3", s.d_ffn * d, 0);
    l.add(h + "w2", d * s.d_ffn, 0);
  }
  l.add("norm", d, 0);
  if (!s.tied) l.add("output", s.vocab * d, 0);
  return l;
}

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

FlatLayout model_layout(std::string_view name) {
  for (const Preset& p : kPresets)
    if (name == p.name) return p.llama ? llama_layout(p.ll) : gpt_layout(p.gpt);
  std::string names;
  for (const Preset& p : kPresets) names += std::string(names.empty() ? "" : ", ") + p.name;
  throw Error(Status::InvalidArgument,
              "unknown model '" + std::string(name) + "' (known: " + names + ")");
}

}  // namespace shardopt::tools
