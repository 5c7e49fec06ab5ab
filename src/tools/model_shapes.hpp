// model_shapes.hpp: parameter layouts of well-known transformer shapes, for shardopt-plan.
// The tensors are registered in forward order with their real sizes, so stage 2's staging
// buffer (the largest bucket, at least the largest tensor, e.g. the embedding) is planned
// honestly rather than assumed.
//
// Every 2-D tensor carries its shape as torch stores it (nn.Linear: out_features x
// in_features; GPT-2's Conv1D: in x out; embeddings: vocab x d). Which tensors are Muon
// matrices (ModelParams::matrix) follows the usual Muon recipe (Jordan et al. 2024;
// Moonlight): the hidden projection matrices of the blocks (attention q/k/v/o or GPT-2's
// fused c_attn and c_proj, the MLP's matrices); the token and position embeddings and the
// output head are 2-D but run AdamW, as do norms and biases (1-D).
#pragma once

#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

#include "shardopt/layout.hpp"

namespace shardopt::tools {

/// GPT-2/GPT-3 style: learned positions, LayerNorm with bias, 4x MLP, tied embedding.
struct GptShape {
  std::size_t n_layer, d_model, vocab, context;
};
/// Llama style: RMSNorm, SwiGLU MLP of width d_ffn, grouped K/V of width d_kv, untied output.
struct LlamaShape {
  std::size_t n_layer, d_model, d_ffn, d_kv, vocab;
  bool tied = false;  ///< the output projection is the embedding (no tensor of its own)
};

/// A layout and, per parameter, whether it is a Muon matrix (see above).
struct ModelParams {
  FlatLayout layout;
  std::vector<bool> matrix;
};

ModelParams gpt_model(const GptShape& s);
ModelParams llama_model(const LlamaShape& s);
FlatLayout gpt_layout(const GptShape& s);    ///< gpt_model(s).layout
FlatLayout llama_layout(const LlamaShape& s);  ///< llama_model(s).layout

struct NamedModel {
  std::string name;
  std::string description;
};
/// The preset names model_layout() knows.
std::vector<NamedModel> known_models();
/// The layout of a preset; throws Error(InvalidArgument) for an unknown name.
FlatLayout model_layout(std::string_view name);
/// The layout of a preset with its matrix flags; throws as model_layout.
ModelParams model_params(std::string_view name);

}  // namespace shardopt::tools
