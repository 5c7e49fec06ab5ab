// test_cuda_optimizer.cpp: the sharded step with Device::Cuda against the double-precision
// oracle (one process, or NCCL under mpiexec), and against the CPU optimizer bitwise. The
// step tests skip without enough GPUs; the device/communicator check runs everywhere.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <initializer_list>
#include <limits>
#include <ostream>
#include <string>
#include <utility>
#include <vector>

#include "gpu_test.hpp"
#include "gpu_world.hpp"
#include "shardopt/cuda_comm.hpp"
#include "shardopt/optimizer.hpp"
#include "shardopt/planner.hpp"
#include "support/forwarding_comm.hpp"
#include "support/reference.hpp"

#if SHARDOPT_GPU_TEST_MPI
#include <mpi.h>

#include "shardopt/mpi_comm.hpp"
#endif

using namespace shardopt;
using shardopt::test::synth;

namespace {

const std::vector<std::size_t> kSizes = {1, 7, 300, 5000, 65, 129, 3};
const std::vector<GroupOptions> kGroups = {GroupOptions{}, GroupOptions{0.5, false}};
// Group 1 holds p1 and p4; under AdamW8bit also p3, and its threshold (kMin8bit) leaves p1
// (7 elements) in fp32 AdamW while p4 (65: one partial block) and p3 (5000: 20 blocks, over
// several buckets and, at 2-3 ranks, shards) keep 8-bit state.
int group_of(std::size_t i, Rule rule1 = Rule::AdamW) {
  return i % 3 == 1 || (rule1 == Rule::AdamW8bit && i == 3) ? 1 : 0;
}
constexpr std::size_t kMin8bit = 64;

// Multiples of 2^-10: sums over ranks are exact in any order (see test_optimizer.cpp).
float grad_value(int rank, int step, std::size_t param, std::size_t k) {
  const float u = synth(static_cast<std::uint64_t>(rank), static_cast<std::uint64_t>(step), param, k);
  return std::round(u * 1024.0f) / 1024.0f;
}

void to_device(std::span<float> dst, const std::vector<float>& src) {
  ASSERT_EQ(cudaMemcpy(dst.data(), src.data(), src.size() * sizeof(float), cudaMemcpyHostToDevice),
            cudaSuccess);
}

// Parameter j's gradient `g` into `opt` (device memory when `device`), then grad_ready(j).
void put_grad(ShardedOptimizer& opt, std::size_t j, const std::vector<float>& g, bool device) {
  const std::span<float> dst = opt.grad(j);
  if (device) {
    to_device(dst, g);
  } else {
    std::copy(g.begin(), g.end(), dst.begin());
  }
  opt.grad_ready(j);
}

// `in_units`: units {p0 p1} {p2 p3} {p4 p5} {p6} (the same layout at every stage); else one.
// `rule1`: group 1's update rule (AdamW, Lion or AdamW8bit: group_of()).
std::unique_ptr<ShardedOptimizer> make(std::shared_ptr<Communicator> comm, Device device,
                                       Stage stage, DType dtype, const AdamConfig& cfg,
                                       bool in_units = false, Rule rule1 = Rule::AdamW,
                                       Ownership ownership = Ownership::Flat,
                                       Reduction reduction = Reduction::Default) {
  OptimizerOptions o;
  o.ownership = ownership;
  o.reduction = reduction;
  o.device = device;
  o.stage = stage;
  o.param_dtype = dtype;
  o.adam = cfg;
  o.bucket_elems = 700;
  auto opt = std::make_unique<ShardedOptimizer>(std::move(comm), o);
  GroupOptions g1 = kGroups[1];
  g1.rule = rule1;
  g1.adamw8bit.min_8bit_numel = kMin8bit;
  opt->add_group(g1);
  for (std::size_t i = 0; i < kSizes.size(); ++i) {
    if (in_units && (i == 2 || i == 4 || i == 6)) opt->begin_unit();
    opt->add_param("p" + std::to_string(i), kSizes[i], group_of(i, rule1));
  }
  opt->finalize();
  for (std::size_t i = 0; i < kSizes.size(); ++i) {
    std::vector<float> init(kSizes[i]);
    for (std::size_t k = 0; k < init.size(); ++k) init[k] = synth(99, 0, i, k);
    opt->set_param(i, init);
  }
  return opt;
}

// Writes this rank's gradients for `step` (backward order, with grad_ready for stage 2).
// `around(j, before)` runs before and after parameter j's gradient (stage 3's acquires).
void produce_grads(ShardedOptimizer& opt, int rank, int step, bool device,
                   const std::function<void(std::size_t, bool)>& around = {}) {
  for (std::size_t j = kSizes.size(); j-- > 0;) {
    if (around) around(j, true);
    std::vector<float> g(kSizes[j]);
    for (std::size_t k = 0; k < g.size(); ++k) g[k] = grad_value(rank, step, j, k);
    put_grad(opt, j, g, device);
    if (around) around(j, false);
  }
}

struct StepCase {
  Stage stage;
  DType dtype;
  double max_grad_norm;
};

void PrintTo(const StepCase& c, std::ostream* os) {
  *os << stage_name(c.stage) << " " << dtype_name(c.dtype) << " max_grad_norm=" << c.max_grad_norm;
}

class CudaStep : public ::testing::TestWithParam<StepCase> {};

TEST_P(CudaStep, MatchesDoubleOracle) {
  SHARDOPT_REQUIRE_GPUS(test::gpu_world_size());
  const StepCase c = GetParam();
  AdamConfig cfg;
  cfg.lr = 1e-2;
  cfg.weight_decay = 0.1;
  cfg.max_grad_norm = c.max_grad_norm;
  auto comm = test::gpu_world();
  const int world = comm->size(), rank = comm->rank();
  auto opt = make(comm, Device::Cuda, c.stage, c.dtype, cfg);

  std::vector<test::RefParam> ref(kSizes.size());
  for (std::size_t i = 0; i < kSizes.size(); ++i) {
    ref[i].group = group_of(i);
    for (std::size_t k = 0; k < kSizes[i]; ++k) {
      ref[i].p.push_back(synth(99, 0, i, k));  // set_param's fp32 values are the master
    }
    ref[i].m.assign(kSizes[i], 0.0);
    ref[i].v.assign(kSizes[i], 0.0);
  }
  for (int step = 1; step <= 3; ++step) {
    produce_grads(*opt, rank, step, true);
    std::vector<std::vector<double>> avg(kSizes.size());
    for (std::size_t i = 0; i < kSizes.size(); ++i)
      for (std::size_t k = 0; k < kSizes[i]; ++k) {
        double s = 0;
        for (int r = 0; r < world; ++r) s += grad_value(r, step, i, k);
        avg[i].push_back(s / world);
      }
    const StepResult got = opt->step();
    const test::RefResult want = test::reference_step(ref, avg, cfg, kGroups, step);
    EXPECT_NEAR(got.grad_norm, want.grad_norm, 1e-9 * want.grad_norm);
    EXPECT_EQ(got.clipped, want.clipped);
    EXPECT_FALSE(got.skipped);
  }
  for (std::size_t i = 0; i < kSizes.size(); ++i) {
    std::vector<float> master(kSizes[i]);
    opt->get_master(i, master);
    std::vector<float> replica(kSizes[i]);
    if (c.dtype == DType::BF16) {
      const std::span<bf16> dev = opt->param<bf16>(i);
      std::vector<bf16> low(dev.size());
      ASSERT_EQ(cudaMemcpy(low.data(), dev.data(), dev.size_bytes(), cudaMemcpyDeviceToHost),
                cudaSuccess);
      for (std::size_t k = 0; k < low.size(); ++k) replica[k] = to_float(low[k]);
    } else {
      const std::span<float> dev = opt->param<float>(i);
      ASSERT_EQ(cudaMemcpy(replica.data(), dev.data(), dev.size_bytes(), cudaMemcpyDeviceToHost),
                cudaSuccess);
    }
    for (std::size_t k = 0; k < kSizes[i]; ++k) {
      ASSERT_NEAR(master[k], ref[i].p[k], 1e-5) << "param " << i << " element " << k;
      // The all-gathered replica is the master rounded to the replica dtype, on every rank.
      const float want = c.dtype == DType::BF16 ? to_float(to_bf16(master[k])) : master[k];
      ASSERT_EQ(float_bits(replica[k]), float_bits(want)) << "param " << i << " element " << k;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Stages, CudaStep,
                         ::testing::Values(StepCase{Stage::DataParallel, DType::BF16, 0.0},
                                           StepCase{Stage::Zero1, DType::BF16, 0.0},
                                           StepCase{Stage::Zero1, DType::F32, 1.0},
                                           StepCase{Stage::Zero2, DType::BF16, 1.0},
                                           StepCase{Stage::Zero2, DType::F32, 0.0}),
                         [](const ::testing::TestParamInfo<StepCase>& i) {
                           return std::string("stage") +
                                  std::to_string(static_cast<int>(i.param.stage)) + "_" +
                                  dtype_name(i.param.dtype) +
                                  (i.param.max_grad_norm > 0 ? "_clip" : "");
                         });

// Parameter i's replica bytes (device memory: the compute stream is the legacy default one,
// which cudaMemcpy waits for; or host memory of a CPU optimizer).
std::vector<unsigned char> replica_bytes(ShardedOptimizer& opt, std::size_t i) {
  const std::size_t n = opt.layout().param(i).numel * dtype_size(opt.options().param_dtype);
  const void* p = opt.options().param_dtype == DType::BF16
                      ? static_cast<const void*>(opt.param<bf16>(i).data())
                      : static_cast<const void*>(opt.param<float>(i).data());
  std::vector<unsigned char> out(n);
  if (opt.options().device == Device::Cpu) {
    std::memcpy(out.data(), p, n);
  } else {
    EXPECT_EQ(cudaMemcpy(out.data(), p, n, cudaMemcpyDeviceToHost), cudaSuccess);
  }
  return out;
}

// The master, m and v of this rank are the same bits in both optimizers (AdamW8bit's m and v
// dequantized: q[code] * scale, so equal codes and scales).
void expect_same_state(ShardedOptimizer& a, ShardedOptimizer& b, int step) {
  for (StateArray s : {StateArray::Master, StateArray::ExpAvg, StateArray::ExpAvgSq}) {
    std::vector<float> x(a.local_size()), y(b.local_size());
    a.copy_state_to_host(s, 0, x);
    b.copy_state_to_host(s, 0, y);
    ASSERT_EQ(x.size(), y.size());
    ASSERT_EQ(std::memcmp(x.data(), y.data(), x.size() * sizeof(float)), 0)
        << "step " << step << " state array " << static_cast<int>(s);
  }
}

// The memory the optimizer holds on this rank is the planner's for it (its groups' rules).
/// accumulated: reproducible mode's accumulator was needed (several micro-batches per rank).
void expect_planned_memory(ShardedOptimizer& opt, bool accumulated = false) {
  PlanConfig pc = plan_config(opt.options(), opt.comm().size());
  pc.accumulate_without_sync = accumulated;
  pc.groups = opt.groups();
  pc.rank = opt.comm().rank();
  FlatLayout unbuilt;
  for (const ParamInfo& p : opt.layout().params()) unbuilt.add(p.name, p.numel, p.group, p.unit);
  const MemoryPlan plan = plan_memory(unbuilt, pc);
  const MemoryReport rep = opt.memory_report();
  for (MemCategory cat :
       {MemCategory::Params, MemCategory::Grads, MemCategory::Master, MemCategory::Moments})
    EXPECT_EQ(plan[cat], rep[cat]) << "category " << mem_category_name(cat);
}

// The CUDA step equals the CPU step bit for bit at every stage and replica dtype, with group 1
// under each of `rules` (AdamW8bit: one parameter below its threshold in fp32 AdamW, two above
// in 8-bit): this rank's master, m, v and the replica (stage 3: each unit gathered) after
// every step (same element math; no clipping, so the different norm summation order cannot
// matter; the gradients' sums over ranks are exact). The device memory is the planner's, and
// the CPU's for the master and the rule's state.
void expect_cpu_bits(const std::function<std::shared_ptr<Communicator>()>& gpu_comm,
                     const std::function<std::shared_ptr<Communicator>()>& cpu_comm,
                     std::initializer_list<Rule> rules) {
  AdamConfig cfg;
  cfg.lr = 1e-2;
  for (Rule rule1 : rules)
  for (Stage stage : {Stage::DataParallel, Stage::Zero1, Stage::Zero2, Stage::Zero3})
    for (DType dtype : {DType::BF16, DType::F32}) {
      SCOPED_TRACE(std::string(rule_name(rule1)) + " " + stage_name(stage) + " " + dtype_name(dtype));
      auto gpu = make(gpu_comm(), Device::Cuda, stage, dtype, cfg, true, rule1);
      auto cpu = make(cpu_comm(), Device::Cpu, stage, dtype, cfg, true, rule1);
      const int rank = gpu->comm().rank();
      if (rule1 == Rule::AdamW8bit) {
        EXPECT_EQ(gpu->rule_of(1), Rule::AdamW) << "p1 is below min_8bit_numel";
        EXPECT_EQ(gpu->rule_of(3), Rule::AdamW8bit);
        EXPECT_EQ(gpu->rule_of(4), Rule::AdamW8bit);
      }
      expect_planned_memory(*gpu);
      for (MemCategory cat : {MemCategory::Master, MemCategory::Moments})
        EXPECT_EQ(gpu->memory_report()[cat], cpu->memory_report()[cat])
            << "category " << mem_category_name(cat);
      for (int step = 1; step <= 3; ++step) {
        produce_grads(*gpu, rank, step, true);
        produce_grads(*cpu, rank, step, false);
        const StepResult a = gpu->step(), b = cpu->step();
        EXPECT_NEAR(a.grad_norm, b.grad_norm, 1e-12 * b.grad_norm);
        expect_same_state(*gpu, *cpu, step);
        for (std::size_t u = 0; u < gpu->layout().num_units(); ++u) {
          if (stage == Stage::Zero3) {
            gpu->acquire(u);
            cpu->acquire(u);
          }
          const Unit& unit = gpu->layout().unit(u);
          for (std::size_t i = unit.params.begin; i < unit.params.end; ++i)
            ASSERT_EQ(replica_bytes(*gpu, i), replica_bytes(*cpu, i)) << "step " << step << " p" << i;
          if (stage == Stage::Zero3) {
            gpu->release(u);
            cpu->release(u);
          }
        }
      }
    }
}

// One process: the one-process device communicator against the CPU's, every rule.
TEST(CudaStepSingle, MatchesCpuOptimizerBitwise) {
  if (test::gpu_world_size() != 1) GTEST_SKIP() << "single-process comparison";
  SHARDOPT_REQUIRE_GPUS(1);
  expect_cpu_bits([] { return make_cuda_single_process_communicator(); },
                  [] { return make_single_process_communicator(); },
                  {Rule::AdamW, Rule::Lion, Rule::AdamW8bit});
}

#if SHARDOPT_GPU_TEST_MPI
// Every rank of the GPU world (NCCL) against the CPU optimizer over MPI on the same ranks,
// group 1 under AdamW8bit (the rule whose blocks the shards must cut whole): each rank's
// shard of the state is the CPU's. (AdamW and Lion at several ranks: CudaStep against the
// oracle, and the CPU optimizer's own tests.)
TEST(CudaStepWorld, MatchesCpuOptimizerBitwise) {
  SHARDOPT_REQUIRE_GPUS(test::gpu_world_size());
  expect_cpu_bits([] { return test::gpu_world(); },
                  [] { return make_mpi_communicator(MPI_COMM_WORLD); }, {Rule::AdamW8bit});
}
#endif

// ---- whole-tensor ownership ----------------------------------------------------------------

// The CPU's communicator on the ranks of the GPU world (test::gpu_world()).
std::shared_ptr<Communicator> host_world() {
#if SHARDOPT_GPU_TEST_MPI
  return make_mpi_communicator(MPI_COMM_WORLD);
#else
  return make_single_process_communicator();
#endif
}

// Ownership::Whole on the device (ragged buckets: the uneven reduce-scatter and all-gather of
// the device communicator) equals the CPU's Whole bit for bit (this rank's master, m, v: the
// same ragged shard) and the CPU's Flat replica of every parameter (the whole model: with an
// fp32 replica, the master weights), stages 0-2, group 1 under AdamW (bf16 and fp32
// replicas), Lion (bf16) and AdamW8bit (fp32), at every rank count of the GPU world; the
// device memory is the planner's Whole plan for this rank.
void expect_whole_bits(const std::function<std::shared_ptr<Communicator>()>& gpu_comm,
                       const std::function<std::shared_ptr<Communicator>()>& cpu_comm) {
  AdamConfig cfg;
  cfg.lr = 1e-2;
  for (const auto& [rule1, dtype] : {std::pair{Rule::AdamW, DType::BF16}, std::pair{Rule::AdamW, DType::F32},
                                     std::pair{Rule::Lion, DType::BF16}, std::pair{Rule::AdamW8bit, DType::F32}})
    for (Stage stage : {Stage::DataParallel, Stage::Zero1, Stage::Zero2}) {
      SCOPED_TRACE(std::string(rule_name(rule1)) + " " + stage_name(stage) + " " + dtype_name(dtype));
      auto gpu = make(gpu_comm(), Device::Cuda, stage, dtype, cfg, false, rule1, Ownership::Whole);
      auto cpu = make(cpu_comm(), Device::Cpu, stage, dtype, cfg, false, rule1, Ownership::Whole);
      auto flat = make(cpu_comm(), Device::Cpu, stage, dtype, cfg, false, rule1);
      ASSERT_EQ(gpu->layout().fingerprint(), cpu->layout().fingerprint());
      ASSERT_EQ(gpu->local_size(), cpu->local_size());
      expect_planned_memory(*gpu);  // plan_memory plans Whole on Device::Cuda too
      const int rank = gpu->comm().rank();
      for (int step = 1; step <= 3; ++step) {
        produce_grads(*gpu, rank, step, true);
        produce_grads(*cpu, rank, step, false);
        produce_grads(*flat, rank, step, false);
        const StepResult a = gpu->step(), b = cpu->step(), c = flat->step();
        EXPECT_NEAR(a.grad_norm, b.grad_norm, 1e-12 * b.grad_norm);
        EXPECT_EQ(b.grad_norm, c.grad_norm);
        expect_same_state(*gpu, *cpu, step);
        for (std::size_t i = 0; i < kSizes.size(); ++i) {
          const std::vector<unsigned char> mine = replica_bytes(*gpu, i);
          ASSERT_EQ(mine, replica_bytes(*cpu, i)) << "step " << step << " p" << i << " (CPU Whole)";
          ASSERT_EQ(mine, replica_bytes(*flat, i)) << "step " << step << " p" << i << " (CPU Flat)";
        }
      }
    }
}

TEST(CudaWhole, MatchesCpuWholeAndFlatBitwise) {
  SHARDOPT_REQUIRE_GPUS(test::gpu_world_size());
  expect_whole_bits([] { return test::gpu_world(); }, host_world);
}

// What Whole does not run on the device yet (stage 3) is refused by finalize() with
// Error(Unsupported), and so is its plan (reproducible mode under Whole is refused on the
// device by the constructor, CudaReproducible.RefusesStage3AndWhole; the planner refuses it
// for Whole too).
TEST(CudaWhole, RefusesStage3) {
  SHARDOPT_REQUIRE_GPUS(test::gpu_world_size());
  OptimizerOptions o;
  o.ownership = Ownership::Whole;
  o.device = Device::Cuda;
  o.stage = Stage::Zero3;
  ShardedOptimizer opt(test::gpu_world(), o);
  opt.add_param("w", 1000, 0);
  try {
    opt.finalize();
    FAIL() << "finalize accepted Whole on Device::Cuda at stage 3";
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), Status::Unsupported) << e.what();
    EXPECT_NE(std::string(e.what()).find("ownership Whole on Device::Cuda: stage 3"),
              std::string::npos)
        << e.what();
  }
  FlatLayout l;
  l.add("w", 1000, 0);
  PlanConfig c = plan_config(o, 1);
  EXPECT_THROW(plan_memory(l, c), Error);
  c.stage = Stage::Zero1;
  c.reduction = Reduction::Reproducible;
  EXPECT_THROW(plan_memory(l, c), Error);
}

// ---- reproducible mode --------------------------------------------------------------------

// Micro-batch q of `rank` at `step`, parameter `param`, element k: full 24-bit mantissas over
// 2^-31 .. 2^9 (their sums over ranks and micro-batches round, so the exact sum decides the
// bits), exact zeros, subnormals, and on step kReproNanStep one NaN (rank 0's first
// micro-batch: the step is skipped everywhere).
constexpr int kReproNanStep = 3;
float repro_grad(int rank, int q, int step, std::size_t param, std::size_t k) {
  if (step == kReproNanStep && rank == 0 && q == 0 && param == 3 && k == 17)
    return std::numeric_limits<float>::quiet_NaN();
  const float u = synth(static_cast<std::uint64_t>(rank) * 64 + static_cast<std::uint64_t>(q),
                        static_cast<std::uint64_t>(step) + 1000, param, k);
  const std::size_t h = param * 7 + k * 13 + static_cast<std::size_t>(step) * 5 + static_cast<std::size_t>(q);
  if (h % 11 == 0) return 0.0f;
  if (h % 17 == 0) return std::ldexp(u, -130);  // subnormal
  return std::ldexp(u, static_cast<int>(h % 41) - 31);
}

// One step of `micro` micro-batches of each of `ranks` ranks into `opt`, every one through
// begin_backward (the last with sync): `ranks` 1 writes this rank's, more writes them all,
// rank by rank (one process holding the whole world's micro-batches).
StepResult repro_step(ShardedOptimizer& opt, int rank, int ranks, int micro, int step, bool device) {
  for (int r = 0; r < ranks; ++r)
    for (int q = 0; q < micro; ++q) {
      opt.begin_backward(r + 1 == ranks && q + 1 == micro);
      for (std::size_t j = kSizes.size(); j-- > 0;) {
        std::vector<float> g(kSizes[j]);
        for (std::size_t k = 0; k < g.size(); ++k)
          g[k] = repro_grad(ranks == 1 ? rank : r, q, step, j, k);
        put_grad(opt, j, g, device);
      }
    }
  return opt.step();
}

// Reduction::Reproducible on the device equals the CPU's Reproducible optimizer bit for bit:
// this rank's master, m and v against the CPU's on the same ranks, every replica and the norm
// against one CPU process that receives every rank's micro-batches (the same bits at any rank
// count). The device takes the CPU's methods: with one micro-batch per rank the direct
// exchange (NcclCommunicator::reduce_scatter_combine: ncclSend/ncclRecv of raw fp32 values,
// 4 bytes per element, combined by the backend's kernel), with several the packed exchange
// (the bins with the last micro-batch packed on the device, 8 bytes per element), and no
// integer reduction; a communicator that refuses the exchanges leaves the two-phase method
// (integer reductions only), the same bits. Stages 0-2, bf16 and fp32 replicas, 1 and 3
// micro-batches per rank, clipping on every step (max_grad_norm 1 against norms far larger),
// a NaN step skipped on every rank, uneven parameter sizes over 700-element buckets.
TEST(CudaReproducible, MatchesCpuReproducibleBitwise) {
  SHARDOPT_REQUIRE_GPUS(test::gpu_world_size());
  AdamConfig cfg;
  cfg.lr = 1e-2;
  cfg.max_grad_norm = 1.0;
  const int world = test::gpu_world_size();
  for (Stage stage : {Stage::DataParallel, Stage::Zero1, Stage::Zero2})
    for (DType dtype : {DType::BF16, DType::F32})
      for (int micro : {1, 3})
        for (bool refuse : {false, true}) {
          if (refuse && dtype == DType::F32) continue;  // the two-phase method: one replica type
          SCOPED_TRACE(std::string(stage_name(stage)) + " " + dtype_name(dtype) + " " +
                       std::to_string(micro) + " micro-batches" + (refuse ? ", two-phase" : ", exchange"));
          const auto mk = [&](std::shared_ptr<Communicator> comm, Device device) {
            return make(std::move(comm), device, stage, dtype, cfg, false, Rule::AdamW,
                        Ownership::Flat, Reduction::Reproducible);
          };
          auto counting = std::make_shared<test::CountingComm>(test::gpu_world());
          counting->refuse_combine = refuse;
          auto gpu = mk(counting, Device::Cuda);
          auto cpu = mk(host_world(), Device::Cpu);
          auto one = mk(make_single_process_communicator(), Device::Cpu);
          const int rank = gpu->comm().rank();
          const std::size_t padded = gpu->layout().padded_size();
          for (int step = 1; step <= 4; ++step) {
            const std::size_t int_before = counting->int_bytes, combine_before = counting->combine_bytes;
            const StepResult a = repro_step(*gpu, rank, 1, micro, step, true);
            const StepResult b = repro_step(*cpu, rank, 1, micro, step, false);
            const StepResult c = repro_step(*one, rank, world, micro, step, false);
            // The accumulator from the first deposit (several micro-batches) or the two-phase method.
            if (step == 1) expect_planned_memory(*gpu, micro > 1 || refuse);
            // The method's wire: the exchange's bytes and no integer reduction, or the reverse.
            const std::size_t combined = counting->combine_bytes - combine_before;
            const std::size_t ints = counting->int_bytes - int_before;
            if (refuse) {
              EXPECT_EQ(combined, 0u) << "step " << step;
              EXPECT_GT(ints, 0u) << "step " << step;
            } else {
              EXPECT_EQ(combined, padded * (micro == 1 ? 4 : 8)) << "step " << step;
              EXPECT_EQ(ints, 0u) << "step " << step;
            }
            EXPECT_EQ(a.skipped, step == kReproNanStep) << "step " << step;
            EXPECT_EQ(b.skipped, a.skipped) << "step " << step;
            EXPECT_EQ(c.skipped, a.skipped) << "step " << step;
            if (!a.skipped) {
              EXPECT_TRUE(a.clipped) << "step " << step;
              EXPECT_EQ(a.grad_norm, b.grad_norm) << "step " << step;
              EXPECT_EQ(a.grad_norm, c.grad_norm) << "step " << step;
            }
            expect_same_state(*gpu, *cpu, step);
            for (std::size_t i = 0; i < kSizes.size(); ++i) {
              const std::vector<unsigned char> mine = replica_bytes(*gpu, i);
              ASSERT_EQ(mine, replica_bytes(*cpu, i)) << "step " << step << " p" << i << " (CPU, same ranks)";
              ASSERT_EQ(mine, replica_bytes(*one, i)) << "step " << step << " p" << i << " (CPU, one process)";
            }
          }
        }
}

// What reproducible mode does not run on the device is refused by the constructor on every
// rank with Error(InvalidArgument): stage 3 and ownership Whole; the planner refuses both too.
TEST(CudaReproducible, RefusesStage3AndWhole) {
  SHARDOPT_REQUIRE_GPUS(test::gpu_world_size());
  for (const auto& [stage, ownership] : {std::pair{Stage::Zero3, Ownership::Flat},
                                         std::pair{Stage::Zero1, Ownership::Whole}}) {
    OptimizerOptions o;
    o.device = Device::Cuda;
    o.reduction = Reduction::Reproducible;
    o.stage = stage;
    o.ownership = ownership;
    try {
      ShardedOptimizer opt(test::gpu_world(), o);
      FAIL() << "the constructor accepted Reproducible on Device::Cuda at " << stage_name(stage);
    } catch (const Error& e) {
      EXPECT_EQ(e.status(), Status::InvalidArgument) << e.what();
      EXPECT_NE(std::string(e.what()).find("reduction Reproducible on Device::Cuda runs at stages 0-2 "
                                           "with ownership Flat only"),
                std::string::npos)
          << e.what();
    }
    FlatLayout l;
    l.add("w", 1000, 0);
    const PlanConfig c = plan_config(o, 1);
    EXPECT_THROW(plan_memory(l, c), Error) << stage_name(stage);
  }
}

// ---- stage 3 -------------------------------------------------------------------------------

// Stage 3 on the device (units gathered on acquire/prefetch over the device communicator,
// released to a pool of units_in_flight buffers) against stage 2 on the same layout: every
// gathered unit equals stage 2's replica and the master weights, m and v are the same bits
// after every step, with clipping, at every rank count of the GPU world; group 1 under AdamW
// and under AdamW8bit (its 8-bit parameters' blocks split over the ranks' shards).
TEST(CudaZero3, MatchesZero2Bitwise) {
  SHARDOPT_REQUIRE_GPUS(test::gpu_world_size());
  for (Rule rule1 : {Rule::AdamW, Rule::AdamW8bit})
  for (DType dtype : {DType::BF16, DType::F32}) {
    SCOPED_TRACE(std::string(rule_name(rule1)) + " " + dtype_name(dtype));
    AdamConfig cfg;
    cfg.lr = 1e-2;
    cfg.max_grad_norm = 1.0;
    auto z2 = make(test::gpu_world(), Device::Cuda, Stage::Zero2, dtype, cfg, true, rule1);
    auto z3 = make(test::gpu_world(), Device::Cuda, Stage::Zero3, dtype, cfg, true, rule1);
    ASSERT_EQ(z2->layout().fingerprint(), z3->layout().fingerprint());
    const int rank = z3->comm().rank();
    const std::size_t units = z3->layout().num_units();
    ASSERT_EQ(units, 4u);
    for (int step = 1; step <= 3; ++step) {
      // Forward: acquire u, prefetch u + 1, read u's parameters, release u.
      z3->acquire(0);
      for (std::size_t u = 0; u < units; ++u) {
        if (u + 1 < units) z3->prefetch(u + 1);
        const Unit& unit = z3->layout().unit(u);
        for (std::size_t i = unit.params.begin; i < unit.params.end; ++i)
          ASSERT_EQ(replica_bytes(*z3, i), replica_bytes(*z2, i)) << "step " << step << " p" << i;
        z3->release(u);
        if (u + 1 < units) z3->acquire(u + 1);
      }
      // Backward, each unit acquired while its gradients are written (the one before it
      // prefetched), as a trainer that recomputes activations does.
      produce_grads(*z2, rank, step, true);
      produce_grads(*z3, rank, step, true, [&](std::size_t j, bool before) {
        const std::size_t u = static_cast<std::size_t>(z3->layout().param(j).unit);
        const Unit& unit = z3->layout().unit(u);
        if (before && j + 1 == unit.params.end) {
          z3->acquire(u);
          if (u > 0) z3->prefetch(u - 1);
        }
        if (!before && j == unit.params.begin) z3->release(u);
      });
      const StepResult a = z2->step(), b = z3->step();
      EXPECT_EQ(a.grad_norm, b.grad_norm);
      EXPECT_EQ(a.clipped, b.clipped);
      expect_same_state(*z2, *z3, step);
    }
  }
}

// The automatic bucket size on a GPU: an eighth of the model up to 2^24 elements (2^20 on the
// CPU), the value the planner gives for Device::Cuda. A 40 Mi-element model: 5 Mi elements
// per bucket on the GPU, where the CPU would cut 2^20. Allocates 40 Mi x 4 fp32 arrays.
TEST(CudaDevice, AutomaticBucketSizeIsTheDevicePlanners) {
  SHARDOPT_REQUIRE_GPUS(test::gpu_world_size());
  OptimizerOptions o;
  o.device = Device::Cuda;
  o.stage = Stage::Zero2;
  o.param_dtype = DType::BF16;
  ShardedOptimizer opt(test::gpu_world(), o);
  const std::size_t n = std::size_t{40} << 20;
  opt.add_param("w", n / 2, 0);
  opt.add_param("v", n / 2, 0);
  opt.finalize();
  EXPECT_EQ(opt.options().bucket_elems, n / 8);
  EXPECT_EQ(opt.options().bucket_elems, FlatLayout::auto_bucket_elems(n, auto_bucket_cap(Device::Cuda)));
  EXPECT_GT(opt.options().bucket_elems, FlatLayout::auto_bucket_elems(n)) << "the CPU's cap";
  PlanConfig c = plan_config(o, test::gpu_world_size());
  FlatLayout layout;
  layout.add("w", n / 2, 0);
  layout.add("v", n / 2, 0);
  const MemoryPlan plan = plan_memory(layout, c);
  EXPECT_EQ(plan.num_buckets, opt.layout().num_buckets());
  std::size_t largest = 0;
  for (std::size_t k = 0; k < opt.layout().num_buckets(); ++k)
    largest = std::max(largest, opt.layout().bucket(k).flat.size());
  EXPECT_EQ(plan.bucket_elems, largest);
}

// Muon on the device in the optimizer (Ownership::Whole: each matrix updated whole by its
// owner, the uneven collectives of the device communicator), next to AdamW, against the CPU
// optimizer on the same ranks, stages 0-2, fp32 replica, 3 steps: the AdamW parameters and
// every momentum (Muon's too: no GEMM in it) are the CPU's bit for bit; the Muon matrices'
// moves from the start agree to 1e-4 relative Frobenius (the GEMMs are cuBLAS's, summed in
// its own order; CudaBackend.MuonMatchesCpuToRounding explains the bound).
void expect_muon_close(const std::function<std::shared_ptr<Communicator>()>& gpu_comm,
                       const std::function<std::shared_ptr<Communicator>()>& cpu_comm) {
  const std::vector<Shape2D> shapes = {{96, 64}, {64, 96}, {33, 17}, {64, 64}};
  const std::vector<std::size_t> vectors = {64, 300};
  const auto build = [&](std::shared_ptr<Communicator> comm, Device device, Stage stage) {
    OptimizerOptions o;
    o.device = device;
    o.stage = stage;
    o.param_dtype = DType::F32;
    o.ownership = Ownership::Whole;
    o.bucket_elems = 8192;
    o.adam.lr = 0.02;
    o.adam.weight_decay = 0.1;
    auto opt = std::make_unique<ShardedOptimizer>(std::move(comm), o);
    GroupOptions muon;
    muon.rule = Rule::Muon;
    const int g = opt->add_group(muon);
    for (std::size_t i = 0; i < shapes.size(); ++i) {
      opt->add_param("w" + std::to_string(i), shapes[i], g);
      opt->add_param("b" + std::to_string(i), vectors[i % vectors.size()], 0);
    }
    opt->finalize();
    for (std::size_t i = 0; i < opt->layout().num_params(); ++i) {
      std::vector<float> init(opt->layout().param(i).numel);
      for (std::size_t k = 0; k < init.size(); ++k) init[k] = synth(99, 0, i, k);
      opt->set_param(i, init);
    }
    return opt;
  };
  for (Stage stage : {Stage::DataParallel, Stage::Zero1, Stage::Zero2}) {
    SCOPED_TRACE(stage_name(stage));
    auto gpu = build(gpu_comm(), Device::Cuda, stage);
    auto cpu = build(cpu_comm(), Device::Cpu, stage);
    ASSERT_EQ(gpu->layout().fingerprint(), cpu->layout().fingerprint());
    const int rank = gpu->comm().rank();
    const std::size_t params = gpu->layout().num_params();
    for (int step = 1; step <= 3; ++step) {
      for (ShardedOptimizer* opt : {gpu.get(), cpu.get()}) {
        for (std::size_t j = params; j-- > 0;) {
          std::vector<float> g(opt->layout().param(j).numel);
          for (std::size_t k = 0; k < g.size(); ++k) g[k] = grad_value(rank, step, j, k);
          put_grad(*opt, j, g, opt == gpu.get());
        }
        opt->step();
      }
      std::vector<float> x(gpu->local_size()), y(cpu->local_size());
      gpu->copy_state_to_host(StateArray::ExpAvg, 0, x);
      cpu->copy_state_to_host(StateArray::ExpAvg, 0, y);
      ASSERT_EQ(x.size(), y.size());
      if (!x.empty())
        ASSERT_EQ(std::memcmp(x.data(), y.data(), x.size() * sizeof(float)), 0) << "momentum, step " << step;
      for (std::size_t i = 0; i < params; ++i) {
        const std::vector<unsigned char> a = replica_bytes(*gpu, i), b = replica_bytes(*cpu, i);
        if (gpu->rule_of(i) != Rule::Muon) {
          ASSERT_EQ(a, b) << "step " << step << " " << gpu->layout().param(i).name;
          continue;
        }
        double d = 0, r = 0;
        for (std::size_t k = 0; k < a.size() / 4; ++k) {
          float pa, pb;
          std::memcpy(&pa, a.data() + 4 * k, 4);
          std::memcpy(&pb, b.data() + 4 * k, 4);
          const double p0 = synth(99, 0, i, k);
          d += (static_cast<double>(pa) - pb) * (static_cast<double>(pa) - pb);
          r += (pb - p0) * (pb - p0);
        }
        EXPECT_LT(std::sqrt(d / r), 1e-4) << "step " << step << " " << gpu->layout().param(i).name;
      }
    }
  }
}

TEST(CudaMuon, MatchesCpuOptimizerToRounding) {
  SHARDOPT_REQUIRE_GPUS(test::gpu_world_size());
  expect_muon_close([] { return test::gpu_world(); }, host_world);
}

// Adafactor on the device in the optimizer (Ownership::Whole: each parameter updated whole by
// its owner) against the CPU optimizer on the same ranks, bit for bit: factored matrices
// (square-ish, tall, odd, more columns than rows), unfactored vectors (1-D, and a 1 x n shape)
// next to AdamW vectors; stages 0-2, bf16 and fp32 replicas, with and without the global
// gradient clipping (clipped: every rank's gradient is the same multiple of 2^-10 times a power
// of two per row, so the average and the norm's sums are exact and both optimizers clip by the
// same coefficient; else each rank's differs), four updates and a skipped step
// (a NaN on the last rank) between the second and the third. After each step: this rank's
// master and per-element state, every factored matrix's row_var and col_var, every replica.
// The memory is the planner's (the rule scratch included: numel + the device reduction's
// workspace of the largest parameter the rank updates) and the CPU optimizer's.
void expect_adafactor_bits(const std::function<std::shared_ptr<Communicator>()>& gpu_comm,
                           const std::function<std::shared_ptr<Communicator>()>& cpu_comm) {
  struct P {
    const char* name;
    std::size_t rows, cols;  // cols 0: 1-D
    bool adafactor;
  };
  const std::vector<P> model = {{"a0", 96, 64, true},  {"b0", 100, 0, false}, {"a1", 33, 17, true},
                                {"v0", 37, 0, true},   {"a2", 40, 130, true}, {"r0", 1, 50, true},
                                {"b1", 64, 0, false},  {"v1", 5000, 0, true}};
  const auto build = [&](std::shared_ptr<Communicator> comm, Device device, Stage stage,
                         DType dtype, double clip) {
    OptimizerOptions o;
    o.device = device;
    o.stage = stage;
    o.param_dtype = dtype;
    o.ownership = Ownership::Whole;
    o.bucket_elems = 8192;
    o.adam.lr = 0.02;
    o.adam.weight_decay = 0.1;
    o.adam.max_grad_norm = clip;
    auto opt = std::make_unique<ShardedOptimizer>(std::move(comm), o);
    GroupOptions ada;
    ada.rule = Rule::Adafactor;
    const int g = opt->add_group(ada);
    for (const P& p : model) {
      if (p.cols) opt->add_param(p.name, Shape2D{p.rows, p.cols}, p.adafactor ? g : 0);
      else opt->add_param(p.name, p.rows, p.adafactor ? g : 0);
    }
    opt->finalize();
    for (std::size_t i = 0; i < model.size(); ++i) {
      std::vector<float> init(opt->layout().param(i).numel);
      for (std::size_t k = 0; k < init.size(); ++k) init[k] = synth(99, 0, i, k);
      opt->set_param(i, init);
    }
    return opt;
  };
  for (Stage stage : {Stage::DataParallel, Stage::Zero1, Stage::Zero2})
    for (const auto& [dtype, clip] : {std::pair{DType::BF16, 0.0}, std::pair{DType::F32, 0.5}}) {
      SCOPED_TRACE(std::string(stage_name(stage)) + " " + dtype_name(dtype) +
                   (clip > 0 ? " clipped" : ""));
      auto gpu = build(gpu_comm(), Device::Cuda, stage, dtype, clip);
      auto cpu = build(cpu_comm(), Device::Cpu, stage, dtype, clip);
      ASSERT_EQ(gpu->layout().fingerprint(), cpu->layout().fingerprint());
      ASSERT_EQ(gpu->local_size(), cpu->local_size());
      const int rank = gpu->comm().rank(), world = gpu->comm().size();
      {
        PlanConfig pc = plan_config(gpu->options(), world);
        pc.groups = gpu->groups();
        pc.rank = rank;
        FlatLayout unbuilt;
        for (const ParamInfo& p : gpu->layout().params())
          unbuilt.add(p.name, p.numel, p.group, p.unit,
                      p.rows > 1 ? Shape2D{p.rows, p.cols} : Shape2D{});
        const MemoryPlan plan = plan_memory(unbuilt, pc);
        const MemoryReport rep = gpu->memory_report(), host = cpu->memory_report();
        for (MemCategory cat : {MemCategory::Params, MemCategory::Grads, MemCategory::Master,
                                MemCategory::Moments, MemCategory::Scratch}) {
          EXPECT_EQ(plan[cat], rep[cat]) << "planned, category " << mem_category_name(cat);
          EXPECT_EQ(host[cat], rep[cat]) << "the CPU's, category " << mem_category_name(cat);
        }
      }
      for (int step = 1; step <= 5; ++step) {
        const bool nan_step = step == 3;
        StepResult res[2];
        for (ShardedOptimizer* opt : {gpu.get(), cpu.get()}) {
          for (std::size_t j = model.size(); j-- > 0;) {
            const std::size_t cols = model[j].cols ? model[j].cols : 1;
            std::vector<float> g(opt->layout().param(j).numel);
            for (std::size_t k = 0; k < g.size(); ++k)
              g[k] = std::ldexp(grad_value(clip > 0 ? 0 : rank, step, j, k),
                                -static_cast<int>((k / cols) % 5));
            if (nan_step && rank == world - 1 && j == 2) g[3] = std::nanf("");
            put_grad(*opt, j, g, opt == gpu.get());
          }
          res[opt == gpu.get() ? 0 : 1] = opt->step();
        }
        EXPECT_EQ(res[0].skipped, nan_step);
        EXPECT_EQ(res[1].skipped, nan_step);
        if (clip > 0 && !nan_step) {
          EXPECT_EQ(res[0].grad_norm, res[1].grad_norm) << "step " << step;
        } else if (!nan_step) {
          EXPECT_NEAR(res[0].grad_norm, res[1].grad_norm, 1e-12 * res[1].grad_norm);
        }
        EXPECT_EQ(res[0].clipped, res[1].clipped);
        if (clip > 0 && !nan_step) EXPECT_TRUE(res[0].clipped) << "step " << step;
        EXPECT_EQ(gpu->step_count(), cpu->step_count());
        expect_same_state(*gpu, *cpu, step);
        for (std::size_t i = 0; i < model.size(); ++i) {
          ASSERT_EQ(replica_bytes(*gpu, i), replica_bytes(*cpu, i))
              << "step " << step << " " << model[i].name;
          const P& p = model[i];
          if (!p.adafactor || p.rows < 2 || p.cols < 2) continue;
          std::vector<float> ra(p.rows), ca(p.cols), rb(p.rows), cb(p.cols);
          gpu->get_factored_state(i, ra, ca);
          cpu->get_factored_state(i, rb, cb);
          ASSERT_EQ(std::memcmp(ra.data(), rb.data(), ra.size() * sizeof(float)), 0)
              << "row_var, step " << step << " " << p.name;
          ASSERT_EQ(std::memcmp(ca.data(), cb.data(), ca.size() * sizeof(float)), 0)
              << "col_var, step " << step << " " << p.name;
          if (step == 1) EXPECT_NE(rb[0], 0.0f) << p.name << ": the statistics moved";
        }
      }
    }
}

TEST(CudaAdafactor, MatchesCpuOptimizerBitwise) {
  SHARDOPT_REQUIRE_GPUS(test::gpu_world_size());
  expect_adafactor_bits([] { return test::gpu_world(); }, host_world);
}

// What Adafactor does not run on the device is refused by finalize() with Error(Unsupported)
// on every rank: stage 3 (Ownership::Whole on Device::Cuda runs stages 0-2).
TEST(CudaAdafactor, RefusesStage3) {
  SHARDOPT_REQUIRE_GPUS(test::gpu_world_size());
  OptimizerOptions o;
  o.device = Device::Cuda;
  o.stage = Stage::Zero3;
  o.ownership = Ownership::Whole;
  ShardedOptimizer opt(test::gpu_world(), o);
  GroupOptions g;
  g.rule = Rule::Adafactor;
  opt.add_param("w", Shape2D{64, 32}, opt.add_group(g));
  opt.add_param("b", 64, 0);
  try {
    opt.finalize();
    FAIL() << "finalize() accepted Adafactor on Device::Cuda at stage 3";
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), Status::Unsupported) << e.what();
    EXPECT_NE(std::string(e.what()).find("ownership Whole on Device::Cuda: stage 3"),
              std::string::npos)
        << e.what();
  }
}

// Device buffers cannot go through a host communicator, at any size (even one rank runs host
// code on the data: the bf16 wire's rounding): every rank gets the same InvalidArgument
// before anything is allocated (needs no GPU).
void expect_refused(std::shared_ptr<Communicator> comm) {
  OptimizerOptions o;
  o.device = Device::Cuda;
  try {
    ShardedOptimizer opt(comm, o);
    FAIL() << "expected Error(InvalidArgument) for " << comm->name();
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), Status::InvalidArgument) << e.what();
    EXPECT_NE(std::string(e.what()).find("Device::Cuda needs a communicator of device buffers"),
              std::string::npos)
        << e.what();
  }
}

TEST(CudaDevice, RejectsSingleProcessHostCommunicator) {
  expect_refused(make_single_process_communicator());
}

#if SHARDOPT_GPU_TEST_MPI
TEST(CudaDevice, RejectsHostMpiCommunicatorAtEverySize) {
  expect_refused(make_mpi_communicator(MPI_COMM_WORLD));
}
#endif

}  // namespace
