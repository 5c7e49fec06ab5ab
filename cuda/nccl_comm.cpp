// nccl_comm.cpp: Communicator over NCCL collectives on device memory, bootstrapped from MPI.
#include "shardopt/nccl_comm.hpp"

#include <nccl.h>

#include <string>
#include <tuple>
#include <utility>

#include "cuda_check.hpp"
#include "shardopt/mpi_comm.hpp"
#include "shift_down.hpp"

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
    case CommType::U8: return ncclUint8;
  }
  return ncclUint8;
}

std::size_t type_size(CommType t) {
  switch (t) {
    case CommType::F32: return 4;
    case CommType::F64: return 8;
    case CommType::U16: return 2;
    case CommType::U8: return 1;
  }
  return 1;
}

/// Runs a local setup step; returns its Error status and message instead of throwing, so
/// every rank can agree on the outcome before the next collective.
template <class F>
std::pair<Status, std::string> attempt(F&& f) {
  try {
    f();
    return {Status::Ok, {}};
  } catch (const Error& e) {
    return {e.status(), e.what()};
  }
}

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(MPI_Comm parent, cudaStream_t stream)
      : host_(make_mpi_communicator(parent)), stream_(stream) {
    auto [st, msg] = attempt([&] {
      int devices = 0;
      SHARDOPT_CUDA_CHECK(cudaGetDeviceCount(&devices));
      require(devices > 0, Status::Cuda, "no CUDA device");
      int device = 0;
      SHARDOPT_CUDA_CHECK(cudaGetDevice(&device));
    });
    agree_or_throw(*host_, st, "make_nccl_communicator: " + msg);

    ncclUniqueId id{};
    std::tie(st, msg) = attempt([&] {
      if (host_->rank() == 0) SHARDOPT_NCCL(ncclGetUniqueId(&id));
    });
    agree_or_throw(*host_, st, "make_nccl_communicator: " + msg);
    host_->broadcast_bytes(&id, sizeof id, 0);
    SHARDOPT_NCCL(ncclCommInitRank(&comm_, host_->size(), id, host_->rank()));
    ncclGetVersion(&version_);
    if (stream_ != nullptr) {
      SHARDOPT_CUDA_CHECK(cudaEventCreateWithFlags(&before_, cudaEventDisableTiming));
      SHARDOPT_CUDA_CHECK(cudaEventCreateWithFlags(&after_, cudaEventDisableTiming));
    }
  }

  ~NcclCommunicator() override {
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

  void all_reduce_sum(void* buf, std::size_t count, CommType type) override {
    require(type == CommType::F32 || type == CommType::F64, Status::InvalidArgument,
            "all_reduce_sum: NCCL sums fp32 or fp64 only");
    enter();
    SHARDOPT_NCCL(ncclAllReduce(buf, buf, count, nccl_type(type), ncclSum, comm_, stream_));
    leave();
  }

  void reduce_scatter_sum_inplace(float* buf, std::span<const std::size_t> counts) override {
    require(counts.size() == static_cast<std::size_t>(size()), Status::InvalidArgument,
            "reduce_scatter: need one count per rank");
    const std::size_t me = static_cast<std::size_t>(rank());
    bool equal = true;
    std::size_t offset = 0;  // of my block
    for (std::size_t r = 0; r < counts.size(); ++r) {
      equal = equal && counts[r] == counts[0];
      if (r < me) offset += counts[r];
    }
    enter();
    if (equal) {
      // NCCL's in-place form: the result lands in my own block.
      SHARDOPT_NCCL(ncclReduceScatter(buf, buf + offset, counts[me], ncclFloat32, ncclSum, comm_,
                                      stream_));
    } else {
      // Unequal blocks (stage 2 buckets): one in-place reduce per owner, fused in a group.
      SHARDOPT_NCCL(ncclGroupStart());
      std::size_t off = 0;
      for (std::size_t r = 0; r < counts.size(); ++r) {
        const ncclResult_t rc = ncclReduce(buf + off, buf + off, counts[r], ncclFloat32, ncclSum,
                                           static_cast<int>(r), comm_, stream_);
        if (rc != ncclSuccess) {
          ncclGroupEnd();
          check_nccl(rc, "ncclReduce", comm_);
        }
        off += counts[r];
      }
      SHARDOPT_NCCL(ncclGroupEnd());
    }
    // The interface wants my block at the front.
    for (const dev::Move& mv : dev::shift_down_moves(offset, counts[me]))
      SHARDOPT_CUDA_CHECK(cudaMemcpyAsync(buf + mv.dst, buf + mv.src, mv.count * sizeof(float),
                                          cudaMemcpyDeviceToDevice, stream_));
    leave();
  }

  void all_gather_inplace(void* buf, std::size_t count_per_rank, CommType type) override {
    char* base = static_cast<char*>(buf);
    const std::size_t mine = static_cast<std::size_t>(rank()) * count_per_rank * type_size(type);
    enter();
    SHARDOPT_NCCL(ncclAllGather(base + mine, buf, count_per_rank, nccl_type(type), comm_, stream_));
    leave();
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
  ncclComm_t comm_ = nullptr;
  int version_ = 0;
};

}  // namespace

std::shared_ptr<Communicator> make_nccl_communicator(MPI_Comm comm, cudaStream_t stream) {
  return std::make_shared<NcclCommunicator>(comm, stream);
}

}  // namespace shardopt
