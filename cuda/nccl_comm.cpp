// nccl_comm.cpp: Communicator over NCCL collectives on device memory, bootstrapped from MPI.
//
// Streams: collectives run on a non-blocking stream of the communicator's own (stream_),
// after an event recorded on the compute stream; a request's wait() is a
// cudaStreamWaitEvent of the compute stream on the collective's end event. Errors: the
// NCCL communicator is non-blocking (config.blocking = 0); a call that returns
// ncclInProgress is settled by polling ncclCommGetAsyncError. The communicator is a
// dev::Watchdog: every host wait of cuda/ polls it for asynchronous errors and for a
// collective older than the timeout, and either aborts the communicator and throws.
#include "shardopt/nccl_comm.hpp"

#include <nccl.h>

#include <chrono>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <tuple>
#include <utility>

#include "cuda_check.hpp"
#include "cuda_ops.hpp"
#include "host_wait.hpp"
#include "shardopt/mpi_comm.hpp"

namespace shardopt {
namespace {

using Clock = std::chrono::steady_clock;

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

std::size_t type_size(CommType t) {
  switch (t) {
    case CommType::F32: return 4;
    case CommType::F64: return 8;
    case CommType::U16:
    case CommType::BF16: return 2;
    case CommType::U8: return 1;
  }
  return 1;
}

/// Runs a local step; returns its Error status and message instead of throwing, so every
/// rank can agree on the outcome before the next collective.
template <class F>
std::pair<Status, std::string> attempt(F&& f) {
  try {
    f();
    return {Status::Ok, {}};
  } catch (const Error& e) {
    return {e.status(), e.what()};
  }
}

std::string seconds_text(double s) {
  std::string t = std::to_string(s);
  t.erase(t.find_last_not_of('0') + 1);
  if (!t.empty() && t.back() == '.') t.pop_back();
  return t;
}

/// A collective on the communication stream: its end event and when it was started.
struct Pending {
  explicit Pending(const char* name) : what(name) {
    SHARDOPT_CUDA_CHECK(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
  }
  ~Pending() { cudaEventDestroy(done); }
  Pending(const Pending&) = delete;
  Pending& operator=(const Pending&) = delete;
  cudaEvent_t done = nullptr;
  Clock::time_point start = Clock::now();
  const char* what;
};

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
  NcclCommunicator(MPI_Comm parent, const NcclOptions& o)
      : host_(make_mpi_communicator(parent)), compute_(o.compute_stream),
        timeout_(o.timeout_seconds) {
    auto [st, msg] = attempt([&] {
      require(o.timeout_seconds >= 0, Status::InvalidArgument, "timeout_seconds is negative");
      int devices = 0;
      SHARDOPT_CUDA_CHECK(cudaGetDeviceCount(&devices));
      require(devices > 0, Status::Cuda, "no CUDA device");
      int device = 0;
      SHARDOPT_CUDA_CHECK(cudaGetDevice(&device));
      SHARDOPT_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
      SHARDOPT_CUDA_CHECK(cudaEventCreateWithFlags(&before_, cudaEventDisableTiming));
    });
    agree_or_throw(*host_, st, "make_nccl_communicator: " + msg);

    ncclUniqueId id{};
    std::tie(st, msg) = attempt([&] {
      if (host_->rank() == 0) nccl("ncclGetUniqueId", ncclGetUniqueId(&id));
    });
    agree_or_throw(*host_, st, "make_nccl_communicator: " + msg);
    host_->broadcast_bytes(&id, sizeof id, 0);
    std::tie(st, msg) = attempt([&] {
      ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
      config.blocking = 0;
      nccl("ncclCommInitRankConfig",
           ncclCommInitRankConfig(&comm_, host_->size(), id, host_->rank(), &config));
    });
    agree_or_throw(*host_, st, "make_nccl_communicator: " + msg);
    ncclGetVersion(&version_);
    dev::add_watchdog(this);
  }

  ~NcclCommunicator() override {
    dev::remove_watchdog(this);
    if (comm_ != nullptr) {
      // Finish the collectives in flight, then free; abort instead if that does not end.
      ncclResult_t rc = ncclCommFinalize(comm_);
      if (rc == ncclInProgress) rc = settled(Clock::now());
      if (rc == ncclSuccess) {
        ncclCommDestroy(comm_);
      } else {
        ncclCommAbort(comm_);
      }
    }
    if (scratch_ != nullptr) cudaFree(scratch_);
    if (before_ != nullptr) cudaEventDestroy(before_);
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

  int rank() const override { return host_->rank(); }
  int size() const override { return host_->size(); }
  std::string name() const override {
    return "nccl " + std::to_string(version_ / 10000) + "." +
           std::to_string(version_ / 100 % 100) + "." + std::to_string(version_ % 100);
  }
  bool device_buffers() const override { return true; }
  void* device_stream() const override { return compute_; }

  void all_reduce_sum(void* buf, std::size_t count, CommType type) override {
    require(type == CommType::F32 || type == CommType::F64, Status::InvalidArgument,
            "all_reduce_sum: NCCL sums fp32 or fp64 only");
    const std::shared_ptr<Pending> p = collective("ncclAllReduce", [&] {
      nccl("ncclAllReduce", ncclAllReduce(buf, buf, count, nccl_type(type), ncclSum, comm_, stream_));
    });
    dev::host_wait(p->done);
  }

  // In place, NCCL's convention: the result lands at block rank() of buf.
  std::unique_ptr<CommRequest> start_reduce_scatter_sum(float* buf, std::size_t count,
                                                        CommType wire) override {
    require(wire == CommType::F32 || wire == CommType::BF16, Status::InvalidArgument,
            "reduce_scatter: wire F32 or BF16");
    const std::size_t own = static_cast<std::size_t>(rank()) * count;
    return request(collective("ncclReduceScatter", [&] {
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
    return request(collective("ncclAllReduce", [&] {
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
    char* own = static_cast<char*>(buf) + static_cast<std::size_t>(rank()) * count * type_size(type);
    return request(collective("ncclAllGather", [&] {
      nccl("ncclAllGather", ncclAllGather(own, buf, count, nccl_type(type), comm_, stream_));
    }));
  }

  // Host collectives refuse to run after an abort too: a rank that has seen the abort must
  // not wait in MPI for ranks that threw.
  void all_reduce_sum_host(double* buf, std::size_t count) override {
    require_usable();
    host_->all_reduce_sum_host(buf, count);
  }
  void all_gather_bytes(const void* send, void* recv, std::size_t bytes) override {
    require_usable();
    host_->all_gather_bytes(send, recv, bytes);
  }
  void broadcast_bytes(void* buf, std::size_t bytes, int root) override {
    require_usable();
    host_->broadcast_bytes(buf, bytes, root);
  }
  void barrier() override {
    require_usable();
    host_->barrier();
  }

  // ---- watchdog ------------------------------------------------------------------------------

  void check() override {
    const std::lock_guard<std::recursive_mutex> lock(mutex_);
    if (comm_ == nullptr) return;
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
    if (!outstanding_.empty() && expired(outstanding_.front()->start))
      abort_with(std::string(outstanding_.front()->what) + " did not complete within " +
                 seconds_text(timeout_) +
                 " s (a rank may have died or stopped calling collectives)");
  }

  /// Throws the abort's error once the communicator has been aborted.
  void require_usable() const {
    if (!aborted_.empty()) throw Error(Status::Communication, aborted_);
  }
  cudaStream_t compute() const { return compute_ != nullptr ? compute_ : cudaStreamLegacy; }

 private:
  bool expired(Clock::time_point since) const {
    return timeout_ > 0 &&
           std::chrono::duration<double>(Clock::now() - since).count() > timeout_;
  }

  /// Polls a non-blocking call to its end; returns the communicator's final state, or
  /// ncclInProgress when the timeout ran out first.
  ncclResult_t settled(Clock::time_point since) {
    for (unsigned spin = 0;; ++spin) {
      ncclResult_t state = ncclSuccess;
      const ncclResult_t rc = ncclCommGetAsyncError(comm_, &state);
      if (rc != ncclSuccess) return rc;
      if (state != ncclInProgress) return state;
      if (expired(since)) return ncclInProgress;
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
        abort_with(std::string(call) + " did not complete within " + seconds_text(timeout_) +
                   " s (a rank may have died or stopped calling collectives)");
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

  [[noreturn]] void abort_with(const std::string& why) {
    aborted_ = "NCCL communicator aborted: " + why;
    if (comm_ != nullptr) ncclCommAbort(comm_);
    comm_ = nullptr;
    outstanding_.clear();
    dev::remove_watchdog(this);
    throw Error(Status::Communication, aborted_);
  }

  /// Enqueues a collective on stream_ after the compute stream's work so far.
  template <class F>
  std::shared_ptr<Pending> collective(const char* what, F&& enqueue) {
    const std::lock_guard<std::recursive_mutex> lock(mutex_);
    require_usable();
    SHARDOPT_CUDA_CHECK(cudaEventRecord(before_, compute()));
    SHARDOPT_CUDA_CHECK(cudaStreamWaitEvent(stream_, before_, 0));
    auto p = std::make_shared<Pending>(what);
    enqueue();
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

  std::shared_ptr<Communicator> host_;  // MPI, for metadata and the bootstrap
  cudaStream_t compute_ = nullptr;      // the trainer's (nullptr: legacy default stream)
  cudaStream_t stream_ = nullptr;       // ours: the collectives
  double timeout_;
  cudaEvent_t before_ = nullptr;
  void* scratch_ = nullptr;
  std::size_t scratch_elems_ = 0;
  ncclComm_t comm_ = nullptr;
  int version_ = 0;
  std::recursive_mutex mutex_;
  std::deque<std::shared_ptr<Pending>> outstanding_;
  std::string aborted_;
};

bool NcclRequest::test() {
  comm_->require_usable();
  comm_->check();
  const cudaError_t rc = cudaEventQuery(pending_->done);
  if (rc == cudaErrorNotReady) return false;
  SHARDOPT_CUDA_CHECK(rc);
  return true;
}

void NcclRequest::wait() {
  comm_->require_usable();
  SHARDOPT_CUDA_CHECK(cudaStreamWaitEvent(comm_->compute(), pending_->done, 0));
}

}  // namespace

std::shared_ptr<Communicator> make_nccl_communicator(MPI_Comm comm, const NcclOptions& options) {
  return std::make_shared<NcclCommunicator>(comm, options);
}

std::shared_ptr<Communicator> make_nccl_communicator(MPI_Comm comm, cudaStream_t compute_stream) {
  NcclOptions o;
  o.compute_stream = compute_stream;
  return make_nccl_communicator(comm, o);
}

}  // namespace shardopt
