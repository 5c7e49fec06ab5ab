// mpi_comm.cpp: Communicator over MPI collectives on host memory.
#include "shardopt/mpi_comm.hpp"

#include <numeric>
#include <string>
#include <vector>

#include "mpi_util.hpp"

namespace shardopt {
namespace {

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
                                 static_cast<int>(n), mpi::datatype(type), MPI_SUM, comm_));
    }
  }

  void reduce_scatter_sum_inplace(float* buf, std::span<const std::size_t> counts) override {
    require(counts.size() == static_cast<std::size_t>(size_), Status::InvalidArgument,
            "reduce_scatter: need one count per rank");
    bool equal = true;
    std::vector<int> icounts(counts.size());
    for (std::size_t r = 0; r < counts.size(); ++r) {
      icounts[r] = mpi::checked_int(counts[r], "MPI_Reduce_scatter");
      equal = equal && counts[r] == counts[0];
    }
    if (equal) {
      SHARDOPT_MPI(MPI_Reduce_scatter_block(MPI_IN_PLACE, buf, icounts[0], MPI_FLOAT, MPI_SUM,
                                            comm_));
    } else {
      SHARDOPT_MPI(MPI_Reduce_scatter(MPI_IN_PLACE, buf, icounts.data(), MPI_FLOAT, MPI_SUM,
                                      comm_));
    }
  }

  void all_gather_inplace(void* buf, std::size_t count_per_rank, CommType type) override {
    SHARDOPT_MPI(MPI_Allgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, buf,
                               mpi::checked_int(count_per_rank, "MPI_Allgather"),
                               mpi::datatype(type), comm_));
  }

  void all_gather_bytes(const void* send, void* recv, std::size_t bytes) override {
    const int n = mpi::checked_int(bytes, "MPI_Allgather");
    SHARDOPT_MPI(MPI_Allgather(send, n, MPI_BYTE, recv, n, MPI_BYTE, comm_));
  }

  void broadcast_bytes(void* buf, std::size_t bytes, int root) override {
    SHARDOPT_MPI(MPI_Bcast(buf, mpi::checked_int(bytes, "MPI_Bcast"), MPI_BYTE, root, comm_));
  }

  void barrier() override { SHARDOPT_MPI(MPI_Barrier(comm_)); }

 private:
  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0;
  int size_ = 1;
};

}  // namespace

std::shared_ptr<Communicator> mpi::make_plain_communicator(MPI_Comm comm) {
  return std::make_shared<MpiCommunicator>(comm);
}

}  // namespace shardopt
