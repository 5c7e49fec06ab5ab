// c10d_comm.cpp: shardopt's Communicator over a LibTorch c10d process group (see the header).
// Buffers are wrapped in tensors without copies where the group allows it; the reduce-scatter
// is an all-to-all plus a local sum in rank order (gloo 1.13 has no reduce-scatter).
#include "shardopt/torch/c10d_comm.hpp"

#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
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

[[noreturn]] void rethrow_as_communication(const char* op) {
  try {
    throw;
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    throw Error(Status::Communication, std::string("c10d ") + op + ": " + what_of(e));
  }
}

// A tensor over `n` elements of `type` at `data` (no copy, no ownership).
torch::Tensor wrap(void* data, std::size_t n, torch::ScalarType type) {
  return torch::from_blob(data, {static_cast<std::int64_t>(n)}, torch::TensorOptions().dtype(type));
}

std::size_t type_size(CommType t) {
  switch (t) {
    case CommType::F32: return 4;
    case CommType::F64: return 8;
    case CommType::U16: return 2;
    case CommType::U8: return 1;
    case CommType::BF16: return 2;
  }
  return 0;
}

// A started c10d operation and what completes it on this side (the local sum of a
// reduce-scatter, the conversion back from bf16). The scratch tensors live until then.
class C10dRequest final : public CommRequest {
 public:
  C10dRequest(const char* op, c10::intrusive_ptr<c10d::Work> work, std::function<void()> finish,
              std::chrono::milliseconds timeout)
      : op_(op), work_(std::move(work)), finish_(std::move(finish)), timeout_(timeout) {}
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
    if (completed) wait();
    return done_;
  }
  void wait() override {
    if (done_) return;
    done_ = true;  // once: a failure is reported by this call only
    try {
      work_->wait(timeout_);
    } catch (...) {
      rethrow_as_communication(op_);
    }
    if (finish_) finish_();
  }

 private:
  const char* op_;
  c10::intrusive_ptr<c10d::Work> work_;
  std::function<void()> finish_;
  std::chrono::milliseconds timeout_;
  bool done_ = false;
};

class C10dCommunicator final : public Communicator {
 public:
  explicit C10dCommunicator(c10::intrusive_ptr<c10d::ProcessGroup> group)
      : group_(std::move(group)), rank_(group_->getRank()), size_(group_->getSize()) {}

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string name() const override { return "c10d:" + group_->getBackendName(); }

  std::unique_ptr<CommRequest> start_reduce_scatter_sum(float* buf, std::size_t count,
                                                        CommType wire) override {
    require(wire == CommType::F32 || wire == CommType::BF16, Status::InvalidArgument,
            "reduce_scatter: wire F32 or BF16");
    const std::size_t n = count * static_cast<std::size_t>(size_);
    float* own = buf + static_cast<std::size_t>(rank_) * count;
    if (wire == CommType::F32) {
      // Received: block j = rank j's copy of this rank's block; summed in rank order.
      auto received = std::make_shared<std::vector<float>>(n);
      return start_all_to_all("reduce_scatter", buf, received->data(), n * 4, [=, this] {
        sum_blocks(received->data(), own, count);
      });
    }
    // bf16 wire: the blocks travel as bf16; each partial sum is rounded to bf16.
    auto sent = std::make_shared<std::vector<std::uint16_t>>(n);
    auto received = std::make_shared<std::vector<std::uint16_t>>(n);
    for (std::size_t k = 0; k < n; ++k) (*sent)[k] = float_to_bf16_bits(buf[k]);
    return start_all_to_all("reduce_scatter", sent->data(), received->data(), n * 2,
                            [=, this] {
                              (void)sent;
                              sum_blocks_bf16(received->data(), own, count);
                            });
  }

  std::unique_ptr<CommRequest> start_all_gather(void* buf, std::size_t count,
                                                CommType type) override {
    require(type == CommType::F32 || type == CommType::U16, Status::InvalidArgument,
            "all_gather: type F32 or U16");
    return start_all_gather_bytes("all_gather", buf, count * type_size(type));
  }

  std::unique_ptr<CommRequest> start_all_reduce_sum(float* buf, std::size_t count,
                                                    CommType wire) override {
    require(wire == CommType::F32 || wire == CommType::BF16, Status::InvalidArgument,
            "all_reduce: wire F32 or BF16");
    if (wire == CommType::F32) {
      std::vector<torch::Tensor> t{wrap(buf, count, torch::kFloat)};
      return start("all_reduce", [&] { return group_->allreduce(t); }, nullptr);
    }
    // bf16 wire: a reduce-scatter over padded blocks, then an all-gather (blocking).
    const std::size_t s = static_cast<std::size_t>(size_);
    const std::size_t block = (count + s - 1) / s;
    std::vector<float> padded(block * s, 0.0f);
    std::copy(buf, buf + count, padded.begin());
    start_reduce_scatter_sum(padded.data(), block, CommType::BF16)->wait();
    start_all_gather(padded.data(), block, CommType::F32)->wait();
    std::copy(padded.begin(), padded.begin() + static_cast<std::ptrdiff_t>(count), buf);
    return completed_request();
  }

  void all_reduce_sum(void* buf, std::size_t count, CommType type) override {
    require(type == CommType::F32 || type == CommType::F64, Status::InvalidArgument,
            "all_reduce_sum: type F32 or F64");
    std::vector<torch::Tensor> t{
        wrap(buf, count, type == CommType::F32 ? torch::kFloat : torch::kDouble)};
    start("all_reduce", [&] { return group_->allreduce(t); }, nullptr)->wait();
  }

  void reduce_scatter_int(void* buf, std::size_t count, IntOp op) override {
    const std::size_t elem = op == IntOp::SumI64 ? 8 : 1;
    const std::size_t n = count * static_cast<std::size_t>(size_);
    std::vector<std::uint8_t> received(n * elem);
    start_all_to_all("reduce_scatter_int", buf, received.data(), n * elem, nullptr)->wait();
    char* own = static_cast<char*>(buf) + static_cast<std::size_t>(rank_) * count * elem;
    if (op == IntOp::SumI64) {
      auto* out = reinterpret_cast<std::int64_t*>(own);
      const auto* in = reinterpret_cast<const std::int64_t*>(received.data());
      for (std::size_t k = 0; k < count; ++k) {
        std::int64_t acc = 0;
        for (std::size_t r = 0; r < static_cast<std::size_t>(size_); ++r) acc += in[r * count + k];
        out[k] = acc;
      }
    } else {
      auto* out = reinterpret_cast<std::uint8_t*>(own);
      for (std::size_t k = 0; k < count; ++k) {
        std::uint8_t m = 0;
        for (std::size_t r = 0; r < static_cast<std::size_t>(size_); ++r)
          m = std::max(m, received[r * count + k]);
        out[k] = m;
      }
    }
  }

  void all_reduce_int(void* buf, std::size_t count, IntOp op) override {
    c10d::AllreduceOptions o;
    o.reduceOp = op == IntOp::SumI64 ? c10d::ReduceOp::SUM : c10d::ReduceOp::MAX;
    std::vector<torch::Tensor> t{
        wrap(buf, count, op == IntOp::SumI64 ? torch::kLong : torch::kByte)};
    start("all_reduce_int", [&] { return group_->allreduce(t, o); }, nullptr)->wait();
  }

  void all_gather_bytes(const void* send, void* recv, std::size_t bytes) override {
    if (bytes == 0) return;
    char* mine = static_cast<char*>(recv) + static_cast<std::size_t>(rank_) * bytes;
    if (mine != send) std::memmove(mine, send, bytes);
    start_all_gather_bytes("all_gather_bytes", recv, bytes)->wait();
  }

  void broadcast_bytes(void* buf, std::size_t bytes, int root) override {
    require(root >= 0 && root < size_, Status::InvalidArgument, "broadcast: root out of range");
    if (bytes == 0) return;
    c10d::BroadcastOptions o;
    o.rootRank = root;
    std::vector<torch::Tensor> t{wrap(buf, bytes, torch::kByte)};
    start("broadcast", [&] { return group_->broadcast(t, o); }, nullptr)->wait();
  }

  void barrier() override {
    start("barrier", [&] { return group_->barrier(); }, nullptr)->wait();
  }

  void set_collective_timeout(double seconds) override {
    timeout_ = seconds > 0 ? std::chrono::milliseconds(static_cast<std::int64_t>(seconds * 1000))
                           : ::kNoTimeout;
  }

 private:
  template <class F>
  std::unique_ptr<CommRequest> start(const char* op, F&& launch, std::function<void()> finish) {
    c10::intrusive_ptr<c10d::Work> work;
    try {
      work = launch();
    } catch (...) {
      rethrow_as_communication(op);
    }
    return std::make_unique<C10dRequest>(op, std::move(work), std::move(finish), timeout_);
  }

  // Block r of `send` (bytes / size() bytes each) goes to rank r; block j of `recv` comes
  // from rank j.
  std::unique_ptr<CommRequest> start_all_to_all(const char* op, void* send, void* recv,
                                                std::size_t bytes, std::function<void()> finish) {
    torch::Tensor in = wrap(send, bytes, torch::kByte), out = wrap(recv, bytes, torch::kByte);
    std::vector<std::int64_t> equal;  // empty: equal splits
    return start(op, [&] { return group_->alltoall_base(out, in, equal, equal); },
                 std::move(finish));
  }

  // In place: block rank() of `buf` (block_bytes each) holds this rank's data; afterwards
  // every block holds its owner's.
  std::unique_ptr<CommRequest> start_all_gather_bytes(const char* op, void* buf,
                                                      std::size_t block_bytes) {
    std::vector<torch::Tensor> input{
        wrap(static_cast<char*>(buf) + static_cast<std::size_t>(rank_) * block_bytes,
             block_bytes, torch::kByte)};
    std::vector<std::vector<torch::Tensor>> outputs(1);
    for (int r = 0; r < size_; ++r)
      outputs[0].push_back(wrap(static_cast<char*>(buf) + static_cast<std::size_t>(r) * block_bytes,
                                block_bytes, torch::kByte));
    return start(op, [&] { return group_->allgather(outputs, input); }, nullptr);
  }

  void sum_blocks(const float* received, float* own, std::size_t count) const {
    for (std::size_t k = 0; k < count; ++k) {
      float acc = received[k];
      for (std::size_t r = 1; r < static_cast<std::size_t>(size_); ++r) acc += received[r * count + k];
      own[k] = acc;
    }
  }

  void sum_blocks_bf16(const std::uint16_t* received, float* own, std::size_t count) const {
    for (std::size_t k = 0; k < count; ++k) {
      std::uint16_t acc = received[k];
      for (std::size_t r = 1; r < static_cast<std::size_t>(size_); ++r)
        acc = float_to_bf16_bits(bf16_bits_to_float(acc) + bf16_bits_to_float(received[r * count + k]));
      own[k] = bf16_bits_to_float(acc);
    }
  }

  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  int rank_;
  int size_;
  std::chrono::milliseconds timeout_ = ::kNoTimeout;
};

// An integer environment variable, or nullopt if unset; malformed is an error naming it.
std::optional<long> env_int(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return std::nullopt;
  char* end = nullptr;
  const long x = std::strtol(v, &end, 10);
  require(*end == '\0' && x >= 0 && x <= std::numeric_limits<int>::max(), Status::InvalidArgument,
          std::string("environment variable ") + name + "='" + v + "' is not a whole number");
  return x;
}

std::shared_ptr<Communicator> make_gloo(int rank, int size, c10::intrusive_ptr<c10d::Store> store,
                                        double timeout_s) {
  try {
    auto options = c10d::ProcessGroupGloo::Options::create(
        std::chrono::milliseconds(static_cast<std::int64_t>(timeout_s * 1000)));
    const char* host = std::getenv("SHARDOPT_GLOO_HOST");
    options->devices.push_back(host != nullptr && *host != '\0'
                                   ? c10d::ProcessGroupGloo::createDeviceForHostname(host)
                                   : c10d::ProcessGroupGloo::createDefaultDevice());
    auto group = c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, size, options);
    auto comm = make_c10d_communicator(group);
    comm->set_collective_timeout(timeout_s);
    return comm;
  } catch (...) {
    rethrow_as_communication("gloo rendezvous");
  }
}

void check_rank(int rank, int size) {
  require(size >= 1 && rank >= 0 && rank < size, Status::InvalidArgument,
          "gloo communicator: rank " + std::to_string(rank) + " is not in [0, " +
              std::to_string(size) + ")");
}

}  // namespace

std::shared_ptr<Communicator> make_c10d_communicator(c10::intrusive_ptr<c10d::ProcessGroup> group) {
  require(group.defined(), Status::InvalidArgument, "make_c10d_communicator: no process group");
  return std::make_shared<C10dCommunicator>(std::move(group));
}

std::shared_ptr<Communicator> make_gloo_communicator(int rank, int size,
                                                     const std::string& file_store_path,
                                                     double timeout_s) {
  check_rank(rank, size);
  require(!file_store_path.empty(), Status::InvalidArgument, "gloo communicator: no store file");
  require(timeout_s > 0, Status::InvalidArgument, "gloo communicator: timeout must be > 0");
  c10::intrusive_ptr<c10d::Store> store;
  try {
    store = c10::make_intrusive<c10d::FileStore>(file_store_path, size);
  } catch (...) {
    rethrow_as_communication("file store");
  }
  return make_gloo(rank, size, store, timeout_s);
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
  check_rank(r, n);
  double timeout_s = 300.0;
  if (const char* t = std::getenv("SHARDOPT_GLOO_TIMEOUT")) {
    char* end = nullptr;
    timeout_s = std::strtod(t, &end);
    require(*end == '\0' && timeout_s > 0, Status::InvalidArgument,
            std::string("environment variable SHARDOPT_GLOO_TIMEOUT='") + t +
                "' is not a positive number of seconds");
  }
  if (const char* file = std::getenv("SHARDOPT_GLOO_FILE"); file != nullptr && *file != '\0')
    return make_gloo_communicator(r, n, file, timeout_s);
  const char* addr = std::getenv("MASTER_ADDR");
  const std::optional<long> port = env_int("MASTER_PORT");
  require(addr != nullptr && *addr != '\0' && port.has_value(), Status::InvalidArgument,
          "gloo communicator: no rendezvous: set SHARDOPT_GLOO_FILE, or MASTER_ADDR and "
          "MASTER_PORT");
  require(*port > 0 && *port < 65536, Status::InvalidArgument,
          "environment variable MASTER_PORT=" + std::to_string(*port) + " is not a port");
  c10::intrusive_ptr<c10d::Store> store;
  try {
    c10d::TCPStoreOptions o;
    o.port = static_cast<std::uint16_t>(*port);
    o.isServer = r == 0;
    o.numWorkers = static_cast<std::size_t>(n);
    o.timeout = std::chrono::milliseconds(static_cast<std::int64_t>(timeout_s * 1000));
    store = c10::make_intrusive<c10d::TCPStore>(addr, o);
  } catch (...) {
    rethrow_as_communication("TCP store");
  }
  return make_gloo(r, n, store, timeout_s);
}

}  // namespace shardopt::libtorch
