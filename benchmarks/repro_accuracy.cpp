// repro_accuracy.cpp: how close the summed gradient comes to the exact sum, default fp32
// summation against reproducible mode's exact bins (src/exact_sum.hpp). Synthetic gradients
// shaped like real ones: 16 tensors whose scales span 1e-6 .. 10, per element a signal shared
// by the micro-batches plus heavy-tailed noise (a normal over a uniform). M micro-batches are
// dealt to N ranks; the default path sums each rank's micro-batches in fp32 (local
// accumulation), then the ranks' partial sums in fp32 in rank order (what a 2-rank
// reduce-scatter does; rings reorder further). The reference is the long-double sum (exact
// here: an element's values span far fewer than 40 binades) rounded once to fp32. Errors are
// in units of the reference's last place (ulps).
//
//   repro_accuracy [--elements 1Mi] [--micro-batches 16]
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <vector>

#include "backend.hpp"
#include "cli.hpp"
#include "exact_sum.hpp"
#include "shardopt/comm.hpp"
#include "support/timing.hpp"

using namespace shardopt;

namespace {

double uniform01(std::uint64_t a, std::uint64_t b) {
  std::uint64_t h = a * 0x9E3779B97F4A7C15ull ^ (b + 0x632BE59BD9B4E019ull);
  h ^= h >> 31;
  h *= 0xBF58476D1CE4E5B9ull;
  h ^= h >> 29;
  return (static_cast<double>(h >> 11) + 0.5) * 0x1p-53;
}

double normal(std::uint64_t a, std::uint64_t b) {
  return std::sqrt(-2 * std::log(uniform01(a, b))) * std::cos(6.283185307179586 * uniform01(a, b + 1));
}

struct Stats {
  double max_ulps = 0, sum_ulps = 0;
  std::size_t exact = 0, n = 0;
  void add(float got, float want) {
    const double ulp = std::ldexp(1.0, std::ilogb(std::max(std::fabs(want), std::numeric_limits<float>::min())) - 23);
    const double e = std::fabs(static_cast<double>(got) - static_cast<double>(want)) / ulp;
    max_ulps = std::max(max_ulps, e);
    sum_ulps += e;
    exact += got == want;
    ++n;
  }
};

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Accuracy of the default and the reproducible gradient sums against the exact sum."};
  cli::init(app, "repro_accuracy");
  std::size_t elements = std::size_t{1} << 20;
  int micro_batches = 16;
  app.add_option("--elements", elements, "gradient elements")->transform(cli::size())
      ->check(CLI::PositiveNumber)->default_str("1Mi");
  app.add_option("--micro-batches", micro_batches, "micro-batches (a multiple of 4)")
      ->check(CLI::Range(4, 4096))->capture_default_str();
  if (const int rc = cli::parse(app, argc, argv, true); rc >= 0) return rc;
  if (micro_batches % 4 != 0) {
    std::fprintf(stderr, "repro_accuracy: --micro-batches must be a multiple of 4\n");
    return 2;
  }
  const std::size_t n = elements;
  const int m = micro_batches;
  std::vector<std::vector<float>> g(static_cast<std::size_t>(m), std::vector<float>(n));
  for (std::size_t j = 0; j < n; ++j) {
    const std::size_t tensor = j * 16 / n;
    const double scale = std::pow(10.0, -6.0 + 7.0 * static_cast<double>(tensor) / 15.0);
    const double signal = normal(j, 1);
    for (int k = 0; k < m; ++k) {
      const double noise = normal(j, 1000 + 2 * static_cast<std::uint64_t>(k)) /
                           (0.3 + uniform01(j, 5000 + static_cast<std::uint64_t>(k)));
      g[static_cast<std::size_t>(k)][j] = static_cast<float>(scale * (signal + noise));
    }
  }
  std::vector<float> want(n);
  for (std::size_t j = 0; j < n; ++j) {
    long double s = 0;
    for (int k = 0; k < m; ++k) s += g[static_cast<std::size_t>(k)][j];
    want[j] = static_cast<float>(s);
  }
  std::printf("cpu: %s; %zu elements, %d micro-batches; errors in ulps of the exact sum "
              "rounded to fp32\n\n",
              bench::cpu_model_name().c_str(), n, m);
  std::printf("| sum | ranks | max ulps | mean ulps | exactly rounded |\n|---|---|---|---|---|\n");
  for (int ranks : {1, 2, 4}) {
    Stats st;
    const int per = m / ranks;
    for (std::size_t j = 0; j < n; ++j) {
      float total = 0;
      for (int r = 0; r < ranks; ++r) {
        float part = 0;
        for (int q = 0; q < per; ++q) part += g[static_cast<std::size_t>(r * per + q)][j];
        total = r == 0 ? part : total + part;
      }
      st.add(total, want[j]);
    }
    std::printf("| default fp32 | %d | %.2f | %.4f | %.2f%% |\n", ranks, st.max_ulps,
                st.sum_ulps / static_cast<double>(st.n), 100.0 * static_cast<double>(st.exact) / static_cast<double>(st.n));
  }
  // Reproducible: the same bits at any rank count (test_reproducible), so one process.
  auto comm = make_single_process_communicator();
  const std::unique_ptr<Backend> cpu = make_cpu_backend();
  const std::size_t bytes = exact::grads_bytes(n, n);
  auto mem = std::make_shared<std::vector<std::int64_t>>(bytes / 8 + 1);
  exact::ExactGrads acc(*cpu, Allocation(mem->data(), bytes, mem, nullptr, MemCategory::Grads), n, n);
  for (int k = 0; k + 1 < m; ++k) acc.deposit(g[static_cast<std::size_t>(k)].data(), n);
  std::vector<float> out = g[static_cast<std::size_t>(m - 1)];
  Bucket bk;
  bk.flat = Range{0, n};
  bk.slice_elems = n;
  acc.reduce(*comm, bk, false, out.data());
  Stats st;
  for (std::size_t j = 0; j < n; ++j) st.add(out[j], want[j]);
  std::printf("| reproducible | any | %.2f | %.4f | %.2f%% |\n", st.max_ulps,
              st.sum_ulps / static_cast<double>(st.n), 100.0 * static_cast<double>(st.exact) / static_cast<double>(st.n));
  return 0;
}
