// muon.cpp: the Muon rule's CPU math (muon.hpp): the element passes and the fp32 GEMMs.
#include "rules/muon.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "cpu/kernels.hpp"
#include "shardopt/error.hpp"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define SHARDOPT_MUON_X86 1
#endif

// The GEMM's vector types live only inside always-inline helpers of one instruction set each;
// no function passes them by value, so GCC's note about their ABI does not apply.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wpsabi"
#endif

namespace shardopt::rules::muon {
namespace {

// ---------------------------------------------------------------------------------------------
// The GEMM: C (M x N, ldc) = A (M x K, row-major, lda) * B, B(k, j) = B[k * ldb + j], or
// B[j * ldb + k] when b_trans (X^T read from X without a transposed copy).
//
// Every output element is one sum, k ascending from 0 over the whole of K, each product
// rounded to fp32 and added to the running fp32 sum (no FMA: -ffp-contract=off). The k
// blocks only decide when the running sum goes through memory, which does not round it, and
// the threads split the output tiles, never a sum: so neither the thread count, nor the tile
// and register-block sizes, nor the instruction set change a bit. Vectorisation runs over j
// (independent outputs).

constexpr std::size_t kTile = 96;  // output tile, rows and columns (square: symmetric products)
constexpr std::size_t kKc = 256;   // k block: the packed B panel is kKc x kTile floats (96 KiB)

struct Gemm {
  const float* a;
  std::size_t lda;
  const float* b;
  std::size_t ldb;
  bool b_trans;
  float* c;
  std::size_t ldc;
  std::size_t m, n, k;
};

#define SHARDOPT_INLINE inline __attribute__((always_inline))

/// B(k0 .. k0+kc, j0 .. j0+nj) into pack[kk * kTile + jj].
SHARDOPT_INLINE void pack_b(const Gemm& g, std::size_t k0, std::size_t kc, std::size_t j0,
                            std::size_t nj, float* pack) {
  if (g.b_trans) {
    for (std::size_t jj = 0; jj < nj; ++jj) {
      const float* src = g.b + (j0 + jj) * g.ldb + k0;
      for (std::size_t kk = 0; kk < kc; ++kk) pack[kk * kTile + jj] = src[kk];
    }
  } else {
    for (std::size_t kk = 0; kk < kc; ++kk)
      std::memcpy(pack + kk * kTile, g.b + (k0 + kk) * g.ldb + j0, nj * sizeof(float));
  }
}

/// The register block: MR rows x NV vectors of V, every sum in registers across the k block.
template <class V, int MR, int NV>
SHARDOPT_INLINE void micro(std::size_t kc, const float* a, std::size_t lda, const float* bp,
                           float* c, std::size_t ldc, bool first) {
  constexpr std::size_t L = sizeof(V) / sizeof(float);
  V acc[MR][NV];
  for (int r = 0; r < MR; ++r)
    for (int q = 0; q < NV; ++q) {
      if (first)
        acc[r][q] = V{};
      else
        std::memcpy(&acc[r][q], c + r * ldc + q * L, sizeof(V));
    }
  for (std::size_t kk = 0; kk < kc; ++kk) {
    V bv[NV];
    for (int q = 0; q < NV; ++q) std::memcpy(&bv[q], bp + kk * kTile + q * L, sizeof(V));
    for (int r = 0; r < MR; ++r) {
      const float ar = a[r * lda + kk];
      for (int q = 0; q < NV; ++q) acc[r][q] += ar * bv[q];
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int q = 0; q < NV; ++q) std::memcpy(c + r * ldc + q * L, &acc[r][q], sizeof(V));
}

/// A partial block (mr x nr) at a tile's edge: the same sums through memory.
SHARDOPT_INLINE void edge(std::size_t kc, const float* a, std::size_t lda, const float* bp,
                          float* c, std::size_t ldc, std::size_t mr, std::size_t nr, bool first) {
  for (std::size_t r = 0; r < mr; ++r) {
    float* cr = c + r * ldc;
    if (first)
      for (std::size_t j = 0; j < nr; ++j) cr[j] = 0.0f;
    for (std::size_t kk = 0; kk < kc; ++kk) {
      const float ar = a[r * lda + kk];
      const float* br = bp + kk * kTile;
      for (std::size_t j = 0; j < nr; ++j) cr[j] += ar * br[j];
    }
  }
}

/// One output tile (rows i0.., columns j0..), all of K. pack: kKc * kTile floats.
template <class V, int MR, int NV>
SHARDOPT_INLINE void tile_impl(const Gemm& g, std::size_t i0, std::size_t j0, float* pack) {
  constexpr std::size_t NR = NV * (sizeof(V) / sizeof(float));
  static_assert(kTile % MR == 0 && kTile % NR == 0, "register blocks tile the output tile");
  const std::size_t mi = std::min(kTile, g.m - i0);
  const std::size_t nj = std::min(kTile, g.n - j0);
  for (std::size_t k0 = 0; k0 < g.k; k0 += kKc) {
    const std::size_t kc = std::min(kKc, g.k - k0);
    pack_b(g, k0, kc, j0, nj, pack);
    const bool first = k0 == 0;
    for (std::size_t jj = 0; jj < nj; jj += NR) {
      const std::size_t nr = std::min(NR, nj - jj);
      for (std::size_t ii = 0; ii < mi; ii += MR) {
        const std::size_t mr = std::min<std::size_t>(MR, mi - ii);
        const float* a = g.a + (i0 + ii) * g.lda + k0;
        float* c = g.c + (i0 + ii) * g.ldc + j0 + jj;
        if (mr == MR && nr == NR)
          micro<V, MR, NV>(kc, a, g.lda, pack + jj, c, g.ldc, first);
        else
          edge(kc, a, g.lda, pack + jj, c, g.ldc, mr, nr, first);
      }
    }
  }
}

typedef float V4 __attribute__((vector_size(16)));
using TileFn = void (*)(const Gemm&, std::size_t, std::size_t, float*);

void tile_portable(const Gemm& g, std::size_t i0, std::size_t j0, float* pack) {
  tile_impl<V4, 4, 2>(g, i0, j0, pack);
}

#ifdef SHARDOPT_MUON_X86
typedef float V8 __attribute__((vector_size(32)));
typedef float V16 __attribute__((vector_size(64)));

// 6 x 16 (12 ymm sums of 16) and 8 x 32 (16 zmm sums of 32): room for the B vectors and the
// products, which are separate instructions without FMA.
__attribute__((target("avx2"))) void tile_avx2(const Gemm& g, std::size_t i0, std::size_t j0,
                                               float* pack) {
  tile_impl<V8, 6, 2>(g, i0, j0, pack);
}
__attribute__((target("avx512f"))) void tile_avx512(const Gemm& g, std::size_t i0,
                                                    std::size_t j0, float* pack) {
  tile_impl<V16, 8, 2>(g, i0, j0, pack);
}
#endif

TileFn tile_fn() {
#ifdef SHARDOPT_MUON_X86
  switch (cpu::active_isa()) {
    case cpu::Isa::Avx512: return tile_avx512;
    case cpu::Isa::Avx2: return tile_avx2;
    case cpu::Isa::Portable: break;
  }
#endif
  return tile_portable;
}

std::size_t tiles(std::size_t n) { return (n + kTile - 1) / kTile; }

/// C = A B over all tiles, or, when `symmetric` (C known to be symmetric: M == N), over the
/// tiles on and above the diagonal, the rest mirrored. The mirror is the sum the lower tile
/// would compute: C[j][i] multiplies the same pairs in the same k order (X X^T: X[j][k] X[i][k];
/// S S with S symmetric: S[j][k] S[k][i] = S[k][j] S[i][k]), and fp32 products commute.
void gemm(const Gemm& g, bool symmetric) {
  const std::size_t ti = tiles(g.m), tj = tiles(g.n);
  // Tile list: upper triangle (row-major) when symmetric, else all.
  std::vector<std::pair<std::uint32_t, std::uint32_t>> list;
  list.reserve(symmetric ? ti * (ti + 1) / 2 : ti * tj);
  for (std::size_t i = 0; i < ti; ++i)
    for (std::size_t j = symmetric ? i : 0; j < tj; ++j)
      list.emplace_back(static_cast<std::uint32_t>(i), static_cast<std::uint32_t>(j));
  const TileFn fn = tile_fn();
  const std::ptrdiff_t count = static_cast<std::ptrdiff_t>(list.size());
#pragma omp parallel if (count > 1)
  {
    std::vector<float> pack(kKc * kTile);
#pragma omp for schedule(dynamic, 1)
    for (std::ptrdiff_t t = 0; t < count; ++t)
      fn(g, list[static_cast<std::size_t>(t)].first * kTile,
         list[static_cast<std::size_t>(t)].second * kTile, pack.data());
    if (symmetric) {
      // (The omp for above ends with a barrier: every upper tile is written.)
      const std::ptrdiff_t m = static_cast<std::ptrdiff_t>(g.m);
#pragma omp for schedule(static)
      for (std::ptrdiff_t i = 0; i < m; ++i) {
        const std::size_t row = static_cast<std::size_t>(i);
        const std::size_t below = (row / kTile) * kTile;  // columns of tiles left of the diagonal
        for (std::size_t j = 0; j < below; ++j) g.c[row * g.ldc + j] = g.c[j * g.ldc + row];
      }
    }
  }
}

/// Multiply-adds of gemm(): sum over its tiles of rows x columns x K.
double gemm_madds(std::size_t m, std::size_t n, std::size_t k, bool symmetric) {
  double total = 0;
  const std::size_t ti = tiles(m), tj = tiles(n);
  for (std::size_t i = 0; i < ti; ++i)
    for (std::size_t j = symmetric ? i : 0; j < tj; ++j)
      total += static_cast<double>(std::min(kTile, m - i * kTile)) *
               static_cast<double>(std::min(kTile, n - j * kTile)) * static_cast<double>(k);
  return total;
}

// ---------------------------------------------------------------------------------------------

void require_finite(double v, bool nonnegative, const char* what) {
  require(std::isfinite(v) && (!nonnegative || v >= 0.0), Status::InvalidArgument,
          std::string("muon: ") + what + (nonnegative ? " must be finite and >= 0" : " must be finite"));
}

void require_matrix(std::size_t rows, std::size_t cols) {
  require(rows > 0 && cols > 0, Status::InvalidArgument,
          "muon: the matrix has a zero extent (" + std::to_string(rows) + " x " +
              std::to_string(cols) + ")");
  // Workspace sizes (3 rows cols + 2 min^2 floats) must not overflow.
  require(rows <= std::numeric_limits<std::size_t>::max() / 8 / cols, Status::InvalidArgument,
          "muon: the matrix is too large");
}

void require_steps(int steps) {
  require(steps >= 0 && steps <= kMaxNsSteps, Status::InvalidArgument,
          "muon: ns_steps must be in [0, " + std::to_string(kMaxNsSteps) + "], got " +
              std::to_string(steps));
}

}  // namespace

double adjust_ratio(LrAdjust adjust, std::size_t rows, std::size_t cols) {
  const double r = static_cast<double>(rows), c = static_cast<double>(cols);
  switch (adjust) {
    case LrAdjust::Original: return std::sqrt(std::max(1.0, r / c));
    case LrAdjust::MatchRmsAdamW: return 0.2 * std::sqrt(std::max(r, c));
    case LrAdjust::None: return 1.0;
  }
  throw Error(Status::InvalidArgument, "muon: unknown lr adjustment");
}

Scalars make_scalars(const Config& cfg, std::size_t rows, std::size_t cols) {
  Scalars s{};
  s.buf_weight = static_cast<float>(1.0 - cfg.momentum);
  s.nesterov_weight = static_cast<float>(cfg.momentum);
  s.a = static_cast<float>(cfg.a);
  s.b = static_cast<float>(cfg.b);
  s.c = static_cast<float>(cfg.c);
  s.decay_factor = static_cast<float>(1.0 - cfg.lr * cfg.weight_decay);
  s.adjusted_lr = static_cast<float>(cfg.lr * adjust_ratio(cfg.adjust, rows, cols));
  return s;
}

Matrix matrix_of(std::span<const std::size_t> shape) {
  require(shape.size() == 2, Status::InvalidArgument,
          "muon: only 2-D parameters are supported, got " + std::to_string(shape.size()) +
              " dimensions");
  require_matrix(shape[0], shape[1]);
  return {shape[0], shape[1]};
}

std::size_t workspace_floats(std::size_t rows, std::size_t cols) {
  const std::size_t m = std::min(rows, cols);
  return 3 * rows * cols + 2 * m * m;
}

double newton_schulz_flops(std::size_t rows, std::size_t cols, int steps) {
  const std::size_t m = std::min(rows, cols), n = std::max(rows, cols);
  const double per_step = gemm_madds(m, m, n, true)     // S = X X^T
                          + gemm_madds(m, m, m, true)   // S S
                          + gemm_madds(m, n, m, false);  // T X
  return 2.0 * per_step * static_cast<double>(std::max(steps, 0));
}

namespace {

/// newton_schulz() on validated arguments; scratch: 2 m n + 2 m^2 floats (m <= n the sides).
void ns_impl(std::size_t rows, std::size_t cols, const float* in, float* out, float a, float b,
             float c, double eps, int steps, float* scratch) {
  const bool trans = rows > cols;
  const std::size_t m = trans ? cols : rows, n = trans ? rows : cols;  // X is m x n, m <= n
  float* x = scratch;
  float* y = x + m * n;
  float* s = y + m * n;
  float* t = s + m * m;
  const std::ptrdiff_t mn = static_cast<std::ptrdiff_t>(m * n);

  if (trans) {
    for (std::size_t i = 0; i < m; ++i)
      for (std::size_t j = 0; j < n; ++j) x[i * n + j] = in[j * m + i];
  } else {
    std::memcpy(x, in, m * n * sizeof(float));
  }
  // Squares of floats are exact in double; the sum is in X's index order (fixed, serial).
  double sum = 0.0;
  for (std::size_t e = 0; e < m * n; ++e) sum += static_cast<double>(x[e]) * x[e];
  const float divisor = ns_divisor(sum, eps);
#pragma omp parallel for schedule(static) if (mn > (1 << 16))
  for (std::ptrdiff_t e = 0; e < mn; ++e) x[e] = x[e] / divisor;

  const std::ptrdiff_t mm = static_cast<std::ptrdiff_t>(m * m);
  for (int it = 0; it < steps; ++it) {
    gemm({x, n, x, n, true, s, m, m, m, n}, true);   // S = X X^T
    gemm({s, m, s, m, false, t, m, m, m, m}, true);  // S S
#pragma omp parallel for schedule(static) if (mm > (1 << 16))
    for (std::ptrdiff_t e = 0; e < mm; ++e) t[e] = b * s[e] + c * t[e];  // T = b S + c S S
    gemm({t, m, x, n, false, y, n, m, n, m}, false);  // T X
#pragma omp parallel for schedule(static) if (mn > (1 << 16))
    for (std::ptrdiff_t e = 0; e < mn; ++e) y[e] = a * x[e] + y[e];  // a X + T X
    std::swap(x, y);
  }

  if (trans) {
    for (std::size_t i = 0; i < m; ++i)
      for (std::size_t j = 0; j < n; ++j) out[j * m + i] = x[i * n + j];
  } else {
    std::memcpy(out, x, m * n * sizeof(float));
  }
}

}  // namespace

void newton_schulz(std::size_t rows, std::size_t cols, const float* in, float* out, float a,
                   float b, float c, double eps, int steps, Workspace& ws) {
  require_matrix(rows, cols);
  require_steps(steps);
  require(in != nullptr && out != nullptr, Status::InvalidArgument,
          "muon: newton_schulz needs its input and output");
  require_finite(eps, true, "eps");
  const std::size_t need = workspace_floats(rows, cols) - rows * cols;
  if (ws.data.size() < need) ws.data.resize(need);
  ns_impl(rows, cols, in, out, a, b, c, eps, steps, ws.data.data());
}

float ns_divisor(double sum_squares, double eps) {
  return static_cast<float>(std::max(std::sqrt(sum_squares), eps));
}

void check_step(const Config& cfg, std::size_t rows, std::size_t cols) {
  require_matrix(rows, cols);
  require_finite(cfg.lr, true, "lr");
  require_finite(cfg.momentum, true, "momentum");
  require_finite(cfg.weight_decay, true, "weight_decay");
  require_finite(cfg.a, false, "ns coefficient a");
  require_finite(cfg.b, false, "ns coefficient b");
  require_finite(cfg.c, false, "ns coefficient c");
  require_steps(cfg.ns_steps);
  require_finite(cfg.eps, true, "eps");
}

void step(const Config& cfg, std::size_t rows, std::size_t cols, float* master, const float* grad,
          float* momentum, bf16* out_bf16, float* out_f32, Workspace& ws) {
  check_step(cfg, rows, cols);
  if (ws.data.size() < workspace_floats(rows, cols)) ws.data.resize(workspace_floats(rows, cols));
  step(cfg, rows, cols, master, grad, momentum, out_bf16, out_f32, ws.data.data());
}

void step(const Config& cfg, std::size_t rows, std::size_t cols, float* master, const float* grad,
          float* momentum, bf16* out_bf16, float* out_f32, float* workspace) {
  check_step(cfg, rows, cols);
  require(workspace != nullptr, Status::InvalidArgument, "muon: step needs its workspace");
  require(master != nullptr && grad != nullptr && momentum != nullptr, Status::InvalidArgument,
          "muon: step needs the master weights, the gradient and the momentum buffer");
  const Scalars sc = make_scalars(cfg, rows, cols);
  const std::size_t count = rows * cols;
  const std::ptrdiff_t n = static_cast<std::ptrdiff_t>(count);
  // U first in the workspace, newton_schulz's X, Y, S, T after it.
  float* u = workspace;

#pragma omp parallel for schedule(static) if (n > (1 << 16))
  for (std::ptrdiff_t e = 0; e < n; ++e) {
    u[e] = momentum_element(sc, cfg.nesterov, grad[e], momentum[e]);
  }
  ns_impl(rows, cols, u, u, sc.a, sc.b, sc.c, cfg.eps, cfg.ns_steps, u + count);
#pragma omp parallel for schedule(static) if (n > (1 << 16))
  for (std::ptrdiff_t e = 0; e < n; ++e) {
    const float p = apply_element(sc, master[e], u[e]);
    master[e] = p;
    if (out_bf16 != nullptr) out_bf16[e] = to_bf16(p);
    if (out_f32 != nullptr) out_f32[e] = p;
  }
}

}  // namespace shardopt::rules::muon
