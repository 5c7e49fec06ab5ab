// gpu_faults.cu: gpu_faults.hpp on a GPU. The stream is held by one thread spinning on the
// global nanosecond timer; the asynchronous error by this program's own definition of
// ncclCommGetAsyncError, which the linker binds the library's calls to (the executable comes
// before libnccl) and which forwards to NCCL's (dlsym RTLD_NEXT) unless an error is injected.
#include <dlfcn.h>

#include <atomic>
#include <cstdint>

#include "cuda_check.hpp"
#include "gpu_faults.hpp"

namespace {

__global__ void spin_for(std::uint64_t ns) {
  std::uint64_t start = 0, now = 0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  do {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  } while (now - start < ns);
}

std::atomic<ncclResult_t> injected{ncclSuccess};

}  // namespace

namespace shardopt::test {

void hold_stream(cudaStream_t stream, double seconds) {
  spin_for<<<1, 1, 0, stream>>>(static_cast<std::uint64_t>(seconds * 1e9));
  SHARDOPT_CUDA_CHECK(cudaGetLastError());
}

void inject_nccl_async_error(ncclResult_t error) { injected.store(error); }

}  // namespace shardopt::test

extern "C" ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t* async_error) {
  using Query = ncclResult_t (*)(ncclComm_t, ncclResult_t*);
  static const auto real = reinterpret_cast<Query>(dlsym(RTLD_NEXT, "ncclCommGetAsyncError"));
  const ncclResult_t error = injected.load();
  if (error != ncclSuccess) {
    *async_error = error;
    return ncclSuccess;
  }
  if (real == nullptr) return ncclSystemError;
  return real(comm, async_error);
}
