// kernels_avx512.cpp: AVX-512F range kernels (compiled with -mavx512f -ffp-contract=off).
//
// Standard-library templates are not used here (they could be linked as AVX-512 code for the
// whole program). Same structure and the same arithmetic as kernels_avx2.cpp, 16 floats per vector: each
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

/// lion_element() on 16 lanes; returns the new weights.
__m512 lion16(const LionScalars& s, float* p, const float* grad, float* m) {
  const __m512 g = _mm512_mul_ps(_mm512_loadu_ps(grad), _mm512_set1_ps(s.grad_scale));
  const __m512 mv = _mm512_loadu_ps(m);
  __m512 pv = _mm512_mul_ps(_mm512_loadu_ps(p), _mm512_set1_ps(s.decay_factor));
  const __m512 c = _mm512_add_ps(_mm512_mul_ps(_mm512_set1_ps(s.beta1), mv),
                                 _mm512_mul_ps(_mm512_set1_ps(s.one_minus_beta1), g));
  const __m512 zero = _mm512_setzero_ps();
  const __mmask16 pos = _mm512_cmp_ps_mask(c, zero, _CMP_GT_OQ);
  const __mmask16 neg = _mm512_cmp_ps_mask(c, zero, _CMP_LT_OQ);
  const __m512 sign = _mm512_mask_blend_ps(
      pos, _mm512_mask_blend_ps(neg, zero, _mm512_set1_ps(-1.0f)), _mm512_set1_ps(1.0f));
  pv = _mm512_sub_ps(pv, _mm512_mul_ps(_mm512_set1_ps(s.lr), sign));
  _mm512_storeu_ps(m, _mm512_add_ps(_mm512_mul_ps(_mm512_set1_ps(s.beta2), mv),
                                    _mm512_mul_ps(_mm512_set1_ps(s.one_minus_beta2), g)));
  _mm512_storeu_ps(p, pv);
  return pv;
}

void lion(const LionScalars& s, float* p, const float* grad, float* m, bf16* out_bf16,
          float* out_f32, std::size_t n) {
  std::size_t i = 0;
  for (; i + kW <= n; i += kW) {
    const __m512 pv = lion16(s, p + i, grad + i, m + i);
    if (out_bf16) store_bf16x16(out_bf16 + i, pack_bf16(pv), false);
    if (out_f32) store_f32x16(out_f32 + i, pv, false);
  }
  portable::lion(s, p + i, grad + i, m + i, out_bf16 ? out_bf16 + i : nullptr,
                 out_f32 ? out_f32 + i : nullptr, n - i);
}

/// adam_element() on 16 lanes of registers: m and v in, the new m and v out; the new weights
/// stored and returned (adam16's arithmetic).
template <bool kL2>
__m512 adam16_regs(const AdamVec& c, float* p, const float* grad, __m512& mv, __m512& vv) {
  __m512 gr = _mm512_mul_ps(_mm512_loadu_ps(grad), c.grad_scale);
  __m512 pv = _mm512_loadu_ps(p);
  if constexpr (kL2) gr = _mm512_add_ps(gr, _mm512_mul_ps(c.l2, pv));
  pv = _mm512_mul_ps(pv, c.decay);
  mv = _mm512_add_ps(_mm512_mul_ps(c.beta1, mv), _mm512_mul_ps(c.omb1, gr));
  vv = _mm512_add_ps(_mm512_mul_ps(c.beta2, vv), _mm512_mul_ps(c.omb2, _mm512_mul_ps(gr, gr)));
  const __m512 denom = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(vv), c.bc2), c.eps);
  pv = _mm512_sub_ps(pv, _mm512_mul_ps(c.step_size, _mm512_div_ps(mv, denom)));
  _mm512_storeu_ps(p, pv);
  return pv;
}

/// Q8Map::entry minus kQ8Low entries: indexed by the bucket bits(|y|) >> 16 itself (an
/// address for the gathers; only indices >= kQ8Low are used).
const void* entry_base(const Q8Map& q) {
  return reinterpret_cast<const void*>(reinterpret_cast<std::uintptr_t>(q.entry) -
                                       kQ8Low * sizeof(std::uint32_t));
}

/// The codes of 16 floats (in the low byte of each lane, higher bits not cleared) through the
/// SIMD entries (simd_entries() in src/rules/qmap.hpp): one gather of the bucket's entry,
/// one comparison of y's key with the bucket's threshold. The bucket of |y| below the table
/// (|y| < 2^-23) is raised to its first bucket, which holds no threshold; the table goes on to
/// the last bucket of any float, where |y| > 1, infinities and NaN have the code of +-1 whatever
/// the key, as quantize() gives them (a NaN's code follows its sign bit there too). kNonNeg: a map without
/// negative thresholds (exp_avg_sq's): every y with the sign bit set then has code 0, the
/// first bucket's base, so the sign needs no handling (y as a signed integer clamps there).
template <bool kNonNeg>
__m512i quantize16(__m512 y, const void* base) {
  const __m512i bits = _mm512_castps_si512(y);
  const __m512i low = _mm512_set1_epi32(static_cast<int>(kQ8Low));
  // key << 16: y's low 16 bits on top, complemented for negative y (larger magnitudes first).
  __m512i key = _mm512_slli_epi32(bits, 16);
  __m512i idx;
  if constexpr (kNonNeg) {
    idx = _mm512_max_epi32(_mm512_srai_epi32(bits, 16), low);
  } else {
    idx = _mm512_srli_epi32(_mm512_and_si512(bits, _mm512_set1_epi32(0x7FFFFFFF)), 16);
    idx = _mm512_max_epu32(idx, low);
    const __mmask16 neg = _mm512_cmplt_epi32_mask(bits, _mm512_setzero_si512());
    idx = _mm512_mask_add_epi32(idx, neg, idx, _mm512_set1_epi32(static_cast<int>(kQ8Buckets)));
    key = _mm512_mask_xor_epi32(key, neg, key, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u)));
  }
  const __m512i e = _mm512_i32gather_epi32(idx, base, 4);
  // key > lim - 1: key << 16 > e (base < 2^16 below it). base + 1 <= 255 where a threshold
  // lies inside: no carry out of the low byte.
  const __mmask16 up = _mm512_cmpgt_epu32_mask(key, e);
  return _mm512_mask_add_epi32(e, up, e, _mm512_set1_epi32(1));
}

template <bool kNonNeg>
void q8_quantize_run(const float* y, std::size_t n, const Q8Map& q, std::uint8_t* code) {
  std::size_t i = 0;
  for (; i + kW <= n; i += kW)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(code + i),
                     _mm512_cvtepi32_epi8(quantize16<kNonNeg>(_mm512_loadu_ps(y + i), entry_base(q))));
  if (i < n) {
    alignas(64) float t[kW] = {};
    alignas(16) std::uint8_t c[kW];
    for (std::size_t k = i; k < n; ++k) t[k - i] = y[k];
    _mm_store_si128(reinterpret_cast<__m128i*>(c),
                    _mm512_cvtepi32_epi8(quantize16<kNonNeg>(_mm512_load_ps(t), entry_base(q))));
    for (std::size_t k = i; k < n; ++k) code[k] = c[k - i];
  }
}

void q8_quantize(const float* y, std::size_t n, const Q8Map& q, bool nonneg, std::uint8_t* code) {
  if (nonneg) q8_quantize_run<true>(y, n, q, code);
  else q8_quantize_run<false>(y, n, q, code);
}

constexpr std::size_t kQBlock = 256;  // rules::q8::kBlock

__m512 dequantize16(const std::uint8_t* code, const float* value, __m512 scale) {
  const __m512i c = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(code)));
  return _mm512_mul_ps(_mm512_i32gather_ps(c, value, 4), scale);
}

/// The codes of 16 of a block's m and v (16 lanes each) under its new scales.
void requantize16(const float* m, const float* v, __m512 scale_m, __m512 scale_v,
                  std::uint8_t* code_m, std::uint8_t* code_v, const void* qs, const void* qu) {
  const __m512i cm = quantize16<false>(_mm512_div_ps(_mm512_load_ps(m), scale_m), qs);
  const __m512i cv = quantize16<true>(_mm512_div_ps(_mm512_load_ps(v), scale_v), qu);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(code_m), _mm512_cvtepi32_epi8(cm));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(code_v), _mm512_cvtepi32_epi8(cv));
}

/// AdamW8bit blocks, software-pipelined: block b's update (dequantize, adam16_regs(): the fp32
/// AdamW arithmetic, the replica, the new scales) runs in the same loop as block b - 1's
/// requantization, so the divider (the update's square root and divisions) and the gathers
/// (the requantization's) work at the same time: 20 ns per 16 elements in L2 on the Xeon of
/// docs/performance.md, against 32 ns for each block's two loops one after the other. Each
/// block's arithmetic is the portable block's, operation for operation; max is exact and
/// order-free on finite values.
template <bool kL2>
void adamw8bit_run(const AdamVec& c, float* p, const float* grad, std::uint8_t* code_m,
                   std::uint8_t* code_v, float* scale_m, float* scale_v, bf16* out_bf16,
                   float* out_f32, std::size_t blocks, const Q8Map& qs, const Q8Map& qu) {
  alignas(64) float mbuf[2][kQBlock];  // the updated m and v of blocks b (b % 2) and b - 1
  alignas(64) float vbuf[2][kQBlock];
  const Q8Map ks = qs, ku = qu;  // local copies: the stores below cannot alias them
  const void* es = entry_base(qs);
  const void* eu = entry_base(qu);
  const __m512i abs_mask = _mm512_set1_epi32(0x7FFFFFFF);
  const float floor = 1e-12f;
  __m512 prev_sm = _mm512_setzero_ps(), prev_sv = _mm512_setzero_ps();
  for (std::size_t b = 0; b <= blocks; ++b) {
    float* m = mbuf[b % 2];
    float* v = vbuf[b % 2];
    const float* pm = mbuf[(b + 1) % 2];
    const float* pv = vbuf[(b + 1) % 2];
    if (b == blocks) {  // the last block's requantization alone
      const std::size_t last = (b - 1) * kQBlock;
      for (std::size_t i = 0; i < kQBlock; i += kW)
        requantize16(pm + i, pv + i, prev_sm, prev_sv, code_m + last + i, code_v + last + i, es, eu);
      break;
    }
    const std::size_t at = b * kQBlock;
    const __m512 sm = _mm512_set1_ps(scale_m[b]), sv = _mm512_set1_ps(scale_v[b]);
    __m512 max_m = _mm512_setzero_ps(), max_v = _mm512_setzero_ps();
    for (std::size_t i = 0; i < kQBlock; i += kW) {
      __m512 mv = dequantize16(code_m + at + i, ks.value, sm);
      __m512 vv = dequantize16(code_v + at + i, ku.value, sv);
      const __m512 pw = adam16_regs<kL2>(c, p + at + i, grad + at + i, mv, vv);
      if (out_bf16) store_bf16x16(out_bf16 + at + i, pack_bf16(pw), false);
      if (out_f32) store_f32x16(out_f32 + at + i, pw, false);
      _mm512_store_ps(m + i, mv);
      _mm512_store_ps(v + i, vv);
      // max(x, acc) returns acc where x is NaN: std::max(acc, x), as the portable loop.
      max_m = _mm512_max_ps(_mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(mv), abs_mask)), max_m);
      max_v = _mm512_max_ps(vv, max_v);
      if (b > 0) {
        const std::size_t prev = at - kQBlock;
        requantize16(pm + i, pv + i, prev_sm, prev_sv, code_m + prev + i, code_v + prev + i, es, eu);
      }
    }
    const float am = _mm512_reduce_max_ps(max_m), av = _mm512_reduce_max_ps(max_v);
    scale_m[b] = am > floor ? am : floor;
    scale_v[b] = av > floor ? av : floor;
    prev_sm = _mm512_set1_ps(scale_m[b]);
    prev_sv = _mm512_set1_ps(scale_v[b]);
  }
}

void adamw8bit_blocks(const StepScalars& s, const SegmentScalars& g, float* p, const float* grad,
                      std::uint8_t* code_m, std::uint8_t* code_v, float* scale_m, float* scale_v,
                      bf16* out_bf16, float* out_f32, std::size_t blocks, const Q8Map& qs,
                      const Q8Map& qu) {
  const AdamVec c{_mm512_set1_ps(s.beta1),       _mm512_set1_ps(s.beta2),
                  _mm512_set1_ps(s.one_minus_beta1), _mm512_set1_ps(s.one_minus_beta2),
                  _mm512_set1_ps(s.eps),         _mm512_set1_ps(s.bias_correction2_sqrt),
                  _mm512_set1_ps(s.grad_scale),  _mm512_set1_ps(g.step_size),
                  _mm512_set1_ps(g.decay_factor), _mm512_set1_ps(g.l2_decay)};
  if (s.mode == AdamMode::AdamL2)
    adamw8bit_run<true>(c, p, grad, code_m, code_v, scale_m, scale_v, out_bf16, out_f32, blocks, qs, qu);
  else
    adamw8bit_run<false>(c, p, grad, code_m, code_v, scale_m, scale_v, out_bf16, out_f32, blocks, qs, qu);
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


// ---- reproducible mode's exact arithmetic (exact_kernels.cpp has the reference) ------------

// exact_combine, 16 elements at a time. The grid exponent g comes from the largest
// exponent field e by a table: (e + 24) / 24 = ((e >> 3) + 3) / 3, so g = 24 L - 174 is a
// function of e >> 3 (32 entries, one vpermt2ps). Each value is scaled by 2^-g with vscalefps
// (exact: the result is below 2^47, and one small enough to be rounded as a subnormal is
// below half a unit either way) and rounded to an integer in fp32 (exact); the integers sum
// exactly in doubles (up to 64 of them). The sum is rounded once to fp32 and scaled by 2^g
// with vscalefps: in the normal range scaling commutes with rounding, and a result in the
// subnormal range comes from level 1 (g = -150), whose values are multiples of 2^-149 and
// whose sum is then exact in fp32 before the scaling.
struct GridTables {
  __m512 minus_g_lo, minus_g_hi, g_lo, g_hi;  // -g and g as floats for e >> 3 = 0..31
};

GridTables grid_tables() {
  alignas(64) float minus_g[32], g[32];
  for (int j = 0; j < 32; ++j) {
    const int level = (j + 3) / 3;
    g[j] = static_cast<float>(24 * level - 174);
    minus_g[j] = -g[j];
  }
  return {_mm512_load_ps(minus_g), _mm512_load_ps(minus_g + 16), _mm512_load_ps(g), _mm512_load_ps(g + 16)};
}

void exact_combine(const float* const* src, int ranks, float* dst, std::size_t n) {
  if (ranks > kExactCombineMaxSimdRanks) return portable::exact_combine(src, ranks, dst, n);
  const GridTables t = grid_tables();
  const __m512i abs_mask = _mm512_set1_epi32(0x7fffffff);
  const __m512i inf_bits = _mm512_set1_epi32(0x7f800000);
  std::size_t i = 0;
  for (; i + kW <= n; i += kW) {
    // The largest magnitude's bits: its exponent field is the largest (NaN/Inf above all).
    __m512i big = _mm512_setzero_si512();
    for (int r = 0; r < ranks; ++r) {
      SHARDOPT_PREFETCH_AHEAD(src[r] + i, kExactPrefetchElems * sizeof(float));
      big = _mm512_max_epu32(big, _mm512_and_si512(_mm512_loadu_si512(src[r] + i), abs_mask));
    }
    const __mmask16 nonfinite = _mm512_cmpge_epu32_mask(big, inf_bits);
    const __m512i idx = _mm512_srli_epi32(big, 26);  // e >> 3
    const __m512 minus_g = _mm512_permutex2var_ps(t.minus_g_lo, idx, t.minus_g_hi);
    const __m512 g = _mm512_permutex2var_ps(t.g_lo, idx, t.g_hi);
    __m512d sum_lo = _mm512_setzero_pd(), sum_hi = _mm512_setzero_pd();
    for (int r = 0; r < ranks; ++r) {
      const __m512 x = _mm512_roundscale_ps(_mm512_scalef_ps(_mm512_loadu_ps(src[r] + i), minus_g),
                                            _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      sum_lo = _mm512_add_pd(sum_lo, _mm512_cvtps_pd(_mm512_castps512_ps256(x)));
      sum_hi = _mm512_add_pd(sum_hi, _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1))));
    }
    const __m512 rounded = _mm512_castpd_ps(_mm512_insertf64x4(
        _mm512_castpd256_pd512(_mm256_castps_pd(_mm512_cvtpd_ps(sum_lo))),
        _mm256_castps_pd(_mm512_cvtpd_ps(sum_hi)), 1));
    // The stores come after every load of this vector: dst may be one of the sources.
    _mm512_storeu_ps(dst + i, _mm512_mask_blend_ps(nonfinite, _mm512_scalef_ps(rounded, g),
                                                   _mm512_castsi512_ps(_mm512_set1_epi32(0x7fc00000))));
  }
  portable::exact_combine_tail(src, ranks, dst, i, n);
}

// exact_to_float (kernels.hpp) on 8 int64 lanes, operation for operation, without
// AVX-512DQ: below 2^50 in magnitude n converts to a double exactly (the 1.5 * 2^52 bit
// trick); above (unsigned |n|: INT64_MIN too), it is first rounded to odd at 2^13 (floor plus
// a sticky bit), which keeps the final rounding to 24 bits correct. The scaling by 2^e is
// exact in double, and the conversion to fp32 rounds once (subnormals included, Inf past the
// range). exact_to_float8_scaled takes 2^e as doubles (scale; 2^13 times it above 2^50,
// exact), exact_to_float8 the exponent e.
__m256 exact_to_float8_scaled(__m512i n, __m512d scale) {
  const __m512d magic = _mm512_set1_pd(0x1.8p52);
  const __mmask8 wide = _mm512_cmpge_epu64_mask(_mm512_abs_epi64(n), _mm512_set1_epi64(std::int64_t{1} << 50));
  __m512i t = n;
  if (wide != 0) {
    const __m512i sticky = _mm512_maskz_mov_epi64(_mm512_test_epi64_mask(n, _mm512_set1_epi64(0x1fff)),
                                                  _mm512_set1_epi64(1));
    t = _mm512_mask_or_epi64(n, wide, _mm512_srai_epi64(n, 13), sticky);
    scale = _mm512_mask_mul_pd(scale, wide, scale, _mm512_set1_pd(0x1p13));  // exact
  }
  const __m512d exact = _mm512_sub_pd(_mm512_castsi512_pd(_mm512_add_epi64(t, _mm512_castpd_si512(magic))), magic);
  return _mm512_cvtpd_ps(_mm512_mul_pd(exact, scale));
}

__m256 exact_to_float8(__m512i n, __m512i e) {
  return exact_to_float8_scaled(
      n, _mm512_castsi512_pd(_mm512_slli_epi64(_mm512_add_epi64(e, _mm512_set1_epi64(1023)), 52)));
}

/// 8 levels (bytes) as int64 lanes.
__m512i load_levels8(const std::uint8_t* level) {
  return _mm512_cvtepu8_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(level)));
}

/// 24 l - 174: the exponent of level l's low grid, b(l - 1).
__m512i grid_exponent8(__m512i l) {
  return _mm512_sub_epi64(_mm512_add_epi64(_mm512_slli_epi64(l, 4), _mm512_slli_epi64(l, 3)),
                          _mm512_set1_epi64(174));
}

/// sum plus the words w lifted to levels g (exact::elem::packed_lifted on 8 int64 lanes):
/// top * 2^24 + low where w's level is g, top where it is g - 1, nothing below.
__m512i add_lifted8(__m512i sum, __m512i w, __m512i g, __m512i g_minus_1) {
  const __m512i l = _mm512_and_si512(w, _mm512_set1_epi64(15));
  const __m512i top = _mm512_srai_epi64(_mm512_slli_epi64(w, 30), 34);
  const __m512i low = _mm512_srai_epi64(w, 34);
  sum = _mm512_mask_add_epi64(sum, _mm512_cmpeq_epi64_mask(l, g), sum,
                              _mm512_add_epi64(_mm512_slli_epi64(top, 24), low));
  return _mm512_mask_add_epi64(sum, _mm512_cmpeq_epi64_mask(l, g_minus_1), sum, top);
}

// exact_combine_packed, 8 elements (64-bit words) at a time: the int64 sum goes to fp32 by
// exact_to_float8.
void exact_combine_packed(const std::uint64_t* const* src, int ranks, float* dst, std::size_t n) {
  if (ranks > kExactCombineMaxSimdRanks) return portable::exact_combine_packed(src, ranks, dst, n);
  const __m512i fifteen = _mm512_set1_epi64(15);
  const __m512i one = _mm512_set1_epi64(1);
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m512i g = _mm512_setzero_si512();
    for (int r = 0; r < ranks; ++r) {
      SHARDOPT_PREFETCH_AHEAD(src[r] + i, kExactPrefetchElems * sizeof(std::uint64_t));
      g = _mm512_max_epu64(g, _mm512_and_si512(_mm512_loadu_si512(src[r] + i), fifteen));
    }
    const __mmask8 nonfinite = _mm512_cmpeq_epi64_mask(g, fifteen);
    const __m512i g_minus_1 = _mm512_sub_epi64(g, one);
    __m512i sum = _mm512_setzero_si512();
    for (int r = 0; r < ranks; ++r) sum = add_lifted8(sum, _mm512_loadu_si512(src[r] + i), g, g_minus_1);
    const __m256 f = exact_to_float8(sum, grid_exponent8(g));  // the grid of level g - 1
    const __m256 nan = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fc00000));
    _mm256_storeu_ps(dst + i, _mm512_castps512_ps256(_mm512_mask_blend_ps(
                                  static_cast<__mmask16>(nonfinite), _mm512_castps256_ps512(f),
                                  _mm512_castps256_ps512(nan))));
  }
  portable::exact_combine_packed_tail(src, ranks, dst, i, n);
}

// exact_combine_packed_raw, 16 elements at a time. The final level G of each element is the
// largest of the words' levels and of the last values' levels, and the latter is the level of
// the largest magnitude among them (levels grow with the exponent field e): (e + 24) / 24 =
// ((e >> 3) + 3) / 3 by a 32-entry table, as exact_combine's grid. The levels are maxed in
// 32-bit lanes (each word's low dword, gathered from two vectors of 8 words), and G's grid
// b(G - 1) = 24 G - 174 (as -b for vscalefps, as 2^b for the final scaling) comes from 16-entry
// tables indexed by G. The words are lifted as in exact_combine_packed (int64 lanes, two
// halves); the last values are scaled to G's low grid with vscalefps and rounded to integers
// in fp32 (exact: below 2^47; one scaled into fp32's subnormal range is below half a unit
// either way), summed exactly in doubles per group of up to 16 ranks (below 2^51) and each
// group's sum added to the int64 lanes by the 1.5 * 2^52 bit trick. Non-finite lanes end as
// the quiet NaN whatever their sums.
void exact_combine_packed_raw(const std::uint64_t* const* words, const float* const* last, int ranks,
                              float* dst, std::size_t n) {
  if (ranks > kExactCombineMaxSimdRanks) return portable::exact_combine_packed_raw(words, last, ranks, dst, n);
  alignas(64) std::int32_t level_table[32];
  for (int j = 0; j < 32; ++j) level_table[j] = (j + 3) / 3;
  alignas(64) float minus_grid_table[16];
  alignas(64) std::uint64_t grid_table[16];  // the bits of 2^(24 l - 174)
  for (int l = 0; l < 16; ++l) {
    minus_grid_table[l] = static_cast<float>(174 - 24 * l);
    grid_table[l] = static_cast<std::uint64_t>(1023 + 24 * l - 174) << 52;
  }
  const __m512i levels_lo = _mm512_load_si512(level_table), levels_hi = _mm512_load_si512(level_table + 16);
  const __m512 minus_grid_by_level = _mm512_load_ps(minus_grid_table);
  const __m512d grid_lo = _mm512_castsi512_pd(_mm512_load_si512(grid_table));
  const __m512d grid_hi = _mm512_castsi512_pd(_mm512_load_si512(grid_table + 8));
  const __m512i low_dwords = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i fifteen32 = _mm512_set1_epi32(15);
  const __m512i one = _mm512_set1_epi64(1);
  const __m512i abs_mask = _mm512_set1_epi32(0x7fffffff);
  const __m512i inf_bits = _mm512_set1_epi32(0x7f800000);
  const __m512d magic = _mm512_set1_pd(0x1.8p52);
  const __m512i magic_bits = _mm512_castpd_si512(magic);
  constexpr int kGroup = 16;  // ranks per double sum: 16 values below 2^47 stay below 2^51
  std::size_t i = 0;
  for (; i + kW <= n; i += kW) {
    __m512i big = _mm512_setzero_si512();
    __m512i g32 = _mm512_setzero_si512();
    for (int r = 0; r < ranks; ++r) {
      SHARDOPT_PREFETCH_AHEAD(last[r] + i, kExactPrefetchElems * sizeof(float));
      SHARDOPT_PREFETCH_AHEAD(words[r] + i, kExactPrefetchElems * sizeof(std::uint64_t));
      SHARDOPT_PREFETCH_AHEAD(words[r] + i + 8, kExactPrefetchElems * sizeof(std::uint64_t));
      big = _mm512_max_epu32(big, _mm512_and_si512(_mm512_loadu_si512(last[r] + i), abs_mask));
      const __m512i lw = _mm512_permutex2var_epi32(_mm512_loadu_si512(words[r] + i), low_dwords,
                                                   _mm512_loadu_si512(words[r] + i + 8));
      g32 = _mm512_max_epu32(g32, _mm512_and_si512(lw, fifteen32));
    }
    __m512i lv = _mm512_permutex2var_epi32(levels_lo, _mm512_srli_epi32(big, 26), levels_hi);
    lv = _mm512_maskz_mov_epi32(_mm512_test_epi32_mask(big, big), lv);                 // zero: 0
    lv = _mm512_mask_mov_epi32(lv, _mm512_cmpge_epu32_mask(big, inf_bits), fifteen32);  // NaN, Inf
    g32 = _mm512_max_epu32(g32, lv);
    const __mmask16 nonfinite = _mm512_cmpeq_epi32_mask(g32, fifteen32);
    const __m512 minus_grid = _mm512_permutexvar_ps(g32, minus_grid_by_level);
    const __m512i g_lo = _mm512_cvtepu32_epi64(_mm512_castsi512_si256(g32));
    const __m512i g_hi = _mm512_cvtepu32_epi64(_mm512_extracti64x4_epi64(g32, 1));
    __m512i sum_lo = _mm512_setzero_si512(), sum_hi = _mm512_setzero_si512();
    const __m512i gm1_lo = _mm512_sub_epi64(g_lo, one), gm1_hi = _mm512_sub_epi64(g_hi, one);
    for (int r0 = 0; r0 < ranks; r0 += kGroup) {
      __m512d raw_lo = _mm512_setzero_pd(), raw_hi = _mm512_setzero_pd();
      for (int r = r0; r < std::min(ranks, r0 + kGroup); ++r) {
        sum_lo = add_lifted8(sum_lo, _mm512_loadu_si512(words[r] + i), g_lo, gm1_lo);
        sum_hi = add_lifted8(sum_hi, _mm512_loadu_si512(words[r] + i + 8), g_hi, gm1_hi);
        const __m512 x = _mm512_roundscale_ps(_mm512_scalef_ps(_mm512_loadu_ps(last[r] + i), minus_grid),
                                              _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        raw_lo = _mm512_add_pd(raw_lo, _mm512_cvtps_pd(_mm512_castps512_ps256(x)));
        raw_hi = _mm512_add_pd(raw_hi, _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1))));
      }
      sum_lo = _mm512_add_epi64(sum_lo, _mm512_sub_epi64(_mm512_castpd_si512(_mm512_add_pd(raw_lo, magic)), magic_bits));
      sum_hi = _mm512_add_epi64(sum_hi, _mm512_sub_epi64(_mm512_castpd_si512(_mm512_add_pd(raw_hi, magic)), magic_bits));
    }
    const __m256 f_lo = exact_to_float8_scaled(sum_lo, _mm512_permutex2var_pd(grid_lo, g_lo, grid_hi));
    const __m256 f_hi = exact_to_float8_scaled(sum_hi, _mm512_permutex2var_pd(grid_lo, g_hi, grid_hi));
    const __m512 f = _mm512_castpd_ps(
        _mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(f_lo)), _mm256_castps_pd(f_hi), 1));
    // The store comes after every load of these 16 elements: dst may be one of last[].
    _mm512_storeu_ps(dst + i, _mm512_mask_blend_ps(nonfinite, f, _mm512_castsi512_ps(_mm512_set1_epi32(0x7fc00000))));
  }
  portable::exact_combine_packed_raw_tail(words, last, ranks, dst, i, n);
}

// exact_deposit, 8 elements at a time, operation for operation the portable loop: the level
// rise by masks, the two parts by exact double arithmetic (scale by 2^-b, round to an integer,
// subtract, scale, round), the integers to int64 by the 1.5 * 2^52 bit trick (|part| <= 2^23).
struct Bins8 {
  __m512i top, low, level;
};

Bins8 deposit8(__m256 v8, Bins8 b) {
  const __m512i zero = _mm512_setzero_si512();
  const __m512i nonfinite_level = _mm512_set1_epi64(127);
  const __m512i ff = _mm512_set1_epi64(0xff);
  const __m512d magic = _mm512_set1_pd(0x1.8p52);
  const __m512i magic_bits = _mm512_castpd_si512(magic);
  constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  const __m512i u = _mm512_cvtepu32_epi64(_mm256_castps_si256(v8));
  const __mmask8 nonzero = _mm512_test_epi64_mask(u, _mm512_set1_epi64(0x7fffffff));
  const __mmask8 active = nonzero & static_cast<__mmask8>(~_mm512_cmpeq_epi64_mask(b.level, nonfinite_level));
  if (active == 0) return b;  // sparse gradients: nothing to add here
  const __m512i e = _mm512_and_si512(_mm512_srli_epi64(u, 23), ff);
  const __mmask8 becomes_nonfinite = active & _mm512_cmpeq_epi64_mask(e, ff);
  const __mmask8 finite = active & static_cast<__mmask8>(~becomes_nonfinite);
  // want = (e + 24) / 24 = ((e + 24) * 2731) >> 16 for e below 300.
  const __m512i want = _mm512_srli_epi64(
      _mm512_mul_epu32(_mm512_add_epi64(e, _mm512_set1_epi64(24)), _mm512_set1_epi64(2731)), 16);
  const __m512i l = b.level;
  const __mmask8 raise = finite & _mm512_cmpgt_epu64_mask(want, l);
  const __mmask8 clear = raise & (_mm512_cmpeq_epi64_mask(l, zero) |
                                  _mm512_cmpge_epu64_mask(_mm512_sub_epi64(want, l), _mm512_set1_epi64(2)));
  const __mmask8 down_one = raise & static_cast<__mmask8>(~clear);
  b.low = _mm512_mask_mov_epi64(b.low, down_one, b.top);
  b.low = _mm512_mask_mov_epi64(b.low, clear, zero);
  b.top = _mm512_mask_mov_epi64(b.top, raise, zero);
  b.level = _mm512_mask_mov_epi64(l, raise, want);
  b.level = _mm512_mask_mov_epi64(b.level, becomes_nonfinite, nonfinite_level);
  // 2^-b, 2^b and 2^(24 - b) for b = 24 L - 150 (meaningless in lanes not finite: unused).
  const __m512i l24 = _mm512_add_epi64(_mm512_slli_epi64(b.level, 4), _mm512_slli_epi64(b.level, 3));
  const __m512d down = _mm512_castsi512_pd(_mm512_slli_epi64(_mm512_sub_epi64(_mm512_set1_epi64(1173), l24), 52));
  const __m512d up = _mm512_castsi512_pd(_mm512_slli_epi64(_mm512_add_epi64(_mm512_set1_epi64(873), l24), 52));
  const __m512d down_low = _mm512_castsi512_pd(_mm512_slli_epi64(_mm512_sub_epi64(_mm512_set1_epi64(1197), l24), 52));
  const __m512d d = _mm512_cvtps_pd(v8);
  const __m512d hi = _mm512_roundscale_pd(_mm512_mul_pd(d, down), kRound);
  const __m512d rest = _mm512_sub_pd(d, _mm512_mul_pd(hi, up));
  const __m512d part = _mm512_roundscale_pd(_mm512_mul_pd(rest, down_low), kRound);
  b.top = _mm512_mask_add_epi64(b.top, finite, b.top,
                                _mm512_sub_epi64(_mm512_castpd_si512(_mm512_add_pd(hi, magic)), magic_bits));
  b.low = _mm512_mask_add_epi64(b.low, finite, b.low,
                                _mm512_sub_epi64(_mm512_castpd_si512(_mm512_add_pd(part, magic)), magic_bits));
  return b;
}

Bins8 load_bins8(const std::int64_t* top, const std::int64_t* low, const std::uint8_t* level) {
  return {_mm512_loadu_si512(top), _mm512_loadu_si512(low),
          _mm512_cvtepu8_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(level)))};
}

void exact_deposit(const float* g, std::size_t n, std::int64_t* top, std::int64_t* low,
                   std::uint8_t* level) {
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v8 = _mm256_loadu_ps(g + i);
    if (_mm256_testz_si256(_mm256_castps_si256(v8), _mm256_set1_epi32(0x7fffffff))) continue;  // all zero
    const Bins8 b = deposit8(v8, load_bins8(top + i, low + i, level + i));
    _mm512_storeu_si512(top + i, b.top);
    _mm512_storeu_si512(low + i, b.low);
    _mm_storel_epi64(reinterpret_cast<__m128i*>(level + i), _mm512_cvtepi64_epi8(b.level));
  }
  portable::exact_deposit(g + i, n - i, top + i, low + i, level + i);
}

// The packed word of 8 elements' bins: empty 0, non-finite 15, else level | top << 4 | low << 34.
__m512i pack8(const Bins8& b) {
  const __m512i word = _mm512_or_si512(
      _mm512_or_si512(b.level, _mm512_slli_epi64(_mm512_and_si512(b.top, _mm512_set1_epi64(0x3fffffff)), 4)),
      _mm512_slli_epi64(b.low, 34));
  const __mmask8 empty = _mm512_cmpeq_epi64_mask(b.level, _mm512_setzero_si512());
  const __mmask8 nonfinite = _mm512_cmpeq_epi64_mask(b.level, _mm512_set1_epi64(127));
  return _mm512_mask_mov_epi64(_mm512_maskz_mov_epi64(static_cast<__mmask8>(~empty), word), nonfinite,
                               _mm512_set1_epi64(15));
}

void exact_deposit_pack(const float* g, std::size_t n, const std::int64_t* top,
                        const std::int64_t* low, const std::uint8_t* level, std::uint64_t* out) {
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm512_storeu_si512(out + i, pack8(deposit8(_mm256_loadu_ps(g + i), load_bins8(top + i, low + i, level + i))));
  portable::exact_deposit_pack(g + i, n - i, top + i, low + i, level + i, out + i);
}

// exact_deposit_packed, 16 values (two vectors of 8 words) at a time, in fp32 and on the
// words' fields in place. The arithmetic is the portable deposit's, rearranged where that is
// exact:
//   - the level wanted by v is a table on its exponent field e >> 3 ((e + 24) / 24 =
//     ((e >> 3) + 3) / 3, as exact_combine's grid); the level L after the deposit is the
//     larger of it and the word's (masks: rise, and on a rise clear or move top to low);
//   - s = v * 2^-b(L) by vscalefps: exact, |s| < 2^23, except where s is below 2^-126 (a
//     subnormal result, rounded), and then both parts are 0 either way; hi = RNE(s)
//     (vrndscaleps), r = s - hi (exact: |r| <= 1/2 and r is a multiple of s's unit, or hi
//     is 0 or +-1 with s in [1/2, 2]), lo = RNE(r * 2^24) (exact product, one conversion):
//     the portable loop's RNE(v / 2^b) and RNE((v - hi 2^b) / 2^(b - 24)), which are exact
//     in double;
//   - hi and lo are added to their 30-bit fields modulo 2^30 (the word keeps only the low 30
//     bits of each bin, and the bins stay within 30 signed bits): hi << 4 is added to the word
//     and only the top field's bits taken from the sum (vpternlogq), lo << 34 is added
//     (carries past bit 63 are the modulo).
// A run of 16 zeros leaves the words as they are (stored only when out is not in).
// exact_deposit_packed_multi: the words stay in registers while every source's 16 values are
// deposited in turn (one load and one store of the words for all of them).
void exact_deposit_packed_multi(const float* const* g, int nsrc, std::size_t n, const std::uint64_t* in,
                                std::uint64_t* out) {
  alignas(64) std::int32_t want_table[32];
  alignas(64) float down_table[16];  // -b(L) for L = 1..11 (0 elsewhere: those lanes add nothing)
  alignas(64) std::int32_t even[16], lo_half[16], hi_half[16];
  for (int j = 0; j < 32; ++j) want_table[j] = (j + 3) / 3;
  for (int l = 0; l < 16; ++l) down_table[l] = l >= 1 && l <= 11 ? static_cast<float>(150 - 24 * l) : 0.0f;
  for (int k = 0; k < 16; ++k) {
    even[k] = 2 * k;                                    // the low dword of each word of (w0, w1)
    lo_half[k] = k % 2 == 0 ? k / 2 : 16 + k / 2;       // (a[0], b[0], a[1], b[1], ...): words 0-7
    hi_half[k] = k % 2 == 0 ? 8 + k / 2 : 24 + k / 2;   // words 8-15
  }
  const __m512i want_lo = _mm512_load_si512(want_table), want_hi = _mm512_load_si512(want_table + 16);
  const __m512 down_t = _mm512_load_ps(down_table);
  const __m512i even_idx = _mm512_load_si512(even);
  const __m512i lo_idx = _mm512_load_si512(lo_half), hi_idx = _mm512_load_si512(hi_half);
  const __m512i abs_mask = _mm512_set1_epi32(0x7fffffff);
  const __m512i inf_bits = _mm512_set1_epi32(0x7f800000);
  const __m512i fifteen32 = _mm512_set1_epi32(15);
  const __m512i one32 = _mm512_set1_epi32(1);
  const __m512i three32 = _mm512_set1_epi32(3);
  const __m512i top_field = _mm512_set1_epi64(std::int64_t{0x3fffffff} << 4);
  const __m512i nonfinite_word = _mm512_set1_epi64(15);
  const __m512 two24 = _mm512_set1_ps(0x1p24f);
  constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  std::size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    if (in != nullptr) {
      SHARDOPT_PREFETCH_AHEAD(in + i, kExactPrefetchElems * sizeof(std::uint64_t));
      SHARDOPT_PREFETCH_AHEAD(in + i + 8, kExactPrefetchElems * sizeof(std::uint64_t));
    }
    __m512i w0 = in == nullptr ? _mm512_setzero_si512() : _mm512_loadu_si512(in + i);
    __m512i w1 = in == nullptr ? _mm512_setzero_si512() : _mm512_loadu_si512(in + i + 8);
    bool empty = in == nullptr;  // every word still empty (all zero)
    bool changed = false;
    for (int src = 0; src < nsrc; ++src) {
      SHARDOPT_PREFETCH_AHEAD(g[src] + i, kExactPrefetchElems * sizeof(float));
      const __m512 v = _mm512_loadu_ps(g[src] + i);
      const __m512i a = _mm512_and_si512(_mm512_castps_si512(v), abs_mask);
      const __mmask16 nonzero = _mm512_test_epi32_mask(a, a);
      if (nonzero == 0) continue;
      changed = true;
      // The words' levels (the low 4 bits of each word's low dword), 16 in one vector.
      const __m512i l = _mm512_and_si512(_mm512_permutex2var_epi32(w0, even_idx, w1), fifteen32);
      const __mmask16 active = nonzero & static_cast<__mmask16>(~_mm512_cmpeq_epi32_mask(l, fifteen32));
      const __mmask16 bad = active & _mm512_cmpge_epu32_mask(a, inf_bits);  // NaN or Inf
      const __mmask16 fin = active & static_cast<__mmask16>(~bad);
      const __m512i want = _mm512_permutex2var_epi32(want_lo, _mm512_srli_epi32(a, 26), want_hi);
      const __mmask16 rise = fin & _mm512_cmpgt_epu32_mask(want, l);
      const __m512i level = _mm512_mask_mov_epi32(l, rise, want);
      if (empty) {
        // From empty (what the general case below does with l = 0): the wanted level where
        // finite (every such lane rises), the non-finite word where bad, else 0.
        w0 = _mm512_mask_mov_epi64(_mm512_maskz_cvtepu32_epi64(static_cast<__mmask8>(fin), _mm512_castsi512_si256(level)),
                                   static_cast<__mmask8>(bad), nonfinite_word);
        w1 = _mm512_mask_mov_epi64(
            _mm512_maskz_cvtepu32_epi64(static_cast<__mmask8>(fin >> 8), _mm512_extracti64x4_epi64(level, 1)),
            static_cast<__mmask8>(bad >> 8), nonfinite_word);
      } else if ((rise | bad) != 0) {  // rare after the first micro-batch
        // A rise by one: the top field becomes the low one (the top and level fields
        // cleared); by more, or from empty: an empty word; then the new level.
        const __mmask16 clear =
            rise & (_mm512_cmpeq_epi32_mask(l, _mm512_setzero_si512()) | _mm512_cmpgt_epu32_mask(want, _mm512_add_epi32(l, one32)));
        const __mmask16 down = rise & static_cast<__mmask16>(~clear);
        for (int h = 0; h < 2; ++h) {
          __m512i& w = h == 0 ? w0 : w1;
          const auto m8 = [h](__mmask16 m) { return static_cast<__mmask8>(m >> (8 * h)); };
          const __m256i half_level = h == 0 ? _mm512_castsi512_si256(level) : _mm512_extracti64x4_epi64(level, 1);
          w = _mm512_mask_mov_epi64(w, m8(down), _mm512_slli_epi64(_mm512_srli_epi64(_mm512_slli_epi64(w, 30), 34), 34));
          w = _mm512_mask_mov_epi64(w, m8(clear), _mm512_setzero_si512());
          w = _mm512_mask_or_epi64(w, m8(rise), w, _mm512_cvtepu32_epi64(half_level));
          w = _mm512_mask_mov_epi64(w, m8(bad), nonfinite_word);
        }
      }
      // The two parts at the level's grids.
      const __m512 sv = _mm512_scalef_ps(v, _mm512_permutexvar_ps(level, down_t));
      const __m512 hi = _mm512_roundscale_ps(sv, kRound);
      const __m512i hi32 = _mm512_cvt_roundps_epi32(hi, kRound);
      const __m512i lo32 = _mm512_cvt_roundps_epi32(_mm512_mul_ps(_mm512_sub_ps(sv, hi), two24), kRound);
      // Each element's parts as a word: hi's low 30 bits at bit 4 (the word's low dword holds
      // hi's bits 0-27, the high dword its bits 28-29), lo's at bit 34.
      const __m512i part_lo = _mm512_slli_epi32(hi32, 4);
      const __m512i part_hi = _mm512_ternarylogic_epi32(_mm512_slli_epi32(lo32, 2), _mm512_srli_epi32(hi32, 28), three32,
                                                        0xf8);  // a | (b & c)
      const __m512i p0 = _mm512_permutex2var_epi32(part_lo, lo_idx, part_hi);
      const __m512i p1 = _mm512_permutex2var_epi32(part_lo, hi_idx, part_hi);
      // Field by field (modulo 2^30 each): the top field from w + p, the low field from w + p
      // without the top field's carry (w + (p without its top field)).
      const __mmask8 f0 = static_cast<__mmask8>(fin), f1 = static_cast<__mmask8>(fin >> 8);
      w0 = _mm512_mask_mov_epi64(w0, f0, _mm512_ternarylogic_epi64(top_field, _mm512_add_epi64(w0, p0),
                                                                   _mm512_add_epi64(w0, _mm512_andnot_si512(top_field, p0)), 0xca));
      w1 = _mm512_mask_mov_epi64(w1, f1, _mm512_ternarylogic_epi64(top_field, _mm512_add_epi64(w1, p1),
                                                                   _mm512_add_epi64(w1, _mm512_andnot_si512(top_field, p1)), 0xca));
      empty = false;
    }
    if (changed || in != out) {
      _mm512_storeu_si512(out + i, w0);
      _mm512_storeu_si512(out + i + 8, w1);
    }
  }
  for (int src = 0; src < nsrc; ++src)
    portable::exact_deposit_packed(g[src] + i, n - i, src == 0 ? (in == nullptr ? nullptr : in + i) : out + i, out + i);
}

void exact_deposit_packed(const float* g, std::size_t n, const std::uint64_t* in, std::uint64_t* out) {
  exact_deposit_packed_multi(&g, 1, n, in, out);
}

// ---- the two-phase method's passes (exact::ExactGrads::reduce) ----

// exact_levels, 16 at a time: (e + 24) / 24 = ((e + 24) * 2731) >> 16 for e below 300 (as
// deposit8), 0 for +-0, 127 for NaN and Inf.
void exact_levels(const float* g, std::size_t n, std::uint8_t* level) {
  const __m512i abs_mask = _mm512_set1_epi32(0x7fffffff);
  const __m512i ff = _mm512_set1_epi32(0xff);
  std::size_t i = 0;
  for (; i + kW <= n; i += kW) {
    const __m512i a = _mm512_and_si512(_mm512_loadu_si512(g + i), abs_mask);
    const __m512i e = _mm512_srli_epi32(a, 23);
    const __m512i want = _mm512_srli_epi32(
        _mm512_mullo_epi32(_mm512_add_epi32(e, _mm512_set1_epi32(24)), _mm512_set1_epi32(2731)), 16);
    __m512i l = _mm512_maskz_mov_epi32(_mm512_test_epi32_mask(a, a), want);
    l = _mm512_mask_mov_epi32(l, _mm512_cmpeq_epi32_mask(e, ff), _mm512_set1_epi32(127));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(level + i), _mm512_cvtepi32_epi8(l));
  }
  portable::exact_levels(g + i, n - i, level + i);
}

// exact_round_to_levels, 8 at a time: the value times 2^(174 - 24 l) (exact in double),
// rounded to an integer and moved to int64 by the 1.5 * 2^52 bit trick (|x| < 2^47); 0 where
// the level is empty or non-finite (whatever the scaling gave there).
void exact_round_to_levels(const float* g, std::size_t n, const std::uint8_t* level, std::int64_t* out) {
  const __m512d magic = _mm512_set1_pd(0x1.8p52);
  const __m512i magic_bits = _mm512_castpd_si512(magic);
  const __m512i nonfinite = _mm512_set1_epi64(127);
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m512i l = load_levels8(level + i);
    const __mmask8 live = _mm512_test_epi64_mask(l, l) & static_cast<__mmask8>(~_mm512_cmpeq_epi64_mask(l, nonfinite));
    const __m512i l24 = _mm512_add_epi64(_mm512_slli_epi64(l, 4), _mm512_slli_epi64(l, 3));
    const __m512d down = _mm512_castsi512_pd(_mm512_slli_epi64(_mm512_sub_epi64(_mm512_set1_epi64(1197), l24), 52));
    const __m512d x = _mm512_mul_pd(_mm512_cvtps_pd(_mm256_loadu_ps(g + i)), down);
    _mm512_storeu_si512(out + i, _mm512_maskz_sub_epi64(live, _mm512_castpd_si512(_mm512_add_pd(x, magic)), magic_bits));
  }
  portable::exact_round_to_levels(g + i, n - i, level + i, out + i);
}

// exact_lift, 8 at a time, by masks.
void exact_lift(const std::uint8_t* mine, const std::uint8_t* level, std::int64_t* top,
                const std::int64_t* low, std::size_t n) {
  const __m512i nonfinite = _mm512_set1_epi64(127);
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m512i local = load_levels8(mine + i);
    const __m512i global = load_levels8(level + i);
    const __m512i t = _mm512_loadu_si512(top + i);
    const __mmask8 live = _mm512_test_epi64_mask(local, local) &
                          static_cast<__mmask8>(~_mm512_cmpeq_epi64_mask(global, nonfinite));
    const __mmask8 same = live & _mm512_cmpeq_epi64_mask(global, local);
    const __mmask8 up_one = live & _mm512_cmpeq_epi64_mask(global, _mm512_add_epi64(local, _mm512_set1_epi64(1)));
    const __m512i r = _mm512_maskz_mov_epi64(up_one, t);
    _mm512_storeu_si512(top + i, _mm512_mask_add_epi64(r, same, _mm512_slli_epi64(t, 24), _mm512_loadu_si512(low + i)));
  }
  portable::exact_lift(mine + i, level + i, top + i, low + i, n - i);
}

// exact_sums_to_float, 8 at a time: exact_to_float8 at each level's grid, +0 for empty
// elements and the quiet NaN for non-finite ones.
void exact_sums_to_float(const std::int64_t* sum, const std::uint8_t* level, float* dst, std::size_t n) {
  const __m512 nan = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fc00000));
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m512i l = load_levels8(level + i);
    const __m512 f = _mm512_castps256_ps512(exact_to_float8(_mm512_loadu_si512(sum + i), grid_exponent8(l)));
    const __mmask16 empty = _mm512_cmpeq_epi64_mask(l, _mm512_setzero_si512());
    const __mmask16 nonfinite = _mm512_cmpeq_epi64_mask(l, _mm512_set1_epi64(127));
    _mm256_storeu_ps(dst + i, _mm512_castps512_ps256(_mm512_mask_mov_ps(
                                  _mm512_maskz_mov_ps(static_cast<__mmask16>(~empty), f), nonfinite, nan)));
  }
  portable::exact_sums_to_float(sum + i, level + i, dst + i, n - i);
}

// Squares relative to the window's largest exponent emax: with m the 24-bit significand
// and e' = max(e, 1), v = m * 2^(e' - 150) and v^2 = m^2 * 2^(2 e' - 300). For the values
// with e' >= e0 = max(emax - 24, 1), q = (v * 2^(150 - e0))^2 = m^2 * 2^(2 (e' - e0)) is an
// integer below 2^96 with 48 significant bits: exact in a double. It is split exactly into
// a multiple of 2^48 (adding and subtracting 1.5 * 2^100 rounds to it) and a rest below 2^47
// in magnitude, and both go to int64 lanes by the 1.5 * 2^52 bit trick: every operation is
// exact. Values below the window (rare) go to SquareDigits::add one by one.
void exact_square_window(const float* x, std::size_t n, SquareDigits& squares) {
  __m512i emax16 = _mm512_setzero_si512();
  const __m512i ff = _mm512_set1_epi32(0xff);
  std::size_t i = 0;
  for (; i + kW <= n; i += kW)
    emax16 = _mm512_max_epu32(emax16, _mm512_and_si512(_mm512_srli_epi32(_mm512_loadu_si512(x + i), 23), ff));
  // (Not _mm512_reduce_*: GCC 12's versions warn inside avx512fintrin.h.)
  alignas(64) std::uint32_t lanes[16];
  _mm512_store_si512(lanes, emax16);
  const std::uint32_t emax = portable::max_exponent_field(lanes, 16, x + i, n - i);
  if (emax == 0xffu) return portable::exact_square_add(x, n, squares);  // NaN or Inf inside
  const std::int64_t e0 = emax > 25 ? static_cast<std::int64_t>(emax) - 24 : 1;
  // Nonzero magnitudes below e0's binade (none when e0 is 1: subnormals count as e' = 1).
  const __m512i below_bits = _mm512_set1_epi32(e0 >= 2 ? static_cast<int>(e0 << 23) : 0);
  const __m512i abs_mask = _mm512_set1_epi32(0x7fffffff);
  const __m512d scale = _mm512_castsi512_pd(_mm512_set1_epi64((1023 + 150 - e0) << 52));
  const __m512d split = _mm512_set1_pd(0x1.8p100);  // rounds q to a multiple of 2^48
  const __m512d magic = _mm512_set1_pd(0x1.8p52);   // integers below 2^51 <-> int64 bits
  // q < 2^96. Each lane adds the bits of q + split (split's bits plus q's high part over 2^48,
  // below 2^48: every such sum lies in [2^100, 2^101), whose unit is 2^48) and of lo + magic
  // (magic's bits plus lo, an integer of magnitude at most 2^47), modulo 2^64; the constants'
  // bits come off once per lane at the end (`added` of each): what is left are the two integer
  // sums, below 2^57 in magnitude (at most 512 additions per lane in a window).
  __m512i acc_lo = _mm512_setzero_si512(), acc_hi = _mm512_setzero_si512();
  std::uint64_t added = 0;
  auto add8 = [&](__m256 v8) {
    const __m512d y = _mm512_mul_pd(_mm512_cvtps_pd(v8), scale);
    const __m512d q = _mm512_mul_pd(y, y);
    const __m512d t = _mm512_add_pd(q, split);
    const __m512d lo = _mm512_sub_pd(q, _mm512_sub_pd(t, split));
    acc_hi = _mm512_add_epi64(acc_hi, _mm512_castpd_si512(t));
    acc_lo = _mm512_add_epi64(acc_lo, _mm512_castpd_si512(_mm512_add_pd(lo, magic)));
    ++added;
  };
  i = 0;
  for (; i + kW <= n; i += kW) {
    __m512 v = _mm512_loadu_ps(x + i);
    const __m512i a = _mm512_and_si512(_mm512_castps_si512(v), abs_mask);
    const __mmask16 below = _mm512_mask_cmplt_epu32_mask(_mm512_test_epi32_mask(a, a), a, below_bits);
    if (below != 0) {
      for (int k = 0; k < 16; ++k)
        if ((below >> k) & 1) squares.add(x[i + static_cast<std::size_t>(k)]);
      v = _mm512_maskz_mov_ps(static_cast<__mmask16>(~below), v);
    }
    add8(_mm512_castps512_ps256(v));
    add8(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
  }
  for (; i < n; ++i) squares.add(x[i]);
  constexpr std::uint64_t kSplitBits = 0x4638000000000000u;  // the bits of 1.5 * 2^100
  acc_lo = _mm512_sub_epi64(acc_lo, _mm512_set1_epi64(static_cast<std::int64_t>(added * kMagicBits)));
  acc_hi = _mm512_sub_epi64(acc_hi, _mm512_set1_epi64(static_cast<std::int64_t>(added * kSplitBits)));
  alignas(64) std::int64_t lo[8], hi[8];
  _mm512_store_si512(lo, acc_lo);
  _mm512_store_si512(hi, acc_hi);
  std::int64_t sum_lo = 0, sum_hi = 0;
  for (int k = 0; k < 8; ++k) {
    sum_lo += lo[k];
    sum_hi += hi[k];
  }
  // sum_hi * 2^48 + sum_lo >= 0; sum_lo may be negative: carry its multiple of 2^48 over.
  const int base = 2 * static_cast<int>(e0) - 300;
  squares.add_scaled(static_cast<std::uint64_t>(sum_lo) & ((std::uint64_t{1} << 48) - 1), base);
  squares.add_scaled(static_cast<std::uint64_t>(sum_hi + (sum_lo >> 48)), base + 48);
}

void exact_square_add(const float* x, std::size_t n, SquareDigits& squares) {
  for (std::size_t w = 0; w < n; w += kExactChunk)
    exact_square_window(x + w, n - w < kExactChunk ? n - w : kExactChunk, squares);
}
}  // namespace
}  // namespace shardopt::cpu::avx512

namespace shardopt::cpu {

const RangeKernels kAvx512Kernels = {
    "avx512",
    avx512::adam,
    avx512::lion,
    avx512::cast_f32_to_bf16,
    avx512::cast_bf16_to_f32,
    avx512::accumulate_f32,
    avx512::accumulate_bf16,
    avx512::sum_squares_block,
    avx512::sum_squares_blocks,
    avx512::any_nonfinite,
    avx512::scale,
    avx512::fill_zero,
    avx512::exact_combine,
    avx512::exact_square_add,
    avx512::exact_combine_packed,
    avx512::exact_deposit,
    avx512::adamw8bit_blocks,
    avx512::q8_quantize,
    avx512::exact_deposit_pack,
    avx512::exact_levels,
    avx512::exact_round_to_levels,
    avx512::exact_lift,
    avx512::exact_sums_to_float,
    avx512::exact_deposit_packed,
    avx512::exact_combine_packed_raw,
    avx512::exact_deposit_packed_multi,
};

}  // namespace shardopt::cpu
