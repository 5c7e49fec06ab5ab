// cuda_backend.cpp: the Backend of device memory: cudaMalloc'd buffers and the device
// algorithms of cuda_ops.hpp, all on one compute stream.
//
// The stream is the communicator's device_stream() (the trainer's choice when it built the
// communicator; default the legacy default stream). Collectives run on the communicator's
// own stream and are ordered against this one with events, so kernels here overlap with
// communication. The host waits only where it reads device data (copies to host memory,
// the norm) or must keep a host buffer alive (copies from host memory), and then through
// dev::host_wait, which watches the NCCL communicators for errors while it polls.
//
// Muon (muon_update): the element passes are device algorithms over muon_op.hpp, the
// Frobenius norm the fixed fp64 tree of sum_squares (one host read per matrix), and the
// GEMMs of Newton-Schulz cuBLAS's fp32 cublasSgemm on the compute stream.
//
// Adafactor (adafactor_update): the passes of adafactor_op.hpp, every sum in the CPU's fixed
// order (one work item per chain), so the result is the CPU's bit for bit; no host wait.
//
// Reproducible mode (exact_*): the passes of exact_op.hpp (the deposit, the exchanges' pack
// and combines, the two-phase method's), the element math of src/exact_element.hpp that the
// CPU's kernels run too; the exact sum of squares is an integer reduction (any order, the same
// digits) read back to the host.
#include <cublas_v2.h>

#include <algorithm>
#include <array>
#include <climits>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <vector>

#include "cuda_backend.hpp"
#include "cuda_check.hpp"
#include "cuda_ops.hpp"
#include "cpu/kernels.hpp"
#include "host_wait.hpp"
#include "rules/adafactor.hpp"
#include "rules/adamw8bit.hpp"
#include "rules/qmap.hpp"
#include "shardopt/cuda_comm.hpp"
#include "shardopt/error.hpp"
#include "sum_squares.hpp"

namespace shardopt {
namespace {

void free_device(void* p) noexcept { cudaFree(p); }

/// Throws Error(Cuda, "<call> failed: <status>"); an allocation failure is OutOfMemory.
void check_cublas(cublasStatus_t rc, const char* call) {
  if (rc == CUBLAS_STATUS_SUCCESS) return;
  throw Error(rc == CUBLAS_STATUS_ALLOC_FAILED ? Status::OutOfMemory : Status::Cuda,
              std::string(call) + " failed: " + cublasGetStatusString(rc));
}
#define SHARDOPT_CUBLAS_CHECK(call) check_cublas((call), #call)
void free_pinned(void* p) noexcept { cudaFreeHost(p); }

/// The update's per-step data as it lies in device memory: the step scalars, then the
/// segments. One upload per call; the kernel reads it through pointers.
struct StepBlockLayout {
  static std::size_t segments_offset() {
    return (sizeof(StepScalars) + alignof(UpdateSegment) - 1) / alignof(UpdateSegment) *
           alignof(UpdateSegment);
  }
  static std::size_t bytes(std::size_t segments) {
    return segments_offset() + segments * sizeof(UpdateSegment);
  }
};

/// Uploads of the step block go through a ring of pinned staging slots. The host rewrites a
/// slot only after the upload that last read it has completed (its event); with one slot per
/// bucket of a typical model in the ring, that wait is normally already over, so
/// adam_update() does not wait on the host.
constexpr std::size_t kStagingSlots = 64;

class CudaBackend final : public Backend {
 public:
  CudaBackend(dev::AdamKernel kernel, cudaStream_t stream)
      : kernel_(kernel), stream_(stream != nullptr ? stream : cudaStreamLegacy) {
    int count = 0;
    const cudaError_t rc = cudaGetDeviceCount(&count);
    if (rc != cudaSuccess || count == 0) {
      (void)cudaGetLastError();
      throw Error(Status::Cuda, std::string("Device::Cuda requested, but no CUDA device is "
                                            "usable (cudaGetDeviceCount: ") +
                                    (rc == cudaSuccess ? "0 devices" : cudaGetErrorString(rc)) +
                                    ")");
    }
    for (Slot& s : slots_)
      SHARDOPT_CUDA_CHECK(cudaEventCreateWithFlags(&s.uploaded, cudaEventDisableTiming));
  }
  ~CudaBackend() override {
    try {
      dev::host_wait(stream_);  // our buffers may still be read by queued work
    } catch (...) {           // nothing to report to from a destructor
    }
    if (cublas_ != nullptr) cublasDestroy(cublas_);
    for (Slot& s : slots_) cudaEventDestroy(s.uploaded);
  }

  const char* name() const override { return "cuda"; }

  Allocation allocate(MemoryTracker* tracker, MemCategory category, std::size_t bytes) override {
    if (bytes == 0) return Allocation{};
    void* p = nullptr;
    const cudaError_t rc = cudaMalloc(&p, bytes);
    if (rc != cudaSuccess) {
      (void)cudaGetLastError();
      throw Error(rc == cudaErrorMemoryAllocation ? Status::OutOfMemory : Status::Cuda,
                  "cudaMalloc of " + std::to_string(bytes) + " bytes for " +
                      mem_category_name(category) + " failed: " + cudaGetErrorString(rc));
    }
    Allocation a(p, bytes, free_device, tracker, category);
    SHARDOPT_CUDA_CHECK(cudaMemsetAsync(p, 0, bytes, stream_));
    return a;
  }

  void fill_zero(void* p, std::size_t bytes) override {
    if (bytes) SHARDOPT_CUDA_CHECK(cudaMemsetAsync(p, 0, bytes, stream_));
  }

  // Host copies wait: the caller's host buffer may change or die as soon as we return.
  void copy_from_host(void* dst, const void* host_src, std::size_t bytes) override {
    if (bytes == 0) return;
    SHARDOPT_CUDA_CHECK(cudaMemcpyAsync(dst, host_src, bytes, cudaMemcpyHostToDevice, stream_));
    dev::host_wait(stream_);
  }
  void copy_to_host(void* host_dst, const void* src, std::size_t bytes) override {
    if (bytes == 0) return;
    SHARDOPT_CUDA_CHECK(cudaMemcpyAsync(host_dst, src, bytes, cudaMemcpyDeviceToHost, stream_));
    dev::host_wait(stream_);
  }
  void copy(void* dst, const void* src, std::size_t bytes) override {
    if (bytes == 0) return;
    SHARDOPT_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream_));
  }

  // The host reads the result: the one wait of the norm.
  double sum_squares(const float* x, std::size_t n) override {
    const Slice one{x, n};
    return sum_squares_in_order({&one, 1});
  }

  // Every slice's tree in its own region of one scratch, the trees advancing together: one
  // launch per level and one for the slices' sums (sum_squares.hpp), one copy of the sums to
  // the host, one wait. The host adds the sums in order, as the loop over sum_squares() does.
  double sum_squares_in_order(std::span<const Slice> slices) override {
    norm_slices_.clear();
    for (const Slice& s : slices) norm_slices_.push_back({s.data, s.n});
    // Nothing to read (no slice, or empty ones only): the loop's 0.0 + 0.0 + ... is 0.0.
    const std::size_t scratch_count = dev::norm_plan_scratch_count(norm_slices_);
    if (scratch_count == 0) return 0.0;
    double* scratch = reserve(norm_scratch_, scratch_count * sizeof(double),
                              MemCategory::Scratch, false)
                          .as<double>();
    const dev::NormPlan plan = dev::plan_sum_squares(norm_slices_, scratch);
    // The tables (entries, then the slices' last levels) and the sums, in one pinned and one
    // device buffer: [entries | last | sums].
    const std::size_t entries_bytes = plan.entries.size() * sizeof(dev::NormLevelEntry);
    const std::size_t last_bytes = plan.last.size() * sizeof(dev::NormSliceLast);
    const std::size_t sums_offset = (entries_bytes + last_bytes + 7) / 8 * 8;
    const std::size_t bytes = sums_offset + slices.size() * sizeof(double);
    char* host = reserve(norm_host_, bytes, MemCategory::Scratch, true).as<char>();
    char* device = reserve(norm_tables_, bytes, MemCategory::Scratch, false).as<char>();
    std::memcpy(host, plan.entries.data(), entries_bytes);  // both non-empty here
    std::memcpy(host + entries_bytes, plan.last.data(), last_bytes);
    SHARDOPT_CUDA_CHECK(cudaMemcpyAsync(device, host, entries_bytes + last_bytes,
                                        cudaMemcpyHostToDevice, stream_));
    double* sums = reinterpret_cast<double*>(device + sums_offset);
    dev::sum_squares_slices(stream_, plan, reinterpret_cast<const dev::NormLevelEntry*>(device),
                            reinterpret_cast<const dev::NormSliceLast*>(device + entries_bytes),
                            sums);
    double* host_sums = reinterpret_cast<double*>(host + sums_offset);
    SHARDOPT_CUDA_CHECK(cudaMemcpyAsync(host_sums, sums, slices.size() * sizeof(double),
                                        cudaMemcpyDeviceToHost, stream_));
    dev::host_wait(stream_);
    double sum = 0.0;
    for (std::size_t i = 0; i < slices.size(); ++i) sum += host_sums[i];
    return sum;
  }

  void accumulate(float* dst, const void* src, DType t, std::size_t n) override {
    if (t == DType::F32) {
      dev::accumulate(stream_, dst, static_cast<const float*>(src), n);
    } else {
      dev::accumulate(stream_, dst, static_cast<const bf16*>(src), n);
    }
  }

  void cast_from_f32(const float* src, void* dst, DType t, std::size_t n) override {
    if (t == DType::F32) {
      if (dst != src && n)
        SHARDOPT_CUDA_CHECK(cudaMemcpyAsync(dst, src, n * sizeof(float),
                                            cudaMemcpyDeviceToDevice, stream_));
    } else {
      dev::cast_f32_to_bf16(stream_, src, static_cast<bf16*>(dst), n);
    }
  }

  void adam_update(const StepScalars& s, std::span<const UpdateSegment> segments, float* master,
                   const float* grad, float* m, float* v, void* replica,
                   DType replica_dtype) override {
    require(!segments.empty(), Status::Internal, "adam_update: no segments");
    const std::size_t n = segments.back().end;
    if (n == 0) return;
    // Stage the step block in the next pinned slot (once the upload that last read it is
    // done) and upload it in stream order, ahead of the kernel that reads it.
    Slot& slot = slots_[next_slot_];
    next_slot_ = (next_slot_ + 1) % kStagingSlots;
    const std::size_t bytes = StepBlockLayout::bytes(segments.size());
    if (slot.used) dev::host_wait(slot.uploaded);
    char* host = reserve(slot.host, bytes, MemCategory::Scratch, true).as<char>();
    char* device = reserve(slot.device, bytes, MemCategory::Scratch, false).as<char>();
    std::memcpy(host, &s, sizeof s);
    std::memcpy(host + StepBlockLayout::segments_offset(), segments.data(),
                segments.size() * sizeof(UpdateSegment));
    SHARDOPT_CUDA_CHECK(cudaMemcpyAsync(device, host, bytes, cudaMemcpyHostToDevice, stream_));
    SHARDOPT_CUDA_CHECK(cudaEventRecord(slot.uploaded, stream_));
    slot.used = true;

    dev::AdamChunkOp op;
    op.step = reinterpret_cast<const StepScalars*>(device);
    op.segments = reinterpret_cast<const UpdateSegment*>(device + StepBlockLayout::segments_offset());
    op.num_segments = segments.size();
    op.n = n;
    op.master = master;
    op.grad = grad;
    op.m = m;
    op.v = v;
    op.out_bf16 = replica && replica_dtype == DType::BF16 ? static_cast<bf16*>(replica) : nullptr;
    op.out_f32 = replica && replica_dtype == DType::F32 ? static_cast<float*>(replica) : nullptr;
    op.vectorized = dev::adam_vector_aligned(master, grad, m, v, op.out_bf16, op.out_f32);
    dev::adam_update(stream_, kernel_, op);
  }

  void exact_deposit(const float* g, std::size_t n, std::int64_t* top, std::int64_t* low,
                     std::uint8_t* level) override {
    dev::ExactOp op;
    op.pass = dev::ExactOp::Deposit;
    op.g = g;
    op.top = top;
    op.low = low;
    op.level = level;
    dev::exact_pass(stream_, op, n);
  }
  void exact_levels(const float* g, std::size_t n, std::uint8_t* level) override {
    dev::ExactOp op;
    op.pass = dev::ExactOp::Levels;
    op.g = g;
    op.level = level;
    dev::exact_pass(stream_, op, n);
  }
  void exact_round_to_levels(const float* g, std::size_t n, const std::uint8_t* level,
                             std::int64_t* out) override {
    dev::ExactOp op;
    op.pass = dev::ExactOp::RoundToLevels;
    op.g = g;
    op.level = const_cast<std::uint8_t*>(level);  // read only in this pass
    op.top = out;
    dev::exact_pass(stream_, op, n);
  }
  void exact_lift(const std::uint8_t* mine, const std::uint8_t* level, std::int64_t* top,
                  const std::int64_t* low, std::size_t n) override {
    dev::ExactOp op;
    op.pass = dev::ExactOp::Lift;
    op.mine = mine;
    op.level = const_cast<std::uint8_t*>(level);  // read only in this pass
    op.top = top;
    op.low = const_cast<std::int64_t*>(low);      // read only in this pass
    dev::exact_pass(stream_, op, n);
  }
  void exact_sums_to_float(const std::int64_t* sum, const std::uint8_t* level, float* dst,
                           std::size_t n) override {
    dev::ExactOp op;
    op.pass = dev::ExactOp::SumsToFloat;
    op.top = const_cast<std::int64_t*>(sum);      // read only in this pass
    op.level = const_cast<std::uint8_t*>(level);  // read only in this pass
    op.dst = dst;
    dev::exact_pass(stream_, op, n);
  }
  void exact_square_add(const float* x, std::size_t n, cpu::SquareDigits& squares) override {
    static_assert(dev::ExactDigits::kDigits == cpu::SquareDigits::kDigits &&
                      cpu::SquareDigits::kBase == exact::elem::kDigitBase,
                  "the device's digits are the CPU's");
    for (std::size_t b = 0; b < n; b += dev::ExactDigits::kMaxValues) {
      const dev::ExactDigits d =
          dev::exact_square_digits(stream_, x + b, std::min(dev::ExactDigits::kMaxValues, n - b));
      cpu::SquareDigits part;
      for (int k = 0; k < dev::ExactDigits::kDigits; ++k)
        part.digit[static_cast<std::size_t>(k)] = d.digit[k];
      part.nans = static_cast<double>(d.nans);
      part.infs = static_cast<double>(d.infs);
      squares.merge(part);  // normalises both: digits below 2^63 before the sum
    }
  }
  void exact_combine(const float* const* src, int nsrc, float* dst, std::size_t n,
                     cpu::SquareDigits& squares) override {
    combine_blocks(dev::ExactOp::CombineRaw, reinterpret_cast<const void* const*>(src), sizeof(float), nsrc,
                   dst, n);
    exact_square_add(dst, n, squares);
  }
  void exact_combine_packed(const std::uint64_t* const* src, int nsrc, float* dst, std::size_t n,
                            cpu::SquareDigits& squares) override {
    combine_blocks(dev::ExactOp::CombinePacked, reinterpret_cast<const void* const*>(src),
                   sizeof(std::uint64_t), nsrc, dst, n);
    exact_square_add(dst, n, squares);
  }
  void exact_deposit_pack(const float* g, std::size_t n, const std::int64_t* top, const std::int64_t* low,
                          const std::uint8_t* level, std::uint64_t* out) override {
    dev::ExactOp op;
    op.pass = dev::ExactOp::DepositPack;
    op.g = g;
    op.top = const_cast<std::int64_t*>(top);      // read only in this pass
    op.low = const_cast<std::int64_t*>(low);      // read only in this pass
    op.level = const_cast<std::uint8_t*>(level);  // read only in this pass (null: all empty)
    op.words = out;
    dev::exact_pass(stream_, op, n);
  }
  void lion_update(std::span<const LionSegment> segments, float* master, const float* grad,
                   float* m, void* replica, DType replica_dtype) override {
    // Groups are few: one launch per segment, its scalars by value (no upload).
    for (const LionSegment& seg : segments) {
      const std::size_t n = seg.end - seg.begin;
      if (n == 0) continue;
      dev::LionOp op;
      op.s = seg.scalars;
      op.master = master + seg.begin;
      op.grad = grad + seg.begin;
      op.m = m + seg.begin;
      if (replica && replica_dtype == DType::BF16) op.out_bf16 = static_cast<bf16*>(replica) + seg.begin;
      if (replica && replica_dtype == DType::F32) op.out_f32 = static_cast<float*>(replica) + seg.begin;
      dev::lion_update(stream_, op, n);
    }
  }

  void adamw8bit_update(const StepScalars& s, std::span<const UpdateSegment> segments,
                        float* master, const float* grad, std::uint8_t* code_m,
                        std::uint8_t* code_v, float* scale_m, float* scale_v, void* replica,
                        DType replica_dtype) override {
    constexpr std::size_t kBlock = rules::q8::kBlock;
    if (rules::q8::require_whole_blocks(segments) == 0) return;
    const rules::q8::Qmap* maps = device_qmaps();
    // Groups are few: one launch per segment, its scalars by value (no upload).
    for (const UpdateSegment& seg : segments) {
      const std::size_t blocks = (seg.end - seg.begin) / kBlock;
      if (blocks == 0) continue;
      dev::AdamW8bitOp op;
      op.s = s;
      op.g = seg.scalars;
      op.qs = maps;
      op.qu = maps + 1;
      op.master = master + seg.begin;
      op.grad = grad + seg.begin;
      op.code_m = code_m + seg.begin;
      op.code_v = code_v + seg.begin;
      op.scale_m = scale_m + seg.begin / kBlock;
      op.scale_v = scale_v + seg.begin / kBlock;
      if (replica && replica_dtype == DType::BF16) op.out_bf16 = static_cast<bf16*>(replica) + seg.begin;
      if (replica && replica_dtype == DType::F32) op.out_f32 = static_cast<float*>(replica) + seg.begin;
      dev::adamw8bit_update(stream_, op, blocks);
    }
  }

  // rules::muon::step's arithmetic with the element passes of muon_op.hpp (the CPU's
  // formulas, bitwise) and cuBLAS for the GEMMs (fp32, cuBLAS's own summation order: results
  // agree with the CPU's to rounding, not bit for bit; docs/cuda.md). Workspace as the CPU's:
  // U, X, Y (rows x cols) and S, T (min(rows, cols)^2), at the start of the optimizer's
  // `scratch` (device memory, accounted; the gradient is scaled inside the momentum pass, so
  // the rows * cols the CPU scales it into are not used here).
  void muon_update(const rules::muon::Config& cfg, std::size_t rows, std::size_t cols,
                   float grad_scale, float* master, const float* grad, float* m, void* replica,
                   DType replica_dtype, float* scratch) override {
    rules::muon::check_step(cfg, rows, cols);
    require(rows <= static_cast<std::size_t>(INT_MAX) && cols <= static_cast<std::size_t>(INT_MAX),
            Status::Unsupported, "muon: cuBLAS takes int dimensions: a matrix of " +
                                     std::to_string(rows) + " x " + std::to_string(cols) +
                                     " is too large");
    const std::size_t n = rows * cols, k = std::min(rows, cols);
    require(scratch != nullptr, Status::Internal, "cuda backend: no scratch for Muon");
    float* u = scratch;
    float* x = u + n;
    float* y = x + n;
    float* s = y + n;
    float* t = s + k * k;
    dev::MuonPassOp op;
    op.s = rules::muon::make_scalars(cfg, rows, cols);
    op.nesterov = cfg.nesterov;
    op.grad_scale = grad_scale;
    op.grad = grad;
    op.m = m;
    op.u = u;
    op.pass = dev::MuonPassOp::Momentum;
    dev::muon_pass(stream_, op, n);
    op.divisor = rules::muon::ns_divisor(sum_squares(u, n), cfg.eps);
    op.x = x;
    op.pass = dev::MuonPassOp::Divide;
    dev::muon_pass(stream_, op, n);

    // Row-major U (rows x cols) is, to column-major cuBLAS, V = U^T (cols x rows, ld cols).
    // rows <= cols: X = U = V^T, S = V^T V, and X' = a X + T X is V' = a V + V T.
    // rows > cols:  X = U^T = V, S = V V^T, and V' = a V + T V.
    // Either way X' lies in memory as U does: no transposes. T = b S + c S S is symmetric.
    cublasHandle_t h = cublas();
    const bool wide = rows <= cols;
    const int R = static_cast<int>(rows), C = static_cast<int>(cols), K = static_cast<int>(k);
    const float one = 1.0f, zero = 0.0f, a = op.s.a, b = op.s.b, c = op.s.c;
    for (int it = 0; it < cfg.ns_steps; ++it) {
      // S = X X^T (K x K): V^T V over C, or V V^T over R.
      SHARDOPT_CUBLAS_CHECK(cublasSgemm(h, wide ? CUBLAS_OP_T : CUBLAS_OP_N,
                                        wide ? CUBLAS_OP_N : CUBLAS_OP_T, K, K, wide ? C : R,
                                        &one, x, C, x, C, &zero, s, K));
      // T = c S S + b S.
      SHARDOPT_CUDA_CHECK(cudaMemcpyAsync(t, s, k * k * sizeof(float), cudaMemcpyDeviceToDevice, stream_));
      SHARDOPT_CUBLAS_CHECK(cublasSgemm(h, CUBLAS_OP_N, CUBLAS_OP_N, K, K, K, &c, s, K, s, K, &b, t, K));
      // X' = a X + T X: V T (wide) or T V, C x R over K.
      SHARDOPT_CUDA_CHECK(cudaMemcpyAsync(y, x, n * sizeof(float), cudaMemcpyDeviceToDevice, stream_));
      SHARDOPT_CUBLAS_CHECK(cublasSgemm(h, CUBLAS_OP_N, CUBLAS_OP_N, C, R, K, &one, wide ? x : t,
                                        wide ? C : K, wide ? t : x, wide ? K : C, &a, y, C));
      std::swap(x, y);
    }

    op.x = x;
    op.master = master;
    op.out_bf16 = replica && replica_dtype == DType::BF16 ? static_cast<bf16*>(replica) : nullptr;
    op.out_f32 = replica && replica_dtype == DType::F32 ? static_cast<float*>(replica) : nullptr;
    op.pass = dev::MuonPassOp::Apply;
    dev::muon_pass(stream_, op, n);
  }

  // rules::adafactor::step / step_vector as the passes of adafactor_op.hpp, in the CPU's
  // reduction order: the state and the weights are the CPU's bit for bit. No host wait: the
  // step coefficient stays on the device. The optimizer's `scratch` (device memory,
  // rules::scratch_floats: accounted) holds the reduction's workspace
  // (rules::adafactor::workspace_floats: the lanes in double first, then mean and the
  // coefficient), then the scaled gradient (rows * cols).
  void adafactor_update(const rules::adafactor::Config& cfg, std::int64_t t, std::size_t rows,
                        std::size_t cols, bool factored, float grad_scale, float* master,
                        const float* grad, float* state, void* replica, DType replica_dtype,
                        float* scratch) override {
    namespace ada = rules::adafactor;
    dev::AdafactorOp op;
    op.s = ada::make_scalars(cfg, t);  // the CPU's checks, before anything is queued
    require(rows > 0 && cols > 0, Status::InvalidArgument,
            "adafactor: rows and cols must be >= 1 (torch cannot step an empty tensor either)");
    require(master && grad && state, Status::InvalidArgument,
            "adafactor: a null master, grad or state pointer");
    require(scratch != nullptr && reinterpret_cast<std::uintptr_t>(scratch) % alignof(double) == 0,
            Status::Internal, "cuda backend: no (or a misaligned) scratch for Adafactor");
    op.rows = rows;
    op.cols = cols;
    op.chunks = ada::reduction_chunks(rows, cols, factored);
    op.grad_scale = grad_scale;
    op.grad = grad;
    op.master = master;
    op.lanes_p = reinterpret_cast<double*>(scratch);
    op.lanes_u = op.lanes_p + op.chunks * ada::kLanes;
    op.mean = reinterpret_cast<float*>(op.lanes_u + op.chunks * ada::kLanes);
    op.coef = op.mean + 1;
    op.g = scratch + ada::workspace_floats(rows, cols, factored);
    if (factored) {
      op.row_var = state;
      op.col_var = state + rows;
    } else {
      op.variance = state;
    }
    op.out_bf16 = replica && replica_dtype == DType::BF16 ? static_cast<bf16*>(replica) : nullptr;
    op.out_f32 = replica && replica_dtype == DType::F32 ? static_cast<float*>(replica) : nullptr;
    using P = dev::AdafactorOp;
    static constexpr P::Pass kFactored[] = {P::Scale, P::Stats,       P::Mean,
                                            P::Lanes, P::Coefficient, P::Apply};
    static constexpr P::Pass kVector[] = {P::Scale, P::VectorLanes, P::Coefficient,
                                          P::VectorApply};
    for (const P::Pass pass : factored ? std::span<const P::Pass>(kFactored)
                                       : std::span<const P::Pass>(kVector)) {
      op.pass = pass;
      dev::adafactor_pass(stream_, op);
    }
  }

  void synchronize() override { dev::host_wait(stream_); }

 private:
  // The combines read the blocks in one kernel: they must lie one stride apart (the device
  // communicator's receive buffer holds them so; Backend::exact_combine).
  void combine_blocks(dev::ExactOp::Pass pass, const void* const* src, std::size_t elem_bytes, int nsrc,
                      float* dst, std::size_t n) {
    require(nsrc >= 1, Status::Internal, "exact_combine: no blocks");
    const auto at = [&](int r) { return reinterpret_cast<std::uintptr_t>(src[r]); };
    const std::uintptr_t step = nsrc > 1 ? at(1) - at(0) : 0;
    for (int r = 1; r < nsrc; ++r)
      require(at(r) - at(0) == static_cast<std::uintptr_t>(r) * step && step % elem_bytes == 0, Status::Internal,
              "exact_combine on the device: the blocks must lie one stride apart");
    dev::ExactOp op;
    op.pass = pass;
    op.src = src[0];
    op.stride = step / elem_bytes;
    op.nsrc = nsrc;
    op.dst = dst;
    dev::exact_pass(stream_, op, n);
  }
  struct Slot {
    Allocation host, device;
    cudaEvent_t uploaded = nullptr;
    bool used = false;
  };

  /// The signed and unsigned maps of AdamW8bit (rules::q8::signed_map(), unsigned_map(): the
  /// host's tables are the one source) in device memory, uploaded at the first AdamW8bit
  /// update and kept for the backend's life: 2 x sizeof(Qmap), about 68 KiB; not in the
  /// memory report, like the scratch buffers below.
  const rules::q8::Qmap* device_qmaps() {
    if (qmaps_.data() == nullptr) {
      Allocation& a = reserve(qmaps_, 2 * sizeof(rules::q8::Qmap), MemCategory::Scratch, false);
      auto* d = a.as<rules::q8::Qmap>();
      SHARDOPT_CUDA_CHECK(cudaMemcpyAsync(d, &rules::q8::signed_map(), sizeof(rules::q8::Qmap),
                                          cudaMemcpyHostToDevice, stream_));
      SHARDOPT_CUDA_CHECK(cudaMemcpyAsync(d + 1, &rules::q8::unsigned_map(),
                                          sizeof(rules::q8::Qmap), cudaMemcpyHostToDevice, stream_));
      dev::host_wait(stream_);  // once per backend; the kernels that read them are queued after
    }
    return qmaps_.as<rules::q8::Qmap>();
  }

  /// The cuBLAS handle of Muon's GEMMs, created at the first Muon update (a backend without
  /// Muon never initialises cuBLAS), on the compute stream, fp32 arithmetic (no TF32).
  cublasHandle_t cublas() {
    if (cublas_ == nullptr) {
      SHARDOPT_CUBLAS_CHECK(cublasCreate(&cublas_));
      SHARDOPT_CUBLAS_CHECK(cublasSetStream(cublas_, stream_));
      SHARDOPT_CUBLAS_CHECK(cublasSetMathMode(cublas_, CUBLAS_PEDANTIC_MATH));
    }
    return cublas_;
  }

  /// Grows a scratch buffer to at least `bytes` (device, or pinned host when `pinned`).
  /// Not in the memory report: the optimizer's tracker dies before its backend, and the
  /// largest of these (the norm tree, n/256 doubles) is under 1% of the gradient shard.
  Allocation& reserve(Allocation& a, std::size_t bytes, MemCategory category, bool pinned) {
    if (a.bytes() >= bytes) return a;
    if (a.data() != nullptr) dev::host_wait(stream_);  // the old buffer may be in use
    a = Allocation{};
    void* p = nullptr;
    if (pinned) {
      SHARDOPT_CUDA_CHECK(cudaMallocHost(&p, bytes));
      a = Allocation(p, bytes, free_pinned, nullptr, category);
    } else {
      SHARDOPT_CUDA_CHECK(cudaMalloc(&p, bytes));
      a = Allocation(p, bytes, free_device, nullptr, category);
    }
    return a;
  }

  dev::AdamKernel kernel_;
  cudaStream_t stream_;
  std::array<Slot, kStagingSlots> slots_;
  std::size_t next_slot_ = 0;
  Allocation norm_scratch_, norm_host_;
  Allocation norm_tables_;                  // sum_squares_in_order: the plan's tables, the sums
  Allocation qmaps_;                        // device_qmaps()
  cublasHandle_t cublas_ = nullptr;         // cublas(): Muon's GEMMs
  std::vector<dev::NormSlice> norm_slices_;
};

}  // namespace

// This library's entry into the core (src/cuda_hook.cpp): registered when the library is
// loaded, so make_cuda_backend() in the core creates a CudaBackend.
namespace {
std::unique_ptr<Backend> make_thrust_backend(void* stream) {
  return std::make_unique<CudaBackend>(dev::AdamKernel::Thrust, static_cast<cudaStream_t>(stream));
}
std::shared_ptr<Communicator> make_default_stream_single_process_communicator() {
  return make_cuda_single_process_communicator(nullptr);
}
[[maybe_unused]] const bool registered =
    (register_cuda({&make_thrust_backend, &make_default_stream_single_process_communicator}), true);
}  // namespace

std::unique_ptr<Backend> make_cuda_backend_with(dev::AdamKernel kernel, cudaStream_t stream) {
  return std::make_unique<CudaBackend>(kernel, stream);
}

}  // namespace shardopt

// A static libshardopt_cuda.a is linked with --undefined=shardopt_cuda_link (the target's
// usage requirement), which pulls this object, and so its registration, into the program.
extern "C" void shardopt_cuda_link(void) {}
