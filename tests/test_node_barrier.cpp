// test_node_barrier.cpp: the shared-memory window's node barrier (src/comm/shm_window.cpp, an
// arrival counter in the window). Many back-to-back barriers, ranks arriving in a skewed
// order (one rank late before some of them), each rank writing into its segment before a
// barrier and checking every peer's value after it: a barrier that completed before every
// rank arrived, or let a fast rank's next arrival complete the current one, shows as a stale
// or future value. The blocking form (sync) and the non-blocking one (start_sync, arrived,
// finish_sync) alike, on one node and on two simulated nodes. And the shared-memory
// communicator's collectives make no MPI barrier call (MPI_Barrier and MPI_Ibarrier counted
// through MPI's profiling interface) while starting two node barriers each.
#include <gtest/gtest.h>
#include <mpi.h>
#include <sched.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "comm/mpi_watchdog.hpp"
#include "comm/shm_node.hpp"
#include "comm/shm_window.hpp"
#include "shardopt/mpi_comm.hpp"

using namespace shardopt;

namespace {
long mpi_barriers = 0;
}
extern "C" int MPI_Barrier(MPI_Comm comm) {
  ++mpi_barriers;
  return PMPI_Barrier(comm);
}
extern "C" int MPI_Ibarrier(MPI_Comm comm, MPI_Request* request) {
  ++mpi_barriers;
  return PMPI_Ibarrier(comm, request);
}

namespace {

// A node's window as the shared-memory communicator makes it, waits polling under a timeout
// (a broken barrier fails the test by its report instead of hanging it).
struct Node {
  MPI_Comm questions = MPI_COMM_NULL;
  std::shared_ptr<shm::NodeTopology> topo;
  std::shared_ptr<mpi::Watchdog> dog = std::make_shared<mpi::Watchdog>();
  std::unique_ptr<shm::ShmWindow> win;

  explicit Node(int simulated_nodes) {
    MPI_Comm_dup(MPI_COMM_WORLD, &questions);
    dog->attach(questions);
    dog->set_timeout(30);
    dog->set_yield(true);
    topo = shm::NodeTopology::create(MPI_COMM_WORLD, simulated_nodes);
    dog->enter("test_node_barrier");
    win = std::make_unique<shm::ShmWindow>(topo, 64 * sizeof(std::uint64_t), dog);
  }
  ~Node() {
    win.reset();
    topo.reset();
    MPI_Comm_free(&questions);
  }
  std::uint64_t* slot(int node_rank) const {
    return reinterpret_cast<std::uint64_t*>(win->segment(node_rank));
  }
};

// Rank `late` of barrier i (a different one each time) sleeps before some barriers.
void maybe_late(int i, int node_rank, int node_size) {
  if (i % 37 == 0 && i % node_size == node_rank) usleep(2000);
}

class NodeBarrier : public testing::TestWithParam<int> {};  // simulated nodes

// Barrier i is the i-th on every rank: before it each rank writes i into its slot, after it
// every peer's slot holds i. The next write comes only after a second barrier, so a rank
// that ran ahead through an early second barrier shows as i + 1 in a peer's check.
TEST_P(NodeBarrier, EveryRankSeesEveryPeersStoreAfterEachBarrier) {
  Node node(GetParam());
  const int me = node.topo->node_rank, n = node.topo->node_size;
  const std::uint64_t before = shm::ShmWindow::barriers_started();
  constexpr int kRounds = 1500;
  for (int i = 1; i <= kRounds; ++i) {
    maybe_late(i, me, n);
    *node.slot(me) = static_cast<std::uint64_t>(i);
    if (i % 2 == 0) {
      node.win->sync();
    } else {  // the non-blocking form, polled as ShmRequest::test() does
      const shm::ShmWindow::Barrier b = node.win->start_sync();
      while (!node.win->arrived(b)) sched_yield();
      node.win->finish_sync();
    }
    for (int p = 0; p < n; ++p)
      ASSERT_EQ(*node.slot(p), static_cast<std::uint64_t>(i)) << "node rank " << p << ", barrier " << i;
    maybe_late(i + 1, me, n);
    node.win->sync();
  }
  EXPECT_EQ(shm::ShmWindow::barriers_started() - before, 2u * kRounds);
}

// A rank that starts the next barrier while a peer has not yet looked at the current one does
// not complete the current one early: rank 0 races ahead through non-blocking starts while
// the others are asleep; its second barrier stays incomplete until they come.
TEST_P(NodeBarrier, AnEarlyArrivalAtTheNextBarrierDoesNotCompleteTheCurrentOne) {
  Node node(GetParam());
  const int me = node.topo->node_rank, n = node.topo->node_size;
  if (n < 2) GTEST_SKIP() << "one rank per node";
  node.win->sync();
  for (int round = 0; round < 8; ++round) {
    if (me != 0) usleep(200000);
    *node.slot(me) = static_cast<std::uint64_t>(round);
    const shm::ShmWindow::Barrier first = node.win->start_sync();
    if (me == 0) EXPECT_FALSE(node.win->arrived(first)) << "complete before the sleeping peers arrived";
    node.win->wait(first, node.dog->current());
    node.win->finish_sync();
    for (int p = 0; p < n; ++p) ASSERT_EQ(*node.slot(p), static_cast<std::uint64_t>(round));
    // The peers sleep before their second arrival: rank 0's own second arrival (with the
    // counter past the first barrier) must not complete it.
    if (me != 0) usleep(200000);
    const shm::ShmWindow::Barrier second = node.win->start_sync();
    if (me == 0) EXPECT_FALSE(node.win->arrived(second)) << "round " << round;
    node.win->wait(second, node.dog->current());
    node.win->finish_sync();
  }
}

// The communicator's shared-memory collectives on one node: two node barriers each (one
// before, one after the sums or copies), none of them an MPI barrier.
TEST(NodeBarrierInCollectives, CollectivesStartNodeBarriersAndNoMpiBarrier) {
  auto comm = make_mpi_communicator(MPI_COMM_WORLD, {MpiCommKind::SharedMemory, 0});
  if (comm->name() != "mpi-shm") GTEST_SKIP() << comm->name();
  const int n = comm->size(), me = comm->rank();
  const std::size_t count = 257;
  const auto total = count * static_cast<std::size_t>(n);
  Allocation win = comm->allocate_collective_buffer(nullptr, MemCategory::Scratch, total * 4);
  ASSERT_NE(win.data(), nullptr);
  float* b = win.as<float>();
  const long mpi_before = mpi_barriers;
  const std::uint64_t before = shm::ShmWindow::barriers_started();
  constexpr int kRounds = 50;
  for (int i = 0; i < kRounds; ++i) {
    for (std::size_t k = 0; k < total; ++k) b[k] = static_cast<float>(me + i);
    if (i % 7 == me) usleep(1000);
    comm->start_reduce_scatter_sum(b, count, CommType::F32)->wait();
    for (std::size_t k = 0; k < count; ++k)
      ASSERT_EQ(b[static_cast<std::size_t>(me) * count + k],
                static_cast<float>(n * i + n * (n - 1) / 2))
          << "round " << i;
    comm->start_all_gather(b, count, CommType::F32)->wait();
    for (std::size_t k = 0; k < total; ++k)
      ASSERT_EQ(b[k], static_cast<float>(n * i + n * (n - 1) / 2)) << "round " << i;
  }
  EXPECT_EQ(mpi_barriers - mpi_before, 0) << "a node barrier went through MPI";
  EXPECT_EQ(shm::ShmWindow::barriers_started() - before, 4u * kRounds);
}

INSTANTIATE_TEST_SUITE_P(Nodes, NodeBarrier, testing::Values(0, 2),
                         [](const testing::TestParamInfo<int>& p) {
                           return p.param == 0 ? std::string("OneNode") : std::string("TwoSimulated");
                         });

}  // namespace
