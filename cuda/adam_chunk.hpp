// adam_chunk.hpp: the fused AdamW / Adam-L2 update of a whole shard as one work item per
// 4-element chunk, so that one launch covers every segment of the shard.
//
// Plain C++ with __host__ __device__ members: the CUDA kernels (Thrust and grid-stride), the
// Thrust OpenMP test build and host tests all run this same code. The arithmetic is
// adam_element() from adam_math.hpp; this file only adds the indexing.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "shardopt/adam_math.hpp"
#include "shardopt/bf16.hpp"
#include "shardopt/host_device.hpp"

namespace shardopt::dev {

// ---- chunk arithmetic ------------------------------------------------------------------------

/// Elements per work item: 4 fp32 = one 128-bit load or store per stream.
inline constexpr std::size_t kAdamWidth = 4;

/// Work items covering n elements (the last one may be partial).
SHARDOPT_HD constexpr std::size_t adam_chunk_count(std::size_t n) {
  return (n + kAdamWidth - 1) / kAdamWidth;
}

/// Index of the segment holding element i. Segments tile [0, n) in order (empty ones
/// allowed); i < n. Binary search on the ends: segments are few (parameter-group changes).
SHARDOPT_HD std::size_t find_segment(const UpdateSegment* segs, std::size_t count,
                                     std::size_t i) {
  std::size_t lo = 0, hi = count - 1;
  while (lo < hi) {
    const std::size_t mid = lo + (hi - lo) / 2;
    if (segs[mid].end <= i) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  return lo;
}

/// True when every stream can use aligned 4-wide accesses: chunk c starts at element 4c, so
/// aligned base pointers make every chunk aligned.
inline bool adam_vector_aligned(const void* master, const void* grad, const void* m,
                                const void* v, const void* out_bf16, const void* out_f32) {
  const auto off = [](const void* p, std::uintptr_t a) {
    return reinterpret_cast<std::uintptr_t>(p) % a;
  };
  return off(master, 16) == 0 && off(grad, 16) == 0 && off(m, 16) == 0 && off(v, 16) == 0 &&
         off(out_bf16, 8) == 0 && off(out_f32, 16) == 0;
}

// ---- vector access ---------------------------------------------------------------------------

struct alignas(16) F32x4 {
  float e[4];
};
struct alignas(8) Bf16x4 {
  bf16 e[4];
};

/// An aligned 4-wide load/store: a single 128-bit (or 64-bit) access on the GPU; memcpy on
/// the host, which compilers turn into vector moves without breaking aliasing rules.
template <class V, class T>
SHARDOPT_HD V load_vec(const T* p) {
#if defined(__CUDA_ARCH__)
  return *reinterpret_cast<const V*>(p);
#else
  V r;
  std::memcpy(&r, p, sizeof r);
  return r;
#endif
}
template <class V, class T>
SHARDOPT_HD void store_vec(T* p, const V& x) {
#if defined(__CUDA_ARCH__)
  *reinterpret_cast<V*>(p) = x;
#else
  std::memcpy(p, &x, sizeof x);
#endif
}

// ---- the work item ---------------------------------------------------------------------------

/// Chunk c of the update. `step` and `segments` point into the device's memory: the step
/// number, lr and bias corrections reach the kernel as data, not as launch arguments.
struct AdamChunkOp {
  const StepScalars* step = nullptr;
  const UpdateSegment* segments = nullptr;
  std::size_t num_segments = 0;
  std::size_t n = 0;  ///< elements; segments tile [0, n)
  float* master = nullptr;
  const float* grad = nullptr;
  float* m = nullptr;
  float* v = nullptr;
  bf16* out_bf16 = nullptr;  ///< replica copy, or null
  float* out_f32 = nullptr;  ///< replica copy, or null
  bool vectorized = false;   ///< adam_vector_aligned() of the pointers above

  SHARDOPT_HD void operator()(std::size_t c) const {
    const StepScalars s = *step;
    const std::size_t b = c * kAdamWidth;
    std::size_t k = find_segment(segments, num_segments, b);
    SegmentScalars g = segments[k].scalars;
    if (vectorized && b + kAdamWidth <= segments[k].end) {
      F32x4 p = load_vec<F32x4>(master + b);
      const F32x4 gr = load_vec<F32x4>(grad + b);
      F32x4 mm = load_vec<F32x4>(m + b);
      F32x4 vv = load_vec<F32x4>(v + b);
      for (int j = 0; j < 4; ++j) adam_element(s, g, p.e[j], gr.e[j], mm.e[j], vv.e[j]);
      store_vec(master + b, p);
      store_vec(m + b, mm);
      store_vec(v + b, vv);
      if (out_bf16) {
        Bf16x4 o;
        for (int j = 0; j < 4; ++j) o.e[j] = to_bf16(p.e[j]);
        store_vec(out_bf16 + b, o);
      }
      if (out_f32) store_vec(out_f32 + b, p);
      return;
    }
    // Tail, misaligned buffers, or a chunk that straddles a segment boundary.
    const std::size_t e = b + kAdamWidth < n ? b + kAdamWidth : n;
    for (std::size_t i = b; i < e; ++i) {
      while (i >= segments[k].end) g = segments[++k].scalars;
      float p = master[i], mi = m[i], vi = v[i];
      adam_element(s, g, p, grad[i], mi, vi);
      master[i] = p;
      m[i] = mi;
      v[i] = vi;
      if (out_bf16) out_bf16[i] = to_bf16(p);
      if (out_f32) out_f32[i] = p;
    }
  }
};

}  // namespace shardopt::dev
