// shm_kernels.hpp: the loops of the shared-memory collectives: a fixed-order fp32 sum of
// peer buffers and the work split between node ranks. Internal.
#pragma once

#include <cstddef>

#include "shardopt/range.hpp"

namespace shardopt::shm {

/// dst[i] = ((src[0][i] + src[1][i]) + src[2][i]) + ... for i < n: fp32, sources in the
/// given order, independent of n, alignment and who calls it. dst may be one of the sources
/// (the same pointer), but may not otherwise overlap them.
/// With clear_sources, every source other than dst is zero on return, each chunk cleared just
/// after it was read (while in cache): the same sums, one pass instead of a sum and a clear.
void sum_rows(float* dst, const float* const* src, int nsrc, std::size_t n,
              bool clear_sources = false);

/// Part `part` of `parts` of [0, n): contiguous, in order, boundaries on multiples of 16
/// elements (64 bytes), so ranks writing neighbouring parts never share a cache line.
Range split_part(std::size_t n, int parts, int part);

}  // namespace shardopt::shm
