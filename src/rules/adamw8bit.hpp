// adamw8bit.hpp: AdamW with block-quantized 8-bit state (issue 31), the CPU kernel.
//
// State per element: a u8 code of exp_avg (signed map) and of exp_avg_sq (unsigned map); per
// block of q8::kBlock elements, the fp32 scale of each (qmap.hpp). One step of a block:
// dequantize m and v (q[code] * scale), run adam_element() on every element (fp32, the
// arithmetic of the fp32 AdamW rule; the weight is updated from the fp32 m and v), write the
// replica, then requantize: the new scales max(|m|), max(v) (floored at 1e-12), the new codes
// of m / scale and v / scale. A block never straddles two parameters (8-bit parameters start
// at multiples of kBlock, and so does every bucket slice), so its scale is its parameter's.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include "shardopt/adam_math.hpp"
#include "rules/qmap.hpp"
#include "shardopt/bf16.hpp"
#include "shardopt/error.hpp"

namespace shardopt::rules::q8 {

/// Checks that `segments` tile [0, n) in whole blocks (every bound a multiple of kBlock), as
/// every AdamW8bit kernel (CPU and CUDA) needs; Error(Internal) otherwise. Returns n.
inline std::size_t require_whole_blocks(std::span<const UpdateSegment> segments) {
  if (segments.empty()) return 0;
  const std::size_t n = segments.back().end;
  require(segments.front().begin == 0 && n % kBlock == 0, Status::Internal,
          "adamw8bit_update: the range is not whole blocks");
  for (const UpdateSegment& seg : segments)
    require(seg.begin % kBlock == 0 && seg.end % kBlock == 0, Status::Internal,
            "adamw8bit_update: a segment boundary inside a block");
  return n;
}

/// AdamW8bit over segments tiling [0, n), n = segments.back().end a multiple of kBlock, each
/// segment's bounds multiples of kBlock: master, grad, the codes (n each) and the scales
/// (n / kBlock each); the replica copy of the new weights when out_bf16 / out_f32 is not null.
/// Threaded over blocks; results do not depend on the thread count.
void adamw8bit_update(const StepScalars& s, std::span<const UpdateSegment> segments,
                      float* master, const float* grad, std::uint8_t* code_m,
                      std::uint8_t* code_v, float* scale_m, float* scale_v, bf16* out_bf16,
                      float* out_f32);

/// One block of n <= kBlock elements (the reference the threaded loop runs).
void adamw8bit_block(const StepScalars& s, const SegmentScalars& g, float* p, const float* grad,
                     std::uint8_t* code_m, std::uint8_t* code_v, float& scale_m, float& scale_v,
                     bf16* out_bf16, float* out_f32, std::size_t n);

}  // namespace shardopt::rules::q8
