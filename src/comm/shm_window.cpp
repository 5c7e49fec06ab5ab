// shm_window.cpp: MPI_Win_allocate_shared with a passive-target epoch held for the window's
// lifetime, so that MPI_Win_sync can order loads and stores between node ranks.
#include "shm_window.hpp"

#include <cstring>
#include <string>

#include "mpi_util.hpp"
#include "shardopt/error.hpp"

namespace shardopt::shm {

ShmWindow::ShmWindow(std::shared_ptr<const NodeTopology> topo, std::size_t bytes,
                     std::shared_ptr<mpi::Watchdog> watchdog)
    : topo_(std::move(topo)), dog_(std::move(watchdog)), bytes_(bytes) {
  // Equal segments on every node rank: the collectives address peers by the same offset.
  long long range[2] = {static_cast<long long>(bytes), -static_cast<long long>(bytes)};
  SHARDOPT_MPI(MPI_Allreduce(MPI_IN_PLACE, range, 2, MPI_LONG_LONG, MPI_MAX, topo_->node));
  require(range[0] == -range[1], Status::InvalidArgument,
          "allocate_collective_buffer: ranks of one node asked for different sizes (" +
              std::to_string(-range[1]) + " to " + std::to_string(range[0]) + " bytes)");

  // Segments rounded to whole cache lines; noncontig lets MPI place each rank's segment in
  // its own pages (first touch by the owner below).
  constexpr std::size_t kLine = 64;
  const std::size_t rounded = (bytes + kLine - 1) / kLine * kLine;
  MPI_Info info = MPI_INFO_NULL;
  SHARDOPT_MPI(MPI_Info_create(&info));
  MPI_Info_set(info, "alloc_shared_noncontig", "true");
  char* base = nullptr;
  const int rc =
      MPI_Win_allocate_shared(static_cast<MPI_Aint>(rounded), 1, info, topo_->node, &base, &win_);
  MPI_Info_free(&info);
  // Every rank of the node learns whether any failed, so that all throw (and none waits in
  // the barrier below). A rank whose allocation succeeded while another's failed cannot free
  // its window (MPI_Win_free is collective): it is left to MPI_Finalize.
  int failed = rc != MPI_SUCCESS ? 1 : 0;
  SHARDOPT_MPI(MPI_Allreduce(MPI_IN_PLACE, &failed, 1, MPI_INT, MPI_MAX, topo_->node));
  if (failed != 0 && rc == MPI_SUCCESS)
    throw Error(Status::OutOfMemory, "MPI_Win_allocate_shared of " + std::to_string(bytes) +
                                         " bytes failed on another rank of this node");
  if (rc != MPI_SUCCESS) {
    // An allocation failure is an out-of-memory condition, whatever MPI calls it.
    char text[MPI_MAX_ERROR_STRING];
    int len = 0;
    MPI_Error_string(rc, text, &len);
    throw Error(Status::OutOfMemory, "MPI_Win_allocate_shared of " + std::to_string(bytes) +
                                         " bytes failed: " + std::string(text, len));
  }
  SHARDOPT_MPI(MPI_Win_set_errhandler(win_, MPI_ERRORS_RETURN));
  bases_.resize(static_cast<std::size_t>(topo_->node_size));
  for (int r = 0; r < topo_->node_size; ++r) {
    MPI_Aint size = 0;
    int disp = 0;
    SHARDOPT_MPI(MPI_Win_shared_query(win_, r, &size, &disp, &bases_[static_cast<std::size_t>(r)]));
  }
  if (rounded != 0) std::memset(mine(), 0, rounded);
  SHARDOPT_MPI(MPI_Win_lock_all(MPI_MODE_NOCHECK, win_));
  sync();
}

ShmWindow::~ShmWindow() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized || win_ == MPI_WIN_NULL) return;
  // After a collective timeout the node's other ranks may never come (MPI_Win_free is
  // collective): the window is left to the process's end.
  if (dog_ && dog_->failed()) return;
  MPI_Win_unlock_all(win_);
  MPI_Win_free(&win_);
}

void ShmWindow::sync() const {
  SHARDOPT_MPI(MPI_Win_sync(win_));
  dog_->run(
      dog_->current(), [&] { SHARDOPT_MPI(MPI_Barrier(topo_->node)); },
      [&](MPI_Request* r) { SHARDOPT_MPI(MPI_Ibarrier(topo_->node, r)); });
  SHARDOPT_MPI(MPI_Win_sync(win_));
}

void ShmWindow::start_sync(MPI_Request* barrier) const {
  SHARDOPT_MPI(MPI_Win_sync(win_));
  SHARDOPT_MPI(MPI_Ibarrier(topo_->node, barrier));
}

void ShmWindow::finish_sync() const { SHARDOPT_MPI(MPI_Win_sync(win_)); }

}  // namespace shardopt::shm
