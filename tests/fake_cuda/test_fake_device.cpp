// test_fake_device.cpp: what only the fake device can check (run under mpiexec at 1-3 ranks):
// that it catches what a GPU would punish (host dereference of device memory, a read before
// its wait, a host read before its copy completed, NCCL's in-place and non-blocking rules),
// and that the library on it keeps the stream contract: host waits only for the norm,
// collectives on their own stream overlapping the updates, a trainer stream ordered by an
// event, a refused host communicator, aborts on NCCL errors and timeouts, the launch shape
// from the occupancy calculator.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>
#include <mpi.h>
#include <nccl.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "cuda_backend.hpp"
#include "fake_control.hpp"
#include "launch_config.hpp"
#include "shardopt/cuda_comm.hpp"
#include "shardopt/mpi_comm.hpp"
#include "shardopt/nccl_comm.hpp"
#include "shardopt/optimizer.hpp"
#include "shardopt/shardopt.h"
#include "support/reference.hpp"
#include "support/mpi_world.hpp"

using namespace shardopt;

namespace {

using shardopt::test::world_rank;
using shardopt::test::world_size;

// Collects the fake's problems for the scope of a test that provokes them.
struct Collecting {
  Collecting() { fakecuda::set_collect_problems(true); }
  ~Collecting() {
    fakecuda::take_problems();
    fakecuda::set_collect_problems(false);
  }
};

bool mentions(const std::vector<std::string>& problems, const std::string& what) {
  for (const std::string& p : problems)
    if (p.find(what) != std::string::npos) return true;
  return false;
}

// ---- the fake itself --------------------------------------------------------------------------

TEST(FakeDevice, HostDereferenceOfDeviceMemoryFaults) {
  GTEST_FLAG_SET(death_test_style, "fast");
  float* p = nullptr;
  ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&p), 64), cudaSuccess);
  EXPECT_DEATH({ volatile float x = p[3]; (void)x; }, "");
  EXPECT_DEATH({ p[0] = 1.0f; }, "");
  cudaFree(p);
}

TEST(FakeDevice, ReadBeforeItsWaitIsARace) {
  Collecting c;
  cudaStream_t a, b;
  ASSERT_EQ(cudaStreamCreateWithFlags(&a, cudaStreamNonBlocking), cudaSuccess);
  ASSERT_EQ(cudaStreamCreateWithFlags(&b, cudaStreamNonBlocking), cudaSuccess);
  void *src, *dst;
  ASSERT_EQ(cudaMalloc(&src, 1024), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&dst, 1024), cudaSuccess);
  ASSERT_EQ(cudaMemsetAsync(src, 1, 1024, a), cudaSuccess);
  ASSERT_EQ(cudaMemcpyAsync(dst, src, 1024, cudaMemcpyDeviceToDevice, b), cudaSuccess);
  const auto unordered = fakecuda::take_problems();
  EXPECT_TRUE(mentions(unordered, "race: memcpy DtoD")) << ::testing::PrintToString(unordered);
  // With the event wait, the same pair is ordered.
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  cudaEvent_t e;
  ASSERT_EQ(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), cudaSuccess);
  ASSERT_EQ(cudaMemsetAsync(src, 2, 1024, a), cudaSuccess);
  ASSERT_EQ(cudaEventRecord(e, a), cudaSuccess);
  ASSERT_EQ(cudaStreamWaitEvent(b, e, 0), cudaSuccess);
  ASSERT_EQ(cudaMemcpyAsync(dst, src, 1024, cudaMemcpyDeviceToDevice, b), cudaSuccess);
  EXPECT_TRUE(fakecuda::take_problems().empty());
  ASSERT_EQ(cudaStreamSynchronize(b), cudaSuccess);  // b is non-blocking: the copy below would not wait
  std::vector<unsigned char> host(1024);
  ASSERT_EQ(cudaMemcpy(host.data(), dst, 1024, cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(host[17], 2);
  EXPECT_TRUE(fakecuda::take_problems().empty());
  cudaEventDestroy(e);
  cudaFree(src);
  cudaFree(dst);
  cudaStreamDestroy(a);
  cudaStreamDestroy(b);
}

TEST(FakeDevice, HostReadBeforeTheCopyCompletedSeesNoData) {
  float* d = nullptr;
  float* pinned = nullptr;
  ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&d), 16), cudaSuccess);
  ASSERT_EQ(cudaMallocHost(reinterpret_cast<void**>(&pinned), 16), cudaSuccess);
  const float v[4] = {1, 2, 3, 4};
  ASSERT_EQ(cudaMemcpy(d, v, sizeof v, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpyAsync(pinned, d, sizeof v, cudaMemcpyDeviceToHost, nullptr), cudaSuccess);
  EXPECT_TRUE(std::isnan(pinned[2]));  // not waited for yet
  ASSERT_EQ(cudaStreamSynchronize(nullptr), cudaSuccess);
  EXPECT_EQ(pinned[2], 3.0f);
  cudaFreeHost(pinned);
  cudaFree(d);
}

struct RawNccl {
  ncclComm_t comm = nullptr;
  explicit RawNccl(bool blocking) {
    ncclUniqueId id{};
    if (world_rank() == 0) ncclGetUniqueId(&id);
    MPI_Bcast(&id, sizeof id, MPI_BYTE, 0, MPI_COMM_WORLD);
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = blocking ? 1 : 0;
    rc = ncclCommInitRankConfig(&comm, world_size(), id, world_rank(), &config);
  }
  ~RawNccl() {
    if (comm != nullptr) ncclCommAbort(comm);
  }
  ncclResult_t rc;
};

TEST(FakeNccl, OverlappingBuffersOutsideTheInPlaceFormAreRefused) {
  Collecting c;
  RawNccl n(true);
  ASSERT_EQ(n.rc, ncclSuccess);
  const std::size_t count = 8, total = count * static_cast<std::size_t>(world_size());
  float* buf = nullptr;
  ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&buf), total * 4), cudaSuccess);
  // recvbuff == sendbuff is not NCCL's in-place reduce-scatter (that is sendbuff + rank*count).
  if (world_size() > 1 || world_rank() != 0) {
    EXPECT_EQ(ncclReduceScatter(buf, buf + (world_rank() + 1) % world_size() * count, count,
                                ncclFloat32, ncclSum, n.comm, nullptr),
              ncclInvalidArgument);
    EXPECT_TRUE(mentions(fakecuda::take_problems(), "in-place form"));
  }
  // Host memory is refused.
  std::vector<float> host(total);
  EXPECT_EQ(ncclAllGather(host.data() + world_rank() * count, host.data(), count, ncclFloat32,
                          n.comm, nullptr),
            ncclInvalidArgument);
  EXPECT_TRUE(mentions(fakecuda::take_problems(), "device memory"));
  EXPECT_EQ(ncclGroupEnd(), ncclInvalidUsage);
  EXPECT_TRUE(mentions(fakecuda::take_problems(), "ncclGroupEnd without ncclGroupStart"));
  cudaFree(buf);
}

TEST(FakeNccl, NonBlockingCommunicatorMustSettleBeforeTheNextCall) {
  Collecting c;
  RawNccl n(false);
  ASSERT_EQ(n.rc, ncclInProgress);
  float* buf = nullptr;
  ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&buf), 64), cudaSuccess);
  EXPECT_EQ(ncclAllReduce(buf, buf, 4, ncclFloat32, ncclSum, n.comm, nullptr), ncclInvalidUsage);
  EXPECT_TRUE(mentions(fakecuda::take_problems(), "ncclInProgress"));
  ncclResult_t state = ncclInProgress;
  while (state == ncclInProgress) ASSERT_EQ(ncclCommGetAsyncError(n.comm, &state), ncclSuccess);
  EXPECT_EQ(state, ncclSuccess);
  cudaFree(buf);
}

TEST(FakeNccl, SumsInPlaceLikeNccl) {
  RawNccl n(true);
  ASSERT_EQ(n.rc, ncclSuccess);
  const int world = world_size(), rank = world_rank();
  const std::size_t count = 5, total = count * static_cast<std::size_t>(world);
  std::vector<float> host(total);
  for (std::size_t i = 0; i < total; ++i) host[i] = static_cast<float>(rank * 100) + static_cast<float>(i);
  float* buf = nullptr;
  ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&buf), total * 4), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(buf, host.data(), total * 4, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(ncclReduceScatter(buf, buf + rank * count, count, ncclFloat32, ncclSum, n.comm, nullptr),
            ncclSuccess);
  ASSERT_EQ(ncclAllGather(buf + rank * count, buf, count, ncclFloat32, n.comm, nullptr), ncclSuccess);
  ASSERT_EQ(cudaMemcpy(host.data(), buf, total * 4, cudaMemcpyDeviceToHost), cudaSuccess);
  const float ranks_sum = 100.0f * static_cast<float>(world * (world - 1) / 2);
  for (std::size_t i = 0; i < total; ++i)
    EXPECT_EQ(host[i], ranks_sum + static_cast<float>(world) * static_cast<float>(i)) << i;
  cudaFree(buf);
}

// ---- the library on the fake ----------------------------------------------------------------

const std::vector<std::size_t> kSizes = {300, 7, 500, 129, 64, 1000};

OptimizerOptions cuda_options(Stage stage) {
  OptimizerOptions o;
  o.device = Device::Cuda;
  o.stage = stage;
  o.bucket_elems = 256;
  o.adam.lr = 1e-2;
  o.adam.max_grad_norm = 1.0;
  return o;
}

std::unique_ptr<ShardedOptimizer> make_optimizer(std::shared_ptr<Communicator> comm, Stage stage) {
  auto opt = std::make_unique<ShardedOptimizer>(std::move(comm), cuda_options(stage));
  for (std::size_t i = 0; i < kSizes.size(); ++i) opt->add_param("p" + std::to_string(i), kSizes[i]);
  opt->finalize();
  for (std::size_t i = 0; i < kSizes.size(); ++i) {
    std::vector<float> init(kSizes[i]);
    for (std::size_t k = 0; k < init.size(); ++k) init[k] = test::synth(1, 0, i, k);
    opt->set_param(i, init);
  }
  return opt;
}

// Backward: gradients written with cudaMemcpyAsync from pinned memory on `stream` (nullptr:
// the compute stream), in backward order. `ordered`: the trainer keeps the stream contract
// for a stream of its own: the write waits for the compute stream (the buffer grad()
// returned may have been zeroed or reused there), and the compute stream waits for the
// write before grad_ready().
void backward(ShardedOptimizer& opt, int step, cudaStream_t stream, bool ordered,
              std::vector<float*>& pinned) {
  cudaEvent_t written = nullptr, ready = nullptr;
  cudaEventCreateWithFlags(&written, cudaEventDisableTiming);
  cudaEventCreateWithFlags(&ready, cudaEventDisableTiming);
  for (std::size_t j = kSizes.size(); j-- > 0;) {
    float*& h = pinned[j];
    if (h == nullptr) ASSERT_EQ(cudaMallocHost(reinterpret_cast<void**>(&h), kSizes[j] * 4), cudaSuccess);
    for (std::size_t k = 0; k < kSizes[j]; ++k)
      h[k] = test::synth(static_cast<std::uint64_t>(world_rank()), static_cast<std::uint64_t>(step), j, k);
    const std::span<float> g = opt.grad(j);
    if (stream != nullptr && ordered) {
      cudaEventRecord(ready, nullptr);
      cudaStreamWaitEvent(stream, ready, 0);
    }
    ASSERT_EQ(cudaMemcpyAsync(g.data(), h, g.size_bytes(), cudaMemcpyHostToDevice, stream), cudaSuccess);
    if (stream != nullptr && ordered) {
      cudaEventRecord(written, stream);
      cudaStreamWaitEvent(nullptr, written, 0);
    }
    opt.grad_ready(j);
  }
  cudaEventDestroy(written);
  cudaEventDestroy(ready);
}

TEST(CudaOptimizerOnFake, RefusesHostCommunicatorsAtEverySize) {
  for (auto comm : {make_single_process_communicator(), make_mpi_communicator(MPI_COMM_WORLD)}) {
    try {
      ShardedOptimizer opt(comm, cuda_options(Stage::Zero1));
      FAIL() << "expected Error(InvalidArgument) for " << comm->name();
    } catch (const Error& e) {
      EXPECT_EQ(e.status(), Status::InvalidArgument) << e.what();
      EXPECT_NE(std::string(e.what()).find("Device::Cuda needs a communicator of device buffers"),
                std::string::npos) << e.what();
    }
  }
}

// The stream contract: after the norm's host read, the step waits on the host no more; each
// bucket's all-gather runs on the communicator's stream, unordered with the next bucket's
// update on the compute stream (they can overlap); the trainer's param() reads are ordered.
TEST(CudaOptimizerOnFake, StepWaitsOnlyForTheNormAndOverlapsGathersWithUpdates) {
  for (Stage stage : {Stage::Zero1, Stage::Zero2}) {
    SCOPED_TRACE(stage_name(stage));
    auto opt = make_optimizer(make_nccl_communicator(MPI_COMM_WORLD), stage);
    std::vector<float*> pinned(kSizes.size(), nullptr);
    for (int step = 1; step <= 2; ++step) {
      backward(*opt, step, nullptr, false, pinned);
      const std::size_t mark = fakecuda::log_mark();
      opt->step();
      const std::vector<fakecuda::LogEntry> log = fakecuda::log_since(mark);
      std::size_t first_update = log.size();
      std::vector<std::uint64_t> updates, gathers;
      for (std::size_t i = 0; i < log.size(); ++i) {
        const fakecuda::LogEntry& e = log[i];
        if (e.kind == fakecuda::LogEntry::Queued && e.name == "kernel adam_update") {
          first_update = std::min(first_update, i);
          updates.push_back(e.op);
          EXPECT_EQ(e.stream, 0) << "the update runs on the compute stream";
        }
        if (e.kind == fakecuda::LogEntry::Queued && e.name.rfind("nccl", 0) == 0)
          EXPECT_NE(e.stream, 0) << e.name << " runs on the compute stream";
        if (e.kind == fakecuda::LogEntry::Queued && e.name == "ncclAllGather") gathers.push_back(e.op);
        if (i > first_update)
          EXPECT_EQ(e.kind, fakecuda::LogEntry::Queued) << "host wait after the first update: " << e.name;
      }
      ASSERT_FALSE(updates.empty());
      if (world_size() > 1) {
        ASSERT_EQ(gathers.size(), updates.size());
        // Gather k is queued after update k; update k+1 neither waits for it nor precedes it.
        for (std::size_t k = 0; k + 1 < updates.size(); ++k) {
          EXPECT_TRUE(fakecuda::happens_before(updates[k], gathers[k]));
          EXPECT_FALSE(fakecuda::happens_before(gathers[k], updates[k + 1])) << "bucket " << k;
        }
      }
    }
    for (std::size_t i = 0; i < kSizes.size(); ++i) {
      std::vector<bf16> replica(kSizes[i]);
      const std::span<bf16> p = opt->param<bf16>(i);
      ASSERT_EQ(cudaMemcpy(replica.data(), p.data(), p.size_bytes(), cudaMemcpyDeviceToHost), cudaSuccess);
      std::vector<float> master(kSizes[i]);
      opt->get_master(i, master);
      for (std::size_t k = 0; k < kSizes[i]; ++k) ASSERT_EQ(replica[k].bits, to_bf16(master[k]).bits);
    }
    for (float* h : pinned) cudaFreeHost(h);
  }
}

// A trainer that writes gradients on a stream of its own must order that write after the
// compute stream and the compute stream after the write (events); forgetting is a race the
// fake reports.
TEST(CudaOptimizerOnFake, TrainerStreamMustBeOrderedBeforeGradReady) {
  cudaStream_t trainer;
  ASSERT_EQ(cudaStreamCreateWithFlags(&trainer, cudaStreamNonBlocking), cudaSuccess);
  for (bool ordered : {true, false}) {
    Collecting c;
    auto opt = make_optimizer(make_nccl_communicator(MPI_COMM_WORLD), Stage::Zero2);
    std::vector<float*> pinned(kSizes.size(), nullptr);
    backward(*opt, 1, trainer, ordered, pinned);
    opt->step();
    const auto problems = fakecuda::take_problems();
    if (ordered) {
      EXPECT_TRUE(problems.empty()) << ::testing::PrintToString(problems);
    } else {
      EXPECT_TRUE(mentions(problems, "race:")) << "an unordered gradient write went unnoticed";
    }
    ASSERT_EQ(cudaStreamSynchronize(trainer), cudaSuccess);
    for (float* h : pinned) cudaFreeHost(h);
  }
  cudaStreamDestroy(trainer);
}

// Every rank's message, gathered on every rank ("" from a rank that has none).
std::vector<std::string> all_messages(const std::string& mine) {
  char buf[1024] = {};
  std::strncpy(buf, mine.c_str(), sizeof buf - 1);
  std::vector<char> all(sizeof buf * static_cast<std::size_t>(world_size()));
  MPI_Allgather(buf, sizeof buf, MPI_CHAR, all.data(), sizeof buf, MPI_CHAR, MPI_COMM_WORLD);
  std::vector<std::string> out;
  for (int r = 0; r < world_size(); ++r) out.emplace_back(all.data() + r * sizeof buf);
  return out;
}

// An asynchronous NCCL error on one rank, with no collective timeout: the communicator is
// aborted on every rank, wherever each one is (rank 0 in its first NCCL call; at 3 ranks,
// rank 1 waiting in step()'s agreement, a host MPI collective; the last rank busy outside
// shardopt for longer than the grace period, which finds the notices when it comes back),
// and every rank throws the same Error(Communication) naming rank 0's cause; later calls
// throw it again instead of hanging.
TEST(CudaOptimizerOnFake, NcclAsyncErrorIsTheSameErrorOnEveryRank) {
  const int world = world_size(), rank = world_rank();
  auto comm = make_nccl_communicator(MPI_COMM_WORLD);
  auto opt = make_optimizer(comm, Stage::Zero1);
  if (rank == 0) fakecuda::nccl_inject_async_error(ncclRemoteError);
  if (world > 1 && rank == world - 1) std::this_thread::sleep_for(std::chrono::milliseconds(1500));
  std::vector<float*> pinned(kSizes.size(), nullptr);
  std::string message;
  try {
    backward(*opt, 1, nullptr, false, pinned);
    opt->step();
    ADD_FAILURE() << "expected Error(Communication)";
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), Status::Communication) << e.what();
    message = e.what();
  }
  EXPECT_EQ(message, "NCCL communicator aborted: rank 0: asynchronous error: remote process "
                     "exited or there was a network error");
  for (const std::string& m : all_messages(message)) EXPECT_EQ(m, message);
  try {
    opt->step();
    ADD_FAILURE() << "a step after the abort must throw";
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), Status::Communication) << e.what();
    EXPECT_EQ(std::string(e.what()), message);
  }
  for (float* h : pinned) cudaFreeHost(h);
  opt.reset();
  comm.reset();
  MPI_Barrier(MPI_COMM_WORLD);
}

// The last rank stops calling collectives: the others' NCCL all-reduce does not complete,
// the collective timeout (set_collective_timeout, as ShardedOptimizer sets it from
// collective_timeout_s) aborts the communicator, and every rank that waits throws the same
// Error(Communication) naming the collective and the timeout, within the timeout plus the
// grace period.
TEST(NcclCommunicatorOnFake, TimeoutAbortsWithTheSameErrorOnEveryWaitingRank) {
  const int world = world_size(), rank = world_rank();
  if (world == 1) GTEST_SKIP() << "needs a second rank to stop";
  auto comm = make_nccl_communicator(MPI_COMM_WORLD);
  comm->set_collective_timeout(2.0);
  float* buf = nullptr;
  ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&buf), 64 * sizeof(float)), cudaSuccess);
  const bool stops = rank == world - 1;
  std::string message;
  if (!stops) {
    const auto start = std::chrono::steady_clock::now();
    try {
      comm->all_reduce_sum(buf, 64, CommType::F32);
      ADD_FAILURE() << "expected Error(Communication)";
    } catch (const Error& e) {
      EXPECT_EQ(e.status(), Status::Communication) << e.what();
      message = e.what();
    }
    const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    EXPECT_GE(took, 2.0);
    EXPECT_LT(took, 2.0 + 0.5 + 10.0);  // timeout + grace + slack for a loaded machine
    EXPECT_EQ(message.rfind("NCCL communicator aborted: rank ", 0), 0u) << message;
    EXPECT_NE(message.find("ncclAllReduce (collective #0) did not complete within 2 s"),
              std::string::npos) << message;
    try {
      comm->barrier();
      ADD_FAILURE() << "a host collective after the abort must throw";
    } catch (const Error& e) {
      EXPECT_EQ(std::string(e.what()), message);
    }
  }
  const std::vector<std::string> all = all_messages(message);
  for (int r = 0; r + 1 < world; ++r) EXPECT_EQ(all[static_cast<std::size_t>(r)], all[0]) << "rank " << r;
  // The stopped rank drains the notices sent to it before its communicator goes away.
  cudaFree(buf);
  comm.reset();
  MPI_Barrier(MPI_COMM_WORLD);
}

// A CUDA optimizer of one parameter of `numel` elements from the C API's one-process
// constructor, finalized (null after a failed ASSERT).
void create_cuda_c_optimizer(std::size_t numel, shardopt_optimizer_t& opt) {
  shardopt_config_t cfg;
  ASSERT_EQ(shardopt_config_init(&cfg), SHARDOPT_SUCCESS);
  cfg.device = SHARDOPT_DEVICE_CUDA;
  ASSERT_EQ(shardopt_create(&opt, &cfg), SHARDOPT_SUCCESS);
  ASSERT_EQ(shardopt_add_param(opt, "w", numel, 0, nullptr), SHARDOPT_SUCCESS);
  ASSERT_EQ(shardopt_finalize(opt), SHARDOPT_SUCCESS);
}

// The C API's one-process constructor gives a CUDA optimizer the device communicator.
TEST(CApiOnFake, CreatesACudaOptimizerInOneProcess) {
  shardopt_optimizer_t opt = nullptr;
  ASSERT_NO_FATAL_FAILURE(create_cuda_c_optimizer(1000, opt));
  EXPECT_EQ(shardopt_destroy(opt), SHARDOPT_SUCCESS);
}

// The automatic bucket size with SHARDOPT_DEVICE_CUDA: an eighth of a 16 Mi-element model
// (2 Mi), where the CPU's cap is 1 Mi (docs/c_api.md).
TEST(CApiOnFake, AutomaticBucketSizeOfACudaOptimizer) {
  shardopt_optimizer_t opt = nullptr;
  ASSERT_NO_FATAL_FAILURE(create_cuda_c_optimizer(std::size_t{16} << 20, opt));
  shardopt_config_t got;
  ASSERT_EQ(shardopt_config_init(&got), SHARDOPT_SUCCESS);
  ASSERT_EQ(shardopt_get_config(opt, &got), SHARDOPT_SUCCESS);
  EXPECT_EQ(got.bucket_elems, std::size_t{2} << 20);
  EXPECT_EQ(shardopt_destroy(opt), SHARDOPT_SUCCESS);
}

TEST(CudaBackendOnFake, GridStrideLaunchShapeFromTheOccupancyQueryOnce) {
  auto be = make_cuda_backend_with(dev::AdamKernel::GridStride);
  const std::size_t n = std::size_t{4} * 256 * 1000;  // 1000 blocks wanted
  Allocation buf[4];
  for (Allocation& a : buf) a = be->allocate(nullptr, MemCategory::Scratch, n * 4);
  const StepHyper h{1e-3, 0.9, 0.999, 1e-8, 0.0, AdamMode::AdamW, 1};
  const std::vector<UpdateSegment> segs = {{0, n, make_segment_scalars(h, 1.0, true)}};
  for (int i = 0; i < 3; ++i)
    be->adam_update(make_step_scalars(h, 1.0), segs, buf[0].as<float>(), buf[1].as<float>(),
                    buf[2].as<float>(), buf[3].as<float>(), nullptr, DType::F32);
  be->synchronize();
  EXPECT_EQ(fakecuda::occupancy_queries(), 1);
  EXPECT_EQ(fakecuda::last_grid_stride_launch().blocks,
            static_cast<unsigned>(fakecuda::kFakeSmCount * fakecuda::kFakeBlocksPerSm));
  EXPECT_EQ(fakecuda::last_grid_stride_launch().threads, dev::kGridStrideThreads);
}

}  // namespace
