// single_comm.cpp: the communicator of a one-process group; runs without MPI.
#include <cstring>

#include "shardopt/bf16.hpp"
#include "shardopt/comm.hpp"

namespace shardopt {
namespace {

// With a bf16 wire the single rank's values still go through bf16, so that results do not
// change character with the number of ranks.
void round_through_bf16(float* buf, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) buf[i] = to_float(to_bf16(buf[i]));
}

class SingleProcessCommunicator final : public Communicator {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  std::string name() const override { return "single-process"; }

  std::unique_ptr<CommRequest> start_reduce_scatter_sum(float* buf, std::size_t count,
                                                        CommType wire) override {
    if (wire == CommType::BF16) round_through_bf16(buf, count);
    return completed_request();
  }
  std::unique_ptr<CommRequest> start_reduce_scatter_sum_v(float* buf,
                                                          std::span<const std::size_t> counts,
                                                          CommType wire) override {
    const std::vector<std::size_t> off = uneven_offsets(counts, 1, "reduce_scatter_sum_v");
    if (wire == CommType::BF16) round_through_bf16(buf, off.back());
    return completed_request();
  }
  std::unique_ptr<CommRequest> start_all_gather_v(void*, std::span<const std::size_t> counts,
                                                  CommType) override {
    uneven_offsets(counts, 1, "all_gather_v");
    return completed_request();
  }
  std::unique_ptr<CommRequest> start_all_reduce_sum(float* buf, std::size_t count,
                                                    CommType wire) override {
    if (wire == CommType::BF16) round_through_bf16(buf, count);
    return completed_request();
  }
  std::unique_ptr<CommRequest> start_all_gather(void*, std::size_t, CommType) override {
    return completed_request();
  }
  void all_reduce_sum(void*, std::size_t, CommType) override {}
  void reduce_scatter_int(void*, std::size_t, IntOp) override {}
  void all_reduce_int(void*, std::size_t, IntOp) override {}
  bool reduce_scatter_combine(const void* in, std::size_t, float* out, std::size_t count,
                              BlockCombiner& op) override {
    const void* src[1] = {in};
    if (count != 0) op.combine(out, src, 1, count);
    return true;
  }
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
