// cuda_bench.hpp: what the CUDA benchmarks share: device-event timing on the legacy default
// stream, zeroed device buffers, and the fused AdamW update (bf16 replica) set up on buffers
// of its own, as the backend runs it on one window.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <vector>

#include "cuda_check.hpp"
#include "cuda_ops.hpp"
#include "shardopt/adam_math.hpp"

namespace shardopt::bench {

/// False, after saying so, when no CUDA device is present (the benchmarks then exit 0).
inline bool gpu_present(const char* program) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) == cudaSuccess && devices > 0) return true;
  std::printf("%s: no CUDA device present; nothing to measure.\n", program);
  return false;
}

/// Milliseconds per call of `body`, timed with events over `reps` calls after one warm-up.
inline double time_ms(int reps, const std::function<void()>& body) {
  cudaEvent_t start, stop;
  SHARDOPT_CUDA_CHECK(cudaEventCreate(&start));
  SHARDOPT_CUDA_CHECK(cudaEventCreate(&stop));
  body();
  SHARDOPT_CUDA_CHECK(cudaEventRecord(start, nullptr));
  for (int i = 0; i < reps; ++i) body();
  SHARDOPT_CUDA_CHECK(cudaEventRecord(stop, nullptr));
  SHARDOPT_CUDA_CHECK(cudaEventSynchronize(stop));
  float ms = 0;
  SHARDOPT_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return ms / reps;
}

inline void* device_zeros(std::size_t bytes) {
  void* p = nullptr;
  SHARDOPT_CUDA_CHECK(cudaMalloc(&p, bytes));
  SHARDOPT_CUDA_CHECK(cudaMemset(p, 0, bytes));
  return p;
}

/// Bytes one fused AdamW update with a bf16 replica moves per element: reads master, grad, m,
/// v; writes master, m, v and the bf16 copy.
inline constexpr double kAdamBf16BytesPerElem = 4.0 * 4 + 3.0 * 4 + 2.0;

/// Bytes one AdamW8bit update with a bf16 replica moves per element: reads master, grad and
/// two codes; writes master, two codes and the bf16 copy; reads and writes two fp32 scales
/// per 256-element block.
inline constexpr double kAdamW8bitBf16BytesPerElem = 4.0 * 2 + 2.0 + 4.0 + 2.0 + 2.0 + 16.0 / 256;

/// The fused update of n elements (one segment, AdamW, bf16 replica) on buffers of its own:
/// realistic values (grad and master in [-1, 1]), not zeros.
class FusedAdam {
 public:
  explicit FusedAdam(std::size_t n) : n_(n) {
    master_ = static_cast<float*>(device_zeros(n * 4));
    grad_ = static_cast<float*>(device_zeros(n * 4));
    m_ = static_cast<float*>(device_zeros(n * 4));
    v_ = static_cast<float*>(device_zeros(n * 4));
    out_ = static_cast<bf16*>(device_zeros(n * 2));
    std::vector<float> host(n);
    for (std::size_t i = 0; i < n; ++i)
      host[i] = static_cast<float>((i * 2654435761u) % 2001) / 1000.0f - 1.0f;
    SHARDOPT_CUDA_CHECK(cudaMemcpy(grad_, host.data(), n * 4, cudaMemcpyHostToDevice));
    SHARDOPT_CUDA_CHECK(cudaMemcpy(master_, host.data(), n * 4, cudaMemcpyHostToDevice));
    const StepHyper h{1e-3, 0.9, 0.999, 1e-8, 0.01, AdamMode::AdamW, 10};
    const Block block{make_step_scalars(h, 1.0), UpdateSegment{0, n, make_segment_scalars(h, 1.0, true)}};
    block_ = static_cast<Block*>(device_zeros(sizeof block));
    SHARDOPT_CUDA_CHECK(cudaMemcpy(block_, &block, sizeof block, cudaMemcpyHostToDevice));
    op_.step = &block_->s;
    op_.segments = &block_->seg;
    op_.num_segments = 1;
    op_.n = n;
    op_.master = master_;
    op_.grad = grad_;
    op_.m = m_;
    op_.v = v_;
    op_.out_bf16 = out_;
    op_.vectorized = dev::adam_vector_aligned(master_, grad_, m_, v_, out_, nullptr);
  }
  ~FusedAdam() {
    for (void* p : {static_cast<void*>(master_), static_cast<void*>(grad_), static_cast<void*>(m_),
                    static_cast<void*>(v_), static_cast<void*>(out_), static_cast<void*>(block_)})
      cudaFree(p);
  }
  FusedAdam(const FusedAdam&) = delete;
  FusedAdam& operator=(const FusedAdam&) = delete;

  /// Queues one update on the legacy default stream.
  void run(dev::AdamKernel kernel) const { dev::adam_update(nullptr, kernel, op_); }
  std::size_t size() const { return n_; }
  float* master() const { return master_; }
  float* grad() const { return grad_; }
  float* m() const { return m_; }
  bf16* out() const { return out_; }

 private:
  struct Block {
    StepScalars s;
    UpdateSegment seg;
  };
  std::size_t n_;
  float *master_ = nullptr, *grad_ = nullptr, *m_ = nullptr, *v_ = nullptr;
  bf16* out_ = nullptr;
  Block* block_ = nullptr;
  dev::AdamChunkOp op_{};
};

}  // namespace shardopt::bench
