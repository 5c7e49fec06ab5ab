// gpu_faults.hpp: faults a GPU test can cause on purpose: a stream kept busy (a collective
// queued behind it cannot complete) and an asynchronous NCCL error (as NCCL reports after a
// peer is lost). gpu_faults.cu implements them on a GPU, tests/fake_cuda/fake_faults.cpp on
// the fake device.
#pragma once

#include <cuda_runtime_api.h>
#include <nccl.h>

namespace shardopt::test {

/// Queues on `stream` work that keeps it busy for `seconds` (on a GPU: one thread spinning on
/// the global timer), then returns without waiting for it.
void hold_stream(cudaStream_t stream, double seconds);

/// From now on ncclCommGetAsyncError reports `error` for every NCCL communicator of this
/// process (ncclSuccess: the real state again). On a GPU the real NCCL does everything else
/// (the collectives, ncclCommAbort); only this query is intercepted.
void inject_nccl_async_error(ncclResult_t error);

}  // namespace shardopt::test
