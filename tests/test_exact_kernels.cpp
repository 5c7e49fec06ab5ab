// test_exact_kernels.cpp: reproducible mode's vectorised kernels (src/cpu/exact_kernels.cpp,
// kernels_avx2.cpp, kernels_avx512.cpp) against the method they replace.
//
// exact_combine (the direct exchange's one-pass sum of one value per rank) on every ISA this
// CPU has must give bit for bit
//   - an independent eager oracle written from exact_sum.hpp's primitives (level_of, the grid
//     of the largest level, nearbyint, int64 sums, cpu::exact_to_float, which
//     ExactSum.ToFloatRoundsOnceToNearestEven checks against long double), and
//   - the accumulator it replaces (exact::ExactGrads: every rank's value deposited as a
//     micro-batch of one process, lazy bins with level lifts, then the int64 sum),
// on heavy-tailed random data and on a boundary corpus: level edges, ties of the split and of
// the final rounding, lifts by one and by several levels, subnormal inputs, FLT_MAX and sums
// that round to Inf, cancellation to zero, -0, NaN and Inf; 1 to 100 ranks (the SIMD paths
// sum in doubles up to 64 ranks and hand more to the int64 path). exact_square_add must
// give the same integer as adding every square one by one (SquareDigits::add). The two-phase
// method's passes (exact_levels, exact_round_to_levels, exact_lift, exact_sums_to_float) on
// every ISA, forced in turn, must write what the portable passes (the loops they replaced)
// write, and their result must equal the same oracles on the same corpus.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "backend.hpp"
#include "cpu/kernels.hpp"
#include "exact_sum.hpp"
#include "support/omp_threads.hpp"

using namespace shardopt;

namespace {

std::vector<cpu::Isa> isas() {
  std::vector<cpu::Isa> out;
  for (cpu::Isa isa : {cpu::Isa::Portable, cpu::Isa::Avx2, cpu::Isa::Avx512})
    if (cpu::isa_supported(isa)) out.push_back(isa);
  return out;
}

// Restores the ISA the process started with.
struct IsaScope {
  cpu::Isa saved = cpu::active_isa();
  ~IsaScope() { cpu::set_isa(saved); }
};

std::uint32_t bits(float v) { return std::bit_cast<std::uint32_t>(v); }

// rank r's values: vals[r][i].
using PerRank = std::vector<std::vector<float>>;

// The eager oracle: the level of the element is the largest among its values, every value is
// rounded once to that level's low grid, the integers are summed, and the sum rounded once.
float oracle_one(const PerRank& vals, std::size_t i) {
  int level = exact::kEmpty;
  for (const auto& r : vals) {
    const float v = r[i];
    if (!std::isfinite(v)) return std::numeric_limits<float>::quiet_NaN();
    if (v != 0.0f) level = std::max(level, exact::level_of(v));
  }
  if (level == exact::kEmpty) return 0.0f;
  const int g = exact::bin_exponent(level - 1);
  std::int64_t sum = 0;
  for (const auto& r : vals)
    sum += static_cast<std::int64_t>(std::nearbyint(std::ldexp(static_cast<double>(r[i]), -g)));
  return cpu::exact_to_float(sum, g);
}

// The CPU backend whose exact passes the accumulators below run.
Backend& cpu_backend() {
  static const std::unique_ptr<Backend> b = make_cpu_backend();
  return *b;
}

// The accumulator of today's reproducible mode on one process: ranks 0..R-2 deposited as
// micro-batches, the last one in the gradient buffer, then the reduction.
std::vector<float> oracle_binned(const PerRank& vals) {
  const std::size_t n = vals[0].size();
  const std::size_t bytes = exact::grads_bytes(n, n);
  auto mem = std::make_shared<std::vector<std::int64_t>>(bytes / 8 + 1);
  exact::ExactGrads acc(cpu_backend(), Allocation(mem->data(), bytes, mem, nullptr, MemCategory::Grads), n, n);
  for (std::size_t r = 0; r + 1 < vals.size(); ++r) acc.deposit(vals[r].data(), n);
  std::vector<float> out = vals.back();
  Bucket bk;
  bk.flat = Range{0, n};
  bk.slice_elems = n;
  auto comm = make_single_process_communicator();
  acc.reduce(*comm, bk, false, out.data());
  return out;
}

float random_value(std::mt19937_64& rng) {
  switch (rng() % 16) {
    case 0: return 0.0f;
    case 1: return -0.0f;
    case 2: return std::ldexp(static_cast<float>(rng() % 0x800000), -149) * ((rng() & 1) ? -1.0f : 1.0f);
    default: break;
  }
  const int e = static_cast<int>(rng() % 254) + 1;  // biased exponent 1..254
  const std::uint32_t b = (static_cast<std::uint32_t>(e) << 23) | static_cast<std::uint32_t>(rng() & 0x7fffff) |
                          ((rng() & 1) ? 0x80000000u : 0u);
  return std::bit_cast<float>(b);
}

float with_exponent(std::mt19937_64& rng, int e) {
  const std::uint32_t b = (static_cast<std::uint32_t>(e) << 23) | static_cast<std::uint32_t>(rng() & 0x7fffff) |
                          ((rng() & 1) ? 0x80000000u : 0u);
  return std::bit_cast<float>(b);
}

// Element patterns for `ranks` values each, cycling through the cases named in the header.
PerRank corpus(int ranks, std::size_t n, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  PerRank v(static_cast<std::size_t>(ranks), std::vector<float>(n));
  const float fmax = std::numeric_limits<float>::max();
  for (std::size_t i = 0; i < n; ++i) {
    auto set = [&](int r, float x) { v[static_cast<std::size_t>(r % ranks)][i] = x; };
    for (int r = 0; r < ranks; ++r) set(r, 0.0f);
    const int kind = static_cast<int>(rng() % 14);
    const int base = static_cast<int>(rng() % 230) + 12;  // an exponent field with room around it
    switch (kind) {
      case 0:  // heavy-tailed, anything
        for (int r = 0; r < ranks; ++r) set(r, random_value(rng));
        break;
      case 1:  // exponents within a few binades: ordinary gradients
        for (int r = 0; r < ranks; ++r) set(r, with_exponent(rng, base + static_cast<int>(rng() % 5)));
        break;
      case 2: {  // level edges: exponent fields 24k - 1 and 24k (levels change between them)
        const int k = static_cast<int>(rng() % 10) + 1;
        for (int r = 0; r < ranks; ++r) set(r, with_exponent(rng, 24 * k - static_cast<int>(rng() % 2)));
        break;
      }
      case 3: {  // a lift by one or several levels: one large value among small ones
        for (int r = 0; r < ranks; ++r) set(r, with_exponent(rng, 1 + static_cast<int>(rng() % 60)));
        set(static_cast<int>(rng() % static_cast<std::uint64_t>(ranks)), with_exponent(rng, 60 + static_cast<int>(rng() % 190)));
        break;
      }
      case 4: {  // ties of the split: x and (odd + 1/2) grid units
        const int L = static_cast<int>(rng() % 10) + 2;
        const int g = exact::bin_exponent(L - 1);
        set(0, std::ldexp(1.0f, exact::bin_exponent(L)));  // sets the level
        for (int r = 1; r < ranks; ++r)
          set(r, std::ldexp(static_cast<float>(2 * (rng() % 1000) + 1), g - 1) * ((rng() & 1) ? -1.0f : 1.0f));
        break;
      }
      case 5: {  // ties of the final rounding: 2^x + 2^(x-24) (+ 2^(x-23) for odd)
        const int L = static_cast<int>(rng() % 9) + 2;
        const int x = exact::bin_exponent(L) + static_cast<int>(rng() % 20);
        set(0, std::ldexp((rng() & 1) ? 1.0f : 1.0f + 0x1p-23f, x));
        set(1, std::ldexp(1.0f, x - 24));
        break;
      }
      case 6:  // subnormals only
        for (int r = 0; r < ranks; ++r)
          set(r, std::ldexp(static_cast<float>(rng() % 0x800000), -149) * ((rng() & 1) ? -1.0f : 1.0f));
        break;
      case 7:  // near FLT_MAX: sums that round to Inf, or just below it
        for (int r = 0; r < ranks; ++r) set(r, (rng() & 1) ? fmax : with_exponent(rng, 250 + static_cast<int>(rng() % 5)));
        if (rng() & 1)
          for (int r = 0; r < ranks; ++r) set(r, -v[static_cast<std::size_t>(r)][i]);
        break;
      case 8: {  // cancellation to zero (pairs of opposite values)
        for (int r = 0; r + 1 < ranks; r += 2) {
          const float x = random_value(rng);
          set(r, x);
          set(r + 1, -x);
        }
        break;
      }
      case 9:  // -0 everywhere
        for (int r = 0; r < ranks; ++r) set(r, -0.0f);
        break;
      case 10: {  // one non-finite value
        const float bad[] = {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                             -std::numeric_limits<float>::infinity()};
        for (int r = 0; r < ranks; ++r) set(r, random_value(rng));
        set(static_cast<int>(rng() % static_cast<std::uint64_t>(ranks)), bad[rng() % 3]);
        break;
      }
      case 11:  // values below half a grid unit of the level (dropped) and just above
        set(0, with_exponent(rng, base));
        for (int r = 1; r < ranks; ++r) set(r, with_exponent(rng, std::max(1, base - 23 - static_cast<int>(rng() % 4))));
        break;
      case 12:  // the smallest normal and subnormal neighbours
        for (int r = 0; r < ranks; ++r)
          set(r, (rng() & 1) ? std::numeric_limits<float>::min() : std::ldexp(1.0f, -149) * static_cast<float>(rng() % 4));
        break;
      default:  // sparse: one nonzero rank
        set(static_cast<int>(rng() % static_cast<std::uint64_t>(ranks)), random_value(rng));
        break;
    }
  }
  return v;
}

std::vector<const float*> pointers(const PerRank& v, std::size_t offset = 0) {
  std::vector<const float*> p;
  for (const auto& r : v) p.push_back(r.data() + offset);
  return p;
}

void expect_same_digits(cpu::SquareDigits a, cpu::SquareDigits b, const std::string& what) {
  a.normalize();
  b.normalize();
  EXPECT_EQ(a.digit, b.digit) << what;
  EXPECT_EQ(a.nans, b.nans) << what;
  EXPECT_EQ(a.infs, b.infs) << what;
}

template <class T>
void expect_same(const std::vector<T>& got, const std::vector<T>& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (std::size_t i = 0; i < got.size(); ++i) {
    if constexpr (std::is_same_v<T, float>) {
      ASSERT_EQ(bits(got[i]), bits(want[i])) << what << ", element " << i << ": " << got[i] << " vs " << want[i];
    } else {
      ASSERT_EQ(got[i], want[i]) << what << ", element " << i;
    }
  }
}

cpu::SquareDigits squares_one_by_one(const float* x, std::size_t n) {
  cpu::SquareDigits d;
  for (std::size_t i = 0; i < n; ++i) d.add(x[i]);
  return d;
}

}  // namespace

TEST(ExactKernels, CombineEqualsTheOraclesOnEveryIsa) {
  const IsaScope restore;
  for (int ranks : {1, 2, 3, 4, 5, 8, 17, 64, 65, 100}) {
    const std::size_t n = ranks > 8 ? 3000 : 20011;  // not a multiple of any vector width
    const PerRank vals = corpus(ranks, n, 1000u + static_cast<std::uint64_t>(ranks));
    std::vector<float> eager(n);
    for (std::size_t i = 0; i < n; ++i) eager[i] = oracle_one(vals, i);
    const std::vector<float> binned = oracle_binned(vals);
    for (std::size_t i = 0; i < n; ++i)
      ASSERT_EQ(bits(eager[i]), bits(binned[i])) << "the oracles disagree, " << ranks << " ranks, element " << i;
    const cpu::SquareDigits want_sq = squares_one_by_one(eager.data(), n);
    for (cpu::Isa isa : isas()) {
      cpu::set_isa(isa);
      for (std::size_t offset : {std::size_t{0}, std::size_t{3}}) {  // unaligned starts too
        const std::vector<const float*> src = pointers(vals, offset);
        std::vector<float> got(n - offset);
        cpu::SquareDigits sq;
        cpu::exact_combine(src.data(), ranks, got.data(), got.size(), &sq);
        const std::string what = std::string(cpu::isa_name(isa)) + ", " + std::to_string(ranks) +
                                 " ranks, offset " + std::to_string(offset);
        for (std::size_t i = 0; i < got.size(); ++i)
          ASSERT_EQ(bits(got[i]), bits(eager[i + offset]))
              << what << ", element " << i + offset << ": " << got[i] << " vs " << eager[i + offset];
        expect_same_digits(sq, squares_one_by_one(eager.data() + offset, got.size()), what + " squares");
        if (offset == 0) expect_same_digits(sq, want_sq, what + " squares (all)");
      }
    }
  }
}

// In place: the destination is one of the sources (the shared-memory exchange writes into
// the owner's block).
TEST(ExactKernels, CombineInPlace) {
  const IsaScope restore;
  for (cpu::Isa isa : isas()) {
    cpu::set_isa(isa);
    for (int ranks : {1, 3}) {
      PerRank vals = corpus(ranks, 5003, 77);
      std::vector<float> want(vals[0].size());
      for (std::size_t i = 0; i < want.size(); ++i) want[i] = oracle_one(vals, i);
      const std::vector<const float*> src = pointers(vals);
      const int own = ranks - 1;
      cpu::exact_combine(src.data(), ranks, vals[static_cast<std::size_t>(own)].data(), want.size(), nullptr);
      for (std::size_t i = 0; i < want.size(); ++i)
        ASSERT_EQ(bits(vals[static_cast<std::size_t>(own)][i]), bits(want[i])) << cpu::isa_name(isa) << " " << i;
    }
  }
}

namespace {

// Metamorphic: negating every input negates every output (zeros stay +0, NaN stays NaN): a
// truncating or away-from-zero rounding breaks the symmetry of round-to-nearest-even at ties.
// Scaling every input by 2^24k moves every value up exactly k levels and the grid with it,
// so the outputs scale exactly (inputs kept inside the normal range on both sides). `sum`
// is a method: one value per rank in, the fp32 sums out.
using Method = std::function<std::vector<float>(const PerRank&)>;

void expect_odd_and_scaling_by_levels(const Method& sum, const std::string& what) {
  for (int ranks : {2, 4, 7}) {
    const std::size_t n = 8191;
    const PerRank vals = corpus(ranks, n, 4242u + static_cast<std::uint64_t>(ranks));
    PerRank neg = vals;
    for (auto& r : neg)
      for (float& x : r) x = -x;
    std::vector<float> a = sum(vals), b = sum(neg);
    for (std::size_t i = 0; i < n; ++i) {
      if (std::isnan(a[i])) {
        ASSERT_TRUE(std::isnan(b[i])) << what << " " << i;
      } else if (a[i] == 0.0f) {
        ASSERT_EQ(bits(b[i]), 0u) << what << " " << i;
        ASSERT_EQ(bits(a[i]), 0u) << what << " " << i;
      } else {
        ASSERT_EQ(bits(b[i]), bits(-a[i])) << what << " element " << i << ": " << a[i];
      }
    }
    // Scaling: random values with exponent fields 48..200 (levels 3..9; 2^48 more is 96..248).
    std::mt19937_64 rng(99u + static_cast<std::uint64_t>(ranks));
    PerRank lo(static_cast<std::size_t>(ranks), std::vector<float>(n));
    for (std::size_t i = 0; i < n; ++i) {
      const int c = 48 + static_cast<int>(rng() % 153);
      for (int r = 0; r < ranks; ++r) {
        const int e = std::min(200, std::max(48, c - static_cast<int>(rng() % 30)));
        lo[static_cast<std::size_t>(r)][i] = (rng() % 5 == 0) ? 0.0f : with_exponent(rng, e);
      }
    }
    a = sum(lo);
    for (int k : {1, 2}) {
      PerRank hi = lo;
      for (auto& r : hi)
        for (float& x : r) x = std::ldexp(x, 24 * k);
      b = sum(hi);
      for (std::size_t i = 0; i < n; ++i)
        ASSERT_EQ(bits(b[i]), bits(std::ldexp(a[i], 24 * k)))
            << what << ", 2^" << 24 * k << ", element " << i << ": " << a[i];
    }
  }
}

std::vector<float> direct_combine(const PerRank& vals) {
  std::vector<float> out(vals[0].size());
  cpu::exact_combine(pointers(vals).data(), static_cast<int>(vals.size()), out.data(), out.size(), nullptr);
  return out;
}

}  // namespace

TEST(ExactKernels, CombineIsOddAndScalesByLevels) {
  const IsaScope restore;
  for (cpu::Isa isa : isas()) {
    cpu::set_isa(isa);
    expect_odd_and_scaling_by_levels(direct_combine, std::string("direct, ") + cpu::isa_name(isa));
  }
}

TEST(ExactKernels, SquaresEqualAddingOneByOne) {
  const IsaScope restore;
  std::mt19937_64 rng(5);
  struct Case {
    std::string name;
    std::vector<float> x;
  };
  std::vector<Case> cases;
  auto make = [&](const std::string& name, std::size_t n, auto gen) {
    Case c{name, std::vector<float>(n)};
    for (float& v : c.x) v = gen();
    cases.push_back(std::move(c));
  };
  make("narrow", 3 * 4096 + 7, [&] { return with_exponent(rng, 120 + static_cast<int>(rng() % 6)); });
  make("anything", 20000, [&] { return random_value(rng); });
  make("window edge", 9000, [&] { return with_exponent(rng, 100 - static_cast<int>(rng() % 27)); });
  make("outliers", 9001, [&] {
    return rng() % 500 == 0 ? with_exponent(rng, 250) : with_exponent(rng, 30 + static_cast<int>(rng() % 4));
  });
  make("subnormal", 4099, [&] { return std::ldexp(static_cast<float>(rng() % 0x800000), -149); });
  make("low normals", 4100, [&] {
    return (rng() & 1) ? with_exponent(rng, 1 + static_cast<int>(rng() % 30))
                       : std::ldexp(static_cast<float>(rng() % 0x800000), -149);
  });
  make("huge", 5000, [&] { return (rng() & 1) ? std::numeric_limits<float>::max() : with_exponent(rng, 254); });
  make("zeros", 4096, [&] { return (rng() & 1) ? 0.0f : -0.0f; });
  make("nonfinite", 7000, [&] {
    const int k = static_cast<int>(rng() % 2000);
    if (k == 0) return std::numeric_limits<float>::quiet_NaN();
    if (k == 1) return -std::numeric_limits<float>::infinity();
    return with_exponent(rng, 60 + static_cast<int>(rng() % 10));
  });
  make("short", 5, [&] { return random_value(rng); });
  for (const Case& c : cases) {
    const cpu::SquareDigits want = squares_one_by_one(c.x.data(), c.x.size());
    for (cpu::Isa isa : isas()) {
      cpu::set_isa(isa);
      cpu::SquareDigits got;
      cpu::exact_square_add(c.x.data(), c.x.size(), got);
      expect_same_digits(got, want, c.name + " " + cpu::isa_name(isa));
      // exact::SquareSum's value is the same double as well.
      exact::SquareSum s;
      s.add(c.x.data(), c.x.size());
      exact::SquareSum ref;
      ref.digits() = want;
      const double a = s.value(), b = ref.value();
      if (std::isnan(b)) {
        EXPECT_TRUE(std::isnan(a)) << c.name;
      } else {
        EXPECT_EQ(a, b) << c.name;
      }
    }
  }
}

// The long-double check of a square sum whose exact value a double can hold.
TEST(ExactKernels, SquareSumValueIsExactWhereADoubleHoldsIt) {
  const IsaScope restore;
  std::mt19937_64 rng(8);
  std::vector<float> x(50000);
  for (float& v : x) v = std::ldexp(1.0f + static_cast<float>(rng() & 0xff) * 0x1p-8f, static_cast<int>(rng() % 8) - 4);
  long double want = 0;  // 18-bit squares over 16 binades: exact in long double
  for (float v : x) want += static_cast<long double>(v) * v;
  for (cpu::Isa isa : isas()) {
    cpu::set_isa(isa);
    exact::SquareSum s;
    s.add(x.data(), x.size());
    EXPECT_EQ(s.value(), static_cast<double>(want)) << cpu::isa_name(isa);
  }
}

// ---- the packed state (several micro-batches per rank) ---------------------------------------

namespace {

// Rank r's micro-batches are rows r, r + ranks, r + 2 ranks, ... of `rows`; each rank
// deposits its own into its bins and packs them.
std::vector<std::vector<std::uint64_t>> packed_states(const PerRank& rows, int ranks) {
  const std::size_t n = rows[0].size();
  std::vector<std::vector<std::uint64_t>> out;
  for (int r = 0; r < ranks; ++r) {
    const std::size_t bytes = exact::grads_bytes(n, n);
    auto mem = std::make_shared<std::vector<std::int64_t>>(bytes / 8 + 1);
    exact::ExactGrads acc(cpu_backend(), Allocation(mem->data(), bytes, mem, nullptr, MemCategory::Grads), n, n);
    for (std::size_t k = static_cast<std::size_t>(r); k < rows.size(); k += static_cast<std::size_t>(ranks))
      acc.deposit(rows[k].data(), n);
    std::vector<std::uint64_t> words(n);
    acc.pack(0, n, words.data());
    out.push_back(std::move(words));
  }
  return out;
}

}  // namespace

// Every rank's packed bins combined at the owner give what one process that deposited every
// micro-batch gives (the two-phase method's result), on every ISA: 1-8 ranks, 1-63
// micro-batches per rank (some ranks with none), the boundary corpus, and sums large enough
// for the rounding-to-odd path (63 values near the top of a level per rank).
TEST(ExactKernels, PackedStatesCombineToTheOneProcessResult) {
  const IsaScope restore;
  struct Case {
    int ranks, per_rank;
    std::size_t rows;  // total micro-batches (fewer than ranks * per_rank: some ranks idle)
  };
  for (const Case& c : {Case{1, 3, 3}, Case{2, 2, 4}, Case{3, 5, 13}, Case{4, 1, 3}, Case{8, 2, 16},
                        Case{2, 63, 126}, Case{5, 7, 30}}) {
    const std::size_t n = c.per_rank > 10 ? 4099 : 9001;
    PerRank rows = corpus(static_cast<int>(c.rows), n, 777u + c.rows);
    if (c.per_rank == 63)  // near the top of level 5 on every micro-batch: wide sums
      for (std::size_t i = 0; i < n; i += 3)
        for (auto& row : rows) row[i] = std::bit_cast<float>(0x3b7fff00u | static_cast<std::uint32_t>(i & 0xff));
    const std::vector<float> want = oracle_binned(rows);
    const auto states = packed_states(rows, c.ranks);
    std::vector<const std::uint64_t*> src;
    for (const auto& s : states) src.push_back(s.data());
    for (cpu::Isa isa : isas()) {
      cpu::set_isa(isa);
      std::vector<float> got(n);
      cpu::SquareDigits sq;
      cpu::exact_combine_packed(src.data(), c.ranks, got.data(), n, &sq);
      const std::string what = std::string(cpu::isa_name(isa)) + ", " + std::to_string(c.ranks) +
                               " ranks, " + std::to_string(c.rows) + " micro-batches";
      for (std::size_t i = 0; i < n; ++i)
        ASSERT_EQ(bits(got[i]), bits(want[i])) << what << ", element " << i << ": " << got[i] << " vs " << want[i];
      expect_same_digits(sq, squares_one_by_one(want.data(), n), what + " squares");
    }
  }
}

// The owners' in-place deposit (cpu::exact_deposit_combine_packed, the shared-memory packed
// exchange): every rank's packed state plus its last micro-batch, deposited window by window
// at the owner, gives the one-process result and its exact squares on every ISA: 1-8 ranks,
// ranks with an empty state (all-zero words), up to 63 micro-batches on a rank with the last,
// several windows of kExactChunk, and the result written over one rank's last micro-batch.
TEST(ExactKernels, DepositCombineGivesTheOneProcessResult) {
  const IsaScope restore;
  struct Case {
    int ranks;
    std::size_t rows;  // deposited before the last micro-batch, round-robin over the ranks
  };
  const std::size_t n = 3 * 4096 + 17;
  for (const Case& c : {Case{1, 4}, Case{2, 3}, Case{3, 1}, Case{4, 12}, Case{8, 20}, Case{2, 124}}) {
    const PerRank rows = corpus(static_cast<int>(c.rows), n, 4040u + c.rows);
    const PerRank last = corpus(c.ranks, n, 5050u + static_cast<std::uint64_t>(c.ranks));
    PerRank everything = rows;
    everything.insert(everything.end(), last.begin(), last.end());
    const std::vector<float> want = oracle_binned(everything);
    const auto states = packed_states(rows, c.ranks);
    std::vector<const std::uint64_t*> words;
    for (const auto& st : states) words.push_back(st.data());
    for (cpu::Isa isa : isas()) {
      cpu::set_isa(isa);
      for (bool over : {false, true}) {
        PerRank mine = last;
        std::vector<const float*> at;
        for (const auto& row : mine) at.push_back(row.data());
        std::vector<float> apart(n);
        float* dst = over ? mine[0].data() : apart.data();
        cpu::SquareDigits sq;
        cpu::exact_deposit_combine_packed(words.data(), at.data(), c.ranks, dst, n, &sq);
        const std::string what = std::string(cpu::isa_name(isa)) + ", " + std::to_string(c.ranks) +
                                 " ranks, " + std::to_string(c.rows) + " deposited" +
                                 (over ? ", over the last micro-batch" : "");
        for (std::size_t i = 0; i < n; ++i)
          ASSERT_EQ(bits(dst[i]), bits(want[i])) << what << ", element " << i << ": " << dst[i] << " vs " << want[i];
        expect_same_digits(sq, squares_one_by_one(want.data(), n), what + " squares");
      }
    }
  }
}

// The owners' pass's squares on the SIMD windows: in DepositCombineGivesTheOneProcessResult the
// boundary corpus puts a NaN or Inf in every window of 4096 results (a kernel that skipped the
// squares of finite windows passed it), and such a window's squares go one by one. Here the
// windows are finite, one per kind: ordinary values, a few outliers 2^37 times larger (the
// rest fall below the window and go one by one), subnormal sums, a window with a NaN between
// finite ones, and a short last window; over two work items of the threading (each with a
// last window of its own), on 1, 2 and 3 threads.
TEST(ExactKernels, DepositCombineSquaresOverFiniteWindows) {
  const IsaScope restore;
  constexpr std::size_t kWin = 4096;
  const std::size_t n = 16 * kWin + 5 * kWin + 19;  // kExactGrain is 16 windows
  for (int ranks : {1, 2, 3}) {
    std::mt19937_64 rng(77u + static_cast<std::uint64_t>(ranks));
    const int rows_n = 2 * ranks;  // two micro-batches deposited per rank before the last
    PerRank rows(static_cast<std::size_t>(rows_n), std::vector<float>(n));
    PerRank last(static_cast<std::size_t>(ranks), std::vector<float>(n));
    auto value = [&](std::size_t i) {
      switch ((i / kWin) % 5) {
        case 0: return with_exponent(rng, 100 + static_cast<int>(rng() % 6));
        case 1: return rng() % 300 == 0 ? with_exponent(rng, 180) : with_exponent(rng, 140 + static_cast<int>(rng() % 4));
        case 2: return std::ldexp(static_cast<float>(rng() % 0x800000), -149) * ((rng() & 1) ? -1.0f : 1.0f);
        case 3: return i % kWin == 777 ? std::numeric_limits<float>::quiet_NaN() : with_exponent(rng, 90);
        default: return random_value(rng);  // finite: zeros, subnormals, any exponent field below 255
      }
    };
    for (std::size_t i = 0; i < n; ++i) {
      for (auto& row : rows) row[i] = value(i);
      for (auto& row : last) row[i] = value(i);
    }
    PerRank everything = rows;
    everything.insert(everything.end(), last.begin(), last.end());
    const std::vector<float> want = oracle_binned(everything);
    const cpu::SquareDigits want_squares = squares_one_by_one(want.data(), n);
    const auto states = packed_states(rows, ranks);
    std::vector<const std::uint64_t*> words;
    for (const auto& st : states) words.push_back(st.data());
    std::vector<const float*> at;
    for (const auto& row : last) at.push_back(row.data());
    for (cpu::Isa isa : isas()) {
      cpu::set_isa(isa);
      for (int threads : {1, 2, 3}) {
        const test::OmpThreads scope(threads);
        std::vector<float> dst(n);
        cpu::SquareDigits sq;
        cpu::exact_deposit_combine_packed(words.data(), at.data(), ranks, dst.data(), n, &sq);
        const std::string what = std::string(cpu::isa_name(isa)) + ", " + std::to_string(ranks) +
                                 " ranks, " + std::to_string(threads) + " threads";
        for (std::size_t i = 0; i < n; ++i)
          ASSERT_EQ(bits(dst[i]), bits(want[i])) << what << ", element " << i;
        expect_same_digits(sq, want_squares, what + " squares");
      }
    }
  }
}

// Sums of 2^50 and more go to fp32 through a rounding to odd; a sum one unit above or below
// a tie of the final rounding (and on it) must round as the exact integer does.
TEST(ExactKernels, LargePackedSumsRoundOnce) {
  const IsaScope restore;
  auto word = [](std::uint64_t level, std::int64_t top, std::int64_t low) {
    return level | ((static_cast<std::uint64_t>(top) & 0x3fffffffu) << 4) | (static_cast<std::uint64_t>(low) << 34);
  };
  std::vector<std::uint64_t> a, b;  // two ranks
  std::vector<float> want;
  // The same sums through the owners' pass with each rank's last micro-batch still raw: zeros
  // (no change), and on one rank -sign * 2^b(G - 1), a value of level G - 1 that rounds to
  // exactly one unit of G's low grid (the sum moves by -sign).
  std::vector<float> unit, want_unit;
  for (std::uint64_t level : {std::uint64_t{2}, std::uint64_t{6}, std::uint64_t{11}})
    for (int p = 45; p <= 53; ++p)
      for (std::int64_t d : {std::int64_t{-1}, std::int64_t{0}, std::int64_t{1}, std::int64_t{4096}, std::int64_t{8191}})
        for (int sign : {1, -1}) {
          const int g = exact::bin_exponent(static_cast<int>(level) - 1);
          const std::int64_t s = sign * ((std::int64_t{1} << p) + (std::int64_t{1} << (p - 24)) + d);
          // Split over the two ranks: each within the 30-bit bins.
          const std::int64_t half = s / 2, rest = s - half;
          a.push_back(word(level, half >> 24, half - ((half >> 24) << 24)));
          b.push_back(word(level, rest >> 24, rest - ((rest >> 24) << 24)));
          want.push_back(cpu::exact_to_float(s, g));
          unit.push_back(static_cast<float>(std::ldexp(static_cast<double>(-sign), g)));
          want_unit.push_back(cpu::exact_to_float(s - sign, g));
        }
  const std::uint64_t* src[2] = {a.data(), b.data()};
  const std::vector<float> zeros(want.size(), 0.0f);
  for (cpu::Isa isa : isas()) {
    cpu::set_isa(isa);
    std::vector<float> got(want.size());
    cpu::exact_combine_packed(src, 2, got.data(), got.size(), nullptr);
    for (std::size_t i = 0; i < want.size(); ++i)
      ASSERT_EQ(bits(got[i]), bits(want[i])) << cpu::isa_name(isa) << " case " << i << ": " << got[i] << " vs " << want[i];
    const float* none[2] = {zeros.data(), zeros.data()};
    cpu::exact_deposit_combine_packed(src, none, 2, got.data(), got.size(), nullptr);
    for (std::size_t i = 0; i < want.size(); ++i)
      ASSERT_EQ(bits(got[i]), bits(want[i])) << cpu::isa_name(isa) << " raw zeros, case " << i << ": " << got[i] << " vs " << want[i];
    const float* one[2] = {zeros.data(), unit.data()};
    cpu::exact_deposit_combine_packed(src, one, 2, got.data(), got.size(), nullptr);
    for (std::size_t i = 0; i < want.size(); ++i)
      ASSERT_EQ(bits(got[i]), bits(want_unit[i])) << cpu::isa_name(isa) << " raw unit, case " << i << ": " << got[i] << " vs " << want_unit[i];
  }
}

// The deposit on every ISA leaves the same levels and bins as the portable one (and so as
// the accumulator before it was vectorised, whose code the portable one is), micro-batch
// after micro-batch on the boundary corpus: rises by one and by several levels, non-finite
// values, zeros, subnormals; unaligned starts and ragged ends.
TEST(ExactKernels, DepositEqualsThePortableDeposit) {
  const IsaScope restore;
  const std::size_t n = 10007;
  const PerRank rows = corpus(24, n, 31337);
  struct Bins {
    std::vector<std::int64_t> top, low;
    std::vector<std::uint8_t> level;
  };
  auto run = [&](cpu::Isa isa, std::size_t offset) {
    cpu::set_isa(isa);
    Bins b{std::vector<std::int64_t>(n, 0), std::vector<std::int64_t>(n, 0), std::vector<std::uint8_t>(n, 0)};
    for (const auto& row : rows)
      cpu::exact_deposit(row.data() + offset, n - offset, b.top.data() + offset, b.low.data() + offset,
                         b.level.data() + offset);
    return b;
  };
  // The last micro-batch straight to the packed state equals depositing it, then packing.
  {
    cpu::set_isa(cpu::Isa::Portable);
    Bins b{std::vector<std::int64_t>(n, 0), std::vector<std::int64_t>(n, 0), std::vector<std::uint8_t>(n, 0)};
    for (std::size_t k = 0; k + 1 < rows.size(); ++k)
      cpu::exact_deposit(rows[k].data(), n, b.top.data(), b.low.data(), b.level.data());
    Bins after = b;
    cpu::exact_deposit(rows.back().data(), n, after.top.data(), after.low.data(), after.level.data());
    std::vector<std::uint64_t> want(n);
    cpu::exact_pack(after.level.data(), after.top.data(), after.low.data(), want.data(), n);
    for (cpu::Isa isa : isas()) {
      cpu::set_isa(isa);
      std::vector<std::uint64_t> got(n);
      cpu::exact_deposit_pack(rows.back().data(), n, b.top.data(), b.low.data(), b.level.data(), got.data());
      EXPECT_EQ(got, want) << cpu::isa_name(isa);
    }
  }
  for (std::size_t offset : {std::size_t{0}, std::size_t{5}}) {
    const Bins want = run(cpu::Isa::Portable, offset);
    for (cpu::Isa isa : isas()) {
      const Bins got = run(isa, offset);
      for (std::size_t i = offset; i < n; ++i) {
        ASSERT_EQ(got.level[i], want.level[i]) << cpu::isa_name(isa) << " element " << i;
        if (want.level[i] == 0 || want.level[i] == 127) continue;  // bins unused
        ASSERT_EQ(got.top[i], want.top[i]) << cpu::isa_name(isa) << " element " << i;
        ASSERT_EQ(got.low[i], want.low[i]) << cpu::isa_name(isa) << " element " << i;
      }
    }
  }
}

// ---- the compact accumulation (the packed word as the accumulator) ---------------------------

namespace {

// Micro-batches for the packed deposit: the boundary corpus (its element patterns run across
// the rows: level edges, lifts, ties, subnormals, FLT_MAX, NaN and Inf, -0, cancellation),
// then elements that grow the bins to the packed word's limit (63 values near the top of a
// level: |top| up to 63 (2^23 - 1)), that climb a level every few rows (lifts by one) or jump
// by several, that cancel, and heavy-tailed random rows.
PerRank packed_rows(std::size_t rows, std::size_t n, std::uint64_t seed) {
  PerRank v = corpus(static_cast<int>(rows), n, seed);
  std::mt19937_64 rng(seed * 7 + 1);
  for (std::size_t i = 0; i < n; ++i) {
    switch (i % 11) {
      case 0:  // the top of level 5 (exponent field 119), same sign: the widest bins
        for (std::size_t k = 0; k < rows; ++k) v[k][i] = std::bit_cast<float>(0x3bffff00u | static_cast<std::uint32_t>(k & 0xff));
        break;
      case 1:  // the top of level 8 (field 191), negative: the sign of the 30-bit fields
        for (std::size_t k = 0; k < rows; ++k) v[k][i] = -std::bit_cast<float>(0x5fffffffu - static_cast<std::uint32_t>(k));
        break;
      case 2:  // a lift by one every few rows (exponent fields 20, 44, 68, ...: the top bin moves down)
        for (std::size_t k = 0; k < rows; ++k)
          v[k][i] = with_exponent(rng, std::min(254, 20 + 24 * static_cast<int>(k / 4) + static_cast<int>(rng() % 4)));
        break;
      case 3:  // small values, then a jump by several levels, then small ones again
        for (std::size_t k = 0; k < rows; ++k)
          v[k][i] = with_exponent(rng, k == rows / 2 ? 200 : 1 + static_cast<int>(rng() % 40));
        break;
      case 4:  // cancellation to zero (row pairs), then -0
        for (std::size_t k = 0; k < rows; ++k) {
          const float x = std::bit_cast<float>(0x4b000000u + static_cast<std::uint32_t>(i % 1000));
          v[k][i] = k + 1 == rows && rows % 2 == 1 ? -0.0f : (k % 2 == 0 ? x : -x);
        }
        break;
      case 5:  // heavy-tailed random
        for (std::size_t k = 0; k < rows; ++k) v[k][i] = random_value(rng);
        break;
      default:  // the corpus's patterns
        break;
    }
  }
  return v;
}

// One process's bins after each micro-batch, packed (the oracle: the portable deposit, the
// scalar code of the 17-byte accumulator, then exact_pack).
std::vector<std::vector<std::uint64_t>> packed_after_each(const PerRank& rows, std::size_t offset) {
  const IsaScope restore;
  cpu::set_isa(cpu::Isa::Portable);
  const std::size_t n = rows[0].size() - offset;
  std::vector<std::int64_t> top(n, 0), low(n, 0);
  std::vector<std::uint8_t> level(n, 0);
  std::vector<std::vector<std::uint64_t>> out;
  for (const auto& row : rows) {
    cpu::exact_deposit(row.data() + offset, n, top.data(), low.data(), level.data());
    std::vector<std::uint64_t> w(n);
    cpu::exact_pack(level.data(), top.data(), low.data(), w.data(), n);
    out.push_back(std::move(w));
  }
  return out;
}

}  // namespace

// The deposit straight into the packed words (in place, and into another buffer) on every ISA
// gives after each of 63 micro-batches what the bins give deposited by the portable code and
// packed: the corpus of packed_rows, aligned and unaligned starts, ragged ends. Unpacked, the
// words are the bins again (levels, and bins where the level is 1-11).
TEST(ExactKernels, PackedDepositEqualsDepositThenPack) {
  const IsaScope restore;
  const std::size_t n = 10007;
  const std::size_t m = static_cast<std::size_t>(cpu::kPackedMaxMicroBatches);
  const PerRank rows = packed_rows(m, n, 4242);
  for (std::size_t offset : {std::size_t{0}, std::size_t{5}}) {
    const auto want = packed_after_each(rows, offset);
    const std::size_t len = n - offset;
    // The limit is reached: some words hold bins close to 2^29 in magnitude.
    std::int64_t widest = 0;
    for (std::uint64_t w : want.back()) widest = std::max(widest, std::abs(static_cast<std::int64_t>(w << 30) >> 34));
    EXPECT_GT(widest, std::int64_t{1} << 28) << "offset " << offset;
    for (cpu::Isa isa : isas()) {
      cpu::set_isa(isa);
      const std::string what = std::string(cpu::isa_name(isa)) + ", offset " + std::to_string(offset);
      std::vector<std::uint64_t> words(len, 0xdeadbeefdeadbeefull);  // the first deposit writes every word
      for (std::size_t k = 0; k < m; ++k) {
        // Into another buffer (the wire) from the state before, then in place.
        std::vector<std::uint64_t> wire(len, 0x5555555555555555ull);
        cpu::exact_deposit_packed(rows[k].data() + offset, len, k == 0 ? nullptr : words.data(), wire.data());
        expect_same(wire, want[k], what + ", into the wire after micro-batch " + std::to_string(k));
        cpu::exact_deposit_packed(rows[k].data() + offset, len, k == 0 ? nullptr : words.data(), words.data());
        expect_same(words, want[k], what + ", in place after micro-batch " + std::to_string(k));
        if (HasFatalFailure()) return;
      }
      std::vector<std::uint8_t> level(len);
      std::vector<std::int64_t> top(len), low(len);
      cpu::exact_unpack(words.data(), len, level.data(), top.data(), low.data());
      std::vector<std::uint64_t> again(len);
      cpu::exact_pack(level.data(), top.data(), low.data(), again.data(), len);
      expect_same(again, words, what + ", unpacked and packed again");
    }
  }
}

// Several sources in one pass (exact_deposit_packed_multi, the sharded accumulation's owner
// depositing every rank's values) gives the words of depositing them one by one: 63 rows of
// packed_rows (with runs of zeros in every row) in groups of 1 to 8 sources (the first group,
// of 3, from empty words; then in place and into another buffer), every ISA, aligned and
// unaligned starts, ragged ends, and a length across grains; no source at all leaves the
// words (or empty ones).
TEST(ExactKernels, MultiSourceDepositEqualsDepositsOneByOne) {
  const IsaScope restore;
  const std::size_t m = static_cast<std::size_t>(cpu::kPackedMaxMicroBatches);
  for (std::size_t n : {std::size_t{10007}, std::size_t{3 * 65536 + 29}}) {
    PerRank rows = packed_rows(m, n, 9191 + n);
    for (auto& row : rows) std::fill(row.begin() + 64, row.begin() + 160, 0.0f);  // runs of zeros in every source
    for (std::size_t offset : {std::size_t{0}, std::size_t{3}}) {
      const auto want = packed_after_each(rows, offset);
      const std::size_t len = n - offset;
      for (cpu::Isa isa : isas()) {
        cpu::set_isa(isa);
        const std::string what = std::string(cpu::isa_name(isa)) + ", n " + std::to_string(n) + ", offset " +
                                 std::to_string(offset);
        std::vector<std::uint64_t> words(len, 0xdeadbeefdeadbeefull);
        std::size_t done = 0;
        for (std::size_t group = 3; done < m; group = group % 8 + 1) {  // the first from empty words
          const std::size_t k = std::min(group, m - done);
          std::vector<const float*> src;
          for (std::size_t j = 0; j < k; ++j) src.push_back(rows[done + j].data() + offset);
          std::vector<std::uint64_t> wire(len, 0x5555555555555555ull);
          cpu::exact_deposit_packed_multi(src.data(), static_cast<int>(k), len, done == 0 ? nullptr : words.data(),
                                          wire.data());
          expect_same(wire, want[done + k - 1], what + ", into another buffer after " + std::to_string(done + k));
          cpu::exact_deposit_packed_multi(src.data(), static_cast<int>(k), len, done == 0 ? nullptr : words.data(),
                                          words.data());
          expect_same(words, want[done + k - 1], what + ", in place after " + std::to_string(done + k));
          if (HasFatalFailure()) return;
          done += k;
        }
        // No source: the words of `in` unchanged (copied into another buffer), or empty ones.
        std::vector<std::uint64_t> copy(len, 0x5555555555555555ull);
        cpu::exact_deposit_packed_multi(nullptr, 0, len, words.data(), copy.data());
        expect_same(copy, want.back(), what + ", no source from the words");
        cpu::exact_deposit_packed_multi(nullptr, 0, len, nullptr, copy.data());
        expect_same(copy, std::vector<std::uint64_t>(len, 0), what + ", no source from empty");
      }
    }
  }
}

// The deposit that consumes its input (exact_deposit_packed_clear, what begin_backward runs)
// writes exact_deposit_packed's words and leaves g +0 (bits 0) on exactly its range: a first
// deposit and one in place, every ISA, aligned and unaligned starts of g and of the words,
// short lengths that are not multiples of a vector, and one across three grains, the last
// partial. The reference is the portable exact_deposit_packed (PackedDepositEqualsDepositThenPack
// checks it).
TEST(ExactKernels, PackedDepositClearEqualsDepositThenClear) {
  const IsaScope restore;
  constexpr std::size_t kGuard = 16;
  const std::size_t longest = 2 * 65536 + 4096 + 37;
  const PerRank rows = packed_rows(2, longest + kGuard, 777);
  for (std::size_t len : {std::size_t{1}, std::size_t{7}, std::size_t{23}, std::size_t{61}, longest}) {
    for (std::size_t offset : {std::size_t{0}, std::size_t{1}, std::size_t{5}, std::size_t{8}}) {
      // The reference: portable, the words after each of the two micro-batches.
      cpu::set_isa(cpu::Isa::Portable);
      std::vector<std::vector<std::uint64_t>> want;
      std::vector<std::uint64_t> ref(len);
      for (std::size_t k = 0; k < rows.size(); ++k) {
        cpu::exact_deposit_packed(rows[k].data() + offset, len, k == 0 ? nullptr : ref.data(), ref.data());
        want.push_back(ref);
      }
      for (cpu::Isa isa : isas()) {
        cpu::set_isa(isa);
        const std::string what =
            std::string(cpu::isa_name(isa)) + ", length " + std::to_string(len) + ", offset " + std::to_string(offset);
        // The words `offset` words past the vector's start, guards around both ranges.
        std::vector<std::uint64_t> plain_mem(len + kGuard, 0xdeadbeefdeadbeefull), clear_mem = plain_mem;
        std::uint64_t* plain = plain_mem.data() + offset;
        std::uint64_t* words = clear_mem.data() + offset;
        for (std::size_t k = 0; k < rows.size(); ++k) {
          const std::string at = what + ", micro-batch " + std::to_string(k);
          cpu::exact_deposit_packed(rows[k].data() + offset, len, k == 0 ? nullptr : plain, plain);
          expect_same(std::vector<std::uint64_t>(plain, plain + len), want[k], at + ", exact_deposit_packed");
          std::vector<float> g = rows[k];
          cpu::exact_deposit_packed_clear(g.data() + offset, len, k == 0 ? nullptr : words, words);
          expect_same(std::vector<std::uint64_t>(words, words + len), want[k], at + ", the words");
          for (std::size_t i = 0; i < g.size(); ++i) {
            const bool inside = i >= offset && i < offset + len;
            ASSERT_EQ(bits(g[i]), inside ? 0u : bits(rows[k][i])) << at << ", g[" << i << "]";
          }
          for (std::size_t i = 0; i < clear_mem.size(); ++i)
            if (i < offset || i >= offset + len) ASSERT_EQ(clear_mem[i], 0xdeadbeefdeadbeefull) << at << ", word " << i;
          if (HasFatalFailure()) return;
        }
      }
    }
  }
}

// ExactGrads::deposit_and_clear, the compact form and the bins: the state deposit() leaves,
// and the gradients +0 after it.
TEST(ExactKernels, DepositAndClearEqualsDepositThenClear) {
  const std::size_t n = 4099;
  const PerRank rows = packed_rows(3, n, 31);
  for (bool compact : {true, false}) {
    const std::string what = compact ? "compact" : "bins";
    const std::size_t bytes = exact::grads_bytes(n, n);
    auto make = [&] {
      if (compact) {
        auto words = std::make_shared<std::vector<std::uint64_t>>(n, 0x123456789abcdef1ull);
        return exact::ExactGrads::compact(
            cpu_backend(), Allocation(words->data(), exact::packed_bytes(n), words, nullptr, MemCategory::Grads), n);
      }
      auto mem = std::make_shared<std::vector<std::int64_t>>(bytes / 8 + 1);
      return exact::ExactGrads(cpu_backend(), Allocation(mem->data(), bytes, mem, nullptr, MemCategory::Grads), n, n);
    };
    exact::ExactGrads plain = make(), consumed = make();
    for (std::size_t k = 0; k < rows.size(); ++k) {
      plain.deposit(rows[k].data(), n);
      std::vector<float> g = rows[k];
      consumed.deposit_and_clear(g.data(), n);
      for (std::size_t i = 0; i < n; ++i) ASSERT_EQ(bits(g[i]), 0u) << what << ", g[" << i << "]";
      EXPECT_EQ(consumed.is_compact(), compact) << what;
      std::vector<std::uint64_t> a(n), b(n);
      plain.pack(0, n, a.data());
      consumed.pack(0, n, b.data());
      expect_same(b, a, what + ", state after micro-batch " + std::to_string(k));
    }
  }
}

// A micro-batch held raw in the upper half of shared words (ExactGrads::deposit_and_clear with
// may_hold) is the state one deposit leaves once settled, alone (settle(), and widen(), which
// settles) or with the next micro-batch in the same pass (a second deposit_and_clear): the
// words equal those of plain deposits bit for bit, on every ISA, over several of the settling
// pass's windows (2^16 elements: the words written there cover held values of the windows
// before, which must have been read first) and a tail. Without may_hold, or with unshared
// words, nothing is held.
TEST(ExactKernels, HeldMicroBatchSettlesToTheDepositsWords) {
  const IsaScope restore;
  const std::size_t n = 3 * (std::size_t{1} << 16) + 4099;
  const PerRank rows = packed_rows(3, n, 57);
  auto make = [&](bool shared) {
    // Words as a previous step leaves them (stale): the settling pass must write, not read.
    auto words = std::make_shared<std::vector<std::uint64_t>>(n, 0x123456789abcdef1ull);
    return exact::ExactGrads::compact(
        cpu_backend(), Allocation(words->data(), exact::packed_bytes(n), words, nullptr, MemCategory::Grads), n,
        shared);
  };
  auto state = [&](const exact::ExactGrads& g) {
    std::vector<std::uint64_t> w(n);
    g.pack(0, n, w.data());
    return w;
  };
  for (cpu::Isa isa : isas()) {
    cpu::set_isa(isa);
    const std::string at = cpu::isa_name(isa);
    exact::ExactGrads one = make(false), two = make(false);
    one.deposit(rows[0].data(), n);
    two.deposit(rows[0].data(), n);
    two.deposit(rows[1].data(), n);
    // Held, then the next micro-batch: both deposited in one pass, the buffer cleared.
    exact::ExactGrads held = make(true);
    std::vector<float> g = rows[0];
    held.deposit_and_clear(g.data(), n, true);
    EXPECT_TRUE(held.holds_raw()) << at;
    EXPECT_FALSE(held.deposited()) << at;
    for (std::size_t i = 0; i < n; ++i) ASSERT_EQ(bits(g[i]), 0u) << at << ", held, g[" << i << "]";
    g = rows[1];
    held.deposit_and_clear(g.data(), n, true);
    EXPECT_FALSE(held.holds_raw()) << at;
    EXPECT_TRUE(held.deposited()) << at;
    for (std::size_t i = 0; i < n; ++i) ASSERT_EQ(bits(g[i]), 0u) << at << ", settled, g[" << i << "]";
    expect_same(state(held), state(two), at + ", held then a second micro-batch");
    if (HasFatalFailure()) return;
    // A third goes into the words in place, as any deposit.
    g = rows[2];
    held.deposit_and_clear(g.data(), n, true);
    two.deposit(rows[2].data(), n);
    expect_same(state(held), state(two), at + ", a third micro-batch");
    // Held, then settled alone.
    exact::ExactGrads alone = make(true);
    g = rows[0];
    alone.deposit_and_clear(g.data(), n, true);
    alone.settle();
    EXPECT_FALSE(alone.holds_raw()) << at;
    expect_same(state(alone), state(one), at + ", held then settled");
    // Held, then widened into the bins: the bins of one deposit.
    exact::ExactGrads wide = make(true);
    g = rows[0];
    wide.deposit_and_clear(g.data(), n, true);
    const std::size_t bytes = exact::grads_bytes(n, n);
    auto mem = std::make_shared<std::vector<std::int64_t>>(bytes / 8 + 1);
    wide.widen(Allocation(mem->data(), bytes, mem, nullptr, MemCategory::Grads), n);
    EXPECT_FALSE(wide.holds_raw()) << at;
    expect_same(state(wide), state(one), at + ", held then widened");
    // Nothing is held without may_hold, or without shared words.
    for (bool shared : {true, false}) {
      exact::ExactGrads no = make(shared);
      g = rows[0];
      no.deposit_and_clear(g.data(), n, !shared);
      EXPECT_FALSE(no.holds_raw()) << at << (shared ? ", shared, no may_hold" : ", unshared");
      expect_same(state(no), state(one), at + ", deposited at once");
    }
    if (HasFatalFailure()) return;
  }
}

// The compact accumulator (ExactGrads::compact) against the bins: its state after each
// micro-batch, the packed exchange's result (one process), and past the limit the widened
// bins' two-phase result, all equal the bins' result bit for bit: 1, 2, 5, 63 and 64
// micro-batches (the last one in the gradient buffer).
TEST(ExactKernels, CompactAccumulatorEqualsTheBins) {
  const std::size_t n = 4099;
  const PerRank all = packed_rows(64, n, 99);
  auto comm = make_single_process_communicator();
  Bucket bk;
  bk.flat = Range{0, n};
  bk.slice_elems = n;
  for (std::size_t m : {std::size_t{1}, std::size_t{2}, std::size_t{5}, std::size_t{63}, std::size_t{64}}) {
    const PerRank rows(all.begin(), all.begin() + static_cast<std::ptrdiff_t>(m));
    const std::vector<float> want = oracle_binned(rows);
    const std::string what = std::to_string(m) + " micro-batches";
    // Words as a previous step leaves them: clear() writes nothing, the first deposit must.
    auto words = std::make_shared<std::vector<std::uint64_t>>(n, 0x123456789abcdef1ull);
    exact::ExactGrads acc = exact::ExactGrads::compact(
        cpu_backend(), Allocation(words->data(), exact::packed_bytes(n), words, nullptr, MemCategory::Grads), n);
    const std::size_t bytes = exact::grads_bytes(n, n);
    auto mem = std::make_shared<std::vector<std::int64_t>>(bytes / 8 + 1);
    exact::ExactGrads bins(cpu_backend(), Allocation(mem->data(), bytes, mem, nullptr, MemCategory::Grads), n, n);
    for (std::size_t k = 0; k + 1 < m; ++k) {
      ASSERT_FALSE(acc.full()) << what;
      acc.deposit(rows[k].data(), n);
      bins.deposit(rows[k].data(), n);
      std::vector<std::uint64_t> a(n), b(n);
      acc.pack(0, n, a.data());
      bins.pack(0, n, b.data());
      expect_same(a, b, what + ", state after micro-batch " + std::to_string(k));
    }
    EXPECT_EQ(acc.deposited(), m > 1) << what;
    EXPECT_EQ(acc.full(), m - 1 == static_cast<std::size_t>(cpu::kPackedMaxMicroBatches)) << what;
    std::vector<float> out = rows.back();
    if (m <= static_cast<std::size_t>(cpu::kPackedMaxMicroBatches)) {
      // The packed exchange: the words with the last micro-batch go to the wire; the state
      // stays (a refusal could still widen it).
      std::vector<std::uint64_t> before(n), after(n), wire(n);
      acc.pack(0, n, before.data());
      exact::SquareSum squares;
      ASSERT_TRUE(acc.reduce_packed(*comm, cpu_backend(), bk, false, out.data(), wire.data(), squares)) << what;
      acc.pack(0, n, after.data());
      expect_same(after, before, what + ", state after the exchange");
      expect_same(out, want, what + ", the packed exchange");
    }
    // The two-phase method from the widened bins (what happens past 63, and on a refusal).
    auto wide = std::make_shared<std::vector<std::int64_t>>(bytes / 8 + 1);
    acc.widen(Allocation(wide->data(), bytes, wide, nullptr, MemCategory::Grads), n);
    EXPECT_FALSE(acc.is_compact());
    out = rows.back();
    acc.reduce(*comm, bk, false, out.data());
    expect_same(out, want, what + ", widened, two-phase");
  }
}

// ---- the two-phase method's passes (exact::ExactGrads::reduce) --------------------------------

namespace {

// The two-phase method over ranks on one process, every pass on the active ISA over elements
// [offset, n), with what each pass wrote. One micro-batch per rank (`rows` one per rank):
// each rank's levels, their maximum (the all-reduce MaxU8), each rank's values rounded to
// that level's grid, the int64 sums (the all-reduce SumI64), one rounding. Several (`ranks`
// < rows: rank r deposits rows r, r + ranks, ...; its last row stays in the gradient buffer as
// in ExactGrads::reduce): the deposits, the maximum of the levels, each rank's bins lifted to
// it, the sums, one rounding.
struct TwoPhase {
  std::vector<std::vector<std::uint8_t>> own;     // each rank's levels
  std::vector<std::uint8_t> level;                // their maximum
  std::vector<std::vector<std::int64_t>> packed;  // each rank's int64 contribution
  std::vector<std::int64_t> sum;
  std::vector<float> out;
};

TwoPhase two_phase(const PerRank& rows, int ranks, std::size_t offset = 0) {
  const std::size_t n = rows[0].size() - offset;
  TwoPhase t;
  t.level.assign(n, 0);
  t.sum.assign(n, 0);
  const bool deposited = rows.size() > static_cast<std::size_t>(ranks);
  std::vector<std::vector<std::int64_t>> low;
  for (int r = 0; r < ranks; ++r) {
    std::vector<std::uint8_t> own(n, 0);
    std::vector<std::int64_t> top(n, 0), lo(n, 0);
    if (deposited) {
      for (std::size_t k = static_cast<std::size_t>(r); k < rows.size(); k += static_cast<std::size_t>(ranks))
        cpu::exact_deposit(rows[k].data() + offset, n, top.data(), lo.data(), own.data());
    } else {
      cpu::exact_levels(rows[static_cast<std::size_t>(r)].data() + offset, n, own.data());
    }
    for (std::size_t i = 0; i < n; ++i) t.level[i] = std::max(t.level[i], own[i]);
    t.own.push_back(std::move(own));
    t.packed.push_back(std::move(top));
    low.push_back(std::move(lo));
  }
  for (int r = 0; r < ranks; ++r) {
    const auto k = static_cast<std::size_t>(r);
    if (deposited)
      cpu::exact_lift(t.own[k].data(), t.level.data(), t.packed[k].data(), low[k].data(), n);
    else
      cpu::exact_round_to_levels(rows[k].data() + offset, n, t.level.data(), t.packed[k].data());
    for (std::size_t i = 0; i < n; ++i) t.sum[i] += t.packed[k][i];
  }
  t.out.resize(n);
  cpu::exact_sums_to_float(t.sum.data(), t.level.data(), t.out.data(), n);
  return t;
}

std::vector<float> two_phase_sum(const PerRank& vals) { return two_phase(vals, static_cast<int>(vals.size())).out; }

}  // namespace

// Every pass of the two-phase method on every ISA (forced, each in turn) writes what the
// portable pass writes, bit for bit, and the result equals the independent oracles: the
// eager one (one micro-batch per rank) and one process depositing every micro-batch (several
// per rank: lifts by one and by several levels between ranks). The boundary corpus, 1-17
// ranks, unaligned starts and ragged ends.
TEST(ExactKernels, TwoPhasePassesEqualThePortableOnesAndTheOracles) {
  const IsaScope restore;
  struct Case {
    int ranks;
    std::size_t rows;  // micro-batches in all (ranks: one each)
  };
  for (const Case& c : {Case{1, 1}, Case{2, 2}, Case{3, 3}, Case{4, 4}, Case{17, 17}, Case{1, 5}, Case{2, 7},
                        Case{3, 12}, Case{4, 9}}) {
    const std::size_t n = 10007;
    const PerRank rows = corpus(static_cast<int>(c.rows), n, 555u + c.rows * 31 + static_cast<std::uint64_t>(c.ranks));
    std::vector<float> want(n);
    if (c.rows == static_cast<std::size_t>(c.ranks)) {
      for (std::size_t i = 0; i < n; ++i) want[i] = oracle_one(rows, i);
    } else {
      want = oracle_binned(rows);
    }
    for (std::size_t offset : {std::size_t{0}, std::size_t{3}}) {
      cpu::set_isa(cpu::Isa::Portable);
      const TwoPhase ref = two_phase(rows, c.ranks, offset);
      const std::string base = std::to_string(c.ranks) + " ranks, " + std::to_string(c.rows) +
                                " micro-batches, offset " + std::to_string(offset) + ", ";
      expect_same(ref.out, std::vector<float>(want.begin() + static_cast<std::ptrdiff_t>(offset), want.end()),
                  base + "portable vs the oracle");
      for (cpu::Isa isa : isas()) {
        if (isa == cpu::Isa::Portable) continue;
        cpu::set_isa(isa);
        const TwoPhase got = two_phase(rows, c.ranks, offset);
        const std::string what = base + cpu::isa_name(isa);
        for (std::size_t r = 0; r < got.own.size(); ++r) {
          expect_same(got.own[r], ref.own[r], what + " levels of rank " + std::to_string(r));
          expect_same(got.packed[r], ref.packed[r], what + " integers of rank " + std::to_string(r));
        }
        expect_same(got.out, ref.out, what + " sums");
      }
    }
  }
}

// The final rounding on its own, every ISA against cpu::exact_to_float (which
// ExactSum.ToFloatRoundsOnceToNearestEven checks against long double) on int64 sums at every
// level: ties of the rounding one unit either side, around 2^50 (where the rounding to odd
// starts), subnormal results of level 1 (ties included), sums that round to Inf or to
// FLT_MAX, zero, the int64 extremes and random words; empty and non-finite levels.
TEST(ExactKernels, TwoPhaseSumsRoundOnce) {
  const IsaScope restore;
  std::vector<std::int64_t> sums;
  std::vector<std::uint8_t> levels;
  std::mt19937_64 rng(2024);
  auto add = [&](std::int64_t s, int level) {
    sums.push_back(s);
    levels.push_back(static_cast<std::uint8_t>(level));
  };
  for (int level : {0, 1, 2, 6, 10, 11, 127}) {
    add(std::numeric_limits<std::int64_t>::min(), level);
    for (std::int64_t s : {std::int64_t{0}, std::int64_t{1}, std::int64_t{2}, std::int64_t{3}, std::int64_t{5},
                           std::numeric_limits<std::int64_t>::max(), std::int64_t{1} << 50,
                           (std::int64_t{1} << 50) - 1, (std::int64_t{1} << 50) + 1})
      for (int sign : {1, -1}) add(sign * s, level);
    for (int p = 24; p <= 62; ++p)  // below 2^24 every sum is exact (no tie to round)
      for (std::int64_t d : {std::int64_t{-1}, std::int64_t{0}, std::int64_t{1}, std::int64_t{4096}, std::int64_t{8191}})
        for (int sign : {1, -1}) {
          // 2^p + 2^(p-24) is a tie of the rounding to 24 bits; + d either side of it.
          const std::int64_t t = (std::int64_t{1} << p) + (std::int64_t{1} << (p - 24)) + d;
          add(sign * t, level);
          add(sign * (t + (std::int64_t{1} << (p - 23))), level);  // odd significand: ties up
        }
    for (int k = 0; k < 200; ++k) add(static_cast<std::int64_t>(rng()), level);
  }
  for (std::int64_t d : {std::int64_t{-1}, std::int64_t{0}, std::int64_t{1}})
    for (int sign : {1, -1}) {
      // level 11's grid is 2^90: FLT_MAX = (2^24 - 1) 2^104 = (2^24 - 1) 2^14 units; the tie
      // above it (2^24 - 1/2) 2^14 units rounds to Inf.
      add(sign * (((std::int64_t{1} << 24) - 1) * (std::int64_t{1} << 14) + (std::int64_t{1} << 13) + d), 11);
      add(sign * ((std::int64_t{1} << 38) + d), 11);  // 2^128: Inf
    }
  const std::size_t n = sums.size();
  std::vector<float> want(n);
  for (std::size_t i = 0; i < n; ++i)
    want[i] = levels[i] == 0     ? 0.0f
              : levels[i] == 127 ? std::numeric_limits<float>::quiet_NaN()
                                 : cpu::exact_to_float(sums[i], exact::bin_exponent(levels[i] - 1));
  for (cpu::Isa isa : isas()) {
    cpu::set_isa(isa);
    for (std::size_t offset : {std::size_t{0}, std::size_t{1}}) {
      std::vector<float> got(n - offset);
      cpu::exact_sums_to_float(sums.data() + offset, levels.data() + offset, got.data(), got.size());
      expect_same(got, std::vector<float>(want.begin() + static_cast<std::ptrdiff_t>(offset), want.end()),
                  std::string(cpu::isa_name(isa)) + ", offset " + std::to_string(offset));
    }
  }
  // The cases the comments name occur (this list is not vacuous).
  std::size_t infs = 0, subnormals = 0;
  for (float f : want) {
    infs += std::isinf(f) ? 1 : 0;
    subnormals += std::fpclassify(f) == FP_SUBNORMAL ? 1 : 0;
  }
  EXPECT_GT(infs, 0u);
  EXPECT_GT(subnormals, 0u);
}

TEST(ExactKernels, TwoPhaseIsOddAndScalesByLevels) {
  const IsaScope restore;
  for (cpu::Isa isa : isas()) {
    cpu::set_isa(isa);
    expect_odd_and_scaling_by_levels(two_phase_sum, std::string("two-phase, ") + cpu::isa_name(isa));
  }
}
