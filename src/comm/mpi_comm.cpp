// mpi_comm.cpp: Communicator over MPI collectives on host memory.
#include "shardopt/mpi_comm.hpp"

#include <algorithm>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "../cpu/kernels.hpp"
#include "mpi_util.hpp"
#include "shardopt/bf16.hpp"

namespace shardopt {
namespace {

// The reduction of the bf16 wire: each partial sum is computed in fp32 and rounded to bf16.
void bf16_sum(void* in, void* inout, int* len, MPI_Datatype*) {
  const auto* a = static_cast<const std::uint16_t*>(in);
  auto* b = static_cast<std::uint16_t*>(inout);
  for (int i = 0; i < *len; ++i)
    b[i] = float_to_bf16_bits(bf16_bits_to_float(a[i]) + bf16_bits_to_float(b[i]));
}

// One started MPI operation, the arrays MPI reads until it completes, and what to do after.
class MpiRequest final : public CommRequest {
 public:
  std::vector<MPI_Request> requests;
  std::vector<int> counts, displs;
  std::vector<bf16> wire, wire_received;
  std::vector<float> received;
  std::function<void()> on_complete;

  ~MpiRequest() override {
    if (done_) return;
    try {
      wait();
    } catch (...) {  // a destructor cannot report; the next collective will
    }
  }
  bool test() override {
    if (done_) return true;
    int flag = 0;
    SHARDOPT_MPI(MPI_Testall(static_cast<int>(requests.size()), requests.data(), &flag,
                             MPI_STATUSES_IGNORE));
    if (flag) finish();
    return done_;
  }
  void wait() override {
    if (done_) return;
    SHARDOPT_MPI(MPI_Waitall(static_cast<int>(requests.size()), requests.data(),
                             MPI_STATUSES_IGNORE));
    finish();
  }

 private:
  void finish() {
    done_ = true;
    if (on_complete) on_complete();
  }
  bool done_ = false;
};

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
    SHARDOPT_MPI(MPI_Op_create(&bf16_sum, 1, &bf16_sum_op_));
  }
  ~MpiCommunicator() override {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (finalized) return;
    MPI_Op_free(&bf16_sum_op_);
    MPI_Comm_free(&comm_);
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string name() const override { return "mpi"; }

  std::unique_ptr<CommRequest> start_reduce_scatter_sum(float* buf,
                                                        std::span<const std::size_t> counts,
                                                        CommType wire) override {
    auto req = blocks(counts, "MPI_Ireduce_scatter");
    const std::size_t mine = counts[static_cast<std::size_t>(rank_)];
    const std::size_t offset = static_cast<std::size_t>(req->displs[static_cast<std::size_t>(rank_)]);
    req->requests.resize(1);
    // Out of place, into a block-sized buffer: MPICH 4.0's in-place MPI_Reduce_scatter with
    // unequal counts (e.g. {0, n} for a bucket inside one shard) corrupts memory
    // ("memcpy argument memory ranges overlap"). The copy back costs one block.
    if (wire == CommType::BF16) {
      // Send bf16: convert, reduce the bf16 values, convert this rank's block back in place.
      const std::size_t total = offset_end(counts);
      req->wire.resize(total);
      cpu::cast_f32_to_bf16(buf, req->wire.data(), total);
      req->wire_received.resize(mine);
      SHARDOPT_MPI(MPI_Ireduce_scatter(req->wire.data(), req->wire_received.data(),
                                       req->counts.data(), MPI_UINT16_T, bf16_sum_op_, comm_,
                                       &req->requests[0]));
      MpiRequest* r = req.get();
      req->on_complete = [r, buf, mine, offset] {
        cpu::cast_bf16_to_f32(r->wire_received.data(), buf + offset, mine);
      };
    } else {
      require(wire == CommType::F32, Status::InvalidArgument, "reduce_scatter: wire F32 or BF16");
      req->received.resize(mine);
      SHARDOPT_MPI(MPI_Ireduce_scatter(buf, req->received.data(), req->counts.data(), MPI_FLOAT,
                                       MPI_SUM, comm_, &req->requests[0]));
      MpiRequest* r = req.get();
      req->on_complete = [r, buf, mine, offset] {
        if (mine) std::memcpy(buf + offset, r->received.data(), mine * sizeof(float));
      };
    }
    return req;
  }

  std::unique_ptr<CommRequest> start_all_reduce_sum(float* buf, std::size_t count,
                                                    CommType wire) override {
    auto req = std::make_unique<MpiRequest>();
    req->requests.resize(1);
    const int n = mpi::checked_int(count, "MPI_Iallreduce");
    if (wire == CommType::BF16) {
      req->wire.resize(count);
      cpu::cast_f32_to_bf16(buf, req->wire.data(), count);
      SHARDOPT_MPI(MPI_Iallreduce(MPI_IN_PLACE, req->wire.data(), n, MPI_UINT16_T, bf16_sum_op_,
                                  comm_, &req->requests[0]));
      MpiRequest* r = req.get();
      req->on_complete = [r, buf, count] { cpu::cast_bf16_to_f32(r->wire.data(), buf, count); };
    } else {
      require(wire == CommType::F32, Status::InvalidArgument, "all_reduce: wire F32 or BF16");
      SHARDOPT_MPI(MPI_Iallreduce(MPI_IN_PLACE, buf, n, MPI_FLOAT, MPI_SUM, comm_,
                                  &req->requests[0]));
    }
    return req;
  }

  std::unique_ptr<CommRequest> start_all_gatherv(void* buf, std::span<const std::size_t> counts,
                                                 CommType type) override {
    // Blocks are multiples of the layout's 64-element alignment in practice: moving them as
    // 64-element units keeps int counts valid for buffers of up to 2^37 elements.
    std::size_t unit = 64;
    for (std::size_t c : counts) unit = c % unit == 0 ? unit : 1;
    std::vector<std::size_t> units(counts.begin(), counts.end());
    for (std::size_t& u : units) u /= unit;
    auto req = blocks(units, "MPI_Iallgatherv");
    MPI_Datatype elem = mpi::datatype(type);
    if (unit > 1) {
      SHARDOPT_MPI(MPI_Type_contiguous(static_cast<int>(unit), elem, &elem));
      SHARDOPT_MPI(MPI_Type_commit(&elem));
    }
    req->requests.resize(1);
    const int rc = MPI_Iallgatherv(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, buf, req->counts.data(),
                                   req->displs.data(), elem, comm_, &req->requests[0]);
    if (unit > 1) MPI_Type_free(&elem);  // MPI keeps it alive until the operation completes
    mpi::check(rc, "MPI_Iallgatherv");
    return req;
  }

  void all_reduce_sum(void* buf, std::size_t count, CommType type) override {
    require(type == CommType::F32 || type == CommType::F64, Status::InvalidArgument,
            "all_reduce_sum: type F32 or F64");
    const std::size_t elem = mpi::type_size(type);
    constexpr std::size_t kChunk = std::size_t{1} << 30;
    for (std::size_t off = 0; off < count; off += kChunk) {
      const std::size_t n = std::min(kChunk, count - off);
      SHARDOPT_MPI(MPI_Allreduce(MPI_IN_PLACE, static_cast<char*>(buf) + off * elem,
                                 static_cast<int>(n), mpi::datatype(type), MPI_SUM, comm_));
    }
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
  // A request with int counts and displacements for per-rank blocks.
  std::unique_ptr<MpiRequest> blocks(std::span<const std::size_t> counts, const char* what) const {
    require(counts.size() == static_cast<std::size_t>(size_), Status::InvalidArgument,
            std::string(what) + ": need one count per rank");
    auto req = std::make_unique<MpiRequest>();
    std::size_t offset = 0;
    for (std::size_t c : counts) {
      req->counts.push_back(mpi::checked_int(c, what));
      req->displs.push_back(mpi::checked_int(offset, what));
      offset += c;
    }
    mpi::checked_int(offset, what);
    return req;
  }
  static std::size_t offset_end(std::span<const std::size_t> counts) {
    std::size_t t = 0;
    for (std::size_t c : counts) t += c;
    return t;
  }

  MPI_Comm comm_ = MPI_COMM_NULL;
  MPI_Op bf16_sum_op_ = MPI_OP_NULL;
  int rank_ = 0;
  int size_ = 1;
};

}  // namespace

std::shared_ptr<Communicator> mpi::make_plain_communicator(MPI_Comm comm) {
  return std::make_shared<MpiCommunicator>(comm);
}

}  // namespace shardopt
