// adafactor_op.hpp: Adafactor (src/rules/adafactor.hpp) on the device, as passes over one
// whole parameter.
//
// Plain C++ with __host__ __device__ members, like muon_op.hpp: the CUDA kernels
// (thrust::for_each_n), the Thrust OpenMP build and the fake device run this same code. The
// arithmetic is the header's (lerp, mean_square, factored_variance, update_element,
// apply_element, step_coefficient) and every sum follows its "fixed reduction order": one work
// item per sum that the CPU keeps as one chain (a row, a column, a chunk's lane), each adding
// in the CPU's order, so the statistics, the state and the weights are the CPU's bit for bit
// (fp32 and fp64 alike: device_algorithms.cu is built with --fmad=false, and the division and
// square roots are IEEE's, correctly rounded, without --use_fast_math).
//
// The passes, in order on one stream (each reads what the ones before it wrote):
//   factored:   Scale, Stats (rows, then columns, then the lanes of sum(p^2)), Mean, Lanes
//               (of sum(u^2)), Coefficient, Apply
//   unfactored: Scale, VectorLanes (the variance's lerp and the lanes of sum(p^2) and
//               sum(u^2)), Coefficient, VectorApply
// items() gives each pass's work-item count. The step coefficient never leaves the device.
#pragma once

#include <cstddef>

#include "rules/adafactor.hpp"
#include "shardopt/bf16.hpp"
#include "shardopt/host_device.hpp"

namespace shardopt::dev {

struct AdafactorOp {
  enum Pass : int {
    Scale = 0,        ///< g = grad * grad_scale (one fp32 multiply, as the CPU backend's)
    Stats = 1,        ///< row_var, col_var; lanes_p
    Mean = 2,         ///< mean = max(mean(row_var), eps1)
    Lanes = 3,        ///< lanes_u of the factored u
    Coefficient = 4,  ///< coef = step_coefficient(sums of lanes_p, lanes_u)
    Apply = 5,        ///< master (and the replica) from the factored u
    VectorLanes = 6,  ///< variance; lanes_p, lanes_u
    VectorApply = 7,  ///< master (and the replica) from the variance
  };
  Pass pass = Scale;
  rules::adafactor::Scalars s{};
  std::size_t rows = 0, cols = 0;  ///< the parameter's shape (rows * cols elements)
  std::size_t chunks = 0;          ///< rules::adafactor::reduction_chunks()
  float grad_scale = 1.0f;
  const float* grad = nullptr;  ///< Scale: the reduced gradient
  float* g = nullptr;           ///< the scaled gradient (Scale writes it)
  float* master = nullptr;
  float* row_var = nullptr;   ///< factored: rows floats
  float* col_var = nullptr;   ///< factored: cols floats
  float* variance = nullptr;  ///< unfactored: rows * cols floats
  double* lanes_p = nullptr;  ///< chunks * kLanes: lane k of chunk c at c * kLanes + k
  double* lanes_u = nullptr;
  float* mean = nullptr;       ///< factored: the clamped mean(row_var)
  float* coef = nullptr;       ///< the step coefficient a of p + a * u
  bf16* out_bf16 = nullptr;    ///< the bf16 replica, or null
  float* out_f32 = nullptr;    ///< an fp32 replica that is not the master, or null

  /// Work items of `pass`.
  std::size_t items() const {
    constexpr std::size_t L = rules::adafactor::kLanes;
    switch (pass) {
      case Scale:
      case Apply:
      case VectorApply: return rows * cols;
      case Stats: return rows + cols + chunks * L;
      case Lanes:
      case VectorLanes: return chunks * L;
      case Mean:
      case Coefficient: return 1;
    }
    return 0;
  }

  SHARDOPT_HD void operator()(std::size_t i) const {
    namespace ada = rules::adafactor;
    switch (pass) {
      case Scale: g[i] = grad[i] * grad_scale; break;
      case Stats:
        if (i < rows) {
          row_sum(i);
        } else if (i < rows + cols) {
          column_sum(i - rows);
        } else {
          param_lane(i - rows - cols);
        }
        break;
      case Mean: {
        double sum = 0.0;
        for (std::size_t r = 0; r < rows; ++r) sum += row_var[r];
        const float m = static_cast<float>(sum / static_cast<double>(rows));
        *mean = m < s.eps1 ? s.eps1 : m;  // NaN stays NaN, as torch's clamp_
        break;
      }
      case Lanes: update_lane(i); break;
      case Coefficient: {
        double sum_p = 0.0, sum_u = 0.0;
        for (std::size_t c = 0; c < chunks; ++c) {
          sum_p += ada::combine(lanes_p + c * ada::kLanes);
          sum_u += ada::combine(lanes_u + c * ada::kLanes);
        }
        *coef = ada::step_coefficient(s, sum_p, sum_u, rows * cols, nullptr);
        break;
      }
      case Apply: {
        const float v = ada::factored_variance(row_var[i / cols], col_var[i % cols], *mean);
        write(i, ada::apply_element(s, *coef, master[i], ada::update_element(v, g[i], s.eps1_sq)));
        break;
      }
      case VectorLanes: vector_lane(i); break;
      case VectorApply:
        write(i, ada::apply_element(s, *coef, master[i],
                                    ada::update_element(variance[i], g[i], s.eps1_sq)));
        break;
    }
  }

 private:
  /// Row r's sum of g^2 (element j into lane j % kLanes), then its row_var.
  SHARDOPT_HD void row_sum(std::size_t r) const {
    namespace ada = rules::adafactor;
    double lanes[ada::kLanes] = {};
    const float* gr = g + r * cols;
    for (std::size_t j = 0; j < cols; ++j) lanes[j % ada::kLanes] += ada::sq(gr[j]);
    row_var[r] = ada::lerp(row_var[r], ada::mean_square(ada::combine(lanes), cols), s.weight);
  }
  /// Column j's sum of g^2: per chunk its rows in order from 0, the chunks in order.
  SHARDOPT_HD void column_sum(std::size_t j) const {
    namespace ada = rules::adafactor;
    double sum = 0.0;
    for (std::size_t c = 0; c < chunks; ++c) {
      double part = 0.0;
      const std::size_t last = ada::chunk_first(c + 1, chunks, rows);
      for (std::size_t r = ada::chunk_first(c, chunks, rows); r < last; ++r)
        part += ada::sq(g[r * cols + j]);
      sum += part;
    }
    col_var[j] = ada::lerp(col_var[j], ada::mean_square(sum, rows), s.weight);
  }
  /// Lane k % kLanes of chunk k / kLanes of sum(p^2): its rows in order, each row's elements
  /// j = lane, lane + kLanes, ... (p before the decay).
  SHARDOPT_HD void param_lane(std::size_t k) const {
    namespace ada = rules::adafactor;
    const std::size_t c = k / ada::kLanes, lane = k % ada::kLanes;
    const std::size_t last = ada::chunk_first(c + 1, chunks, rows);
    double acc = 0.0;
    for (std::size_t r = ada::chunk_first(c, chunks, rows); r < last; ++r)
      for (std::size_t j = lane; j < cols; j += ada::kLanes) acc += ada::sq(master[r * cols + j]);
    lanes_p[k] = acc;
  }
  /// The same lane of sum(u^2), u from the new row_var, col_var and mean.
  SHARDOPT_HD void update_lane(std::size_t k) const {
    namespace ada = rules::adafactor;
    const std::size_t c = k / ada::kLanes, lane = k % ada::kLanes;
    const std::size_t last = ada::chunk_first(c + 1, chunks, rows);
    const float m = *mean;
    double acc = 0.0;
    for (std::size_t r = ada::chunk_first(c, chunks, rows); r < last; ++r) {
      const float rv = row_var[r];
      for (std::size_t j = lane; j < cols; j += ada::kLanes)
        acc += ada::sq(ada::update_element(ada::factored_variance(rv, col_var[j], m),
                                           g[r * cols + j], s.eps1_sq));
    }
    lanes_u[k] = acc;
  }
  /// Unfactored, lane k % kLanes of chunk k / kLanes (its elements first + lane, + kLanes,
  /// ...): p^2 (before the decay) into lanes_p; the variance's lerp towards g * g; u^2 from the
  /// new variance into lanes_u. The lanes of all chunks cover every element once.
  SHARDOPT_HD void vector_lane(std::size_t k) const {
    namespace ada = rules::adafactor;
    const std::size_t n = rows * cols, c = k / ada::kLanes, lane = k % ada::kLanes;
    const std::size_t first = c * ada::kVectorChunk;
    const std::size_t last = n - first < ada::kVectorChunk ? n : first + ada::kVectorChunk;
    double acc_p = 0.0, acc_u = 0.0;
    for (std::size_t j = first + lane; j < last; j += ada::kLanes) {
      acc_p += ada::sq(master[j]);
      const float v = ada::lerp(variance[j], g[j] * g[j], s.weight);
      variance[j] = v;
      acc_u += ada::sq(ada::update_element(v, g[j], s.eps1_sq));
    }
    lanes_p[k] = acc_p;
    lanes_u[k] = acc_u;
  }
  SHARDOPT_HD void write(std::size_t i, float p) const {
    master[i] = p;
    if (out_bf16) out_bf16[i] = to_bf16(p);
    if (out_f32) out_f32[i] = p;
  }
};

}  // namespace shardopt::dev
