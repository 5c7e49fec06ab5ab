// host_wait.cpp: polling host waits with watchdogs (see host_wait.hpp).
#include "host_wait.hpp"

#include <algorithm>
#include <chrono>
#include <mutex>
#include <thread>
#include <vector>

#include "cuda_check.hpp"

namespace shardopt::dev {
namespace {

// Recursive: a watchdog that aborts removes itself from inside run_watchdogs().
std::recursive_mutex& registry_mutex() {
  static std::recursive_mutex m;
  return m;
}
std::vector<Watchdog*>& registry() {
  static std::vector<Watchdog*> r;
  return r;
}

template <class Query>
void poll(Query query, const char* what) {
  for (unsigned spin = 0;; ++spin) {
    const cudaError_t rc = query();
    if (rc == cudaSuccess) return;
    if (rc != cudaErrorNotReady) check_cuda(rc, what);
    run_watchdogs();
    // Spin briefly (short kernels), then back off so that a long wait costs no CPU.
    if (spin < 64) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(spin < 1024 ? 10 : 100));
    }
  }
}

}  // namespace

void add_watchdog(Watchdog* w) {
  const std::lock_guard<std::recursive_mutex> lock(registry_mutex());
  registry().push_back(w);
}

void remove_watchdog(Watchdog* w) {
  const std::lock_guard<std::recursive_mutex> lock(registry_mutex());
  auto& r = registry();
  r.erase(std::remove(r.begin(), r.end(), w), r.end());
}

void run_watchdogs() {
  // Held while checking, so that no watchdog is destroyed during its check.
  const std::lock_guard<std::recursive_mutex> lock(registry_mutex());
  const std::vector<Watchdog*> copy = registry();
  for (Watchdog* w : copy) w->check();
}

void host_wait(cudaStream_t stream) {
  poll([stream] { return cudaStreamQuery(stream); }, "cudaStreamQuery");
}

void host_wait(cudaEvent_t event) {
  poll([event] { return cudaEventQuery(event); }, "cudaEventQuery");
}

}  // namespace shardopt::dev
