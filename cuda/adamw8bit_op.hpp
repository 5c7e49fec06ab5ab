// adamw8bit_op.hpp: AdamW8bit (src/rules/adamw8bit.hpp) on the device, in pieces of one
// 256-element quantization block.
//
// Plain C++ with __host__ __device__ members, like lion_op.hpp. The CUDA kernel
// (device_algorithms.cu) runs a block of 256 threads per quantization block: update() on each
// thread's element, the block's maxima (max_of() in any order: see below), then requantize().
// The Thrust OpenMP test build and the fake device run operator()(b), the same pieces over
// the block's elements in a loop. The arithmetic is rules::q8::adamw8bit_block's: the
// dequantization q[code] * scale, adam_element(), the replica, max(|m|) and max(v) floored at
// kMinScale, quantize(map, x / scale).
//
// Why the maxima are the same bits in any order: max_of(acc, x) is the CPU's std::max(acc, x),
// acc < x ? x : acc, so a NaN x leaves acc as it is; each thread's leaf max_of(0, x) is NaN-free,
// and the maximum of NaN-free floats is one of them whatever the order, except that +0 and -0
// may come out either way, which the floor (kMinScale > 0) erases. Where a NaN arises (v
// overflowing to Inf, then Inf / Inf), its bits are the hardware's, and so is its code, which
// follows the sign bit: bitwise equality with an x86 CPU holds for finite values (docs/cuda.md).
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>

#include "rules/qmap.hpp"
#include "shardopt/adam_math.hpp"
#include "shardopt/bf16.hpp"
#include "shardopt/host_device.hpp"

namespace shardopt::dev {

/// One segment of whole blocks: elements [0, blocks * kBlock) of the pointers (already offset
/// to the segment's start; scale_m / scale_v to its first block).
struct AdamW8bitOp {
  StepScalars s{};
  SegmentScalars g{};
  const rules::q8::Qmap* qs = nullptr;  ///< the signed map (exp_avg), in the kernel's memory
  const rules::q8::Qmap* qu = nullptr;  ///< the unsigned map (exp_avg_sq)
  float* master = nullptr;
  const float* grad = nullptr;
  std::uint8_t* code_m = nullptr;
  std::uint8_t* code_v = nullptr;
  float* scale_m = nullptr;  ///< one per block
  float* scale_v = nullptr;
  bf16* out_bf16 = nullptr;  ///< the bf16 replica, or null
  float* out_f32 = nullptr;  ///< an fp32 replica that is not the master, or null

  /// The CPU block's running maximum: std::max(acc, x).
  SHARDOPT_HD static float max_of(float acc, float x) { return acc < x ? x : acc; }

  /// Element i with its block's old scales: dequantizes m and v, runs adam_element(), writes
  /// the master and the replica; the new m and v come back (fp32, before requantization).
  SHARDOPT_HD void update(std::size_t i, float old_scale_m, float old_scale_v, float& m,
                          float& v) const {
    m = qs->value[code_m[i]] * old_scale_m;
    v = qu->value[code_v[i]] * old_scale_v;
    float p = master[i];
    adam_element(s, g, p, grad[i], m, v);
    master[i] = p;
    if (out_bf16) out_bf16[i] = to_bf16(p);
    if (out_f32) out_f32[i] = p;
  }

  /// The block's new scales from the maxima of |m| and v over it.
  SHARDOPT_HD static float new_scale(float max) { return max_of(max, rules::q8::kMinScale); }

  /// Element i's new codes under its block's new scales.
  SHARDOPT_HD void requantize(std::size_t i, float m, float v, float new_scale_m,
                              float new_scale_v) const {
    code_m[i] = rules::q8::quantize(*qs, m / new_scale_m);
    code_v[i] = rules::q8::quantize(*qu, v / new_scale_v);
  }

  /// Block b whole, element after element (the Thrust OpenMP build and the fake device).
  SHARDOPT_HD void operator()(std::size_t b) const {
    constexpr std::size_t kBlock = rules::q8::kBlock;
    const std::size_t at = b * kBlock;
    float m[kBlock], v[kBlock];
    const float old_m = scale_m[b], old_v = scale_v[b];
    float max_m = 0.0f, max_v = 0.0f;
    for (std::size_t k = 0; k < kBlock; ++k) {
      update(at + k, old_m, old_v, m[k], v[k]);
      max_m = max_of(max_m, fabsf(m[k]));
      max_v = max_of(max_v, v[k]);
    }
    const float sm = new_scale(max_m), sv = new_scale(max_v);
    scale_m[b] = sm;
    scale_v[b] = sv;
    for (std::size_t k = 0; k < kBlock; ++k) requantize(at + k, m[k], v[k], sm, sv);
  }
};

}  // namespace shardopt::dev
