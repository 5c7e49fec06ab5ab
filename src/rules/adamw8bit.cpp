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

cpu::Q8Map simd_map(const Qmap& q) {
  return cpu::Q8Map{q.value, q.threshold, q.base_pos, static_cast<std::uint32_t>(kBuckets),
                    kBucketShift};
}

}  // namespace

void adamw8bit_update(const StepScalars& s, std::span<const UpdateSegment> segments,
                      float* master, const float* grad, std::uint8_t* code_m,
                      std::uint8_t* code_v, float* scale_m, float* scale_v, bf16* out_bf16,
                      float* out_f32) {
  if (segments.empty()) return;
  const std::size_t n = segments.back().end;
  require(segments.front().begin == 0 && n % kBlock == 0, Status::Internal,
          "adamw8bit_update: the range is not whole blocks");
  for (const UpdateSegment& seg : segments)
    require(seg.begin % kBlock == 0 && seg.end % kBlock == 0, Status::Internal,
            "adamw8bit_update: a segment boundary inside a block");
  const std::ptrdiff_t blocks = static_cast<std::ptrdiff_t>(n / kBlock);
  // The ISA's block kernel where it has one (AVX-512), bitwise the portable block.
  const auto simd = cpu::active_kernels().adamw8bit_block;
  const cpu::Q8Map qs = simd_map(signed_map()), qu = simd_map(unsigned_map());
#pragma omp parallel for schedule(static) if (blocks > 64)
  for (std::ptrdiff_t b = 0; b < blocks; ++b) {
    const std::size_t at = static_cast<std::size_t>(b) * kBlock;
    const auto seg = std::upper_bound(segments.begin(), segments.end(), at,
                                      [](std::size_t i, const UpdateSegment& sg) { return i < sg.end; });
    bf16* o16 = out_bf16 ? out_bf16 + at : nullptr;
    float* o32 = out_f32 ? out_f32 + at : nullptr;
    if (simd)
      simd(s, seg->scalars, master + at, grad + at, code_m + at, code_v + at, scale_m[b],
           scale_v[b], o16, o32, qs, qu);
    else
      adamw8bit_block(s, seg->scalars, master + at, grad + at, code_m + at, code_v + at,
                      scale_m[b], scale_v[b], o16, o32, kBlock);
  }
}

}  // namespace shardopt::rules::q8
