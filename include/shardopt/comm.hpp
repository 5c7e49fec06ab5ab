// comm.hpp: the communication layer. The optimizer talks to its data-parallel group only
// through this interface; implementations: single process (no MPI), MPI (host buffers),
// and, in cuda/, NCCL (device buffers).
#pragma once

#include <cstddef>
#include <memory>
#include <span>
#include <string>

#include "shardopt/error.hpp"
#include "shardopt/memory.hpp"

namespace shardopt {

/// Element types that cross the wire.
enum class CommType { F32, F64, U16, U8 };

class Communicator {
 public:
  virtual ~Communicator() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual std::string name() const = 0;
  /// True when buffers passed to the collectives must be device memory.
  virtual bool device_buffers() const { return false; }

  // Data collectives: buffers are device memory when device_buffers() is true.
  /// In-place sum over all ranks. CommType F32 or F64.
  virtual void all_reduce_sum(void* buf, std::size_t count, CommType type) = 0;

  /// In-place reduce-scatter (sum) with per-rank block lengths `counts` (size() entries):
  /// on entry buf holds sum(counts) floats, block r starting at counts[0] + ... + counts[r-1];
  /// on return buf[0, counts[rank()]) holds the sum over ranks of block rank().
  virtual void reduce_scatter_sum_inplace(float* buf, std::span<const std::size_t> counts) = 0;

  /// In-place all-gather of equal blocks: on entry block rank() of buf (count_per_rank
  /// elements at offset rank() * count_per_rank) holds this rank's data; on return every block
  /// holds its owner's data.
  virtual void all_gather_inplace(void* buf, std::size_t count_per_rank, CommType type) = 0;

  /// In-place sum of a few doubles in host memory (flags, norms), whatever device_buffers().
  virtual void all_reduce_sum_host(double* buf, std::size_t count) {
    all_reduce_sum(buf, count, CommType::F64);
  }

  // Host collectives for small metadata.
  /// Gathers `bytes` from every rank into recv (size() * bytes), in rank order.
  virtual void all_gather_bytes(const void* send, void* recv, std::size_t bytes) = 0;

  virtual void broadcast_bytes(void* buf, std::size_t bytes, int root) = 0;
  virtual void barrier() = 0;

  /// Collective (same bytes, same order on every rank): zeroed host memory for a large buffer
  /// that will go through the data collectives, from wherever this communicator moves it
  /// fastest (the shared-memory communicator: an MPI-3 shared window, accounted under
  /// `category`; its release is collective too). Empty (data() == nullptr) means "allocate
  /// it yourself"; the collectives accept any buffer either way.
  virtual Allocation allocate_collective_buffer(MemoryTracker* /*tracker*/,
                                                MemCategory /*category*/,
                                                std::size_t /*bytes*/) {
    return {};
  }
};

/// A group of one: every collective is a no-op (or a copy). Needs no MPI.
std::shared_ptr<Communicator> make_single_process_communicator();

/// Collective: every rank states whether its local checks passed. If any rank failed, every
/// rank throws Error(status of the first failing rank) whose message names the failing ranks
/// and their reasons; no rank is left waiting in a later collective.
void agree_or_throw(Communicator& comm, Status local_status, const std::string& local_message);

/// Collective, for when every rank already knows that some rank failed: exchanges the
/// statuses and messages and throws the combined Error on every rank.
[[noreturn]] void throw_agreed_error(Communicator& comm, Status local_status,
                                     const std::string& local_message);

}  // namespace shardopt
