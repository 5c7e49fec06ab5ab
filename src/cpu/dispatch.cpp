// dispatch.cpp: picks the range kernels for this CPU at run time, so one build runs on any
// x86-64 (and the portable kernels run everywhere else).
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <string>

#include "kernel_table.hpp"
#include "kernels.hpp"
#include "shardopt/error.hpp"

namespace shardopt::cpu {
namespace {

const RangeKernels* table_for(Isa isa) {
  switch (isa) {
#if defined(SHARDOPT_CPU_X86)
    case Isa::Avx2:
      return &kAvx2Kernels;
    case Isa::Avx512:
      return &kAvx512Kernels;
#endif
    default:
      return &kPortableKernels;
  }
}

/// Reads an environment variable naming one of `names`; returns its index, or `fallback`
/// when the variable is unset or empty.
int env_choice(const char* var, const char* const* names, int count, int fallback) {
  const char* value = std::getenv(var);
  if (!value || !*value) return fallback;
  std::string allowed;
  for (int i = 0; i < count; ++i) {
    if (std::strcmp(value, names[i]) == 0) return i;
    allowed += (i ? ", " : "") + std::string(names[i]);
  }
  throw Error(Status::InvalidArgument,
              std::string(var) + "='" + value + "' is not one of: " + allowed);
}

void require_supported(Isa isa, const char* origin) {
  require(isa_supported(isa), Status::Unsupported,
          std::string(origin) + ": this CPU (or this build) does not support " + isa_name(isa));
}

struct DispatchState {
  std::atomic<Isa> isa;
  std::atomic<StreamPolicy> stream;
};

DispatchState make_state() {
  static const char* const kIsaNames[] = {"portable", "avx2", "avx512"};
  static const char* const kStreamNames[] = {"auto", "always", "never"};
  const auto isa = static_cast<Isa>(
      env_choice("SHARDOPT_CPU_ISA", kIsaNames, 3, static_cast<int>(best_isa())));
  require_supported(isa, "SHARDOPT_CPU_ISA");
  const auto stream = static_cast<StreamPolicy>(env_choice("SHARDOPT_CPU_STREAM", kStreamNames, 3, 0));
  return DispatchState{isa, stream};
}

DispatchState& state() {
  static DispatchState s = make_state();  // a throw here leaves it for the next call to retry
  return s;
}

}  // namespace

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::Avx2:
      return "avx2";
    case Isa::Avx512:
      return "avx512";
    default:
      return "portable";
  }
}

bool isa_supported(Isa isa) {
  if (isa == Isa::Portable) return true;
#if defined(SHARDOPT_CPU_X86) && (defined(__GNUC__) || defined(__clang__))
  __builtin_cpu_init();
  // __builtin_cpu_supports also checks that the OS saves the wide registers (XGETBV).
  if (isa == Isa::Avx2) return __builtin_cpu_supports("avx2");
  if (isa == Isa::Avx512) return __builtin_cpu_supports("avx512f");
#endif
  return false;
}

Isa best_isa() {
  if (isa_supported(Isa::Avx512)) return Isa::Avx512;
  if (isa_supported(Isa::Avx2)) return Isa::Avx2;
  return Isa::Portable;
}

Isa active_isa() { return state().isa.load(std::memory_order_relaxed); }

void set_isa(Isa isa) {
  require_supported(isa, "set_isa");
  state().isa.store(isa, std::memory_order_relaxed);
}

StreamPolicy stream_policy() { return state().stream.load(std::memory_order_relaxed); }
void set_stream_policy(StreamPolicy p) { state().stream.store(p, std::memory_order_relaxed); }

const RangeKernels& active_kernels() { return *table_for(active_isa()); }

bool use_streaming_stores(std::size_t bytes) {
  switch (stream_policy()) {
    case StreamPolicy::Always:
      return true;
    case StreamPolicy::Never:
      return false;
    default:
      return bytes >= kStreamMinBytes;
  }
}

}  // namespace shardopt::cpu
