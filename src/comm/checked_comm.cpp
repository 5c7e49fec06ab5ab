// checked_comm.cpp: the debugging decorator of make_checked_communicator(): before every
// collective, all ranks compare what they are about to enter.
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "describe.hpp"
#include "shardopt/comm.hpp"
#include "shardopt/layout.hpp"  // fnv1a64

namespace shardopt {
namespace {

enum class Op : std::uint32_t {
  ReduceScatterSum, AllGather, AllReduceSumStarted, AllReduceSum, AllReduceSumHost,
  AllGatherBytes, BroadcastBytes, Barrier, AllocateCollectiveBuffer, ReduceScatterInt,
  AllReduceInt, ReduceScatterCombine, ReduceScatterSumV, AllGatherV, ReduceScatterCombinePair,
};

const char* op_name(Op op) {
  switch (op) {
    case Op::ReduceScatterSum: return "reduce_scatter_sum";
    case Op::AllGather: return "all_gather";
    case Op::AllReduceSumStarted: return "start_all_reduce_sum";
    case Op::AllReduceSum: return "all_reduce_sum";
    case Op::AllReduceSumHost: return "all_reduce_sum_host";
    case Op::AllGatherBytes: return "all_gather_bytes";
    case Op::BroadcastBytes: return "broadcast_bytes";
    case Op::Barrier: return "barrier";
    case Op::AllocateCollectiveBuffer: return "allocate_collective_buffer";
    case Op::ReduceScatterInt: return "reduce_scatter_int";
    case Op::AllReduceInt: return "all_reduce_int";
    case Op::ReduceScatterCombine: return "reduce_scatter_combine";
    case Op::ReduceScatterSumV: return "reduce_scatter_sum_v";
    case Op::AllGatherV: return "all_gather_v";
    case Op::ReduceScatterCombinePair: return "reduce_scatter_combine_pair";
  }
  return "?";
}

const char* type_name(CommType t) {
  switch (t) {
    case CommType::F32: return "f32";
    case CommType::F64: return "f64";
    case CommType::U16: return "u16";
    case CommType::U8: return "bytes";
    case CommType::BF16: return "bf16 wire";
  }
  return "?";
}

// What a rank is entering; compared field by field across ranks.
struct Entry {
  std::uint64_t seq;   // collectives this rank entered on the communicator before
  std::uint32_t op;
  std::uint32_t type;
  std::uint64_t count;
  std::int64_t root;   // broadcast_bytes: the root; the uneven ones: their counts' hash; else 0
};
static_assert(sizeof(Entry) == 32);

std::string describe(const Entry& e) {
  const Op op = static_cast<Op>(e.op);
  std::string s = op_name(op);
  switch (op) {
    case Op::Barrier: return s + "()";
    case Op::ReduceScatterInt:
    case Op::AllReduceInt:
      return s + "(" + std::to_string(e.count) + (op == Op::ReduceScatterInt ? " per rank, " : " ") +
             (static_cast<IntOp>(e.type) == IntOp::SumI64 ? "sum i64" : "max u8") + ")";
    case Op::ReduceScatterSum:
    case Op::ReduceScatterCombine:
    case Op::AllGather:
      return s + "(" + std::to_string(e.count) + " per rank, " +
             type_name(static_cast<CommType>(e.type)) + ")";
    case Op::ReduceScatterSumV:
    case Op::AllGatherV: {
      char hash[24];
      std::snprintf(hash, sizeof hash, "%016llx",
                    static_cast<unsigned long long>(static_cast<std::uint64_t>(e.root)));
      return s + "(" + std::to_string(e.count) + " in all, counts #" + hash + ", " +
             type_name(static_cast<CommType>(e.type)) + ")";
    }
    case Op::BroadcastBytes:
      return s + "(" + std::to_string(e.count) + " bytes, root " + std::to_string(e.root) + ")";
    default:
      return s + "(" + std::to_string(e.count) + " " + type_name(static_cast<CommType>(e.type)) +
             ")";
  }
}

class CheckedCommunicator final : public Communicator {
 public:
  explicit CheckedCommunicator(std::shared_ptr<Communicator> inner) : in_(std::move(inner)) {
    require(in_ != nullptr, Status::InvalidArgument,
            "make_checked_communicator: null communicator");
  }

  int rank() const override { return in_->rank(); }
  int size() const override { return in_->size(); }
  std::string name() const override { return in_->name() + " (checked)"; }
  bool device_buffers() const override { return in_->device_buffers(); }
  void* device_stream() const override { return in_->device_stream(); }
  void set_collective_timeout(double seconds) override { in_->set_collective_timeout(seconds); }
  std::uint64_t internode_bytes() const override { return in_->internode_bytes(); }

  std::unique_ptr<CommRequest> start_reduce_scatter_sum(float* buf, std::size_t count,
                                                        CommType wire) override {
    check(Op::ReduceScatterSum, wire, count);
    return in_->start_reduce_scatter_sum(buf, count, wire);
  }
  std::unique_ptr<CommRequest> start_all_gather(void* buf, std::size_t count,
                                                CommType type) override {
    check(Op::AllGather, type, count);
    return in_->start_all_gather(buf, count, type);
  }
  // The uneven ones compare the total and a hash of the counts (their number included).
  std::unique_ptr<CommRequest> start_reduce_scatter_sum_v(float* buf,
                                                          std::span<const std::size_t> counts,
                                                          CommType wire) override {
    check_v(Op::ReduceScatterSumV, wire, counts);
    return in_->start_reduce_scatter_sum_v(buf, counts, wire);
  }
  std::unique_ptr<CommRequest> start_all_gather_v(void* buf, std::span<const std::size_t> counts,
                                                  CommType type) override {
    check_v(Op::AllGatherV, type, counts);
    return in_->start_all_gather_v(buf, counts, type);
  }
  std::unique_ptr<CommRequest> start_all_reduce_sum(float* buf, std::size_t count,
                                                    CommType wire) override {
    check(Op::AllReduceSumStarted, wire, count);
    return in_->start_all_reduce_sum(buf, count, wire);
  }
  void all_reduce_sum(void* buf, std::size_t count, CommType type) override {
    check(Op::AllReduceSum, type, count);
    in_->all_reduce_sum(buf, count, type);
  }
  // The integer ops record their IntOp in the type field (0: sum i64, 1: max u8).
  void reduce_scatter_int(void* buf, std::size_t count, IntOp op) override {
    check(Op::ReduceScatterInt, static_cast<CommType>(op), count);
    in_->reduce_scatter_int(buf, count, op);
  }
  void all_reduce_int(void* buf, std::size_t count, IntOp op) override {
    check(Op::AllReduceInt, static_cast<CommType>(op), count);
    in_->all_reduce_int(buf, count, op);
  }
  bool reduce_scatter_combine(const void* in, std::size_t elem_bytes, float* out, std::size_t count,
                              BlockCombiner& op) override {
    check(Op::ReduceScatterCombine, elem_bytes == 8 ? CommType::F64 : CommType::F32, count);
    return in_->reduce_scatter_combine(in, elem_bytes, out, count, op);
  }
  bool reduce_scatter_combine_pair(const void* in, std::size_t elem_bytes, const void* in2,
                                   std::size_t elem_bytes2, float* out, std::size_t count,
                                   BlockCombiner& op) override {
    check(Op::ReduceScatterCombinePair, elem_bytes == 8 ? CommType::F64 : CommType::F32, count);
    return in_->reduce_scatter_combine_pair(in, elem_bytes, in2, elem_bytes2, out, count, op);
  }
  void all_reduce_sum_host(double* buf, std::size_t count) override {
    check(Op::AllReduceSumHost, CommType::F64, count);
    in_->all_reduce_sum_host(buf, count);
  }
  void all_gather_bytes(const void* send, void* recv, std::size_t bytes) override {
    check(Op::AllGatherBytes, CommType::U8, bytes);
    in_->all_gather_bytes(send, recv, bytes);
  }
  void broadcast_bytes(void* buf, std::size_t bytes, int root) override {
    check(Op::BroadcastBytes, CommType::U8, bytes, root);
    in_->broadcast_bytes(buf, bytes, root);
  }
  void barrier() override {
    check(Op::Barrier, CommType::U8, 0);
    in_->barrier();
  }
  Allocation allocate_collective_buffer(MemoryTracker* tracker, MemCategory category,
                                        std::size_t bytes) override {
    check(Op::AllocateCollectiveBuffer, CommType::U8, bytes);
    return in_->allocate_collective_buffer(tracker, category, bytes);
  }
  std::vector<Allocation> allocate_collective_buffers(
      MemoryTracker* tracker, std::span<const BufferRequest> requests) override {
    std::size_t total = 0;
    for (const BufferRequest& r : requests) total += r.bytes;
    check(Op::AllocateCollectiveBuffer, CommType::U8, total);
    return in_->allocate_collective_buffers(tracker, requests);
  }

 private:
  void check_v(Op op, CommType type, std::span<const std::size_t> counts) {
    std::uint64_t total = 0;
    std::vector<std::uint64_t> c(counts.size() + 1);
    c[0] = counts.size();
    for (std::size_t r = 0; r < counts.size(); ++r) {
      c[r + 1] = counts[r];
      total += counts[r];
    }
    const std::uint64_t hash = fnv1a64(c.data(), c.size() * sizeof c[0]);
    check(op, type, static_cast<std::size_t>(total), static_cast<std::int64_t>(hash));
  }

  // Every rank gathers every rank's entry and decides from the same data, so all of them
  // throw the same Error or none does.
  void check(Op op, CommType type, std::size_t count, std::int64_t root = 0) {
    Entry mine{};
    mine.seq = seq_++;
    mine.op = static_cast<std::uint32_t>(op);
    mine.type = static_cast<std::uint32_t>(type);
    mine.count = count;
    mine.root = root;
    std::vector<Entry> all(static_cast<std::size_t>(size()));
    in_->all_gather_bytes(&mine, all.data(), sizeof mine);
    bool same = true;
    for (const Entry& e : all) same = same && std::memcmp(&e, &all[0], sizeof e) == 0;
    if (same) return;
    std::vector<std::string> entered;
    // (A rank that entered through another wrapper counts from elsewhere: its number shows.)
    for (const Entry& e : all)
      entered.push_back(describe(e) +
                        (e.seq != mine.seq ? " as collective #" + std::to_string(e.seq) : ""));
    throw Error(Status::InvalidState, "debug_collectives: collective #" + std::to_string(mine.seq) +
                                          " on " + in_->name() + " differs across ranks: " +
                                          values_by_rank(entered));
  }

  std::shared_ptr<Communicator> in_;
  std::uint64_t seq_ = 0;
};

}  // namespace

std::shared_ptr<Communicator> make_checked_communicator(std::shared_ptr<Communicator> inner) {
  return std::make_shared<CheckedCommunicator>(std::move(inner));
}

}  // namespace shardopt
