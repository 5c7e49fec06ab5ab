// test_cuda_backend.cpp: the CUDA backend's kernels against the CPU backend (bitwise where
// the arithmetic is elementwise, the fixed tree for the norm), and the hand-written
// grid-stride update against its Thrust twin. Skips without a GPU.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "cuda_backend.hpp"
#include "gpu_test.hpp"
#include "shardopt/bf16.hpp"
#include "sum_squares.hpp"
#include "support/reference.hpp"

using namespace shardopt;
using shardopt::test::synth;

namespace {

std::vector<float> values(std::size_t n, std::uint64_t seed, float scale = 1.0f) {
  std::vector<float> x(n);
  for (std::size_t i = 0; i < n; ++i) x[i] = scale * synth(seed, 3, 4, i);
  return x;
}

/// A device copy of a host vector, owned by `be`.
template <class T>
Allocation upload(Backend& be, const std::vector<T>& host) {
  Allocation a = be.allocate(nullptr, MemCategory::Scratch, host.size() * sizeof(T) + 16);
  be.copy_from_host(a.data(), host.data(), host.size() * sizeof(T));
  return a;
}
template <class T>
std::vector<T> download(Backend& be, const void* p, std::size_t n) {
  std::vector<T> host(n);
  be.copy_to_host(host.data(), p, n * sizeof(T));
  return host;
}

std::vector<UpdateSegment> segments(std::size_t n, const StepHyper& h) {
  const SegmentScalars a = make_segment_scalars(h, 1.0, true);
  const SegmentScalars b = make_segment_scalars(h, 0.25, false);
  const std::size_t c1 = std::min<std::size_t>(n, 6), c2 = std::min<std::size_t>(n, 70001);
  return {{0, c1, a}, {c1, c1, b}, {c1, c2, b}, {c2, n, a}};
}

struct AdamRun {
  std::vector<float> p, m, v;
  std::vector<bf16> out;
};

// Runs the fused update (3 steps) on `be`; `offset` shifts every buffer (misalignment).
AdamRun run_adam(Backend& be, AdamMode mode, std::size_t n, std::size_t offset) {
  std::vector<float> p = values(n + offset, 1), m(n + offset, 0.0f), v(n + offset, 0.0f);
  std::vector<bf16> out(n + offset, bf16{0});
  Allocation dp = upload(be, p), dm = upload(be, m), dv = upload(be, v), dout = upload(be, out);
  float* P = dp.as<float>() + offset;
  float* M = dm.as<float>() + offset;
  float* V = dv.as<float>() + offset;
  bf16* O = dout.as<bf16>() + offset;
  for (int step = 1; step <= 3; ++step) {
    const StepHyper h{1e-2, 0.9, 0.999, 1e-8, 0.1, mode, step};
    const std::vector<float> g = values(n + offset, 10 + static_cast<std::uint64_t>(step));
    Allocation dg = upload(be, g);
    be.adam_update(make_step_scalars(h, 0.5), segments(n, h), P, dg.as<float>() + offset, M, V,
                   O, DType::BF16);
  }
  be.synchronize();
  return {download<float>(be, P, n), download<float>(be, M, n), download<float>(be, V, n),
          download<bf16>(be, O, n)};
}

void expect_same(const AdamRun& a, const AdamRun& b) {
  ASSERT_EQ(a.p.size(), b.p.size());
  for (std::size_t i = 0; i < a.p.size(); ++i) {
    ASSERT_EQ(float_bits(a.p[i]), float_bits(b.p[i])) << i;
    ASSERT_EQ(float_bits(a.m[i]), float_bits(b.m[i])) << i;
    ASSERT_EQ(float_bits(a.v[i]), float_bits(b.v[i])) << i;
    ASSERT_EQ(a.out[i].bits, b.out[i].bits) << i;
  }
}

TEST(CudaBackend, FusedUpdateMatchesCpuBitwise) {
  SHARDOPT_REQUIRE_GPUS(1);
  auto cpu = make_cpu_backend();
  auto gpu = make_cuda_backend();
  for (AdamMode mode : {AdamMode::AdamW, AdamMode::AdamL2})
    for (std::size_t n : {std::size_t{1}, std::size_t{5}, std::size_t{1000003}})
      for (std::size_t offset : {0, 1}) {
        SCOPED_TRACE("n=" + std::to_string(n) + " offset=" + std::to_string(offset));
        expect_same(run_adam(*gpu, mode, n, offset), run_adam(*cpu, mode, n, offset));
      }
}

TEST(CudaBackend, GridStrideKernelMatchesThrustTwin) {
  SHARDOPT_REQUIRE_GPUS(1);
  auto thrust_be = make_cuda_backend_with(dev::AdamKernel::Thrust);
  auto grid_be = make_cuda_backend_with(dev::AdamKernel::GridStride);
  for (std::size_t n : {std::size_t{3}, std::size_t{4099}, std::size_t{3000017}})
    for (std::size_t offset : {0, 1})
      expect_same(run_adam(*grid_be, AdamMode::AdamW, n, offset),
                  run_adam(*thrust_be, AdamMode::AdamW, n, offset));
}

TEST(CudaBackend, CastsAndAccumulateMatchCpuBitwise) {
  SHARDOPT_REQUIRE_GPUS(1);
  auto cpu = make_cpu_backend();
  auto gpu = make_cuda_backend();
  const std::size_t n = 300007;
  std::vector<float> x = values(n, 5, 1e3f), base = values(n, 6);
  x[0] = std::numeric_limits<float>::quiet_NaN();
  x[1] = std::numeric_limits<float>::max();
  x[2] = std::numeric_limits<float>::denorm_min();
  std::vector<bf16> x16(n);
  for (std::size_t i = 0; i < n; ++i) x16[i] = to_bf16(x[i]);
  // Cast.
  std::vector<bf16> cast_cpu(n);
  cpu->cast_from_f32(x.data(), cast_cpu.data(), DType::BF16, n);
  Allocation dx = upload(*gpu, x), dcast = upload(*gpu, std::vector<bf16>(n));
  gpu->cast_from_f32(dx.as<float>(), dcast.data(), DType::BF16, n);
  const std::vector<bf16> cast_gpu = download<bf16>(*gpu, dcast.data(), n);
  for (std::size_t i = 0; i < n; ++i) ASSERT_EQ(cast_gpu[i].bits, cast_cpu[i].bits) << i;
  // Accumulate fp32 and bf16.
  for (DType t : {DType::F32, DType::BF16}) {
    std::vector<float> acc_cpu = base;
    const void* src = t == DType::F32 ? static_cast<const void*>(x.data()) : x16.data();
    cpu->accumulate(acc_cpu.data(), src, t, n);
    Allocation dacc = upload(*gpu, base);
    Allocation dsrc = t == DType::F32 ? upload(*gpu, x) : upload(*gpu, x16);
    gpu->accumulate(dacc.as<float>(), dsrc.data(), t, n);
    const std::vector<float> acc_gpu = download<float>(*gpu, dacc.data(), n);
    for (std::size_t i = 0; i < n; ++i) {
      // A NaN's payload is the hardware's: x86 keeps the operand's (0x7fc00000 here), a GPU's
      // arithmetic returns its canonical NaN (0x7fffffff, measured on an H200). Both NaN.
      if (std::isnan(acc_cpu[i])) {
        ASSERT_TRUE(std::isnan(acc_gpu[i])) << dtype_name(t) << " " << i;
        continue;
      }
      ASSERT_EQ(float_bits(acc_gpu[i]), float_bits(acc_cpu[i])) << dtype_name(t) << " " << i;
    }
  }
}

TEST(CudaBackend, SumSquaresIsTheFixedTreeRunToRun) {
  SHARDOPT_REQUIRE_GPUS(1);
  auto gpu = make_cuda_backend();
  for (std::size_t n : {std::size_t{0}, std::size_t{1}, std::size_t{65537},
                        dev::kNormBlock * dev::kNormFanIn + 5}) {
    const std::vector<float> x = values(n, 8, 2.0f);
    std::vector<double> scratch(dev::norm_scratch_count(n) + 1);
    const double serial = dev::sum_squares_serial(x.data(), n, scratch.data());
    Allocation dx = upload(*gpu, x);
    const double first = gpu->sum_squares(dx.as<float>(), n);
    const double second = gpu->sum_squares(dx.as<float>(), n);
    EXPECT_EQ(std::memcmp(&first, &serial, sizeof first), 0) << "n=" << n;
    EXPECT_EQ(std::memcmp(&first, &second, sizeof first), 0) << "n=" << n;
  }
}

// The step's norm: every bucket's tree queued, one wait. Bitwise the loop over sum_squares()
// (slices of different sizes, so the shared scratch is reused by a smaller tree after a larger
// one; empty slices; a slice that ends unaligned) and the serial tree.
TEST(CudaBackend, SumSquaresInOrderIsTheLoopBitwise) {
  SHARDOPT_REQUIRE_GPUS(1);
  auto gpu = make_cuda_backend();
  const std::size_t n = 3 * dev::kNormBlock + 4099;
  const std::vector<float> x = values(n, 10, 3.0f);
  Allocation dx = upload(*gpu, x);
  const float* d = dx.as<float>();
  const std::vector<Backend::Slice> slices = {
      {d, 2 * dev::kNormBlock + 17}, {d, 0}, {d + 5, 1}, {d + 100, 3 * dev::kNormBlock + 3999},
      {d + 7, 65536}, {d + n, 0}, {d + 1, n - 1}};
  double loop = 0.0, serial = 0.0;
  for (const Backend::Slice& s : slices) {
    loop += gpu->sum_squares(s.data, s.n);
    std::vector<double> scratch(dev::norm_scratch_count(s.n) + 1);
    serial += dev::sum_squares_serial(x.data() + (s.data - d), s.n, scratch.data());
  }
  const double batched = gpu->sum_squares_in_order(slices);
  EXPECT_EQ(std::memcmp(&batched, &loop, sizeof batched), 0) << batched << " vs " << loop;
  EXPECT_EQ(std::memcmp(&batched, &serial, sizeof batched), 0) << batched << " vs " << serial;
  EXPECT_EQ(gpu->sum_squares_in_order({}), 0.0);
  // A NaN in one slice makes the sum NaN, as the loop's.
  std::vector<float> bad = x;
  bad[n - 2] = std::numeric_limits<float>::quiet_NaN();
  gpu->copy_from_host(dx.data(), bad.data(), n * sizeof(float));
  EXPECT_TRUE(std::isnan(gpu->sum_squares_in_order(slices)));
}

TEST(CudaBackend, NonFiniteFlag) {
  SHARDOPT_REQUIRE_GPUS(1);
  auto gpu = make_cuda_backend();
  std::vector<float> x = values(100001, 9);
  Allocation dx = upload(*gpu, x);
  EXPECT_TRUE(dev::all_finite(nullptr, dx.as<float>(), x.size()));
  for (float bad : {std::numeric_limits<float>::quiet_NaN(), -std::numeric_limits<float>::infinity()}) {
    x[99999] = bad;
    gpu->copy_from_host(dx.data(), x.data(), x.size() * sizeof(float));
    EXPECT_FALSE(dev::all_finite(nullptr, dx.as<float>(), x.size()));
    EXPECT_FALSE(std::isfinite(gpu->sum_squares(dx.as<float>(), x.size())));
  }
}

TEST(CudaBackend, AllocationsAreZeroedAndAccounted) {
  SHARDOPT_REQUIRE_GPUS(1);
  auto gpu = make_cuda_backend();
  MemoryTracker tracker;
  {
    Allocation a = gpu->allocate(&tracker, MemCategory::Moments, 4096);
    EXPECT_EQ(tracker.report()[MemCategory::Moments], 4096u);
    const std::vector<unsigned char> host = download<unsigned char>(*gpu, a.data(), 4096);
    for (unsigned char c : host) ASSERT_EQ(c, 0);
    const std::vector<unsigned char> ones(4096, 1);
    gpu->copy_from_host(a.data(), ones.data(), ones.size());
    gpu->fill_zero(a.data(), 4096);
    for (unsigned char c : download<unsigned char>(*gpu, a.data(), 4096)) ASSERT_EQ(c, 0);
  }
  EXPECT_EQ(tracker.report()[MemCategory::Moments], 0u);
}

}  // namespace
