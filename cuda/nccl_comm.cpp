// nccl_comm.cpp: Communicator over NCCL collectives on device memory, bootstrapped from MPI.
//
// Streams: collectives run on a non-blocking stream of the communicator's own (stream_),
// after an event recorded on the compute stream; a request's wait() is a
// cudaStreamWaitEvent of the compute stream on the collective's end event.
//
// Errors. The NCCL communicator is non-blocking (config.blocking = 0); a call that returns
// ncclInProgress is settled by polling ncclCommGetAsyncError. The communicator is a
// dev::Watchdog: every host wait of cuda/ polls it (check()), and so does every wait of its
// host-side MPI collectives (the MPI watchdog's interrupt). A check looks for an asynchronous
// NCCL error, for a collective older than the collective timeout
// (Communicator::set_collective_timeout; 0: none), and for an abort notice from another rank.
// Any of them aborts the NCCL communicator (ncclCommAbort) and throws the same
// Error(Communication) on every rank that can still answer:
//
//   - The rank that found the cause sends an abort notice with its reason to every other rank
//     (point to point, on a duplicate of the parent communicator that carries nothing else).
//   - A rank that receives a notice while it waits aborts too and sends a notice saying so.
//   - Each aborting rank then collects the other ranks' notices until every rank has sent one
//     or a grace period has passed (mpi::Watchdog::grace_seconds of the timeout), and throws
//     Error(Communication, "NCCL communicator aborted: rank r: reason; ...") listing the
//     ranks that found a cause themselves, in rank order. Every rank that answers within the
//     grace has heard the same causes, so it throws the same message; a rank that comes back
//     later (it was busy outside shardopt) finds the notices waiting and throws it too.
//   - Every later call throws that Error again, without communicating.
#include "shardopt/nccl_comm.hpp"

#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <deque>
#include <map>
#include <set>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "comm/mpi_util.hpp"
#include "comm/mpi_watchdog.hpp"
#include "cuda_check.hpp"
#include "cuda_ops.hpp"
#include "host_wait.hpp"

namespace shardopt {
namespace {

using Clock = std::chrono::steady_clock;

double since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

ncclDataType_t int_type(IntOp op) { return op == IntOp::SumI64 ? ncclInt64 : ncclUint8; }
ncclRedOp_t int_op(IntOp op) { return op == IntOp::SumI64 ? ncclSum : ncclMax; }

ncclDataType_t nccl_type(CommType t) {
  switch (t) {
    case CommType::F32: return ncclFloat32;
    case CommType::F64: return ncclFloat64;
    case CommType::U16: return ncclBfloat16;  // the bf16 replica; all-gather only moves bits
    case CommType::BF16: return ncclBfloat16;
    case CommType::U8: return ncclUint8;
  }
  return ncclUint8;
}

std::string seconds_text(double s) {
  std::string t = std::to_string(s);
  t.erase(t.find_last_not_of('0') + 1);
  if (!t.empty() && t.back() == '.') t.pop_back();
  return t;
}

/// A collective on the communication stream: its end event, when it was started, and its
/// number in this communicator's collectives (the same on every rank).
struct Pending {
  Pending(const char* name, std::uint64_t number) : what(name), seq(number) {
    SHARDOPT_CUDA_CHECK(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
  }
  ~Pending() { cudaEventDestroy(done); }
  Pending(const Pending&) = delete;
  Pending& operator=(const Pending&) = delete;
  cudaEvent_t done = nullptr;
  Clock::time_point start = Clock::now();
  const char* what;
  std::uint64_t seq;
};

/// What an aborting rank tells the others.
struct Notice {
  std::uint64_t token;  ///< the communicator's (drawn by rank 0 at set-up): stale ones are dropped
  std::int32_t own;     ///< 1: the sender found the cause itself; 0: it followed a notice
  char reason[500];
};
constexpr int kNoticeTag = 32700;  // <= 32767, the least MPI_TAG_UB; no other traffic here

class NcclCommunicator;

class NcclRequest final : public CommRequest {
 public:
  NcclRequest(NcclCommunicator* comm, std::shared_ptr<Pending> p)
      : comm_(comm), pending_(std::move(p)) {}
  bool test() override;
  void wait() override;

 private:
  NcclCommunicator* comm_;
  std::shared_ptr<Pending> pending_;
};

class NcclCommunicator final : public Communicator, public dev::Watchdog {
 public:
  NcclCommunicator(MPI_Comm parent, cudaStream_t compute)
      : dog_(std::make_shared<mpi::Watchdog>()),
        host_(mpi::make_plain_communicator(parent, 1, dog_)),
        compute_(compute) {
    // Local setup steps run through collective(): a failure on one rank is the same error on
    // every rank before the next collective.
    collective(*host_, "make_nccl_communicator", [&] {
      int devices = 0;
      SHARDOPT_CUDA_CHECK(cudaGetDeviceCount(&devices));
      require(devices > 0, Status::Cuda, "make_nccl_communicator: no CUDA device");
      int device = 0;
      SHARDOPT_CUDA_CHECK(cudaGetDevice(&device));
      SHARDOPT_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
      SHARDOPT_CUDA_CHECK(cudaEventCreateWithFlags(&before_, cudaEventDisableTiming));
    });
    SHARDOPT_MPI(MPI_Comm_dup(parent, &notices_));
    SHARDOPT_MPI(MPI_Comm_set_errhandler(notices_, MPI_ERRORS_RETURN));
    struct {
      ncclUniqueId id;
      std::uint64_t token;
    } setup{};
    collective(*host_, "make_nccl_communicator", [&] {
      if (host_->rank() != 0) return;
      nccl("ncclGetUniqueId", ncclGetUniqueId(&setup.id));
      setup.token = (std::uint64_t{std::random_device{}()} << 32) ^ std::random_device{}() ^
                    static_cast<std::uint64_t>(Clock::now().time_since_epoch().count());
    });
    host_->broadcast_bytes(&setup, sizeof setup, 0);
    token_ = setup.token;
    // From here on, the host collectives' waits watch for aborts too.
    dog_->set_interrupt([this] { check(); });
    collective(*host_, "make_nccl_communicator", [&] {
      ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
      config.blocking = 0;
      nccl("ncclCommInitRankConfig",
           ncclCommInitRankConfig(&comm_, host_->size(), setup.id, host_->rank(), &config));
    });
    ncclGetVersion(&version_);
    dev::add_watchdog(this);
  }

  ~NcclCommunicator() override {
    dev::remove_watchdog(this);
    dog_->set_interrupt(nullptr);
    if (comm_ != nullptr) {
      // Let the collectives in flight finish (as a host wait would: an asynchronous error, an
      // abort notice or the timeout ends the wait), finalize, then free; abort instead when
      // that fails.
      ncclResult_t rc = ncclSuccess;
      try {
        while (!outstanding_.empty()) {
          check();
          if (!outstanding_.empty())
            std::this_thread::sleep_for(std::chrono::duration<double>(mpi::Watchdog::kMaxSleepSeconds));
        }
      } catch (...) {  // aborted: comm_ is null now
        rc = ncclInternalError;
      }
      if (comm_ != nullptr) rc = ncclCommFinalize(comm_);
      if (rc == ncclInProgress) rc = settled(Clock::now(), /*watch_notices=*/false);
      if (comm_ != nullptr && rc == ncclSuccess) {
        ncclCommDestroy(comm_);
      } else if (comm_ != nullptr) {
        ncclCommAbort(comm_);
      }
    }
    if (scratch_ != nullptr) cudaFree(scratch_);
    if (combine_ != nullptr) cudaFree(combine_);
    if (before_ != nullptr) cudaEventDestroy(before_);
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
    close_notices();
  }

  int rank() const override { return host_->rank(); }
  int size() const override { return host_->size(); }
  std::string name() const override {
    return "nccl " + std::to_string(version_ / 10000) + "." +
           std::to_string(version_ / 100 % 100) + "." + std::to_string(version_ % 100);
  }
  bool device_buffers() const override { return true; }
  void* device_stream() const override { return compute_; }
  /// One timeout for both sides: NCCL's collectives (the communicator is aborted, an Error
  /// thrown) and the host-side MPI collectives (the MPI watchdog: the job is aborted).
  void set_collective_timeout(double seconds) override {
    const std::lock_guard<std::recursive_mutex> lock(mutex_);
    timeout_ = seconds;
    host_->set_collective_timeout(seconds);
  }

  void all_reduce_sum(void* buf, std::size_t count, CommType type) override {
    require(type == CommType::F32 || type == CommType::F64, Status::InvalidArgument,
            "all_reduce_sum: NCCL sums fp32 or fp64 only");
    const std::shared_ptr<Pending> p = enqueue("ncclAllReduce", [&] {
      nccl("ncclAllReduce", ncclAllReduce(buf, buf, count, nccl_type(type), ncclSum, comm_, stream_));
    });
    dev::host_wait(p->done);
  }

  // The integer reductions of reproducible mode's two-phase method, on device buffers:
  // ncclInt64 sums and ncclUint8 maxima are exact in any order NCCL chooses.
  void all_reduce_int(void* buf, std::size_t count, IntOp op) override {
    const std::shared_ptr<Pending> p = enqueue("ncclAllReduce (integer)", [&] {
      nccl("ncclAllReduce", ncclAllReduce(buf, buf, count, int_type(op), int_op(op), comm_, stream_));
    });
    dev::host_wait(p->done);
  }
  void reduce_scatter_int(void* buf, std::size_t count, IntOp op) override {
    char* b = static_cast<char*>(buf);
    const std::size_t own = static_cast<std::size_t>(rank()) * count * (op == IntOp::SumI64 ? 8 : 1);
    const std::shared_ptr<Pending> p = enqueue("ncclReduceScatter (integer)", [&] {
      nccl("ncclReduceScatter",
           ncclReduceScatter(b, b + own, count, int_type(op), int_op(op), comm_, stream_));
    });
    dev::host_wait(p->done);
  }

  // In place, NCCL's convention: the result lands at block rank() of buf.
  std::unique_ptr<CommRequest> start_reduce_scatter_sum(float* buf, std::size_t count,
                                                        CommType wire) override {
    require(wire == CommType::F32 || wire == CommType::BF16, Status::InvalidArgument,
            "reduce_scatter: wire F32 or BF16");
    const std::size_t own = static_cast<std::size_t>(rank()) * count;
    return request(enqueue("ncclReduceScatter", [&] {
      if (wire == CommType::BF16) {
        // Reduce bf16 copies in a scratch buffer, then widen this rank's block in place.
        const std::size_t total = count * static_cast<std::size_t>(size());
        bf16* tmp = scratch_bf16(total);
        dev::cast_f32_to_bf16(stream_, buf, tmp, total);
        nccl("ncclReduceScatter",
             ncclReduceScatter(tmp, tmp + own, count, ncclBfloat16, ncclSum, comm_, stream_));
        dev::cast_bf16_to_f32(stream_, tmp + own, buf + own, count);
      } else {
        nccl("ncclReduceScatter",
             ncclReduceScatter(buf, buf + own, count, ncclFloat32, ncclSum, comm_, stream_));
      }
    }));
  }

  std::unique_ptr<CommRequest> start_all_reduce_sum(float* buf, std::size_t count,
                                                    CommType wire) override {
    require(wire == CommType::F32 || wire == CommType::BF16, Status::InvalidArgument,
            "all_reduce: wire F32 or BF16");
    return request(enqueue("ncclAllReduce", [&] {
      if (wire == CommType::BF16) {
        bf16* tmp = scratch_bf16(count);
        dev::cast_f32_to_bf16(stream_, buf, tmp, count);
        nccl("ncclAllReduce", ncclAllReduce(tmp, tmp, count, ncclBfloat16, ncclSum, comm_, stream_));
        dev::cast_bf16_to_f32(stream_, tmp, buf, count);
      } else {
        nccl("ncclAllReduce", ncclAllReduce(buf, buf, count, ncclFloat32, ncclSum, comm_, stream_));
      }
    }));
  }

  std::unique_ptr<CommRequest> start_all_gather(void* buf, std::size_t count,
                                                CommType type) override {
    char* own =
        static_cast<char*>(buf) + static_cast<std::size_t>(rank()) * count * mpi::type_size(type);
    return request(enqueue("ncclAllGather", [&] {
      nccl("ncclAllGather", ncclAllGather(own, buf, count, nccl_type(type), comm_, stream_));
    }));
  }

  // The uneven forms (whole-tensor ownership): one ncclReduce to each rank that owns
  // elements, or one ncclBroadcast from each, all in one ncclGroupStart/End (NCCL runs a
  // group as one launch); a rank with a zero count takes no part as an owner, and a bucket
  // of one owner is one reduce and one broadcast of its bytes. In place: the owner's block
  // of buf is the send and the receive buffer on every rank (NCCL reads a broadcast's send
  // buffer on the root only and writes a reduce's receive buffer on the root only).
  std::unique_ptr<CommRequest> start_reduce_scatter_sum_v(float* buf,
                                                          std::span<const std::size_t> counts,
                                                          CommType wire) override {
    const std::vector<std::size_t> off = uneven_offsets(counts, size(), "reduce_scatter_sum_v");
    require(wire == CommType::F32 || wire == CommType::BF16, Status::InvalidArgument,
            "reduce_scatter_sum_v: wire F32 or BF16");
    if (off.back() == 0) return completed_request();
    const std::size_t me = static_cast<std::size_t>(rank());
    return request(enqueue("ncclReduce (uneven reduce-scatter)", [&] {
      if (wire == CommType::BF16) {
        // Reduce bf16 copies in a scratch buffer, then widen this rank's block in place.
        bf16* tmp = scratch_bf16(off.back());
        dev::cast_f32_to_bf16(stream_, buf, tmp, off.back());
        grouped(counts, "ncclReduce", [&](int r, std::size_t begin, std::size_t n) {
          return ncclReduce(tmp + begin, tmp + begin, n, ncclBfloat16, ncclSum, r, comm_, stream_);
        }, off);
        dev::cast_bf16_to_f32(stream_, tmp + off[me], buf + off[me], counts[me]);
      } else {
        grouped(counts, "ncclReduce", [&](int r, std::size_t begin, std::size_t n) {
          return ncclReduce(buf + begin, buf + begin, n, ncclFloat32, ncclSum, r, comm_, stream_);
        }, off);
      }
    }));
  }

  std::unique_ptr<CommRequest> start_all_gather_v(void* buf, std::span<const std::size_t> counts,
                                                  CommType type) override {
    const std::vector<std::size_t> off = uneven_offsets(counts, size(), "all_gather_v");
    require(type == CommType::F32 || type == CommType::U16, Status::InvalidArgument,
            "all_gather_v: type F32 or U16");
    if (off.back() == 0) return completed_request();
    char* base = static_cast<char*>(buf);
    const std::size_t elem = mpi::type_size(type);
    return request(enqueue("ncclBroadcast (uneven all-gather)", [&] {
      grouped(counts, "ncclBroadcast", [&](int r, std::size_t begin, std::size_t n) {
        char* block = base + begin * elem;
        return ncclBroadcast(block, block, n, nccl_type(type), r, comm_, stream_);
      }, off);
    }));
  }

  // Reproducible mode's exchanges of raw values and packed states (ExactGrads::reduce_direct,
  // reduce_packed; Communicator::reduce_scatter_combine). Per chunk of at most
  // kCombineBytes received bytes: one NCCL group of ncclSend/ncclRecv pairs (block r's chunk
  // to rank r, rank r's chunk of this rank's block into the receive buffer; this rank's own
  // chunk by a device copy), a watched host wait for it, then `op` combines the chunk on the
  // compute stream, reading the received blocks one stride apart (Backend::exact_combine).
  // The next chunk's exchange is queued after the compute stream's work (enqueue), so the
  // buffer is reused safely. In place (out == in): a chunk's result overwrites only this
  // rank's block at offsets already received.
  bool reduce_scatter_combine(const void* in, std::size_t elem_bytes, float* out, std::size_t count,
                              BlockCombiner& op) override {
    constexpr std::size_t kCombineBytes = std::size_t{64} << 20;
    if (count == 0) return true;
    const std::size_t ranks = static_cast<std::size_t>(size());
    const std::size_t me = static_cast<std::size_t>(rank());
    const std::size_t chunk = std::max<std::size_t>(1, kCombineBytes / elem_bytes / ranks);
    char* recv = combine_buffer(std::min(chunk, count) * ranks * elem_bytes);
    const char* src = static_cast<const char*>(in);
    float* own = out + me * count;
    std::vector<const void*> blocks(ranks);
    for (std::size_t c0 = 0; c0 < count; c0 += chunk) {
      const std::size_t k = std::min(chunk, count - c0);
      const std::size_t bytes = k * elem_bytes;
      for (std::size_t r = 0; r < ranks; ++r) blocks[r] = recv + r * bytes;
      const std::shared_ptr<Pending> p = enqueue("ncclSend/ncclRecv (exact exchange)", [&] {
        const auto block = [&](std::size_t r) { return src + (r * count + c0) * elem_bytes; };
        SHARDOPT_CUDA_CHECK(cudaMemcpyAsync(recv + me * bytes, block(me), bytes, cudaMemcpyDeviceToDevice, stream_));
        if (ranks == 1) return;
        nccl("ncclGroupStart", ncclGroupStart());
        ncclResult_t first = ncclSuccess;
        const auto keep = [&](ncclResult_t rc) {
          if (first == ncclSuccess && rc != ncclSuccess && rc != ncclInProgress) first = rc;
        };
        for (std::size_t r = 0; r < ranks; ++r) {
          if (r == me) continue;
          const int peer = static_cast<int>(r);
          keep(ncclSend(block(r), bytes, ncclUint8, peer, comm_, stream_));
          keep(ncclRecv(recv + r * bytes, bytes, ncclUint8, peer, comm_, stream_));
        }
        nccl("ncclGroupEnd", ncclGroupEnd());
        nccl("ncclSend/ncclRecv", first);
      });
      SHARDOPT_CUDA_CHECK(cudaStreamWaitEvent(compute(), p->done, 0));
      dev::host_wait(p->done);
      op.combine(own + c0, blocks.data(), size(), k);
    }
    return true;
  }

  // Host collectives refuse to run after an abort too: a rank that has seen the abort must
  // not wait in MPI for ranks that threw. While they wait, they watch for aborts (check()).
  void all_reduce_sum_host(double* buf, std::size_t count) override {
    usable();
    host_->all_reduce_sum_host(buf, count);
  }
  void all_gather_bytes(const void* send, void* recv, std::size_t bytes) override {
    usable();
    host_->all_gather_bytes(send, recv, bytes);
  }
  void broadcast_bytes(void* buf, std::size_t bytes, int root) override {
    usable();
    host_->broadcast_bytes(buf, bytes, root);
  }
  void barrier() override {
    usable();
    host_->barrier();
  }

  // ---- watchdog ------------------------------------------------------------------------------

  void check() override {
    const std::lock_guard<std::recursive_mutex> lock(mutex_);
    usable();
    if (comm_ == nullptr) return;  // still setting up
    ncclResult_t state = ncclSuccess;
    ncclCommGetAsyncError(comm_, &state);
    if (state != ncclSuccess && state != ncclInProgress)
      abort_with(std::string("asynchronous error: ") + ncclGetErrorString(state));
    while (!outstanding_.empty()) {
      const cudaError_t rc = cudaEventQuery(outstanding_.front()->done);
      if (rc == cudaErrorNotReady) break;
      SHARDOPT_CUDA_CHECK(rc);
      outstanding_.pop_front();
    }
    if (!outstanding_.empty() && expired(outstanding_.front()->start)) {
      const Pending& p = *outstanding_.front();
      abort_with(std::string(p.what) + " (collective #" + std::to_string(p.seq) +
                 ") did not complete within " + seconds_text(timeout_) +
                 " s (collective timeout; a rank may have died or stopped calling collectives)");
    }
  }

  /// Throws the abort's Error once the communicator has been aborted, here or (a notice
  /// waiting) on another rank. Queries no device work: every call makes it.
  void usable() {
    const std::lock_guard<std::recursive_mutex> lock(mutex_);
    if (!aborted_.empty()) throw Error(Status::Communication, aborted_);
    receive_notices();
    if (!heard_.empty()) abort_with({}, /*own=*/false);
  }
  cudaStream_t compute() const { return compute_ != nullptr ? compute_ : cudaStreamLegacy; }

 private:
  bool expired(Clock::time_point t) const { return timeout_ > 0 && since(t) > timeout_; }

  /// Polls a non-blocking call to its end; returns the communicator's final state, or
  /// ncclInProgress when the timeout ran out first. Watches for other ranks' aborts.
  ncclResult_t settled(Clock::time_point start, bool watch_notices = true) {
    for (unsigned spin = 0;; ++spin) {
      ncclResult_t state = ncclSuccess;
      const ncclResult_t rc = ncclCommGetAsyncError(comm_, &state);
      if (rc != ncclSuccess) return rc;
      if (state != ncclInProgress) return state;
      if (expired(start)) return ncclInProgress;
      if (watch_notices) {
        usable();
      }
      if (spin < 64) {
        std::this_thread::yield();
      } else {
        std::this_thread::sleep_for(std::chrono::microseconds(50));
      }
    }
  }

  /// Checks an NCCL call; ncclInProgress (non-blocking communicator) is polled to its end.
  void nccl(const char* call, ncclResult_t rc) {
    if (rc == ncclInProgress) {
      rc = settled(Clock::now());
      if (rc == ncclInProgress)
        abort_with(std::string(call) +
                   (*CallScope::current() != '\0' ? std::string(" in ") + CallScope::current() : "") +
                   " did not complete within " + seconds_text(timeout_) +
                   " s (collective timeout; a rank may have died or stopped calling collectives)");
      if (rc != ncclSuccess)
        abort_with(std::string(call) + " failed asynchronously: " + ncclGetErrorString(rc));
      return;
    }
    if (rc == ncclSuccess) return;
    if (comm_ != nullptr) {  // a failure that broke the communicator: abort it
      ncclResult_t state = ncclSuccess;
      ncclCommGetAsyncError(comm_, &state);
      if (state != ncclSuccess && state != ncclInProgress)
        abort_with(std::string("asynchronous error: ") + ncclGetErrorString(state));
    }
    std::string msg = std::string(call) + " failed: " + ncclGetErrorString(rc);
    const char* detail = ncclGetLastError(comm_);
    if (detail != nullptr && *detail != '\0') msg += std::string(" (") + detail + ")";
    throw Error(Status::Communication, msg);
  }

  /// One call(owner, offset, count) per rank with a non-zero count, inside one NCCL group.
  /// The calls' results are checked after ncclGroupEnd (a failure inside a group must not
  /// abort the communicator before the group is closed).
  template <class F>
  void grouped(std::span<const std::size_t> counts, const char* call, F&& each,
               const std::vector<std::size_t>& off) {
    nccl("ncclGroupStart", ncclGroupStart());
    ncclResult_t first = ncclSuccess;
    for (int r = 0; r < size(); ++r) {
      const std::size_t n = counts[static_cast<std::size_t>(r)];
      if (n == 0) continue;
      const ncclResult_t rc = each(r, off[static_cast<std::size_t>(r)], n);
      if (first == ncclSuccess && rc != ncclSuccess && rc != ncclInProgress) first = rc;
    }
    nccl("ncclGroupEnd", ncclGroupEnd());
    nccl(call, first);
  }

  // ---- abort ---------------------------------------------------------------------------------

  /// Aborts NCCL, tells the other ranks, collects their notices and throws the agreed Error.
  /// `own`: this rank found `cause`; otherwise it follows the notices in heard_.
  [[noreturn]] void abort_with(const std::string& cause, bool own = true) {
    if (comm_ != nullptr) ncclCommAbort(comm_);
    comm_ = nullptr;
    outstanding_.clear();
    dev::remove_watchdog(this);
    if (own) causes_[rank()] = cause;
    send_notice(own, cause);
    // Collect until every other rank has sent its notice, or for the grace period.
    const Clock::time_point start = Clock::now();
    const double grace = mpi::Watchdog::grace_seconds(timeout_);
    for (;;) {
      receive_notices();
      if (static_cast<int>(heard_.size()) >= size() - 1 || since(start) > grace) break;
      std::this_thread::sleep_for(std::chrono::duration<double>(mpi::Watchdog::kMaxSleepSeconds));
    }
    std::string list;
    for (const auto& [r, why] : causes_)
      list += (list.empty() ? "rank " : "; rank ") + std::to_string(r) + ": " + why;
    aborted_ = "NCCL communicator aborted: " +
               (list.empty() ? std::string("another rank aborted (its notice did not arrive)") : list);
    throw Error(Status::Communication, aborted_);
  }

  void send_notice(bool own, const std::string& cause) {
    auto n = std::make_unique<Notice>();
    n->token = token_;
    n->own = own ? 1 : 0;
    const std::size_t len = std::min(cause.size(), sizeof n->reason - 1);
    std::memcpy(n->reason, cause.data(), len);
    n->reason[len] = '\0';
    for (int r = 0; r < size(); ++r) {
      if (r == rank()) continue;
      MPI_Request req = MPI_REQUEST_NULL;
      if (MPI_Isend(n.get(), sizeof(Notice), MPI_BYTE, r, kNoticeTag, notices_, &req) ==
          MPI_SUCCESS)
        sends_.push_back(req);
    }
    notices_sent_.push_back(std::move(n));
  }

  /// Takes every notice that has arrived; records the causes.
  void receive_notices() {
    if (notices_ == MPI_COMM_NULL) return;
    for (;;) {
      int flag = 0;
      MPI_Status st;
      if (MPI_Iprobe(MPI_ANY_SOURCE, kNoticeTag, notices_, &flag, &st) != MPI_SUCCESS || !flag)
        return;
      Notice n{};
      if (MPI_Recv(&n, sizeof n, MPI_BYTE, st.MPI_SOURCE, kNoticeTag, notices_,
                   MPI_STATUS_IGNORE) != MPI_SUCCESS)
        return;
      if (n.token != token_) continue;  // for an earlier communicator on a recycled context
      heard_.insert(st.MPI_SOURCE);
      n.reason[sizeof n.reason - 1] = '\0';
      if (n.own) causes_[st.MPI_SOURCE] = n.reason;
    }
  }

  void close_notices() {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (finalized || notices_ == MPI_COMM_NULL) return;
    receive_notices();
    // Notices are small: they have normally been sent already. Any still going keep their
    // buffer (leaked on purpose) until MPI is done with it.
    for (MPI_Request& r : sends_) {
      int done = 0;
      MPI_Test(&r, &done, MPI_STATUS_IGNORE);
      if (!done) {
        MPI_Request_free(&r);
        for (auto& n : notices_sent_) n.release();
      }
    }
    MPI_Comm_free(&notices_);
  }

  /// Enqueues a collective on stream_ after the compute stream's work so far.
  template <class F>
  std::shared_ptr<Pending> enqueue(const char* what, F&& enqueue_calls) {
    const std::lock_guard<std::recursive_mutex> lock(mutex_);
    usable();
    SHARDOPT_CUDA_CHECK(cudaEventRecord(before_, compute()));
    SHARDOPT_CUDA_CHECK(cudaStreamWaitEvent(stream_, before_, 0));
    auto p = std::make_shared<Pending>(what, next_seq_++);
    enqueue_calls();
    SHARDOPT_CUDA_CHECK(cudaEventRecord(p->done, stream_));
    outstanding_.push_back(p);
    return p;
  }
  std::unique_ptr<CommRequest> request(std::shared_ptr<Pending> p) {
    return std::make_unique<NcclRequest>(this, std::move(p));
  }

  // A reused device buffer for the bf16 wire, grown on demand.
  bf16* scratch_bf16(std::size_t n) {
    if (n > scratch_elems_) {
      if (scratch_ != nullptr) {
        dev::host_wait(stream_);  // the old buffer may still be in use
        SHARDOPT_CUDA_CHECK(cudaFree(scratch_));
        scratch_ = nullptr;
      }
      SHARDOPT_CUDA_CHECK(cudaMalloc(&scratch_, n * sizeof(bf16)));
      scratch_elems_ = n;
    }
    return static_cast<bf16*>(scratch_);
  }

  // The exchanges' receive buffer (reduce_scatter_combine), grown on demand.
  char* combine_buffer(std::size_t bytes) {
    if (bytes > combine_bytes_) {
      if (combine_ != nullptr) {
        dev::host_wait(compute());  // the old buffer may still be read by a combine
        SHARDOPT_CUDA_CHECK(cudaFree(combine_));
        combine_ = nullptr;
      }
      SHARDOPT_CUDA_CHECK(cudaMalloc(&combine_, bytes));
      combine_bytes_ = bytes;
    }
    return static_cast<char*>(combine_);
  }

  std::shared_ptr<mpi::Watchdog> dog_;  // the host side's: timeout, and check() while it waits
  std::shared_ptr<Communicator> host_;  // plain MPI, for metadata and the bootstrap
  cudaStream_t compute_ = nullptr;      // the trainer's (nullptr: legacy default stream)
  cudaStream_t stream_ = nullptr;       // ours: the collectives
  double timeout_ = 0.0;                // set_collective_timeout; 0: none
  cudaEvent_t before_ = nullptr;
  void* scratch_ = nullptr;
  std::size_t scratch_elems_ = 0;
  void* combine_ = nullptr;
  std::size_t combine_bytes_ = 0;
  ncclComm_t comm_ = nullptr;
  int version_ = 0;
  std::uint64_t next_seq_ = 0;
  std::recursive_mutex mutex_;
  std::deque<std::shared_ptr<Pending>> outstanding_;
  // Aborts: the notice channel, what this rank has heard, and the agreed message.
  MPI_Comm notices_ = MPI_COMM_NULL;
  std::uint64_t token_ = 0;
  std::set<int> heard_;
  std::map<int, std::string> causes_;
  std::vector<MPI_Request> sends_;
  std::vector<std::unique_ptr<Notice>> notices_sent_;
  std::string aborted_;
};

bool NcclRequest::test() {
  comm_->check();
  const cudaError_t rc = cudaEventQuery(pending_->done);
  if (rc == cudaErrorNotReady) return false;
  SHARDOPT_CUDA_CHECK(rc);
  return true;
}

void NcclRequest::wait() {
  comm_->usable();
  SHARDOPT_CUDA_CHECK(cudaStreamWaitEvent(comm_->compute(), pending_->done, 0));
}

}  // namespace

std::shared_ptr<Communicator> make_nccl_communicator(MPI_Comm comm, cudaStream_t compute_stream) {
  return std::make_shared<NcclCommunicator>(comm, compute_stream);
}

}  // namespace shardopt
