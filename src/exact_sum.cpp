// exact_sum.cpp: reproducible mode's exact gradient sums and sum of squares (exact_sum.hpp).
// No FMA contraction may change these results (the project compiles with -ffp-contract=off);
// every double operation below is exact by construction, except where a comment says it
// rounds.
#include "exact_sum.hpp"

#include "backend.hpp"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#include <limits>
#include <vector>

namespace shardopt::exact {

bool sharded_stage2(const FlatLayout& layout, Stage stage, Device device) {
  if ((stage != Stage::Zero2 && stage != Stage::Zero3) || device != Device::Cpu || layout.world_size() < 2)
    return false;
  if (layout.ownership() != Ownership::Flat || ragged_buckets(layout, false)) return false;
  const char* env = std::getenv("SHARDOPT_REPRO_EXCHANGE");
  return env != nullptr && std::string(env) == "sharded";
}

std::size_t grads_bytes(std::size_t padded, std::size_t max_bucket) {
  return padded * (2 * sizeof(std::int64_t) + 1) + max_bucket;
}

std::size_t packed_bytes(std::size_t padded) { return padded * sizeof(std::uint64_t); }

ExactGrads::ExactGrads(Backend& backend, Allocation storage, std::size_t padded,
                       std::size_t max_bucket)
    : backend_(&backend), storage_(std::move(storage)), n_(padded) {
  set_bins(max_bucket);
  clear();
}

ExactGrads ExactGrads::compact(Backend& backend, Allocation words, std::size_t padded, bool shared) {
  require(words.bytes() >= packed_bytes(padded), Status::Internal, "ExactGrads: storage too small");
  ExactGrads g;
  g.backend_ = &backend;
  g.n_ = padded;
  g.shared_ = shared;
  g.words_storage_ = std::move(words);
  g.words_ = g.words_storage_.as<std::uint64_t>();
  return g;
}

void ExactGrads::set_bins(std::size_t max_bucket) {
  require(storage_.bytes() >= grads_bytes(n_, max_bucket), Status::Internal,
          "ExactGrads: storage too small");
  char* p = storage_.as<char>();
  top_ = reinterpret_cast<std::int64_t*>(p);
  low_ = top_ + n_;
  level_ = reinterpret_cast<std::uint8_t*>(low_ + n_);
  scratch_ = level_ + n_;
}

void ExactGrads::widen(Allocation storage, std::size_t max_bucket) {
  require(is_compact(), Status::Internal, "ExactGrads::widen: not the compact form");
  settle();
  storage_ = std::move(storage);
  set_bins(max_bucket);
  if (deposits_ > 0) cpu::exact_unpack(words_, n_, level_, top_, low_);
  else backend_->fill_zero(level_, n_);
  words_ = nullptr;
  // Released: the bins hold the state from now on. A window's release is collective: kept
  // until release_retired().
  if (shared_) retired_ = std::move(words_storage_);
  words_storage_ = Allocation();
  shared_ = false;
}

void ExactGrads::clear() {
  static_assert(kEmpty == 0, "cleared levels are zero bytes");
  if (level_ != nullptr) backend_->fill_zero(level_, n_);
  deposits_ = 0;
  rounds_ = 0;
  held_ = false;
}

void ExactGrads::deposit(const float* g, std::size_t n) { deposit_all(g, n, nullptr); }

void ExactGrads::deposit_and_clear(float* g, std::size_t n, bool may_hold) {
  require(n <= n_, Status::Internal, "ExactGrads::deposit: range outside the buffer");
  if (may_hold && shared_ && deposits_ == 0 && !held_) {
    // Held raw: a copy, no deposit. Elements past n hold +0 (nothing).
    float* h = held();
    std::memcpy(h, g, n * sizeof(float));
    std::memset(h + n, 0, (n_ - n) * sizeof(float));
    backend_->fill_zero(g, n * sizeof(float));
    held_ = true;
    return;
  }
  if (held_) {
    settle_with(g, n);
    return;
  }
  deposit_all(g, n, g);
}

void ExactGrads::settle() {
  if (held_) settle_with(nullptr, 0);
}

// The held values (and g[0, n), cleared after, when given) deposited into empty words, in
// windows from the first element up: each window's held values are copied out before its
// words are written, and word i covers held values of elements at most i (held()), so no
// value is overwritten before it is read, whatever order the threads write a window in.
void ExactGrads::settle_with(float* g, std::size_t n) {
  constexpr std::size_t kWindow = std::size_t{1} << 16;  // 256 KiB of held values: in cache
  std::vector<float> copy(std::min(kWindow, n_));
  const float* h = held();
  for (std::size_t w = 0; w < n_; w += kWindow) {
    const std::size_t len = std::min(kWindow, n_ - w);
    std::memcpy(copy.data(), h + w, len * sizeof(float));
    const float* src[2] = {copy.data(), g != nullptr && w < n ? g + w : nullptr};
    const int nsrc = src[1] != nullptr ? 2 : 1;
    if (nsrc == 2 && w + len > n) {  // the window passes g's end: its tail held alone
      const std::size_t part = n - w;
      cpu::exact_deposit_packed_multi(src, 2, part, nullptr, words_ + w);
      cpu::exact_deposit_packed(copy.data() + part, len - part, nullptr, words_ + w + part);
    } else {
      cpu::exact_deposit_packed_multi(src, nsrc, len, nullptr, words_ + w);
    }
  }
  if (g != nullptr) backend_->fill_zero(g, n * sizeof(float));
  held_ = false;
  deposits_ = g != nullptr ? 2 : 1;
}

void ExactGrads::deposit_all(const float* g, std::size_t n, float* clear) {
  require(n <= n_, Status::Internal, "ExactGrads::deposit: range outside the buffer");
  if (is_compact()) {
    require(!held_, Status::Internal, "ExactGrads::deposit: a micro-batch is held raw (settle first)");
    require(!full(), Status::Internal, "ExactGrads::deposit: the packed words are full (widen first)");
    // The first deposit of a step writes the words (nothing to read: clear() wrote nothing),
    // and the elements past n are empty.
    const std::uint64_t* in = deposits_ > 0 ? words_ : nullptr;
    if (clear != nullptr) cpu::exact_deposit_packed_clear(clear, n, in, words_);
    else cpu::exact_deposit_packed(g, n, in, words_);
    if (deposits_ == 0) std::memset(words_ + n, 0, (n_ - n) * sizeof(std::uint64_t));
    ++deposits_;
    return;
  }
  if (deposits_ < std::numeric_limits<int>::max()) ++deposits_;
  deposit_range(g, 0, n);
  if (clear != nullptr) backend_->fill_zero(clear, n * sizeof(float));
}

void ExactGrads::deposit_range(const float* g, std::size_t begin, std::size_t n) {
  static_assert(kEmpty == 0 && kNonFinite == 127 && kBinBits == 24 && kBase == -150,
                "cpu::exact_deposit's encoding");
  backend_->exact_deposit(g + begin, n, top_ + begin, low_ + begin, level_ + begin);
}

void ExactGrads::pack(std::size_t begin, std::size_t n, std::uint64_t* out) const {
  require(!held_, Status::Internal, "ExactGrads::pack: a micro-batch is held raw (settle first)");
  if (is_compact()) {
    if (deposits_ > 0) std::memcpy(out, words_ + begin, n * sizeof(std::uint64_t));
    else std::memset(out, 0, n * sizeof(std::uint64_t));
    return;
  }
  cpu::exact_pack(level_ + begin, top_ + begin, low_ + begin, out, n);
}

void ExactGrads::reduce(Communicator& comm, const Bucket& bk, bool whole, float* grads) {
  const std::size_t b = bk.flat.begin;
  const std::size_t n = bk.flat.size();
  const float* last = grads + b;
  std::int64_t* top = top_ + b;
  const std::int64_t* low = low_ + b;
  std::uint8_t* level = level_ + b;
  require(!is_compact(), Status::Internal, "ExactGrads::reduce: the compact form (widen first)");
  if (deposited()) {
    // 1. The last micro-batch joins the bins; the level of every element of the bucket is
    // the highest on any rank; each rank lifts its bins to it and packs them into one int64
    // (in the top bin's place).
    deposit_range(grads, b, n);
    backend_->copy(scratch_, level, n);
    comm.all_reduce_int(level, n, IntOp::MaxU8);
    backend_->exact_lift(scratch_, level, top, low, n);
  } else {
    // 1'. One micro-batch: its levels, their maximum, and each value rounded to the low bin
    // of that level (0 when the level is 2 or more above its own: below half a unit).
    backend_->exact_levels(last, n, level);
    comm.all_reduce_int(level, n, IntOp::MaxU8);
    backend_->exact_round_to_levels(last, n, level, top);
  }
  // 2. Integer sums (associative on every transport), then one rounding to fp32 of the
  // elements this rank keeps: the bucket (whole), or its slice, equal or (whole-tensor
  // ownership) its ragged range. A ragged bucket's sums come from an all-reduce of the
  // bucket, of which each rank keeps its range (the integer reduce-scatter has equal blocks
  // only; twice the integer bytes of the equal form).
  const Range mine = whole ? bk.flat : bk.slice(comm.rank());
  if (!whole && bk.equal_cut) comm.reduce_scatter_int(top, bk.slice_elems, IntOp::SumI64);
  else comm.all_reduce_int(top, n, IntOp::SumI64);
  const std::size_t first = mine.begin - b;
  float* dst = grads + b + first;
  const std::int64_t* sum = top + first;
  const std::uint8_t* lv = level + first;
  backend_->exact_sums_to_float(sum, lv, dst, mine.size());
}

namespace {

// The direct exchange's combine: the backend's exact_combine of raw fp32 values, with the
// squares of what it writes.
class RawCombiner final : public BlockCombiner {
 public:
  RawCombiner(Backend& backend, cpu::SquareDigits& squares) : backend_(backend), squares_(squares) {}
  void combine(float* dst, const void* const* src, int nsrc, std::size_t n) override {
    at_.resize(static_cast<std::size_t>(nsrc));
    for (int r = 0; r < nsrc; ++r) at_[static_cast<std::size_t>(r)] = static_cast<const float*>(src[r]);
    backend_.exact_combine(at_.data(), nsrc, dst, n, squares_);
  }

 private:
  Backend& backend_;
  cpu::SquareDigits& squares_;
  std::vector<const float*> at_;
};

// The packed exchange's combine: the backend's exact_combine_packed of every rank's state.
class PackedCombiner final : public BlockCombiner {
 public:
  PackedCombiner(Backend& backend, cpu::SquareDigits& squares) : backend_(backend), squares_(squares) {}
  void combine(float* dst, const void* const* src, int nsrc, std::size_t n) override {
    at_.resize(static_cast<std::size_t>(nsrc));
    for (int r = 0; r < nsrc; ++r) at_[static_cast<std::size_t>(r)] = static_cast<const std::uint64_t*>(src[r]);
    backend_.exact_combine_packed(at_.data(), nsrc, dst, n, squares_);
  }

 private:
  Backend& backend_;
  cpu::SquareDigits& squares_;
  std::vector<const std::uint64_t*> at_;
};

// The packed exchange with the owner depositing the last micro-batch:
// cpu::exact_deposit_combine_packed of every rank's words (the first half of the sources)
// and last micro-batch (the second half).
class DepositPackedCombiner final : public BlockCombiner {
 public:
  explicit DepositPackedCombiner(cpu::SquareDigits& squares) : squares_(squares) {}
  void combine(float* dst, const void* const* src, int nsrc, std::size_t n) override {
    const int ranks = nsrc / 2;
    words_.resize(static_cast<std::size_t>(ranks));
    last_.resize(static_cast<std::size_t>(ranks));
    for (int r = 0; r < ranks; ++r) {
      words_[static_cast<std::size_t>(r)] = static_cast<const std::uint64_t*>(src[r]);
      last_[static_cast<std::size_t>(r)] = static_cast<const float*>(src[ranks + r]);
    }
    cpu::exact_deposit_combine_packed(words_.data(), last_.data(), ranks, dst, n, &squares_);
  }

 private:
  cpu::SquareDigits& squares_;
  std::vector<const std::uint64_t*> words_;
  std::vector<const float*> last_;
};

// Stage 2's sharded deposit: every rank's raw values of this rank's slice go into its state
// (the owner combines its whole block: dst lies in its own block of `out`, at the offset of
// the elements). Nothing is written to dst. The bins: the backend's deposit per rank; the
// packed words: every rank's values in one cpu::exact_deposit_packed_multi, in place, except
// that the first deposit of a step (`fresh`) writes the words without reading them (they hold
// an earlier step).
class DepositCombiner final : public BlockCombiner {
 public:
  DepositCombiner(Backend& backend, const float* block, std::int64_t* top, std::int64_t* low,
                  std::uint8_t* level)
      : backend_(backend), block_(block), top_(top), low_(low), level_(level) {}
  DepositCombiner(Backend& backend, const float* block, std::uint64_t* words, bool fresh)
      : backend_(backend), block_(block), words_(words), fresh_(fresh) {}
  bool at_owner() const override { return true; }
  void combine(float* dst, const void* const* src, int nsrc, std::size_t n) override {
    const std::size_t at = static_cast<std::size_t>(dst - block_);
    if (words_ != nullptr) {
      cpu::exact_deposit_packed_multi(reinterpret_cast<const float* const*>(src), nsrc, n,
                                      fresh_ ? nullptr : words_ + at, words_ + at);
      return;
    }
    for (int r = 0; r < nsrc; ++r)
      backend_.exact_deposit(static_cast<const float*>(src[r]), n, top_ + at, low_ + at, level_ + at);
  }

 private:
  Backend& backend_;
  const float* block_;
  std::int64_t* top_ = nullptr;
  std::int64_t* low_ = nullptr;
  std::uint8_t* level_ = nullptr;
  std::uint64_t* words_ = nullptr;
  bool fresh_ = false;
};

}  // namespace

bool ExactGrads::exchange_deposit(Communicator& comm, const Bucket& bk, const float* data,
                                  std::size_t local) {
  const std::size_t n = bk.slice_elems;
  require(local + n <= n_, Status::Internal, "ExactGrads::exchange_deposit: slice outside the bins");
  float* out = const_cast<float*>(data);  // the combiner writes nothing
  const float* block = out + static_cast<std::size_t>(comm.rank()) * n;
  require(!round_full(comm.size()), Status::Internal,
          "ExactGrads::exchange_deposit: the packed words are full (widen first)");
  DepositCombiner op = is_compact() ? DepositCombiner(*backend_, block, words_ + local, rounds_ == 0)
                                    : DepositCombiner(*backend_, block, top_ + local, low_ + local, level_ + local);
  if (!comm.reduce_scatter_combine(data, sizeof(float), out, n, op)) return false;
  if (deposits_ < std::numeric_limits<int>::max()) ++deposits_;
  return true;
}

void ExactGrads::round_to(std::size_t begin, std::size_t n, float* dst) {
  require(begin + n <= n_, Status::Internal, "ExactGrads::round_to: range outside the bins");
  if (is_compact()) {  // each word alone, combined: its own level's sum rounded once
    const std::uint64_t* w = words_ + begin;
    cpu::exact_combine_packed(&w, 1, dst, n, nullptr);
    return;
  }
  // Lifting to its own level packs each element's bins into one int64 (in the top bin).
  backend_->exact_lift(level_ + begin, level_ + begin, top_ + begin, low_ + begin, n);
  backend_->exact_sums_to_float(top_ + begin, level_ + begin, dst, n);
}

bool ExactGrads::reduce_direct(Communicator& comm, Backend& backend, const Bucket& bk, bool whole,
                               float* grads, SquareSum& squares) {
  float* data = grads + bk.flat.begin;
  RawCombiner op(backend, squares.digits());
  if (!comm.reduce_scatter_combine(data, sizeof(float), data, bk.slice_elems, op)) return false;
  if (whole) comm.all_gather_inplace(data, bk.slice_elems, CommType::F32);
  return true;
}

bool ExactGrads::reduce_packed(Communicator& comm, Backend& backend, const Bucket& bk, bool whole,
                               float* grads, std::uint64_t* wire, SquareSum& squares) {
  const std::size_t b = bk.flat.begin;
  const std::size_t n = bk.flat.size();
  settle();  // a held micro-batch joins the words first
  if (shared_) {
    // Every rank's words and last micro-batch, read in place by the owners (the same answer
    // on every rank: the buffers were obtained the same way). Words of a rank that deposited
    // nothing since clear() are stale: an empty state is all zero.
    if (deposits_ == 0) std::memset(words_ + b, 0, n * sizeof(std::uint64_t));
    DepositPackedCombiner op(squares.digits());
    if (comm.reduce_scatter_combine_pair(words_ + b, sizeof(std::uint64_t), grads + b, sizeof(float),
                                         grads + b, bk.slice_elems, op)) {
      if (whole) comm.all_gather_inplace(grads + b, bk.slice_elems, CommType::F32);
      return true;
    }
  }
  // The state with the last micro-batch deposited, straight into the wire buffer (the state
  // stays as it was: a refusal leaves reduce() everything to do).
  if (is_compact())  // the words (host memory)
    cpu::exact_deposit_packed(grads + b, n, deposits_ > 0 ? words_ + b : nullptr, wire);
  else  // the bins, or nothing deposited on this rank (no accumulator: all empty)
    backend.exact_deposit_pack(grads + b, n, level_ != nullptr ? top_ + b : nullptr,
                               level_ != nullptr ? low_ + b : nullptr, level_ != nullptr ? level_ + b : nullptr,
                               wire);
  PackedCombiner op(backend, squares.digits());
  if (!comm.reduce_scatter_combine(wire, sizeof(std::uint64_t), grads + b, bk.slice_elems, op)) return false;
  if (whole) comm.all_gather_inplace(grads + b, bk.slice_elems, CommType::F32);
  return true;
}

bool ExactGrads::reduce_held(Communicator& comm, Backend& backend, const Bucket& bk, bool whole,
                             float* grads, SquareSum& squares) {
  require(shared_, Status::Internal, "ExactGrads::reduce_held: the words are not in a window");
  const std::size_t b = bk.flat.begin;
  float* h = held();
  // A rank holding nothing (at most one micro-batch) offers zeros: they add nothing.
  if (!held_) std::memset(h + b, 0, bk.flat.size() * sizeof(float));
  RawCombiner op(backend, squares.digits());
  if (!comm.reduce_scatter_combine_pair(h + b, sizeof(float), grads + b, sizeof(float), grads + b,
                                        bk.slice_elems, op))
    return false;
  if (whole) comm.all_gather_inplace(grads + b, bk.slice_elems, CommType::F32);
  return true;
}

// ---- SquareSum -------------------------------------------------------------------------

void SquareSum::add(const float* x, std::size_t n) { cpu::exact_square_add(x, n, d_); }

void SquareSum::merge(SquareSum& other) { d_.merge(other.d_); }

void SquareSum::sum_over_ranks(Communicator& comm) {
  constexpr int kDigits = cpu::SquareDigits::kDigits;
  d_.normalize();
  // Digits below 2^32 sum exactly in doubles over fewer than 2^21 ranks.
  std::array<double, kDigits + 2> buf{};
  for (int i = 0; i < kDigits; ++i) buf[static_cast<std::size_t>(i)] = static_cast<double>(d_.digit[static_cast<std::size_t>(i)]);
  buf[kDigits] = d_.nans;
  buf[kDigits + 1] = d_.infs;
  comm.all_reduce_sum_host(buf.data(), buf.size());
  for (int i = 0; i < kDigits; ++i)
    d_.digit[static_cast<std::size_t>(i)] = static_cast<std::uint64_t>(buf[static_cast<std::size_t>(i)]);
  d_.nans = buf[kDigits];
  d_.infs = buf[kDigits + 1];
  d_.normalize();
}

double SquareSum::value() const {
  if (d_.nans > 0) return std::numeric_limits<double>::quiet_NaN();
  if (d_.infs > 0) return std::numeric_limits<double>::infinity();
  cpu::SquareDigits c = d_;
  c.normalize();
  // From the lowest digit up: a fixed sequence of roundings of the same integers.
  double v = 0.0;
  for (int i = 0; i < cpu::SquareDigits::kDigits; ++i)
    v += std::ldexp(static_cast<double>(c.digit[static_cast<std::size_t>(i)]),
                    32 * i + cpu::SquareDigits::kBase);
  return v;
}

}  // namespace shardopt::exact

namespace shardopt {
namespace {

[[noreturn]] void no_exact_sums(const Backend& b) {
  throw Error(Status::Unsupported, std::string("reproducible mode's exact sums are not implemented on the ") +
                                       b.name() + " backend");
}

}  // namespace

void Backend::exact_deposit(const float*, std::size_t, std::int64_t*, std::int64_t*, std::uint8_t*) {
  no_exact_sums(*this);
}
void Backend::exact_levels(const float*, std::size_t, std::uint8_t*) { no_exact_sums(*this); }
void Backend::exact_round_to_levels(const float*, std::size_t, const std::uint8_t*, std::int64_t*) {
  no_exact_sums(*this);
}
void Backend::exact_lift(const std::uint8_t*, const std::uint8_t*, std::int64_t*, const std::int64_t*,
                         std::size_t) {
  no_exact_sums(*this);
}
void Backend::exact_sums_to_float(const std::int64_t*, const std::uint8_t*, float*, std::size_t) {
  no_exact_sums(*this);
}
void Backend::exact_square_add(const float*, std::size_t, cpu::SquareDigits&) { no_exact_sums(*this); }
void Backend::exact_combine(const float* const*, int, float*, std::size_t, cpu::SquareDigits&) {
  no_exact_sums(*this);
}
void Backend::exact_combine_packed(const std::uint64_t* const*, int, float*, std::size_t, cpu::SquareDigits&) {
  no_exact_sums(*this);
}
void Backend::exact_deposit_pack(const float*, std::size_t, const std::int64_t*, const std::int64_t*,
                                 const std::uint8_t*, std::uint64_t*) {
  no_exact_sums(*this);
}

}  // namespace shardopt
