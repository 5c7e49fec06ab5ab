// single_comm.cpp: the communicator of a one-process group; runs without MPI.
#include <cstring>

#include "shardopt/comm.hpp"

namespace shardopt {
namespace {

class SingleProcessCommunicator final : public Communicator {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  std::string name() const override { return "single-process"; }
  void all_reduce_sum(void*, std::size_t, CommType) override {}
  void reduce_scatter_sum_inplace(float*, std::span<const std::size_t> counts) override {
    require(counts.size() == 1, Status::InvalidArgument, "reduce_scatter: need one count");
  }
  void all_gather_inplace(void*, std::size_t, CommType) override {}
  void all_gather_bytes(const void* send, void* recv, std::size_t bytes) override {
    if (bytes != 0 && send != recv) std::memmove(recv, send, bytes);
  }
  void broadcast_bytes(void*, std::size_t, int root) override {
    require(root == 0, Status::InvalidArgument, "broadcast: root out of range");
  }
  void barrier() override {}
};

}  // namespace

std::shared_ptr<Communicator> make_single_process_communicator() {
  return std::make_shared<SingleProcessCommunicator>();
}

}  // namespace shardopt
