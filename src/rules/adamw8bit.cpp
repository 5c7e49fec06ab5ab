// adamw8bit.cpp: the AdamW8bit CPU kernel (adamw8bit.hpp).
#include "rules/adamw8bit.hpp"

#include <algorithm>
#include <cmath>

#include "cpu/kernel_table.hpp"
#include "rules/qmap.hpp"
#include "shardopt/error.hpp"

namespace shardopt::rules::q8 {

void adamw8bit_block(const StepScalars& s, const SegmentScalars& g, float* p, const float* grad,
                     std::uint8_t* code_m, std::uint8_t* code_v, float& scale_m, float& scale_v,
                     bf16* out_bf16, float* out_f32, std::size_t n) {
  const Qmap& qs = signed_map();
  const Qmap& qu = unsigned_map();
  float m[kBlock], v[kBlock];
  float max_m = 0.0f, max_v = 0.0f;
  for (std::size_t i = 0; i < n; ++i) {
    float mi = qs.value[code_m[i]] * scale_m;
    float vi = qu.value[code_v[i]] * scale_v;
    float pi = p[i];
    adam_element(s, g, pi, grad[i], mi, vi);
    p[i] = pi;
    if (out_bf16) out_bf16[i] = to_bf16(pi);
    if (out_f32) out_f32[i] = pi;
    m[i] = mi;
    v[i] = vi;
    max_m = std::max(max_m, std::fabs(mi));
    max_v = std::max(max_v, vi);
  }
  scale_m = std::max(max_m, kMinScale);
  scale_v = std::max(max_v, kMinScale);
  for (std::size_t i = 0; i < n; ++i) {
    code_m[i] = quantize(qs, m[i] / scale_m);
    code_v[i] = quantize(qu, v[i] / scale_v);
  }
}

namespace {

static_assert(cpu::kQ8Low == kSimdLow && cpu::kQ8Buckets == kSimdBuckets);

cpu::Q8Map simd_map(const Qmap& q) { return cpu::Q8Map{q.value, simd_entries(q)}; }

/// Blocks per unit of the threaded loop (a unit is split where a segment ends).
constexpr std::size_t kUnitBlocks = 16;

}  // namespace

void adamw8bit_update(const StepScalars& s, std::span<const UpdateSegment> segments,
                      float* master, const float* grad, std::uint8_t* code_m,
                      std::uint8_t* code_v, float* scale_m, float* scale_v, bf16* out_bf16,
                      float* out_f32) {
  if (segments.empty()) return;
  const std::size_t blocks = require_whole_blocks(segments) / kBlock;
  const std::ptrdiff_t units = static_cast<std::ptrdiff_t>((blocks + kUnitBlocks - 1) / kUnitBlocks);
  // The ISA's kernel where it has one (AVX2, AVX-512), bitwise the portable block. Each block
  // is computed alone, so neither the units nor the thread count change a bit.
  const auto simd = cpu::active_kernels().adamw8bit_blocks;
  const cpu::Q8Map qs = simd_map(signed_map()), qu = simd_map(unsigned_map());
#pragma omp parallel for schedule(static) if (units > 4)
  for (std::ptrdiff_t u = 0; u < units; ++u) {
    std::size_t b = static_cast<std::size_t>(u) * kUnitBlocks;
    const std::size_t unit_end = std::min(blocks, b + kUnitBlocks);
    auto seg = std::upper_bound(segments.begin(), segments.end(), b * kBlock,
                                [](std::size_t i, const UpdateSegment& sg) { return i < sg.end; });
    while (b < unit_end) {
      const std::size_t end = std::min(unit_end, seg->end / kBlock), at = b * kBlock;
      bf16* o16 = out_bf16 ? out_bf16 + at : nullptr;
      float* o32 = out_f32 ? out_f32 + at : nullptr;
      if (end == b) {
        // an empty segment
      } else if (simd) {
        simd(s, seg->scalars, master + at, grad + at, code_m + at, code_v + at, scale_m + b,
             scale_v + b, o16, o32, end - b, qs, qu);
      } else {
        for (std::size_t k = b; k < end; ++k) {
          const std::size_t o = (k - b) * kBlock;
          adamw8bit_block(s, seg->scalars, master + at + o, grad + at + o, code_m + at + o,
                          code_v + at + o, scale_m[k], scale_v[k], o16 ? o16 + o : nullptr,
                          o32 ? o32 + o : nullptr, kBlock);
        }
      }
      b = end;
      ++seg;
    }
  }
}

}  // namespace shardopt::rules::q8
