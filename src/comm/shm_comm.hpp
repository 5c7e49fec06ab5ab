// shm_comm.hpp: the node-aware communicator (shm_comm.cpp). Internal; built through
// make_mpi_communicator().
#pragma once

#include <memory>

#include "mpi_watchdog.hpp"
#include "shardopt/comm.hpp"
#include "shm_node.hpp"

namespace shardopt::shm {

/// `plain` carries everything that is not a data collective on a window buffer (metadata,
/// all-reduce, foreign buffers, non-consecutive multi-node placements); `watchdog` is the one
/// `plain` waits under.
/// `clear_inputs`: whether its sums may clear the inputs they read (clears_inputs(); the same
/// on every rank, SHARDOPT_SHM_CLEAR_INPUTS agreed by make_mpi_communicator).
std::shared_ptr<Communicator> make_shm_communicator(std::shared_ptr<Communicator> plain,
                                                    std::shared_ptr<NodeTopology> topo,
                                                    std::shared_ptr<mpi::Watchdog> watchdog,
                                                    bool clear_inputs = true);

}  // namespace shardopt::shm
