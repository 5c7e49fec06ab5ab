// forwarding_comm.hpp: communicators that wrap another one in the tests. ForwardingComm hands
// every virtual of Communicator to the wrapped communicator, so a wrapper behaves exactly as
// the communicator it wraps; its variants override only what they change: CountingComm counts
// what goes through (bytes on the wire, collectives started, integer and raw-value bytes,
// windows handed out), ComposedOnlyComm runs the uneven collectives as the base class composes
// them (what the NCCL communicator and any new one get).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "shardopt/comm.hpp"

namespace shardopt::test {

/// Every virtual of Communicator, forwarded to `inner`.
class ForwardingComm : public Communicator {
 public:
  explicit ForwardingComm(std::shared_ptr<Communicator> inner) : in_(std::move(inner)) {}

  int rank() const override { return in_->rank(); }
  int size() const override { return in_->size(); }
  std::string name() const override { return in_->name(); }
  bool device_buffers() const override { return in_->device_buffers(); }
  void* device_stream() const override { return in_->device_stream(); }

  std::unique_ptr<CommRequest> start_reduce_scatter_sum(float* buf, std::size_t count_per_rank,
                                                        CommType wire) override {
    return in_->start_reduce_scatter_sum(buf, count_per_rank, wire);
  }
  std::unique_ptr<CommRequest> start_all_gather(void* buf, std::size_t count_per_rank,
                                                CommType type) override {
    return in_->start_all_gather(buf, count_per_rank, type);
  }
  std::unique_ptr<CommRequest> start_reduce_scatter_sum_v(float* buf,
                                                          std::span<const std::size_t> counts,
                                                          CommType wire) override {
    return in_->start_reduce_scatter_sum_v(buf, counts, wire);
  }
  std::unique_ptr<CommRequest> start_all_gather_v(void* buf, std::span<const std::size_t> counts,
                                                  CommType type) override {
    return in_->start_all_gather_v(buf, counts, type);
  }
  std::unique_ptr<CommRequest> start_all_reduce_sum(float* buf, std::size_t count,
                                                    CommType wire) override {
    return in_->start_all_reduce_sum(buf, count, wire);
  }
  void all_reduce_sum(void* buf, std::size_t count, CommType type) override {
    in_->all_reduce_sum(buf, count, type);
  }
  void reduce_scatter_int(void* buf, std::size_t count_per_rank, IntOp op) override {
    in_->reduce_scatter_int(buf, count_per_rank, op);
  }
  void all_reduce_int(void* buf, std::size_t count, IntOp op) override {
    in_->all_reduce_int(buf, count, op);
  }
  bool reduce_scatter_combine(const void* in, std::size_t elem_bytes, float* out,
                              std::size_t count_per_rank, BlockCombiner& op) override {
    return in_->reduce_scatter_combine(in, elem_bytes, out, count_per_rank, op);
  }
  bool reduce_scatter_combine_pair(const void* in, std::size_t elem_bytes, const void* in2,
                                   std::size_t elem_bytes2, float* out, std::size_t count_per_rank,
                                   BlockCombiner& op) override {
    return in_->reduce_scatter_combine_pair(in, elem_bytes, in2, elem_bytes2, out, count_per_rank, op);
  }
  void all_reduce_sum_host(double* buf, std::size_t count) override {
    in_->all_reduce_sum_host(buf, count);
  }
  void all_gather_bytes(const void* send, void* recv, std::size_t bytes) override {
    in_->all_gather_bytes(send, recv, bytes);
  }
  void broadcast_bytes(void* buf, std::size_t bytes, int root) override {
    in_->broadcast_bytes(buf, bytes, root);
  }
  void barrier() override { in_->barrier(); }
  Allocation allocate_collective_buffer(MemoryTracker* tracker, MemCategory category,
                                        std::size_t bytes) override {
    return in_->allocate_collective_buffer(tracker, category, bytes);
  }
  std::uint64_t internode_bytes() const override { return in_->internode_bytes(); }
  void set_collective_timeout(double seconds) override { in_->set_collective_timeout(seconds); }

 private:
  std::shared_ptr<Communicator> in_;
};

/// Forwards everything and counts, per rank, what this rank hands to the communicator.
class CountingComm final : public ForwardingComm {
 public:
  using ForwardingComm::ForwardingComm;

  /// Bytes of the data collectives started (reduce-scatters and all-gathers, equal and
  /// uneven: every rank's block; all-reduces: the buffer), at the wire type's width.
  std::size_t wire_bytes = 0;
  /// Gradient reductions started: reduce-scatters (equal and uneven) and all-reduces.
  int reductions = 0;
  /// All-gathers started (equal and uneven), and the library call each started in
  /// (CallScope::current()).
  int gathers = 0;
  std::vector<std::string> gather_calls;
  /// Payload bytes of the integer collectives (reproducible mode's two-phase method: a
  /// reduce-scatter counts every rank's block) and of the raw-value exchanges that were done
  /// (reduce_scatter_combine: every rank's block), as MemoryPlan::reduce_bytes counts them.
  std::size_t int_bytes = 0;
  std::size_t combine_bytes = 0;
  /// reduce_scatter_combine_pair calls that were done (the packed exchange with the last
  /// micro-batch deposited at the owner).
  int combine_pairs = 0;
  /// Act as a communicator without the raw-value exchange (reduce_scatter_combine answers
  /// false, the default's answer).
  bool refuse_combine = false;
  /// Refuse only reduce_scatter_combine_pair (the owners cannot read in place: a
  /// communicator over several nodes).
  bool refuse_pairs = false;
  /// Buffers allocate_collective_buffer handed out (non-empty: shared-memory windows).
  int windows = 0;

  std::unique_ptr<CommRequest> start_reduce_scatter_sum(float* buf, std::size_t count_per_rank,
                                                        CommType wire) override {
    wire_bytes += count_per_rank * ranks() * width(wire);
    ++reductions;
    return ForwardingComm::start_reduce_scatter_sum(buf, count_per_rank, wire);
  }
  std::unique_ptr<CommRequest> start_all_gather(void* buf, std::size_t count_per_rank,
                                                CommType type) override {
    wire_bytes += count_per_rank * ranks() * width(type);
    started_gather();
    return ForwardingComm::start_all_gather(buf, count_per_rank, type);
  }
  std::unique_ptr<CommRequest> start_reduce_scatter_sum_v(float* buf,
                                                          std::span<const std::size_t> counts,
                                                          CommType wire) override {
    for (std::size_t n : counts) wire_bytes += n * width(wire);
    ++reductions;
    return ForwardingComm::start_reduce_scatter_sum_v(buf, counts, wire);
  }
  std::unique_ptr<CommRequest> start_all_gather_v(void* buf, std::span<const std::size_t> counts,
                                                  CommType type) override {
    for (std::size_t n : counts) wire_bytes += n * width(type);
    started_gather();
    return ForwardingComm::start_all_gather_v(buf, counts, type);
  }
  std::unique_ptr<CommRequest> start_all_reduce_sum(float* buf, std::size_t count,
                                                    CommType wire) override {
    wire_bytes += count * width(wire);
    ++reductions;
    return ForwardingComm::start_all_reduce_sum(buf, count, wire);
  }
  void reduce_scatter_int(void* buf, std::size_t count_per_rank, IntOp op) override {
    int_bytes += count_per_rank * ranks() * width(op);
    ForwardingComm::reduce_scatter_int(buf, count_per_rank, op);
  }
  void all_reduce_int(void* buf, std::size_t count, IntOp op) override {
    int_bytes += count * width(op);
    ForwardingComm::all_reduce_int(buf, count, op);
  }
  bool reduce_scatter_combine(const void* in, std::size_t elem_bytes, float* out,
                              std::size_t count_per_rank, BlockCombiner& op) override {
    if (refuse_combine) return false;
    const bool done = ForwardingComm::reduce_scatter_combine(in, elem_bytes, out, count_per_rank, op);
    if (done) combine_bytes += count_per_rank * ranks() * elem_bytes;
    return done;
  }
  bool reduce_scatter_combine_pair(const void* in, std::size_t elem_bytes, const void* in2,
                                   std::size_t elem_bytes2, float* out, std::size_t count_per_rank,
                                   BlockCombiner& op) override {
    if (refuse_combine || refuse_pairs) return false;
    const bool done = ForwardingComm::reduce_scatter_combine_pair(in, elem_bytes, in2, elem_bytes2, out,
                                                                  count_per_rank, op);
    if (done) {
      combine_bytes += count_per_rank * ranks() * (elem_bytes + elem_bytes2);
      ++combine_pairs;
    }
    return done;
  }
  Allocation allocate_collective_buffer(MemoryTracker* tracker, MemCategory category,
                                        std::size_t bytes) override {
    Allocation a = ForwardingComm::allocate_collective_buffer(tracker, category, bytes);
    if (a.data()) ++windows;
    return a;
  }

 private:
  std::size_t ranks() const { return static_cast<std::size_t>(size()); }
  static std::size_t width(CommType t) {
    switch (t) {
      case CommType::F32: return 4;
      case CommType::F64: return 8;
      case CommType::U8: return 1;
      default: return 2;  // U16, BF16
    }
  }
  static std::size_t width(IntOp op) { return op == IntOp::SumI64 ? 8 : 1; }
  void started_gather() {
    ++gathers;
    gather_calls.emplace_back(CallScope::current());
  }
};

/// Forwards everything except the uneven collectives, which run the base class's composed
/// default (Communicator::start_reduce_scatter_sum_v and start_all_gather_v, built from this
/// communicator's all-reduce and broadcasts).
class ComposedOnlyComm final : public ForwardingComm {
 public:
  using ForwardingComm::ForwardingComm;
  std::string name() const override { return ForwardingComm::name() + " (composed)"; }
  std::unique_ptr<CommRequest> start_reduce_scatter_sum_v(float* buf,
                                                          std::span<const std::size_t> counts,
                                                          CommType wire) override {
    return Communicator::start_reduce_scatter_sum_v(buf, counts, wire);
  }
  std::unique_ptr<CommRequest> start_all_gather_v(void* buf, std::span<const std::size_t> counts,
                                                  CommType type) override {
    return Communicator::start_all_gather_v(buf, counts, type);
  }
};

}  // namespace shardopt::test
