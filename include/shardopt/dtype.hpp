// dtype.hpp: element types of the parameter replica and of gradients given to the library.
#pragma once

#include <cstddef>
#include <cstdint>

namespace shardopt {

enum class DType : std::uint8_t { F32 = 0, BF16 = 1 };

constexpr std::size_t dtype_size(DType t) { return t == DType::F32 ? 4 : 2; }
constexpr const char* dtype_name(DType t) { return t == DType::F32 ? "fp32" : "bf16"; }

}  // namespace shardopt
