// model_shapes.hpp: parameter layouts of well-known transformer shapes, for shardopt-plan.
// The tensors are registered in forward order with their real sizes, so stage 2's staging
// buffer (the largest bucket, at least the largest tensor, e.g. the embedding) is planned
// honestly rather than assumed.
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

FlatLayout gpt_layout(const GptShape& s);
FlatLayout llama_layout(const LlamaShape& s);

struct NamedModel {
  std::string name;
  std::string description;
};
/// The preset names model_layout() knows.
std::vector<NamedModel> known_models();
/// The layout of a preset; throws Error(InvalidArgument) for an unknown name.
FlatLayout model_layout(std::string_view name);

}  // namespace shardopt::tools
