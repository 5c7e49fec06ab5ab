// device_algorithms.cu: the CUDA instantiations of device_algorithms.hpp, on a caller's
// stream, without a host synchronisation after each algorithm (par_nosync). Compiled with
// --fmad=false (cuda/CMakeLists.txt): no multiply-add is contracted, so every element rounds
// as on the CPU (checked in the PTX by cuda/check_kernels.sh).
#include <thrust/system/cuda/execution_policy.h>
#include <thrust/system_error.h>

#include <new>
#include <string>

#include "cuda_check.hpp"
#include "cuda_ops.hpp"
#include "device_algorithms.hpp"
#include "launch_config.hpp"

namespace shardopt::dev {
namespace {

auto on(cudaStream_t stream) { return thrust::cuda::par_nosync.on(stream); }

/// Runs a Thrust call; its exceptions (launch failures, temporary-storage allocation) become
/// shardopt::Error naming the algorithm.
template <class F>
auto guarded(const char* what, F&& f) {
  try {
    return f();
  } catch (const thrust::system_error& e) {
    (void)cudaGetLastError();
    throw Error(Status::Cuda, std::string(what) + " failed: " + e.what());
  } catch (const std::bad_alloc&) {
    throw Error(Status::OutOfMemory, std::string(what) + ": out of device memory");
  }
}

/// The hand-written twin of thrust::for_each: a grid-stride loop over the chunks, sized by
/// adam_grid_stride_launch() (the occupancy calculator's resident blocks per SM).
__global__ void adam_grid_stride_kernel(AdamChunkOp op, std::size_t chunks) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t c = grid_stride_first(blockIdx.x, blockDim.x, threadIdx.x); c < chunks;
       c += stride)
    op(c);
}

/// AdamW8bit: one 256-thread block per quantization block (a grid-stride loop over the
/// blocks beyond the grid), thread t on element t: AdamW8bitOp::update(), the block's maxima
/// of |m| and v (warp shuffles, then the warps' results in shared memory: max_of() is exact in
/// any order, adamw8bit_op.hpp), the new scales written by thread 0, AdamW8bitOp::requantize().
constexpr unsigned kQ8Threads = static_cast<unsigned>(rules::q8::kBlock);
static_assert(kQ8Threads % 32 == 0, "whole warps per quantization block");

__global__ void __launch_bounds__(kQ8Threads) adamw8bit_kernel(AdamW8bitOp op, std::size_t blocks) {
  constexpr unsigned kWarps = kQ8Threads / 32;
  __shared__ float warp_m[kWarps], warp_v[kWarps], scales[2];
  const unsigned t = threadIdx.x;
  for (std::size_t b = blockIdx.x; b < blocks; b += gridDim.x) {
    const std::size_t i = b * rules::q8::kBlock + t;
    float m, v;
    op.update(i, op.scale_m[b], op.scale_v[b], m, v);
    float am = AdamW8bitOp::max_of(0.0f, fabsf(m)), av = AdamW8bitOp::max_of(0.0f, v);
    for (unsigned o = 16; o > 0; o /= 2) {
      am = AdamW8bitOp::max_of(am, __shfl_xor_sync(0xffffffffu, am, o));
      av = AdamW8bitOp::max_of(av, __shfl_xor_sync(0xffffffffu, av, o));
    }
    if (t % 32 == 0) {
      warp_m[t / 32] = am;
      warp_v[t / 32] = av;
    }
    __syncthreads();  // every thread has read the old scales and written its warp's maxima
    if (t == 0) {
      float mm = 0.0f, mv = 0.0f;
      for (unsigned w = 0; w < kWarps; ++w) {
        mm = AdamW8bitOp::max_of(mm, warp_m[w]);
        mv = AdamW8bitOp::max_of(mv, warp_v[w]);
      }
      scales[0] = op.scale_m[b] = AdamW8bitOp::new_scale(mm);
      scales[1] = op.scale_v[b] = AdamW8bitOp::new_scale(mv);
    }
    __syncthreads();
    op.requantize(i, m, v, scales[0], scales[1]);
    // The next block's first writes to shared memory (warp_m, warp_v before its first barrier,
    // scales after it) come after every thread has passed this block's second barrier.
  }
}

/// The grid of adamw8bit_kernel: a block per quantization block, at most 4096 (then each
/// loops): about four times the blocks an H100 holds at once (132 SMs x 8 blocks of 256
/// threads), and few enough that CudaBackend.AdamW8bitMatchesCpuBitwise (4099 blocks) runs the
/// loop.
constexpr std::size_t kQ8MaxGrid = 4096;

}  // namespace

const void* adam_grid_stride_kernel_address() {
  return reinterpret_cast<const void*>(&adam_grid_stride_kernel);
}

void adam_update(cudaStream_t stream, AdamKernel kernel, const AdamChunkOp& op) {
  if (kernel == AdamKernel::Thrust) {
    guarded("thrust::for_each_n (fused Adam update)", [&] { adam_update(on(stream), op); });
  } else {
    const std::size_t chunks = adam_chunk_count(op.n);
    if (chunks == 0) return;
    const LaunchConfig c = adam_grid_stride_launch(chunks);
    adam_grid_stride_kernel<<<c.blocks, c.threads, 0, stream>>>(op, chunks);
  }
  SHARDOPT_CUDA_CHECK(cudaGetLastError());
}

void lion_update(cudaStream_t stream, const LionOp& op, std::size_t n) {
  guarded("thrust::for_each_n (Lion update)", [&] { lion_update(on(stream), op, n); });
  SHARDOPT_CUDA_CHECK(cudaGetLastError());
}

void muon_pass(cudaStream_t stream, const MuonPassOp& op, std::size_t n) {
  guarded("thrust::for_each_n (Muon element pass)", [&] { muon_pass(on(stream), op, n); });
  SHARDOPT_CUDA_CHECK(cudaGetLastError());
}

void adafactor_pass(cudaStream_t stream, const AdafactorOp& op) {
  guarded("thrust::for_each_n (Adafactor pass)", [&] { adafactor_pass(on(stream), op); });
  SHARDOPT_CUDA_CHECK(cudaGetLastError());
}

void adamw8bit_update(cudaStream_t stream, const AdamW8bitOp& op, std::size_t blocks) {
  if (blocks == 0) return;
  const unsigned grid = static_cast<unsigned>(blocks < kQ8MaxGrid ? blocks : kQ8MaxGrid);
  adamw8bit_kernel<<<grid, kQ8Threads, 0, stream>>>(op, blocks);
  SHARDOPT_CUDA_CHECK(cudaGetLastError());
}

void cast_f32_to_bf16(cudaStream_t stream, const float* src, bf16* dst, std::size_t n) {
  guarded("thrust::transform (fp32 -> bf16)",
          [&] { cast_f32_to_bf16(on(stream), src, dst, n); });
}

void cast_bf16_to_f32(cudaStream_t stream, const bf16* src, float* dst, std::size_t n) {
  guarded("thrust::transform (bf16 -> fp32)",
          [&] { cast_bf16_to_f32(on(stream), src, dst, n); });
}

void round_through_bf16(cudaStream_t stream, float* buf, std::size_t n) {
  guarded("thrust::transform (round through bf16)",
          [&] { round_through_bf16(on(stream), buf, n); });
}

void accumulate(cudaStream_t stream, float* dst, const float* src, std::size_t n) {
  guarded("thrust::transform (accumulate fp32)", [&] { accumulate(on(stream), dst, src, n); });
}

void accumulate(cudaStream_t stream, float* dst, const bf16* src, std::size_t n) {
  guarded("thrust::transform (accumulate bf16)", [&] { accumulate(on(stream), dst, src, n); });
}

DevicePartials sum_squares_partials(cudaStream_t stream, const float* x, std::size_t n,
                                    double* scratch) {
  const Partials p = guarded("thrust::transform (sum of squares)",
                             [&] { return sum_squares_partials(on(stream), x, n, scratch); });
  return {p.data, p.count};
}

void sum_squares_slices(cudaStream_t stream, const NormPlan& plan, const NormLevelEntry* entries,
                        const NormSliceLast* last, double* results) {
  guarded("thrust::for_each_n (sum of squares of several slices)", [&] {
    sum_squares_slices(on(stream), entries, plan.levels, last, plan.last.size(), results);
  });
}

void exact_pass(cudaStream_t stream, const ExactOp& op, std::size_t n) {
  guarded("thrust::for_each_n (reproducible exact pass)", [&] { exact_pass(on(stream), op, n); });
  SHARDOPT_CUDA_CHECK(cudaGetLastError());
}

ExactDigits exact_square_digits(cudaStream_t stream, const float* x, std::size_t n) {
  return guarded("thrust::transform_reduce (exact sum of squares)",
                 [&] { return exact_square_digits(thrust::cuda::par.on(stream), x, n); });
}

bool all_finite(cudaStream_t stream, const float* x, std::size_t n) {
  return guarded("thrust::transform_reduce (non-finite flag)",
                 [&] { return all_finite(thrust::cuda::par.on(stream), x, n); });
}

}  // namespace shardopt::dev
