// kernels.hpp: the CPU kernels of the step: one pass each, vectorized and threaded.
//
// Each kernel runs the instruction set chosen at run time (see Isa below) on chunks of a
// static OpenMP partition. Every kernel is elementwise or reduces in an order fixed by n
// alone, so results do not depend on the number of threads, and the SIMD paths compute
// bit for bit what the portable path computes (no FMA; see docs/performance.md).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>

#include "shardopt/adam_math.hpp"
#include "shardopt/lion_math.hpp"
#include "shardopt/bf16.hpp"
#include "../exact_element.hpp"

namespace shardopt::cpu {

// ---- kernels ---------------------------------------------------------------------------------

/// Fused AdamW / Adam-L2 over segments tiling [0, n): reads master, grad, m, v once, writes
/// master, m, v and (if not null) the bf16 or fp32 replica copy of the new weights.
void adam_update(const StepScalars& s, std::span<const UpdateSegment> segments, float* master,
                 const float* grad, float* m, float* v, bf16* out_bf16, float* out_f32);

/// Lion over segments covering [segments.front().begin, segments.back().end) of master,
/// grad and m (the momentum), writing the replica copy as adam_update does.
void lion_update(std::span<const LionSegment> segments, float* master, const float* grad,
                 float* m, bf16* out_bf16, float* out_f32);

/// Round to nearest even, bit-identical to float_to_bf16_bits() (NaN -> sign | 0x7FC0).
void cast_f32_to_bf16(const float* src, bf16* dst, std::size_t n);
void cast_bf16_to_f32(const bf16* src, float* dst, std::size_t n);
/// dst[i] += src[i] (one fp32 rounding).
void accumulate(float* dst, const float* src, std::size_t n);
void accumulate(float* dst, const bf16* src, std::size_t n);

/// Sum of squares in double. The order is fixed: blocks of kSumBlock elements; inside a block
/// element k goes to lane k % kSumLanes, lanes are folded pairwise (lane j += lane j + w for
/// w = 8, 4, 2, 1); block partials are added in block order. Squares of floats are exact in
/// double, so every path (and every thread count) returns the same bits.
inline constexpr std::size_t kSumBlock = 8192;
inline constexpr std::size_t kSumLanes = 16;
double sum_squares(const float* x, std::size_t n);
/// False if any element is NaN or +-Inf.
bool all_finite(const float* x, std::size_t n);
/// x[i] *= factor (e.g. the clipping coefficient).
void scale(float* x, std::size_t n, float factor);
void fill_zero(float* x, std::size_t n);

// ---- reproducible mode's exact arithmetic (src/exact_sum.hpp defines the method) -------------

/// An exact sum of squares of fp32 values: the integer sum of v^2 / 2^kBase held in 32-bit
/// digits (a digit word may exceed 32 bits until normalize()), plus counts of NaN and Inf.
/// Every fp32 square is an integer multiple of 2^-298, so every split of the values among
/// threads or ranks gives the same integer.
struct SquareDigits {
  static constexpr int kDigits = 22;  ///< 2^-352 .. 2^352
  static constexpr int kBase = -352;
  std::array<std::uint64_t, kDigits> digit{};
  std::uint64_t pending = 0;  ///< additions since the last normalize(): each below 2^33
  double nans = 0;
  double infs = 0;
  /// Adds v^2 (NaN and +-Inf are counted instead).
  void add(float v);
  /// Adds value * 2^exp2 (value < 2^62, exp2 >= kBase, the result below 2^(kBase + 32 * kDigits)).
  void add_scaled(std::uint64_t value, int exp2);
  void normalize();
  /// Adds another sum (both are normalised).
  void merge(SquareDigits& other);
};

/// The exponent g of the grid that reproducible mode rounds a value to, from the largest
/// biased exponent field `e` (0..254) among an element's values: the level L = (e + 24) / 24
/// (at least 1) and g = b(L - 1) = 24 L - 174 (exact_sum.hpp: kBinBits 24, kBase -150).
constexpr int exact_grid_exponent(std::uint32_t e) { return exact::elem::grid_exponent(e); }

/// n * 2^e rounded once to fp32 (to nearest even, subnormals included, Inf past the range),
/// for any int64 n and -900 <= e <= 900: the one rounding of reproducible mode's exact sums.
float exact_to_float(std::int64_t n, int e);

/// Ranks above this take the int64 path of exact_combine (the SIMD paths sum in doubles: each
/// rounded value is below 2^47 in magnitude, so 64 of them sum exactly).
inline constexpr int kExactCombineMaxSimdRanks = 64;

/// Reproducible mode's sum of one value per rank (the direct exchange): for each i,
///   dst[i] = RNE32(2^g * sum over r of RNE(src[r][i] / 2^g)),
/// g = exact_grid_exponent(the largest exponent field among src[.][i]), the quiet NaN if any
/// src[r][i] is NaN or +-Inf; and the exact squares of dst join `squares` (if not null). Bit
/// for bit what exact::ExactGrads computes for one micro-batch per rank, on every ISA and
/// thread count. dst may be one of the sources (the same pointer), not otherwise overlap them.
void exact_combine(const float* const* src, int ranks, float* dst, std::size_t n,
                   SquareDigits* squares);
/// The exact squares of x[0, n) join `squares`.
void exact_square_add(const float* x, std::size_t n, SquareDigits& squares);

/// Reproducible mode's deposit of one micro-batch into the exact bins of exact_sum.hpp (the
/// accumulator's arrays: level per element, 0 empty, 1-11, 127 non-finite; top and low bins
/// in units of 2^b(level) and 2^b(level - 1)): each nonzero g[i] raises the level if it needs
/// a higher one (a rise by one moves top into low, by more clears both), then adds its parts
/// round(g / 2^b) and round(rest / 2^b(level - 1)) (nearest even); NaN or Inf marks the
/// element non-finite. The same bits on every ISA and thread count.
void exact_deposit(const float* g, std::size_t n, std::int64_t* top, std::int64_t* low,
                   std::uint8_t* level);

/// The packed state (exact_pack) that exact_deposit of g would leave, without changing the
/// bins: the last micro-batch of a step goes straight to the exchange.
void exact_deposit_pack(const float* g, std::size_t n, const std::int64_t* top,
                        const std::int64_t* low, const std::uint8_t* level, std::uint64_t* out);

/// Reproducible mode's packed per-element state (several micro-batches on a rank): one 64-bit
/// word per element, bits 0-3 the level (0 empty, 1-11, kPackedNonFinite), bits 4-33 the top
/// bin and bits 34-63 the low bin as signed 30-bit integers (exact for up to
/// kPackedMaxMicroBatches values per rank: each adds at most 2^23 to either bin).
using exact::elem::kPackedNonFinite;
inline constexpr int kPackedMaxMicroBatches = 63;
/// out[i] = the packed word of level[i] (0: empty, whatever the bins hold; 127: non-finite),
/// top[i], low[i].
void exact_pack(const std::uint8_t* level, const std::int64_t* top, const std::int64_t* low,
                std::uint64_t* out, std::size_t n);
/// Reproducible mode's compact accumulation (exact::ExactGrads's packed form: the packed
/// word is the accumulator while every element received at most kPackedMaxMicroBatches
/// values): out[i] = the packed word of the state in[i] (all empty when in is null) with g[i]
/// deposited, bit for bit exact_pack of what exact_deposit of g leaves in the bins that in[i]
/// packs. `in` may be `out` (the deposit in place: 4 bytes read and 8 read and written per
/// element) or another buffer (the last micro-batch into the exchange's wire buffer); the
/// words of `in` must hold fewer than kPackedMaxMicroBatches values each.
void exact_deposit_packed(const float* g, std::size_t n, const std::uint64_t* in, std::uint64_t* out);
/// exact_deposit_packed, and g[0, n) = +0 in the same pass (each grain of g cleared right
/// after the kernel has read it, while still in cache): the micro-batch consumed, the buffer
/// ready for the next one. The words are exact_deposit_packed's, bit for bit.
void exact_deposit_packed_clear(float* g, std::size_t n, const std::uint64_t* in, std::uint64_t* out);
/// exact_deposit_packed of g[0], then of g[1], ... g[nsrc - 1] into the result (no source:
/// the words of `in`, or empty ones), in one pass where the ISA has it (AVX-512 and AVX2: the
/// words stay in registers; the portable path: one pass per source): the sharded
/// accumulation's owner depositing every rank's values. The same bits; `in` as for
/// exact_deposit_packed (null: the words start empty).
void exact_deposit_packed_multi(const float* const* g, int nsrc, std::size_t n, const std::uint64_t* in,
                                std::uint64_t* out);
/// The packed words' bins unpacked (the two-phase method's form, past kPackedMaxMicroBatches):
/// level[i] 0, 1-11 or 127 (non-finite), top[i] and low[i] the bins (0 for empty and
/// non-finite elements). The inverse of exact_pack.
void exact_unpack(const std::uint64_t* words, std::size_t n, std::uint8_t* level, std::int64_t* top,
                  std::int64_t* low);
/// The two-phase result from every rank's packed state: for each i, with G the largest level
/// among src[.][i], dst[i] = RNE32(2^b(G-1) * sum over r of the state lifted to G: top * 2^24 +
/// low at level G, top at G - 1, nothing below), +0 when every state is empty, the quiet NaN
/// when any is non-finite; the exact squares of dst join `squares` (if not null). Bit for
/// bit what exact::ExactGrads::reduce computes from the same bins.
void exact_combine_packed(const std::uint64_t* const* src, int ranks, float* dst, std::size_t n,
                          SquareDigits* squares);
/// The packed exchange with the last micro-batch deposited at the owner: bit for bit
/// exact_deposit_packed(last[r], n, words[r], w_r) for every rank r followed by
/// exact_combine_packed(w, ranks, dst, n, squares), in one pass that stores no w_r: each
/// last value is rounded straight to its element's final grid (exact::elem::combine_packed_raw,
/// which says why that is the deposit's result), so no deposit runs at all. words[r] all zero
/// is an empty state (a rank that deposited nothing). dst may be one of last[] (the same
/// pointer).
void exact_deposit_combine_packed(const std::uint64_t* const* words, const float* const* last, int ranks,
                                  float* dst, std::size_t n, SquareDigits* squares);

/// The two-phase method (exact::ExactGrads::reduce, the fallback of transports that offer
/// only built-in reductions), one pass each. Levels are exact_deposit's encoding (0 empty,
/// 1-11, 127 non-finite); b(L) = 24 L - 150, so level L's low grid is 2^(24 L - 174).
///
/// level[i] = the level of g[i] alone: 0 for +-0, 127 for NaN or +-Inf, else (e + 24) / 24
/// with e its biased exponent field (subnormals: level 1).
void exact_levels(const float* g, std::size_t n, std::uint8_t* level);
/// out[i] = round(g[i] / 2^(24 level[i] - 174)) (nearest even) where level[i] is 1-11 (the
/// element's level over every rank, at least g[i]'s own: |g[i]| then rounds to below 2^47),
/// else 0.
void exact_round_to_levels(const float* g, std::size_t n, const std::uint8_t* level,
                           std::int64_t* out);
/// Each element's bins at its own level mine[i] lifted to level[i] >= mine[i] and packed
/// into one int64 in top's place: top * 2^24 + low at the same level, top one level up,
/// 0 two or more up; 0 as well when mine[i] is empty or level[i] is non-finite.
void exact_lift(const std::uint8_t* mine, const std::uint8_t* level, std::int64_t* top,
                const std::int64_t* low, std::size_t n);
/// dst[i] = exact_to_float(sum[i], 24 level[i] - 174) for levels 1-11, +0 for level 0, the
/// quiet NaN for 127 (the one rounding of the two-phase sums).
void exact_sums_to_float(const std::int64_t* sum, const std::uint8_t* level, float* dst,
                         std::size_t n);

// ---- instruction set -------------------------------------------------------------------------

enum class Isa { Portable, Avx2, Avx512 };

const char* isa_name(Isa isa);
/// Compiled in and supported by this CPU (and its OS).
bool isa_supported(Isa isa);
/// The widest supported ISA: what runs unless SHARDOPT_CPU_ISA or set_isa() says otherwise.
Isa best_isa();
/// The ISA the kernels use now. The first call reads SHARDOPT_CPU_ISA (portable, avx2,
/// avx512); an unknown name throws Error(InvalidArgument), an unsupported one
/// Error(Unsupported).
Isa active_isa();
/// Forces an ISA for all later calls (tests, benchmarks); throws Error(Unsupported) if the
/// CPU lacks it. Not to be called while kernels run on other threads.
void set_isa(Isa isa);

/// When the write-only outputs (bf16/fp32 copies, cast destinations) use non-temporal
/// stores. Auto streams when a call touches more than kStreamMinBytes, so small arrays stay
/// in cache for the next kernel. The first call reads SHARDOPT_CPU_STREAM (auto, always,
/// never). Results are identical under every policy.
enum class StreamPolicy { Auto, Always, Never };
inline constexpr std::size_t kStreamMinBytes = std::size_t{64} << 20;
StreamPolicy stream_policy();
void set_stream_policy(StreamPolicy p);

}  // namespace shardopt::cpu
