// cuda_backend.cpp: the Backend of device memory: cudaMalloc'd buffers and the device
// algorithms of cuda_ops.hpp, all on the legacy default stream.
//
// Why the legacy default stream: the optimizer's step interleaves backend kernels with
// communicator collectives, and the legacy stream is ordered with every blocking stream, so
// the NCCL communicator (which also orders a caller's stream against it with events) and a
// trainer's own blocking streams see the kernels in program order without host waits.
#include <cstring>
#include <string>
#include <vector>

#include "cuda_backend.hpp"
#include "cuda_check.hpp"
#include "cuda_ops.hpp"
#include "shardopt/error.hpp"
#include "sum_squares.hpp"

namespace shardopt {
namespace {

void free_device(void* p) noexcept { cudaFree(p); }
void free_pinned(void* p) noexcept { cudaFreeHost(p); }

/// The update's per-step data as it lies in device memory: the step scalars, then the
/// segments. One upload per step; the kernel reads it through pointers (graph-capturable).
struct StepBlockLayout {
  static std::size_t segments_offset() {
    return (sizeof(StepScalars) + alignof(UpdateSegment) - 1) / alignof(UpdateSegment) *
           alignof(UpdateSegment);
  }
  static std::size_t bytes(std::size_t segments) {
    return segments_offset() + segments * sizeof(UpdateSegment);
  }
};

class CudaBackend final : public Backend {
 public:
  explicit CudaBackend(dev::AdamKernel kernel) : kernel_(kernel) {
    int count = 0;
    const cudaError_t rc = cudaGetDeviceCount(&count);
    if (rc != cudaSuccess || count == 0) {
      (void)cudaGetLastError();
      throw Error(Status::Cuda, std::string("Device::Cuda requested, but no CUDA device is "
                                            "usable (cudaGetDeviceCount: ") +
                                    (rc == cudaSuccess ? "0 devices" : cudaGetErrorString(rc)) +
                                    ")");
    }
    SHARDOPT_CUDA_CHECK(cudaEventCreateWithFlags(&upload_done_, cudaEventDisableTiming));
  }
  ~CudaBackend() override {
    cudaStreamSynchronize(stream_);
    cudaEventDestroy(upload_done_);
  }

  const char* name() const override { return "cuda"; }

  Allocation allocate(MemoryTracker* tracker, MemCategory category, std::size_t bytes) override {
    if (bytes == 0) return Allocation{};
    void* p = nullptr;
    const cudaError_t rc = cudaMalloc(&p, bytes);
    if (rc != cudaSuccess) {
      (void)cudaGetLastError();
      throw Error(rc == cudaErrorMemoryAllocation ? Status::OutOfMemory : Status::Cuda,
                  "cudaMalloc of " + std::to_string(bytes) + " bytes for " +
                      mem_category_name(category) + " failed: " + cudaGetErrorString(rc));
    }
    Allocation a(p, bytes, free_device, tracker, category);
    SHARDOPT_CUDA_CHECK(cudaMemsetAsync(p, 0, bytes, stream_));
    return a;
  }

  void fill_zero(void* p, std::size_t bytes) override {
    if (bytes) SHARDOPT_CUDA_CHECK(cudaMemsetAsync(p, 0, bytes, stream_));
  }

  // Host copies wait: the caller's host buffer may change or die as soon as we return.
  void copy_from_host(void* dst, const void* host_src, std::size_t bytes) override {
    if (bytes == 0) return;
    SHARDOPT_CUDA_CHECK(cudaMemcpyAsync(dst, host_src, bytes, cudaMemcpyHostToDevice, stream_));
    SHARDOPT_CUDA_CHECK(cudaStreamSynchronize(stream_));
  }
  void copy_to_host(void* host_dst, const void* src, std::size_t bytes) override {
    if (bytes == 0) return;
    SHARDOPT_CUDA_CHECK(cudaMemcpyAsync(host_dst, src, bytes, cudaMemcpyDeviceToHost, stream_));
    SHARDOPT_CUDA_CHECK(cudaStreamSynchronize(stream_));
  }
  void copy(void* dst, const void* src, std::size_t bytes) override {
    if (bytes == 0) return;
    SHARDOPT_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream_));
    SHARDOPT_CUDA_CHECK(cudaStreamSynchronize(stream_));
  }

  double sum_squares(const float* x, std::size_t n) override {
    if (n == 0) return 0.0;
    double* scratch = reserve(norm_scratch_, dev::norm_scratch_count(n) * sizeof(double),
                              MemCategory::Scratch, false)
                          .as<double>();
    const dev::DevicePartials p = dev::sum_squares_partials(stream_, x, n, scratch);
    double* host = reserve(norm_host_, dev::kNormFanIn * sizeof(double), MemCategory::Scratch,
                           true)
                       .as<double>();
    SHARDOPT_CUDA_CHECK(cudaMemcpyAsync(host, p.data, p.count * sizeof(double),
                                        cudaMemcpyDeviceToHost, stream_));
    SHARDOPT_CUDA_CHECK(cudaStreamSynchronize(stream_));
    return dev::combine_in_order(host, p.count);
  }

  void accumulate(float* dst, const void* src, DType t, std::size_t n) override {
    if (t == DType::F32) {
      dev::accumulate(stream_, dst, static_cast<const float*>(src), n);
    } else {
      dev::accumulate(stream_, dst, static_cast<const bf16*>(src), n);
    }
  }

  void cast_from_f32(const float* src, void* dst, DType t, std::size_t n) override {
    if (t == DType::F32) {
      if (dst != src && n)
        SHARDOPT_CUDA_CHECK(cudaMemcpyAsync(dst, src, n * sizeof(float),
                                            cudaMemcpyDeviceToDevice, stream_));
    } else {
      dev::cast_f32_to_bf16(stream_, src, static_cast<bf16*>(dst), n);
    }
  }

  void adam_update(const StepScalars& s, std::span<const UpdateSegment> segments, float* master,
                   const float* grad, float* m, float* v, void* replica,
                   DType replica_dtype) override {
    require(!segments.empty(), Status::Internal, "adam_update: no segments");
    const std::size_t n = segments.back().end;
    if (n == 0) return;
    // Stage the step block in pinned memory (after the previous upload has read it) and
    // upload it in stream order, ahead of the kernel that reads it.
    const std::size_t bytes = StepBlockLayout::bytes(segments.size());
    char* host = reserve(step_host_, bytes, MemCategory::Scratch, true).as<char>();
    char* device = reserve(step_device_, bytes, MemCategory::Scratch, false).as<char>();
    SHARDOPT_CUDA_CHECK(cudaEventSynchronize(upload_done_));
    std::memcpy(host, &s, sizeof s);
    std::memcpy(host + StepBlockLayout::segments_offset(), segments.data(),
                segments.size() * sizeof(UpdateSegment));
    SHARDOPT_CUDA_CHECK(cudaMemcpyAsync(device, host, bytes, cudaMemcpyHostToDevice, stream_));
    SHARDOPT_CUDA_CHECK(cudaEventRecord(upload_done_, stream_));

    dev::AdamChunkOp op;
    op.step = reinterpret_cast<const StepScalars*>(device);
    op.segments = reinterpret_cast<const UpdateSegment*>(device + StepBlockLayout::segments_offset());
    op.num_segments = segments.size();
    op.n = n;
    op.master = master;
    op.grad = grad;
    op.m = m;
    op.v = v;
    op.out_bf16 = replica && replica_dtype == DType::BF16 ? static_cast<bf16*>(replica) : nullptr;
    op.out_f32 = replica && replica_dtype == DType::F32 ? static_cast<float*>(replica) : nullptr;
    op.vectorized = dev::adam_vector_aligned(master, grad, m, v, op.out_bf16, op.out_f32);
    dev::adam_update(stream_, kernel_, op);
  }

  void synchronize() override { SHARDOPT_CUDA_CHECK(cudaStreamSynchronize(stream_)); }

 private:
  /// Grows a scratch buffer to at least `bytes` (device, or pinned host when `pinned`).
  /// Not in the memory report: the optimizer's tracker dies before its backend, and the
  /// largest of these (the norm tree, n/256 doubles) is under 1% of the gradient shard.
  Allocation& reserve(Allocation& a, std::size_t bytes, MemCategory category, bool pinned) {
    if (a.bytes() >= bytes) return a;
    SHARDOPT_CUDA_CHECK(cudaStreamSynchronize(stream_));  // the old buffer may be in use
    a = Allocation{};
    void* p = nullptr;
    if (pinned) {
      SHARDOPT_CUDA_CHECK(cudaMallocHost(&p, bytes));
      a = Allocation(p, bytes, free_pinned, nullptr, category);
    } else {
      SHARDOPT_CUDA_CHECK(cudaMalloc(&p, bytes));
      a = Allocation(p, bytes, free_device, nullptr, category);
    }
    return a;
  }

  dev::AdamKernel kernel_;
  cudaStream_t stream_ = nullptr;  // legacy default stream
  cudaEvent_t upload_done_ = nullptr;
  Allocation norm_scratch_, norm_host_, step_host_, step_device_;
};

}  // namespace

// This library's entry into the core (src/cuda_hook.cpp): registered when the library is
// loaded, so make_cuda_backend() in the core creates a CudaBackend.
namespace {
std::unique_ptr<Backend> make_thrust_backend() {
  return std::make_unique<CudaBackend>(dev::AdamKernel::Thrust);
}
[[maybe_unused]] const bool registered = (register_cuda_backend(&make_thrust_backend), true);
}  // namespace

std::unique_ptr<Backend> make_cuda_backend_with(dev::AdamKernel kernel) {
  return std::make_unique<CudaBackend>(kernel);
}

}  // namespace shardopt

// A static libshardopt_cuda.a is linked with --undefined=shardopt_cuda_link (the target's
// usage requirement), which pulls this object, and so its registration, into the program.
extern "C" void shardopt_cuda_link(void) {}
