// mpi_comm.cpp: Communicator over MPI collectives on host memory.
#include "shardopt/mpi_comm.hpp"

#include <algorithm>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "../cpu/kernels.hpp"
#include "mpi_util.hpp"
#include "mpi_watchdog.hpp"
#include "shardopt/bf16.hpp"

namespace shardopt {
namespace {

using mpi::Watchdog;

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
  MpiRequest(std::shared_ptr<Watchdog> dog, const char* name)
      : dog_(std::move(dog)), ticket_(dog_->enter(name)) {}
  std::vector<MPI_Request> requests;
  std::vector<bf16> wire;
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
    dog_->wait(ticket_, static_cast<int>(requests.size()), requests.data());
    finish();
  }

 private:
  void finish() {
    done_ = true;
    if (on_complete) on_complete();
  }
  bool done_ = false;
  std::shared_ptr<Watchdog> dog_;
  Watchdog::Ticket ticket_;
};

class MpiCommunicator final : public Communicator {
 public:
  MpiCommunicator(MPI_Comm parent, std::shared_ptr<Watchdog> dog) : dog_(std::move(dog)) {
    int initialized = 0;
    MPI_Initialized(&initialized);
    require(initialized != 0, Status::InvalidState, "MPI is not initialised");
    SHARDOPT_MPI(MPI_Comm_dup(parent, &comm_));
    SHARDOPT_MPI(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN));
    SHARDOPT_MPI(MPI_Comm_rank(comm_, &rank_));
    SHARDOPT_MPI(MPI_Comm_size(comm_, &size_));
    SHARDOPT_MPI(MPI_Op_create(&bf16_sum, 1, &bf16_sum_op_));
    dog_->attach(comm_);
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
  void set_collective_timeout(double seconds) override { dog_->set_timeout(seconds); }

  // MPI's in-place reduce-scatter leaves the result at the start of the buffer; it is moved
  // to the rank's own block when the request completes (NCCL's convention), so no temporary
  // is needed with an fp32 wire.
  std::unique_ptr<CommRequest> start_reduce_scatter_sum(float* buf, std::size_t count,
                                                        CommType wire) override {
    auto req = std::make_unique<MpiRequest>(dog_, "reduce_scatter_sum");
    req->requests.resize(1);
    const int n = mpi::checked_int(count, "MPI_Ireduce_scatter_block");
    mpi::checked_int(count * static_cast<std::size_t>(size_), "MPI_Ireduce_scatter_block");
    float* own = buf + static_cast<std::size_t>(rank_) * count;
    if (wire == CommType::BF16) {
      // Send bf16: convert, reduce the bf16 values, convert this rank's block back in place.
      const std::size_t total = count * static_cast<std::size_t>(size_);
      req->wire.resize(total);
      cpu::cast_f32_to_bf16(buf, req->wire.data(), total);
      SHARDOPT_MPI(MPI_Ireduce_scatter_block(MPI_IN_PLACE, req->wire.data(), n, MPI_UINT16_T,
                                             bf16_sum_op_, comm_, &req->requests[0]));
      MpiRequest* r = req.get();
      req->on_complete = [r, own, count] { cpu::cast_bf16_to_f32(r->wire.data(), own, count); };
    } else {
      require(wire == CommType::F32, Status::InvalidArgument, "reduce_scatter: wire F32 or BF16");
      SHARDOPT_MPI(MPI_Ireduce_scatter_block(MPI_IN_PLACE, buf, n, MPI_FLOAT, MPI_SUM, comm_,
                                             &req->requests[0]));
      if (rank_ != 0)
        req->on_complete = [buf, own, count] { std::memcpy(own, buf, count * sizeof(float)); };
    }
    return req;
  }

  std::unique_ptr<CommRequest> start_all_reduce_sum(float* buf, std::size_t count,
                                                    CommType wire) override {
    auto req = std::make_unique<MpiRequest>(dog_, "start_all_reduce_sum");
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

  std::unique_ptr<CommRequest> start_all_gather(void* buf, std::size_t count,
                                                CommType type) override {
    // Blocks are multiples of the layout's 64-element alignment in practice: moving them as
    // 64-element units keeps int counts valid for buckets of up to 2^37 elements per rank.
    const std::size_t unit = count % 64 == 0 ? 64 : 1;
    const int n = mpi::checked_int(count / unit, "MPI_Iallgather");
    mpi::checked_int(count / unit * static_cast<std::size_t>(size_), "MPI_Iallgather");
    auto req = std::make_unique<MpiRequest>(dog_, "all_gather");
    MPI_Datatype elem = mpi::datatype(type);
    if (unit > 1) {
      SHARDOPT_MPI(MPI_Type_contiguous(static_cast<int>(unit), elem, &elem));
      SHARDOPT_MPI(MPI_Type_commit(&elem));
    }
    req->requests.resize(1);
    const int rc = MPI_Iallgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, buf, n, elem, comm_,
                                  &req->requests[0]);
    if (unit > 1) MPI_Type_free(&elem);  // MPI keeps it alive until the operation completes
    mpi::check(rc, "MPI_Iallgather");
    return req;
  }

  void all_reduce_sum(void* buf, std::size_t count, CommType type) override {
    require(type == CommType::F32 || type == CommType::F64, Status::InvalidArgument,
            "all_reduce_sum: type F32 or F64");
    const std::size_t elem = mpi::type_size(type);
    constexpr std::size_t kChunk = std::size_t{1} << 30;
    const Watchdog::Ticket t = dog_->enter("all_reduce_sum");
    for (std::size_t off = 0; off < count; off += kChunk) {
      const int n = static_cast<int>(std::min(kChunk, count - off));
      void* at = static_cast<char*>(buf) + off * elem;
      const MPI_Datatype dt = mpi::datatype(type);
      dog_->run(
          t, [&] { SHARDOPT_MPI(MPI_Allreduce(MPI_IN_PLACE, at, n, dt, MPI_SUM, comm_)); },
          [&](MPI_Request* r) {
            SHARDOPT_MPI(MPI_Iallreduce(MPI_IN_PLACE, at, n, dt, MPI_SUM, comm_, r));
          });
    }
  }

  void all_gather_bytes(const void* send, void* recv, std::size_t bytes) override {
    const int n = mpi::checked_int(bytes, "MPI_Allgather");
    dog_->run(
        dog_->enter("all_gather_bytes"),
        [&] { SHARDOPT_MPI(MPI_Allgather(send, n, MPI_BYTE, recv, n, MPI_BYTE, comm_)); },
        [&](MPI_Request* r) {
          SHARDOPT_MPI(MPI_Iallgather(send, n, MPI_BYTE, recv, n, MPI_BYTE, comm_, r));
        });
  }

  void broadcast_bytes(void* buf, std::size_t bytes, int root) override {
    const int n = mpi::checked_int(bytes, "MPI_Bcast");
    dog_->run(
        dog_->enter("broadcast_bytes"),
        [&] { SHARDOPT_MPI(MPI_Bcast(buf, n, MPI_BYTE, root, comm_)); },
        [&](MPI_Request* r) { SHARDOPT_MPI(MPI_Ibcast(buf, n, MPI_BYTE, root, comm_, r)); });
  }

  void barrier() override {
    dog_->run(
        dog_->enter("barrier"), [&] { SHARDOPT_MPI(MPI_Barrier(comm_)); },
        [&](MPI_Request* r) { SHARDOPT_MPI(MPI_Ibarrier(comm_, r)); });
  }

 private:
  std::shared_ptr<Watchdog> dog_;
  MPI_Comm comm_ = MPI_COMM_NULL;
  MPI_Op bf16_sum_op_ = MPI_OP_NULL;
  int rank_ = 0;
  int size_ = 1;
};

}  // namespace

std::shared_ptr<Communicator> mpi::make_plain_communicator(MPI_Comm comm,
                                                           std::shared_ptr<Watchdog> watchdog) {
  return std::make_shared<MpiCommunicator>(comm, std::move(watchdog));
}

}  // namespace shardopt
