// shm_window.hpp: one MPI-3 shared-memory window over a node: every node rank's segment is
// directly addressable by every other; and the node barrier that orders its phases, an
// arrival counter in the window itself (no MPI call: shm_window.cpp). Internal.
#pragma once

#include <mpi.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "mpi_watchdog.hpp"
#include "shm_node.hpp"

namespace shardopt::shm {

class ShmWindow {
 public:
  /// Collective over the node: every node rank contributes a zeroed segment of `bytes`
  /// (which must be equal on all of them). Waits (sync()) run under `watchdog`.
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

  /// A node barrier this rank has started: complete once every node rank has started it.
  struct Barrier {
    std::uint64_t target = 0;  ///< the arrival count that completes it
  };

  /// Node barrier with the memory ordering of the MPI-3 unified model (MPI_Win_sync on both
  /// sides of the barrier): stores any node rank made to the window before it are visible to
  /// every node rank after it.
  void sync() const;
  /// sync() in parts, for collectives that complete later (non-blocking): start_sync() makes
  /// this rank's stores visible and starts the node barrier; arrived() says without waiting
  /// whether it is complete, wait() waits for it under the watchdog (collective `t`);
  /// finish_sync(), after it completed, makes every node rank's stores visible.
  Barrier start_sync() const;
  bool arrived(Barrier b) const;
  void wait(Barrier b, const mpi::Watchdog::Ticket& t) const;
  void finish_sync() const;

  /// Node barriers this process has started (every window): what a test counts.
  static std::uint64_t barriers_started() { return started_in_process_.load(); }

 private:
  std::shared_ptr<const NodeTopology> topo_;
  std::shared_ptr<mpi::Watchdog> dog_;
  MPI_Win win_ = MPI_WIN_NULL;
  std::size_t bytes_ = 0;
  std::vector<char*> bases_;
  std::uint64_t* arrivals_ = nullptr;  ///< the barrier's counter, in node rank 0's segment
  mutable std::uint64_t started_ = 0;  ///< barriers this rank started on this window
  static inline std::atomic<std::uint64_t> started_in_process_{0};
};

}  // namespace shardopt::shm
