// host_wait.hpp: the only way cuda/ waits on the host for device work. It polls the stream
// or event instead of blocking in the CUDA runtime, and between polls runs every registered
// watchdog (the NCCL communicators: asynchronous errors and timeouts), so that a dead peer
// becomes an Error instead of an endless cudaStreamSynchronize.
#pragma once

#include <cuda_runtime_api.h>

namespace shardopt::dev {

/// Something to check while the host waits; check() throws to end the wait.
class Watchdog {
 public:
  virtual ~Watchdog() = default;
  virtual void check() = 0;
};

/// Registration (thread-safe). A watchdog must be removed before it is destroyed.
void add_watchdog(Watchdog* w);
void remove_watchdog(Watchdog* w);
/// Runs every registered watchdog once.
void run_watchdogs();

/// Returns once all work queued on `stream` (or the work before `event`'s record) has
/// completed; throws Error(Cuda) for a failed stream and whatever a watchdog throws.
void host_wait(cudaStream_t stream);
void host_wait(cudaEvent_t event);

}  // namespace shardopt::dev
