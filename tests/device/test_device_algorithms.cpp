// test_device_algorithms.cpp: the device algorithms of cuda/ (the templates the CUDA backend
// instantiates) run through Thrust's OpenMP device system, against the CPU kernels (bitwise:
// same functors) and double-precision references.
#include <gtest/gtest.h>
#include <omp.h>
#include <thrust/execution_policy.h>

#include <cmath>
#include <ostream>
#include <cstring>
#include <limits>
#include <numeric>
#include <vector>

#include "cpu/kernels.hpp"
#include "device_algorithms.hpp"
#include "launch_config.hpp"
#include "support/reference.hpp"

using namespace shardopt;
using shardopt::test::synth;

#if THRUST_DEVICE_SYSTEM != THRUST_DEVICE_SYSTEM_OMP
#error "this test is built with THRUST_DEVICE_SYSTEM=THRUST_DEVICE_SYSTEM_OMP"
#endif

namespace {

const auto& exec = thrust::device;  // the OpenMP device system in this build

std::uint32_t bits(float f) { return float_bits(f); }

std::vector<float> values(std::size_t n, std::uint64_t seed, float scale = 1.0f) {
  std::vector<float> x(n);
  for (std::size_t i = 0; i < n; ++i) x[i] = scale * synth(seed, 1, 2, i);
  return x;
}

// ---- index arithmetic -------------------------------------------------------------------------

TEST(ChunkArithmetic, CountsCoverEveryElement) {
  EXPECT_EQ(dev::adam_chunk_count(0), 0u);
  EXPECT_EQ(dev::adam_chunk_count(1), 1u);
  EXPECT_EQ(dev::adam_chunk_count(4), 1u);
  EXPECT_EQ(dev::adam_chunk_count(5), 2u);
  EXPECT_EQ(dev::adam_chunk_count(4097), 1025u);
}

TEST(ChunkArithmetic, FindSegmentSkipsEmptySegments) {
  const SegmentScalars z{};
  const std::vector<UpdateSegment> segs = {{0, 0, z}, {0, 5, z}, {5, 5, z}, {5, 6, z}, {6, 20, z}};
  const std::size_t want[20] = {1, 1, 1, 1, 1, 3, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4};
  for (std::size_t i = 0; i < 20; ++i)
    EXPECT_EQ(dev::find_segment(segs.data(), segs.size(), i), want[i]) << "element " << i;
}

TEST(LaunchConfig, GridStrideVisitsEveryItemOnce) {
  for (std::size_t items : {std::size_t{0}, std::size_t{1}, std::size_t{255}, std::size_t{256},
                            std::size_t{257}, std::size_t{100000}}) {
    const dev::LaunchConfig c = dev::grid_stride_config(items, 4, 2, 256);
    EXPECT_GE(c.blocks, 1u);
    EXPECT_LE(c.blocks, 8u);
    std::vector<int> seen(items, 0);
    for (unsigned b = 0; b < c.blocks; ++b)
      for (unsigned t = 0; t < c.threads; ++t)
        for (std::size_t i = dev::grid_stride_first(b, c.threads, t); i < items;
             i += dev::grid_stride_stride(c))
          ++seen[i];
    for (std::size_t i = 0; i < items; ++i) ASSERT_EQ(seen[i], 1) << "item " << i;
  }
  EXPECT_EQ(dev::grid_stride_config(1000, 132, 5).blocks, 4u);  // small: one item per thread
  // Large: capped at the resident blocks the occupancy calculator reports (5 per SM).
  EXPECT_EQ(dev::grid_stride_config(1u << 30, 132, 5).blocks, 132u * 5u);
}

// ---- fused update -----------------------------------------------------------------------------

struct AdamCase {
  AdamMode mode;
  DType out;      // replica dtype
  bool replica;   // write the replica copy at all
  std::size_t offset;  // elements by which every buffer is shifted (1: misaligned)
};

void PrintTo(const AdamCase& c, std::ostream* os) {
  *os << (c.mode == AdamMode::AdamW ? "AdamW" : "Adam-L2") << " " << dtype_name(c.out) << (c.replica ? "" : " (no replica)") << " offset " << c.offset;
}

class AdamUpdate : public ::testing::TestWithParam<AdamCase> {};

// Segments with boundaries inside 4-element chunks, an empty one, and different scalars.
std::vector<UpdateSegment> segments_for(std::size_t n, const StepHyper& h) {
  std::vector<UpdateSegment> s;
  const std::size_t cuts[] = {0, std::min<std::size_t>(n, 5), std::min<std::size_t>(n, 5),
                              std::min<std::size_t>(n, 130), n};
  const SegmentScalars a = make_segment_scalars(h, 1.0, true);
  const SegmentScalars b = make_segment_scalars(h, 0.5, false);
  for (int k = 0; k < 4; ++k) s.push_back({cuts[k], cuts[k + 1], k % 2 ? b : a});
  return s;
}

TEST_P(AdamUpdate, MatchesCpuKernelBitwise) {
  const AdamCase c = GetParam();
  const StepHyper h{1e-2, 0.9, 0.999, 1e-8, 0.1, c.mode, 3};
  const StepScalars s = make_step_scalars(h, 0.5);
  for (std::size_t n : {0, 1, 3, 4, 5, 7, 131, 1000, 4099}) {
    const std::vector<UpdateSegment> segs = segments_for(n, h);
    const std::size_t o = c.offset;
    std::vector<float> p0 = values(n + o, 1), g = values(n + o, 2), m0 = values(n + o, 3, 0.1f),
                       v0 = values(n + o, 4, 0.01f);
    for (float& x : v0) x = x * x;
    // Reference: the CPU kernel.
    std::vector<float> p1 = p0, m1 = m0, v1 = v0, f1(n + o, -1.0f);
    std::vector<bf16> b1(n + o, bf16{0xFFFF});
    cpu::adam_update(s, segs, p1.data() + o, g.data() + o, m1.data() + o, v1.data() + o,
                     c.replica && c.out == DType::BF16 ? b1.data() + o : nullptr,
                     c.replica && c.out == DType::F32 ? f1.data() + o : nullptr);
    // Device algorithm, vectorized when alignment allows and forced scalar.
    for (bool allow_vector : {true, false}) {
      std::vector<float> p2 = p0, m2 = m0, v2 = v0, f2(n + o, -1.0f);
      std::vector<bf16> b2(n + o, bf16{0xFFFF});
      dev::AdamChunkOp op;
      op.step = &s;
      op.segments = segs.data();
      op.num_segments = segs.size();
      op.n = n;
      op.master = p2.data() + o;
      op.grad = g.data() + o;
      op.m = m2.data() + o;
      op.v = v2.data() + o;
      op.out_bf16 = c.replica && c.out == DType::BF16 ? b2.data() + o : nullptr;
      op.out_f32 = c.replica && c.out == DType::F32 ? f2.data() + o : nullptr;
      op.vectorized = allow_vector && dev::adam_vector_aligned(op.master, op.grad, op.m, op.v,
                                                               op.out_bf16, op.out_f32);
      if (allow_vector && o == 0 && n > 0) {
        // std::vector storage is 16-byte aligned for these sizes on glibc.
        EXPECT_TRUE(op.vectorized);
      }
      dev::adam_update(exec, op);
      for (std::size_t i = 0; i < n + o; ++i) {
        ASSERT_EQ(bits(p2[i]), bits(p1[i])) << "n=" << n << " i=" << i;
        ASSERT_EQ(bits(m2[i]), bits(m1[i])) << "n=" << n << " i=" << i;
        ASSERT_EQ(bits(v2[i]), bits(v1[i])) << "n=" << n << " i=" << i;
        ASSERT_EQ(b2[i].bits, b1[i].bits) << "n=" << n << " i=" << i;
        ASSERT_EQ(bits(f2[i]), bits(f1[i])) << "n=" << n << " i=" << i;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Cases, AdamUpdate,
    ::testing::Values(AdamCase{AdamMode::AdamW, DType::BF16, true, 0},
                      AdamCase{AdamMode::AdamW, DType::F32, true, 0},
                      AdamCase{AdamMode::AdamW, DType::BF16, false, 0},
                      AdamCase{AdamMode::AdamL2, DType::BF16, true, 0},
                      AdamCase{AdamMode::AdamW, DType::BF16, true, 1},
                      AdamCase{AdamMode::AdamL2, DType::F32, true, 3}),
    [](const ::testing::TestParamInfo<AdamCase>& i) {
      return std::string(i.param.mode == AdamMode::AdamW ? "adamw" : "adam_l2") + "_" +
             (i.param.replica ? dtype_name(i.param.out) : "no_replica") + "_offset" +
             std::to_string(i.param.offset);
    });

// The formulas themselves, against the double-precision oracle (the bitwise test above only
// shows that the device code equals the CPU kernel).
TEST(AdamUpdateReference, CloseToDoubleOracle) {
  AdamConfig cfg;
  cfg.lr = 1e-2;
  cfg.weight_decay = 0.1;
  const std::size_t n = 777;
  const std::vector<GroupOptions> groups = {GroupOptions{}};
  std::vector<test::RefParam> ref(1);
  std::vector<float> p = values(n, 7), m(n, 0.0f), v(n, 0.0f);
  ref[0].p.assign(p.begin(), p.end());
  ref[0].m.assign(n, 0.0);
  ref[0].v.assign(n, 0.0);
  for (int step = 1; step <= 5; ++step) {
    const std::vector<float> g = values(n, 100 + static_cast<std::uint64_t>(step));
    const StepHyper h{cfg.lr, cfg.beta1, cfg.beta2, cfg.eps, cfg.weight_decay, cfg.mode, step};
    const StepScalars s = make_step_scalars(h, 1.0);
    const UpdateSegment seg{0, n, make_segment_scalars(h, 1.0, true)};
    dev::AdamChunkOp op;
    op.step = &s;
    op.segments = &seg;
    op.num_segments = 1;
    op.n = n;
    op.master = p.data();
    op.grad = g.data();
    op.m = m.data();
    op.v = v.data();
    op.vectorized = dev::adam_vector_aligned(p.data(), g.data(), m.data(), v.data(), nullptr,
                                             nullptr);
    dev::adam_update(exec, op);
    test::reference_step(ref, {std::vector<double>(g.begin(), g.end())}, cfg, groups, step);
  }
  for (std::size_t i = 0; i < n; ++i) ASSERT_NEAR(p[i], ref[0].p[i], 2e-6) << i;
}

// ---- casts and accumulation -------------------------------------------------------------------

TEST(Casts, EveryBf16PatternWidensExactly) {
  std::vector<bf16> all(65536);
  for (std::size_t i = 0; i < all.size(); ++i) all[i].bits = static_cast<std::uint16_t>(i);
  std::vector<float> got(all.size()), want(all.size());
  dev::cast_bf16_to_f32(exec, all.data(), got.data(), all.size());
  cpu::cast_bf16_to_f32(all.data(), want.data(), all.size());
  for (std::size_t i = 0; i < all.size(); ++i) {
    ASSERT_EQ(bits(got[i]), bits(want[i])) << i;
    ASSERT_EQ(bits(got[i]), static_cast<std::uint32_t>(i) << 16) << i;
  }
}

TEST(Casts, NarrowingRoundsToNearestEvenLikeCpu) {
  std::vector<float> x = values(100003, 9, 1e3f);
  const float specials[] = {0.0f, -0.0f, 1.00390625f /* tie -> even */, 1.01171875f,
                            std::numeric_limits<float>::infinity(),
                            -std::numeric_limits<float>::infinity(),
                            std::numeric_limits<float>::quiet_NaN(),
                            std::numeric_limits<float>::max(),
                            std::numeric_limits<float>::denorm_min(), 1e-40f};
  std::copy(std::begin(specials), std::end(specials), x.begin());
  std::vector<bf16> got(x.size()), want(x.size());
  dev::cast_f32_to_bf16(exec, x.data(), got.data(), x.size());
  cpu::cast_f32_to_bf16(x.data(), want.data(), x.size());
  for (std::size_t i = 0; i < x.size(); ++i) ASSERT_EQ(got[i].bits, want[i].bits) << i;
  EXPECT_EQ(got[2].bits, 0x3F80);  // 1 + 2^-8 is half-way: rounds to 1.0 (even)
  EXPECT_EQ(got[3].bits, 0x3F82);  // 1 + 3*2^-8 is half-way: rounds up to the even 0x3F82
  EXPECT_EQ(got[7].bits, 0x7F80);  // FLT_MAX overflows to +Inf
}

TEST(Accumulate, Fp32AndBf16MatchCpu) {
  const std::size_t n = 70001;
  const std::vector<float> base = values(n, 11), add = values(n, 12);
  std::vector<bf16> add16(n);
  for (std::size_t i = 0; i < n; ++i) add16[i] = to_bf16(add[i]);
  std::vector<float> a = base, b = base, c = base, d = base;
  dev::accumulate(exec, a.data(), add.data(), n);
  cpu::accumulate(b.data(), add.data(), n);
  dev::accumulate(exec, c.data(), add16.data(), n);
  cpu::accumulate(d.data(), add16.data(), n);
  for (std::size_t i = 0; i < n; ++i) {
    ASSERT_EQ(bits(a[i]), bits(b[i])) << i;
    ASSERT_EQ(bits(c[i]), bits(d[i])) << i;
    ASSERT_EQ(a[i], base[i] + add[i]) << i;
  }
}

// ---- norm and non-finite flag -----------------------------------------------------------------

double device_sum_squares(const std::vector<float>& x) {
  std::vector<double> scratch(dev::norm_scratch_count(x.size()) + 1);
  const dev::Partials p = dev::sum_squares_partials(exec, x.data(), x.size(), scratch.data());
  EXPECT_LE(p.count, dev::kNormFanIn);
  return dev::combine_in_order(p.data, p.count);
}

TEST(SumSquares, FixedTreeAndCloseToExact) {
  // Sizes around every level boundary: one lane, one block, one group, two group levels.
  for (std::size_t n : {std::size_t{0}, std::size_t{1}, std::size_t{255}, std::size_t{256},
                        std::size_t{65535}, std::size_t{65536}, std::size_t{65537},
                        std::size_t{1000003}, dev::kNormBlock * dev::kNormFanIn + 4097}) {
    const std::vector<float> x = values(n, 21, 3.0f);
    std::vector<double> scratch(dev::norm_scratch_count(n) + 1);
    const double serial = dev::sum_squares_serial(x.data(), n, scratch.data());
    const double got = device_sum_squares(x);
    EXPECT_EQ(std::memcmp(&got, &serial, sizeof got), 0) << "n=" << n;
    long double exact = 0;
    for (float f : x) exact += static_cast<long double>(f) * f;
    EXPECT_NEAR(got, static_cast<double>(exact), 1e-13 * static_cast<double>(exact) + 1e-300)
        << "n=" << n;
    EXPECT_NEAR(got, cpu::sum_squares(x.data(), n), 1e-13 * got + 1e-300) << "n=" << n;
  }
}

TEST(SumSquares, IndependentOfThreadCount) {
  const std::vector<float> x = values(3000017, 22);
  const int threads = omp_get_max_threads();
  omp_set_num_threads(1);
  const double one = device_sum_squares(x);
  omp_set_num_threads(std::max(threads, 3));
  const double many = device_sum_squares(x);
  const double again = device_sum_squares(x);
  omp_set_num_threads(threads);
  EXPECT_EQ(std::memcmp(&one, &many, sizeof one), 0);
  EXPECT_EQ(std::memcmp(&many, &again, sizeof one), 0);
}

TEST(SumSquares, NonFiniteInputGivesNonFiniteSum) {
  std::vector<float> x = values(100000, 23);
  x[77777] = std::numeric_limits<float>::infinity();
  EXPECT_FALSE(std::isfinite(device_sum_squares(x)));
  x[77777] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_TRUE(std::isnan(device_sum_squares(x)));
  x[77777] = std::numeric_limits<float>::max();  // its square is finite in double
  EXPECT_TRUE(std::isfinite(device_sum_squares(x)));
}

TEST(AllFinite, FlagsNanAndInfAnywhere) {
  std::vector<float> x = values(50001, 24);
  x[0] = std::numeric_limits<float>::max();
  x[1] = std::numeric_limits<float>::denorm_min();
  EXPECT_TRUE(dev::all_finite(exec, x.data(), x.size()));
  EXPECT_TRUE(dev::all_finite(exec, x.data(), 0));
  for (std::size_t at : {std::size_t{0}, std::size_t{4096}, std::size_t{50000}}) {
    for (float bad : {std::numeric_limits<float>::quiet_NaN(),
                      std::numeric_limits<float>::infinity(),
                      -std::numeric_limits<float>::infinity()}) {
      std::vector<float> y = x;
      y[at] = bad;
      EXPECT_FALSE(dev::all_finite(exec, y.data(), y.size())) << at << " " << bad;
      EXPECT_EQ(cpu::all_finite(y.data(), y.size()), false);
    }
  }
}

}  // namespace

