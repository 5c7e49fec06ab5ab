// c10d_comm.cpp: shardopt's Communicator over a LibTorch c10d process group (see the header).
//
// Host buffers are wrapped in tensors with torch::from_blob (no copies) wherever the group
// reads or writes them directly. What LibTorch 1.13's gloo group lacks, and what replaces it:
//   reduce_scatter / _reduce_scatter_base: not supported. The reduce-scatter is an all-to-all
//     (alltoall_base, equal splits) of the blocks into a scratch tensor, then a local sum in
//     rank order 0..N-1 written into block rank(): deterministic, and the same bytes on the
//     wire as a ring reduce-scatter. Never an all-reduce.
//   _allgather_base: not supported. The all-gather is allgather() with one output tensor per
//     block, each a view of the caller's buffer (gloo stages them through one flat tensor).
//   bfloat16 tensors ("Invalid scalar type"): the bf16 wire travels as bytes, and its sums
//     are computed here, each partial sum rounded to bf16 as the MPI communicator's.
// Scratch memory is owned by tensors that the c10d work item references too, so it outlives
// an operation that a timeout abandoned.
#include "shardopt/torch/c10d_comm.hpp"

#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torch/torch.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <limits>
#include <optional>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include "shardopt/bf16.hpp"
#include "shardopt/error.hpp"

namespace shardopt::libtorch {
namespace {

// The message of a c10d failure, without c10's backtrace.
std::string what_of(const std::exception& e) {
  if (const auto* c = dynamic_cast<const c10::Error*>(&e)) return c->what_without_backtrace();
  return e.what();
}

// In a catch block: rethrows a shardopt::Error as is, anything else as
// Error(Communication, "c10d <op>: <what>").
// The library call this rank is in (CallScope), as " in <call>", or "".
std::string in_call() {
  const std::string call = CallScope::current();
  return call.empty() ? call : " in " + call;
}

[[noreturn]] void rethrow_as_communication(const std::string& op) {
  try {
    throw;
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    throw Error(Status::Communication, "c10d " + op + in_call() + ": " + what_of(e));
  } catch (...) {
    throw Error(Status::Communication, "c10d " + op + in_call() + ": unknown exception");
  }
}

// A tensor viewing `bytes` bytes at `data` (no copy, no ownership).
torch::Tensor view_bytes(void* data, std::size_t bytes) {
  return torch::from_blob(data, {static_cast<std::int64_t>(bytes)},
                          torch::TensorOptions().dtype(torch::kByte));
}

// A tensor viewing `n` elements of `type` at `data` (no copy, no ownership).
torch::Tensor view(void* data, std::size_t n, torch::ScalarType type) {
  return torch::from_blob(data, {static_cast<std::int64_t>(n)}, torch::TensorOptions().dtype(type));
}

// Scratch memory owned by a tensor (uninitialised).
torch::Tensor scratch_bytes(std::size_t bytes) {
  return torch::empty({static_cast<std::int64_t>(bytes)}, torch::TensorOptions().dtype(torch::kByte));
}

template <class T>
T* data_of(const torch::Tensor& t) {
  return reinterpret_cast<T*>(t.data_ptr<std::uint8_t>());
}

std::chrono::milliseconds to_ms(double seconds) {
  return std::chrono::milliseconds(static_cast<std::int64_t>(std::ceil(seconds * 1000.0)));
}

// ---- local reductions of an all-to-all's result ----------------------------------------------
// `received` holds `ranks` blocks of `count` elements: block j is rank j's copy of this rank's
// block. Every element is reduced over j = 0, 1, ..., ranks-1 in that order.

void sum_f32_in_rank_order(const float* received, int ranks, std::size_t count, float* out) {
  for (std::size_t k = 0; k < count; ++k) {
    float acc = received[k];
    for (std::size_t j = 1; j < static_cast<std::size_t>(ranks); ++j) acc += received[j * count + k];
    out[k] = acc;
  }
}

// The bf16 wire's sum of element k: each partial sum computed in fp32 and rounded to bf16.
std::uint16_t bf16_sum_in_rank_order(const std::uint16_t* received, int ranks, std::size_t count,
                                     std::size_t k) {
  std::uint16_t acc = received[k];
  for (std::size_t j = 1; j < static_cast<std::size_t>(ranks); ++j)
    acc = float_to_bf16_bits(bf16_bits_to_float(acc) + bf16_bits_to_float(received[j * count + k]));
  return acc;
}

void sum_i64_in_rank_order(const std::int64_t* received, int ranks, std::size_t count,
                           std::int64_t* out) {
  for (std::size_t k = 0; k < count; ++k) {
    std::int64_t acc = 0;
    for (std::size_t j = 0; j < static_cast<std::size_t>(ranks); ++j) acc += received[j * count + k];
    out[k] = acc;
  }
}

void max_u8(const std::uint8_t* received, int ranks, std::size_t count, std::uint8_t* out) {
  for (std::size_t k = 0; k < count; ++k) {
    std::uint8_t m = 0;
    for (std::size_t j = 0; j < static_cast<std::size_t>(ranks); ++j)
      m = std::max(m, received[j * count + k]);
    out[k] = m;
  }
}

// ---- requests -----------------------------------------------------------------------------------

// A started c10d operation and what completes it on this side (the local sum of a
// reduce-scatter, the conversion back from bf16). `finish` owns the scratch tensors it reads
// (the work item references them too).
class C10dRequest final : public CommRequest {
 public:
  C10dRequest(std::string op, c10::intrusive_ptr<c10d::Work> work, std::function<void()> finish,
              std::chrono::milliseconds timeout)
      : op_(std::move(op)), work_(std::move(work)), finish_(std::move(finish)), timeout_(timeout) {}
  ~C10dRequest() override {
    if (done_) return;
    try {
      wait();
    } catch (...) {  // a destructor must not throw; the error was the caller's to collect
    }
  }
  bool test() override {
    if (done_) return true;
    bool completed = false;
    try {
      completed = work_->isCompleted();
    } catch (...) {
      rethrow_as_communication(op_);
    }
    if (completed) wait();  // collects a failure, runs the local finishing step
    return done_;
  }
  void wait() override {
    if (done_) return;
    done_ = true;  // once: a failure is reported by this call only
    try {
      // kNoTimeout (0) waits until gloo itself gives up (the group's timeout).
      work_->wait(timeout_);
    } catch (...) {
      rethrow_as_communication(op_ + (timeout_ == ::kNoTimeout
                                          ? std::string()
                                          : " (timeout " + std::to_string(timeout_.count()) + " ms)"));
    }
    if (finish_) finish_();
  }

 private:
  std::string op_;
  c10::intrusive_ptr<c10d::Work> work_;
  std::function<void()> finish_;
  std::chrono::milliseconds timeout_;
  bool done_ = false;
};

// ---- the communicator ---------------------------------------------------------------------------

class C10dCommunicator final : public Communicator {
 public:
  explicit C10dCommunicator(c10::intrusive_ptr<c10d::ProcessGroup> group)
      : group_(std::move(group)), rank_(group_->getRank()), size_(group_->getSize()) {}

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string name() const override { return "c10d:" + group_->getBackendName(); }

  // An all-to-all of the blocks, then the sum of the received copies of block rank() in rank
  // order, written into block rank().
  std::unique_ptr<CommRequest> start_reduce_scatter_sum(float* buf, std::size_t count,
                                                        CommType wire) override {
    require(wire == CommType::F32 || wire == CommType::BF16, Status::InvalidArgument,
            "reduce_scatter: wire F32 or BF16");
    if (count == 0) return completed_request();
    const std::size_t n = count * static_cast<std::size_t>(size_);
    float* own = buf + static_cast<std::size_t>(rank_) * count;
    const int ranks = size_;
    if (wire == CommType::F32) {
      torch::Tensor received = scratch_bytes(n * sizeof(float));
      return start_all_to_all("reduce_scatter", view_bytes(buf, n * sizeof(float)), received,
                              [received, ranks, count, own] {
                                sum_f32_in_rank_order(data_of<float>(received), ranks, count, own);
                              });
    }
    // bf16 wire: every block travels as bf16; the sum rounds every partial sum to bf16.
    torch::Tensor sent = scratch_bytes(n * 2), received = scratch_bytes(n * 2);
    auto* s = data_of<std::uint16_t>(sent);
    for (std::size_t k = 0; k < n; ++k) s[k] = float_to_bf16_bits(buf[k]);
    return start_all_to_all("reduce_scatter", sent, received, [received, ranks, count, own] {
      const auto* r = data_of<std::uint16_t>(received);
      for (std::size_t k = 0; k < count; ++k)
        own[k] = bf16_bits_to_float(bf16_sum_in_rank_order(r, ranks, count, k));
    });
  }

  std::unique_ptr<CommRequest> start_all_gather(void* buf, std::size_t count,
                                                CommType type) override {
    require(type == CommType::F32 || type == CommType::U16, Status::InvalidArgument,
            "all_gather: type F32 or U16");
    if (count == 0) return completed_request();
    return start_all_gather_blocks("all_gather", buf, count * (type == CommType::F32 ? 4 : 2));
  }

  std::unique_ptr<CommRequest> start_all_reduce_sum(float* buf, std::size_t count,
                                                    CommType wire) override {
    require(wire == CommType::F32 || wire == CommType::BF16, Status::InvalidArgument,
            "all_reduce: wire F32 or BF16");
    if (count == 0) return completed_request();
    if (wire == CommType::F32) {
      std::vector<torch::Tensor> t{view(buf, count, torch::kFloat)};
      return start("all_reduce", [&] { return group_->allreduce(t); }, nullptr);
    }
    // bf16 wire: a reduce-scatter of bf16 blocks (all-to-all + sum in rank order) and an
    // all-gather of the bf16 sums. The second collective needs the first's result, so this
    // one completes before it returns.
    const std::size_t s = static_cast<std::size_t>(size_);
    const std::size_t block = (count + s - 1) / s;
    torch::Tensor wire_buf = scratch_bytes(block * s * 2), received = scratch_bytes(block * s * 2);
    auto* w = data_of<std::uint16_t>(wire_buf);
    for (std::size_t k = 0; k < count; ++k) w[k] = float_to_bf16_bits(buf[k]);
    std::fill(w + count, w + block * s, std::uint16_t{0});
    start_all_to_all("all_reduce", wire_buf, received, nullptr)->wait();
    const auto* r = data_of<std::uint16_t>(received);
    std::uint16_t* own = w + static_cast<std::size_t>(rank_) * block;
    for (std::size_t k = 0; k < block; ++k) own[k] = bf16_sum_in_rank_order(r, size_, block, k);
    start_all_gather_blocks("all_reduce", w, block * 2)->wait();
    for (std::size_t k = 0; k < count; ++k) buf[k] = bf16_bits_to_float(w[k]);
    return completed_request();
  }

  void all_reduce_sum(void* buf, std::size_t count, CommType type) override {
    require(type == CommType::F32 || type == CommType::F64, Status::InvalidArgument,
            "all_reduce_sum: type F32 or F64");
    if (count == 0) return;
    std::vector<torch::Tensor> t{
        view(buf, count, type == CommType::F32 ? torch::kFloat : torch::kDouble)};
    start("all_reduce_sum", [&] { return group_->allreduce(t); }, nullptr)->wait();
  }

  // As the reduce-scatter: an all-to-all, then the reduction in rank order (exact for these
  // integer operations in any order).
  void reduce_scatter_int(void* buf, std::size_t count, IntOp op) override {
    require(op == IntOp::SumI64 || op == IntOp::MaxU8, Status::InvalidArgument,
            "reduce_scatter_int: unknown operation");
    if (count == 0) return;
    const std::size_t elem = op == IntOp::SumI64 ? sizeof(std::int64_t) : 1;
    const std::size_t bytes = count * static_cast<std::size_t>(size_) * elem;
    torch::Tensor received = scratch_bytes(bytes);
    start_all_to_all("reduce_scatter_int", view_bytes(buf, bytes), received, nullptr)->wait();
    char* own = static_cast<char*>(buf) + static_cast<std::size_t>(rank_) * count * elem;
    if (op == IntOp::SumI64)
      sum_i64_in_rank_order(data_of<std::int64_t>(received), size_, count,
                            reinterpret_cast<std::int64_t*>(own));
    else
      max_u8(data_of<std::uint8_t>(received), size_, count, reinterpret_cast<std::uint8_t*>(own));
  }

  // Reproducible mode's direct exchange: the all-to-all, then the owner combines the
  // elements of its block.
  bool reduce_scatter_combine(const void* in, std::size_t elem_bytes, float* out, std::size_t count,
                              BlockCombiner& op) override {
    if (count == 0) return true;
    const std::size_t bytes = count * static_cast<std::size_t>(size_) * elem_bytes;
    torch::Tensor received = scratch_bytes(bytes);
    start_all_to_all("reduce_scatter_combine", view_bytes(const_cast<void*>(in), bytes), received, nullptr)->wait();
    const char* all = data_of<char>(received);
    std::vector<const void*> src(static_cast<std::size_t>(size_));
    for (int r = 0; r < size_; ++r)
      src[static_cast<std::size_t>(r)] = all + static_cast<std::size_t>(r) * count * elem_bytes;
    op.combine(out + static_cast<std::size_t>(rank_) * count, src.data(), size_, count);
    return true;
  }

  void all_reduce_int(void* buf, std::size_t count, IntOp op) override {
    require(op == IntOp::SumI64 || op == IntOp::MaxU8, Status::InvalidArgument,
            "all_reduce_int: unknown operation");
    if (count == 0) return;
    c10d::AllreduceOptions o;
    o.reduceOp = op == IntOp::SumI64 ? c10d::ReduceOp::SUM : c10d::ReduceOp::MAX;
    std::vector<torch::Tensor> t{
        view(buf, count, op == IntOp::SumI64 ? torch::kLong : torch::kByte)};
    start("all_reduce_int", [&] { return group_->allreduce(t, o); }, nullptr)->wait();
  }

  void all_gather_bytes(const void* send, void* recv, std::size_t bytes) override {
    if (bytes == 0) return;
    char* mine = static_cast<char*>(recv) + static_cast<std::size_t>(rank_) * bytes;
    if (mine != send) std::memmove(mine, send, bytes);
    start_all_gather_blocks("all_gather_bytes", recv, bytes)->wait();
  }

  void broadcast_bytes(void* buf, std::size_t bytes, int root) override {
    require(root >= 0 && root < size_, Status::InvalidArgument,
            "broadcast_bytes: root " + std::to_string(root) + " is not a rank of " +
                std::to_string(size_));
    if (bytes == 0) return;
    c10d::BroadcastOptions o;
    o.rootRank = root;
    std::vector<torch::Tensor> t{view_bytes(buf, bytes)};
    start("broadcast_bytes", [&] { return group_->broadcast(t, o); }, nullptr)->wait();
  }

  void barrier() override {
    start("barrier", [&] { return group_->barrier(); }, nullptr)->wait();
  }

  // c10d groups cannot change their own timeout once made: this bounds each wait instead.
  void set_collective_timeout(double seconds) override {
    require(std::isfinite(seconds) && seconds >= 0, Status::InvalidArgument,
            "set_collective_timeout: seconds must be >= 0");
    timeout_ = seconds > 0 ? std::max(to_ms(seconds), std::chrono::milliseconds(1)) : ::kNoTimeout;
  }

 private:
  // Launches a c10d operation; its failure to start is an Error(Communication) too.
  template <class F>
  std::unique_ptr<CommRequest> start(const std::string& op, F&& launch,
                                     std::function<void()> finish) {
    c10::intrusive_ptr<c10d::Work> work;
    try {
      work = launch();
    } catch (...) {
      rethrow_as_communication(op);
    }
    return std::make_unique<C10dRequest>(op, std::move(work), std::move(finish), timeout_);
  }

  // Equal splits: the r-th of size() slices of `send` goes to rank r; the j-th slice of
  // `recv` comes from rank j. Both byte tensors of the same length.
  std::unique_ptr<CommRequest> start_all_to_all(const std::string& op, torch::Tensor send,
                                                torch::Tensor recv, std::function<void()> finish) {
    std::vector<std::int64_t> equal;  // empty: equal splits
    return start(op, [&] { return group_->alltoall_base(recv, send, equal, equal); },
                 std::move(finish));
  }

  // In place: block rank() of `buf` (block_bytes each) holds this rank's data; afterwards
  // every block holds its owner's.
  std::unique_ptr<CommRequest> start_all_gather_blocks(const std::string& op, void* buf,
                                                       std::size_t block_bytes) {
    auto* base = static_cast<char*>(buf);
    std::vector<torch::Tensor> input{
        view_bytes(base + static_cast<std::size_t>(rank_) * block_bytes, block_bytes)};
    std::vector<std::vector<torch::Tensor>> outputs(1);
    for (int r = 0; r < size_; ++r)
      outputs[0].push_back(view_bytes(base + static_cast<std::size_t>(r) * block_bytes, block_bytes));
    return start(op, [&] { return group_->allgather(outputs, input); }, nullptr);
  }

  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  int rank_;
  int size_;
  std::chrono::milliseconds timeout_ = ::kNoTimeout;
};

// ---- construction from the environment ----------------------------------------------------------

// A non-negative integer environment variable, or nullopt if unset or empty; anything else is
// Error(InvalidArgument) naming it.
std::optional<long> env_int(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return std::nullopt;
  char* end = nullptr;
  errno = 0;
  const long x = std::strtol(v, &end, 10);
  require(errno == 0 && *end == '\0' && x >= 0 && x <= std::numeric_limits<int>::max(),
          Status::InvalidArgument,
          std::string("environment variable ") + name + "='" + v +
              "' is not a non-negative whole number");
  return x;
}

// The gloo transport device: SHARDOPT_GLOO_HOST (an address or host name to bind to), else
// GLOO_SOCKET_IFNAME (an interface, as PyTorch reads it), else gloo's default (this
// machine's hostname if it resolves to a usable address, else loopback).
std::shared_ptr<::gloo::transport::Device> gloo_device() {
  if (const char* host = std::getenv("SHARDOPT_GLOO_HOST"); host != nullptr && *host != '\0')
    return c10d::ProcessGroupGloo::createDeviceForHostname(host);
  if (const char* ifname = std::getenv("GLOO_SOCKET_IFNAME"); ifname != nullptr && *ifname != '\0') {
    const std::string first(ifname, std::strcspn(ifname, ","));
    return c10d::ProcessGroupGloo::createDeviceForInterface(first);
  }
  return c10d::ProcessGroupGloo::createDefaultDevice();
}

std::shared_ptr<Communicator> make_gloo(int rank, int size, c10::intrusive_ptr<c10d::Store> store,
                                        double timeout_s) {
  std::shared_ptr<Communicator> comm;
  try {
    auto options = c10d::ProcessGroupGloo::Options::create(to_ms(timeout_s));
    options->devices.push_back(gloo_device());
    auto group = c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, size, options);
    comm = make_c10d_communicator(group);
  } catch (...) {
    rethrow_as_communication("gloo rendezvous");
  }
  comm->set_collective_timeout(timeout_s);
  return comm;
}

void check_args(int rank, int size, double timeout_s) {
  require(size >= 1 && rank >= 0 && rank < size, Status::InvalidArgument,
          "gloo communicator: rank " + std::to_string(rank) + " is not in [0, " +
              std::to_string(size) + ")");
  require(std::isfinite(timeout_s) && timeout_s > 0, Status::InvalidArgument,
          "gloo communicator: timeout_s must be > 0 seconds");
}

}  // namespace

std::shared_ptr<Communicator> make_c10d_communicator(c10::intrusive_ptr<c10d::ProcessGroup> group) {
  require(group.defined(), Status::InvalidArgument, "make_c10d_communicator: no process group");
  return std::make_shared<C10dCommunicator>(std::move(group));
}

std::shared_ptr<Communicator> make_gloo_communicator(int rank, int size,
                                                     const std::string& file_store_path,
                                                     double timeout_s) {
  check_args(rank, size, timeout_s);
  require(!file_store_path.empty(), Status::InvalidArgument,
          "gloo communicator: no rendezvous file (empty path)");
  c10::intrusive_ptr<c10d::Store> store;
  try {
    store = c10::make_intrusive<c10d::FileStore>(file_store_path, size);
    store->setTimeout(to_ms(timeout_s));
  } catch (...) {
    rethrow_as_communication("file store " + file_store_path);
  }
  auto comm = make_gloo(rank, size, store, timeout_s);
  // Once every process has passed the barrier, all of them have connected and nobody reads
  // the file again: rank 0 deletes it, so the path can serve the next run.
  comm->barrier();
  if (rank == 0) {
    std::error_code ignored;
    std::filesystem::remove(file_store_path, ignored);
  }
  return comm;
}

std::shared_ptr<Communicator> make_gloo_communicator_from_env() {
  std::optional<long> rank, size;
  const char* names[3][2] = {{"RANK", "WORLD_SIZE"},
                             {"PMI_RANK", "PMI_SIZE"},
                             {"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"}};
  for (const auto& pair : names) {
    rank = env_int(pair[0]);
    size = env_int(pair[1]);
    if (rank || size) {
      require(rank && size, Status::InvalidArgument,
              std::string("gloo communicator: ") + (rank ? pair[1] : pair[0]) +
                  " is not set (" + (rank ? pair[0] : pair[1]) + " is)");
      break;
    }
  }
  require(rank.has_value(), Status::InvalidArgument,
          "gloo communicator: no rank in the environment (RANK and WORLD_SIZE, or a launcher's "
          "PMI_RANK/PMI_SIZE or OMPI_COMM_WORLD_RANK/OMPI_COMM_WORLD_SIZE)");
  const int r = static_cast<int>(*rank), n = static_cast<int>(*size);
  double timeout_s = 300.0;
  if (const char* t = std::getenv("SHARDOPT_GLOO_TIMEOUT"); t != nullptr && *t != '\0') {
    char* end = nullptr;
    timeout_s = std::strtod(t, &end);
    require(*end == '\0' && std::isfinite(timeout_s) && timeout_s > 0, Status::InvalidArgument,
            std::string("environment variable SHARDOPT_GLOO_TIMEOUT='") + t +
                "' is not a positive number of seconds");
  }
  check_args(r, n, timeout_s);
  if (const char* file = std::getenv("SHARDOPT_GLOO_FILE"); file != nullptr && *file != '\0')
    return make_gloo_communicator(r, n, file, timeout_s);
  const char* addr = std::getenv("MASTER_ADDR");
  require(addr != nullptr && *addr != '\0', Status::InvalidArgument,
          "gloo communicator: no rendezvous: set SHARDOPT_GLOO_FILE, or MASTER_ADDR and "
          "MASTER_PORT");
  const std::optional<long> port = env_int("MASTER_PORT");
  require(port.has_value(), Status::InvalidArgument,
          "gloo communicator: MASTER_ADDR is set but MASTER_PORT is not");
  require(*port > 0 && *port < 65536, Status::InvalidArgument,
          "environment variable MASTER_PORT=" + std::to_string(*port) + " is not a port");
  c10::intrusive_ptr<c10d::Store> store;
  try {
    c10d::TCPStoreOptions o;
    o.port = static_cast<std::uint16_t>(*port);
    o.isServer = r == 0;
    o.numWorkers = static_cast<std::size_t>(n);
    o.timeout = to_ms(timeout_s);
    store = c10::make_intrusive<c10d::TCPStore>(addr, o);
  } catch (...) {
    rethrow_as_communication(std::string("TCP store ") + addr + ":" + std::to_string(*port));
  }
  return make_gloo(r, n, store, timeout_s);
}

}  // namespace shardopt::libtorch
