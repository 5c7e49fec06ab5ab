// shm_window.cpp: MPI_Win_allocate_shared with a passive-target epoch held for the window's
// lifetime, so that MPI_Win_sync can order loads and stores between node ranks; and the node
// barrier between the phases of a collective, a counter in the window.
//
// The node barrier. A barrier through MPI (MPI_Ibarrier on the node communicator, before
// 2026-11-27) completes only once every node rank has run MPI's progress engine at each of its
// dissemination rounds: when ranks outnumber cores, or beside other programs, each round waits
// for a descheduled rank to be scheduled again. Here a barrier is one atomic increment: node
// rank 0's segment ends with a cache line holding a 64-bit counter of arrivals, zeroed at
// creation. The k-th barrier this rank starts on this window adds 1 to it (fetch_add,
// acq_rel) and is complete once the counter has reached k * node_size (acquire load): a rank
// whose peers have all arrived goes on at once, whoever is scheduled.
//
// Why it never completes early. Every node rank starts the same barriers of a window in the
// same order (the collectives' order, ShmQueue), adds exactly 1 per barrier, and starts its
// (k+1)-th only after its k-th completed. Take the first moment the counter reaches
// (k+1) * node_size: no rank has started its (k+2)-th yet (that needs the counter at
// (k+1) * node_size before, and this is the first moment it is), so every increment so far
// came from barriers 1 .. k+1, at most k+1 per rank; (k+1) * node_size of them means every
// rank has made exactly k+1, i.e. has arrived at barrier k+1. The counter only grows, so a
// completed barrier stays complete for a rank that looks late. (64 bits: no wrap.)
//
// Memory ordering. Each rank's stores before its increment happen before every load after
// another rank's acquire load that sees the count including it: the increments are
// read-modify-writes, so each one releases into the same release sequence. That orders the
// stores to every window the collective touched, not just this one (a batch's round of
// barriers runs on its first window). The counter is a lock-free, hence address-free,
// std::atomic_ref: correct through the different addresses the processes map it at.
// MPI_Win_sync stays on both sides, as in the MPI-3 unified model's example of shared-memory
// synchronisation by flags (MPI-4.0 section 12.7): it is the memory barrier MPI asks for on
// a window in a passive-target epoch, and costs a fence where the atomics already order.
#include "shm_window.hpp"

#include <cstdint>
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
  // Waited under the watchdog (polls that yield, the timeout), not in MPICH's spinning
  // MPI_Allreduce: with more ranks than cores a spinning wait costs scheduler time slices.
  dog_->run(
      dog_->current(),
      [&] { SHARDOPT_MPI(MPI_Allreduce(MPI_IN_PLACE, range, 2, MPI_LONG_LONG, MPI_MAX, topo_->node)); },
      [&](MPI_Request* r) {
        SHARDOPT_MPI(MPI_Iallreduce(MPI_IN_PLACE, range, 2, MPI_LONG_LONG, MPI_MAX, topo_->node, r));
      });
  require(range[0] == -range[1], Status::InvalidArgument,
          "allocate_collective_buffer: ranks of one node asked for different sizes (" +
              std::to_string(-range[1]) + " to " + std::to_string(range[0]) + " bytes)");

  // Segments rounded to whole cache lines, plus two lines of which node rank 0's hold the
  // barrier's counter on a line of its own (wherever MPI aligns a segment); noncontig lets
  // MPI place each rank's segment in its own pages (first touch by the owner below).
  constexpr std::size_t kLine = 64;
  const std::size_t rounded = (bytes + kLine - 1) / kLine * kLine;
  const std::size_t allocated = rounded + 2 * kLine;
  MPI_Info info = MPI_INFO_NULL;
  SHARDOPT_MPI(MPI_Info_create(&info));
  MPI_Info_set(info, "alloc_shared_noncontig", "true");
  char* base = nullptr;
  const int rc =
      MPI_Win_allocate_shared(static_cast<MPI_Aint>(allocated), 1, info, topo_->node, &base, &win_);
  MPI_Info_free(&info);
  // Every rank of the node learns whether any failed, so that all throw (and none waits in
  // the barrier below). A rank whose allocation succeeded while another's failed cannot free
  // its window (MPI_Win_free is collective): it is left to MPI_Finalize.
  int failed = rc != MPI_SUCCESS ? 1 : 0;
  dog_->run(
      dog_->current(),
      [&] { SHARDOPT_MPI(MPI_Allreduce(MPI_IN_PLACE, &failed, 1, MPI_INT, MPI_MAX, topo_->node)); },
      [&](MPI_Request* r) {
        SHARDOPT_MPI(MPI_Iallreduce(MPI_IN_PLACE, &failed, 1, MPI_INT, MPI_MAX, topo_->node, r));
      });
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
  std::memset(mine(), 0, allocated);
  const auto line = reinterpret_cast<std::uintptr_t>(segment(0) + rounded + kLine - 1) / kLine * kLine;
  arrivals_ = reinterpret_cast<std::uint64_t*>(line);
  SHARDOPT_MPI(MPI_Win_lock_all(MPI_MODE_NOCHECK, win_));
  // The zeroed counter visible to every node rank before any starts a barrier: this once
  // through MPI (window creation is collective and waits in MPI anyway).
  SHARDOPT_MPI(MPI_Win_sync(win_));
  dog_->run(
      dog_->current(), [&] { SHARDOPT_MPI(MPI_Barrier(topo_->node)); },
      [&](MPI_Request* r) { SHARDOPT_MPI(MPI_Ibarrier(topo_->node, r)); });
  SHARDOPT_MPI(MPI_Win_sync(win_));
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

namespace {

using Counter = std::atomic_ref<std::uint64_t>;
static_assert(Counter::is_always_lock_free,
              "the node barrier's counter must be lock-free (address-free across processes)");

}  // namespace

void ShmWindow::sync() const {
  const Barrier b = start_sync();
  wait(b, dog_->current());
  finish_sync();
}

ShmWindow::Barrier ShmWindow::start_sync() const {
  SHARDOPT_MPI(MPI_Win_sync(win_));
  started_in_process_.fetch_add(1, std::memory_order_relaxed);
  const Barrier b{++started_ * static_cast<std::uint64_t>(topo_->node_size)};
  Counter(*arrivals_).fetch_add(1, std::memory_order_acq_rel);
  return b;
}

bool ShmWindow::arrived(Barrier b) const {
  return Counter(*arrivals_).load(std::memory_order_acquire) >= b.target;
}

void ShmWindow::wait(Barrier b, const mpi::Watchdog::Ticket& t) const {
  dog_->wait_until(t, [&] { return arrived(b); });
}

void ShmWindow::finish_sync() const { SHARDOPT_MPI(MPI_Win_sync(win_)); }

}  // namespace shardopt::shm
