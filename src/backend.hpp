// backend.hpp: buffers and kernels of one device kind, as the optimizer sees them.
//
// The optimizer's step logic is written once against this interface; the CPU backend
// (src/cpu/) runs OpenMP/SIMD kernels on host memory, the CUDA backend (cuda/) runs device
// kernels on device memory. All pointers below are in the backend's own memory unless they
// are called host_*.
#pragma once

#include <cstddef>
#include <memory>
#include <span>

#include "shardopt/adam_math.hpp"
#include "shardopt/dtype.hpp"
#include "shardopt/memory.hpp"
#include "shardopt/options.hpp"

namespace shardopt {

class Backend {
 public:
  virtual ~Backend() = default;
  virtual const char* name() const = 0;

  /// A zeroed allocation of `bytes`, accounted under `category`.
  virtual Allocation allocate(MemoryTracker* tracker, MemCategory category,
                              std::size_t bytes) = 0;
  virtual void fill_zero(void* p, std::size_t bytes) = 0;
  virtual void copy_from_host(void* dst, const void* host_src, std::size_t bytes) = 0;
  virtual void copy_to_host(void* host_dst, const void* src, std::size_t bytes) = 0;

  /// Sum of squares in double, with an order fixed by n alone (not by threads or timing).
  virtual double sum_squares(const float* x, std::size_t n) = 0;
  /// dst[i] += src[i], src fp32 or bf16.
  virtual void accumulate(float* dst, const void* src, DType src_dtype, std::size_t n) = 0;
  /// Casts fp32 to the replica dtype (a copy for fp32).
  virtual void cast_from_f32(const float* src, void* dst, DType dst_dtype, std::size_t n) = 0;

  /// The fused update over one shard: segments tile [0, n) of master/grad/m/v. When
  /// `replica` is not null, the new weights are also written there in `replica_dtype`.
  virtual void adam_update(const StepScalars& s, std::span<const UpdateSegment> segments,
                           float* master, const float* grad, float* m, float* v, void* replica,
                           DType replica_dtype) = 0;

  /// Waits for queued work (device backends); a no-op on the CPU.
  virtual void synchronize() {}
};

std::unique_ptr<Backend> make_cpu_backend();
/// Computes on `stream` (a cudaStream_t; nullptr: the legacy default stream). Throws
/// Error(Unsupported) when shardopt was built without CUDA.
std::unique_ptr<Backend> make_cuda_backend(void* stream = nullptr);

}  // namespace shardopt
