// cuda_single_comm.cpp: the one-process communicator of device buffers (cuda_comm.hpp).
#include "cuda_ops.hpp"
#include "shardopt/cuda_comm.hpp"

namespace shardopt {
namespace {

class CudaSingleProcessCommunicator final : public Communicator {
 public:
  explicit CudaSingleProcessCommunicator(cudaStream_t stream)
      : host_(make_single_process_communicator()), stream_(stream) {}

  int rank() const override { return 0; }
  int size() const override { return 1; }
  std::string name() const override { return "cuda single-process"; }
  bool device_buffers() const override { return true; }
  void* device_stream() const override { return stream_; }

  // On the compute stream itself: consumers queued after these calls see the result.
  std::unique_ptr<CommRequest> start_reduce_scatter_sum(float* buf, std::size_t count,
                                                        CommType wire) override {
    return reduce(buf, count, wire);
  }
  std::unique_ptr<CommRequest> start_all_reduce_sum(float* buf, std::size_t count,
                                                    CommType wire) override {
    return reduce(buf, count, wire);
  }
  std::unique_ptr<CommRequest> start_all_gather(void*, std::size_t, CommType) override {
    return completed_request();
  }
  // The uneven forms at one rank: the whole buffer is this rank's block. (The base class's
  // reduce-scatter would do the same through start_all_reduce_sum; its all-gather refuses
  // device buffers.)
  std::unique_ptr<CommRequest> start_reduce_scatter_sum_v(float* buf,
                                                          std::span<const std::size_t> counts,
                                                          CommType wire) override {
    return reduce(buf, uneven_offsets(counts, 1, "reduce_scatter_sum_v").back(), wire);
  }
  std::unique_ptr<CommRequest> start_all_gather_v(void*, std::span<const std::size_t> counts,
                                                  CommType) override {
    uneven_offsets(counts, 1, "all_gather_v");
    return completed_request();
  }
  void all_reduce_sum(void*, std::size_t, CommType) override {}
  // The integer reductions of one rank: the buffer is the result.
  void reduce_scatter_int(void*, std::size_t, IntOp) override {}
  void all_reduce_int(void*, std::size_t, IntOp) override {}
  // Reproducible mode's exchanges at one rank: the block is the whole input, combined on the
  // compute stream by the backend's kernel.
  bool reduce_scatter_combine(const void* in, std::size_t, float* out, std::size_t count,
                              BlockCombiner& op) override {
    const void* src[1] = {in};
    if (count != 0) op.combine(out, src, 1, count);
    return true;
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
  void barrier() override {}

 private:
  std::unique_ptr<CommRequest> reduce(float* buf, std::size_t count, CommType wire) {
    require(wire == CommType::F32 || wire == CommType::BF16, Status::InvalidArgument,
            "reduce: wire F32 or BF16");
    if (wire == CommType::BF16) dev::round_through_bf16(stream(), buf, count);
    return completed_request();
  }
  cudaStream_t stream() const { return stream_ != nullptr ? stream_ : cudaStreamLegacy; }

  std::shared_ptr<Communicator> host_;
  cudaStream_t stream_;
};

}  // namespace

std::shared_ptr<Communicator> make_cuda_single_process_communicator(cudaStream_t compute_stream) {
  return std::make_shared<CudaSingleProcessCommunicator>(compute_stream);
}

}  // namespace shardopt
