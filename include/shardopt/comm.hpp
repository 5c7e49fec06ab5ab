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

/// Element types that cross the wire. BF16 is a reduction type: fp32 values are sent and
/// summed as bf16 (half the bytes; every partial sum is rounded to bf16) and the result is
/// written back as fp32.
enum class CommType { F32, F64, U16, U8, BF16 };

/// A collective that was started and may still be running. Every started collective must be
/// completed (wait) on every rank; destroying an unfinished request waits for it.
class CommRequest {
 public:
  virtual ~CommRequest() = default;
  /// Drives progress; returns true once the operation has completed.
  virtual bool test() = 0;
  /// Completes the operation for its consumers. Host communicators return once it is done.
  /// Device communicators (device_buffers()) do not wait on the host: work queued on
  /// device_stream() after wait() sees the result; the host must wait on that stream before
  /// it reads the result.
  virtual void wait() = 0;
};

class Communicator {
 public:
  virtual ~Communicator() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual std::string name() const = 0;
  /// True when buffers passed to the data collectives must be device memory.
  virtual bool device_buffers() const { return false; }
  /// Device communicators: the CUDA stream (a cudaStream_t; nullptr: the legacy default
  /// stream) that data collectives are ordered with: a collective starts after the work
  /// queued there before it, and CommRequest::wait() orders that stream after it. A CUDA
  /// optimizer computes on this stream.
  virtual void* device_stream() const { return nullptr; }

  // ---- data collectives (device memory when device_buffers()) --------------------------------

  // Every data collective works on size() equal blocks of `count_per_rank` elements laid out
  // back to back (block r at offset r * count_per_rank): the shape of a bucket, of which rank
  // r owns the r-th equal slice. In place, in NCCL's convention.

  /// Starts an in-place reduce-scatter (sum): on completion block rank() holds the sum over
  /// ranks of everyone's block rank(); the other blocks are undefined. `wire` is F32 or BF16.
  virtual std::unique_ptr<CommRequest> start_reduce_scatter_sum(float* buf,
                                                                std::size_t count_per_rank,
                                                                CommType wire) = 0;

  /// Starts an in-place all-gather: on entry block rank() holds this rank's data; on
  /// completion every block holds its owner's data. `type` is F32 or U16.
  virtual std::unique_ptr<CommRequest> start_all_gather(void* buf, std::size_t count_per_rank,
                                                        CommType type) = 0;

  /// Starts an in-place sum over all ranks of `count` fp32 values; `wire` is F32 or BF16.
  virtual std::unique_ptr<CommRequest> start_all_reduce_sum(float* buf, std::size_t count,
                                                            CommType wire) = 0;

  /// In-place sum over all ranks, blocking. CommType F32 or F64.
  virtual void all_reduce_sum(void* buf, std::size_t count, CommType type) = 0;

  /// Blocking forms of the above.
  void reduce_scatter_sum_inplace(float* buf, std::size_t count_per_rank,
                                  CommType wire = CommType::F32) {
    start_reduce_scatter_sum(buf, count_per_rank, wire)->wait();
  }
  void all_gather_inplace(void* buf, std::size_t count_per_rank, CommType type) {
    start_all_gather(buf, count_per_rank, type)->wait();
  }

  // ---- host collectives for small metadata ------------------------------------------------------

  /// In-place sum of a few doubles in host memory (flags, norms), whatever device_buffers().
  virtual void all_reduce_sum_host(double* buf, std::size_t count) {
    all_reduce_sum(buf, count, CommType::F64);
  }
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

/// A request that completed when it was made (blocking implementations return it).
std::unique_ptr<CommRequest> completed_request();

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
