// cuda_hook.cpp: how the core finds the CUDA backend. The backend lives in its own library
// (libshardopt_cuda, CMake target shardopt::cuda), so that the core, and every program that
// uses only the CPU, needs neither the CUDA toolkit nor libcudart/libnccl. That library
// registers its entry points when it is loaded (a program linked with shardopt::cuda);
// otherwise the first Device::Cuda request loads it with dlopen, from the core library's own
// directory (its $ORIGIN run path) or the loader's search path.
#include <dlfcn.h>

#include <mutex>
#include <string>

#include "backend.hpp"
#include "shardopt/error.hpp"

namespace shardopt {

namespace {
constinit CudaEntryPoints g_cuda{};  // safe during static init

// The registered entry points, loading libshardopt_cuda once if they are not there yet.
const CudaEntryPoints& cuda_entry_points() {
  static std::once_flag tried;
  static std::string load_error;
  if (!g_cuda.make_backend) {
    std::call_once(tried, [] {
      // Loading runs the library's registration; the handle is kept for the process's life.
      if (!dlopen(SHARDOPT_CUDA_LIBRARY, RTLD_NOW | RTLD_GLOBAL)) {
        const char* e = dlerror();
        load_error = e ? e : "dlopen failed";
      }
    });
  }
  if (!g_cuda.make_backend) {
    if (!SHARDOPT_CUDA_BUILT)
      throw Error(Status::Unsupported,
                  "Device::Cuda requested, but shardopt was built without CUDA (SHARDOPT_CUDA=OFF "
                  "or no nvcc found at configure time)");
    throw Error(Status::Unsupported,
                "Device::Cuda requested, but the CUDA backend is not loaded: link the program "
                "with shardopt::cuda (pkg-config shardopt-cuda), or install " SHARDOPT_CUDA_LIBRARY
                " next to the shardopt library (" + load_error + ")");
  }
  return g_cuda;
}
}  // namespace

void register_cuda(const CudaEntryPoints& entry) { g_cuda = entry; }

std::unique_ptr<Backend> make_cuda_backend(void* stream) {
  return cuda_entry_points().make_backend(stream);
}

std::shared_ptr<Communicator> make_cuda_single_process_communicator_from_core() {
  return cuda_entry_points().make_single_process_communicator();
}

}  // namespace shardopt
