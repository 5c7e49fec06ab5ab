// kernel_table.hpp: the single-threaded range kernels that each ISA file provides.
//
// kernels.cpp threads them (static OpenMP chunks); dispatch.cpp picks one table at run time.
// The SIMD files (kernels_avx2.cpp, kernels_avx512.cpp) are compiled with ISA flags, so they
// must not call inline functions from other headers (adam_element, float_to_bf16_bits,
// <cmath>): the linker could keep their AVX copy for the whole program. They hand heads and
// tails to the portable range kernels instead, which are the reference arithmetic.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels.hpp"
#include "shardopt/adam_math.hpp"
#include "shardopt/bf16.hpp"
#include "shardopt/lion_math.hpp"

namespace shardopt::cpu {

/// An 8-bit quantization map as AdamW8bit's SIMD kernels read it (src/rules/qmap.hpp's Qmap):
/// its 256 values and its SIMD quantizer entries, [neg * kQ8Buckets + max(bits(|y|) >> 16,
/// kQ8Low) - kQ8Low] = base | (lim - 1) << 16 (rules::q8::simd_entries()): the code of y is
/// base + (key > lim - 1), key = the low 16 bits of y, complemented for y <= -0.
struct Q8Map {
  const float* value;
  const std::uint32_t* entry;
};
/// The entries' first bucket and buckets per sign (kSimdLow and kSimdBuckets in qmap.hpp;
/// src/rules/adamw8bit.cpp checks that they agree), constants so that they cost no register.
inline constexpr std::uint32_t kQ8Low = 0x3400u;
inline constexpr std::uint32_t kQ8Buckets = 0x7FFFu - kQ8Low + 1;

struct RangeKernels {
  const char* name;
  /// Pointers already offset to the range start; stream: non-temporal stores for outputs.
  void (*adam)(const StepScalars& s, const SegmentScalars& g, float* p, const float* grad,
               float* m, float* v, bf16* out_bf16, float* out_f32, std::size_t n, bool stream);
  /// Lion (lion_element) on one range: reads p, grad, m once, writes p, m and the replica.
  void (*lion)(const LionScalars& s, float* p, const float* grad, float* m, bf16* out_bf16,
               float* out_f32, std::size_t n);
  void (*cast_f32_to_bf16)(const float* src, bf16* dst, std::size_t n, bool stream);
  void (*cast_bf16_to_f32)(const bf16* src, float* dst, std::size_t n, bool stream);
  void (*accumulate_f32)(float* dst, const float* src, std::size_t n);
  void (*accumulate_bf16)(float* dst, const bf16* src, std::size_t n);
  /// One block (n <= kSumBlock) in the lane order documented in kernels.hpp.
  double (*sum_squares_block)(const float* x, std::size_t n);
  /// `blocks` full blocks of kSumBlock elements: out[b] is sum_squares_block of block b, bit
  /// for bit. The SIMD tables work on kSumGroup blocks at once, each in its own accumulators:
  /// one block's lanes form two (AVX-512) or four (AVX2) chains of dependent additions, so a
  /// single block waits on the adder's latency, while several blocks keep it busy.
  void (*sum_squares_blocks)(const float* x, std::size_t blocks, double* out);
  bool (*any_nonfinite)(const float* x, std::size_t n);
  void (*scale)(float* x, std::size_t n, float factor);
  /// x[0, n) = +0; stream: non-temporal stores (a large buffer is not read back soon, and
  /// ordinary stores would read every line before writing it: twice the traffic).
  void (*fill_zero)(float* x, std::size_t n, bool stream);
  /// exact_combine (kernels.hpp) on one range, without the squares.
  void (*exact_combine)(const float* const* src, int ranks, float* dst, std::size_t n);
  /// exact_square_add on one range: the SIMD tables take each run of kExactChunk values
  /// relative to its largest exponent (a fixed-point sum of 96 bits per lane) and hand values
  /// more than 2^24 times smaller, NaN and Inf to SquareDigits::add.
  void (*exact_square_add)(const float* x, std::size_t n, SquareDigits& squares);
  /// exact_combine_packed (kernels.hpp) on one range, without the squares.
  void (*exact_combine_packed)(const std::uint64_t* const* src, int ranks, float* dst, std::size_t n);
  /// exact_deposit (kernels.hpp) on one range.
  void (*exact_deposit)(const float* g, std::size_t n, std::int64_t* top, std::int64_t* low,
                        std::uint8_t* level);
  /// `blocks` whole AdamW8bit blocks of 256 elements in one segment (src/rules/adamw8bit.hpp):
  /// bitwise the portable rules::q8::adamw8bit_block on each, scale_m[b] and scale_v[b] the
  /// scales of block b. Many blocks per call, so the constants stay in registers and one
  /// block's requantization overlaps the next one's update. Null where the ISA has none (the
  /// caller runs the portable block).
  void (*adamw8bit_blocks)(const StepScalars& s, const SegmentScalars& g, float* p,
                           const float* grad, std::uint8_t* code_m, std::uint8_t* code_v,
                           float* scale_m, float* scale_v, bf16* out_bf16, float* out_f32,
                           std::size_t blocks, const Q8Map& qs, const Q8Map& qu);
  /// The codes of y[0, n) as the block kernels compute them (for the tests): bitwise
  /// rules::q8::quantize for every float y, NaN and infinities included; nonneg: the path for
  /// a map without negative thresholds (the unsigned map), which skips the sign. Null with
  /// adamw8bit_blocks.
  void (*q8_quantize)(const float* y, std::size_t n, const Q8Map& q, bool nonneg,
                      std::uint8_t* code);
  /// exact_deposit_pack (kernels.hpp) on one range.
  void (*exact_deposit_pack)(const float* g, std::size_t n, const std::int64_t* top,
                             const std::int64_t* low, const std::uint8_t* level, std::uint64_t* out);
  /// The two-phase method's passes (kernels.hpp) on one range.
  void (*exact_levels)(const float* g, std::size_t n, std::uint8_t* level);
  void (*exact_round_to_levels)(const float* g, std::size_t n, const std::uint8_t* level,
                                std::int64_t* out);
  void (*exact_lift)(const std::uint8_t* mine, const std::uint8_t* level, std::int64_t* top,
                     const std::int64_t* low, std::size_t n);
  void (*exact_sums_to_float)(const std::int64_t* sum, const std::uint8_t* level, float* dst,
                              std::size_t n);
  /// exact_deposit_packed (kernels.hpp) on one range.
  void (*exact_deposit_packed)(const float* g, std::size_t n, const std::uint64_t* in, std::uint64_t* out);
  /// exact_deposit_combine_packed (kernels.hpp) on one range, without the squares: element by
  /// element exact::elem::combine_packed_raw (no deposit is stored).
  void (*exact_combine_packed_raw)(const std::uint64_t* const* words, const float* const* last,
                                   int ranks, float* dst, std::size_t n);
  /// exact_deposit_packed_multi (kernels.hpp) on one range, nsrc >= 1. Null where the ISA has
  /// none: the caller deposits the sources one by one (exact_deposit_packed, the same bits).
  void (*exact_deposit_packed_multi)(const float* const* g, int nsrc, std::size_t n,
                                     const std::uint64_t* in, std::uint64_t* out);
};

/// Values per fixed-point window of the SIMD exact_square_add: each lane adds at most
/// kExactChunk / 4 values below 2^48, so its two 64-bit words cannot overflow.
inline constexpr std::size_t kExactChunk = 4096;

/// How far ahead (in elements) the SIMD exact combines and deposits ask for every source: with
/// two or three streams per rank the hardware prefetchers fell behind (docs/performance.md,
/// "The owners' combine: prefetching", A/B of the distance).
inline constexpr std::size_t kExactPrefetchElems = 512;
/// A prefetch hint for the cache line `bytes` past p, for the SIMD files (which include
/// <immintrin.h>). A hint never faults, so one past a buffer's end is harmless; the address is
/// formed in integers, so no pointer past the end is.
#define SHARDOPT_PREFETCH_AHEAD(p, bytes) \
  _mm_prefetch(reinterpret_cast<const char*>(reinterpret_cast<std::uintptr_t>(p) + (bytes)), _MM_HINT_T0)

/// The bits of 1.5 * 2^52: an integer n below 2^51 in magnitude added to it as a double gives
/// these bits plus n (the SIMD files' exact double <-> int64 conversions).
inline constexpr std::uint64_t kMagicBits = 0x4338000000000000u;

extern const RangeKernels kPortableKernels;
#if defined(__x86_64__) || defined(_M_X64)
#define SHARDOPT_CPU_X86 1
extern const RangeKernels kAvx2Kernels;
extern const RangeKernels kAvx512Kernels;
#endif

/// The table of the active ISA (see active_isa()); call it outside parallel regions.
const RangeKernels& active_kernels();
/// Whether a call that touches `bytes` in total should stream its write-only outputs.
bool use_streaming_stores(std::size_t bytes);

namespace portable {
// Exposed for the SIMD files' heads and tails.
void adam(const StepScalars& s, const SegmentScalars& g, float* p, const float* grad, float* m,
          float* v, bf16* out_bf16, float* out_f32, std::size_t n, bool stream);
void lion(const LionScalars& s, float* p, const float* grad, float* m, bf16* out_bf16,
          float* out_f32, std::size_t n);
void cast_f32_to_bf16(const float* src, bf16* dst, std::size_t n, bool stream);
void cast_bf16_to_f32(const bf16* src, float* dst, std::size_t n, bool stream);
void accumulate_f32(float* dst, const float* src, std::size_t n);
void accumulate_bf16(float* dst, const bf16* src, std::size_t n);
bool any_nonfinite(const float* x, std::size_t n);
void scale(float* x, std::size_t n, float factor);
void fill_zero(float* x, std::size_t n, bool stream);
/// Adds the tail elements (fewer than kSumLanes) to lanes 0.. and folds the lanes: the one
/// definition of the in-block order.
double finish_sum_lanes(double* lanes, const float* tail, std::size_t tail_n);
void exact_combine(const float* const* src, int ranks, float* dst, std::size_t n);
/// The SIMD combines' tails: elements [from, n) of the same ranges (src[r] not offset), by the
/// portable loops.
void exact_combine_tail(const float* const* src, int ranks, float* dst, std::size_t from, std::size_t n);
void exact_combine_packed_tail(const std::uint64_t* const* src, int ranks, float* dst, std::size_t from,
                               std::size_t n);
void exact_combine_packed_raw_tail(const std::uint64_t* const* words, const float* const* last, int ranks,
                                   float* dst, std::size_t from, std::size_t n);
void exact_square_add(const float* x, std::size_t n, SquareDigits& squares);
/// The largest of lanes[0, nlanes) (exponent fields a SIMD loop collected) and of the biased
/// exponent fields of x[0, n) (its tail).
std::uint32_t max_exponent_field(const std::uint32_t* lanes, int nlanes, const float* x, std::size_t n);
void exact_combine_packed(const std::uint64_t* const* src, int ranks, float* dst, std::size_t n);
void exact_deposit(const float* g, std::size_t n, std::int64_t* top, std::int64_t* low,
                   std::uint8_t* level);
void exact_deposit_pack(const float* g, std::size_t n, const std::int64_t* top,
                        const std::int64_t* low, const std::uint8_t* level, std::uint64_t* out);
void exact_levels(const float* g, std::size_t n, std::uint8_t* level);
void exact_round_to_levels(const float* g, std::size_t n, const std::uint8_t* level, std::int64_t* out);
void exact_lift(const std::uint8_t* mine, const std::uint8_t* level, std::int64_t* top,
                const std::int64_t* low, std::size_t n);
void exact_sums_to_float(const std::int64_t* sum, const std::uint8_t* level, float* dst, std::size_t n);
void exact_deposit_packed(const float* g, std::size_t n, const std::uint64_t* in, std::uint64_t* out);
void exact_combine_packed_raw(const std::uint64_t* const* words, const float* const* last, int ranks,
                              float* dst, std::size_t n);
}  // namespace portable

/// Blocks per call of a SIMD table's interleaved sum of squares (and the OpenMP unit).
inline constexpr std::size_t kSumGroup = 8;

}  // namespace shardopt::cpu
