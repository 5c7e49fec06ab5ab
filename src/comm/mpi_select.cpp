// mpi_select.cpp: make_mpi_communicator(): the shared-memory communicator where ranks share
// a node, plain MPI otherwise, either one forced by option or SHARDOPT_COMM; and how its
// waits behave (MpiWait, SHARDOPT_MPI_WAIT).
#include <algorithm>
#include <cstdlib>
#include <string>
#include <vector>

#include "mpi_util.hpp"
#include "mpi_watchdog.hpp"
#include "shardopt/mpi_comm.hpp"
#include "shardopt/options.hpp"
#include "shm_comm.hpp"

namespace shardopt {
namespace {

// Resolves the environment overrides; returns what is wrong with them, or "".
// `clear_inputs`: SHARDOPT_SHM_CLEAR_INPUTS (the shared-memory sums clear stage 2's staging
// slots as they read them, Communicator::clears_inputs; "0" turns it off for A/B runs).
std::string resolve(MpiCommOptions& o, bool& clear_inputs) {
  clear_inputs = true;
  if (const char* env = std::getenv("SHARDOPT_SHM_CLEAR_INPUTS"); env && *env) {
    const std::string v = env;
    if (v != "0" && v != "1") return "SHARDOPT_SHM_CLEAR_INPUTS='" + v + "': expected 0 or 1";
    clear_inputs = v == "1";
  }
  if (o.kind == MpiCommKind::Auto) {
    if (const char* env = std::getenv("SHARDOPT_COMM")) {
      const std::string v = env;
      if (v == "mpi")
        o.kind = MpiCommKind::Plain;
      else if (v == "shm")
        o.kind = MpiCommKind::SharedMemory;
      else if (!v.empty() && v != "auto")
        return "SHARDOPT_COMM='" + v + "': expected mpi, shm or auto";
    }
  }
  if (o.simulate_nodes == 0) {
    if (const char* env = std::getenv("SHARDOPT_SIMULATE_NODES")) {
      char* end = nullptr;
      const long n = std::strtol(env, &end, 10);
      if (*env == '\0' || *end != '\0' || n < 0 || n > 1 << 20)
        return std::string("SHARDOPT_SIMULATE_NODES='") + env + "': expected a count >= 0";
      o.simulate_nodes = static_cast<int>(n);
    }
  }
  if (o.simulate_nodes < 0) return "simulate_nodes must be >= 0";
  if (o.mpi_in_flight == 0) {
    o.mpi_in_flight = 1;
    if (const char* env = std::getenv("SHARDOPT_MPI_IN_FLIGHT"); env && *env) {
      char* end = nullptr;
      const long n = std::strtol(env, &end, 10);
      if (*end != '\0' || n < 1 || n > 1 << 20)
        return std::string("SHARDOPT_MPI_IN_FLIGHT='") + env + "': expected a count >= 1";
      o.mpi_in_flight = static_cast<int>(n);
    }
  }
  if (o.mpi_in_flight < 0) return "mpi_in_flight must be >= 0";
  if (o.wait == MpiWait::Auto) {
    if (const char* env = std::getenv("SHARDOPT_MPI_WAIT"); env && *env) {
      const std::string v = env;
      if (v == "block")
        o.wait = MpiWait::Block;
      else if (v == "yield")
        o.wait = MpiWait::Yield;
      else if (v != "auto")
        return "SHARDOPT_MPI_WAIT='" + v + "': expected block, yield or auto";
    }
  }
  if (o.exchange == MpiExchange::Auto) {
    o.exchange = MpiExchange::Direct;
    if (const char* env = std::getenv("SHARDOPT_MPI_EXCHANGE"); env && *env) {
      const std::string v = env;
      if (v == "mpi")
        o.exchange = MpiExchange::Collective;
      else if (v != "direct" && v != "auto")
        return "SHARDOPT_MPI_EXCHANGE='" + v + "': expected direct, mpi or auto";
    }
  }
  if (o.exchange != MpiExchange::Direct && o.exchange != MpiExchange::Collective)
    return "exchange: expected MpiExchange::Auto, Direct or Collective";
  // The direct exchange tells requests in flight together apart by their tags.
  if (o.exchange == MpiExchange::Direct && o.mpi_in_flight >= mpi::tag_space())
    return "mpi_in_flight " + std::to_string(o.mpi_in_flight) +
           " must stay below MPI_TAG_UB + 1 = " + std::to_string(mpi::tag_space()) +
           " with MpiExchange::Direct";
  return {};
}

}  // namespace

std::shared_ptr<Communicator> make_mpi_communicator(MPI_Comm comm, MpiCommOptions options) {
  auto watchdog = std::make_shared<mpi::Watchdog>();
  bool clear_inputs = true;
  const std::string problem = resolve(options, clear_inputs);
  // Until an optimizer sets its own, the communicator's collectives (this function's, and
  // the optimizer constructor's agreement) wait at most the default timeout, or what
  // SHARDOPT_COLLECTIVE_TIMEOUT says (a malformed value is the optimizer constructor's error
  // to report; here it leaves the default).
  double timeout = kDefaultCollectiveTimeoutS;
  std::string malformed;
  collective_timeout_from_environment(timeout, malformed);
  watchdog->set_timeout(timeout > 0 ? timeout : 0.0);
  std::shared_ptr<Communicator> plain = mpi::make_plain_communicator(
      comm, problem.empty() ? options.mpi_in_flight : 1, watchdog,
      problem.empty() && options.exchange == MpiExchange::Direct);
  agree_or_throw(*plain, problem.empty() ? Status::Ok : Status::InvalidArgument, problem);

  // A rank that chose differently would wait in other collectives than its peers (or, for
  // the slot clearing, leave a peer's slot uncleared while the peer counts on it).
  constexpr std::size_t kChoices = 4;
  const int mine[kChoices] = {static_cast<int>(options.kind), options.simulate_nodes,
                              static_cast<int>(options.exchange), clear_inputs ? 1 : 0};
  std::vector<int> all(kChoices * static_cast<std::size_t>(plain->size()));
  plain->all_gather_bytes(mine, all.data(), sizeof mine);
  for (std::size_t r = 0; r < all.size(); r += kChoices)
    require(std::equal(mine, mine + kChoices, all.begin() + static_cast<std::ptrdiff_t>(r)),
            Status::InvalidArgument,
            "make_mpi_communicator: ranks chose different communicators (kind, simulated "
            "nodes, exchange or slot clearing; check SHARDOPT_COMM, SHARDOPT_SIMULATE_NODES, "
            "SHARDOPT_MPI_EXCHANGE and SHARDOPT_SHM_CLEAR_INPUTS)");

  auto topo = shm::NodeTopology::create(comm, options.simulate_nodes);
  if (topo->num_nodes > 1) watchdog->set_nodes(topo->node_of, topo->host_of);
  // A spinning wait keeps whatever else wants this CPU off it: the rank being waited for
  // when ranks outnumber CPUs, another program on a shared machine.
  watchdog->set_yield(mpi::Watchdog::should_yield(options.wait));
  if (options.kind == MpiCommKind::Plain) return plain;
  if (options.kind == MpiCommKind::Auto && topo->max_node_size < 2) return plain;
  return shm::make_shm_communicator(std::move(plain), std::move(topo), std::move(watchdog),
                                    clear_inputs);
}

}  // namespace shardopt
