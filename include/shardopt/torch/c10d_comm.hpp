// shardopt/torch/c10d_comm.hpp: a shardopt Communicator over a LibTorch c10d process group,
// so that a LibTorch trainer can run shardopt without MPI (gloo over TCP, host memory).
//
// Every data collective keeps shardopt's conventions (comm.hpp): in place, equal blocks, no
// hidden all-reduce. LibTorch 1.13's gloo group has no reduce-scatter, so the reduce-scatter
// is an all-to-all of the blocks (each rank receives every rank's copy of its own block, the
// bytes a ring reduce-scatter moves) followed by a local sum in rank order 0..N-1: its result
// is independent of timing and of the transport, and the same wherever it is computed. The
// bf16 wire sums the same way, rounding every partial sum to bf16 (as the MPI communicator).
// The all-reduce with a bf16 wire is that reduce-scatter plus an all-gather of the bf16 sums;
// it completes before start_all_reduce_sum() returns (the other start_* calls return at once).
//
// Timeouts: set_collective_timeout(s) (ShardedOptimizer sets it from
// OptimizerOptions::collective_timeout_s) bounds each wait; the groups made here also give
// gloo itself the timeout they are made with. A collective that runs out of time throws
// Error(Communication) on the ranks that wait in it, instead of hanging or aborting the job.
// Errors of the process group (a timeout, a peer that died) become Error(Communication,
// "c10d <op>: ...") on the ranks that see them. After such an error the communicator is
// unusable: the abandoned operation may still write its buffers until gloo gives it up.
#pragma once

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <memory>
#include <string>

#include "shardopt/comm.hpp"

namespace shardopt::libtorch {

/// Local. A Communicator over `group` (any c10d process group that supports allreduce,
/// allgather, broadcast, barrier and alltoall_base on CPU tensors; tested with gloo). Rank and
/// size are the group's; name() is "c10d:<backend>", e.g. "c10d:gloo". The communicator keeps
/// a reference to the group, and calls it from the calling thread only. Throws
/// Error(InvalidArgument) for a null group.
std::shared_ptr<Communicator> make_c10d_communicator(c10::intrusive_ptr<c10d::ProcessGroup> group);

/// Collective over `size` processes, each passing its own `rank` and the same path: a gloo
/// process group whose rendezvous is the file `file_store_path` (c10d::FileStore) on a file
/// system every process sees. The file must not exist or must not hold an earlier group's
/// rendezvous; once every process has joined, rank 0 deletes it (so the same path can serve
/// the next run). Gloo binds to SHARDOPT_GLOO_HOST (an address or host name) if set, else to
/// the interface GLOO_SOCKET_IFNAME, else to this machine's hostname if it resolves to a
/// usable address, else to loopback. `timeout_s` bounds the rendezvous and every collective
/// (set_collective_timeout can change the latter). Throws Error(InvalidArgument) for a rank
/// outside [0, size), an empty path or a non-positive timeout, and Error(Communication) if the
/// rendezvous fails or times out.
std::shared_ptr<Communicator> make_gloo_communicator(int rank, int size,
                                                     const std::string& file_store_path,
                                                     double timeout_s = 300.0);

/// Collective: make_gloo_communicator from the environment, as torchrun and mpiexec set it.
/// Rank and size: RANK and WORLD_SIZE, else PMI_RANK and PMI_SIZE (MPICH's mpiexec), else
/// OMPI_COMM_WORLD_RANK and OMPI_COMM_WORLD_SIZE (Open MPI's); the first pair of which either
/// variable is set is used. Rendezvous: the file SHARDOPT_GLOO_FILE if set, else a TCP store
/// (c10d::TCPStore) at MASTER_ADDR:MASTER_PORT that rank 0 serves. Timeout:
/// SHARDOPT_GLOO_TIMEOUT seconds (default 300). The process never calls MPI. Throws
/// Error(InvalidArgument) naming the variable if one is missing or malformed (checked before
/// any rendezvous), and Error(Communication) as make_gloo_communicator.
std::shared_ptr<Communicator> make_gloo_communicator_from_env();

}  // namespace shardopt::libtorch
