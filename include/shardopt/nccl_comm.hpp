// nccl_comm.hpp: the NCCL communicator (device buffers). Only available when shardopt was
// built with CUDA, MPI and NCCL (SHARDOPT_WITH_NCCL); includes <mpi.h> and the CUDA runtime
// header.
#pragma once

#include <cuda_runtime_api.h>
#include <mpi.h>

#include <memory>

#include "shardopt/comm.hpp"

namespace shardopt {

/// Collective over `comm`, one per data-parallel group. Each rank must have selected its own
/// CUDA device (cudaSetDevice) first: NCCL allows one rank per device. Rank 0 creates the
/// NCCL unique id, MPI broadcasts it, every rank joins a non-blocking NCCL communicator; a
/// failure on any rank during the set-up (no device, no id, a failed join) throws the same
/// Error on every rank.
///
/// Streams. `compute_stream` is the trainer's (nullptr: the legacy default stream): the CUDA
/// optimizer's kernels run there (device_stream()). Data collectives take device buffers and
/// run on a stream of the communicator's own, so they overlap with the compute stream's
/// kernels; each is ordered after the work already queued on the compute stream, and its
/// request's wait() makes the compute stream wait for it (cudaStreamWaitEvent; no host
/// wait). bf16 replicas are all-gathered as ncclBfloat16. Host collectives
/// (all_reduce_sum_host, all_gather_bytes, broadcast_bytes, barrier) go over plain MPI on a
/// duplicate of `comm`. The compute stream must outlive the communicator.
///
/// Errors: Error(Communication) naming the NCCL call and NCCL's message, Error(Cuda) for
/// CUDA runtime calls. While the host waits (for device work, in a non-blocking NCCL call, or
/// in a host collective), the communicator polls ncclCommGetAsyncError, the age of its oldest
/// unfinished collective against the collective timeout (set_collective_timeout, which
/// OptimizerOptions::collective_timeout_s and SHARDOPT_COLLECTIVE_TIMEOUT set; 0, the
/// default: no timeout), and abort notices from the other ranks. An asynchronous error, a
/// timeout or a notice aborts the NCCL communicator (ncclCommAbort), tells the other ranks,
/// and throws Error(Communication, "NCCL communicator aborted: rank r: <cause>; ...") with
/// the same message on every rank that answers within a grace period (timeout/4, 0.5-5 s);
/// every later call throws it again. The same timeout covers the host collectives as in the
/// MPI communicators: the ranks waiting in one throw the same Error(Communication) (comm.hpp).
std::shared_ptr<Communicator> make_nccl_communicator(MPI_Comm comm,
                                                     cudaStream_t compute_stream = nullptr);

}  // namespace shardopt
