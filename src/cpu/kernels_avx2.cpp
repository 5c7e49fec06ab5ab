// kernels_avx2.cpp: AVX2 range kernels (compiled with -mavx2 -ffp-contract=off).
//
// Each vector loop mirrors the portable kernel operation for operation with correctly
// rounded IEEE operations (add, mul, div, sqrt) and no FMA, so it returns the same bits.
// Heads (to align streamed outputs) and tails go to the portable kernels; see
// kernel_table.hpp for why this file calls no inline functions of other headers.
#include <immintrin.h>

#include <cstdint>

#include "kernel_table.hpp"
#include "kernels.hpp"

namespace shardopt::cpu::avx2 {
namespace {

constexpr std::size_t kW = 8;  // floats per vector

/// Elements before p reaches a 32-byte boundary (n if never: p not element-aligned).
template <class T>
std::size_t head_to_align32(const T* p, std::size_t n) {
  const auto addr = reinterpret_cast<std::uintptr_t>(p);
  if (addr % sizeof(T) != 0) return n;
  const std::size_t h = ((32 - addr % 32) % 32) / sizeof(T);
  return h < n ? h : n;
}

/// float -> bf16 bits (in the low half of each 32-bit lane), as float_to_bf16_bits().
__m256i bf16_bits(__m256 x) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i hi = _mm256_srli_epi32(u, 16);
  const __m256i is_nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7FFFFFFF)),
                                            _mm256_set1_epi32(0x7F800000));
  const __m256i bias = _mm256_add_epi32(_mm256_and_si256(hi, _mm256_set1_epi32(1)),
                                        _mm256_set1_epi32(0x7FFF));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(u, bias), 16);
  const __m256i nan = _mm256_or_si256(_mm256_and_si256(hi, _mm256_set1_epi32(0x8000)),
                                      _mm256_set1_epi32(0x7FC0));
  return _mm256_blendv_epi8(rounded, nan, is_nan);
}

/// 16 floats -> 16 bf16 in order.
__m256i pack_bf16(__m256 a, __m256 b) {
  // packus interleaves 128-bit lanes: [a0-3 b0-3 a4-7 b4-7]; the permute restores order.
  const __m256i packed = _mm256_packus_epi32(bf16_bits(a), bf16_bits(b));
  return _mm256_permute4x64_epi64(packed, 0xD8);
}

__m256 widen_bf16(__m128i h) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

void store_bf16x16(bf16* dst, __m256i x, bool stream) {
  if (stream) {
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst), x);
  } else {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), x);
  }
}

void store_f32x8(float* dst, __m256 x, bool stream) {
  if (stream) {
    _mm256_stream_ps(dst, x);
  } else {
    _mm256_storeu_ps(dst, x);
  }
}

struct AdamVec {
  __m256 beta1, beta2, omb1, omb2, eps, bc2, grad_scale, step_size, decay, l2;
};

/// adam_element() on 8 lanes; returns the new weights.
template <bool kL2>
__m256 adam8(const AdamVec& c, float* p, const float* grad, float* m, float* v) {
  __m256 gr = _mm256_mul_ps(_mm256_loadu_ps(grad), c.grad_scale);
  __m256 pv = _mm256_loadu_ps(p);
  if constexpr (kL2) gr = _mm256_add_ps(gr, _mm256_mul_ps(c.l2, pv));
  pv = _mm256_mul_ps(pv, c.decay);
  const __m256 mv = _mm256_add_ps(_mm256_mul_ps(c.beta1, _mm256_loadu_ps(m)),
                                  _mm256_mul_ps(c.omb1, gr));
  const __m256 vv = _mm256_add_ps(_mm256_mul_ps(c.beta2, _mm256_loadu_ps(v)),
                                  _mm256_mul_ps(c.omb2, _mm256_mul_ps(gr, gr)));
  const __m256 denom = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(vv), c.bc2), c.eps);
  pv = _mm256_sub_ps(pv, _mm256_mul_ps(c.step_size, _mm256_div_ps(mv, denom)));
  _mm256_storeu_ps(m, mv);
  _mm256_storeu_ps(v, vv);
  _mm256_storeu_ps(p, pv);
  return pv;
}

template <bool kL2>
std::size_t adam_body(const AdamVec& c, float* p, const float* grad, float* m, float* v,
                      bf16* out_bf16, float* out_f32, std::size_t n, bool stream16,
                      bool stream32) {
  std::size_t i = 0;
  for (; i + 2 * kW <= n; i += 2 * kW) {
    const __m256 p0 = adam8<kL2>(c, p + i, grad + i, m + i, v + i);
    const __m256 p1 = adam8<kL2>(c, p + i + kW, grad + i + kW, m + i + kW, v + i + kW);
    if (out_bf16) store_bf16x16(out_bf16 + i, pack_bf16(p0, p1), stream16);
    if (out_f32) {
      store_f32x8(out_f32 + i, p0, stream32);
      store_f32x8(out_f32 + i + kW, p1, stream32);
    }
  }
  return i;
}

void adam(const StepScalars& s, const SegmentScalars& g, float* p, const float* grad, float* m,
          float* v, bf16* out_bf16, float* out_f32, std::size_t n, bool stream) {
  // Stream one output (the bf16 copy when there is one); align its start first.
  std::size_t head = 0;
  bool stream16 = false, stream32 = false;
  if (stream && out_bf16) {
    head = head_to_align32(out_bf16, n);
    stream16 = true;
  } else if (stream && out_f32) {
    head = head_to_align32(out_f32, n);
    stream32 = true;
  }
  portable::adam(s, g, p, grad, m, v, out_bf16, out_f32, head, false);
  const AdamVec c{_mm256_set1_ps(s.beta1),       _mm256_set1_ps(s.beta2),
                  _mm256_set1_ps(s.one_minus_beta1), _mm256_set1_ps(s.one_minus_beta2),
                  _mm256_set1_ps(s.eps),         _mm256_set1_ps(s.bias_correction2_sqrt),
                  _mm256_set1_ps(s.grad_scale),  _mm256_set1_ps(g.step_size),
                  _mm256_set1_ps(g.decay_factor), _mm256_set1_ps(g.l2_decay)};
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
  if (stream) _mm_sfence();  // order the weakly ordered stores before other threads read
}

/// lion_element() on 8 lanes; returns the new weights.
__m256 lion8(const LionScalars& s, float* p, const float* grad, float* m) {
  const __m256 g = _mm256_mul_ps(_mm256_loadu_ps(grad), _mm256_set1_ps(s.grad_scale));
  const __m256 mv = _mm256_loadu_ps(m);
  __m256 pv = _mm256_mul_ps(_mm256_loadu_ps(p), _mm256_set1_ps(s.decay_factor));
  const __m256 c = _mm256_add_ps(_mm256_mul_ps(_mm256_set1_ps(s.beta1), mv),
                                 _mm256_mul_ps(_mm256_set1_ps(s.one_minus_beta1), g));
  const __m256 zero = _mm256_setzero_ps();
  const __m256 sign =
      _mm256_or_ps(_mm256_and_ps(_mm256_cmp_ps(c, zero, _CMP_GT_OQ), _mm256_set1_ps(1.0f)),
                   _mm256_and_ps(_mm256_cmp_ps(c, zero, _CMP_LT_OQ), _mm256_set1_ps(-1.0f)));
  pv = _mm256_sub_ps(pv, _mm256_mul_ps(_mm256_set1_ps(s.lr), sign));
  _mm256_storeu_ps(m, _mm256_add_ps(_mm256_mul_ps(_mm256_set1_ps(s.beta2), mv),
                                    _mm256_mul_ps(_mm256_set1_ps(s.one_minus_beta2), g)));
  _mm256_storeu_ps(p, pv);
  return pv;
}

void lion(const LionScalars& s, float* p, const float* grad, float* m, bf16* out_bf16,
          float* out_f32, std::size_t n) {
  std::size_t i = 0;
  for (; i + 2 * kW <= n; i += 2 * kW) {
    const __m256 p0 = lion8(s, p + i, grad + i, m + i);
    const __m256 p1 = lion8(s, p + i + kW, grad + i + kW, m + i + kW);
    if (out_bf16) store_bf16x16(out_bf16 + i, pack_bf16(p0, p1), false);
    if (out_f32) {
      _mm256_storeu_ps(out_f32 + i, p0);
      _mm256_storeu_ps(out_f32 + i + kW, p1);
    }
  }
  portable::lion(s, p + i, grad + i, m + i, out_bf16 ? out_bf16 + i : nullptr,
                 out_f32 ? out_f32 + i : nullptr, n - i);
}

/// adam_element() on 8 lanes of registers: m and v in, the new m and v out; the new weights
/// stored and returned (adam8's arithmetic).
template <bool kL2>
__m256 adam8_regs(const AdamVec& c, float* p, const float* grad, __m256& mv, __m256& vv) {
  __m256 gr = _mm256_mul_ps(_mm256_loadu_ps(grad), c.grad_scale);
  __m256 pv = _mm256_loadu_ps(p);
  if constexpr (kL2) gr = _mm256_add_ps(gr, _mm256_mul_ps(c.l2, pv));
  pv = _mm256_mul_ps(pv, c.decay);
  mv = _mm256_add_ps(_mm256_mul_ps(c.beta1, mv), _mm256_mul_ps(c.omb1, gr));
  vv = _mm256_add_ps(_mm256_mul_ps(c.beta2, vv), _mm256_mul_ps(c.omb2, _mm256_mul_ps(gr, gr)));
  const __m256 denom = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(vv), c.bc2), c.eps);
  pv = _mm256_sub_ps(pv, _mm256_mul_ps(c.step_size, _mm256_div_ps(mv, denom)));
  _mm256_storeu_ps(p, pv);
  return pv;
}

/// Q8Map::entry minus kQ8Low entries: indexed by the bucket bits(|y|) >> 16 itself (an
/// address for the gathers; only indices >= kQ8Low are used).
const int* entry_base(const Q8Map& q) {
  return reinterpret_cast<const int*>(reinterpret_cast<std::uintptr_t>(q.entry) -
                                      kQ8Low * sizeof(std::uint32_t));
}

/// The codes of 8 floats (in the low byte of each lane, higher bits not cleared) through the
/// SIMD entries, as quantize16 in kernels_avx512.cpp: the bucket of |y| < 2^-23 raised to the
/// table's first; |y| > 1, infinities and NaN have the code of +-1 by the sign bit there, as
/// quantize() gives them. kNonNeg: a map without negative thresholds
/// (exp_avg_sq's), where every y with the sign bit set has the first bucket's code 0.
template <bool kNonNeg>
__m256i quantize8(__m256 y, const int* base) {
  const __m256i bits = _mm256_castps_si256(y);
  const __m256i ffff = _mm256_set1_epi32(0xFFFF);
  const __m256i low = _mm256_set1_epi32(static_cast<int>(kQ8Low));
  __m256i idx, key;
  if constexpr (kNonNeg) {
    idx = _mm256_max_epi32(_mm256_srai_epi32(bits, 16), low);
    key = _mm256_and_si256(bits, ffff);
  } else {
    const __m256i neg = _mm256_srai_epi32(bits, 31);  // all ones for y <= -0
    idx = _mm256_srli_epi32(_mm256_and_si256(bits, _mm256_set1_epi32(0x7FFFFFFF)), 16);
    idx = _mm256_max_epi32(idx, low);
    idx = _mm256_add_epi32(idx, _mm256_and_si256(neg, _mm256_set1_epi32(static_cast<int>(kQ8Buckets))));
    // key: the low 16 bits, complemented for negative y (larger magnitudes first).
    key = _mm256_and_si256(_mm256_xor_si256(bits, neg), ffff);
  }
  const __m256i e = _mm256_i32gather_epi32(base, idx, 4);
  // key > lim - 1 (both < 2^16): e + 1 (base + 1 <= 255 there, no carry out of the low
  // byte); else e.
  return _mm256_sub_epi32(e, _mm256_cmpgt_epi32(key, _mm256_srli_epi32(e, 16)));
}

/// 16 codes (the low bytes of two quantize8 results) stored in order.
void store_codes16(std::uint8_t* dst, __m256i a, __m256i b) {
  const __m256i byte = _mm256_set1_epi32(0xFF);
  // packus interleaves 128-bit lanes: [a0-3 b0-3 a4-7 b4-7]; the permute restores order.
  const __m256i w = _mm256_permute4x64_epi64(
      _mm256_packus_epi32(_mm256_and_si256(a, byte), _mm256_and_si256(b, byte)), 0xD8);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst),
                   _mm_packus_epi16(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1)));
}

template <bool kNonNeg>
void q8_quantize_run(const float* y, std::size_t n, const Q8Map& q, std::uint8_t* code) {
  std::size_t i = 0;
  for (; i + 2 * kW <= n; i += 2 * kW)
    store_codes16(code + i, quantize8<kNonNeg>(_mm256_loadu_ps(y + i), entry_base(q)),
                  quantize8<kNonNeg>(_mm256_loadu_ps(y + i + kW), entry_base(q)));
  if (i < n) {
    alignas(32) float t[2 * kW] = {};
    std::uint8_t c[2 * kW];
    for (std::size_t k = i; k < n; ++k) t[k - i] = y[k];
    store_codes16(c, quantize8<kNonNeg>(_mm256_load_ps(t), entry_base(q)),
                  quantize8<kNonNeg>(_mm256_load_ps(t + kW), entry_base(q)));
    for (std::size_t k = i; k < n; ++k) code[k] = c[k - i];
  }
}

void q8_quantize(const float* y, std::size_t n, const Q8Map& q, bool nonneg, std::uint8_t* code) {
  if (nonneg) q8_quantize_run<true>(y, n, q, code);
  else q8_quantize_run<false>(y, n, q, code);
}

constexpr std::size_t kQBlock = 256;  // rules::q8::kBlock

__m256 dequantize8(const std::uint8_t* code, const float* value, __m256 scale) {
  const __m256i c = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(code)));
  return _mm256_mul_ps(_mm256_i32gather_ps(value, c, 4), scale);
}

/// The codes of 16 of a block's m and v under its new scales.
void requantize16(const float* m, const float* v, __m256 scale_m, __m256 scale_v,
                  std::uint8_t* code_m, std::uint8_t* code_v, const int* qs, const int* qu) {
  store_codes16(code_m, quantize8<false>(_mm256_div_ps(_mm256_load_ps(m), scale_m), qs),
                quantize8<false>(_mm256_div_ps(_mm256_load_ps(m + kW), scale_m), qs));
  store_codes16(code_v, quantize8<true>(_mm256_div_ps(_mm256_load_ps(v), scale_v), qu),
                quantize8<true>(_mm256_div_ps(_mm256_load_ps(v + kW), scale_v), qu));
}

float reduce_max(__m256 x) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
  return _mm_cvtss_f32(m);
}

/// AdamW8bit blocks, software-pipelined as in kernels_avx512.cpp: block b's update
/// (dequantize, adam8_regs(), the replica, the new scales) in the same loop as block b - 1's
/// requantization (27 ns per 16 elements in L2, against 31 ns one block after the other). Each block's arithmetic is the portable block's, operation for
/// operation; max is exact and order-free on finite values.
template <bool kL2>
void adamw8bit_run(const AdamVec& c, float* p, const float* grad, std::uint8_t* code_m,
                   std::uint8_t* code_v, float* scale_m, float* scale_v, bf16* out_bf16,
                   float* out_f32, std::size_t blocks, const Q8Map& qs, const Q8Map& qu) {
  alignas(32) float mbuf[2][kQBlock];  // the updated m and v of blocks b (b % 2) and b - 1
  alignas(32) float vbuf[2][kQBlock];
  const Q8Map ks = qs, ku = qu;  // local copies: the stores below cannot alias them
  const int* es = entry_base(qs);
  const int* eu = entry_base(qu);
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  const float floor = 1e-12f;
  __m256 prev_sm = _mm256_setzero_ps(), prev_sv = _mm256_setzero_ps();
  for (std::size_t b = 0; b <= blocks; ++b) {
    float* m = mbuf[b % 2];
    float* v = vbuf[b % 2];
    const float* pm = mbuf[(b + 1) % 2];
    const float* pv = vbuf[(b + 1) % 2];
    if (b == blocks) {  // the last block's requantization alone
      const std::size_t last = (b - 1) * kQBlock;
      for (std::size_t i = 0; i < kQBlock; i += 2 * kW)
        requantize16(pm + i, pv + i, prev_sm, prev_sv, code_m + last + i, code_v + last + i, es, eu);
      break;
    }
    const std::size_t at = b * kQBlock;
    const __m256 sm = _mm256_set1_ps(scale_m[b]), sv = _mm256_set1_ps(scale_v[b]);
    __m256 max_m = _mm256_setzero_ps(), max_v = _mm256_setzero_ps();
    for (std::size_t i = 0; i < kQBlock; i += 2 * kW) {
      __m256 m0 = dequantize8(code_m + at + i, ks.value, sm);
      __m256 m1 = dequantize8(code_m + at + i + kW, ks.value, sm);
      __m256 v0 = dequantize8(code_v + at + i, ku.value, sv);
      __m256 v1 = dequantize8(code_v + at + i + kW, ku.value, sv);
      const __m256 p0 = adam8_regs<kL2>(c, p + at + i, grad + at + i, m0, v0);
      const __m256 p1 = adam8_regs<kL2>(c, p + at + i + kW, grad + at + i + kW, m1, v1);
      if (out_bf16) store_bf16x16(out_bf16 + at + i, pack_bf16(p0, p1), false);
      if (out_f32) {
        store_f32x8(out_f32 + at + i, p0, false);
        store_f32x8(out_f32 + at + i + kW, p1, false);
      }
      _mm256_store_ps(m + i, m0);
      _mm256_store_ps(m + i + kW, m1);
      _mm256_store_ps(v + i, v0);
      _mm256_store_ps(v + i + kW, v1);
      // max(x, acc) returns acc where x is NaN: std::max(acc, x), as the portable loop.
      max_m = _mm256_max_ps(_mm256_and_ps(m1, abs_mask), _mm256_max_ps(_mm256_and_ps(m0, abs_mask), max_m));
      max_v = _mm256_max_ps(v1, _mm256_max_ps(v0, max_v));
      if (b > 0) {
        const std::size_t prev = at - kQBlock;
        requantize16(pm + i, pv + i, prev_sm, prev_sv, code_m + prev + i, code_v + prev + i, es, eu);
      }
    }
    const float am = reduce_max(max_m), av = reduce_max(max_v);
    scale_m[b] = am > floor ? am : floor;
    scale_v[b] = av > floor ? av : floor;
    prev_sm = _mm256_set1_ps(scale_m[b]);
    prev_sv = _mm256_set1_ps(scale_v[b]);
  }
}

void adamw8bit_blocks(const StepScalars& s, const SegmentScalars& g, float* p, const float* grad,
                      std::uint8_t* code_m, std::uint8_t* code_v, float* scale_m, float* scale_v,
                      bf16* out_bf16, float* out_f32, std::size_t blocks, const Q8Map& qs,
                      const Q8Map& qu) {
  const AdamVec c{_mm256_set1_ps(s.beta1),       _mm256_set1_ps(s.beta2),
                  _mm256_set1_ps(s.one_minus_beta1), _mm256_set1_ps(s.one_minus_beta2),
                  _mm256_set1_ps(s.eps),         _mm256_set1_ps(s.bias_correction2_sqrt),
                  _mm256_set1_ps(s.grad_scale),  _mm256_set1_ps(g.step_size),
                  _mm256_set1_ps(g.decay_factor), _mm256_set1_ps(g.l2_decay)};
  if (s.mode == AdamMode::AdamL2)
    adamw8bit_run<true>(c, p, grad, code_m, code_v, scale_m, scale_v, out_bf16, out_f32, blocks, qs, qu);
  else
    adamw8bit_run<false>(c, p, grad, code_m, code_v, scale_m, scale_v, out_bf16, out_f32, blocks, qs, qu);
}

void cast_f32_to_bf16(const float* src, bf16* dst, std::size_t n, bool stream) {
  const std::size_t head = stream ? head_to_align32(dst, n) : 0;
  portable::cast_f32_to_bf16(src, dst, head, false);
  std::size_t i = head;
  for (; i + 2 * kW <= n; i += 2 * kW)
    store_bf16x16(dst + i, pack_bf16(_mm256_loadu_ps(src + i), _mm256_loadu_ps(src + i + kW)),
                  stream);
  portable::cast_f32_to_bf16(src + i, dst + i, n - i, false);
  if (stream) _mm_sfence();
}

void cast_bf16_to_f32(const bf16* src, float* dst, std::size_t n, bool stream) {
  const std::size_t head = stream ? head_to_align32(dst, n) : 0;
  portable::cast_bf16_to_f32(src, dst, head, false);
  std::size_t i = head;
  for (; i + 2 * kW <= n; i += 2 * kW) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
    store_f32x8(dst + i, widen_bf16(_mm256_castsi256_si128(h)), stream);
    store_f32x8(dst + i + kW, widen_bf16(_mm256_extracti128_si256(h, 1)), stream);
  }
  portable::cast_bf16_to_f32(src + i, dst + i, n - i, false);
  if (stream) _mm_sfence();
}

void accumulate_f32(float* dst, const float* src, std::size_t n) {
  std::size_t i = 0;
  for (; i + 2 * kW <= n; i += 2 * kW) {
    _mm256_storeu_ps(dst + i, _mm256_add_ps(_mm256_loadu_ps(dst + i), _mm256_loadu_ps(src + i)));
    _mm256_storeu_ps(dst + i + kW, _mm256_add_ps(_mm256_loadu_ps(dst + i + kW),
                                                 _mm256_loadu_ps(src + i + kW)));
  }
  portable::accumulate_f32(dst + i, src + i, n - i);
}

void accumulate_bf16(float* dst, const bf16* src, std::size_t n) {
  std::size_t i = 0;
  for (; i + 2 * kW <= n; i += 2 * kW) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
    _mm256_storeu_ps(dst + i, _mm256_add_ps(_mm256_loadu_ps(dst + i),
                                            widen_bf16(_mm256_castsi256_si128(h))));
    _mm256_storeu_ps(dst + i + kW, _mm256_add_ps(_mm256_loadu_ps(dst + i + kW),
                                                 widen_bf16(_mm256_extracti128_si256(h, 1))));
  }
  portable::accumulate_bf16(dst + i, src + i, n - i);
}

double sum_squares_block(const float* x, std::size_t n) {
  // Four accumulators of 4 doubles are lanes 0-3, 4-7, 8-11, 12-15 of the documented order.
  __m256d acc[4] = {_mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd(),
                    _mm256_setzero_pd()};
  std::size_t i = 0;
  for (; i + 2 * kW <= n; i += 2 * kW) {
    const __m256 a = _mm256_loadu_ps(x + i), b = _mm256_loadu_ps(x + i + kW);
    const __m256d d[4] = {_mm256_cvtps_pd(_mm256_castps256_ps128(a)),
                          _mm256_cvtps_pd(_mm256_extractf128_ps(a, 1)),
                          _mm256_cvtps_pd(_mm256_castps256_ps128(b)),
                          _mm256_cvtps_pd(_mm256_extractf128_ps(b, 1))};
    for (int k = 0; k < 4; ++k) acc[k] = _mm256_add_pd(acc[k], _mm256_mul_pd(d[k], d[k]));
  }
  alignas(32) double lanes[kSumLanes];
  for (int k = 0; k < 4; ++k) _mm256_store_pd(lanes + 4 * k, acc[k]);
  return portable::finish_sum_lanes(lanes, x + i, n - i);
}

// kSumGroup full blocks side by side: block g's lanes 4k..4k+3 in acc[4g + k], the same
// additions in the same order as sum_squares_block, 4 x kSumGroup independent chains (more
// than the 16 registers: the spills cost less than the chains' latency, measured).
void sum_squares_group(const float* x, double* out) {
  __m256d acc[4 * kSumGroup];
  for (__m256d& a : acc) a = _mm256_setzero_pd();
  for (std::size_t i = 0; i < kSumBlock; i += 2 * kW) {
    for (std::size_t g = 0; g < kSumGroup; ++g) {
      const float* p = x + g * kSumBlock + i;
      for (std::size_t k = 0; k < 4; ++k) {
        const __m256d d = _mm256_cvtps_pd(_mm_loadu_ps(p + 4 * k));
        acc[4 * g + k] = _mm256_add_pd(acc[4 * g + k], _mm256_mul_pd(d, d));
      }
    }
  }
  for (std::size_t g = 0; g < kSumGroup; ++g) {
    alignas(32) double lanes[kSumLanes];
    for (std::size_t k = 0; k < 4; ++k) _mm256_store_pd(lanes + 4 * k, acc[4 * g + k]);
    out[g] = portable::finish_sum_lanes(lanes, nullptr, 0);
  }
}

void sum_squares_blocks(const float* x, std::size_t blocks, double* out) {
  std::size_t b = 0;
  for (; b + kSumGroup <= blocks; b += kSumGroup) sum_squares_group(x + b * kSumBlock, out + b);
  for (; b < blocks; ++b) out[b] = sum_squares_block(x + b * kSumBlock, kSumBlock);
}

bool any_nonfinite(const float* x, std::size_t n) {
  const __m256i exp_mask = _mm256_set1_epi32(0x7F800000);
  __m256i bad = _mm256_setzero_si256();
  std::size_t i = 0;
  for (; i + 2 * kW <= n; i += 2 * kW) {
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i));
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i + kW));
    bad = _mm256_or_si256(bad, _mm256_cmpeq_epi32(_mm256_and_si256(a, exp_mask), exp_mask));
    bad = _mm256_or_si256(bad, _mm256_cmpeq_epi32(_mm256_and_si256(b, exp_mask), exp_mask));
  }
  return !_mm256_testz_si256(bad, bad) || portable::any_nonfinite(x + i, n - i);
}

void scale(float* x, std::size_t n, float factor) {
  const __m256 f = _mm256_set1_ps(factor);
  std::size_t i = 0;
  for (; i + kW <= n; i += kW) _mm256_storeu_ps(x + i, _mm256_mul_ps(_mm256_loadu_ps(x + i), f));
  portable::scale(x + i, n - i, factor);
}

void fill_zero(float* x, std::size_t n, bool stream) {
  if (!stream) return portable::fill_zero(x, n, false);
  const std::size_t head = head_to_align32(x, n);
  portable::fill_zero(x, head, false);
  const __m256 z = _mm256_setzero_ps();
  std::size_t i = head;
  for (; i + kW <= n; i += kW) _mm256_stream_ps(x + i, z);
  portable::fill_zero(x + i, n - i, false);
  _mm_sfence();
}


// ---- reproducible mode's exact arithmetic (exact_kernels.cpp has the reference) ------------

// 4 doubles = 2^g for 4 int64 lanes of g (biased-exponent construction, no libm).
__m256d pow2_pd(__m256i g) {
  return _mm256_castsi256_pd(_mm256_slli_epi64(_mm256_add_epi64(g, _mm256_set1_epi64x(1023)), 52));
}

// One half (4 lanes) of 8: sum over ranks of RNE(v / 2^g), times 2^g, rounded once to fp32.
__m128 combine_half(const float* const* src, int ranks, std::size_t i, int half, __m256i g64) {
  const __m256d down = pow2_pd(_mm256_sub_epi64(_mm256_setzero_si256(), g64));
  const __m256d shift = _mm256_set1_pd(6755399441055744.0);  // 1.5 * 2^52: round to integer
  __m256d sum = _mm256_setzero_pd();
  for (int r = 0; r < ranks; ++r) {
    const __m128 v = _mm_loadu_ps(src[r] + i + 4 * static_cast<std::size_t>(half));
    __m256d x = _mm256_mul_pd(_mm256_cvtps_pd(v), down);
    x = _mm256_sub_pd(_mm256_add_pd(x, shift), shift);
    sum = _mm256_add_pd(sum, x);
  }
  return _mm256_cvtpd_ps(_mm256_mul_pd(sum, pow2_pd(g64)));
}

void exact_combine(const float* const* src, int ranks, float* dst, std::size_t n) {
  if (ranks > kExactCombineMaxSimdRanks) return portable::exact_combine(src, ranks, dst, n);
  const __m256i ff = _mm256_set1_epi32(0xff);
  std::size_t i = 0;
  for (; i + kW <= n; i += kW) {
    __m256i e = _mm256_setzero_si256();
    for (int r = 0; r < ranks; ++r) {
      SHARDOPT_PREFETCH_AHEAD(src[r] + i, kExactPrefetchElems * sizeof(float));
      e = _mm256_max_epu32(e, _mm256_and_si256(
                                  _mm256_srli_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src[r] + i)), 23), ff));
    }
    const __m256 nonfinite = _mm256_castsi256_ps(_mm256_cmpeq_epi32(e, ff));
    // g = 24 * ((e + 24) / 24) - 174; x / 24 = (x * 2731) >> 16 for every x below 300.
    const __m256i level = _mm256_srli_epi32(
        _mm256_mullo_epi32(_mm256_add_epi32(e, _mm256_set1_epi32(24)), _mm256_set1_epi32(2731)), 16);
    const __m256i g = _mm256_sub_epi32(_mm256_mullo_epi32(level, _mm256_set1_epi32(24)),
                                       _mm256_set1_epi32(174));
    const __m128 lo = combine_half(src, ranks, i, 0, _mm256_cvtepi32_epi64(_mm256_castsi256_si128(g)));
    const __m128 hi = combine_half(src, ranks, i, 1, _mm256_cvtepi32_epi64(_mm256_extracti128_si256(g, 1)));
    const __m256 both = _mm256_insertf128_ps(_mm256_castps128_ps256(lo), hi, 1);
    // The stores come after every load of this vector: dst may be one of the sources.
    _mm256_storeu_ps(dst + i, _mm256_blendv_ps(both, _mm256_castsi256_ps(_mm256_set1_epi32(0x7fc00000)),
                                               nonfinite));
  }
  portable::exact_combine_tail(src, ranks, dst, i, n);
}

// As kernels_avx512.cpp's exact_square_window (the method is described there), 4 lanes.
void exact_square_window(const float* x, std::size_t n, SquareDigits& squares) {
  std::uint32_t emax;
  {
    __m256i e8 = _mm256_setzero_si256();
    const __m256i ff = _mm256_set1_epi32(0xff);
    std::size_t i = 0;
    for (; i + kW <= n; i += kW)
      e8 = _mm256_max_epu32(e8, _mm256_and_si256(
                                    _mm256_srli_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i)), 23), ff));
    alignas(32) std::uint32_t lanes[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), e8);
    emax = portable::max_exponent_field(lanes, 8, x + i, n - i);
  }
  if (emax == 0xffu) return portable::exact_square_add(x, n, squares);  // NaN or Inf inside
  const std::int64_t e0 = emax > 25 ? static_cast<std::int64_t>(emax) - 24 : 1;
  const __m256i e0m1 = _mm256_set1_epi64x(e0 - 1);
  const __m256i e0v = _mm256_set1_epi64x(e0);
  const __m256i mask48 = _mm256_set1_epi64x((std::int64_t{1} << 48) - 1);
  const __m256i one = _mm256_set1_epi64x(1);
  const __m256i zero = _mm256_setzero_si256();
  __m256i acc_lo = zero, acc_hi = zero;
  std::size_t i = 0;
  for (; i + 4 <= n; i += 4) {
    const __m256i u = _mm256_cvtepu32_epi64(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x + i)));
    const __m256i e = _mm256_and_si256(_mm256_srli_epi64(u, 23), _mm256_set1_epi64x(0xff));
    const __m256i normal = _mm256_cmpgt_epi64(e, zero);
    __m256i m = _mm256_or_si256(_mm256_and_si256(u, _mm256_set1_epi64x(0x7fffff)),
                                _mm256_and_si256(normal, _mm256_set1_epi64x(0x800000)));
    const __m256i ee = _mm256_blendv_epi8(one, e, normal);  // max(e, 1)
    const __m256i inside = _mm256_cmpgt_epi64(ee, e0m1);     // ee >= e0
    const __m256i nonzero = _mm256_xor_si256(_mm256_cmpeq_epi64(m, zero), _mm256_set1_epi64x(-1));
    const int below = _mm256_movemask_pd(_mm256_castsi256_pd(_mm256_andnot_si256(inside, nonzero)));
    if (below != 0) {
      for (int k = 0; k < 4; ++k)
        if ((below >> k) & 1) squares.add(x[i + static_cast<std::size_t>(k)]);
    }
    m = _mm256_and_si256(m, inside);
    const __m256i s = _mm256_and_si256(_mm256_slli_epi64(_mm256_sub_epi64(ee, e0v), 1), inside);
    const __m256i m2 = _mm256_mul_epu32(m, m);  // < 2^48
    acc_lo = _mm256_add_epi64(acc_lo, _mm256_and_si256(_mm256_sllv_epi64(m2, s), mask48));
    acc_hi = _mm256_add_epi64(acc_hi, _mm256_srlv_epi64(m2, _mm256_sub_epi64(_mm256_set1_epi64x(48), s)));
  }
  for (; i < n; ++i) squares.add(x[i]);
  alignas(32) std::uint64_t lo[4], hi[4];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lo), acc_lo);
  _mm256_store_si256(reinterpret_cast<__m256i*>(hi), acc_hi);
  const int base = 2 * static_cast<int>(e0) - 300;
  squares.add_scaled(lo[0] + lo[1] + lo[2] + lo[3], base);
  squares.add_scaled(hi[0] + hi[1] + hi[2] + hi[3], base + 48);
}

void exact_square_add(const float* x, std::size_t n, SquareDigits& squares) {
  for (std::size_t w = 0; w < n; w += kExactChunk)
    exact_square_window(x + w, n - w < kExactChunk ? n - w : kExactChunk, squares);
}

// ---- the two-phase method's passes (exact::ExactGrads::reduce), as kernels_avx512.cpp ----

// exact_to_float on 4 int64 lanes, as kernels_avx512.cpp's exact_to_float8 (the method is
// described there): AVX2 has no 64-bit arithmetic shift, so n >> 13 is the logical shift with
// the sign's bits put back on top.
__m128 exact_to_float4(__m256i n, __m256i e) {
  const __m256d magic = _mm256_set1_pd(0x1.8p52);
  const __m256i zero = _mm256_setzero_si256();
  const __m256i wide = _mm256_or_si256(_mm256_cmpgt_epi64(n, _mm256_set1_epi64x((std::int64_t{1} << 50) - 1)),
                                       _mm256_cmpgt_epi64(_mm256_set1_epi64x(-(std::int64_t{1} << 50)), n));
  __m256i t = n;
  if (!_mm256_testz_si256(wide, wide)) {
    const __m256i shifted = _mm256_or_si256(_mm256_srli_epi64(n, 13), _mm256_slli_epi64(_mm256_cmpgt_epi64(zero, n), 51));
    const __m256i sticky = _mm256_andnot_si256(
        _mm256_cmpeq_epi64(_mm256_and_si256(n, _mm256_set1_epi64x(0x1fff)), zero), _mm256_set1_epi64x(1));
    t = _mm256_blendv_epi8(n, _mm256_or_si256(shifted, sticky), wide);
    e = _mm256_add_epi64(e, _mm256_and_si256(wide, _mm256_set1_epi64x(13)));
  }
  const __m256d exact = _mm256_sub_pd(_mm256_castsi256_pd(_mm256_add_epi64(t, _mm256_castpd_si256(magic))), magic);
  return _mm256_cvtpd_ps(_mm256_mul_pd(
      exact, _mm256_castsi256_pd(_mm256_slli_epi64(_mm256_add_epi64(e, _mm256_set1_epi64x(1023)), 52))));
}

/// 4 levels (bytes) as int64 lanes.
__m256i load_levels4(const std::uint8_t* level) { return _mm256_cvtepu8_epi64(_mm_loadu_si32(level)); }

/// 24 l: with b(l) = 24 l - 150, the exponents of the grids are offsets of it.
__m256i times24(__m256i l) { return _mm256_add_epi64(_mm256_slli_epi64(l, 4), _mm256_slli_epi64(l, 3)); }

void exact_levels(const float* g, std::size_t n, std::uint8_t* level) {
  const __m256i abs_mask = _mm256_set1_epi32(0x7fffffff);
  const __m256i zero = _mm256_setzero_si256();
  // Bytes 0, 4, 8, 12 of each 128-bit half into its first 4 bytes.
  const __m256i gather = _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                          0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
  std::size_t i = 0;
  for (; i + kW <= n; i += kW) {
    const __m256i a = _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(g + i)), abs_mask);
    const __m256i e = _mm256_srli_epi32(a, 23);
    __m256i l = _mm256_srli_epi32(
        _mm256_mullo_epi32(_mm256_add_epi32(e, _mm256_set1_epi32(24)), _mm256_set1_epi32(2731)), 16);
    l = _mm256_andnot_si256(_mm256_cmpeq_epi32(a, zero), l);
    l = _mm256_blendv_epi8(l, _mm256_set1_epi32(127), _mm256_cmpeq_epi32(e, _mm256_set1_epi32(0xff)));
    const __m256i b = _mm256_shuffle_epi8(l, gather);
    _mm_storel_epi64(reinterpret_cast<__m128i*>(level + i),
                     _mm_unpacklo_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1)));
  }
  portable::exact_levels(g + i, n - i, level + i);
}

void exact_round_to_levels(const float* g, std::size_t n, const std::uint8_t* level, std::int64_t* out) {
  const __m256d magic = _mm256_set1_pd(0x1.8p52);
  const __m256i magic_bits = _mm256_castpd_si256(magic);
  const __m256i zero = _mm256_setzero_si256();
  std::size_t i = 0;
  for (; i + 4 <= n; i += 4) {
    const __m256i l = load_levels4(level + i);
    const __m256i dead = _mm256_or_si256(_mm256_cmpeq_epi64(l, zero), _mm256_cmpeq_epi64(l, _mm256_set1_epi64x(127)));
    const __m256d down = _mm256_castsi256_pd(_mm256_slli_epi64(_mm256_sub_epi64(_mm256_set1_epi64x(1197), times24(l)), 52));
    const __m256d x = _mm256_mul_pd(_mm256_cvtps_pd(_mm_loadu_ps(g + i)), down);
    const __m256i r = _mm256_sub_epi64(_mm256_castpd_si256(_mm256_add_pd(x, magic)), magic_bits);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), _mm256_andnot_si256(dead, r));
  }
  portable::exact_round_to_levels(g + i, n - i, level + i, out + i);
}

void exact_lift(const std::uint8_t* mine, const std::uint8_t* level, std::int64_t* top,
                const std::int64_t* low, std::size_t n) {
  const __m256i zero = _mm256_setzero_si256();
  std::size_t i = 0;
  for (; i + 4 <= n; i += 4) {
    const __m256i local = load_levels4(mine + i);
    const __m256i global = load_levels4(level + i);
    const __m256i t = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(top + i));
    const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(low + i));
    const __m256i dead = _mm256_or_si256(_mm256_cmpeq_epi64(local, zero),
                                         _mm256_cmpeq_epi64(global, _mm256_set1_epi64x(127)));
    const __m256i same = _mm256_cmpeq_epi64(global, local);
    const __m256i up_one = _mm256_cmpeq_epi64(global, _mm256_add_epi64(local, _mm256_set1_epi64x(1)));
    __m256i r = _mm256_and_si256(up_one, t);
    r = _mm256_blendv_epi8(r, _mm256_add_epi64(_mm256_slli_epi64(t, 24), lo), same);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(top + i), _mm256_andnot_si256(dead, r));
  }
  portable::exact_lift(mine + i, level + i, top + i, low + i, n - i);
}

void exact_sums_to_float(const std::int64_t* sum, const std::uint8_t* level, float* dst, std::size_t n) {
  const __m128 nan = _mm_castsi128_ps(_mm_set1_epi32(0x7fc00000));
  std::size_t i = 0;
  for (; i + 4 <= n; i += 4) {
    const __m256i l = load_levels4(level + i);
    const __m128 f = exact_to_float4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sum + i)),
                                     _mm256_sub_epi64(times24(l), _mm256_set1_epi64x(174)));
    const __m128i l32 = _mm_cvtepu8_epi32(_mm_loadu_si32(level + i));
    const __m128 r = _mm_andnot_ps(_mm_castsi128_ps(_mm_cmpeq_epi32(l32, _mm_setzero_si128())), f);
    _mm_storeu_ps(dst + i, _mm_blendv_ps(r, nan, _mm_castsi128_ps(_mm_cmpeq_epi32(l32, _mm_set1_epi32(127)))));
  }
  portable::exact_sums_to_float(sum + i, level + i, dst + i, n - i);
}

// exact_combine_packed and exact_combine_packed_raw, as kernels_avx512.cpp's (the method is
// described there), 4 words at a time with AVX2's means: no 64-bit arithmetic shift, so a
// 30-bit field is taken by a logical shift and a mask and sign-extended by (x ^ 2^29) - 2^29;
// no vscalefps, so a last value goes to G's low grid in double (multiplied by 2^(174 - 24 G),
// exact: |v| / 2^b(G - 1) < 2^47), and is rounded to an integer by adding 1.5 * 2^52, whose
// bits then hold it (the bits of the ranks' sums of such doubles, less ranks times the
// constant's bits, are their integers' sum: every addend lies in [2^52, 2^53)).

/// sum plus the words w lifted to levels g (exact::elem::packed_lifted on 4 int64 lanes).
__m256i add_lifted4(__m256i sum, __m256i w, __m256i g, __m256i g_minus_1) {
  const __m256i sign = _mm256_set1_epi64x(std::int64_t{1} << 29);
  const __m256i l = _mm256_and_si256(w, _mm256_set1_epi64x(15));
  const __m256i top = _mm256_sub_epi64(
      _mm256_xor_si256(_mm256_and_si256(_mm256_srli_epi64(w, 4), _mm256_set1_epi64x(0x3fffffff)), sign), sign);
  const __m256i low = _mm256_sub_epi64(_mm256_xor_si256(_mm256_srli_epi64(w, 34), sign), sign);
  sum = _mm256_add_epi64(sum, _mm256_and_si256(_mm256_cmpeq_epi64(l, g),
                                               _mm256_add_epi64(_mm256_slli_epi64(top, 24), low)));
  return _mm256_add_epi64(sum, _mm256_and_si256(_mm256_cmpeq_epi64(l, g_minus_1), top));
}

/// 4 elements from j: every rank's word (and, with last, its last value) at the highest level
/// G among them and g (the last values' levels, 4 int64 lanes), rounded once to fp32; the
/// quiet NaN where G is the non-finite level.
__m128 combine_packed4(const std::uint64_t* const* words, const float* const* last, int ranks,
                       std::size_t j, __m256i g) {
  const __m256i fifteen = _mm256_set1_epi64x(15);
  for (int r = 0; r < ranks; ++r) {  // levels below 16: the unsigned 32-bit max of each low dword
    SHARDOPT_PREFETCH_AHEAD(words[r] + j, kExactPrefetchElems * sizeof(std::uint64_t));
    g = _mm256_max_epu32(g, _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(words[r] + j)), fifteen));
  }
  const __m256i g_minus_1 = _mm256_sub_epi64(g, _mm256_set1_epi64x(1));
  const __m256i grid = _mm256_sub_epi64(times24(g), _mm256_set1_epi64x(174));  // b(G - 1)
  __m256i sum = _mm256_setzero_si256();
  if (last == nullptr) {
    for (int r = 0; r < ranks; ++r)
      sum = add_lifted4(sum, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(words[r] + j)), g, g_minus_1);
  } else {
    const __m256d magic = _mm256_set1_pd(0x1.8p52);
    const __m256d down = pow2_pd(_mm256_sub_epi64(_mm256_setzero_si256(), grid));
    __m256i raw = _mm256_setzero_si256();
    for (int r = 0; r < ranks; ++r) {
      sum = add_lifted4(sum, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(words[r] + j)), g, g_minus_1);
      raw = _mm256_add_epi64(raw, _mm256_castpd_si256(_mm256_add_pd(
                                      _mm256_mul_pd(_mm256_cvtps_pd(_mm_loadu_ps(last[r] + j)), down), magic)));
    }
    sum = _mm256_add_epi64(sum, _mm256_sub_epi64(raw, _mm256_set1_epi64x(static_cast<std::int64_t>(
                                                          static_cast<std::uint64_t>(ranks) * kMagicBits))));
  }
  const __m256i nonfinite = _mm256_cmpeq_epi64(g, fifteen);
  const __m128 nonfinite4 = _mm_shuffle_ps(_mm256_castps256_ps128(_mm256_castsi256_ps(nonfinite)),
                                           _mm256_extractf128_ps(_mm256_castsi256_ps(nonfinite), 1), _MM_SHUFFLE(2, 0, 2, 0));
  return _mm_blendv_ps(exact_to_float4(sum, grid), _mm_castsi128_ps(_mm_set1_epi32(0x7fc00000)), nonfinite4);
}

void exact_combine_packed(const std::uint64_t* const* src, int ranks, float* dst, std::size_t n) {
  if (ranks > kExactCombineMaxSimdRanks) return portable::exact_combine_packed(src, ranks, dst, n);
  std::size_t i = 0;
  for (; i + 4 <= n; i += 4)
    _mm_storeu_ps(dst + i, combine_packed4(src, nullptr, ranks, i, _mm256_setzero_si256()));
  portable::exact_combine_packed_tail(src, ranks, dst, i, n);
}

// The last values' level, 8 at a time: the level of the largest magnitude (levels grow with
// the exponent field e), ((e + 24) * 2731) >> 16 = (e + 24) / 24; 0 for zeros, 15 for NaN/Inf.
void exact_combine_packed_raw(const std::uint64_t* const* words, const float* const* last, int ranks,
                              float* dst, std::size_t n) {
  if (ranks > kExactCombineMaxSimdRanks) return portable::exact_combine_packed_raw(words, last, ranks, dst, n);
  const __m256i abs_mask = _mm256_set1_epi32(0x7fffffff);
  const __m256i zero = _mm256_setzero_si256();
  std::size_t i = 0;
  for (; i + kW <= n; i += kW) {
    __m256i big = zero;
    for (int r = 0; r < ranks; ++r) {
      SHARDOPT_PREFETCH_AHEAD(last[r] + i, kExactPrefetchElems * sizeof(float));
      big = _mm256_max_epu32(big, _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(last[r] + i)), abs_mask));
    }
    __m256i lv = _mm256_srli_epi32(
        _mm256_mullo_epi32(_mm256_add_epi32(_mm256_srli_epi32(big, 23), _mm256_set1_epi32(24)), _mm256_set1_epi32(2731)), 16);
    lv = _mm256_andnot_si256(_mm256_cmpeq_epi32(big, zero), lv);
    lv = _mm256_blendv_epi8(lv, _mm256_set1_epi32(15), _mm256_cmpgt_epi32(big, _mm256_set1_epi32(0x7f7fffff)));
    const __m128 lo = combine_packed4(words, last, ranks, i, _mm256_cvtepu32_epi64(_mm256_castsi256_si128(lv)));
    const __m128 hi = combine_packed4(words, last, ranks, i + 4, _mm256_cvtepu32_epi64(_mm256_extracti128_si256(lv, 1)));
    // The store comes after every load of these 8 elements: dst may be one of last[].
    _mm256_storeu_ps(dst + i, _mm256_insertf128_ps(_mm256_castps128_ps256(lo), hi, 1));
  }
  portable::exact_combine_packed_raw_tail(words, last, ranks, dst, i, n);
}

// exact_deposit_packed, 8 values (two vectors of 4 words) at a time, in fp32 on the words'
// fields, as kernels_avx512.cpp's exact_deposit_packed (whose comment shows why each step is
// exact), with AVX2's means: the wanted level ((e + 24) * 2731) >> 16 by a 16-bit high
// multiply ((e + 24) < 2^16 sits in each lane's low half), 2^-b(L) as float bits
// (277 - 24 L) << 23 (2^126 .. 2^-114, normal), the parts rounded by vroundps and converted
// exactly, and the fields added modulo 2^30 by masks.
// exact_deposit_packed_multi: the words stay in registers while every source's 8 values are
// deposited in turn.
void exact_deposit_packed_multi(const float* const* g, int nsrc, std::size_t n, const std::uint64_t* in,
                                std::uint64_t* out) {
  const __m256i abs_mask = _mm256_set1_epi32(0x7fffffff);
  const __m256i zero = _mm256_setzero_si256();
  const __m256i fifteen32 = _mm256_set1_epi32(15);
  const __m256i one32 = _mm256_set1_epi32(1);
  const __m256i three32 = _mm256_set1_epi32(3);
  const __m256i top_field = _mm256_set1_epi64x(std::int64_t{0x3fffffff} << 4);
  const __m256i nonfinite_word = _mm256_set1_epi64x(15);
  const __m256 two24 = _mm256_set1_ps(0x1p24f);
  constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    if (in != nullptr) SHARDOPT_PREFETCH_AHEAD(in + i, kExactPrefetchElems * sizeof(std::uint64_t));
    __m256i w0 = in == nullptr ? zero : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(in + i));
    __m256i w1 = in == nullptr ? zero : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(in + i + 4));
    bool changed = false;
    for (int src = 0; src < nsrc; ++src) {
      SHARDOPT_PREFETCH_AHEAD(g[src] + i, kExactPrefetchElems * sizeof(float));
      const __m256 v = _mm256_loadu_ps(g[src] + i);
      const __m256i a = _mm256_and_si256(_mm256_castps_si256(v), abs_mask);
      if (_mm256_testz_si256(a, a)) continue;  // all zero
      changed = true;
      // The words' levels: the low dword of each word, in element order, its low 4 bits.
      const __m256i l = _mm256_and_si256(
          _mm256_permute4x64_epi64(_mm256_castps_si256(_mm256_shuffle_ps(_mm256_castsi256_ps(w0), _mm256_castsi256_ps(w1),
                                                                         _MM_SHUFFLE(2, 0, 2, 0))),
                                   _MM_SHUFFLE(3, 1, 2, 0)),
          fifteen32);
      const __m256i nonzero = _mm256_xor_si256(_mm256_cmpeq_epi32(a, zero), _mm256_set1_epi32(-1));
      const __m256i active = _mm256_andnot_si256(_mm256_cmpeq_epi32(l, fifteen32), nonzero);
      const __m256i bad = _mm256_and_si256(active, _mm256_cmpgt_epi32(a, _mm256_set1_epi32(0x7f7fffff)));
      const __m256i fin = _mm256_andnot_si256(bad, active);
      const __m256i want = _mm256_mulhi_epu16(_mm256_add_epi32(_mm256_srli_epi32(a, 23), _mm256_set1_epi32(24)),
                                              _mm256_set1_epi32(2731));
      const __m256i rise = _mm256_and_si256(fin, _mm256_cmpgt_epi32(want, l));
      const __m256i level = _mm256_blendv_epi8(l, want, rise);
      const __m256i fin0 = _mm256_cvtepi32_epi64(_mm256_castsi256_si128(fin));
      const __m256i fin1 = _mm256_cvtepi32_epi64(_mm256_extracti128_si256(fin, 1));
      if (!_mm256_testz_si256(_mm256_or_si256(rise, bad), _mm256_or_si256(rise, bad))) {
        // A rise by one: the top field becomes the low one; by more, or from empty: an empty
        // word; then the new level (as kernels_avx512.cpp).
        const __m256i clear = _mm256_and_si256(
            rise, _mm256_or_si256(_mm256_cmpeq_epi32(l, zero), _mm256_cmpgt_epi32(want, _mm256_add_epi32(l, one32))));
        const __m256i down = _mm256_andnot_si256(clear, rise);
        for (int h = 0; h < 2; ++h) {
          __m256i& w = h == 0 ? w0 : w1;
          const auto half = [h](__m256i x) {
            return _mm256_cvtepi32_epi64(h == 0 ? _mm256_castsi256_si128(x) : _mm256_extracti128_si256(x, 1));
          };
          const __m256i moved = _mm256_slli_epi64(_mm256_srli_epi64(_mm256_slli_epi64(w, 30), 34), 34);
          w = _mm256_blendv_epi8(w, moved, half(down));
          w = _mm256_andnot_si256(half(clear), w);
          w = _mm256_or_si256(w, _mm256_and_si256(half(rise), half(level)));
          w = _mm256_blendv_epi8(w, nonfinite_word, half(bad));
        }
      }
      // The two parts at the level's grids.
      const __m256 scale = _mm256_castsi256_ps(_mm256_slli_epi32(
          _mm256_sub_epi32(_mm256_set1_epi32(277), _mm256_add_epi32(_mm256_slli_epi32(level, 4), _mm256_slli_epi32(level, 3))), 23));
      const __m256 sv = _mm256_mul_ps(v, scale);
      const __m256 hi = _mm256_round_ps(sv, kRound);
      const __m256i hi32 = _mm256_cvttps_epi32(hi);
      const __m256i lo32 = _mm256_cvttps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_sub_ps(sv, hi), two24), kRound));
      // Each element's parts as a word (hi's low 30 bits at bit 4, lo's at bit 34), in order.
      const __m256i part_lo = _mm256_slli_epi32(hi32, 4);
      const __m256i part_hi = _mm256_or_si256(_mm256_slli_epi32(lo32, 2), _mm256_and_si256(_mm256_srli_epi32(hi32, 28), three32));
      const __m256i u_lo = _mm256_unpacklo_epi32(part_lo, part_hi);  // elements 0, 1, 4, 5
      const __m256i u_hi = _mm256_unpackhi_epi32(part_lo, part_hi);  // elements 2, 3, 6, 7
      const __m256i p0 = _mm256_permute2x128_si256(u_lo, u_hi, 0x20);
      const __m256i p1 = _mm256_permute2x128_si256(u_lo, u_hi, 0x31);
      // Field by field (modulo 2^30 each): the top field from w + p, the low field from w + p
      // without the top field's carry.
      const auto add_fields = [&](__m256i w, __m256i p) {
        return _mm256_or_si256(_mm256_and_si256(top_field, _mm256_add_epi64(w, p)),
                               _mm256_andnot_si256(top_field, _mm256_add_epi64(w, _mm256_andnot_si256(top_field, p))));
      };
      w0 = _mm256_blendv_epi8(w0, add_fields(w0, p0), fin0);
      w1 = _mm256_blendv_epi8(w1, add_fields(w1, p1), fin1);
    }
    if (changed || in != out) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), w0);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i + 4), w1);
    }
  }
  for (int src = 0; src < nsrc; ++src)
    portable::exact_deposit_packed(g[src] + i, n - i, src == 0 ? (in == nullptr ? nullptr : in + i) : out + i, out + i);
}

void exact_deposit_packed(const float* g, std::size_t n, const std::uint64_t* in, std::uint64_t* out) {
  exact_deposit_packed_multi(&g, 1, n, in, out);
}
}  // namespace
}  // namespace shardopt::cpu::avx2

namespace shardopt::cpu {

const RangeKernels kAvx2Kernels = {
    "avx2",
    avx2::adam,
    avx2::lion,
    avx2::cast_f32_to_bf16,
    avx2::cast_bf16_to_f32,
    avx2::accumulate_f32,
    avx2::accumulate_bf16,
    avx2::sum_squares_block,
    avx2::sum_squares_blocks,
    avx2::any_nonfinite,
    avx2::scale,
    avx2::fill_zero,
    avx2::exact_combine,
    avx2::exact_square_add,
    avx2::exact_combine_packed,
    portable::exact_deposit,
    avx2::adamw8bit_blocks,
    avx2::q8_quantize,
    portable::exact_deposit_pack,
    avx2::exact_levels,
    avx2::exact_round_to_levels,
    avx2::exact_lift,
    avx2::exact_sums_to_float,
    avx2::exact_deposit_packed,
    avx2::exact_combine_packed_raw,
    avx2::exact_deposit_packed_multi,
};

}  // namespace shardopt::cpu
