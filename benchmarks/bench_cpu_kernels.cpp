// bench_cpu_kernels.cpp: every CPU kernel of the step against the machine's own memory
// bandwidth, measured in the same run.
//
// Ceilings: a STREAM triad (a = b + s*c) and an in-place update (a += s*b). The in-place
// update is the fair ceiling for an optimizer that updates in place: it pays no
// write-allocate read, which STREAM does not count either. Each kernel runs through the
// dispatched ISA, forced to the portable path, without non-temporal stores where it has
// them, and as the straightforward scalar loop (the baseline); AdamW and AdamW8bit also
// forced to AVX2 where AVX-512 is the best ISA. After the Google Benchmark
// output a table gives parameters/s, GB/s and the fraction of the in-place bandwidth.
//
//   bench_cpu_kernels [--sizes=1Mi,16Mi,64Mi,256Mi] [--threads=2] [Google Benchmark flags]
#include <benchmark/benchmark.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <unistd.h>

#if defined(_OPENMP)
#include <omp.h>
#endif

#include "cli.hpp"
#include "kernel_table.hpp"
#include "kernels.hpp"
#include "rules/adamw8bit.hpp"
#include "shardopt/lion_math.hpp"

namespace {

using namespace shardopt;
using cpu::Isa;
using cpu::StreamPolicy;

// ---- buffers, first touched with the kernels' own static partition -----------------------

struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};

template <class T>
std::unique_ptr<T[], FreeDeleter> alloc(std::size_t n) {
  const std::size_t bytes = (n * sizeof(T) + 4095) / 4096 * 4096;
  return std::unique_ptr<T[], FreeDeleter>(static_cast<T*>(std::aligned_alloc(4096, bytes)));
}

struct Buffers {
  std::size_t n = 0;
  std::unique_ptr<float[], FreeDeleter> p, g, m, v;
  std::unique_ptr<bf16[], FreeDeleter> half;
  // Reproducible mode's two-phase method (made by exact_buffers() on first use): g's levels,
  // levels one or two above them (lifts), and two int64 arrays.
  std::unique_ptr<std::uint8_t[], FreeDeleter> level, lifted;
  std::unique_ptr<std::int64_t[], FreeDeleter> sums, low;
};

float value(std::size_t i, std::uint32_t salt) {
  std::uint32_t h = static_cast<std::uint32_t>(i) * 2654435761u ^ salt * 40503u;
  h ^= h >> 15;
  return static_cast<float>(h & 0xFFFF) / 32768.0f - 1.0f;
}

/// g's values (in buffers(), and untimed before each run of a kernel that clears g).
void fill_g(Buffers& b) {
  float* g = b.g.get();
#pragma omp parallel for schedule(static)
  for (std::ptrdiff_t i = 0; i < static_cast<std::ptrdiff_t>(b.n); ++i) g[i] = 1e-2f * value(static_cast<std::size_t>(i), 2);
}

/// One set of arrays at a time (256M parameters take 4.5 GB); kept while sizes repeat.
Buffers& buffers(std::size_t n) {
  static Buffers b;
  if (b.n == n) return b;
  b = Buffers{};
  b.n = n;
  b.p = alloc<float>(n), b.g = alloc<float>(n), b.m = alloc<float>(n), b.v = alloc<float>(n);
  b.half = alloc<bf16>(n);
  for (float* x : {b.p.get(), b.g.get(), b.m.get(), b.v.get()}) cpu::fill_zero(x, n);
  cpu::cast_f32_to_bf16(b.m.get(), b.half.get(), n);  // first touch in the same partition
  float* p = b.p.get();
#pragma omp parallel for schedule(static)
  for (std::ptrdiff_t i = 0; i < static_cast<std::ptrdiff_t>(n); ++i) p[i] = value(static_cast<std::size_t>(i), 1);
  fill_g(b);
  cpu::cast_f32_to_bf16(p, b.half.get(), n);
  return b;
}

/// The two-phase method's arrays: g's levels and g rounded to them (the sums), first touched
/// with the kernels' own partition.
Buffers& exact_buffers(Buffers& b) {
  if (b.level) return b;
  const std::size_t n = b.n;
  b.level = alloc<std::uint8_t>(n), b.lifted = alloc<std::uint8_t>(n);
  b.sums = alloc<std::int64_t>(n), b.low = alloc<std::int64_t>(n);
  cpu::exact_levels(b.g.get(), n, b.level.get());
  cpu::exact_round_to_levels(b.g.get(), n, b.level.get(), b.sums.get());
  cpu::exact_round_to_levels(b.g.get(), n, b.level.get(), b.low.get());
  for (std::size_t i = 0; i < n; ++i) b.lifted[i] = static_cast<std::uint8_t>(b.level[i] + 1 + i % 2);
  return b;
}

void set_threads(int t) {
#if defined(_OPENMP)
  omp_set_num_threads(t);
#else
  (void)t;
#endif
}

const StepHyper kHyper{1e-3, 0.9, 0.999, 1e-8, 0.1, AdamMode::AdamW, 10};

// ---- the straightforward scalar loops (baseline) -----------------------------------------

void scalar_adam(const StepScalars& s, const SegmentScalars& sg, float* p, const float* g,
                 float* m, float* v, bf16* out, std::size_t n) {
#pragma omp parallel for schedule(static)
  for (std::ptrdiff_t i = 0; i < static_cast<std::ptrdiff_t>(n); ++i) {
    adam_element(s, sg, p[i], g[i], m[i], v[i]);
    out[i] = to_bf16(p[i]);
  }
}

// ---- what runs: name, bytes per parameter, body -------------------------------------------

enum class Variant { Dispatched, Avx2, Portable, NoStream, Scalar, Ceiling };

struct Kernel {
  std::string name;
  double bytes_per_param;
  Variant variant;
  std::function<double(Buffers&)> run;  // returns something to keep
  std::function<void(Buffers&)> setup;  // untimed, before each run (if any)
};

std::vector<Kernel> kernels() {
  std::vector<Kernel> k;
  auto add = [&](std::string name, double bytes, Variant var, std::function<double(Buffers&)> f,
                 std::function<void(Buffers&)> setup = nullptr) {
    k.push_back({std::move(name), bytes, var, std::move(f), std::move(setup)});
  };
  add("triad", 12, Variant::Ceiling, [](Buffers& b) {
    float *a = b.p.get(), *x = b.g.get(), *y = b.m.get();
    const float s = 0.5f;
#pragma omp parallel for simd schedule(static)
    for (std::ptrdiff_t i = 0; i < static_cast<std::ptrdiff_t>(b.n); ++i) a[i] = x[i] + s * y[i];
    return 0.0;
  });
  add("inplace", 12, Variant::Ceiling, [](Buffers& b) {
    float *a = b.m.get(), *x = b.g.get();
    const float s = 1e-3f;
#pragma omp parallel for simd schedule(static)
    for (std::ptrdiff_t i = 0; i < static_cast<std::ptrdiff_t>(b.n); ++i) a[i] += s * x[i];
    return 0.0;
  });
  // The streams of exact_deposit_combine_2 below with no arithmetic: two ranks' 8-byte words
  // and 4-byte values read, one float written (28 bytes per element), each source asked for
  // kExactPrefetchElems ahead as the library's SIMD combines do. That kernel's own memory
  // floor in the same run: its time over this row's is what its arithmetic adds.
  add(
      "combine_streams_2", 28, Variant::Ceiling,
      [](Buffers& b) {
        const auto* w0 = reinterpret_cast<const std::uint64_t*>(b.sums.get());
        const auto* w1 = reinterpret_cast<const std::uint64_t*>(b.low.get());
        const float *x = b.g.get(), *y = b.v.get();
        float* d = b.m.get();
        constexpr std::size_t kBlock = 16;  // one cache line of floats, two of words
        const auto ahead = [](const void* p, std::size_t bytes) {
          __builtin_prefetch(reinterpret_cast<const void*>(reinterpret_cast<std::uintptr_t>(p) + bytes));
        };
        const auto blocks = static_cast<std::ptrdiff_t>(b.n / kBlock);
#pragma omp parallel for schedule(static)
        for (std::ptrdiff_t k = 0; k < blocks; ++k) {
          const std::size_t i = static_cast<std::size_t>(k) * kBlock;
          constexpr std::size_t kF = cpu::kExactPrefetchElems * sizeof(float);
          constexpr std::size_t kU = cpu::kExactPrefetchElems * sizeof(std::uint64_t);
          ahead(x + i, kF), ahead(y + i, kF), ahead(w0 + i, kU), ahead(w0 + i + 8, kU);
          ahead(w1 + i, kU), ahead(w1 + i + 8, kU);
          for (std::size_t j = i; j < i + kBlock; ++j) {
            std::uint32_t u = std::bit_cast<std::uint32_t>(x[j]) ^ std::bit_cast<std::uint32_t>(y[j]);
            u ^= static_cast<std::uint32_t>(w0[j] ^ (w0[j] >> 32) ^ w1[j] ^ (w1[j] >> 32));
            d[j] = std::bit_cast<float>(u);
          }
        }
        return 0.0;
      },
      [](Buffers& b) { exact_buffers(b); });

  const StepScalars s = make_step_scalars(kHyper, 1.0);
  const SegmentScalars sg = make_segment_scalars(kHyper, 1.0, true);
  auto adam = [s, sg](Buffers& b) {
    const UpdateSegment seg{0, b.n, sg};
    cpu::adam_update(s, {&seg, 1}, b.p.get(), b.g.get(), b.m.get(), b.v.get(), b.half.get(),
                     nullptr);
    return 0.0;
  };
  // Lion: master, grad, its momentum (m), the bf16 replica.
  const LionScalars ls = make_lion_scalars(0.9, 0.99, 1e-4, 0.1, 1.0);
  auto lion = [ls](Buffers& b) {
    const LionSegment seg{0, b.n, ls};
    cpu::lion_update({&seg, 1}, b.p.get(), b.g.get(), b.m.get(), b.half.get(), nullptr);
    return 0.0;
  };
  // AdamW8bit: master, grad, the codes of m and v (in m's buffer: n bytes each), the block
  // scales (in v's buffer), the bf16 replica.
  auto adam8 = [s, sg](Buffers& b) {
    const std::size_t n = b.n / rules::q8::kBlock * rules::q8::kBlock;
    const UpdateSegment seg{0, n, sg};
    auto* codes = reinterpret_cast<std::uint8_t*>(b.m.get());
    float* scales = b.v.get();
    rules::q8::adamw8bit_update(s, {&seg, 1}, b.p.get(), b.g.get(), codes, codes + b.n, scales,
                                scales + n / rules::q8::kBlock, b.half.get(), nullptr);
    return 0.0;
  };
  auto down = [](Buffers& b) { cpu::cast_f32_to_bf16(b.p.get(), b.half.get(), b.n); return 0.0; };
  auto up = [](Buffers& b) { cpu::cast_bf16_to_f32(b.half.get(), b.v.get(), b.n); return 0.0; };
  auto acc32 = [](Buffers& b) { cpu::accumulate(b.m.get(), b.g.get(), b.n); return 0.0; };
  auto acc16 = [](Buffers& b) { cpu::accumulate(b.m.get(), b.half.get(), b.n); return 0.0; };
  auto sumsq = [](Buffers& b) { return cpu::sum_squares(b.g.get(), b.n); };
  auto finite = [](Buffers& b) { return cpu::all_finite(b.g.get(), b.n) ? 1.0 : 0.0; };
  auto scale = [](Buffers& b) { cpu::scale(b.g.get(), b.n, 1.0f); return 0.0; };
  // Reproducible mode's direct exchange on one rank of two: g and v are the two ranks' raw
  // values, m the result; the exact squares of the result in the same pass.
  auto combine = [](Buffers& b) {
    const float* src[2] = {b.g.get(), b.v.get()};
    cpu::SquareDigits sq;
    cpu::exact_combine(src, 2, b.m.get(), b.n, &sq);
    return static_cast<double>(sq.digit[0]);
  };
  auto combine_only = [](Buffers& b) {
    const float* src[2] = {b.g.get(), b.v.get()};
    cpu::exact_combine(src, 2, b.m.get(), b.n, nullptr);
    return 0.0;
  };
  auto exact_sq = [](Buffers& b) {
    cpu::SquareDigits sq;
    cpu::exact_square_add(b.g.get(), b.n, sq);
    return static_cast<double>(sq.digit[0]);
  };
  // Reproducible mode's two-phase method (one micro-batch per rank): g's levels, g rounded to
  // its levels' grids (int64), the int64 sums rounded once to fp32 (into m); with several
  // micro-batches, the bins lifted by one or two levels (idempotent: run after run the same).
  auto levels = [](Buffers& b) {
    cpu::exact_levels(b.g.get(), b.n, exact_buffers(b).level.get());
    return 0.0;
  };
  auto round_levels = [](Buffers& b) {
    exact_buffers(b);
    cpu::exact_round_to_levels(b.g.get(), b.n, b.level.get(), b.sums.get());
    return 0.0;
  };
  auto sums_to_float = [](Buffers& b) {
    exact_buffers(b);
    cpu::exact_sums_to_float(b.sums.get(), b.level.get(), b.m.get(), b.n);
    return 0.0;
  };
  auto lift = [](Buffers& b) {
    exact_buffers(b);
    cpu::exact_lift(b.level.get(), b.lifted.get(), b.low.get(), b.sums.get(), b.n);
    return 0.0;
  };

  // Reproducible mode's deposit of a micro-batch (g) into the accumulator: the bins (levels
  // and two int64 bins: 4 + 17 read + 17 written per element) and the compact form's packed
  // words in place (4 + 8 read + 8 written). Run after run the same levels: no lifts.
  auto deposit_bins = [](Buffers& b) {
    exact_buffers(b);
    cpu::exact_deposit(b.g.get(), b.n, b.sums.get(), b.low.get(), b.level.get());
    return 0.0;
  };
  auto deposit_packed = [](Buffers& b) {
    auto* words = reinterpret_cast<std::uint64_t*>(exact_buffers(b).sums.get());
    cpu::exact_deposit_packed(b.g.get(), b.n, words, words);
    return 0.0;
  };
  // The first deposit of a step (nothing to read: 4 read + 8 written), and a micro-batch
  // consumed (begin_backward): the deposit and g cleared, in one pass
  // (exact_deposit_packed_clear) or as the deposit followed by fill_zero (4 more written);
  // g is refilled before each run, untimed, and after the last (later rows read it).
  auto deposit_first = [](Buffers& b) {
    auto* words = reinterpret_cast<std::uint64_t*>(exact_buffers(b).sums.get());
    cpu::exact_deposit_packed(b.g.get(), b.n, nullptr, words);
    return 0.0;
  };
  auto first_then_zero = [](Buffers& b) {
    auto* words = reinterpret_cast<std::uint64_t*>(exact_buffers(b).sums.get());
    cpu::exact_deposit_packed(b.g.get(), b.n, nullptr, words);
    cpu::fill_zero(b.g.get(), b.n);
    return 0.0;
  };
  auto first_clear = [](Buffers& b) {
    auto* words = reinterpret_cast<std::uint64_t*>(exact_buffers(b).sums.get());
    cpu::exact_deposit_packed_clear(b.g.get(), b.n, nullptr, words);
    return 0.0;
  };
  auto deposit_then_zero = [](Buffers& b) {
    auto* words = reinterpret_cast<std::uint64_t*>(exact_buffers(b).sums.get());
    cpu::exact_deposit_packed(b.g.get(), b.n, words, words);
    cpu::fill_zero(b.g.get(), b.n);
    return 0.0;
  };
  auto deposit_clear = [](Buffers& b) {
    auto* words = reinterpret_cast<std::uint64_t*>(exact_buffers(b).sums.get());
    cpu::exact_deposit_packed_clear(b.g.get(), b.n, words, words);
    return 0.0;
  };
  // The packed exchange at an owner on shared memory, 2 ranks (exact_deposit_combine_packed):
  // each rank's words (8 bytes, from sums and low) and its last micro-batch (g, v) read, the
  // result (m) written, with its exact squares ("_nosq": without them). "_scratch": the method
  // before (2026-11-28): each rank's last micro-batch deposited into a per-window scratch,
  // then exact_combine_packed, through the same table.
  auto fill_words = [](Buffers& b) {
    exact_buffers(b);
    cpu::exact_deposit_packed(b.g.get(), b.n, nullptr, reinterpret_cast<std::uint64_t*>(b.sums.get()));
    cpu::exact_deposit_packed(b.v.get(), b.n, nullptr, reinterpret_cast<std::uint64_t*>(b.low.get()));
  };
  // The sharded accumulation's owner: two ranks' values (g, v) into the words in one pass
  // (exact_deposit_packed_multi: 4 + 4 + 8 read, 8 written: 24 bytes per element, two
  // values), against two exact_deposit_packed passes (2 x 20 bytes).
  auto deposit_multi = [](Buffers& b) {
    auto* words = reinterpret_cast<std::uint64_t*>(exact_buffers(b).sums.get());
    const float* src[2] = {b.g.get(), b.v.get()};
    cpu::exact_deposit_packed_multi(src, 2, b.n, words, words);
    return 0.0;
  };
  auto deposit_combine = [](Buffers& b) {
    const std::uint64_t* words[2] = {reinterpret_cast<const std::uint64_t*>(b.sums.get()),
                                     reinterpret_cast<const std::uint64_t*>(b.low.get())};
    const float* last[2] = {b.g.get(), b.v.get()};
    cpu::SquareDigits sq;
    cpu::exact_deposit_combine_packed(words, last, 2, b.m.get(), b.n, &sq);
    return static_cast<double>(sq.digit[0]);
  };
  auto deposit_combine_nosq = [](Buffers& b) {
    const std::uint64_t* words[2] = {reinterpret_cast<const std::uint64_t*>(b.sums.get()),
                                     reinterpret_cast<const std::uint64_t*>(b.low.get())};
    const float* last[2] = {b.g.get(), b.v.get()};
    cpu::exact_deposit_combine_packed(words, last, 2, b.m.get(), b.n, nullptr);
    return static_cast<double>(b.m[0]);
  };
  auto deposit_combine_scratch = [](Buffers& b) {
    const std::uint64_t* words[2] = {reinterpret_cast<const std::uint64_t*>(b.sums.get()),
                                     reinterpret_cast<const std::uint64_t*>(b.low.get())};
    const float* last[2] = {b.g.get(), b.v.get()};
    const cpu::RangeKernels& k = cpu::active_kernels();
    const std::size_t chunk = cpu::kExactChunk;
    const auto windows = static_cast<std::ptrdiff_t>((b.n + chunk - 1) / chunk);
    float* dst = b.m.get();
    cpu::SquareDigits sq;
#pragma omp parallel
    {
      std::vector<std::uint64_t> state(2 * chunk);
      cpu::SquareDigits part;
#pragma omp for schedule(static)
      for (std::ptrdiff_t c = 0; c < windows; ++c) {
        const std::size_t w = static_cast<std::size_t>(c) * chunk;
        const std::size_t len = std::min(chunk, b.n - w);
        for (std::size_t r = 0; r < 2; ++r)
          k.exact_deposit_packed(last[r] + w, len, words[r] + w, state.data() + r * chunk);
        const std::uint64_t* at[2] = {state.data(), state.data() + chunk};
        k.exact_combine_packed(at, 2, dst + w, len);
        k.exact_square_add(dst + w, len, part);
      }
#pragma omp critical
      sq.merge(part);
    }
    return static_cast<double>(sq.digit[0]);
  };

  struct Entry {
    const char* name;
    double bytes;
    std::function<double(Buffers&)> fn;
    bool streams;
    /// The straightforward scalar loop; none where the portable path is that loop (the code
    /// the kernel replaced).
    std::function<double(Buffers&)> scalar;
    bool avx2 = false;  ///< also forced to AVX2 where AVX-512 is the best ISA
    std::function<void(Buffers&)> setup = nullptr;  ///< untimed, before each run
  };
  const std::vector<Entry> entries = {
      {"adamw_bf16", 30, adam, true,
       [s, sg](Buffers& b) {
         scalar_adam(s, sg, b.p.get(), b.g.get(), b.m.get(), b.v.get(), b.half.get(), b.n);
         return 0.0;
       },
       true},
      // The scalar loops: the kernels' portable arithmetic on one thread.
      {"lion_bf16", 22, lion, false,
       [ls](Buffers& b) {
         for (std::size_t i = 0; i < b.n; ++i) {
           lion_element(ls, b.p[i], b.g[i], b.m[i]);
           b.half[i] = to_bf16(b.p[i]);
         }
         return 0.0;
       }},
      {"adamw8bit_bf16", 18.0 + 8.0 / 256 * 2, adam8, false,
       [s, sg](Buffers& b) {
         const std::size_t n = b.n / rules::q8::kBlock * rules::q8::kBlock;
         auto* codes = reinterpret_cast<std::uint8_t*>(b.m.get());
         float* scales = b.v.get();
         for (std::size_t k = 0; k < n; k += rules::q8::kBlock)
           rules::q8::adamw8bit_block(s, sg, b.p.get() + k, b.g.get() + k, codes + k,
                                      codes + b.n + k, scales[k / rules::q8::kBlock],
                                      scales[n / rules::q8::kBlock + k / rules::q8::kBlock],
                                      b.half.get() + k, nullptr, rules::q8::kBlock);
         return 0.0;
       },
       true},
      {"cast_f32_to_bf16", 6, down, true,
       [](Buffers& b) {
         const float* x = b.p.get();
         bf16* y = b.half.get();
#pragma omp parallel for schedule(static)
         for (std::ptrdiff_t i = 0; i < static_cast<std::ptrdiff_t>(b.n); ++i) y[i] = to_bf16(x[i]);
         return 0.0;
       }},
      {"cast_bf16_to_f32", 6, up, true,
       [](Buffers& b) {
         const bf16* x = b.half.get();
         float* y = b.v.get();
#pragma omp parallel for schedule(static)
         for (std::ptrdiff_t i = 0; i < static_cast<std::ptrdiff_t>(b.n); ++i) y[i] = to_float(x[i]);
         return 0.0;
       }},
      {"accumulate_f32", 12, acc32, false,
       [](Buffers& b) {
         float* d = b.m.get();
         const float* x = b.g.get();
#pragma omp parallel for schedule(static)
         for (std::ptrdiff_t i = 0; i < static_cast<std::ptrdiff_t>(b.n); ++i) d[i] += x[i];
         return 0.0;
       }},
      {"accumulate_bf16", 10, acc16, false,
       [](Buffers& b) {
         float* d = b.m.get();
         const bf16* x = b.half.get();
#pragma omp parallel for schedule(static)
         for (std::ptrdiff_t i = 0; i < static_cast<std::ptrdiff_t>(b.n); ++i) d[i] += to_float(x[i]);
         return 0.0;
       }},
      {"sum_squares", 4, sumsq, false,
       [](Buffers& b) {
         const float* x = b.g.get();
         double acc = 0;
#pragma omp parallel for schedule(static) reduction(+ : acc)
         for (std::ptrdiff_t i = 0; i < static_cast<std::ptrdiff_t>(b.n); ++i)
           acc += static_cast<double>(x[i]) * x[i];
         return acc;
       }},
      // The scalar loop here is the default reduction's work on the same bytes (an fp32 sum
      // and a double sum of squares), for comparison.
      {"exact_combine_2", 12, combine, false,
       [](Buffers& b) {
         float* d = b.m.get();
         const float *x = b.g.get(), *y = b.v.get();
         double acc = 0;
#pragma omp parallel for schedule(static) reduction(+ : acc)
         for (std::ptrdiff_t i = 0; i < static_cast<std::ptrdiff_t>(b.n); ++i) {
           d[i] = x[i] + y[i];
           acc += static_cast<double>(d[i]) * d[i];
         }
         return acc;
       }},
      {"exact_combine_2_nosq", 12, combine_only, false,
       [](Buffers& b) {
         float* d = b.m.get();
         const float *x = b.g.get(), *y = b.v.get();
#pragma omp parallel for schedule(static)
         for (std::ptrdiff_t i = 0; i < static_cast<std::ptrdiff_t>(b.n); ++i) d[i] = x[i] + y[i];
         return 0.0;
       }},
      {"exact_square_add", 4, exact_sq, false,
       [](Buffers& b) {
         const float* x = b.g.get();
         double acc = 0;
#pragma omp parallel for schedule(static) reduction(+ : acc)
         for (std::ptrdiff_t i = 0; i < static_cast<std::ptrdiff_t>(b.n); ++i)
           acc += static_cast<double>(x[i]) * x[i];
         return acc;
       }},
      // The portable paths of these are the loops of exact::ExactGrads::reduce they replaced.
      {"exact_levels", 5, levels, false, nullptr, true},
      {"exact_round_to_levels", 13, round_levels, false, nullptr, true},
      {"exact_sums_to_float", 13, sums_to_float, false, nullptr, true},
      {"exact_lift", 26, lift, false, nullptr, true},
      // The portable paths are the scalar per-element deposit (exact::elem::deposit).
      {"exact_deposit_bins", 38, deposit_bins, false, nullptr, true},
      {"exact_deposit_packed", 20, deposit_packed, false, nullptr, true},
      {"exact_deposit_first", 12, deposit_first, false, nullptr, true},
      // The separate fill_zero streams its zeros where large (no-nt: it does not).
      {"exact_deposit_first+zero", 16, first_then_zero, true, nullptr, false, fill_g},
      {"exact_deposit_first_clear", 16, first_clear, false, nullptr, false, fill_g},
      {"exact_deposit+zero", 24, deposit_then_zero, true, nullptr, false, fill_g},
      {"exact_deposit_clear", 24, deposit_clear, false, nullptr, false, fill_g},
      {"exact_deposit_multi_2", 24, deposit_multi, false, nullptr, true, fill_words},
      {"exact_deposit_combine_2", 28, deposit_combine, false, nullptr, true, fill_words},
      {"exact_deposit_combine_2_nosq", 28, deposit_combine_nosq, false, nullptr, true, fill_words},
      {"exact_deposit_combine_2_scratch", 28, deposit_combine_scratch, false, nullptr, true, fill_words},
      {"all_finite", 4, finite, false,
       [](Buffers& b) {
         const float* x = b.g.get();
         int bad = 0;
#pragma omp parallel for schedule(static) reduction(| : bad)
         for (std::ptrdiff_t i = 0; i < static_cast<std::ptrdiff_t>(b.n); ++i) bad |= !std::isfinite(x[i]);
         return static_cast<double>(bad);
       }},
      {"scale", 8, scale, false,
       [](Buffers& b) {
         float* x = b.g.get();
         volatile float one = 1.0f;  // a literal 1.0f would let the compiler drop the loop
         const float f = one;
#pragma omp parallel for schedule(static)
         for (std::ptrdiff_t i = 0; i < static_cast<std::ptrdiff_t>(b.n); ++i) x[i] *= f;
         return 0.0;
       }},
  };
  for (const Entry& e : entries) {
    add(e.name, e.bytes, Variant::Dispatched, e.fn, e.setup);
#if defined(__x86_64__) || defined(_M_X64)
    if (e.avx2 && cpu::best_isa() == Isa::Avx512) {
      add(e.name, e.bytes, Variant::Avx2, [fn = e.fn](Buffers& b) {
        const Isa keep = cpu::active_isa();
        cpu::set_isa(Isa::Avx2);
        const double r = fn(b);
        cpu::set_isa(keep);
        return r;
      }, e.setup);
    }
#endif
    if (e.streams) {
      add(e.name, e.bytes, Variant::NoStream, [fn = e.fn](Buffers& b) {
        const StreamPolicy keep = cpu::stream_policy();
        cpu::set_stream_policy(StreamPolicy::Never);
        const double r = fn(b);
        cpu::set_stream_policy(keep);
        return r;
      }, e.setup);
    }
    add(e.name, e.bytes, Variant::Portable, [fn = e.fn](Buffers& b) {
      const Isa keep = cpu::active_isa();
      cpu::set_isa(Isa::Portable);
      const double r = fn(b);
      cpu::set_isa(keep);
      return r;
    }, e.setup);
    if (e.scalar) add(e.name, e.bytes, Variant::Scalar, e.scalar);
  }
  return k;
}

std::string variant_label(Variant v) {
  switch (v) {
    case Variant::Dispatched:
      return cpu::isa_name(cpu::active_isa());
    case Variant::Avx2:
      return "avx2";
    case Variant::Portable:
      return "portable";
    case Variant::NoStream:
      return std::string(cpu::isa_name(cpu::active_isa())) + ",no-nt";
    case Variant::Scalar:
      return "scalar-loop";
    default:
      return "ceiling";
  }
}

std::string size_label(std::size_t n) {
  return n % (1u << 20) == 0 ? std::to_string(n >> 20) + "M" : std::to_string(n);
}

// ---- the fraction-of-bandwidth table -------------------------------------------------------

struct Row {
  std::string kernel, label;
  std::size_t n;
  int threads;
  double bytes_per_param;
  double seconds = 0;  // per iteration
};

std::vector<Row> g_rows;                 // in registration order
std::map<std::string, std::size_t> g_row_of;  // benchmark function name -> row

class FractionReporter : public benchmark::ConsoleReporter {
 public:
  FractionReporter() : ConsoleReporter(isatty(STDOUT_FILENO) ? OO_Defaults : OO_Tabular) {}
  void ReportRuns(const std::vector<Run>& runs) override {
    ConsoleReporter::ReportRuns(runs);
    for (const Run& r : runs) {
      if (r.error_occurred) continue;
      const bool median = r.run_type == Run::RT_Aggregate && r.aggregate_name == "median";
      if (r.run_type == Run::RT_Aggregate && !median) continue;
      auto it = g_row_of.find(r.run_name.function_name);
      if (it == g_row_of.end()) continue;
      const double sec = r.GetAdjustedRealTime() / benchmark::GetTimeUnitMultiplier(r.time_unit);
      if (median || r.repetitions <= 1) g_rows[it->second].seconds = sec;
    }
  }
};

void print_table() {
  std::printf("\nFraction of the in-place update bandwidth (a += s*b), same run%s:\n",
              g_rows.empty() || g_rows.front().seconds <= 0 ? "" : " (median if repeated)");
  std::printf("%-18s %-14s %6s %3s %6s %12s %9s %9s\n", "kernel", "path", "n", "thr", "B/par",
              "params/s", "GB/s", "x inplace");
  std::map<std::pair<std::size_t, int>, double> ceiling;
  for (const Row& r : g_rows)
    if (r.kernel == "inplace" && r.seconds > 0)
      ceiling[{r.n, r.threads}] = r.bytes_per_param * static_cast<double>(r.n) / r.seconds;
  for (const Row& r : g_rows) {
    if (r.seconds <= 0) continue;
    const double pps = static_cast<double>(r.n) / r.seconds;
    const double bw = pps * r.bytes_per_param;
    const auto c = ceiling.find({r.n, r.threads});
    const double frac = c == ceiling.end() ? 0.0 : bw / c->second;
    std::printf("%-18s %-14s %6s %3d %6.0f %12.4g %9.2f %9.3f\n", r.kernel.c_str(), r.label.c_str(),
                size_label(r.n).c_str(), r.threads, r.bytes_per_param, pps, bw * 1e-9, frac);
  }
}

/// The CPU's model name (/proc/cpuinfo), or "unknown".
std::string cpu_model() {
  std::FILE* f = std::fopen("/proc/cpuinfo", "r");
  if (!f) return "unknown";
  char line[512];
  std::string model = "unknown";
  while (std::fgets(line, sizeof line, f)) {
    if (std::strncmp(line, "model name", 10) != 0) continue;
    const char* colon = std::strchr(line, ':');
    if (colon) {
      model = colon + 1;
      model.erase(0, model.find_first_not_of(" \t"));
      model.erase(model.find_last_not_of(" \t\n") + 1);
    }
    break;
  }
  std::fclose(f);
  return model;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::size_t> sizes = {1u << 20, 16u << 20, 64u << 20, 256u << 20};
  std::vector<int> threads = {2};
  CLI::App app{"Every CPU kernel of the step against the machine's memory bandwidth. Options "
               "not listed here (--benchmark_*) are Google Benchmark's (--benchmark_list_tests, "
               "--benchmark_filter=..., --benchmark_repetitions=...)."};
  shardopt::cli::init(app, "bench_cpu_kernels");
  app.add_option("--sizes", sizes, "parameters per kernel call, comma separated")
      ->delimiter(',')->transform(shardopt::cli::size())->check(CLI::PositiveNumber)
      ->default_str("1Mi,16Mi,64Mi,256Mi");
  app.add_option("--threads", threads, "OpenMP thread counts, comma separated")
      ->delimiter(',')->check(CLI::Range(1, 4096))->default_str("2");
  app.allow_extras();
  if (const int rc = shardopt::cli::parse(app, argc, argv); rc >= 0) return rc;
  std::vector<std::string> extras = app.remaining();
  std::vector<char*> rest{argv[0]};
  for (std::string& e : extras) {
    if (e.rfind("--benchmark_", 0) != 0) {
      std::fprintf(stderr, "bench_cpu_kernels: unknown option '%s' (see --help)\n", e.c_str());
      return 2;
    }
    rest.push_back(e.data());
  }
  int rest_argc = static_cast<int>(rest.size());
  benchmark::Initialize(&rest_argc, rest.data());
  if (benchmark::ReportUnrecognizedArguments(rest_argc, rest.data())) return 1;

  std::printf("CPU: %s, %ld online\n", cpu_model().c_str(), sysconf(_SC_NPROCESSORS_ONLN));
  std::printf("shardopt CPU kernels: ISA %s (best %s), streaming stores %s above %zu MiB\n",
              cpu::isa_name(cpu::active_isa()), cpu::isa_name(cpu::best_isa()),
              cpu::stream_policy() == StreamPolicy::Auto ? "auto"
              : cpu::stream_policy() == StreamPolicy::Always ? "always" : "never",
              cpu::kStreamMinBytes >> 20);
  const std::vector<Kernel> ks = kernels();
  for (std::size_t n : sizes) {
    for (int t : threads) {
      for (const Kernel& k : ks) {
        Row row{k.name, variant_label(k.variant), n, t, k.bytes_per_param};
        const std::string name = k.name + "[" + row.label + "]/n:" + size_label(n) +
                                 "/threads:" + std::to_string(t);
        g_row_of[name] = g_rows.size();
        g_rows.push_back(row);
        benchmark::RegisterBenchmark(name.c_str(), [&k, n, t](benchmark::State& st) {
          set_threads(t);
          Buffers& b = buffers(n);
          if (k.setup) k.setup(b);
          k.run(b);  // warm: page tables, caches
          for (auto _ : st) {
            if (k.setup) {
              st.PauseTiming();
              k.setup(b);
              st.ResumeTiming();
            }
            benchmark::DoNotOptimize(k.run(b));
            benchmark::ClobberMemory();
          }
          if (k.setup) k.setup(b);  // the buffers as the next kernel expects them
          const double items = static_cast<double>(st.iterations()) * static_cast<double>(n);
          st.counters["params/s"] = benchmark::Counter(items, benchmark::Counter::kIsRate);
          st.counters["bytes/s"] =
              benchmark::Counter(items * k.bytes_per_param, benchmark::Counter::kIsRate,
                                 benchmark::Counter::kIs1024);
        })->UseRealTime()->Unit(benchmark::kMillisecond);
      }
    }
  }
  FractionReporter reporter;
  benchmark::RunSpecifiedBenchmarks(&reporter);
  print_table();
  benchmark::Shutdown();
  return 0;
}
