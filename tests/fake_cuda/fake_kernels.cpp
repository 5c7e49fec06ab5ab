// fake_kernels.cpp: the device algorithms of cuda_ops.hpp for the fake device. Each call
// queues an op that declares what it reads and writes; when the op runs, the very templates
// of cuda/device_algorithms.hpp run on the read/write mapping under Thrust's OpenMP system
// (fake_thrust.cpp), or, for AdamKernel::GridStride, the grid-stride loop over AdamChunkOp
// in the launch shape the real code computes.
#include "cuda_ops.hpp"
#include "fake_control.hpp"
#include "fake_device.hpp"
#include "fake_thrust.hpp"
#include "launch_config.hpp"
#include "shardopt/error.hpp"
#include "sum_squares.hpp"

namespace fakecuda {
void set_last_grid_stride_launch(Launch l);
}

namespace shardopt::dev {
namespace {

using fakecuda::Access;
using fakecuda::dev;

Access reads(const void* p, std::size_t bytes) {
  const auto a = reinterpret_cast<std::uintptr_t>(p);
  return {a, a + bytes, false};
}
Access writes(const void* p, std::size_t bytes) {
  const auto a = reinterpret_cast<std::uintptr_t>(p);
  return {a, a + bytes, true};
}

/// A kernel launch: pointers must be device memory (a host pointer is an illegal address).
void launch(cudaStream_t stream, const char* name, std::vector<Access> acc, std::function<void()> run) {
  for (const Access& a : acc)
    if (a.end > a.begin && !fakecuda::is_device(reinterpret_cast<const void*>(a.begin), a.end - a.begin))
      fakecuda::problem(std::string("kernel ") + name + " was given memory that is not a device "
                        "allocation (or runs past one)");
  if (!fakecuda::valid_stream(stream))
    throw Error(Status::Cuda, std::string(name) + ": invalid stream");
  fakecuda::enqueue(stream, std::string("kernel ") + name, std::move(acc), std::move(run));
}

}  // namespace

const void* adam_grid_stride_kernel_address() {
  static const char kernel = 0;
  return &kernel;
}

void adam_update(cudaStream_t stream, AdamKernel kernel, const AdamChunkOp& op) {
  const std::size_t n = op.n, chunks = adam_chunk_count(n);
  if (chunks == 0) return;
  std::vector<Access> acc = {reads(op.step, sizeof(StepScalars)),
                             reads(op.segments, op.num_segments * sizeof(UpdateSegment)),
                             writes(op.master, n * 4), reads(op.grad, n * 4), writes(op.m, n * 4),
                             writes(op.v, n * 4)};
  if (op.out_bf16) acc.push_back(writes(op.out_bf16, n * 2));
  if (op.out_f32) acc.push_back(writes(op.out_f32, n * 4));
  LaunchConfig shape{};
  if (kernel == AdamKernel::GridStride) shape = adam_grid_stride_launch(chunks);
  auto lock = fakecuda::lock_device();
  if (kernel == AdamKernel::GridStride)
    fakecuda::set_last_grid_stride_launch({shape.blocks, shape.threads});
  launch(stream, "adam_update", std::move(acc), [op, kernel, shape, chunks] {
    AdamChunkOp d = op;
    d.step = dev(op.step);
    d.segments = dev(op.segments);
    d.master = dev(op.master);
    d.grad = dev(op.grad);
    d.m = dev(op.m);
    d.v = dev(op.v);
    d.out_bf16 = dev(op.out_bf16);
    d.out_f32 = dev(op.out_f32);
    if (kernel == AdamKernel::Thrust) {
      fakecuda::omp::adam_update(d);
      return;
    }
    const std::size_t stride = grid_stride_stride(shape);
    for (unsigned b = 0; b < shape.blocks; ++b)
      for (unsigned t = 0; t < shape.threads; ++t)
        for (std::size_t c = grid_stride_first(b, shape.threads, t); c < chunks; c += stride) d(c);
  });
}

void lion_update(cudaStream_t stream, const LionOp& op, std::size_t n) {
  if (n == 0) return;
  std::vector<Access> acc = {writes(op.master, n * 4), reads(op.grad, n * 4), writes(op.m, n * 4)};
  if (op.out_bf16) acc.push_back(writes(op.out_bf16, n * 2));
  if (op.out_f32) acc.push_back(writes(op.out_f32, n * 4));
  auto lock = fakecuda::lock_device();
  launch(stream, "lion_update", std::move(acc), [op, n] {
    LionOp d = op;
    d.master = dev(op.master);
    d.grad = dev(op.grad);
    d.m = dev(op.m);
    d.out_bf16 = dev(op.out_bf16);
    d.out_f32 = dev(op.out_f32);
    fakecuda::omp::lion_update(d, n);
  });
}

void muon_pass(cudaStream_t stream, const MuonPassOp& op, std::size_t n) {
  if (n == 0) return;
  std::vector<Access> acc;
  switch (op.pass) {
    case MuonPassOp::Momentum:
      acc = {reads(op.grad, n * 4), writes(op.m, n * 4), writes(op.u, n * 4)};
      break;
    case MuonPassOp::Divide: acc = {reads(op.u, n * 4), writes(op.x, n * 4)}; break;
    case MuonPassOp::Apply:
      acc = {writes(op.master, n * 4), reads(op.x, n * 4)};
      if (op.out_bf16) acc.push_back(writes(op.out_bf16, n * 2));
      if (op.out_f32) acc.push_back(writes(op.out_f32, n * 4));
      break;
  }
  auto lock = fakecuda::lock_device();
  launch(stream, "muon_pass", std::move(acc), [op, n] {
    MuonPassOp d = op;
    d.grad = dev(op.grad);
    d.m = dev(op.m);
    d.u = dev(op.u);
    d.x = dev(op.x);
    d.master = dev(op.master);
    d.out_bf16 = dev(op.out_bf16);
    d.out_f32 = dev(op.out_f32);
    fakecuda::omp::muon_pass(d, n);
  });
}

// Each pass declares what it reads and writes (adafactor_op.hpp), so the fake's checks of
// device memory and of stream order see every buffer the real kernel touches.
void adafactor_pass(cudaStream_t stream, const AdafactorOp& op) {
  const std::size_t items = op.items();
  if (items == 0) return;
  const std::size_t n = op.rows * op.cols, f = 4, lanes = op.chunks * rules::adafactor::kLanes * 8;
  std::vector<Access> acc;
  const auto replica = [&] {
    if (op.out_bf16) acc.push_back(writes(op.out_bf16, n * 2));
    if (op.out_f32) acc.push_back(writes(op.out_f32, n * f));
  };
  switch (op.pass) {
    case AdafactorOp::Scale: acc = {reads(op.grad, n * f), writes(op.g, n * f)}; break;
    case AdafactorOp::Stats:
      acc = {reads(op.g, n * f), reads(op.master, n * f), writes(op.row_var, op.rows * f),
             writes(op.col_var, op.cols * f), writes(op.lanes_p, lanes)};
      break;
    case AdafactorOp::Mean: acc = {reads(op.row_var, op.rows * f), writes(op.mean, f)}; break;
    case AdafactorOp::Lanes:
      acc = {reads(op.g, n * f), reads(op.row_var, op.rows * f), reads(op.col_var, op.cols * f),
             reads(op.mean, f), writes(op.lanes_u, lanes)};
      break;
    case AdafactorOp::Coefficient:
      acc = {reads(op.lanes_p, lanes), reads(op.lanes_u, lanes), writes(op.coef, f)};
      break;
    case AdafactorOp::Apply:
      acc = {reads(op.g, n * f), reads(op.row_var, op.rows * f), reads(op.col_var, op.cols * f),
             reads(op.mean, f), reads(op.coef, f), writes(op.master, n * f)};
      replica();
      break;
    case AdafactorOp::VectorLanes:
      acc = {reads(op.g, n * f), reads(op.master, n * f), writes(op.variance, n * f),
             writes(op.lanes_p, lanes), writes(op.lanes_u, lanes)};
      break;
    case AdafactorOp::VectorApply:
      acc = {reads(op.g, n * f), reads(op.variance, n * f), reads(op.coef, f),
             writes(op.master, n * f)};
      replica();
      break;
  }
  auto lock = fakecuda::lock_device();
  launch(stream, "adafactor_pass", std::move(acc), [op] {
    AdafactorOp d = op;
    d.grad = dev(op.grad);
    d.g = dev(op.g);
    d.master = dev(op.master);
    d.row_var = dev(op.row_var);
    d.col_var = dev(op.col_var);
    d.variance = dev(op.variance);
    d.lanes_p = dev(op.lanes_p);
    d.lanes_u = dev(op.lanes_u);
    d.mean = dev(op.mean);
    d.coef = dev(op.coef);
    d.out_bf16 = dev(op.out_bf16);
    d.out_f32 = dev(op.out_f32);
    fakecuda::omp::adafactor_pass(d);
  });
}

// The real kernel runs a 256-thread block per quantization block; the fake runs the same
// pieces of AdamW8bitOp over each block's elements in a loop (AdamW8bitOp::operator()).
void adamw8bit_update(cudaStream_t stream, const AdamW8bitOp& op, std::size_t blocks) {
  if (blocks == 0) return;
  const std::size_t n = blocks * rules::q8::kBlock;
  std::vector<Access> acc = {reads(op.qs, sizeof(rules::q8::Qmap)),
                             reads(op.qu, sizeof(rules::q8::Qmap)),
                             writes(op.master, n * 4),
                             reads(op.grad, n * 4),
                             writes(op.code_m, n),
                             writes(op.code_v, n),
                             writes(op.scale_m, blocks * 4),
                             writes(op.scale_v, blocks * 4)};
  if (op.out_bf16) acc.push_back(writes(op.out_bf16, n * 2));
  if (op.out_f32) acc.push_back(writes(op.out_f32, n * 4));
  auto lock = fakecuda::lock_device();
  launch(stream, "adamw8bit_update", std::move(acc), [op, blocks] {
    AdamW8bitOp d = op;
    d.qs = dev(op.qs);
    d.qu = dev(op.qu);
    d.master = dev(op.master);
    d.grad = dev(op.grad);
    d.code_m = dev(op.code_m);
    d.code_v = dev(op.code_v);
    d.scale_m = dev(op.scale_m);
    d.scale_v = dev(op.scale_v);
    d.out_bf16 = dev(op.out_bf16);
    d.out_f32 = dev(op.out_f32);
    fakecuda::omp::adamw8bit_update(d, blocks);
  });
}

void cast_f32_to_bf16(cudaStream_t stream, const float* src, bf16* dst, std::size_t n) {
  if (n == 0) return;
  auto lock = fakecuda::lock_device();
  launch(stream, "cast_f32_to_bf16", {reads(src, n * 4), writes(dst, n * 2)},
         [=] { fakecuda::omp::cast_f32_to_bf16(dev(src), dev(dst), n); });
}

void cast_bf16_to_f32(cudaStream_t stream, const bf16* src, float* dst, std::size_t n) {
  if (n == 0) return;
  auto lock = fakecuda::lock_device();
  launch(stream, "cast_bf16_to_f32", {reads(src, n * 2), writes(dst, n * 4)},
         [=] { fakecuda::omp::cast_bf16_to_f32(dev(src), dev(dst), n); });
}

void round_through_bf16(cudaStream_t stream, float* buf, std::size_t n) {
  if (n == 0) return;
  auto lock = fakecuda::lock_device();
  launch(stream, "round_through_bf16", {writes(buf, n * 4)},
         [=] { fakecuda::omp::round_through_bf16(dev(buf), n); });
}

void accumulate(cudaStream_t stream, float* dst, const float* src, std::size_t n) {
  if (n == 0) return;
  auto lock = fakecuda::lock_device();
  launch(stream, "accumulate_f32", {reads(src, n * 4), writes(dst, n * 4)},
         [=] { fakecuda::omp::accumulate(dev(dst), dev(src), n); });
}

void accumulate(cudaStream_t stream, float* dst, const bf16* src, std::size_t n) {
  if (n == 0) return;
  auto lock = fakecuda::lock_device();
  launch(stream, "accumulate_bf16", {reads(src, n * 2), writes(dst, n * 4)},
         [=] { fakecuda::omp::accumulate(dev(dst), dev(src), n); });
}

DevicePartials sum_squares_partials(cudaStream_t stream, const float* x, std::size_t n,
                                    double* scratch) {
  const NormLastLevel last = norm_last_level(n);
  auto lock = fakecuda::lock_device();
  if (n != 0)
    launch(stream, "sum_squares_partials",
           {reads(x, n * 4), writes(scratch, norm_scratch_count(n) * sizeof(double))},
           [=] { fakecuda::omp::sum_squares_partials(dev(x), n, dev(scratch)); });
  return {scratch + last.offset, last.count};
}

// What the kernels touch comes from the host's plan; what they run on comes from the tables
// in device memory (so a table the backend did not upload, or uploaded wrong, shows), with
// every pointer in them translated to the fake's read/write mapping.
void sum_squares_slices(cudaStream_t stream, const NormPlan& plan, const NormLevelEntry* entries,
                        const NormSliceLast* last, double* results) {
  const std::size_t slices = plan.last.size();
  if (plan.entries.empty() && slices == 0) return;
  std::vector<Access> acc = {reads(entries, plan.entries.size() * sizeof(NormLevelEntry)),
                             reads(last, slices * sizeof(NormSliceLast)),
                             writes(results, slices * sizeof(double))};
  for (const NormLevelEntry& e : plan.entries) {
    if (e.x != nullptr) acc.push_back(reads(e.x, e.n * 4));
    else acc.push_back(reads(e.in, e.count * sizeof(double)));
    const std::size_t items = e.x != nullptr ? norm_lane_count(e.n) : ceil_div(e.count, kNormFanIn);
    acc.push_back(writes(e.out, items * sizeof(double)));
  }
  for (const NormSliceLast& l : plan.last) acc.push_back(reads(l.in, l.count * sizeof(double)));
  auto lock = fakecuda::lock_device();
  launch(stream, "sum_squares_slices", std::move(acc),
         [entries, last, slices, levels = plan.levels, num_entries = plan.entries.size(), results] {
           std::vector<NormLevelEntry> e(dev(entries), dev(entries) + num_entries);
           for (NormLevelEntry& x : e) {
             x.x = x.x != nullptr ? dev(x.x) : nullptr;
             x.in = x.in != nullptr ? dev(x.in) : nullptr;
             x.out = dev(x.out);
           }
           std::vector<NormSliceLast> l(dev(last), dev(last) + slices);
           for (NormSliceLast& x : l) x.in = x.in != nullptr ? dev(x.in) : nullptr;
           fakecuda::omp::sum_squares_slices(e.data(), levels, l.data(), slices, dev(results));
         });
}

bool all_finite(cudaStream_t stream, const float* x, std::size_t n) {
  if (n == 0) return true;
  if (cudaStreamSynchronize(stream) != cudaSuccess) throw Error(Status::Cuda, "all_finite: stream");
  if (!fakecuda::is_device(x, n * 4)) fakecuda::problem("all_finite: not device memory");
  return fakecuda::omp::all_finite(dev(x), n);
}

void exact_pass(cudaStream_t stream, const ExactOp& op, std::size_t n) {
  if (n == 0) return;
  std::vector<Access> acc;
  switch (op.pass) {
    case ExactOp::Deposit:
      acc = {reads(op.g, n * 4), writes(op.top, n * 8), writes(op.low, n * 8), writes(op.level, n)};
      break;
    case ExactOp::Levels: acc = {reads(op.g, n * 4), writes(op.level, n)}; break;
    case ExactOp::RoundToLevels:
      acc = {reads(op.g, n * 4), reads(op.level, n), writes(op.top, n * 8)};
      break;
    case ExactOp::Lift:
      acc = {reads(op.mine, n), reads(op.level, n), writes(op.top, n * 8), reads(op.low, n * 8)};
      break;
    case ExactOp::SumsToFloat:
      acc = {reads(op.top, n * 8), reads(op.level, n), writes(op.dst, n * 4)};
      break;
    case ExactOp::DepositPack:
      acc = {reads(op.g, n * 4), writes(op.words, n * 8)};
      if (op.level != nullptr)
        for (const Access& a : {reads(op.top, n * 8), reads(op.low, n * 8), reads(op.level, n)}) acc.push_back(a);
      break;
    case ExactOp::CombineRaw:
    case ExactOp::CombinePacked: {
      const std::size_t es = op.pass == ExactOp::CombineRaw ? 4 : 8;
      acc = {writes(op.dst, n * 4)};
      for (int r = 0; r < op.nsrc; ++r)
        acc.push_back(reads(static_cast<const char*>(op.src) + static_cast<std::size_t>(r) * op.stride * es, n * es));
      break;
    }
  }
  auto lock = fakecuda::lock_device();
  launch(stream, "exact_pass", std::move(acc), [op, n] {
    ExactOp d = op;
    d.g = dev(op.g);
    d.dst = dev(op.dst);
    d.top = dev(op.top);
    d.low = dev(op.low);
    d.level = dev(op.level);
    d.mine = dev(op.mine);
    d.words = dev(op.words);
    d.src = dev(op.src);
    fakecuda::omp::exact_pass(d, n);
  });
}

ExactDigits exact_square_digits(cudaStream_t stream, const float* x, std::size_t n) {
  if (n == 0) return ExactDigits{};
  if (cudaStreamSynchronize(stream) != cudaSuccess) throw Error(Status::Cuda, "exact_square_digits: stream");
  if (!fakecuda::is_device(x, n * 4)) fakecuda::problem("exact_square_digits: not device memory");
  return fakecuda::omp::exact_square_digits(dev(x), n);
}

}  // namespace shardopt::dev
