// cpu_backend.cpp: the Backend of host memory and the CPU kernels.
#include <cstring>
#include <vector>

#include "../backend.hpp"
#include "../rules/adamw8bit.hpp"
#include "kernels.hpp"

namespace shardopt {
namespace {

class CpuBackend final : public Backend {
 public:
  const char* name() const override { return "cpu"; }
  Allocation allocate(MemoryTracker* tracker, MemCategory category, std::size_t bytes) override {
    return allocate_host(tracker, category, bytes);
  }
  void fill_zero(void* p, std::size_t bytes) override {
    if (bytes % sizeof(float) == 0) {
      cpu::fill_zero(static_cast<float*>(p), bytes / sizeof(float));
    } else {
      std::memset(p, 0, bytes);
    }
  }
  void copy_from_host(void* dst, const void* src, std::size_t bytes) override {
    if (bytes) std::memcpy(dst, src, bytes);
  }
  void copy_to_host(void* dst, const void* src, std::size_t bytes) override {
    if (bytes) std::memcpy(dst, src, bytes);
  }
  void copy(void* dst, const void* src, std::size_t bytes) override {
    if (bytes) std::memcpy(dst, src, bytes);
  }
  double sum_squares(const float* x, std::size_t n) override { return cpu::sum_squares(x, n); }
  void accumulate(float* dst, const void* src, DType t, std::size_t n) override {
    if (t == DType::F32) {
      cpu::accumulate(dst, static_cast<const float*>(src), n);
    } else {
      cpu::accumulate(dst, static_cast<const bf16*>(src), n);
    }
  }
  void cast_from_f32(const float* src, void* dst, DType t, std::size_t n) override {
    if (t == DType::F32) {
      if (dst != src && n) std::memcpy(dst, src, n * sizeof(float));
    } else {
      cpu::cast_f32_to_bf16(src, static_cast<bf16*>(dst), n);
    }
  }
  void adam_update(const StepScalars& s, std::span<const UpdateSegment> segments, float* master,
                   const float* grad, float* m, float* v, void* replica,
                   DType replica_dtype) override {
    bf16* out_bf16 = replica && replica_dtype == DType::BF16 ? static_cast<bf16*>(replica) : nullptr;
    float* out_f32 = replica && replica_dtype == DType::F32 ? static_cast<float*>(replica) : nullptr;
    cpu::adam_update(s, segments, master, grad, m, v, out_bf16, out_f32);
  }
  void exact_deposit(const float* g, std::size_t n, std::int64_t* top, std::int64_t* low,
                     std::uint8_t* level) override {
    cpu::exact_deposit(g, n, top, low, level);
  }
  void exact_levels(const float* g, std::size_t n, std::uint8_t* level) override {
    cpu::exact_levels(g, n, level);
  }
  void exact_round_to_levels(const float* g, std::size_t n, const std::uint8_t* level,
                             std::int64_t* out) override {
    cpu::exact_round_to_levels(g, n, level, out);
  }
  void exact_lift(const std::uint8_t* mine, const std::uint8_t* level, std::int64_t* top,
                  const std::int64_t* low, std::size_t n) override {
    cpu::exact_lift(mine, level, top, low, n);
  }
  void exact_sums_to_float(const std::int64_t* sum, const std::uint8_t* level, float* dst,
                           std::size_t n) override {
    cpu::exact_sums_to_float(sum, level, dst, n);
  }
  void exact_square_add(const float* x, std::size_t n, cpu::SquareDigits& squares) override {
    cpu::exact_square_add(x, n, squares);
  }
  void exact_combine(const float* const* src, int nsrc, float* dst, std::size_t n,
                     cpu::SquareDigits& squares) override {
    cpu::exact_combine(src, nsrc, dst, n, &squares);
  }
  void exact_combine_packed(const std::uint64_t* const* src, int nsrc, float* dst, std::size_t n,
                            cpu::SquareDigits& squares) override {
    cpu::exact_combine_packed(src, nsrc, dst, n, &squares);
  }
  void exact_deposit_pack(const float* g, std::size_t n, const std::int64_t* top, const std::int64_t* low,
                          const std::uint8_t* level, std::uint64_t* out) override {
    if (level != nullptr) cpu::exact_deposit_pack(g, n, top, low, level, out);
    else cpu::exact_deposit_packed(g, n, nullptr, out);
  }
  void lion_update(std::span<const LionSegment> segments, float* master, const float* grad,
                   float* m, void* replica, DType replica_dtype) override {
    bf16* out_bf16 = replica && replica_dtype == DType::BF16 ? static_cast<bf16*>(replica) : nullptr;
    float* out_f32 = replica && replica_dtype == DType::F32 ? static_cast<float*>(replica) : nullptr;
    cpu::lion_update(segments, master, grad, m, out_bf16, out_f32);
  }
  void adamw8bit_update(const StepScalars& s, std::span<const UpdateSegment> segments,
                        float* master, const float* grad, std::uint8_t* code_m,
                        std::uint8_t* code_v, float* scale_m, float* scale_v, void* replica,
                        DType replica_dtype) override {
    bf16* out_bf16 = replica && replica_dtype == DType::BF16 ? static_cast<bf16*>(replica) : nullptr;
    float* out_f32 = replica && replica_dtype == DType::F32 ? static_cast<float*>(replica) : nullptr;
    rules::q8::adamw8bit_update(s, segments, master, grad, code_m, code_v, scale_m, scale_v,
                                out_bf16, out_f32);
  }
  // The scratch: the scaled gradient (rows * cols), then Muon's workspace.
  void muon_update(const rules::muon::Config& cfg, std::size_t rows, std::size_t cols,
                   float grad_scale, float* master, const float* grad, float* m, void* replica,
                   DType replica_dtype, float* scratch) override {
    bf16* out_bf16 = replica && replica_dtype == DType::BF16 ? static_cast<bf16*>(replica) : nullptr;
    float* out_f32 = replica && replica_dtype == DType::F32 ? static_cast<float*>(replica) : nullptr;
    const float* g = scale(grad, rows * cols, grad_scale, scratch);
    rules::muon::step(cfg, rows, cols, master, g, m, out_bf16, out_f32, scratch + rows * cols);
  }
  void adafactor_update(const rules::adafactor::Config& cfg, std::int64_t t, std::size_t rows,
                        std::size_t cols, bool factored, float grad_scale, float* master,
                        const float* grad, float* state, void* replica,
                        DType replica_dtype, float* scratch) override {
    bf16* out_bf16 = replica && replica_dtype == DType::BF16 ? static_cast<bf16*>(replica) : nullptr;
    float* out_f32 = replica && replica_dtype == DType::F32 ? static_cast<float*>(replica) : nullptr;
    const float* g = scale(grad, rows * cols, grad_scale, scratch);
    if (factored)
      rules::adafactor::step(cfg, t, rows, cols, master, g, state, state + rows, out_bf16, out_f32);
    else
      rules::adafactor::step_vector(cfg, t, rows * cols, master, g, state, out_bf16, out_f32);
  }

 private:
  // The gradient of one whole parameter times grad_scale, into `out`: one fp32 multiply per
  // element, as adam_element's `grad * s.grad_scale`.
  static const float* scale(const float* grad, std::size_t n, float grad_scale, float* out) {
    require(out != nullptr, Status::Internal, "cpu backend: no scratch for a whole-tensor rule");
    for (std::size_t i = 0; i < n; ++i) out[i] = grad[i] * grad_scale;
    return out;
  }
};

}  // namespace

std::unique_ptr<Backend> make_cpu_backend() { return std::make_unique<CpuBackend>(); }

}  // namespace shardopt
