// comm.hpp: the communication layer. The optimizer talks to its data-parallel group only
// through this interface; implementations: single process (no MPI), MPI (host buffers),
// and, in cuda/, NCCL (device buffers).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "shardopt/error.hpp"
#include "shardopt/memory.hpp"

namespace shardopt {

/// Element types that cross the wire. BF16 is a reduction type: fp32 values are sent and
/// summed as bf16 (half the bytes; every partial sum is rounded to bf16) and the result is
/// written back as fp32.
enum class CommType { F32, F64, U16, U8, BF16 };

/// The integer reductions of reproducible mode (Reduction::Reproducible): integer sums and
/// maxima are associative, so their result does not depend on the order a transport takes.
enum class IntOp {
  SumI64,  ///< std::int64_t, sum (the caller keeps every partial sum inside int64's range)
  MaxU8,   ///< std::uint8_t, maximum
};

/// What a reduce-scatter that delivers raw values (Communicator::reduce_scatter_combine) does
/// with them: for i < n, dst[i] = a function of element i of src[0], ..., src[nsrc - 1] (one
/// array per rank, in rank order, of the call's element type). dst may be one of the sources
/// (the same address). A combiner may keep side results (reproducible mode takes the exact
/// squares of what it writes).
class BlockCombiner {
 public:
  virtual ~BlockCombiner() = default;
  virtual void combine(float* dst, const void* const* src, int nsrc, std::size_t n) = 0;
  /// Whether the block's owner must do all of its block's combining, with dst inside its own
  /// `out` (out + rank * count + offset): a combiner that keeps the owner's state (reproducible
  /// mode's stage-2 deposit into the owner's bins). Otherwise a communicator may split a block
  /// between ranks (the shared-memory one does) and write through a peer's mapping.
  virtual bool at_owner() const { return false; }
};

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

/// One collective of a batch (Communicator::start_batch): the arguments of one of the
/// Communicator's start_ calls.
struct BatchedCollective {
  enum class Op : unsigned char {
    ReduceScatterSum,   ///< start_reduce_scatter_sum(buf, count, type)
    ReduceScatterSumV,  ///< start_reduce_scatter_sum_v(buf, counts, type)
    AllGather,          ///< start_all_gather(buf, count, type)
    AllGatherV,         ///< start_all_gather_v(buf, counts, type)
    AllReduceSum,       ///< start_all_reduce_sum(buf, count, type)
  };
  Op op = Op::AllGather;
  void* buf = nullptr;
  std::size_t count = 0;                ///< per rank (equal forms) or in all (all-reduce)
  std::span<const std::size_t> counts;  ///< the uneven forms' per-rank counts
  CommType type = CommType::F32;        ///< the wire (reductions) or element type (gathers)
  /// Reduce-scatters only: the caller clears the buffer after the collective anyway (stage 2's
  /// staging slots), so the communicator may zero the inputs it reads while it sums them.
  /// Whether it does is clears_inputs(); where it does not, the buffer is as without the flag.
  bool clear_inputs = false;
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

  // The uneven forms (issue 32, whole-tensor ownership): rank r's block holds counts[r]
  // elements (0 allowed) and starts at offset_r = counts[0] + ... + counts[r - 1]; the buffer
  // holds sum(counts) elements. `counts` has size() entries, the same on every rank. In place
  // like the equal forms; requests complete as theirs do. The base class composes them from
  // the other collectives: the reduce-scatter as an all-reduce of the whole buffer (any
  // communicator, device buffers included), the all-gather as one broadcast_bytes per rank
  // with a non-zero count (host buffers only; device buffers: Error(Unsupported); the
  // request is complete on return). Single process, plain MPI and shared memory have their
  // own forms; plain MPI refuses counts or totals above INT_MAX (Error(Unsupported)).

  /// Starts an in-place uneven reduce-scatter (sum): on completion buf + offset_rank() holds
  /// the sum over ranks of everyone's block rank() (counts[rank()] elements); the rest of
  /// the buffer is undefined. `wire` is F32 or BF16.
  virtual std::unique_ptr<CommRequest> start_reduce_scatter_sum_v(
      float* buf, std::span<const std::size_t> counts, CommType wire);

  /// Starts an in-place uneven all-gather: on entry block rank() holds this rank's data; on
  /// completion every block holds its owner's data. `type` is F32 or U16.
  virtual std::unique_ptr<CommRequest> start_all_gather_v(void* buf,
                                                          std::span<const std::size_t> counts,
                                                          CommType type);

  /// Starts an in-place sum over all ranks of `count` fp32 values; `wire` is F32 or BF16.
  virtual std::unique_ptr<CommRequest> start_all_reduce_sum(float* buf, std::size_t count,
                                                            CommType wire) = 0;

  /// Starts `c` alone: the start_ call it names (the shared-memory communicator also reads
  /// c.clear_inputs).
  virtual std::unique_ptr<CommRequest> start_collective(const BatchedCollective& c);

  /// True when `c` (a reduce-scatter with clear_inputs), started by start_collective() or
  /// start_batch(), leaves every element of its buffer outside this rank's block zero on
  /// completion (the block holds the sum as without the flag): the caller then has only its own
  /// block to clear. Every rank gets the same answer for the same collective. The default:
  /// false (the shared-memory communicator on one node: true, its sums zero what they read).
  virtual bool clears_inputs(const BatchedCollective& c) const {
    (void)c;
    return false;
  }

  /// Starts several collectives at once, in the order given, and returns their requests in
  /// that order. Each request completes as the collective started alone would (the same
  /// result, bit for bit); waiting for one may complete others of the batch. The buffers
  /// must not overlap; every rank passes the same list (the same ops and counts, buffers
  /// obtained the same way). The default starts them one by one (start_collective()); the shared-memory
  /// communicator runs a batch held in its windows on one node as one request, one round of
  /// node barriers per phase for the whole batch instead of one per collective.
  virtual std::vector<std::unique_ptr<CommRequest>> start_batch(
      std::span<const BatchedCollective> batch);

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
  void reduce_scatter_sum_v_inplace(float* buf, std::span<const std::size_t> counts,
                                    CommType wire = CommType::F32) {
    start_reduce_scatter_sum_v(buf, counts, wire)->wait();
  }
  void all_gather_v_inplace(void* buf, std::span<const std::size_t> counts, CommType type) {
    start_all_gather_v(buf, counts, type)->wait();
  }

  /// Blocking, in place, host memory: the integer form of the reduce-scatter above (block
  /// rank() of `count_per_rank` elements holds the result, the other blocks are undefined).
  /// The default throws Error(Unsupported): the NCCL communicator does not implement it.
  virtual void reduce_scatter_int(void* buf, std::size_t count_per_rank, IntOp op);
  /// Blocking, in place, host memory: `count` elements reduced over all ranks.
  virtual void all_reduce_int(void* buf, std::size_t count, IntOp op);
  /// Blocking, host memory, in the shape of the reduce-scatter above: `in` holds size()
  /// blocks of `count_per_rank` elements of `elem_bytes` bytes each, `out` as many fp32
  /// values; block rank() of `out` ends up holding, element by element, `op`'s combination of
  /// every rank's element of block rank() of `in` (elem_bytes on the wire per element, no
  /// partial results in between). `out` may be `in` (fp32 elements, in place). Which rank
  /// calls `op` on which elements is the communicator's choice (shared memory splits every
  /// block between the node's ranks and writes into the owner's `out`), so side results of
  /// `op` mean something only summed over all ranks; each element of every block is combined
  /// exactly once. The other blocks of `out` (and all of `in`) are undefined afterwards.
  /// Returns false, having done nothing, when this communicator cannot deliver raw values
  /// (the default); the answer is the same on every rank for buffers obtained the same way.
  virtual bool reduce_scatter_combine(const void* in, std::size_t elem_bytes, float* out,
                                      std::size_t count_per_rank, BlockCombiner& op);
  /// reduce_scatter_combine with two inputs per rank, both read where they lie: `op` gets 2 *
  /// size() sources, every rank's element of `in` (elem_bytes each) in rank order, then every
  /// rank's element of `in2` (elem_bytes2 each); `out` may be `in2` (fp32, in place).
  /// Reproducible mode's packed exchange uses it to deposit each rank's last micro-batch at the
  /// owner, in the combining pass. Only a communicator that reads its peers' memory in place
  /// does it (the shared-memory one, on one node, with `in`, `in2` and `out` in its windows);
  /// the others return false, having done nothing (the default), the same on every rank for
  /// buffers obtained the same way.
  virtual bool reduce_scatter_combine_pair(const void* in, std::size_t elem_bytes, const void* in2,
                                           std::size_t elem_bytes2, float* out,
                                           std::size_t count_per_rank, BlockCombiner& op);

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
  /// One collective buffer of allocate_collective_buffers().
  struct BufferRequest {
    MemCategory category;
    std::size_t bytes;
  };
  /// Collective: several buffers as allocate_collective_buffer() gives them, in one call (one
  /// allocation where the communicator can: the shared-memory communicator puts them in one
  /// window, whose creation costs several node-wide rounds inside MPI). Element k answers
  /// requests[k]; an empty one means "allocate it yourself". By default one call each.
  virtual std::vector<Allocation> allocate_collective_buffers(
      MemoryTracker* tracker, std::span<const BufferRequest> requests) {
    std::vector<Allocation> out;
    out.reserve(requests.size());
    for (const BufferRequest& r : requests)
      out.push_back(allocate_collective_buffer(tracker, r.category, r.bytes));
    return out;
  }

  /// Local. Bytes of the data collectives above (reduce-scatter, all-gather, all-reduce)
  /// that crossed between nodes for this rank since the communicator was made, counted as a
  /// ring between the nodes moves them: a reduce-scatter or all-gather of B bytes in all
  /// moves B minus this node's part of it, an all-reduce twice that. Counted by the node
  /// leaders of the shared-memory communicator across nodes (node rank 0; the other ranks
  /// hand their node's data to the leader in shared memory and count 0; a collective it
  /// hands to plain MPI, such as a bf16 wire or a buffer outside its windows, is not
  /// counted) and by plain MPI, which takes every rank as a node of its own (what
  /// make_mpi_communicator chooses when every node holds one rank). 0 for the others.
  /// The planner's MemoryPlan::internode_bytes is the same figure for one step.
  virtual std::uint64_t internode_bytes() const { return 0; }

  /// Local. A rank that waits longer than `seconds` in one collective of this communicator
  /// gives up: it asks every rank what it is in, and every rank waiting in the library that
  /// is asked gives up with it; each prints to stderr the collective it waits in and which
  /// ranks have not arrived, and all of them throw the same Error(Communication) (its text
  /// names the collective, the missing ranks and their nodes, and the ranks that gave up).
  /// Every later call of the communicator throws it again: an MPI collective cannot be
  /// cancelled. MPI_Finalize would then wait for the missing ranks, so the program should
  /// end the job with MPI_Abort; a rank still running `seconds` after its error ends the job
  /// itself (MPI_Abort on MPI_COMM_WORLD, code kCollectiveTimeoutExitCode). While it waits it
  /// polls, sleeping between polls after the first 50 ms instead of spinning. 0 (the
  /// default) waits forever with plain blocking calls. The MPI communicators implement it.
  /// The NCCL communicator applies it to its host-side MPI collectives as above and to its
  /// NCCL collectives, where a timeout aborts the NCCL communicator and throws the same
  /// Error(Communication) on every rank that can still answer (nccl_comm.hpp). The others
  /// never wait.
  virtual void set_collective_timeout(double /*seconds*/) {}
};

/// Names the library call this thread is in ("step", "shardopt_step", "ShardedAdamW::
/// unit_forward(unit 3)") for the collective timeout's report, which gives every rank's call.
/// Scopes nest and the outermost names the call (a C ABI function, not the C++ method it
/// calls). Local and cheap: a thread-local name, cut to 63 bytes.
class CallScope {
 public:
  explicit CallScope(std::string_view name) noexcept;
  ~CallScope();
  CallScope(const CallScope&) = delete;
  CallScope& operator=(const CallScope&) = delete;
  /// The outermost scope's name on this thread; "" outside every scope.
  static const char* current() noexcept;
};

/// The exit code with which a rank ends the job (MPI_Abort) when it still runs a collective
/// timeout after its timeout error (see set_collective_timeout).
inline constexpr int kCollectiveTimeoutExitCode = 14;

/// A request that completed when it was made (blocking implementations return it).
std::unique_ptr<CommRequest> completed_request();

/// The offsets of the blocks of an uneven collective: size counts.size() + 1, the last entry
/// sum(counts). Throws Error(InvalidArgument) naming `what` unless counts.size() == ranks.
std::vector<std::size_t> uneven_offsets(std::span<const std::size_t> counts, int ranks,
                                        const char* what);

/// A group of one: every collective is a no-op (or a copy). Needs no MPI.
std::shared_ptr<Communicator> make_single_process_communicator();

/// Wraps `inner` for debugging (OptimizerOptions::debug_collectives,
/// SHARDOPT_DEBUG_COLLECTIVES=1): before every collective, all ranks exchange what they are
/// entering (the operation, its element count and type, the root, and its sequence number on
/// this communicator; for the uneven collectives the total and a hash of the counts) and
/// compare. At the first divergence every rank throws the same
/// Error(InvalidState) naming the collective and what each rank entered, instead of hanging or
/// mixing up data. Cost: one extra blocking all-gather of 32 bytes per rank before every
/// collective (a started collective is started only once all ranks reach it).
std::shared_ptr<Communicator> make_checked_communicator(std::shared_ptr<Communicator> inner);

// ---- agreement: a failure on one rank is the same error on every rank ---------------------------
//
// A collective call whose local part fails on one rank must not leave the others waiting in
// the collectives that follow. Each collective entry point therefore runs its local part
// (argument checks, local setup) through collective(): it captures what the local part threw,
// all ranks agree on the outcomes in one small all-reduce, and then either every rank goes on
// or every rank throws the same Error. The all-reduce also carries the name of the call, so
// ranks that entered different collective calls get an error instead of exchanging the wrong
// data.

/// What the local part of a collective call came to on one rank.
struct LocalOutcome {
  Status status = Status::Ok;
  std::string message;
  bool ok() const { return status == Status::Ok; }
};

/// The LocalOutcome of the exception being handled (call it in a catch block): an Error
/// keeps its status and message; std::filesystem errors are Io, std::bad_alloc OutOfMemory,
/// anything else Internal, with "what: " before their message. Never throws.
LocalOutcome current_exception_outcome(std::string_view what) noexcept;

/// Runs f() on this rank and returns how it went (see current_exception_outcome). Local;
/// never throws.
template <class F>
LocalOutcome capture(std::string_view what, F&& f) noexcept {
  try {
    std::forward<F>(f)();
    return {};
  } catch (...) {
    return current_exception_outcome(what);
  }
}

/// Collective: every rank states the outcome of its local part of the collective call `what`
/// (one all-reduce of 9 doubles). Returns on every rank if all succeeded in the same call.
/// Otherwise every rank throws the same Error: if some rank failed, with the status of the
/// first failing rank (each failing rank: its own) and a message naming every failing rank
/// and its reason; if all succeeded but entered different calls, Error(InvalidState) naming
/// the call of each rank.
void agree(Communicator& comm, std::string_view what, const LocalOutcome& local);

/// Collective: validate locally, agree, then run. Runs local() on this rank, agrees on the
/// outcome (agree()), and returns local()'s result on every rank, or throws the same Error on
/// every rank. The code after it (the collective part of the call) runs only when every rank
/// passed, so a bad argument on one rank is an error everywhere, never a hang.
template <class F>
auto collective(Communicator& comm, std::string_view what, F&& local) {
  using R = std::invoke_result_t<F&>;
  if constexpr (std::is_void_v<R>) {
    agree(comm, what, capture(what, local));
  } else {
    std::optional<R> result;
    agree(comm, what, capture(what, [&] { result.emplace(local()); }));
    return std::move(*result);
  }
}

/// agree() for a call without a name: kept for existing callers.
void agree_or_throw(Communicator& comm, Status local_status, const std::string& local_message);

/// Collective, for when every rank already knows that some rank failed: exchanges the
/// statuses and messages and throws the combined Error on every rank (as agree()).
[[noreturn]] void throw_agreed_error(Communicator& comm, Status local_status,
                                     const std::string& local_message);

}  // namespace shardopt
