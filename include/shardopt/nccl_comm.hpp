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
/// NCCL unique id, MPI broadcasts it, every rank joins with ncclCommInitRank; a failure on
/// any rank before the join (no device, no id) throws the same Error on every rank.
///
/// Data collectives (all_reduce_sum, reduce_scatter_sum_inplace, all_gather_inplace; bf16
/// replicas are all-gathered as ncclBfloat16) take device buffers and are enqueued on
/// `stream` (nullptr: the legacy default stream). They are ordered after the work already on
/// the legacy default stream (where the CUDA backend runs) and before work queued there
/// later, and return without waiting for completion.
/// Host collectives (all_reduce_sum_host, all_gather_bytes, broadcast_bytes, barrier) go over
/// a duplicate of `comm`. Errors: Error(Communication) naming the NCCL call and NCCL's
/// message, Error(Cuda) for CUDA runtime calls. `stream` must outlive the communicator.
std::shared_ptr<Communicator> make_nccl_communicator(MPI_Comm comm, cudaStream_t stream = nullptr);

}  // namespace shardopt
