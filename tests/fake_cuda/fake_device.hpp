// fake_device.hpp: the model behind the fake CUDA runtime and NCCL (internal to
// tests/fake_cuda; tests use fake_control.hpp).
//
// Memory. Device memory is one memfd mapped twice: PROT_NONE at the addresses the library
// sees, read/write at a second address for the fake's own kernels and copies. Any host
// dereference of a device pointer by the library faults.
//
// Work. Every copy, memset, kernel and collective is an Op queued on a stream. A device
// thread runs them in the background, in stream order and after the events they wait for
// (collectives progress over MPI meanwhile), as a GPU would. Copies into pinned host memory
// run only when the host waits for them, and their destination is poisoned (NaN bytes) when
// they are queued: a host that reads before it waits sees no data.
//
// Ordering. Each op carries a vector clock over streams (program order on a stream,
// cudaStreamWaitEvent, the legacy default stream's implicit barriers, host
// synchronisation). Each op declares the device ranges it reads and writes; two accesses to
// overlapping bytes, one a write, whose ops are not ordered by the clocks are a race, found
// when the second is queued, whatever order the ops later run in.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "cuda_runtime_api.h"

namespace fakecuda {

struct Access {
  std::uintptr_t begin, end;  // library (PROT_NONE) addresses
  bool write;
};

/// A collective in flight: post() starts it (MPI), test() progresses it, finish() writes
/// the result; cancel() is ncclCommAbort's.
class Transfer {
 public:
  virtual ~Transfer() = default;
  virtual void post() = 0;
  virtual bool test() = 0;
  virtual void finish() = 0;
  virtual void cancel() = 0;
};

struct Op;
using OpPtr = std::shared_ptr<Op>;

/// Queues an op on `stream` (nullptr or cudaStreamLegacy: the legacy stream). `run` runs
/// it (for kernels: on the read/write mapping, see dev()). Returns the op, or null with
/// the error set when the stream is invalid.
OpPtr enqueue(cudaStream_t stream, std::string name, std::vector<Access> accesses,
              std::function<void()> run, std::unique_ptr<Transfer> transfer = nullptr);

/// The read/write address of library address p when p is device memory; p otherwise.
void* dev(const void* p);
template <class T>
T* dev(T* p) {
  return static_cast<T*>(dev(static_cast<const void*>(p)));
}
bool is_device(const void* p, std::size_t bytes = 1);
bool is_pinned(const void* p, std::size_t bytes = 1);
bool valid_stream(cudaStream_t s);

/// Every entry point of the fake holds this lock (the device thread takes it to run work).
std::unique_lock<std::mutex> lock_device();
/// Progresses queued work; with `lock` (held) waits until `op` is done (releasing the lock
/// meanwhile), without it makes one round. True when done.
bool run_until(const OpPtr& op, std::unique_lock<std::mutex>* lock);
/// The op writes pinned host memory: it runs only when the host waits for it.
void mark_host_visible(const OpPtr& op);
bool op_done(const OpPtr& op);
/// Marks ops of a transfer as done without running them (ncclCommAbort).
void abandon(const OpPtr& op);
/// Records a race or misuse: aborts the process with the message (default), or keeps it
/// for take_problems() (fake_control.hpp).
void problem(const std::string& what);
/// The current error for cudaGetLastError.
cudaError_t fail(cudaError_t e, const std::string& what);

}  // namespace fakecuda
