// grad_reducer.hpp: where backward's gradients go and how they are reduced over ranks.
//
// Gradients are reduced bucket by bucket (buckets tile the flat buffer in backward order).
// With overlap on, a bucket's non-blocking collective starts as soon as all of its
// parameters are marked ready, while backward continues; with overlap off, every bucket is
// reduced at the step (stage 2: as soon as its staging slot is needed). Both paths issue the
// same collectives on the same buckets, so their results are identical.
//
// Buffers per stage: data-parallel and stage 1 accumulate in a full fp32 buffer that is
// reduced in place (all-reduce / reduce-scatter whose result lands at this rank's own block,
// i.e. at its owned position). Stage 2 writes into a few bucket-sized staging slots whose
// reduced block is added into the owned gradient shard, so no full-size buffer exists —
// unless micro-batches accumulate without synchronising, which needs one (allocated then).
#pragma once

#include <cstddef>
#include <deque>
#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "backend.hpp"
#include "shardopt/comm.hpp"
#include "shardopt/layout.hpp"
#include "shardopt/options.hpp"

namespace shardopt {

class GradReducer {
 public:
  struct Config {
    Stage stage;
    std::size_t bucket_elems;
    int slots;      ///< stage 2 staging slots (buckets in flight)
    CommType wire;  ///< F32 or BF16
    bool overlap;
  };

  /// Allocates a buffer that goes through collectives (collective: same calls on every
  /// rank); the communicator may place it where it moves fastest (shared-memory windows).
  using CollectiveAllocator = std::function<Allocation(MemCategory, std::size_t bytes)>;

  GradReducer(Communicator& comm, Backend& backend, MemoryTracker& tracker,
              const FlatLayout& layout, Range owned, Config config,
              const CollectiveAllocator& allocate_collective);
  ~GradReducer();  // completes collectives still in flight (they are collective)
  GradReducer(const GradReducer&) = delete;
  GradReducer& operator=(const GradReducer&) = delete;

  /// Starts one micro-batch's backward; sync = false accumulates locally, no communication.
  void begin_backward(bool sync);
  /// Where backward writes (or adds) parameter i's gradient now.
  std::span<float> grad(std::size_t i);
  /// Parameter i's gradient of this micro-batch is complete.
  void grad_ready(std::size_t i);
  /// Reduces what is not reduced yet and waits for everything in flight; afterwards
  /// owned_grad() holds the sum over ranks and micro-batches of the owned range.
  void finish();
  float* owned_grad() const;
  /// Micro-batches accumulated since the last zero() (at least 1).
  int micro_batches() const { return micro_batches_ > 0 ? micro_batches_ : 1; }
  /// Waits for anything in flight and clears every gradient and the pass state.
  void zero();
  /// Tests in-flight collectives so that MPI makes progress while backward computes.
  void progress();
  /// Seconds spent blocked in communication (starting or waiting for collectives) since the
  /// last zero(), on this rank.
  double blocked_seconds() const { return blocked_seconds_; }

  const std::vector<Bucket>& buckets() const { return buckets_; }
  std::size_t bucket_of(std::size_t param) const { return bucket_of_param_[param]; }
  /// Per-rank lengths of bucket b's blocks (its intersection with each shard).
  std::span<const std::size_t> block_counts(std::size_t b) const { return counts_[b]; }

 private:
  struct InFlight {
    std::size_t bucket;
    std::unique_ptr<CommRequest> request;
  };
  void start_through(std::size_t end);  // starts buckets [next_start_, end) in order
  void start_bucket(std::size_t b);
  void complete_oldest();
  float* slot_for(std::size_t b);  // stage 2: the bucket's staging slot, acquired if needed
  void require_open(std::size_t b, std::size_t i) const;

  Communicator& comm_;
  Backend& backend_;
  MemoryTracker& tracker_;
  const FlatLayout& layout_;
  Range owned_;
  Config cfg_;

  std::vector<Bucket> buckets_;
  std::vector<std::size_t> bucket_of_param_;
  std::vector<std::vector<std::size_t>> counts_;
  std::vector<std::size_t> ready_in_bucket_;
  std::vector<unsigned char> param_ready_;

  Allocation full_;        ///< data-parallel / stage 1: the full fp32 gradient
  Allocation shard_;       ///< stage 2: the owned gradient
  Allocation slots_;       ///< stage 2: staging slots, slot_capacity_ floats each
  Allocation accumulate_;  ///< stage 2 without sync: full-size local accumulation
  std::size_t slot_capacity_ = 0;
  std::vector<int> slot_of_bucket_;
  std::vector<int> free_slots_;

  std::deque<InFlight> in_flight_;
  std::size_t next_start_ = 0;  ///< buckets before it were started in this step
  int micro_batches_ = 0;
  bool sync_ = true;
  double blocked_seconds_ = 0.0;
};

}  // namespace shardopt
