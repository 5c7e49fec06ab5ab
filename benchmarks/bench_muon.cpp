// bench_muon.cpp: Muon's Newton-Schulz (src/rules/muon.*) in GFLOP/s on the CPU.
//
// The rate counts newton_schulz_flops() (2 x the multiply-adds its GEMMs run) per call of 5
// iterations; the normalisation and the element passes are in the time, not in the count.
// Each shape runs on the dispatched ISA and forced to AVX2 and to the portable path where
// they differ, at 1 thread (rate per CPU second of the process) and at all of
// OMP_NUM_THREADS' (or the machine's) threads (rate per wall-clock second).
//
//   bench_muon [Google Benchmark flags, e.g. --benchmark_filter=1024x4096]
#include <benchmark/benchmark.h>

#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include <omp.h>

#include "cpu/kernels.hpp"
#include "rules/muon.hpp"

namespace {

using namespace shardopt;
using namespace shardopt::rules::muon;

std::string cpu_model() {
  std::ifstream f("/proc/cpuinfo");
  for (std::string line; std::getline(f, line);)
    if (line.rfind("model name", 0) == 0) return line.substr(line.find(':') + 2);
  return "unknown CPU";
}

void bench_ns(benchmark::State& st, std::size_t rows, std::size_t cols, cpu::Isa isa,
              int threads) {
  const cpu::Isa before = cpu::active_isa();
  cpu::set_isa(isa);
  const int threads_before = omp_get_max_threads();
  omp_set_num_threads(threads);
  std::vector<float> u(rows * cols), out(rows * cols);
  for (std::size_t e = 0; e < u.size(); ++e)
    u[e] = static_cast<float>((e * 2654435761u) % 1000) * 1e-3f - 0.5f;
  Workspace ws;
  for (auto _ : st) {
    newton_schulz(rows, cols, u.data(), out.data(), static_cast<float>(kDefaultA),
                  static_cast<float>(kDefaultB), static_cast<float>(kDefaultC), 1e-7,
                  kDefaultNsSteps, ws);
    benchmark::DoNotOptimize(out.data());
  }
  st.counters["GFLOP/s"] = benchmark::Counter(
      newton_schulz_flops(rows, cols, kDefaultNsSteps) * 1e-9,
      benchmark::Counter::kIsIterationInvariantRate);
  omp_set_num_threads(threads_before);
  cpu::set_isa(before);
}

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  const int all = omp_get_max_threads();
  std::printf("CPU: %s; ISA %s; %d OpenMP threads\n", cpu_model().c_str(),
              cpu::isa_name(cpu::best_isa()), all);
  std::vector<cpu::Isa> isas{cpu::best_isa()};
  for (cpu::Isa isa : {cpu::Isa::Avx2, cpu::Isa::Portable})
    if (isa != cpu::best_isa() && cpu::isa_supported(isa)) isas.push_back(isa);
  const std::pair<std::size_t, std::size_t> shapes[] = {{1024, 1024}, {1024, 4096}, {2048, 8192}};
  for (const auto& [rows, cols] : shapes)
    for (cpu::Isa isa : isas)
      for (int t : all > 1 ? std::vector<int>{1, all} : std::vector<int>{1}) {
        // The portable path on the largest shape would take minutes: skipped.
        if (isa == cpu::Isa::Portable && rows * cols > (1u << 22)) continue;
        const std::string name = "newton_schulz/" + std::to_string(rows) + "x" +
                                 std::to_string(cols) + "/" + cpu::isa_name(isa) + "/threads:" +
                                 std::to_string(t);
        auto* b = benchmark::RegisterBenchmark(name.c_str(), bench_ns, rows, cols, isa, t)
                      ->Unit(benchmark::kMillisecond)
                      ->MinTime(1.0);
        // One thread: the rate per CPU second, which other processes on a shared machine do
        // not dilute; several: per wall-clock second (CPU time would add the threads' up).
        if (t > 1) b->UseRealTime();
      }
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
