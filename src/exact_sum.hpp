// exact_sum.hpp: the exact sums of reproducible mode (Reduction::Reproducible).
//
// Gradients. Every flat element keeps a level and two integer bins. Bin boundaries are
// absolute: at level L (1..kMaxLevel) the top bin counts units of 2^b(L) and the low bin
// units of 2^b(L-1), b(L) = kBinBits * L + kBase, and level L holds values with
// |v| < 2^(b(L) + kBinBits - 1). A value is split once into its top part round(v / 2^b(L))
// and the rounded rest of it in units of 2^b(L-1) (round to nearest even, exact double
// arithmetic); what lies below 2^b(L-1) is dropped. An element's level is the highest level
// of the values it received; when it rises by one, the top bin becomes the low bin and the
// old low bin is dropped (by two or more: both are dropped), which is exactly what splitting
// every earlier value at the new level would have given (their top part there is zero). So
// the bins hold a function of the multiset of values deposited and the final level only,
// whatever the order and grouping: summing ranks' bins after lifting them to the highest
// level among all ranks (an integer max) is the same as depositing everything on one rank.
// The sum leaves as one int64 per element (top * 2^kBinBits + low, exact while at most
// kMaxContributions values per element are summed) and is rounded once to fp32.
//
// Error: each value loses at most half a unit of its element's low bin,
// 2^(b(L-1) - 1) <= 2^-kBinBits * (the largest magnitude the element received); the result
// is then rounded to fp32 once (half an ulp).
//
// Norm. The squares of the rounded fp32 gradients are exact doubles; SquareSum adds them
// into a fixed-point accumulator wide enough for every fp32 square (32-bit digits), so the
// sum over any split of the elements among ranks is the same integer.
#pragma once

#include <array>
#include <bit>
#include <cstddef>
#include <cstdint>

#include "cpu/kernels.hpp"
#include "shardopt/comm.hpp"
#include "shardopt/layout.hpp"
#include "shardopt/memory.hpp"
#include "shardopt/options.hpp"

namespace shardopt {
class Backend;
}

namespace shardopt::exact {

inline constexpr int kBinBits = 24;
inline constexpr int kBase = -150;     ///< b(0): level 1's low bin resolves every fp32 subnormal
inline constexpr int kMaxLevel = 11;   ///< holds |v| < 2^137, above every finite fp32
inline constexpr std::uint8_t kEmpty = 0;        ///< no nonzero value received
/// A NaN or Inf was received. Below 128: MPICH 4.0's MPI_MAX on MPI_UINT8_T compares as
/// signed bytes (255 loses to 4), so every level stays in 0..127.
inline constexpr std::uint8_t kNonFinite = 127;
/// Values summed per element (micro-batches over all ranks) for which the packed int64 sum
/// cannot overflow: each value packs to at most 2^47 + 2^23 in magnitude.
inline constexpr std::int64_t kMaxContributions = 65535;

/// 2^b(L), the exponent of level L's top bin.
constexpr int bin_exponent(int level) { return kBinBits * level + kBase; }
/// The lowest level that holds v (finite, nonzero). With E the biased exponent field,
/// 2^(E-127) <= |v| < 2^(E-126) (subnormals: E = 0, below 2^-126); the lowest L with
/// E - 126 <= b(L) + kBinBits - 1 is ceil((E + 1) / 24), at least 1.
inline int level_of(float v) {
  static_assert(kBinBits == 24 && kBase == -150, "level_of assumes these bins");
  const std::uint32_t e = (std::bit_cast<std::uint32_t>(v) >> 23) & 0xffu;
  return static_cast<int>((e + 24) / 24);
}

/// Whether the exchanges of raw values (ExactGrads::reduce_direct, reduce_packed: equal
/// blocks) can reduce bucket `bk`: whole (data-parallel) or cut in equal slices. A ragged
/// bucket of whole-tensor ownership takes the two-phase method (ExactGrads::reduce).
inline bool exchanges(const Bucket& bk, bool whole) { return whole || bk.equal_cut; }
/// Whether some bucket of `layout` takes the two-phase method at every step (see exchanges):
/// its accumulator is then allocated at finalize, not on demand (buffer_plan.hpp).
inline bool ragged_buckets(const FlatLayout& layout, bool whole) {
  for (const Bucket& bk : layout.buckets())
    if (!exchanges(bk, whole)) return true;
  return false;
}

/// Whether reproducible mode takes the sharded exact accumulation at stage 2 or 3 (the name
/// is from when it was stage 2's alone)
/// (BufferPlan::exact_sharded; docs/architecture.md, "Reproducible mode"): stage 2 or 3, the CPU,
/// more than one rank, every bucket cut in equal slices (Flat ownership), and opted into with
/// SHARDOPT_REPRO_EXCHANGE=sharded (the same on every rank). Opt-in because with one
/// micro-batch per rank the full-buffer path needs less memory (4 bytes per element against
/// 21 per owned element) and accepts gradients in any order. The staging must also pay off
/// (plan_buffers: shard + staging below the full buffer; stage 3 stages on any number of
/// ranks above one), else the full-buffer path runs.
bool sharded_stage2(const FlatLayout& layout, Stage stage, Device device);

/// Host bytes of the gradient accumulator of a layout: levels, two bins and a scratch copy
/// of the largest bucket's levels.
std::size_t grads_bytes(std::size_t padded_elems, std::size_t max_bucket_elems);
/// Host bytes of the compact accumulator (ExactGrads::compact): one packed word per element.
std::size_t packed_bytes(std::size_t padded_elems);

/// The exact sum of the squares of fp32 values (the digits are cpu::SquareDigits; the SIMD
/// kernels add them, exact_kernels.cpp).
class SquareSum {
 public:
  void add(const float* x, std::size_t n);
  /// Adds another partial sum (local).
  void merge(SquareSum& other);
  /// Collective: the sum over all ranks (one all-reduce of kDigits + 2 doubles, exact).
  void sum_over_ranks(Communicator& comm);
  /// The sum, rounded to double (NaN if a value was NaN, +Inf if one was infinite).
  double value() const;
  /// The integer itself, for kernels that add to it (and tests that compare sums).
  cpu::SquareDigits& digits() { return d_; }

 private:
  cpu::SquareDigits d_;
};

/// Reproducible mode's gradient accumulator over the whole flat buffer, in the memory of a
/// backend, in one of two forms:
///   - the bins (the constructor; 17 bytes per element, grads_bytes): level, top and low bin
///     per element. deposit() and reduce() run the backend's exact passes (Backend::exact_*:
///     the CPU's kernels, or a device's over device memory with the communicator's integer
///     reductions on it);
///   - the compact form (compact(); CPU only, 8 bytes per element, packed_bytes): the packed
///     word of cpu::exact_pack is the accumulator itself, each micro-batch deposited into it in
///     place (cpu::exact_deposit_packed), exact while every element received at most
///     cpu::kPackedMaxMicroBatches values; reduce_packed() sends it as it is, the last
///     micro-batch deposited on the way into the wire buffer. Before a deposit past that
///     limit, or for the two-phase method (reduce()), the owner widens it (widen(): the bins,
///     unpacked from the words, which are released).
/// With two micro-batches and shared words the first may be held raw in the words' window
/// instead (deposit_and_clear's may_hold, reduce_held(); settle() deposits it).
/// The exchanges reduce_direct() and reduce_packed() run in the memory of the backend they are
/// given (its exact_combine, exact_combine_packed and exact_deposit_pack; the compact form is
/// host memory); pack() is host memory only.
class ExactGrads {
 public:
  ExactGrads() = default;
  /// The bins. storage: grads_bytes(padded, max_bucket) bytes of `backend`'s memory (kept by
  /// reference).
  ExactGrads(Backend& backend, Allocation storage, std::size_t padded_elems,
             std::size_t max_bucket_elems);
  /// The compact form. words: packed_bytes(padded) bytes of host memory; `shared`: memory
  /// that the communicator's peers read in place (a window of
  /// Communicator::allocate_collective_buffer), whose release is collective.
  static ExactGrads compact(Backend& backend, Allocation words, std::size_t padded_elems,
                            bool shared = false);
  /// Whether the state is packed words (compact(), not widened).
  bool is_compact() const { return words_ != nullptr; }
  /// Whether the words are in a communicator window (compact(..., true)): reduce_packed()
  /// then lets each owner deposit every rank's last micro-batch as it combines.
  bool shared() const { return shared_; }
  /// The shared words that widen() kept (their release is collective): released now, on
  /// every rank at the same point (BucketSet does it where every rank widened).
  void release_retired() { retired_ = Allocation(); }
  /// Compact form: whether the next deposit() needs widen() first (every element may have
  /// received cpu::kPackedMaxMicroBatches values since clear()).
  bool full() const { return is_compact() && deposits_ >= cpu::kPackedMaxMicroBatches; }
  /// Compact form: the bins from now on. storage as for the constructor; the words' state is
  /// unpacked into it and the words are released (shared words: kept until
  /// release_retired()). The bins stay for later steps.
  void widen(Allocation storage, std::size_t max_bucket_elems);

  /// Adds one micro-batch's fp32 gradients of flat elements [0, n) (compact form: not full()).
  void deposit(const float* grads, std::size_t n);
  /// deposit(), then grads[0, n) = +0 (the micro-batch consumed, the buffer ready for the
  /// next one): the compact form in one pass (cpu::exact_deposit_packed_clear), the bins by
  /// the backend's deposit and fill_zero. With shared() words that hold nothing yet and
  /// `may_hold`, the micro-batch is held raw instead (holds_raw(): copied into the upper half
  /// of the words' window, 4 of its 8 bytes per element, grads cleared); the next deposit
  /// deposits the held values and its own into the words in one multi-source pass.
  void deposit_and_clear(float* grads, std::size_t n, bool may_hold = false);
  /// Whether a micro-batch is held raw (deposit_and_clear with may_hold): the state is then
  /// that micro-batch's fp32 values, not the words, and reduce_held() exchanges it.
  bool holds_raw() const { return held_; }
  /// The held micro-batch deposited into the words (nothing when none is held): before an
  /// exchange or method that reads the words. Local.
  void settle();
  /// Collective: reduces bucket `bk` exactly over the group. `grads` is the full gradient
  /// buffer (flat coordinates): on entry it holds the last micro-batch, not deposited yet; on
  /// return it holds the fp32 sums over every rank and micro-batch, on every element of the
  /// bucket when whole (data-parallel), else on this rank's slice (Bucket::slice: equal, or
  /// the ragged range of whole-tensor ownership). NaN where any rank
  /// received a NaN/Inf. The bucket's bins are consumed. When nothing was deposited before
  /// (one micro-batch per rank) the values are packed straight from `grads`: rounding v to
  /// the low bin of the final level is what splitting it into the two bins and packing gives.
  void reduce(Communicator& comm, const Bucket& bk, bool whole, float* grads);
  /// The two exchanges below deliver equal blocks: they take a bucket that is whole or cut in
  /// equal slices (Bucket::equal_cut); a ragged bucket of whole-tensor ownership goes to
  /// reduce() (BucketSet::reduce_exactly), whose result they equal bit for bit.
  /// Collective, for one micro-batch per rank on every rank (nothing deposited anywhere):
  /// the same result as reduce(), by the direct exchange (Communicator::
  /// reduce_scatter_combine: 4 bytes per element, one pass, backend.exact_combine), and the
  /// exact squares of the elements this rank combined join `squares` (summed over ranks:
  /// every element of the bucket once). Returns false, having done nothing, when the
  /// communicator cannot exchange raw values (the same answer on every rank).
  bool reduce_direct(Communicator& comm, Backend& backend, const Bucket& bk, bool whole,
                     float* grads, SquareSum& squares);
  /// Collective, when some rank accumulated several micro-batches (each at most
  /// cpu::kPackedMaxMicroBatches): the same result as reduce(), by the packed exchange. The
  /// bucket's state with the last micro-batch (in `grads`) deposited is packed into `wire`
  /// (the bucket's size, 8 bytes per element, a buffer the communicator moves fast; from the
  /// compact form's words in one pass, cpu::exact_deposit_packed, or from the bins,
  /// backend.exact_deposit_pack; a default-constructed accumulator is all empty) and
  /// every owner combines all ranks' states (Communicator::reduce_scatter_combine, 8 bytes
  /// per element, backend.exact_combine_packed) into its slice of `grads`, taking the exact
  /// squares of the result into `squares`. With shared() words, on a communicator that reads
  /// them in place (Communicator::reduce_scatter_combine_pair), there is no wire buffer: each
  /// owner reads every rank's words and last micro-batch where they lie and deposits the
  /// latter in the combining pass (cpu::exact_deposit_combine_packed, the same bits; 12 bytes
  /// per element read from the ranks instead of 8, and no pass over the bucket before the
  /// exchange); a rank that deposited nothing clears its words of the bucket first (empty
  /// states). Returns false, the state and `grads` untouched,
  /// when the communicator cannot exchange (reduce() then does the bucket, after widen()).
  bool reduce_packed(Communicator& comm, Backend& backend, const Bucket& bk, bool whole,
                     float* grads, std::uint64_t* wire, SquareSum& squares);
  /// Collective, when no rank deposited into its words and some rank holds a micro-batch raw
  /// (holds_raw(): two micro-batches, the first held; shared() words on every rank): the
  /// same result as reduce(), each owner reading every rank's held values and last
  /// micro-batch in place (Communicator::reduce_scatter_combine_pair, 8 bytes per element)
  /// and combining them all as raw values (backend.exact_combine: the one-pass combine of
  /// the direct exchange, 2 x ranks values per element), taking the exact squares into
  /// `squares`. A rank that holds nothing offers zeros (its held half of the bucket cleared
  /// first). Returns false, having changed nothing but that, when the communicator cannot
  /// read them in place (the same answer on every rank).
  bool reduce_held(Communicator& comm, Backend& backend, const Bucket& bk, bool whole, float* grads,
                   SquareSum& squares);
  /// Stage 2's sharded accumulation (BufferPlan::exact_sharded): the accumulator then covers
  /// only this rank's owned elements (its local arrays' coordinates): the packed words
  /// (compact(), packed_bytes(owned)) while every element received at most
  /// cpu::kPackedMaxMicroBatches values, the bins (grads_bytes(owned, 0), widen()) past that.
  /// Collective: the direct exchange (Communicator::reduce_scatter_combine, 4 bytes per
  /// element) of bucket `bk`'s raw fp32 values of one micro-batch in `data` (the bucket's
  /// elements, every rank's; left as they are), and this rank deposits every rank's values of
  /// its slice into its state from local element `local` on (the words: every rank's values
  /// in one cpu::exact_deposit_packed_multi, the first of the step writing them without
  /// reading).
  /// The deposit is order- and grouping-free, so after any number of these the state is what
  /// one process depositing every value gets; a zero contributes nothing (a rank without a
  /// micro-batch sends zeros). Each bucket once per round (next_round()); the words must have
  /// room for the round (!round_full(comm.size())). Returns false, having done nothing, when
  /// the communicator cannot exchange raw values (the same answer on every rank).
  bool exchange_deposit(Communicator& comm, const Bucket& bk, const float* data, std::size_t local);
  /// Stage 2's sharded accumulation: every bucket of a round has been exchanged.
  void next_round() { ++rounds_; }
  /// Stage 2's sharded accumulation, compact form: whether a round of `ranks` values per
  /// element would pass the words' limit (widen() first).
  bool round_full(int ranks) const {
    return is_compact() && (rounds_ + 1) * ranks > cpu::kPackedMaxMicroBatches;
  }
  /// Stage 2's sharded accumulation: rounds local elements [begin, begin + n) of the state
  /// once to fp32 into dst (NaN where a NaN/Inf was deposited). The state is consumed.
  void round_to(std::size_t begin, std::size_t n, float* dst);
  /// The packed state (cpu::exact_pack) of flat elements [begin, begin + n): level and bins
  /// as deposited so far. Exact while at most cpu::kPackedMaxMicroBatches were deposited.
  void pack(std::size_t begin, std::size_t n, std::uint64_t* out) const;
  /// Whether deposit() was called since clear() (several micro-batches on this rank), into
  /// the words or bins (a held micro-batch is not deposited: holds_raw()).
  bool deposited() const { return deposits_ > 0; }
  /// Forgets everything deposited (the bins: clears the levels, bins are reset on first use;
  /// the compact form: nothing to write, the next deposit overwrites the words).
  void clear();

 private:
  void deposit_range(const float* grads, std::size_t begin, std::size_t n);
  /// deposit() of g; clear: g itself (deposit_and_clear) or null.
  void deposit_all(const float* g, std::size_t n, float* clear);
  /// settle(), with g[0, n) (null: none) deposited in the same pass and cleared.
  void settle_with(float* g, std::size_t n);
  void set_bins(std::size_t max_bucket_elems);
  /// The held micro-batch's values: the upper half of the words' window (element i at byte
  /// 4 (n_ + i); word i is bytes 8 i to 8 i + 7, so a word written never covers a held value
  /// of a higher element).
  float* held() { return reinterpret_cast<float*>(words_storage_.as<char>() + n_ * sizeof(float)); }
  Backend* backend_ = nullptr;
  Allocation storage_;
  std::size_t n_ = 0;
  std::int64_t* top_ = nullptr;
  std::int64_t* low_ = nullptr;
  std::uint8_t* level_ = nullptr;
  std::uint8_t* scratch_ = nullptr;
  Allocation words_storage_;          ///< the compact form's words (until widen())
  std::uint64_t* words_ = nullptr;    ///< the compact form: packed_bytes(n_)
  bool shared_ = false;               ///< words_storage_ is a communicator window
  Allocation retired_;                ///< shared words after widen(), until release_retired()
  int deposits_ = 0;  ///< deposit() calls since clear() (saturates: only 0, >0 and the limit count)
  int rounds_ = 0;    ///< the sharded accumulation's rounds since clear() (next_round())
  bool held_ = false;  ///< a micro-batch held raw in held() (holds_raw())
};

}  // namespace shardopt::exact
