// nccl_comm.hpp: the NCCL communicator (device buffers). Only available when shardopt was
// built with CUDA, MPI and NCCL (SHARDOPT_WITH_NCCL); includes <mpi.h> and the CUDA runtime
// header.
#pragma once

#include <cuda_runtime_api.h>
#include <mpi.h>

#include <memory>

#include "shardopt/comm.hpp"

namespace shardopt {

struct NcclOptions {
  /// The trainer's compute stream (nullptr: the legacy default stream): the optimizer's
  /// kernels run there, collectives start after the work queued there before them, and
  /// CommRequest::wait() orders it after the collective (device_stream()).
  cudaStream_t compute_stream = nullptr;
  /// A collective, or the communicator's set-up, that has not completed after this many
  /// seconds while the host waits aborts the communicator (0: wait forever).
  double timeout_seconds = 600.0;
};

/// Collective over `comm`, one per data-parallel group. Each rank must have selected its own
/// CUDA device (cudaSetDevice) first: NCCL allows one rank per device. Rank 0 creates the
/// NCCL unique id, MPI broadcasts it, every rank joins a non-blocking NCCL communicator; a
/// failure on any rank before the join (no device, no id) throws the same Error on every
/// rank.
///
/// Data collectives take device buffers. They run on a stream of the communicator's own, so
/// they overlap with the compute stream's kernels; each is ordered after the work already
/// queued on the compute stream, and its request's wait() makes the compute stream wait for
/// it (cudaStreamWaitEvent; no host wait). bf16 replicas are all-gathered as ncclBfloat16.
/// Host collectives (all_reduce_sum_host, all_gather_bytes, broadcast_bytes, barrier) go over
/// a duplicate of `comm`.
///
/// Errors: Error(Communication) naming the NCCL call and NCCL's message, Error(Cuda) for
/// CUDA runtime calls. While the host waits for device work (dev::host_wait), the
/// communicator polls ncclCommGetAsyncError and the age of its oldest unfinished collective;
/// an asynchronous error or a timeout aborts the communicator (ncclCommAbort) and throws
/// Error(Communication, "NCCL communicator aborted: ..."), with the same message on every
/// rank that sees the same cause; every later call throws it again. The compute stream must
/// outlive the communicator.
std::shared_ptr<Communicator> make_nccl_communicator(MPI_Comm comm, const NcclOptions& options);
std::shared_ptr<Communicator> make_nccl_communicator(MPI_Comm comm,
                                                     cudaStream_t compute_stream = nullptr);

}  // namespace shardopt
