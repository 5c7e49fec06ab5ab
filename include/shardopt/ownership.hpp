// ownership.hpp: whole-tensor ownership (issue 32): which rank owns each parameter whole, and
// how every bucket is cut into per-rank ragged ranges so that it does.
//
// Muon (Newton-Schulz orthogonalisation of 2-D matrices) and Adafactor need every element of
// a matrix on one rank. A Whole layout keeps the buckets FlatLayout::build forms (same
// capacity, same order), except that a parameter larger than a bucket gets buckets of its own,
// and cuts each bucket into N contiguous ranges of
// different lengths instead of N equal slices; gradients reach the owner by an uneven
// reduce-scatter and parameters leave by an uneven all-gather
// (Communicator::start_reduce_scatter_sum_v / start_all_gather_v). assign_owners() computes
// the cut. It is pure arithmetic: every rank computes the same plan from the same inputs, no
// MPI. finalize() cuts a Whole layout with it (FlatLayout::apply_owners; costs from
// rules::owner_costs, the hook where a matrix rule marks its 2-D parameters) and the step runs
// it at stages 0-3 on the CPU (docs/architecture.md, "Whole-tensor ownership").
//
// Kinds of buckets and parameters:
//   spanning    a parameter larger than a bucket. In a Whole layout (FlatLayout::
//               set_ownership) build() gives it buckets of its own: its first piece opens a
//               bucket and its last piece closes one. Owner kAllRanks. It must run an
//               element-wise rule (a matrix that spans buckets is refused: raise the bucket
//               size).
//   equal       a bucket of a spanning parameter: equal slices, exactly as today
//               (Bucket::slice()), so its state spreads evenly over the ranks.
//   ragged      every other bucket. Its parameters are placed ordered by owner (ties by
//               registration order), each starting at a multiple of the layout's alignment,
//               so rank r's range is contiguous and its count a multiple of the alignment.
//               The padding at the end of a bucket belongs to the last rank with elements in
//               it; ranks after it have empty ranges (count 0). (Before spanning parameters
//               had buckets of their own, a ragged bucket could hold the tail of one, pinned
//               to rank 0: Llama 3.2 1B's tied embedding put 11M extra elements on rank 0.)
//
// The owner rule (deterministic longest processing time first, LPT): every rank starts with
// the state bytes of its equal slices. Whole parameters are sorted by
// (Newton-Schulz flops desc, state bytes desc, registration index asc) and each is given to
// the rank with the least (cumulative NS flops, cumulative state bytes, rank index).
// Element-wise parameters (NS flops 0) come last; under that key they would all go to the
// rank that happened to end with the least NS work, whatever their bytes, so by default
// (OwnerOptions::elementwise_by_state) they go to the rank with the least (cumulative state
// bytes, cumulative NS flops, rank index) instead: they add no NS work, only state.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "shardopt/range.hpp"

namespace shardopt {

class FlatLayout;
struct ParamInfo;

/// How a layout's buckets are divided between ranks.
enum class Ownership : int {
  Flat = 0,   ///< equal slices of every bucket (every rank owns a piece of most parameters)
  Whole = 1,  ///< ragged ranges: every parameter within a bucket has one owner (above)
};
const char* ownership_name(Ownership o) noexcept;

/// The owner of a spanning parameter: its elements are spread over all ranks.
inline constexpr int kAllRanks = -1;

/// Newton-Schulz iterations Muon runs per step (Jordan et al. 2024: 5 quintic iterations).
inline constexpr int kNewtonSchulzIterations = 5;

/// Flops of `iterations` Newton-Schulz iterations on a rows x cols matrix. With the matrix
/// transposed so that m = min(rows, cols) <= n = max(rows, cols), each iteration computes
/// S = X X^T (2 m^2 n), S S (2 m^3) and T X (2 m^2 n): 4 m^2 n + 2 m^3.
std::uint64_t newton_schulz_flops(std::size_t rows, std::size_t cols,
                                  int iterations = kNewtonSchulzIterations);

/// Bytes of optimizer state Muon keeps per element: one fp32 momentum (the fp32 master of a
/// bf16 replica comes on top, as for every rule).
inline constexpr double kMuonStateBytesPerElem = 4.0;

/// How the owner rule prices one parameter.
struct ParamCost {
  bool matrix = false;               ///< runs the matrix rule (Muon): needs one owner
  std::uint64_t ns_flops = 0;        ///< Newton-Schulz flops per step (0 unless matrix)
  double state_bytes_per_elem = 0;   ///< state (and master) bytes per element on its owner
};

/// The cost model: a matrix parameter costs newton_schulz_flops(rows, cols) of its ParamInfo
/// (it must have a 2-D shape: Error(InvalidArgument) otherwise); any other costs 0 flops.
ParamCost param_cost(const ParamInfo& p, bool matrix, double state_bytes_per_elem);

struct OwnerOptions {
  /// Element-wise parameters balance the state bytes (see above); false: the key
  /// (cumulative NS flops first) for them too.
  bool elementwise_by_state = true;
};

/// One bucket of an OwnerPlan (the layout's bucket of the same index).
struct OwnedBucket {
  Range flat;                      ///< the layout's bucket range (unchanged)
  bool equal = false;              ///< equal slices (pieces of spanning parameters only)
  std::vector<std::size_t> order;  ///< parameters with elements in it, in placement order
  std::vector<std::size_t> counts;   ///< per rank: elements (multiples of the alignment)
  std::vector<std::size_t> offsets;  ///< per rank: where its range starts, from flat.begin
  /// Rank r's range, in flat coordinates.
  Range range(int rank) const {
    const std::size_t b = flat.begin + offsets[static_cast<std::size_t>(rank)];
    return {b, b + counts[static_cast<std::size_t>(rank)]};
  }
};

/// What one rank holds and computes.
struct RankLoad {
  std::size_t elems = 0;          ///< its ranges' elements, padding included (local arrays)
  std::uint64_t state_bytes = 0;  ///< state of its parameters and pieces
  std::uint64_t ns_flops = 0;     ///< Newton-Schulz flops of its matrices per step
  std::size_t matrices = 0;       ///< matrices it owns
};

/// The largest and the mean of a per-rank figure; max_over_mean() is 1 for a perfect balance
/// (and for all zeros).
struct Spread {
  double max = 0;
  double mean = 0;
  double max_over_mean() const { return mean > 0 ? max / mean : 1.0; }
};

struct OwnerPlan {
  int world_size = 0;
  std::vector<int> owner;          ///< per parameter: its rank, or kAllRanks (spanning)
  std::vector<Range> flat;         ///< per parameter: its place in the Whole flat buffer
  std::vector<OwnedBucket> buckets;  ///< per bucket of the layout (backward order)
  std::vector<RankLoad> ranks;     ///< per rank
  Spread elems, state_bytes, ns_flops;
  std::size_t equal_buckets = 0;   ///< buckets with equal slices
  std::size_t spanning_params = 0; ///< parameters with owner kAllRanks
};

/// The owner plan of a built Whole layout (set_ownership before build) for its world size,
/// with costs[i] for parameter i (one per parameter). Throws Error(InvalidState) for an
/// unbuilt or a Flat layout and Error(InvalidArgument)
/// for a wrong number of costs or a matrix parameter that spans buckets. Pure: the same
/// inputs give the same plan on every rank.
OwnerPlan assign_owners(const FlatLayout& layout, const std::vector<ParamCost>& costs,
                        const OwnerOptions& options = {});

}  // namespace shardopt
