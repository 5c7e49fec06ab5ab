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
#include "rules/adamw8bit.hpp"
#include "rules/qmap.hpp"
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

// ---- AdamW8bit ---------------------------------------------------------------------------------

constexpr std::size_t kQ8 = rules::q8::kBlock;

struct Q8State {
  std::vector<float> p, scale_m, scale_v, o32;
  std::vector<std::uint8_t> code_m, code_v;
  std::vector<bf16> o16;
};

// `blocks` blocks: weights over many binades, codes all over both maps, scales from the floor
// up (block 3: every code 0 and the floor, as a fresh state; block 5: huge scales).
Q8State q8_state(std::size_t blocks, std::uint64_t seed) {
  const std::size_t n = blocks * kQ8;
  Q8State st;
  st.p = values(n, seed);
  st.code_m.resize(n);
  st.code_v.resize(n);
  for (std::size_t i = 0; i < n; ++i) {
    st.code_m[i] = static_cast<std::uint8_t>((i * 37 + seed) % 256);
    st.code_v[i] = static_cast<std::uint8_t>((i * 91 + 3 * seed) % 256);
  }
  st.scale_m.resize(blocks);
  st.scale_v.resize(blocks);
  for (std::size_t b = 0; b < blocks; ++b) {
    st.scale_m[b] = std::ldexp(0.75f, static_cast<int>(b % 23) - 16);
    st.scale_v[b] = std::ldexp(0.625f, static_cast<int>(b % 29) - 24);
  }
  if (blocks > 3) {
    std::fill(st.code_m.begin() + 3 * kQ8, st.code_m.begin() + 4 * kQ8, 0);
    std::fill(st.code_v.begin() + 3 * kQ8, st.code_v.begin() + 4 * kQ8, 0);
    st.scale_m[3] = st.scale_v[3] = rules::q8::kMinScale;
  }
  if (blocks > 5) st.scale_m[5] = st.scale_v[5] = 1e30f;
  st.o32.assign(n, -1.0f);
  st.o16.assign(n, bf16{0xFFFF});
  return st;
}

// Gradients: mostly ordinary, a zero block (block 2), and with `extremes` the values that make
// NaN and Inf on the way (NaN, +-Inf, squares that overflow, signed zeros, subnormals).
std::vector<float> q8_grads(std::size_t blocks, std::uint64_t seed, bool extremes) {
  std::vector<float> g = values(blocks * kQ8, seed);
  if (blocks > 2) std::fill(g.begin() + 2 * kQ8, g.begin() + 3 * kQ8, 0.0f);
  if (extremes && blocks > 7) {
    const float inf = std::numeric_limits<float>::infinity();
    const float specials[] = {std::numeric_limits<float>::quiet_NaN(), inf, -inf, 3e19f, -3e19f,
                              -0.0f, 0.0f, std::numeric_limits<float>::denorm_min(), 1e-40f};
    for (std::size_t k = 0; k < std::size(specials); ++k) g[6 * kQ8 + 17 * k] = specials[k];
    g[7 * kQ8 + 5] = 3e19f;  // one square overflows: v = Inf in an otherwise finite block
  }
  return g;
}

// The CUDA kernel's order, on the CPU: thread t's leaf max_of(0, x), an xor butterfly over each
// warp's 32 lanes, then thread 0 over the 8 warps' results (device_algorithms.cu).
void q8_block_as_the_kernel(const dev::AdamW8bitOp& op, std::size_t b) {
  using Op = dev::AdamW8bitOp;
  float m[kQ8], v[kQ8], am[kQ8], av[kQ8];
  const float old_m = op.scale_m[b], old_v = op.scale_v[b];
  for (std::size_t t = 0; t < kQ8; ++t) {
    op.update(b * kQ8 + t, old_m, old_v, m[t], v[t]);
    am[t] = Op::max_of(0.0f, std::fabs(m[t]));
    av[t] = Op::max_of(0.0f, v[t]);
  }
  for (std::size_t o = 16; o > 0; o /= 2) {
    float nm[kQ8], nv[kQ8];
    for (std::size_t t = 0; t < kQ8; ++t) {
      nm[t] = Op::max_of(am[t], am[t ^ o]);
      nv[t] = Op::max_of(av[t], av[t ^ o]);
    }
    std::copy(nm, nm + kQ8, am);
    std::copy(nv, nv + kQ8, av);
  }
  float mm = 0.0f, mv = 0.0f;
  for (std::size_t w = 0; w < kQ8 / 32; ++w) {
    mm = Op::max_of(mm, am[32 * w]);
    mv = Op::max_of(mv, av[32 * w]);
  }
  const float sm = Op::new_scale(mm), sv = Op::new_scale(mv);
  op.scale_m[b] = sm;
  op.scale_v[b] = sv;
  for (std::size_t t = 0; t < kQ8; ++t) op.requantize(b * kQ8 + t, m[t], v[t], sm, sv);
}

void expect_same_q8(const Q8State& a, const Q8State& b, const std::string& what) {
  ASSERT_EQ(a.p.size(), b.p.size());
  for (std::size_t i = 0; i < a.p.size(); ++i) {
    ASSERT_EQ(bits(a.p[i]), bits(b.p[i])) << what << " master " << i;
    ASSERT_EQ(bits(a.o32[i]), bits(b.o32[i])) << what << " fp32 replica " << i;
    ASSERT_EQ(a.o16[i].bits, b.o16[i].bits) << what << " bf16 replica " << i;
    ASSERT_EQ(a.code_m[i], b.code_m[i]) << what << " code_m " << i;
    ASSERT_EQ(a.code_v[i], b.code_v[i]) << what << " code_v " << i;
  }
  for (std::size_t k = 0; k < a.scale_m.size(); ++k) {
    ASSERT_EQ(bits(a.scale_m[k]), bits(b.scale_m[k])) << what << " scale_m " << k;
    ASSERT_EQ(bits(a.scale_v[k]), bits(b.scale_v[k])) << what << " scale_v " << k;
  }
}

dev::AdamW8bitOp q8_op(const StepScalars& s, const SegmentScalars& g, Q8State& st,
                       const std::vector<float>& grad, std::size_t first_block, DType out,
                       bool replica) {
  const std::size_t at = first_block * kQ8;
  dev::AdamW8bitOp op;
  op.s = s;
  op.g = g;
  op.qs = &rules::q8::signed_map();
  op.qu = &rules::q8::unsigned_map();
  op.master = st.p.data() + at;
  op.grad = grad.data() + at;
  op.code_m = st.code_m.data() + at;
  op.code_v = st.code_v.data() + at;
  op.scale_m = st.scale_m.data() + first_block;
  op.scale_v = st.scale_v.data() + first_block;
  op.out_bf16 = replica && out == DType::BF16 ? st.o16.data() + at : nullptr;
  op.out_f32 = replica && out == DType::F32 ? st.o32.data() + at : nullptr;
  return op;
}

// The device's AdamW8bit (the Thrust algorithm over blocks, and the CUDA kernel's reduction
// order emulated) against the CPU's portable block (rules::q8::adamw8bit_block), including
// NaN, Inf and overflowing squares (all on this CPU, so even NaN's bits must agree), and
// against adamw8bit_update (the ISA's kernel) on ordinary values: master, replica, codes,
// scales, bit for bit, over three steps and two segments.
TEST(AdamW8bitUpdate, MatchesCpuKernelBitwise) {
  const std::size_t blocks = 12, n = blocks * kQ8, cut = 5;
  for (AdamMode mode : {AdamMode::AdamW, AdamMode::AdamL2})
    for (bool extremes : {false, true})
      for (DType out : {DType::BF16, DType::F32})
        for (bool replica : {true, false}) {
          const std::string what = std::string(mode == AdamMode::AdamW ? "adamw" : "adam_l2") +
                                   (extremes ? " extremes " : " ") + dtype_name(out) +
                                   (replica ? "" : " no replica");
          Q8State cpu = q8_state(blocks, 1), thr = cpu, emu = cpu, isa = cpu;
          for (int step = 1; step <= 3; ++step) {
            const std::vector<float> g = q8_grads(blocks, 10 + static_cast<std::uint64_t>(step), extremes);
            const StepHyper h{1e-2, 0.9, 0.999, 1e-8, 0.1, mode, step};
            const StepScalars s = make_step_scalars(h, 0.5);
            const SegmentScalars ga = make_segment_scalars(h, 1.0, true);
            const SegmentScalars gb = make_segment_scalars(h, 0.25, false);
            for (std::size_t b = 0; b < blocks; ++b) {
              const std::size_t at = b * kQ8;
              rules::q8::adamw8bit_block(
                  s, b < cut ? ga : gb, cpu.p.data() + at, g.data() + at, cpu.code_m.data() + at,
                  cpu.code_v.data() + at, cpu.scale_m[b], cpu.scale_v[b],
                  replica && out == DType::BF16 ? cpu.o16.data() + at : nullptr,
                  replica && out == DType::F32 ? cpu.o32.data() + at : nullptr, kQ8);
            }
            dev::adamw8bit_update(exec, q8_op(s, ga, thr, g, 0, out, replica), cut);
            dev::adamw8bit_update(exec, q8_op(s, gb, thr, g, cut, out, replica), blocks - cut);
            for (std::size_t b = 0; b < blocks; ++b)
              q8_block_as_the_kernel(q8_op(s, b < cut ? ga : gb, emu, g, 0, out, replica), b);
            const UpdateSegment segs[2] = {{0, cut * kQ8, ga}, {cut * kQ8, n, gb}};
            rules::q8::adamw8bit_update(s, segs, isa.p.data(), g.data(), isa.code_m.data(),
                                        isa.code_v.data(), isa.scale_m.data(),
                                        isa.scale_v.data(),
                                        replica && out == DType::BF16 ? isa.o16.data() : nullptr,
                                        replica && out == DType::F32 ? isa.o32.data() : nullptr);
            const std::string at = what + " step " + std::to_string(step);
            expect_same_q8(thr, cpu, at + " (Thrust)");
            expect_same_q8(emu, cpu, at + " (kernel order)");
            if (!extremes) expect_same_q8(isa, cpu, at + " (adamw8bit_update)");
          }
          if (extremes) {  // the inputs did reach the non-finite paths
            EXPECT_TRUE(std::isnan(cpu.p[6 * kQ8]) || std::isinf(cpu.p[6 * kQ8])) << what;
            EXPECT_TRUE(std::isinf(cpu.scale_v[7]) || std::isnan(cpu.scale_v[7]) ||
                        cpu.scale_v[7] > 1e30f)
                << what;
          }
        }
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

