// units.hpp: stage 3's gathered units. Each rank keeps only its slice of every bucket of the
// replica (local coordinates, like master, m and v); a unit (consecutive parameters, a whole
// number of buckets, see layout.hpp) is gathered into one of a pool of full-size buffers
// when the trainer acquires or prefetches it, and the buffer returns to the pool on release.
//
// A gather copies this rank's slice of each of the unit's buckets into its block of the
// buffer and starts one in-place all-gather per bucket, in bucket order: equal counts, or
// under whole-tensor ownership the bucket's ragged per-rank counts (bucket_gather; each rank
// keeps only its owned ranges, some of them empty), in batches of at most `batch` buckets
// (Communicator::start_batch, SHARDOPT_COMM_BATCH; on one node's shared memory one round of
// node barriers per batch). The gathers are collectives: every rank must make the same prefetch/acquire/release calls in
// the same order. The checks are local (check_prefetch, check_acquire) and made before any
// collective starts; ShardedOptimizer agrees on their outcome across ranks first, so a bad
// call on one rank is an error on every rank and none is left waiting.
#pragma once

#include <cstddef>
#include <memory>
#include <vector>

#include "backend.hpp"
#include "buffer_plan.hpp"
#include "shardopt/comm.hpp"
#include "shardopt/layout.hpp"

namespace shardopt {

class UnitSet {
 public:
  /// `replica` is this rank's local replica (plan.replica: its slices, param dtype); `pool`
  /// the unit buffers (plan.units), allocated collectively by the caller; `batch` the most
  /// buckets of a unit one start_batch covers (BucketSet::Config::batch, the same on every rank).
  UnitSet(Communicator& comm, Backend& backend, const FlatLayout& layout, const BufferPlan& plan,
          DType param_dtype, Allocation pool, const void* replica, std::size_t batch);
  ~UnitSet();  // completes gathers still in flight (they are collective)
  UnitSet(const UnitSet&) = delete;
  UnitSet& operator=(const UnitSet&) = delete;

  /// Throws what prefetch(u) / acquire(u) would throw, before either communicates. Local.
  void check_prefetch(std::size_t u) const;
  void check_acquire(std::size_t u) const;
  /// Starts gathering unit u into a free buffer, unless it is held already (prefetched or
  /// acquired). Throws InvalidState when every buffer is held.
  void prefetch(std::size_t u);
  /// Prefetches u if needed and waits for its gather; u is then acquired until release(u).
  /// Throws InvalidState if u is acquired already.
  void acquire(std::size_t u);
  /// Returns u's buffer to the pool; throws InvalidState if u is not acquired.
  void release(std::size_t u);
  /// Parameter i inside its acquired unit's buffer; throws InvalidState if the unit is not
  /// acquired.
  void* param_data(std::size_t i) const;
  /// Units prefetched or acquired (each holds one buffer).
  std::size_t held() const;
  /// Tests gathers in flight so that MPI makes progress.
  void progress();

 private:
  enum class Hold : unsigned char { None, Prefetched, Acquired };
  struct State {
    Hold hold = Hold::None;
    int buffer = -1;
    std::vector<std::unique_ptr<CommRequest>> gathers;  ///< one per bucket, until waited
  };
  void require_unit(std::size_t u, const char* what) const;
  void wait(State& s);

  Communicator& comm_;
  Backend& backend_;
  const FlatLayout& layout_;
  BufferPlan plan_;
  DType dtype_;
  std::size_t batch_;
  const char* replica_;
  Allocation pool_;
  std::vector<int> free_buffers_;
  std::vector<State> state_;
};

}  // namespace shardopt
