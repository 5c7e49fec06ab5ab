// communicator.cpp: what all communicators share.
#include "shardopt/comm.hpp"

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

namespace shardopt {
namespace {

struct CallName {
  int depth = 0;
  char name[64] = {};
};
thread_local CallName call_name;

class CompletedRequest final : public CommRequest {
 public:
  bool test() override { return true; }
  void wait() override {}
};

}  // namespace

void Communicator::reduce_scatter_int(void*, std::size_t, IntOp) {
  throw Error(Status::Unsupported,
              "reduce_scatter_int: the " + name() + " communicator has no integer reductions "
              "(reproducible mode needs a host communicator)");
}

bool Communicator::reduce_scatter_combine(const void*, std::size_t, float*, std::size_t,
                                          BlockCombiner&) {
  return false;
}

bool Communicator::reduce_scatter_combine_pair(const void*, std::size_t, const void*, std::size_t,
                                               float*, std::size_t, BlockCombiner&) {
  return false;
}

void Communicator::all_reduce_int(void*, std::size_t, IntOp) {
  throw Error(Status::Unsupported,
              "all_reduce_int: the " + name() + " communicator has no integer reductions "
              "(reproducible mode needs a host communicator)");
}

std::vector<std::size_t> uneven_offsets(std::span<const std::size_t> counts, int ranks,
                                        const char* what) {
  require(counts.size() == static_cast<std::size_t>(ranks), Status::InvalidArgument,
          std::string(what) + ": " + std::to_string(counts.size()) + " counts for " +
              std::to_string(ranks) + " ranks");
  std::vector<std::size_t> off(counts.size() + 1, 0);
  for (std::size_t r = 0; r < counts.size(); ++r) off[r + 1] = off[r] + counts[r];
  return off;
}

// The default uneven reduce-scatter: an all-reduce of the whole buffer leaves every block
// summed, this rank's among them. In place, on any communicator (device buffers too), with
// the same wires; it moves about twice the bytes of a reduce-scatter, which is what the
// communicators with their own form avoid.
std::unique_ptr<CommRequest> Communicator::start_reduce_scatter_sum_v(
    float* buf, std::span<const std::size_t> counts, CommType wire) {
  const std::vector<std::size_t> off = uneven_offsets(counts, size(), "reduce_scatter_sum_v");
  require(wire == CommType::F32 || wire == CommType::BF16, Status::InvalidArgument,
          "reduce_scatter_sum_v: wire F32 or BF16");
  if (off.back() == 0) return completed_request();
  return start_all_reduce_sum(buf, off.back(), wire);
}

// The default uneven all-gather: one broadcast per rank that owns elements (host memory;
// chunked below the MPI int limit), so a single-owner bucket is one broadcast of its bytes.
std::unique_ptr<CommRequest> Communicator::start_all_gather_v(void* buf,
                                                              std::span<const std::size_t> counts,
                                                              CommType type) {
  const std::vector<std::size_t> off = uneven_offsets(counts, size(), "all_gather_v");
  require(type == CommType::F32 || type == CommType::U16, Status::InvalidArgument,
          "all_gather_v: type F32 or U16");
  if (device_buffers())
    throw Error(Status::Unsupported, "all_gather_v: the " + name() +
                                         " communicator has no uneven all-gather of device buffers");
  const std::size_t elem = type == CommType::F32 ? 4 : 2;
  constexpr std::size_t kChunk = std::size_t{1} << 30;  // bytes per broadcast
  for (int r = 0; r < size(); ++r) {
    const std::size_t begin = off[static_cast<std::size_t>(r)] * elem;
    const std::size_t bytes = counts[static_cast<std::size_t>(r)] * elem;
    for (std::size_t at = 0; at < bytes; at += kChunk)
      broadcast_bytes(static_cast<char*>(buf) + begin + at, std::min(kChunk, bytes - at), r);
  }
  return completed_request();
}

std::unique_ptr<CommRequest> Communicator::start_collective(const BatchedCollective& c) {
  using Op = BatchedCollective::Op;
  switch (c.op) {
    case Op::ReduceScatterSum:
      return start_reduce_scatter_sum(static_cast<float*>(c.buf), c.count, c.type);
    case Op::ReduceScatterSumV:
      return start_reduce_scatter_sum_v(static_cast<float*>(c.buf), c.counts, c.type);
    case Op::AllGather: return start_all_gather(c.buf, c.count, c.type);
    case Op::AllGatherV: return start_all_gather_v(c.buf, c.counts, c.type);
    case Op::AllReduceSum: return start_all_reduce_sum(static_cast<float*>(c.buf), c.count, c.type);
  }
  throw Error(Status::InvalidArgument, "start: unknown collective");
}

std::vector<std::unique_ptr<CommRequest>> Communicator::start_batch(
    std::span<const BatchedCollective> batch) {
  std::vector<std::unique_ptr<CommRequest>> requests;
  requests.reserve(batch.size());
  for (const BatchedCollective& c : batch) requests.push_back(start_collective(c));
  return requests;
}

CallScope::CallScope(std::string_view name) noexcept {
  if (call_name.depth++ > 0) return;
  const std::size_t n = std::min(name.size(), sizeof call_name.name - 1);
  std::memcpy(call_name.name, name.data(), n);
  call_name.name[n] = '\0';
}

CallScope::~CallScope() {
  if (--call_name.depth == 0) call_name.name[0] = '\0';
}

const char* CallScope::current() noexcept { return call_name.name; }

std::unique_ptr<CommRequest> completed_request() { return std::make_unique<CompletedRequest>(); }

}  // namespace shardopt
