// test_cpu_kernels.cpp: every CPU kernel against a double-precision reference, on awkward
// sizes, misaligned starts and special values; then every ISA, streaming policy and thread
// count against the portable single-threaded run, bit for bit.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#if defined(_OPENMP)
#include <omp.h>
#endif

#include "kernels.hpp"
#include "shardopt/error.hpp"
#include "support/bf16_reference.hpp"
#include "support/reference.hpp"

namespace shardopt::cpu {
namespace {

using test::reference_bf16;
using test::synth;

constexpr float kEps32 = std::numeric_limits<float>::epsilon();

std::vector<Isa> supported_isas() {
  std::vector<Isa> out;
  for (Isa isa : {Isa::Portable, Isa::Avx2, Isa::Avx512})
    if (isa_supported(isa)) out.push_back(isa);
  return out;
}

/// Restores the ISA, streaming policy and thread count a test changed.
class KernelSettings {
 public:
  KernelSettings() : isa_(active_isa()), stream_(stream_policy()) {}
  ~KernelSettings() {
    set_isa(isa_);
    set_stream_policy(stream_);
    set_threads(0);
  }
  static void set_threads(int t) {
#if defined(_OPENMP)
    static const int initial = omp_get_max_threads();
    omp_set_num_threads(t > 0 ? t : initial);
#else
    (void)t;
#endif
  }

 private:
  Isa isa_;
  StreamPolicy stream_;
};

bool same_bits(float a, float b) { return float_bits(a) == float_bits(b); }

/// Values that stress the kernels: NaNs of both signs and payloads, infinities, signed
/// zeros, subnormals, the largest floats, and values at the bf16 rounding boundaries.
const std::vector<std::uint32_t>& special_bits() {
  static const std::vector<std::uint32_t> v = {
      0x7FC00000u, 0xFFC00000u, 0x7F800001u, 0xFFBFFFFFu,  // NaN: quiet, signaling, payloads
      0x7F800000u, 0xFF800000u,                           // +-Inf
      0x00000000u, 0x80000000u,                           // +-0
      0x00000001u, 0x807FFFFFu, 0x00008000u, 0x00018000u,  // subnormals (incl. ties)
      0x7F7FFFFFu, 0xFF7FFFFFu,                           // +-FLT_MAX -> +-Inf in bf16
      0x7F7F7FFFu, 0x7F7F8000u, 0x7F7F0000u,              // just below / at the overflow tie
      0x3F808000u, 0x3F818000u, 0x3F808001u, 0x3F807FFFu,  // ties and near-ties at 1
      0x00800000u, 0x80800000u,                           // smallest normals
  };
  return v;
}

/// Deterministic data with a special value every `stride` elements (0: none).
std::vector<float> make_data(std::size_t n, std::uint64_t seed, float amplitude,
                             std::size_t stride) {
  std::vector<float> x(n);
  const auto& sp = special_bits();
  for (std::size_t i = 0; i < n; ++i) {
    x[i] = amplitude * synth(seed, i, 0, 0);
    if (stride && i % stride == stride / 2) x[i] = bits_float(sp[(i / stride) % sp.size()]);
  }
  return x;
}

/// A copy of `src` placed `offset` elements past a 64-byte boundary inside `storage`.
template <class T>
T* place(std::vector<T>& storage, const std::vector<T>& src, std::size_t offset) {
  storage.assign(src.size() + offset + 64 / sizeof(T), T{});
  auto base = reinterpret_cast<std::uintptr_t>(storage.data());
  const std::size_t skip = ((64 - base % 64) % 64) / sizeof(T) + offset;
  std::copy(src.begin(), src.end(), storage.begin() + static_cast<std::ptrdiff_t>(skip));
  return storage.data() + skip;
}

// ---- one run of every kernel -------------------------------------------------------------

struct Inputs {
  std::size_t n;
  std::size_t offset;
  std::vector<float> p, g, m, v;        // Adam state (finite, v >= 0)
  std::vector<float> special;          // finite data laced with special values
  std::vector<float> finite;           // finite data with subnormals and huge values
  std::vector<bf16> half;              // bf16 data, all classes
  std::vector<float> acc;              // accumulation target
  std::vector<UpdateSegment> segments;  // two parameter groups, split off the vector width
  StepScalars scalars_w, scalars_l2;
};

Inputs make_inputs(std::size_t n, std::size_t offset) {
  Inputs in;
  in.n = n;
  in.offset = offset;
  in.p = make_data(n, 1, 2.0f, 0);
  in.g = make_data(n, 2, 0.5f, 0);
  in.m = make_data(n, 3, 0.05f, 0);
  in.v = make_data(n, 4, 0.01f, 0);
  for (float& x : in.v) x = std::fabs(x);
  // A few gradients of extreme magnitudes; still finite through the update.
  for (std::size_t i = 5; i < n; i += 101) in.g[i] = (i % 2) ? 0.0f : 1e-30f;
  in.special = make_data(n, 5, 3.0f, 13);
  in.finite = make_data(n, 6, 100.0f, 0);
  for (std::size_t i = 3; i < n; i += 29) in.finite[i] = (i % 2) ? 1e-40f : -3.0e38f;
  in.half.resize(n);
  for (std::size_t i = 0; i < n; ++i)
    in.half[i] = bf16{static_cast<std::uint16_t>((i * 40503u + 7u) & 0xFFFFu)};
  in.acc = make_data(n, 7, 1.0f, 17);

  const StepHyper h{1e-3, 0.9, 0.999, 1e-8, 0.1, AdamMode::AdamW, 7};
  in.scalars_w = make_step_scalars(h, 0.25);
  StepHyper h2 = h;
  h2.mode = AdamMode::AdamL2;
  in.scalars_l2 = make_step_scalars(h2, 0.25);
  const std::size_t split = n / 3 + 1 < n ? n / 3 + 1 : n;
  in.segments = {{0, split, make_segment_scalars(h, 1.0, true)},
                 {split, n, make_segment_scalars(h, 0.5, false)}};
  return in;
}

struct Outputs {
  std::vector<float> p_w, m_w, v_w;     // AdamW with a bf16 copy
  std::vector<bf16> copy_bf16;
  std::vector<float> p_l2, m_l2, v_l2;  // Adam-L2 with an fp32 copy
  std::vector<float> copy_f32;
  std::vector<bf16> cast_down;          // special -> bf16
  std::vector<float> cast_up;           // half -> f32
  std::vector<float> acc_f32, acc_bf16;  // acc + special, acc + half
  std::vector<float> scaled;            // special * 0.37
  std::vector<float> zeroed;            // 1.5, special zeroed, 2.5: fill_zero and its bounds
  double sumsq_finite = 0, sumsq_special = 0;
  bool finite_ok = false, special_ok = true;
};

template <class T>
std::vector<T> to_vec(const T* x, std::size_t n) {
  return std::vector<T>(x, x + n);
}

Outputs run_kernels(const Inputs& in) {
  const std::size_t n = in.n, off = in.offset;
  Outputs out;
  std::vector<float> sp, sg, sm, sv, so;
  std::vector<bf16> sb;
  std::vector<UpdateSegment> seg_l2 = in.segments;
  for (UpdateSegment& s : seg_l2) {
    s.scalars.l2_decay = 0.1f;
    s.scalars.decay_factor = 1.0f;
  }
  {
    float* p = place(sp, in.p, off);
    float* g = place(sg, in.g, off + 1);  // every array misaligned differently
    float* m = place(sm, in.m, off + 2);
    float* v = place(sv, in.v, off + 3);
    bf16* o = place(sb, std::vector<bf16>(n), off + 1);
    adam_update(in.scalars_w, in.segments, p, g, m, v, o, nullptr);
    out.p_w = to_vec(p, n), out.m_w = to_vec(m, n), out.v_w = to_vec(v, n);
    out.copy_bf16 = to_vec(o, n);
  }
  {
    float* p = place(sp, in.p, off + 3);
    float* g = place(sg, in.g, off);
    float* m = place(sm, in.m, off + 1);
    float* v = place(sv, in.v, off + 2);
    float* o = place(so, std::vector<float>(n), off + 5);
    adam_update(in.scalars_l2, seg_l2, p, g, m, v, nullptr, o);
    out.p_l2 = to_vec(p, n), out.m_l2 = to_vec(m, n), out.v_l2 = to_vec(v, n);
    out.copy_f32 = to_vec(o, n);
  }
  {
    const float* src = place(sp, in.special, off);
    bf16* dst = place(sb, std::vector<bf16>(n), off + 3);
    cast_f32_to_bf16(src, dst, n);
    out.cast_down = to_vec(dst, n);
    std::vector<bf16> sh;
    const bf16* hsrc = place(sh, in.half, off + 1);
    float* fdst = place(so, std::vector<float>(n), off);
    cast_bf16_to_f32(hsrc, fdst, n);
    out.cast_up = to_vec(fdst, n);
    float* acc = place(sg, in.acc, off + 2);
    accumulate(acc, src, n);
    out.acc_f32 = to_vec(acc, n);
    acc = place(sg, in.acc, off + 1);
    accumulate(acc, hsrc, n);
    out.acc_bf16 = to_vec(acc, n);
    float* x = place(sm, in.special, off + 3);
    scale(x, n, 0.37f);
    out.scaled = to_vec(x, n);
    std::vector<float> guarded{1.5f};
    guarded.insert(guarded.end(), in.special.begin(), in.special.end());
    guarded.push_back(2.5f);
    std::vector<float> sz;
    float* z = place(sz, guarded, off + 2);
    fill_zero(z + 1, n);
    out.zeroed = to_vec(z, n + 2);
    out.special_ok = all_finite(src, n);
    out.sumsq_special = sum_squares(src, n);
    const float* fin = place(sv, in.finite, off + 1);
    out.finite_ok = all_finite(fin, n);
    out.sumsq_finite = sum_squares(fin, n);
  }
  return out;
}

// ---- references --------------------------------------------------------------------------

/// Checks one Adam run against the update in double, with the same float scalars. The
/// bound allows a few float roundings of each term.
void check_adam_reference(const Inputs& in, const StepScalars& s,
                          const std::vector<UpdateSegment>& segs, const std::vector<float>& p,
                          const std::vector<float>& m, const std::vector<float>& v,
                          const char* what) {
  for (const UpdateSegment& seg : segs) {
    const SegmentScalars& g = seg.scalars;
    for (std::size_t i = seg.begin; i < seg.end; ++i) {
      double gr = static_cast<double>(in.g[i]) * s.grad_scale;
      const double l2_term = s.mode == AdamMode::AdamL2 ? double{g.l2_decay} * in.p[i] : 0.0;
      gr += l2_term;
      const double pd = static_cast<double>(in.p[i]) * g.decay_factor;
      const double m1 = double{s.beta1} * in.m[i], m2 = double{s.one_minus_beta1} * gr;
      const double v1 = double{s.beta2} * in.v[i], v2 = double{s.one_minus_beta2} * gr * gr;
      const double md = m1 + m2, vd = v1 + v2;
      const double denom = std::sqrt(vd) / s.bias_correction2_sqrt + s.eps;
      const double step = g.step_size * md / denom;
      const double pn = pd - step;
      const double tiny = 1e-38;
      const double tol_m = 8 * kEps32 * (std::fabs(m1) + std::fabs(m2) + std::fabs(l2_term)) + tiny;
      const double tol_v = 8 * kEps32 * (std::fabs(v1) + std::fabs(v2)) + tiny;
      const double tol_p =
          16 * kEps32 * (std::fabs(pd) + std::fabs(step) +
                         g.step_size * (std::fabs(m1) + std::fabs(m2) + std::fabs(l2_term)) / denom) +
          tiny;
      ASSERT_NEAR(m[i], md, tol_m) << what << " m at " << i;
      ASSERT_NEAR(v[i], vd, tol_v) << what << " v at " << i;
      ASSERT_NEAR(p[i], pn, tol_p) << what << " p at " << i;
    }
  }
}

double reference_bf16_to_double(bf16 h) {
  const std::uint32_t e = (h.bits >> 7) & 0xFF, f = h.bits & 0x7F;
  const double sign = (h.bits & 0x8000) ? -1.0 : 1.0;
  if (e == 0xFF) return f ? std::numeric_limits<double>::quiet_NaN() : sign * INFINITY;
  if (e == 0) return sign * std::ldexp(static_cast<double>(f), -133);
  return sign * std::ldexp(128.0 + f, static_cast<int>(e) - 134);
}

/// Float rounding of an exact double result (sum or product of two floats): one rounding.
bool matches_rounded(float got, double exact) {
  if (std::isnan(exact)) return std::isnan(got);
  return same_bits(got, static_cast<float>(exact));
}

/// The documented sum order, written out independently of the kernels.
double documented_sum_squares(const std::vector<float>& x) {
  double total = 0;
  for (std::size_t b = 0; b < x.size(); b += kSumBlock) {
    double lanes[kSumLanes] = {};
    for (std::size_t i = b; i < std::min(x.size(), b + kSumBlock); ++i)
      lanes[(i - b) % kSumLanes] += static_cast<double>(x[i]) * x[i];
    for (std::size_t w = kSumLanes / 2; w >= 1; w /= 2)
      for (std::size_t j = 0; j < w; ++j) lanes[j] += lanes[j + w];
    total += lanes[0];
  }
  return total;
}

void check_against_references(const Inputs& in, const Outputs& out) {
  const std::size_t n = in.n;
  check_adam_reference(in, in.scalars_w, in.segments, out.p_w, out.m_w, out.v_w, "AdamW");
  std::vector<UpdateSegment> seg_l2 = in.segments;
  for (UpdateSegment& s : seg_l2) {
    s.scalars.l2_decay = 0.1f;
    s.scalars.decay_factor = 1.0f;
  }
  check_adam_reference(in, in.scalars_l2, seg_l2, out.p_l2, out.m_l2, out.v_l2, "Adam-L2");
  for (std::size_t i = 0; i < n; ++i) {
    ASSERT_EQ(out.copy_bf16[i].bits, reference_bf16(out.p_w[i])) << i;
    ASSERT_TRUE(same_bits(out.copy_f32[i], out.p_l2[i])) << i;
    ASSERT_EQ(out.cast_down[i].bits, reference_bf16(in.special[i]))
        << std::hex << float_bits(in.special[i]) << " at " << std::dec << i;
    const double up = reference_bf16_to_double(in.half[i]);
    if (std::isnan(up)) {
      ASSERT_EQ(float_bits(out.cast_up[i]), std::uint32_t{in.half[i].bits} << 16) << i;
    } else {
      ASSERT_EQ(static_cast<double>(out.cast_up[i]), up) << i;
    }
    ASSERT_TRUE(matches_rounded(out.acc_f32[i], double{in.acc[i]} + in.special[i])) << i;
    ASSERT_TRUE(matches_rounded(out.acc_bf16[i], double{in.acc[i]} + up)) << i;
    ASSERT_TRUE(matches_rounded(out.scaled[i], double{in.special[i]} * 0.37f)) << i;
    ASSERT_EQ(float_bits(out.zeroed[i + 1]), 0u) << "fill_zero at " << i;
  }
  ASSERT_EQ(out.zeroed.front(), 1.5f) << "fill_zero wrote before its range";
  ASSERT_EQ(out.zeroed.back(), 2.5f) << "fill_zero wrote past its range";
  long double exact = 0;
  for (float x : in.finite) exact += static_cast<long double>(x) * x;
  const double bound = static_cast<double>(n + kSumLanes) * 0x1p-53 * static_cast<double>(exact);
  EXPECT_NEAR(out.sumsq_finite, static_cast<double>(exact), bound);
  EXPECT_EQ(out.sumsq_finite, documented_sum_squares(in.finite));
  EXPECT_TRUE(out.finite_ok);
  const bool has_special = n > 13 / 2;  // make_data puts the first special at index 6
  EXPECT_EQ(out.special_ok, !has_special);
  if (has_special) EXPECT_TRUE(std::isnan(out.sumsq_special));
}

void expect_identical(const Outputs& a, const Outputs& b, const std::string& what) {
  // Bit for bit, except that any NaN equals any NaN: where two NaNs meet in an addition,
  // x86 returns the first operand's payload and compilers may commute the operands.
  auto same = [&](const auto& x, const auto& y, const char* name) {
    ASSERT_EQ(x.size(), y.size());
    for (std::size_t i = 0; i < x.size(); ++i) {
      if constexpr (std::is_same_v<std::decay_t<decltype(x[i])>, float>) {
        if (std::isnan(x[i]) && std::isnan(y[i])) continue;
        ASSERT_TRUE(same_bits(x[i], y[i])) << what << ": " << name << " at " << i;
      } else {
        ASSERT_EQ(x[i].bits, y[i].bits) << what << ": " << name << " at " << i;
      }
    }
  };
  same(a.p_w, b.p_w, "AdamW p");
  same(a.m_w, b.m_w, "AdamW m");
  same(a.v_w, b.v_w, "AdamW v");
  same(a.copy_bf16, b.copy_bf16, "bf16 copy");
  same(a.p_l2, b.p_l2, "Adam-L2 p");
  same(a.m_l2, b.m_l2, "Adam-L2 m");
  same(a.v_l2, b.v_l2, "Adam-L2 v");
  same(a.copy_f32, b.copy_f32, "fp32 copy");
  same(a.cast_down, b.cast_down, "cast f32->bf16");
  same(a.cast_up, b.cast_up, "cast bf16->f32");
  same(a.acc_f32, b.acc_f32, "accumulate f32");
  same(a.acc_bf16, b.acc_bf16, "accumulate bf16");
  same(a.scaled, b.scaled, "scale");
  same(a.zeroed, b.zeroed, "fill_zero");
  EXPECT_EQ(float_bits(static_cast<float>(a.sumsq_finite)),
            float_bits(static_cast<float>(b.sumsq_finite)));
  EXPECT_EQ(std::memcmp(&a.sumsq_finite, &b.sumsq_finite, sizeof(double)), 0) << what << ": sumsq";
  EXPECT_EQ(a.finite_ok, b.finite_ok) << what;
  EXPECT_EQ(a.special_ok, b.special_ok) << what;
}

// ---- tests -------------------------------------------------------------------------------

class CpuKernels : public ::testing::TestWithParam<std::size_t> {};

// Sizes below, at and just past the vector widths, the OpenMP grain (65536) and the sum
// block (8192) and its groups of 8 (27 blocks: 3 groups and 3 single blocks), and one large
// odd size.
INSTANTIATE_TEST_SUITE_P(Sizes, CpuKernels,
                         ::testing::Values(0, 1, 7, 15, 16, 17, 33, 8193, 65536 * 2 + 37, 8192 * 27,
                                           1000003));

TEST_P(CpuKernels, EveryIsaStreamAndThreadCountMatchesTheReference) {
  KernelSettings restore;
  const std::size_t n = GetParam();
  // Misaligned starts; the largest size only at two to keep the test fast.
  const std::vector<std::size_t> offsets =
      n > 200000 ? std::vector<std::size_t>{0, 3} : std::vector<std::size_t>{0, 1, 3};
  for (std::size_t offset : offsets) {
    const Inputs in = make_inputs(n, offset);
    set_isa(Isa::Portable);
    set_stream_policy(StreamPolicy::Never);
    KernelSettings::set_threads(1);
    const Outputs base = run_kernels(in);
    check_against_references(in, base);
    if (HasFatalFailure()) return;
    for (Isa isa : supported_isas()) {
      for (StreamPolicy sp : {StreamPolicy::Never, StreamPolicy::Always}) {
        for (int threads : {1, 2, 4}) {
          set_isa(isa);
          set_stream_policy(sp);
          KernelSettings::set_threads(threads);
          expect_identical(run_kernels(in), base,
                           std::string(isa_name(isa)) + (sp == StreamPolicy::Always ? " stream" : "") +
                               " threads=" + std::to_string(threads) + " n=" + std::to_string(n) +
                               " offset=" + std::to_string(offset));
        }
      }
    }
  }
}

TEST(CpuKernelsEdge, AdamSpecialValuesMatchAdamElementBitForBit) {
  KernelSettings restore;
  const auto& sp = special_bits();
  const std::size_t n = 1037;
  const Inputs in = make_inputs(n, 0);
  std::vector<float> p = in.p, g = in.g, m = in.m, v = in.v;
  for (std::size_t i = 0; i < n; ++i) {  // specials in every slot of p, grad and m in turn
    const float x = bits_float(sp[i % sp.size()]);
    if (i % 3 == 0) p[i] = x;
    if (i % 3 == 1) g[i] = x;
    if (i % 3 == 2) m[i] = x;
  }
  std::vector<float> ep = p, em = m, ev = v;
  for (const UpdateSegment& seg : in.segments)
    for (std::size_t i = seg.begin; i < seg.end; ++i)
      adam_element(in.scalars_w, seg.scalars, ep[i], g[i], em[i], ev[i]);
  for (Isa isa : supported_isas()) {
    set_isa(isa);
    for (StreamPolicy pol : {StreamPolicy::Never, StreamPolicy::Always}) {
      set_stream_policy(pol);
      std::vector<float> kp = p, km = m, kv = v;
      std::vector<bf16> out(n);
      adam_update(in.scalars_w, in.segments, kp.data(), g.data(), km.data(), kv.data(),
                  out.data(), nullptr);
      for (std::size_t i = 0; i < n; ++i) {
        ASSERT_TRUE(same_bits(kp[i], ep[i])) << isa_name(isa) << " p at " << i;
        ASSERT_TRUE(same_bits(km[i], em[i])) << isa_name(isa) << " m at " << i;
        ASSERT_TRUE(same_bits(kv[i], ev[i])) << isa_name(isa) << " v at " << i;
        ASSERT_EQ(out[i].bits, float_to_bf16_bits(ep[i])) << isa_name(isa) << " at " << i;
      }
    }
  }
}

TEST(CpuKernelsEdge, AllFiniteFindsOneBadValueAnywhere) {
  KernelSettings restore;
  const std::size_t n = 65536 + 100;
  std::vector<float> x = make_data(n, 9, 1.0f, 0);
  for (Isa isa : supported_isas()) {
    set_isa(isa);
    for (std::size_t pos : {std::size_t{0}, std::size_t{7}, std::size_t{16}, std::size_t{65535},
                            std::size_t{65536}, n - 1}) {
      for (float bad : {NAN, INFINITY, -INFINITY}) {
        const float keep = x[pos];
        x[pos] = bad;
        EXPECT_FALSE(all_finite(x.data(), n)) << isa_name(isa) << " at " << pos;
        EXPECT_FALSE(std::isfinite(sum_squares(x.data(), n))) << isa_name(isa) << " at " << pos;
        x[pos] = keep;
      }
    }
    EXPECT_TRUE(all_finite(x.data(), n));
    EXPECT_TRUE(all_finite(x.data(), 0));
    EXPECT_EQ(sum_squares(x.data(), 0), 0.0);
  }
}

TEST(CpuKernelsEdge, SumSquaresIsInfOnlyForInfinities) {
  KernelSettings restore;
  std::vector<float> x(100, std::numeric_limits<float>::max());
  for (Isa isa : supported_isas()) {
    set_isa(isa);
    EXPECT_TRUE(std::isfinite(sum_squares(x.data(), x.size())));  // 1e78 fits in double
    x[50] = -INFINITY;
    EXPECT_EQ(sum_squares(x.data(), x.size()), INFINITY);
    x[50] = std::numeric_limits<float>::max();
  }
}

TEST(CpuKernelsDispatch, ForcingAnIsaTheCpuLacksThrows) {
  KernelSettings restore;
  EXPECT_TRUE(isa_supported(Isa::Portable));
  EXPECT_TRUE(isa_supported(best_isa()));
  for (Isa isa : {Isa::Portable, Isa::Avx2, Isa::Avx512}) {
    if (isa_supported(isa)) {
      EXPECT_NO_THROW(set_isa(isa));
      EXPECT_EQ(active_isa(), isa);
    } else {
      try {
        set_isa(isa);
        ADD_FAILURE() << "set_isa accepted " << isa_name(isa);
      } catch (const Error& e) {
        EXPECT_EQ(e.status(), Status::Unsupported);
      }
    }
  }
}

}  // namespace
}  // namespace shardopt::cpu

// ---- Lion (the rule layer's second rule) -------------------------------------------------------

namespace shardopt::cpu {
namespace {

struct LionCase {
  std::vector<float> p, g, m;
  std::vector<LionSegment> segments;
};

// Three groups' scalars over [0, n), with and without decay, scaled gradients.
LionCase make_lion_case(std::size_t n, bool specials) {
  LionCase c;
  for (std::size_t i = 0; i < n; ++i) {
    c.p.push_back(synth(31, 1, 0, i));
    c.g.push_back(synth(31, 2, 0, i) * (i % 7 == 0 ? 1e-3f : 1.0f));
    c.m.push_back(synth(31, 3, 0, i) * 0.1f);
  }
  if (specials) {
    const auto& sp = special_bits();
    for (std::size_t i = 0; i < n; i += 5) {
      float& slot = i % 3 == 0 ? c.p[i] : i % 3 == 1 ? c.g[i] : c.m[i];
      slot = bits_float(sp[(i / 5) % sp.size()]);
    }
  }
  for (std::size_t i = 0; i < n; i += 9) c.g[i] = c.m[i] = 0.0f;  // c = 0: sign(0) = 0
  const std::size_t a = n / 3, b = 2 * n / 3;
  c.segments = {LionSegment{0, a, make_lion_scalars(0.9, 0.99, 1e-3, 0.1, 0.5)},
                LionSegment{a, b, make_lion_scalars(0.95, 0.98, 3e-4, 0.0, 0.25)},
                LionSegment{b, n, make_lion_scalars(0.0, 0.5, 2.0, 0.01, 1.0 / 3.0)}};
  return c;
}

TEST(LionKernels, EveryIsaAndThreadCountMatchesLionElementBitForBit) {
  KernelSettings restore;
  for (std::size_t n : {std::size_t{1037}, std::size_t{200003}}) {
    const LionCase c = make_lion_case(n, true);
    std::vector<float> ep = c.p, em = c.m;
    for (const LionSegment& s : c.segments)
      for (std::size_t i = s.begin; i < s.end; ++i) lion_element(s.scalars, ep[i], c.g[i], em[i]);
    for (Isa isa : supported_isas())
      for (int threads : {1, 2, 3}) {
        set_isa(isa);
        KernelSettings::set_threads(threads);
        std::vector<float> p = c.p, m = c.m, out32(n);
        std::vector<bf16> out16(n);
        lion_update(c.segments, p.data(), c.g.data(), m.data(), out16.data(), nullptr);
        std::vector<float> p2 = c.p, m2 = c.m;
        lion_update(c.segments, p2.data(), c.g.data(), m2.data(), nullptr, out32.data());
        for (std::size_t i = 0; i < n; ++i) {
          ASSERT_TRUE(same_bits(p[i], ep[i])) << isa_name(isa) << " p at " << i;
          ASSERT_TRUE(same_bits(m[i], em[i])) << isa_name(isa) << " m at " << i;
          ASSERT_EQ(out16[i].bits, float_to_bf16_bits(ep[i])) << isa_name(isa) << " bf16 at " << i;
          ASSERT_TRUE(same_bits(out32[i], ep[i])) << isa_name(isa) << " f32 copy at " << i;
          ASSERT_TRUE(same_bits(p2[i], ep[i]) && same_bits(m2[i], em[i])) << isa_name(isa) << i;
        }
      }
  }
}

// The kernel against Lion in double precision (lion-pytorch's order): the weight within a
// few ulps of the double result, the momentum too; the sign may differ only where the double
// interpolation is within float rounding of zero.
TEST(LionKernels, MatchesTheDoubleReference) {
  KernelSettings restore;
  const std::size_t n = 50001;
  const LionCase c = make_lion_case(n, false);
  const double hyper[3][5] = {{0.9, 0.99, 1e-3, 0.1, 0.5},
                              {0.95, 0.98, 3e-4, 0.0, 0.25},
                              {0.0, 0.5, 2.0, 0.01, 1.0 / 3.0}};
  for (Isa isa : supported_isas()) {
    set_isa(isa);
    std::vector<float> p = c.p, m = c.m;
    lion_update(c.segments, p.data(), c.g.data(), m.data(), nullptr, nullptr);
    std::size_t near_zero = 0, zero_sign = 0;
    for (std::size_t s = 0; s < 3; ++s)
      for (std::size_t i = c.segments[s].begin; i < c.segments[s].end; ++i) {
        const double b1 = hyper[s][0], b2 = hyper[s][1], lr = hyper[s][2], wd = hyper[s][3];
        const double g = static_cast<double>(c.g[i]) * hyper[s][4];
        const double cc = b1 * c.m[i] + (1 - b1) * g;
        const double sign = cc > 0 ? 1.0 : cc < 0 ? -1.0 : 0.0;
        const double ep = c.p[i] * (1 - lr * wd) - lr * sign;
        const double em = b2 * c.m[i] + (1 - b2) * g;
        const double scale_c = std::fabs(b1 * c.m[i]) + std::fabs((1 - b1) * g);
        if (std::fabs(cc) <= 4 * kEps32 * scale_c && sign != 0) {
          ++near_zero;  // within rounding of zero: either sign (or zero) is right
          continue;
        }
        if (sign == 0) ++zero_sign;
        const double tol_p = 4 * kEps32 * (std::fabs(c.p[i]) + lr);
        ASSERT_NEAR(p[i], ep, tol_p) << isa_name(isa) << " p at " << i;
        ASSERT_NEAR(m[i], em, 4 * kEps32 * (std::fabs(b2 * c.m[i]) + std::fabs((1 - b2) * g)) + 1e-45)
            << isa_name(isa) << " m at " << i;
      }
    EXPECT_LT(near_zero, n / 1000) << "too many interpolations near zero to check the signs";
    EXPECT_GE(zero_sign, n / 9) << "the sign(0) = 0 elements were not exercised";
  }
}

TEST(LionKernels, ZeroInterpolationLeavesTheDecayedWeight) {
  const LionScalars s = make_lion_scalars(0.9, 0.99, 0.5, 0.2, 1.0);
  for (float p0 : {1.5f, -2.0f, 0.0f, -0.0f}) {
    float p = p0, m = 0.0f;
    lion_element(s, p, 0.0f, m);  // c = 0
    EXPECT_TRUE(same_bits(p, p0 * s.decay_factor)) << p0;
    EXPECT_EQ(m, 0.0f);
    float q = p0, mm = -0.0f;
    lion_element(s, q, -0.0f, mm);  // c = -0: still no step
    EXPECT_TRUE(same_bits(q, p0 * s.decay_factor)) << p0;
  }
  float p = 1.0f, m = 0.0f;
  lion_element(s, p, 1e-30f, m);  // a tiny positive gradient: a full -lr step
  EXPECT_FLOAT_EQ(p, 1.0f * s.decay_factor - 0.5f);
}

}  // namespace
}  // namespace shardopt::cpu
