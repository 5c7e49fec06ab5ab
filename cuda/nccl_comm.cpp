// nccl_comm.cpp: Communicator over NCCL collectives on device memory, bootstrapped from MPI.
#include "shardopt/nccl_comm.hpp"

#include <nccl.h>

#include <algorithm>
#include <span>
#include <string>
#include <tuple>
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

// Offsets of per-rank blocks laid out back to back.
std::vector<std::size_t> block_offsets(std::span<const std::size_t> counts) {
  std::vector<std::size_t> off(counts.size() + 1, 0);
  for (std::size_t r = 0; r < counts.size(); ++r) off[r + 1] = off[r] + counts[r];
  return off;
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

  void all_reduce_sum(void* buf, std::size_t count, CommType type) override {
    require(type == CommType::F32 || type == CommType::F64, Status::InvalidArgument,
            "all_reduce_sum: NCCL sums fp32 or fp64 only");
    enter();
    SHARDOPT_NCCL(ncclAllReduce(buf, buf, count, nccl_type(type), ncclSum, comm_, stream_));
    leave();
  }

  // NCCL collectives are stream-ordered: once enqueued, later work on the stream sees their
  // results, so the requests returned here are complete from the host's point of view.

  std::unique_ptr<CommRequest> start_reduce_scatter_sum(float* buf,
                                                        std::span<const std::size_t> counts,
                                                        CommType wire) override {
    require(counts.size() == static_cast<std::size_t>(size()), Status::InvalidArgument,
            "reduce_scatter: need one count per rank");
    require(wire == CommType::F32 || wire == CommType::BF16, Status::InvalidArgument,
            "reduce_scatter: wire F32 or BF16");
    const std::vector<std::size_t> off = block_offsets(counts);
    const std::size_t me = static_cast<std::size_t>(rank());
    enter();
    if (wire == CommType::BF16) {
      // Reduce bf16 copies in a scratch buffer, then widen this rank's block in place.
      bf16* tmp = scratch_bf16(off.back());
      dev::cast_f32_to_bf16(stream(), buf, tmp, off.back());
      reduce_scatter_blocks(tmp, counts, off, ncclBfloat16);
      dev::cast_bf16_to_f32(stream(), tmp + off[me], buf + off[me], counts[me]);
    } else {
      reduce_scatter_blocks(buf, counts, off, ncclFloat32);
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

  std::unique_ptr<CommRequest> start_all_gatherv(void* buf, std::span<const std::size_t> counts,
                                                 CommType type) override {
    require(counts.size() == static_cast<std::size_t>(size()), Status::InvalidArgument,
            "all_gather: need one count per rank");
    const std::vector<std::size_t> off = block_offsets(counts);
    const std::size_t me = static_cast<std::size_t>(rank()), unit = type_size(type);
    char* base = static_cast<char*>(buf);
    enter();
    if (std::all_of(counts.begin(), counts.end(), [&](std::size_t c) { return c == counts[0]; })) {
      SHARDOPT_NCCL(ncclAllGather(base + off[me] * unit, buf, counts[me], nccl_type(type), comm_,
                                  stream_));
    } else {
      // Unequal blocks (buckets across shard boundaries): one broadcast per owner, grouped.
      SHARDOPT_NCCL(ncclGroupStart());
      for (std::size_t r = 0; r < counts.size(); ++r) {
        const ncclResult_t rc = ncclBroadcast(base + off[r] * unit, base + off[r] * unit,
                                              counts[r], nccl_type(type), static_cast<int>(r),
                                              comm_, stream_);
        if (rc != ncclSuccess) {
          ncclGroupEnd();
          check_nccl(rc, "ncclBroadcast", comm_);
        }
      }
      SHARDOPT_NCCL(ncclGroupEnd());
    }
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

  // NCCL's in-place reduce-scatter leaves block rank() at its own offset: the equal-block
  // form; unequal blocks (stage-2 buckets) become one in-place reduce per owner, grouped.
  void reduce_scatter_blocks(void* buf, std::span<const std::size_t> counts,
                             const std::vector<std::size_t>& off, ncclDataType_t type) {
    const std::size_t me = static_cast<std::size_t>(rank());
    const std::size_t unit = type == ncclBfloat16 ? 2 : 4;
    char* base = static_cast<char*>(buf);
    if (std::all_of(counts.begin(), counts.end(), [&](std::size_t c) { return c == counts[0]; })) {
      SHARDOPT_NCCL(ncclReduceScatter(buf, base + off[me] * unit, counts[me], type, ncclSum,
                                      comm_, stream_));
      return;
    }
    SHARDOPT_NCCL(ncclGroupStart());
    for (std::size_t r = 0; r < counts.size(); ++r) {
      const ncclResult_t rc = ncclReduce(base + off[r] * unit, base + off[r] * unit, counts[r],
                                         type, ncclSum, static_cast<int>(r), comm_, stream_);
      if (rc != ncclSuccess) {
        ncclGroupEnd();
        check_nccl(rc, "ncclReduce", comm_);
      }
    }
    SHARDOPT_NCCL(ncclGroupEnd());
  }

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
