// shardopt/torch/c10d_comm.hpp: a shardopt Communicator over a LibTorch c10d process group,
// so that a LibTorch trainer can run shardopt without MPI (gloo over TCP).
//
// Every data collective keeps shardopt's conventions (comm.hpp): in place, equal blocks, no
// hidden all-reduce. LibTorch 1.13's gloo group has no reduce-scatter, so the reduce-scatter
// is an all-to-all of the blocks (each rank receives every rank's copy of its own block, the
// same bytes a ring reduce-scatter moves) followed by a local sum in rank order 0..N-1, which
// makes the result identical on every rank that computes it and independent of timing.
// Errors of the process group (a peer that died, a timeout) become
// shardopt::Error(Communication) on the ranks that see them.
#pragma once

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <memory>
#include <string>

#include "shardopt/comm.hpp"

namespace shardopt::libtorch {

/// A Communicator over `group` (any c10d process group; tested with gloo). Local; the group
/// must stay usable for the communicator's lifetime (it keeps a reference).
std::shared_ptr<Communicator> make_c10d_communicator(c10::intrusive_ptr<c10d::ProcessGroup> group);

/// Collective over `size` processes: a gloo process group whose rendezvous is the file
/// `file_store_path` on a file system every process sees (it must not hold a previous run's
/// rendezvous), each process with its `rank`. Gloo binds to the address of SHARDOPT_GLOO_HOST
/// if set, else to this machine's hostname (loopback if it does not resolve). `timeout_s`
/// bounds every collective. Throws Error(InvalidArgument) for a bad rank/size and
/// Error(Communication) if the rendezvous fails.
std::shared_ptr<Communicator> make_gloo_communicator(int rank, int size,
                                                     const std::string& file_store_path,
                                                     double timeout_s = 300.0);

/// Collective: make_gloo_communicator from the environment, as torchrun and mpiexec set it.
/// Rank and size: RANK and WORLD_SIZE, else PMI_RANK and PMI_SIZE (MPICH's mpiexec), else
/// OMPI_COMM_WORLD_RANK and OMPI_COMM_WORLD_SIZE (Open MPI's). Rendezvous: the file
/// SHARDOPT_GLOO_FILE, else a TCP store at MASTER_ADDR:MASTER_PORT (rank 0 serves it).
/// Timeout: SHARDOPT_GLOO_TIMEOUT seconds (default 300). A missing or malformed variable is
/// Error(InvalidArgument) naming it.
std::shared_ptr<Communicator> make_gloo_communicator_from_env();

}  // namespace shardopt::libtorch
