// fake_faults.cpp: tests/gpu/gpu_faults.hpp on the fake device, through its control API.
#include "fake_control.hpp"
#include "gpu_faults.hpp"

namespace shardopt::test {

void hold_stream(cudaStream_t stream, double seconds) { fakecuda::hold_stream(stream, seconds); }

void inject_nccl_async_error(ncclResult_t error) { fakecuda::nccl_inject_async_error(error); }

}  // namespace shardopt::test
