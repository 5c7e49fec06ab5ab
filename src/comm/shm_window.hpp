// shm_window.hpp: one MPI-3 shared-memory window over a node: every node rank's segment is
// directly addressable by every other. Internal.
#pragma once

#include <mpi.h>

#include <cstddef>
#include <memory>
#include <vector>

#include "mpi_watchdog.hpp"
#include "shm_node.hpp"

namespace shardopt::shm {

class ShmWindow {
 public:
  /// Collective over the node: every node rank contributes a zeroed segment of `bytes`
  /// (which must be equal on all of them). sync() waits under `watchdog`.
  ShmWindow(std::shared_ptr<const NodeTopology> topo, std::size_t bytes,
            std::shared_ptr<mpi::Watchdog> watchdog);
  /// Collective over the node (MPI_Win_free).
  ~ShmWindow();
  ShmWindow(const ShmWindow&) = delete;
  ShmWindow& operator=(const ShmWindow&) = delete;

  /// The segment of node rank r, mapped into this process.
  char* segment(int node_rank) const { return bases_[static_cast<std::size_t>(node_rank)]; }
  char* mine() const { return segment(topo_->node_rank); }
  std::size_t bytes() const { return bytes_; }

  /// Node barrier with the memory ordering of the MPI-3 unified model (MPI_Win_sync on both
  /// sides of MPI_Barrier): stores any node rank made to the window before it are visible to
  /// every node rank after it.
  void sync() const;
  /// sync() in two halves, for collectives that complete later (non-blocking): start_sync()
  /// makes this rank's stores visible and starts the node barrier in `barrier`;
  /// finish_sync(), after that barrier completed, makes every node rank's stores visible.
  void start_sync(MPI_Request* barrier) const;
  void finish_sync() const;

 private:
  std::shared_ptr<const NodeTopology> topo_;
  std::shared_ptr<mpi::Watchdog> dog_;
  MPI_Win win_ = MPI_WIN_NULL;
  std::size_t bytes_ = 0;
  std::vector<char*> bases_;
};

}  // namespace shardopt::shm
