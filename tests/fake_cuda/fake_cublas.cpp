// fake_cublas.cpp: the cuBLAS calls of the CUDA backend (cublas_v2.h of the fake) on the fake
// device. A GEMM is an op on the handle's stream that declares what it reads and writes,
// like the fake's kernels, and computes each output element as one fp32 sum in k order; a
// GPU's cuBLAS sums in an order of its own (and may differ by GPU model and version), so
// tests compare the device's Muon with the CPU's to a tolerance, not bit for bit.
#include <cstdint>
#include <utility>
#include <set>
#include <string>
#include <vector>

#include "cublas_v2.h"
#include "fake_control.hpp"
#include "fake_device.hpp"

struct cublasContext {
  cudaStream_t stream = nullptr;  // nullptr: the legacy default stream
};

namespace {

std::set<cublasContext*>& handles() {
  static std::set<cublasContext*> s;
  return s;
}

bool live(cublasHandle_t h) { return h != nullptr && handles().count(h) != 0; }

/// The bytes of a column-major rows x cols matrix with leading dimension ld.
std::size_t extent(int rows, int cols, int ld) {
  if (rows <= 0 || cols <= 0) return 0;
  return (static_cast<std::size_t>(ld) * static_cast<std::size_t>(cols - 1) +
          static_cast<std::size_t>(rows)) * sizeof(float);
}

fakecuda::Access access(const void* p, std::size_t bytes, bool write) {
  const auto a = reinterpret_cast<std::uintptr_t>(p);
  return {a, a + bytes, write};
}

}  // namespace

extern "C" {

cublasStatus_t cublasCreate(cublasHandle_t* handle) {
  auto lock = fakecuda::lock_device();
  if (handle == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
  *handle = new cublasContext;
  handles().insert(*handle);
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasDestroy(cublasHandle_t handle) {
  auto lock = fakecuda::lock_device();
  if (!live(handle)) return CUBLAS_STATUS_NOT_INITIALIZED;
  handles().erase(handle);
  delete handle;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetStream(cublasHandle_t handle, cudaStream_t stream) {
  auto lock = fakecuda::lock_device();
  if (!live(handle)) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (!fakecuda::valid_stream(stream != nullptr ? stream : cudaStreamLegacy))
    return CUBLAS_STATUS_INVALID_VALUE;
  handle->stream = stream;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetMathMode(cublasHandle_t handle, cublasMath_t mode) {
  auto lock = fakecuda::lock_device();
  if (!live(handle)) return CUBLAS_STATUS_NOT_INITIALIZED;
  return mode == CUBLAS_DEFAULT_MATH || mode == CUBLAS_PEDANTIC_MATH ? CUBLAS_STATUS_SUCCESS
                                                                      : CUBLAS_STATUS_NOT_SUPPORTED;
}

const char* cublasGetStatusString(cublasStatus_t status) {
  switch (status) {
    case CUBLAS_STATUS_SUCCESS: return "CUBLAS_STATUS_SUCCESS";
    case CUBLAS_STATUS_NOT_INITIALIZED: return "CUBLAS_STATUS_NOT_INITIALIZED";
    case CUBLAS_STATUS_ALLOC_FAILED: return "CUBLAS_STATUS_ALLOC_FAILED";
    case CUBLAS_STATUS_INVALID_VALUE: return "CUBLAS_STATUS_INVALID_VALUE";
    case CUBLAS_STATUS_EXECUTION_FAILED: return "CUBLAS_STATUS_EXECUTION_FAILED";
    case CUBLAS_STATUS_INTERNAL_ERROR: return "CUBLAS_STATUS_INTERNAL_ERROR";
    case CUBLAS_STATUS_NOT_SUPPORTED: return "CUBLAS_STATUS_NOT_SUPPORTED";
    default: return "CUBLAS_STATUS_UNKNOWN";
  }
}

cublasStatus_t cublasSgemm(cublasHandle_t handle, cublasOperation_t transa,
                           cublasOperation_t transb, int m, int n, int k, const float* alpha,
                           const float* A, int lda, const float* B, int ldb, const float* beta,
                           float* C, int ldc) {
  auto lock = fakecuda::lock_device();
  if (!live(handle)) return CUBLAS_STATUS_NOT_INITIALIZED;
  const bool ta = transa == CUBLAS_OP_T, tb = transb == CUBLAS_OP_T;
  if ((transa != CUBLAS_OP_N && !ta) || (transb != CUBLAS_OP_N && !tb) || m < 0 || n < 0 ||
      k < 0 || alpha == nullptr || beta == nullptr || lda < (ta ? k : m) || lda < 1 ||
      ldb < (tb ? n : k) || ldb < 1 || ldc < m || ldc < 1)
    return CUBLAS_STATUS_INVALID_VALUE;
  if (m == 0 || n == 0) return CUBLAS_STATUS_SUCCESS;
  const std::size_t a_bytes = ta ? extent(k, m, lda) : extent(m, k, lda);
  const std::size_t b_bytes = tb ? extent(n, k, ldb) : extent(k, n, ldb);
  const std::size_t c_bytes = extent(m, n, ldc);
  for (const auto& [p, bytes] : {std::pair<const void*, std::size_t>{A, a_bytes}, {B, b_bytes}, {C, c_bytes}})
    if (bytes != 0 && !fakecuda::is_device(p, bytes))
      fakecuda::problem("cublasSgemm was given memory that is not a device allocation (or runs past one)");
  std::vector<fakecuda::Access> acc = {access(A, a_bytes, false), access(B, b_bytes, false),
                                       access(C, c_bytes, true)};
  const float al = *alpha, be = *beta;
  const cudaStream_t stream = handle->stream != nullptr ? handle->stream : cudaStreamLegacy;
  fakecuda::enqueue(stream, "kernel cublasSgemm", std::move(acc), [=] {
    const float* a = fakecuda::dev(A);
    const float* b = fakecuda::dev(B);
    float* c = fakecuda::dev(C);
    const auto at = [&](int i, int l) {
      return ta ? a[static_cast<std::size_t>(i) * lda + l] : a[static_cast<std::size_t>(l) * lda + i];
    };
    const auto bt = [&](int l, int j) {
      return tb ? b[static_cast<std::size_t>(l) * ldb + j] : b[static_cast<std::size_t>(j) * ldb + l];
    };
    for (int j = 0; j < n; ++j)
      for (int i = 0; i < m; ++i) {
        float sum = 0.0f;
        for (int l = 0; l < k; ++l) sum += at(i, l) * bt(l, j);
        float& out = c[static_cast<std::size_t>(j) * ldc + i];
        out = be == 0.0f ? al * sum : al * sum + be * out;
      }
  });
  return CUBLAS_STATUS_SUCCESS;
}

}  // extern "C"
