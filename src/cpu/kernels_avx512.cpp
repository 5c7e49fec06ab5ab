// kernels_avx512.cpp: AVX-512F range kernels (compiled with -mavx512f -ffp-contract=off).
//
// Same structure and the same arithmetic as kernels_avx2.cpp, 16 floats per vector: each
// loop mirrors the portable kernel operation for operation (no FMA), so it returns the same
// bits. Heads and tails go to the portable kernels (see kernel_table.hpp).
#include <immintrin.h>

#include <cstdint>

#include "kernel_table.hpp"
#include "kernels.hpp"

namespace shardopt::cpu::avx512 {
namespace {

constexpr std::size_t kW = 16;  // floats per vector

/// Elements before p reaches an `align`-byte boundary (n if never: p not element-aligned).
template <class T>
std::size_t head_to_align(const T* p, std::size_t n, std::size_t align) {
  const auto addr = reinterpret_cast<std::uintptr_t>(p);
  if (addr % sizeof(T) != 0) return n;
  const std::size_t h = ((align - addr % align) % align) / sizeof(T);
  return h < n ? h : n;
}

/// 16 floats -> 16 bf16, as float_to_bf16_bits().
__m256i pack_bf16(__m512 x) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i hi = _mm512_srli_epi32(u, 16);
  const __mmask16 is_nan = _mm512_cmpgt_epi32_mask(
      _mm512_and_si512(u, _mm512_set1_epi32(0x7FFFFFFF)), _mm512_set1_epi32(0x7F800000));
  const __m512i bias = _mm512_add_epi32(_mm512_and_si512(hi, _mm512_set1_epi32(1)),
                                        _mm512_set1_epi32(0x7FFF));
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(u, bias), 16);
  const __m512i nan = _mm512_or_si512(_mm512_and_si512(hi, _mm512_set1_epi32(0x8000)),
                                      _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(is_nan, rounded, nan));
}

__m512 widen_bf16(__m256i h) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

void store_bf16x16(bf16* dst, __m256i x, bool stream) {
  if (stream) {
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst), x);
  } else {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), x);
  }
}

void store_f32x16(float* dst, __m512 x, bool stream) {
  if (stream) {
    _mm512_stream_ps(dst, x);
  } else {
    _mm512_storeu_ps(dst, x);
  }
}

struct AdamVec {
  __m512 beta1, beta2, omb1, omb2, eps, bc2, grad_scale, step_size, decay, l2;
};

/// adam_element() on 16 lanes; returns the new weights.
template <bool kL2>
__m512 adam16(const AdamVec& c, float* p, const float* grad, float* m, float* v) {
  __m512 gr = _mm512_mul_ps(_mm512_loadu_ps(grad), c.grad_scale);
  __m512 pv = _mm512_loadu_ps(p);
  if constexpr (kL2) gr = _mm512_add_ps(gr, _mm512_mul_ps(c.l2, pv));
  pv = _mm512_mul_ps(pv, c.decay);
  const __m512 mv = _mm512_add_ps(_mm512_mul_ps(c.beta1, _mm512_loadu_ps(m)),
                                  _mm512_mul_ps(c.omb1, gr));
  const __m512 vv = _mm512_add_ps(_mm512_mul_ps(c.beta2, _mm512_loadu_ps(v)),
                                  _mm512_mul_ps(c.omb2, _mm512_mul_ps(gr, gr)));
  const __m512 denom = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(vv), c.bc2), c.eps);
  pv = _mm512_sub_ps(pv, _mm512_mul_ps(c.step_size, _mm512_div_ps(mv, denom)));
  _mm512_storeu_ps(m, mv);
  _mm512_storeu_ps(v, vv);
  _mm512_storeu_ps(p, pv);
  return pv;
}

template <bool kL2>
std::size_t adam_body(const AdamVec& c, float* p, const float* grad, float* m, float* v,
                      bf16* out_bf16, float* out_f32, std::size_t n, bool stream16,
                      bool stream32) {
  std::size_t i = 0;
  for (; i + kW <= n; i += kW) {
    const __m512 pv = adam16<kL2>(c, p + i, grad + i, m + i, v + i);
    if (out_bf16) store_bf16x16(out_bf16 + i, pack_bf16(pv), stream16);
    if (out_f32) store_f32x16(out_f32 + i, pv, stream32);
  }
  return i;
}

void adam(const StepScalars& s, const SegmentScalars& g, float* p, const float* grad, float* m,
          float* v, bf16* out_bf16, float* out_f32, std::size_t n, bool stream) {
  std::size_t head = 0;
  bool stream16 = false, stream32 = false;
  if (stream && out_bf16) {
    head = head_to_align(out_bf16, n, 32);
    stream16 = true;
  } else if (stream && out_f32) {
    head = head_to_align(out_f32, n, 64);
    stream32 = true;
  }
  portable::adam(s, g, p, grad, m, v, out_bf16, out_f32, head, false);
  const AdamVec c{_mm512_set1_ps(s.beta1),       _mm512_set1_ps(s.beta2),
                  _mm512_set1_ps(s.one_minus_beta1), _mm512_set1_ps(s.one_minus_beta2),
                  _mm512_set1_ps(s.eps),         _mm512_set1_ps(s.bias_correction2_sqrt),
                  _mm512_set1_ps(s.grad_scale),  _mm512_set1_ps(g.step_size),
                  _mm512_set1_ps(g.decay_factor), _mm512_set1_ps(g.l2_decay)};
  bf16* o16 = out_bf16 ? out_bf16 + head : nullptr;
  float* o32 = out_f32 ? out_f32 + head : nullptr;
  const std::size_t rest = n - head;
  const std::size_t done =
      s.mode == AdamMode::AdamL2
          ? adam_body<true>(c, p + head, grad + head, m + head, v + head, o16, o32, rest,
                            stream16, stream32)
          : adam_body<false>(c, p + head, grad + head, m + head, v + head, o16, o32, rest,
                             stream16, stream32);
  const std::size_t t = head + done;
  portable::adam(s, g, p + t, grad + t, m + t, v + t, out_bf16 ? out_bf16 + t : nullptr,
                 out_f32 ? out_f32 + t : nullptr, n - t, false);
  if (stream) _mm_sfence();
}

void cast_f32_to_bf16(const float* src, bf16* dst, std::size_t n, bool stream) {
  const std::size_t head = stream ? head_to_align(dst, n, 32) : 0;
  portable::cast_f32_to_bf16(src, dst, head, false);
  std::size_t i = head;
  for (; i + kW <= n; i += kW) store_bf16x16(dst + i, pack_bf16(_mm512_loadu_ps(src + i)), stream);
  portable::cast_f32_to_bf16(src + i, dst + i, n - i, false);
  if (stream) _mm_sfence();
}

void cast_bf16_to_f32(const bf16* src, float* dst, std::size_t n, bool stream) {
  const std::size_t head = stream ? head_to_align(dst, n, 64) : 0;
  portable::cast_bf16_to_f32(src, dst, head, false);
  std::size_t i = head;
  for (; i + kW <= n; i += kW)
    store_f32x16(dst + i,
                 widen_bf16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i))),
                 stream);
  portable::cast_bf16_to_f32(src + i, dst + i, n - i, false);
  if (stream) _mm_sfence();
}

void accumulate_f32(float* dst, const float* src, std::size_t n) {
  std::size_t i = 0;
  for (; i + kW <= n; i += kW)
    _mm512_storeu_ps(dst + i, _mm512_add_ps(_mm512_loadu_ps(dst + i), _mm512_loadu_ps(src + i)));
  portable::accumulate_f32(dst + i, src + i, n - i);
}

void accumulate_bf16(float* dst, const bf16* src, std::size_t n) {
  std::size_t i = 0;
  for (; i + kW <= n; i += kW) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
    _mm512_storeu_ps(dst + i, _mm512_add_ps(_mm512_loadu_ps(dst + i), widen_bf16(h)));
  }
  portable::accumulate_bf16(dst + i, src + i, n - i);
}

double sum_squares_block(const float* x, std::size_t n) {
  // Two accumulators of 8 doubles are lanes 0-7 and 8-15 of the documented order.
  __m512d acc0 = _mm512_setzero_pd(), acc1 = _mm512_setzero_pd();
  std::size_t i = 0;
  for (; i + kW <= n; i += kW) {
    const __m512 a = _mm512_loadu_ps(x + i);
    const __m512d d0 = _mm512_cvtps_pd(_mm512_castps512_ps256(a));
    const __m512d d1 = _mm512_cvtps_pd(
        _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
    acc0 = _mm512_add_pd(acc0, _mm512_mul_pd(d0, d0));
    acc1 = _mm512_add_pd(acc1, _mm512_mul_pd(d1, d1));
  }
  alignas(64) double lanes[kSumLanes];
  _mm512_store_pd(lanes, acc0);
  _mm512_store_pd(lanes + 8, acc1);
  return portable::finish_sum_lanes(lanes, x + i, n - i);
}

// kSumGroup full blocks side by side: block g's lanes 0-7 and 8-15 in acc[2g] and acc[2g + 1],
// the same additions in the same order as sum_squares_block, 2 x kSumGroup independent chains.
void sum_squares_group(const float* x, double* out) {
  __m512d acc[2 * kSumGroup];
  for (__m512d& a : acc) a = _mm512_setzero_pd();
  for (std::size_t i = 0; i < kSumBlock; i += kW) {
    for (std::size_t g = 0; g < kSumGroup; ++g) {
      const float* p = x + g * kSumBlock + i;
      const __m512d d0 = _mm512_cvtps_pd(_mm256_loadu_ps(p));
      const __m512d d1 = _mm512_cvtps_pd(_mm256_loadu_ps(p + kW / 2));
      acc[2 * g] = _mm512_add_pd(acc[2 * g], _mm512_mul_pd(d0, d0));
      acc[2 * g + 1] = _mm512_add_pd(acc[2 * g + 1], _mm512_mul_pd(d1, d1));
    }
  }
  for (std::size_t g = 0; g < kSumGroup; ++g) {
    alignas(64) double lanes[kSumLanes];
    _mm512_store_pd(lanes, acc[2 * g]);
    _mm512_store_pd(lanes + 8, acc[2 * g + 1]);
    out[g] = portable::finish_sum_lanes(lanes, nullptr, 0);
  }
}

void sum_squares_blocks(const float* x, std::size_t blocks, double* out) {
  std::size_t b = 0;
  for (; b + kSumGroup <= blocks; b += kSumGroup) sum_squares_group(x + b * kSumBlock, out + b);
  for (; b < blocks; ++b) out[b] = sum_squares_block(x + b * kSumBlock, kSumBlock);
}

bool any_nonfinite(const float* x, std::size_t n) {
  const __m512i exp_mask = _mm512_set1_epi32(0x7F800000);
  __mmask16 bad = 0;
  std::size_t i = 0;
  for (; i + kW <= n; i += kW) {
    const __m512i a = _mm512_loadu_si512(x + i);
    bad = static_cast<__mmask16>(bad | _mm512_cmpeq_epi32_mask(_mm512_and_si512(a, exp_mask),
                                                               exp_mask));
  }
  return bad != 0 || portable::any_nonfinite(x + i, n - i);
}

void scale(float* x, std::size_t n, float factor) {
  const __m512 f = _mm512_set1_ps(factor);
  std::size_t i = 0;
  for (; i + kW <= n; i += kW) _mm512_storeu_ps(x + i, _mm512_mul_ps(_mm512_loadu_ps(x + i), f));
  portable::scale(x + i, n - i, factor);
}

void fill_zero(float* x, std::size_t n, bool stream) {
  if (!stream) return portable::fill_zero(x, n, false);
  const std::size_t head = head_to_align(x, n, 64);
  portable::fill_zero(x, head, false);
  const __m512 z = _mm512_setzero_ps();
  std::size_t i = head;
  for (; i + kW <= n; i += kW) _mm512_stream_ps(x + i, z);
  portable::fill_zero(x + i, n - i, false);
  _mm_sfence();
}

}  // namespace
}  // namespace shardopt::cpu::avx512

namespace shardopt::cpu {

const RangeKernels kAvx512Kernels = {
    "avx512",
    avx512::adam,
    avx512::cast_f32_to_bf16,
    avx512::cast_bf16_to_f32,
    avx512::accumulate_f32,
    avx512::accumulate_bf16,
    avx512::sum_squares_block,
    avx512::sum_squares_blocks,
    avx512::any_nonfinite,
    avx512::scale,
    avx512::fill_zero,
};

}  // namespace shardopt::cpu
