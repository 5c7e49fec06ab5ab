// mpi_comm.cpp: Communicator over MPI collectives on host memory.
#include "shardopt/mpi_comm.hpp"

#include <algorithm>
#include <climits>
#include <numeric>
#include <string>
#include <vector>

namespace shardopt {
namespace {

void check_mpi(int rc, const char* call) {
  if (rc == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, text, &len);
  throw Error(Status::Communication, std::string(call) + " failed: " + std::string(text, len));
}
#define SHARDOPT_MPI(call) check_mpi((call), #call)

MPI_Datatype mpi_type(CommType t) {
  switch (t) {
    case CommType::F32: return MPI_FLOAT;
    case CommType::F64: return MPI_DOUBLE;
    case CommType::U16: return MPI_UINT16_T;
    case CommType::U8: return MPI_BYTE;
  }
  return MPI_DATATYPE_NULL;
}

// MPI-3 counts are int. Larger messages go through a contiguous datatype of `unit` elements
// where the operation allows it (data movement); reductions are split into chunks.
int checked_int(std::size_t n, const char* what) {
  if (n > static_cast<std::size_t>(INT_MAX))
    throw Error(Status::Unsupported, std::string(what) + ": count " + std::to_string(n) +
                                         " exceeds the MPI int limit");
  return static_cast<int>(n);
}

class MpiCommunicator final : public Communicator {
 public:
  explicit MpiCommunicator(MPI_Comm parent) {
    int initialized = 0;
    MPI_Initialized(&initialized);
    require(initialized != 0, Status::InvalidState, "MPI is not initialised");
    SHARDOPT_MPI(MPI_Comm_dup(parent, &comm_));
    SHARDOPT_MPI(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN));
    SHARDOPT_MPI(MPI_Comm_rank(comm_, &rank_));
    SHARDOPT_MPI(MPI_Comm_size(comm_, &size_));
  }
  ~MpiCommunicator() override {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized) MPI_Comm_free(&comm_);
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string name() const override { return "mpi"; }

  void all_reduce_sum(void* buf, std::size_t count, CommType type) override {
    const std::size_t elem = type == CommType::F64 ? 8 : 4;
    constexpr std::size_t kChunk = std::size_t{1} << 30;
    for (std::size_t off = 0; off < count; off += kChunk) {
      const std::size_t n = std::min(kChunk, count - off);
      SHARDOPT_MPI(MPI_Allreduce(MPI_IN_PLACE, static_cast<char*>(buf) + off * elem,
                                 static_cast<int>(n), mpi_type(type), MPI_SUM, comm_));
    }
  }

  void reduce_scatter_sum_inplace(float* buf, std::span<const std::size_t> counts) override {
    require(counts.size() == static_cast<std::size_t>(size_), Status::InvalidArgument,
            "reduce_scatter: need one count per rank");
    bool equal = true;
    std::vector<int> icounts(counts.size());
    for (std::size_t r = 0; r < counts.size(); ++r) {
      icounts[r] = checked_int(counts[r], "MPI_Reduce_scatter");
      equal = equal && counts[r] == counts[0];
    }
    if (equal) {
      SHARDOPT_MPI(MPI_Reduce_scatter_block(MPI_IN_PLACE, buf, icounts[0], MPI_FLOAT, MPI_SUM,
                                            comm_));
    } else {
      // Not in place: MPICH 4.0.2's in-place MPI_Reduce_scatter aborts ("memcpy argument
      // memory ranges overlap") for large unequal counts, e.g. a stage-2 bucket that lies
      // in one rank's shard. The result goes through a reused buffer of counts[rank] floats.
      const std::size_t mine = counts[static_cast<std::size_t>(rank_)];
      if (recv_.size() < mine) recv_.resize(mine);
      SHARDOPT_MPI(MPI_Reduce_scatter(buf, recv_.data(), icounts.data(), MPI_FLOAT, MPI_SUM,
                                      comm_));
      std::copy(recv_.begin(), recv_.begin() + static_cast<std::ptrdiff_t>(mine), buf);
    }
  }

  void all_gather_inplace(void* buf, std::size_t count_per_rank, CommType type) override {
    SHARDOPT_MPI(MPI_Allgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, buf,
                               checked_int(count_per_rank, "MPI_Allgather"), mpi_type(type),
                               comm_));
  }

  void all_gather_bytes(const void* send, void* recv, std::size_t bytes) override {
    const int n = checked_int(bytes, "MPI_Allgather");
    SHARDOPT_MPI(MPI_Allgather(send, n, MPI_BYTE, recv, n, MPI_BYTE, comm_));
  }

  void broadcast_bytes(void* buf, std::size_t bytes, int root) override {
    SHARDOPT_MPI(MPI_Bcast(buf, checked_int(bytes, "MPI_Bcast"), MPI_BYTE, root, comm_));
  }

  void barrier() override { SHARDOPT_MPI(MPI_Barrier(comm_)); }

 private:
  MPI_Comm comm_ = MPI_COMM_NULL;
  std::vector<float> recv_;  ///< receive buffer of reduce_scatter_sum_inplace, unequal counts
  int rank_ = 0;
  int size_ = 1;
};

}  // namespace

std::shared_ptr<Communicator> make_mpi_communicator(MPI_Comm comm) {
  return std::make_shared<MpiCommunicator>(comm);
}

}  // namespace shardopt
