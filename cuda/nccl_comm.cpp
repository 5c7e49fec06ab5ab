// nccl_comm.cpp: Communicator over NCCL collectives on device memory, bootstrapped from MPI.
#include "shardopt/nccl_comm.hpp"

#include <nccl.h>

#include <algorithm>
#include <span>
#include <string>
#include <vector>
#include <utility>

#include "cuda_check.hpp"
#include "shardopt/mpi_comm.hpp"
#include "cuda_ops.hpp"

namespace shardopt {
namespace {

void check_nccl(ncclResult_t rc, const char* call, ncclComm_t comm) {
  if (rc == ncclSuccess) return;
  std::string msg = std::string(call) + " failed: " + ncclGetErrorString(rc);
  const char* detail = ncclGetLastError(comm);
  if (detail != nullptr && *detail != '\0') msg += std::string(" (") + detail + ")";
  throw Error(Status::Communication, msg);
}
#define SHARDOPT_NCCL(call) check_nccl((call), #call, comm_)

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

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(MPI_Comm parent, cudaStream_t stream)
      : host_(make_mpi_communicator(parent)), stream_(stream) {
    // Local setup steps run through collective(): a failure on one rank is the same error on
    // every rank before the next collective.
    collective(*host_, "make_nccl_communicator", [&] {
      int devices = 0;
      SHARDOPT_CUDA_CHECK(cudaGetDeviceCount(&devices));
      require(devices > 0, Status::Cuda, "make_nccl_communicator: no CUDA device");
      int device = 0;
      SHARDOPT_CUDA_CHECK(cudaGetDevice(&device));
    });
    ncclUniqueId id{};
    collective(*host_, "make_nccl_communicator", [&] {
      if (host_->rank() == 0) SHARDOPT_NCCL(ncclGetUniqueId(&id));
    });
    host_->broadcast_bytes(&id, sizeof id, 0);
    SHARDOPT_NCCL(ncclCommInitRank(&comm_, host_->size(), id, host_->rank()));
    ncclGetVersion(&version_);
    if (stream_ != nullptr) {
      SHARDOPT_CUDA_CHECK(cudaEventCreateWithFlags(&before_, cudaEventDisableTiming));
      SHARDOPT_CUDA_CHECK(cudaEventCreateWithFlags(&after_, cudaEventDisableTiming));
    }
  }

  ~NcclCommunicator() override {
    if (scratch_ != nullptr) cudaFreeAsync(scratch_, stream());
    if (comm_ != nullptr) ncclCommDestroy(comm_);
    if (before_ != nullptr) cudaEventDestroy(before_);
    if (after_ != nullptr) cudaEventDestroy(after_);
  }

  int rank() const override { return host_->rank(); }
  int size() const override { return host_->size(); }
  std::string name() const override {
    return "nccl " + std::to_string(version_ / 10000) + "." +
           std::to_string(version_ / 100 % 100) + "." + std::to_string(version_ % 100);
  }
  bool device_buffers() const override { return true; }
  /// Covers the host-side MPI collectives; NCCL's own collectives run on the stream and are
  /// not timed.
  void set_collective_timeout(double seconds) override { host_->set_collective_timeout(seconds); }

  void all_reduce_sum(void* buf, std::size_t count, CommType type) override {
    require(type == CommType::F32 || type == CommType::F64, Status::InvalidArgument,
            "all_reduce_sum: NCCL sums fp32 or fp64 only");
    enter();
    SHARDOPT_NCCL(ncclAllReduce(buf, buf, count, nccl_type(type), ncclSum, comm_, stream_));
    leave();
  }

  // NCCL collectives are stream-ordered: once enqueued, later work on the stream sees their
  // results, so the requests returned here are complete from the host's point of view.

  // In place, NCCL's convention: the result lands at block rank() of buf.
  std::unique_ptr<CommRequest> start_reduce_scatter_sum(float* buf, std::size_t count,
                                                        CommType wire) override {
    require(wire == CommType::F32 || wire == CommType::BF16, Status::InvalidArgument,
            "reduce_scatter: wire F32 or BF16");
    const std::size_t own = static_cast<std::size_t>(rank()) * count;
    enter();
    if (wire == CommType::BF16) {
      // Reduce bf16 copies in a scratch buffer, then widen this rank's block in place.
      const std::size_t total = count * static_cast<std::size_t>(size());
      bf16* tmp = scratch_bf16(total);
      dev::cast_f32_to_bf16(stream(), buf, tmp, total);
      SHARDOPT_NCCL(ncclReduceScatter(tmp, tmp + own, count, ncclBfloat16, ncclSum, comm_, stream_));
      dev::cast_bf16_to_f32(stream(), tmp + own, buf + own, count);
    } else {
      SHARDOPT_NCCL(ncclReduceScatter(buf, buf + own, count, ncclFloat32, ncclSum, comm_, stream_));
    }
    leave();
    return completed_request();
  }

  std::unique_ptr<CommRequest> start_all_reduce_sum(float* buf, std::size_t count,
                                                    CommType wire) override {
    require(wire == CommType::F32 || wire == CommType::BF16, Status::InvalidArgument,
            "all_reduce: wire F32 or BF16");
    enter();
    if (wire == CommType::BF16) {
      bf16* tmp = scratch_bf16(count);
      dev::cast_f32_to_bf16(stream(), buf, tmp, count);
      SHARDOPT_NCCL(ncclAllReduce(tmp, tmp, count, ncclBfloat16, ncclSum, comm_, stream_));
      dev::cast_bf16_to_f32(stream(), tmp, buf, count);
    } else {
      SHARDOPT_NCCL(ncclAllReduce(buf, buf, count, ncclFloat32, ncclSum, comm_, stream_));
    }
    leave();
    return completed_request();
  }

  std::unique_ptr<CommRequest> start_all_gather(void* buf, std::size_t count,
                                                CommType type) override {
    char* own = static_cast<char*>(buf) + static_cast<std::size_t>(rank()) * count * type_size(type);
    enter();
    SHARDOPT_NCCL(ncclAllGather(own, buf, count, nccl_type(type), comm_, stream_));
    leave();
    return completed_request();
  }

  void all_reduce_sum_host(double* buf, std::size_t count) override {
    host_->all_reduce_sum_host(buf, count);
  }
  void all_gather_bytes(const void* send, void* recv, std::size_t bytes) override {
    host_->all_gather_bytes(send, recv, bytes);
  }
  void broadcast_bytes(void* buf, std::size_t bytes, int root) override {
    host_->broadcast_bytes(buf, bytes, root);
  }
  void barrier() override { host_->barrier(); }

 private:
  cudaStream_t stream() const { return stream_ != nullptr ? stream_ : cudaStreamLegacy; }

  // A reused device buffer for the bf16 wire, grown on demand (stream-ordered allocation).
  bf16* scratch_bf16(std::size_t n) {
    if (n > scratch_elems_) {
      if (scratch_ != nullptr) SHARDOPT_CUDA_CHECK(cudaFreeAsync(scratch_, stream()));
      SHARDOPT_CUDA_CHECK(cudaMallocAsync(&scratch_, n * sizeof(bf16), stream()));
      scratch_elems_ = n;
    }
    return static_cast<bf16*>(scratch_);
  }

  // Order a caller's stream against the legacy default stream (the backend's), both ways,
  // with events: no host waits, and correct even for a non-blocking stream.
  void enter() {
    if (stream_ == nullptr) return;
    SHARDOPT_CUDA_CHECK(cudaEventRecord(before_, cudaStreamLegacy));
    SHARDOPT_CUDA_CHECK(cudaStreamWaitEvent(stream_, before_, 0));
  }
  void leave() {
    if (stream_ == nullptr) return;
    SHARDOPT_CUDA_CHECK(cudaEventRecord(after_, stream_));
    SHARDOPT_CUDA_CHECK(cudaStreamWaitEvent(cudaStreamLegacy, after_, 0));
  }

  std::shared_ptr<Communicator> host_;  // MPI, for metadata and the bootstrap
  cudaStream_t stream_ = nullptr;
  cudaEvent_t before_ = nullptr, after_ = nullptr;
  void* scratch_ = nullptr;
  std::size_t scratch_elems_ = 0;
  ncclComm_t comm_ = nullptr;
  int version_ = 0;
};

}  // namespace

std::shared_ptr<Communicator> make_nccl_communicator(MPI_Comm comm, cudaStream_t stream) {
  return std::make_shared<NcclCommunicator>(comm, stream);
}

}  // namespace shardopt
