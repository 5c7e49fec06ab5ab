// backend.hpp: buffers and kernels of one device kind, as the optimizer sees them.
//
// The optimizer's step logic is written once against this interface; the CPU backend
// (src/cpu/) runs OpenMP/SIMD kernels on host memory, the CUDA backend (cuda/) runs device
// kernels on device memory. All pointers below are in the backend's own memory unless they
// are called host_*.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>

#include "shardopt/adam_math.hpp"
#include "shardopt/dtype.hpp"
#include "shardopt/lion_math.hpp"
#include "shardopt/memory.hpp"
#include "shardopt/options.hpp"
#include "shardopt/error.hpp"
#include "rules/adafactor.hpp"
#include "rules/muon.hpp"

namespace shardopt {

class Communicator;
namespace cpu {
struct SquareDigits;
}

/// Test-only: consulted by every host buffer allocation (allocate_host) with its category
/// and size; returning true makes that allocation fail with Error(OutOfMemory) as a real
/// out-of-memory would, so tests can fail one rank's allocation of one buffer. Null (the
/// default) costs one branch.
using AllocationTestHook = bool (*)(MemCategory category, std::size_t bytes);
void set_allocation_test_hook(AllocationTestHook hook);

class Backend {
 public:
  virtual ~Backend() = default;
  virtual const char* name() const = 0;

  /// A zeroed allocation of `bytes`, accounted under `category`.
  virtual Allocation allocate(MemoryTracker* tracker, MemCategory category,
                              std::size_t bytes) = 0;
  virtual void fill_zero(void* p, std::size_t bytes) = 0;
  virtual void copy_from_host(void* dst, const void* host_src, std::size_t bytes) = 0;
  virtual void copy_to_host(void* host_dst, const void* src, std::size_t bytes) = 0;
  /// Copies between two of the backend's own buffers (they do not overlap). Device backends
  /// queue it in stream order and return without waiting, like the kernels below.
  virtual void copy(void* dst, const void* src, std::size_t bytes) = 0;

  /// Sum of squares in double, with an order fixed by n alone (not by threads or timing).
  virtual double sum_squares(const float* x, std::size_t n) = 0;
  /// The sum, in order, of sum_squares() over `slices`: bitwise what a loop adding
  /// sum_squares(slice) to 0.0 slice by slice gives. Device backends queue every slice and
  /// wait once (the step's norm: one wait per step, not one per bucket).
  struct Slice {
    const float* data;
    std::size_t n;
  };
  virtual double sum_squares_in_order(std::span<const Slice> slices) {
    double sum = 0.0;
    for (const Slice& s : slices) sum += sum_squares(s.data, s.n);
    return sum;
  }
  /// dst[i] += src[i], src fp32 or bf16.
  virtual void accumulate(float* dst, const void* src, DType src_dtype, std::size_t n) = 0;
  /// Casts fp32 to the replica dtype (a copy for fp32).
  virtual void cast_from_f32(const float* src, void* dst, DType dst_dtype, std::size_t n) = 0;

  /// The fused update over one shard: segments tile [0, n) of master/grad/m/v. When
  /// `replica` is not null, the new weights are also written there in `replica_dtype`.
  virtual void adam_update(const StepScalars& s, std::span<const UpdateSegment> segments,
                           float* master, const float* grad, float* m, float* v, void* replica,
                           DType replica_dtype) = 0;

  /// Lion (lion_math.hpp) over segments covering [front().begin, back().end) of master,
  /// grad and m (the momentum, indexed like master); the replica as in adam_update().
  virtual void lion_update(std::span<const LionSegment> segments, float* master,
                           const float* grad, float* m, void* replica, DType replica_dtype) = 0;

  /// AdamW8bit (src/rules/adamw8bit.hpp) over segments tiling [0, n) (whole 256-element
  /// blocks): master, grad, the u8 codes of m and v, one fp32 scale of each per block.
  virtual void adamw8bit_update(const StepScalars& s, std::span<const UpdateSegment> segments,
                                float* master, const float* grad, std::uint8_t* code_m,
                                std::uint8_t* code_v, float* scale_m, float* scale_v,
                                void* replica, DType replica_dtype) = 0;

  /// Muon (src/rules/muon.hpp) on one whole rows x cols matrix: the reduced gradient `grad`
  /// is first multiplied by `grad_scale` (fp32, element by element, exactly as adam_update
  /// applies StepScalars::grad_scale), then rules::muon::step runs once on it with master, the
  /// momentum m and the replica as in adam_update(). `scratch`: rules::scratch_floats(Muon)
  /// floats of this backend's memory (the optimizer's, accounted). The CPU and CUDA backends
  /// have it; the default throws Error(Unsupported).
  virtual void muon_update(const rules::muon::Config& cfg, std::size_t rows, std::size_t cols,
                           float grad_scale, float* master, const float* grad, float* m,
                           void* replica, DType replica_dtype, float* scratch) {
    (void)cfg, (void)rows, (void)cols, (void)grad_scale, (void)master, (void)grad, (void)m,
        (void)replica, (void)replica_dtype, (void)scratch;
    throw Error(Status::Unsupported,
                std::string("the Muon rule is not implemented on the ") + name() + " backend");
  }

  /// Adafactor (src/rules/adafactor.hpp) on one whole parameter of rows x cols elements at
  /// step t: the reduced gradient is scaled (rows * cols floats of `scratch`) as in
  /// muon_update(), then rules::adafactor::step runs once on it: `factored`, state is row_var (rows floats) then
  /// col_var (cols floats); otherwise state is the per-element variance (rows * cols floats).
  /// Master and the replica as in adam_update(). `scratch`: rules::scratch_floats(Adafactor)
  /// floats of this backend's memory (the device backend keeps its reduction's workspace,
  /// rules::adafactor::workspace_floats, at its start and the scaled gradient after it). The
  /// CPU and CUDA backends have it (bit for bit the same results); the default throws
  /// Error(Unsupported).
  virtual void adafactor_update(const rules::adafactor::Config& cfg, std::int64_t t,
                                std::size_t rows, std::size_t cols, bool factored,
                                float grad_scale, float* master, const float* grad, float* state,
                                void* replica, DType replica_dtype, float* scratch) {
    (void)cfg, (void)t, (void)rows, (void)cols, (void)factored, (void)grad_scale, (void)master,
        (void)grad, (void)state, (void)replica, (void)replica_dtype, (void)scratch;
    throw Error(Status::Unsupported,
                std::string("the Adafactor rule is not implemented on the ") + name() + " backend");
  }

  // ---- reproducible mode's two-phase exact sums (exact_sum.hpp), on this backend's memory --
  // One pass each over n elements, the element math of exact_element.hpp (the same bits on
  // every backend): the deposit of a micro-batch into the levels and bins, the levels of a
  // micro-batch, its values rounded to the low bin of agreed levels, the bins lifted to
  // agreed levels and packed, the exact sums rounded once to fp32 (cpu::exact_* in
  // cpu/kernels.hpp say the same in detail). The default throws Error(Unsupported).
  virtual void exact_deposit(const float* g, std::size_t n, std::int64_t* top,
                             std::int64_t* low, std::uint8_t* level);
  virtual void exact_levels(const float* g, std::size_t n, std::uint8_t* level);
  virtual void exact_round_to_levels(const float* g, std::size_t n, const std::uint8_t* level,
                                     std::int64_t* out);
  virtual void exact_lift(const std::uint8_t* mine, const std::uint8_t* level, std::int64_t* top,
                          const std::int64_t* low, std::size_t n);
  virtual void exact_sums_to_float(const std::int64_t* sum, const std::uint8_t* level,
                                   float* dst, std::size_t n);
  /// The exact squares of x[0, n) join `squares` (host memory; device backends wait for it).
  virtual void exact_square_add(const float* x, std::size_t n, cpu::SquareDigits& squares);

  // ---- reproducible mode's exchanges (ExactGrads::reduce_direct, reduce_packed) ------------
  // What an owner does with the blocks that Communicator::reduce_scatter_combine delivers,
  // in this backend's memory, and the packed state that goes on the wire. The element math is
  // exact_element.hpp's (cpu::exact_combine, exact_combine_packed and exact_deposit_pack say
  // the same in detail). A device backend takes src[r] = src[0] + r * stride, one stride for
  // every r (how a device communicator delivers the blocks; Error(Internal) otherwise). The
  // default throws Error(Unsupported).
  /// dst[i] = the exact sum of src[0][i], ..., src[nsrc - 1][i] (raw fp32 values) rounded
  /// once to fp32; the exact squares of dst join `squares`.
  virtual void exact_combine(const float* const* src, int nsrc, float* dst, std::size_t n,
                             cpu::SquareDigits& squares);
  /// dst[i] = the exact sum of the packed states src[.][i] rounded once to fp32; the exact
  /// squares of dst join `squares`.
  virtual void exact_combine_packed(const std::uint64_t* const* src, int nsrc, float* dst,
                                    std::size_t n, cpu::SquareDigits& squares);
  /// out[i] = the packed state of the bins (top, low, level; level null: all empty) with g[i]
  /// deposited; the bins are not changed.
  virtual void exact_deposit_pack(const float* g, std::size_t n, const std::int64_t* top,
                                  const std::int64_t* low, const std::uint8_t* level,
                                  std::uint64_t* out);

  /// Waits for queued work (device backends); a no-op on the CPU.
  virtual void synchronize() {}
};

std::unique_ptr<Backend> make_cpu_backend();
/// The CUDA backend (libshardopt_cuda; src/cuda_hook.cpp), computing on `stream` (a
/// cudaStream_t; nullptr: the legacy default stream). Throws Error(Unsupported) when
/// shardopt was built without CUDA or that library can be neither found nor loaded.
std::unique_ptr<Backend> make_cuda_backend(void* stream = nullptr);
/// make_cuda_single_process_communicator() of libshardopt_cuda (shardopt/cuda_comm.hpp) on
/// the legacy default stream, for callers in the core (the C ABI's shardopt_create); throws
/// as make_cuda_backend() when that library is not there.
std::shared_ptr<Communicator> make_cuda_single_process_communicator_from_core();
/// What libshardopt_cuda registers when it is loaded.
struct CudaEntryPoints {
  std::unique_ptr<Backend> (*make_backend)(void* stream) = nullptr;
  std::shared_ptr<Communicator> (*make_single_process_communicator)() = nullptr;
};
void register_cuda(const CudaEntryPoints& entry);

}  // namespace shardopt
