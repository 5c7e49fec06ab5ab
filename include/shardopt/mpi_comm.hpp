// mpi_comm.hpp: the MPI communicators (host buffers). Only available when shardopt was built
// with MPI (SHARDOPT_WITH_MPI); includes <mpi.h>.
#pragma once

#include <mpi.h>

#include <memory>

#include "shardopt/comm.hpp"

namespace shardopt {

/// Which MPI communicator make_mpi_communicator() builds.
enum class MpiCommKind : int {
  Auto = 0,          ///< SHARDOPT_COMM (mpi|shm) if set, else SharedMemory when some node
                     ///< holds two or more ranks, else Plain
  Plain = 1,         ///< MPI collectives only
  SharedMemory = 2,  ///< node-local shared-memory windows, hierarchical across nodes
};

/// How a rank waits in a collective. With a collective timeout (the default) every wait
/// polls MPI_Test for 50 ms, then sleeps between polls (20 us doubling to 1 ms), so a rank
/// waiting for a slow or stopped peer stops burning its CPU; this chooses what the polls do
/// in those first 50 ms, and how a wait without a timeout waits.
enum class MpiWait {
  Auto,   ///< SHARDOPT_MPI_WAIT (auto, block or yield) if set; else Yield
  Block,  ///< without a timeout: MPI's own blocking wait (MPICH spins on the CPU); with one:
          ///< polls that do not yield. For a machine whose CPUs are the job's alone
  Yield,  ///< poll MPI_Test and yield the CPU between polls (sched_yield), then sleep, so a
          ///< rank that shares a CPU with another (its peer, or another program) lets it run
};

/// How plain MPI (and the shared-memory communicator where it hands a collective to plain
/// MPI) runs the fp32 reduce-scatters, equal and uneven. The bf16 wire, the all-gathers and
/// the all-reduces use MPI's collectives either way (an all-gather of point-to-point messages
/// measured no faster than MPICH's; docs/performance.md, "Uneven collectives").
enum class MpiExchange : int {
  Auto = 0,        ///< SHARDOPT_MPI_EXCHANGE (direct, mpi or auto) if set; else Direct
  Direct = 1,      ///< point to point: every rank sends each block to its owner in chunks,
                   ///< and the owner sums them in rank order ((b_0 + b_1) + b_2) + ..., the
                   ///< shared-memory communicator's order: deterministic, and equal to it bit
                   ///< for bit on one node. Faster than MPICH 4.0's reduce-scatters
                   ///< (docs/performance.md)
  Collective = 2,  ///< MPI's collectives: MPI_Ireduce_scatter_block, MPI_Ireduce_scatter
                   ///< (MPI_Ireduce with one owner); summation order is the MPI library's
};

struct MpiCommOptions {
  MpiCommKind kind = MpiCommKind::Auto;
  /// > 0: split the ranks into this many groups of consecutive ranks and treat each group
  /// as a node (tests of the hierarchical path on one machine). 0: SHARDOPT_SIMULATE_NODES
  /// if set, else the real nodes (MPI_COMM_TYPE_SHARED).
  int simulate_nodes = 0;
  /// How many non-blocking collectives plain MPI keeps started at once; later ones start, in
  /// call order, as earlier ones complete. 0: SHARDOPT_MPI_IN_FLIGHT if set, else 1 (MPICH
  /// 4.0 slows down sharply with several large ones outstanding; docs/performance.md).
  int mpi_in_flight = 0;
  /// How waits poll. Oversubscribed, or beside another busy program, spinning waits cost
  /// scheduler time slices (8 to 32 ms per collective measured at 3-4 ranks on 2 cores);
  /// yielding waits do not (docs/performance.md, "Oversubscribed ranks", "Waits on a shared
  /// machine").
  MpiWait wait = MpiWait::Auto;
  /// How the fp32 reduce-scatters run (MpiExchange).
  MpiExchange exchange = MpiExchange::Auto;
};

/// Collective. Duplicates `comm` (so the library's traffic never matches the caller's) and
/// sets it to return errors, which become Error(Status::Communication) naming the MPI call.
/// Every rank must resolve the same kind and node simulation (otherwise every rank throws
/// InvalidArgument). MPI must be initialised, and stay so until the returned object and every
/// buffer it allocated are destroyed.
///
/// The shared-memory communicator keeps the buffers it hands out through
/// allocate_collective_buffer() in MPI-3 shared windows (one per node) and runs
/// reduce_scatter_sum_inplace() and all_gather_inplace() on them by direct loads and stores
/// inside each node, with MPI collectives between one leader per node; other buffers and
/// other collectives use plain MPI. Summation order inside a node: node-local ranks 0, 1, ...
/// (ascending world rank), left to right in fp32, so on one node results are deterministic
/// and bitwise equal to plain MPI's direct exchange (MpiExchange::Direct, the default; at two
/// ranks also to MPI's collectives: a + b). See docs/performance.md.
std::shared_ptr<Communicator> make_mpi_communicator(MPI_Comm comm, MpiCommOptions options = {});

}  // namespace shardopt
