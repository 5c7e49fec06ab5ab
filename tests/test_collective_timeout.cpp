// test_collective_timeout.cpp: a rank that leaves the collective sequence ends the job.
// collective_timeout_driver runs under mpiexec with a 3 s collective timeout (given as the
// option, or through SHARDOPT_COLLECTIVE_TIMEOUT with the option at its default); one rank
// (or every rank of a pretend node) stops itself (SIGSTOP), leaves its loop, or enters a
// collective alone (step, or a stage-3 gather) while the others wait in their own
// MPI_Barrier. Every rank that waits in the library must get the same Error(Communication)
// naming the collective and the ranks that have not arrived (and their node), and print on
// stderr the call and collective it is in; the job must end within the timeout plus a bound
// (plus the timeout again when the program calls MPI_Finalize after the error: the watchdog's
// last resort ends it), and the waiting rank must not spin meanwhile.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "shardopt/comm.hpp"

extern char** environ;

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

namespace {

constexpr double kTimeout = 3.0;
// Past the timeout: the watchdog's grace for answers (0.75 s here), the program's exit, and
// mpiexec taking the job down, on a loaded machine.
constexpr double kBound = 15.0;

struct Frozen {
  int ranks;
  int stop_rank;      // the rank that diverges
  const char* comm;   // SHARDOPT_COMM: mpi or shm
  const char* where;  // the driver's scenario
  const char* collective;  // the name the message must give
  const char* call;        // the reporting rank's call, as the message names it
  const char* missing;     // the ranks it must name as not arrived ("rank 1", "ranks 1, 2")
  int waiter;              // a rank that waits under the watchdog (its CPU use is sampled)
  bool env = false;        // the timeout from SHARDOPT_COLLECTIVE_TIMEOUT, the option default
  bool debug = false;      // SHARDOPT_DEBUG_COLLECTIVES=1
  // > 0: the job runs on that many pretend nodes (scripts/mpiexec_nodes.sh), ranks / nodes
  // each, and stop_ranks (every rank of one node) stop; by_node is how the message must name
  // them by node.
  int nodes = 0;
  const char* stop_ranks = nullptr;
  const char* by_node = nullptr;
  // What the program does after the error (the driver's AFTER): "abort" (MPI_Abort), "exit"
  // (exit code 3 without MPI_Finalize) or "finalize" (MPI_Finalize first, where MPI waits for
  // the missing ranks: the watchdog's last resort must end the process, the timeout later).
  const char* after = "abort";
};

// The ranks that must get the error: the diverging rank where it is alone in the library
// (the others wait in their own MPI_Barrier), else every rank but the stopped or leaving ones.
std::vector<int> reporters(const Frozen& c) {
  const std::string w = c.where;
  if (w == "alone" || w == "acquire" || w == "c_step") return {c.stop_rank};
  std::vector<int> stopped;
  if (c.stop_ranks) {
    std::istringstream in(c.stop_ranks);
    for (std::string r; std::getline(in, r, ',');) stopped.push_back(std::stoi(r));
  } else {
    stopped.push_back(c.stop_rank);
  }
  std::vector<int> out;
  for (int r = 0; r < c.ranks; ++r)
    if (std::find(stopped.begin(), stopped.end(), r) == stopped.end()) out.push_back(r);
  return out;
}

std::string frozen_name(const testing::TestParamInfo<Frozen>& i) {
  return std::string(i.param.where) + "_np" + std::to_string(i.param.ranks) + "_" +
         i.param.comm + "_rank" + std::to_string(i.param.stop_rank) +
         (i.param.env ? "_env" : "") + (i.param.debug ? "_debug" : "") +
         (i.param.nodes ? "_nodes" + std::to_string(i.param.nodes) : "") +
         (std::string(i.param.after) == "abort" ? "" : std::string("_") + i.param.after);
}

void PrintTo(const Frozen& f, std::ostream* os) { *os << f.where << " np" << f.ranks; }

// Starts argv in its own process group, stdout and stderr to `log`; returns its pid.
pid_t spawn(const std::vector<std::string>& args, const fs::path& log) {
  std::vector<char*> argv;
  for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  posix_spawnattr_t attr;
  posix_spawnattr_init(&attr);
  posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETPGROUP);
  posix_spawnattr_setpgroup(&attr, 0);
  posix_spawn_file_actions_t files;
  posix_spawn_file_actions_init(&files);
  posix_spawn_file_actions_addopen(&files, 1, log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_adddup2(&files, 1, 2);
  pid_t pid = -1;
  const int rc = posix_spawn(&pid, argv[0], &files, &attr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&files);
  posix_spawnattr_destroy(&attr);
  return rc == 0 ? pid : -1;
}

double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

// The pid in `file`, or -1 while it is not there.
pid_t read_pid(const fs::path& file) {
  pid_t pid = -1;
  std::ifstream f(file);
  if (!(f >> pid)) return -1;
  return pid;
}

// CPU seconds (user + system) a process has used, from /proc; -1 when unreadable.
double cpu_seconds(pid_t pid) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!std::getline(f, line)) return -1;
  std::istringstream rest(line.substr(line.rfind(')') + 2));
  std::string field;
  double utime = 0, stime = 0;
  for (int k = 3; k <= 15 && rest >> field; ++k) {
    if (k == 14) utime = std::stod(field);
    if (k == 15) stime = std::stod(field);
  }
  return (utime + stime) / static_cast<double>(sysconf(_SC_CLK_TCK));
}

std::string contents(const fs::path& p) {
  std::ifstream f(p);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

class FrozenRank : public testing::TestWithParam<Frozen> {};

}  // namespace

TEST_P(FrozenRank, JobEndsWithTheMessageWithinTheTimeoutPlusABound) {
  const Frozen c = GetParam();
  std::string tmpl = (fs::temp_directory_path() / "shardopt-frozen-XXXXXX").string();
  ASSERT_NE(mkdtemp(tmpl.data()), nullptr);
  const fs::path work = tmpl;
  std::vector<std::string> args;
  if (c.nodes > 0) {
#ifdef SHARDOPT_NODES_LAUNCHER
    setenv("MPIEXEC", SHARDOPT_MPIEXEC, 1);  // the build's MPICH launcher
    args = {"/bin/bash", SHARDOPT_NODES_LAUNCHER, std::to_string(c.nodes),
            std::to_string(c.ranks / c.nodes), "--"};
#else
    GTEST_SKIP() << "pretend nodes are not available here (root and unshare --uts needed)";
#endif
  } else {
    args = {SHARDOPT_MPIEXEC, "-n", std::to_string(c.ranks)};
    for (const char* f : {SHARDOPT_MPIEXEC_EXTRA})
      if (*f) args.push_back(f);
  }
  for (const std::string& a : {std::string(SHARDOPT_TIMEOUT_DRIVER), work.string(),
                               c.stop_ranks ? std::string(c.stop_ranks) : std::to_string(c.stop_rank),
                               c.env ? std::string("0") : std::to_string(kTimeout),
                               std::string(c.where), std::string(c.after)})
    args.push_back(a);
  setenv("SHARDOPT_COMM", c.comm, 1);
  if (c.env) setenv("SHARDOPT_COLLECTIVE_TIMEOUT", std::to_string(kTimeout).c_str(), 1);
  else unsetenv("SHARDOPT_COLLECTIVE_TIMEOUT");
  if (c.debug) setenv("SHARDOPT_DEBUG_COLLECTIVES", "1", 1);
  const fs::path log = work / "job.log";
  const pid_t job = spawn(args, log);
  unsetenv("SHARDOPT_COMM");
  unsetenv("SHARDOPT_COLLECTIVE_TIMEOUT");
  unsetenv("SHARDOPT_DEBUG_COLLECTIVES");
  ASSERT_GT(job, 0);

  // Wait for the stop.
  const Clock::time_point launched = Clock::now();
  int status = 0;
  bool exited = false;
  while (read_pid(work / "stopped") < 0 && seconds_since(launched) < 180) {
    if (waitpid(job, &status, WNOHANG) == job) {
      exited = true;
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  const Clock::time_point stopped = Clock::now();
  ASSERT_FALSE(exited) << "the job ended before a rank stopped:\n" << contents(log);
  ASSERT_GT(read_pid(work / "stopped"), 0) << "no rank stopped:\n" << contents(log);

  // A waiting rank's CPU use between 1 s after the stop and 0.5 s before the timeout.
  const int waiter = c.waiter;
  pid_t waiter_pid = -1;
  double cpu0 = -1, cpu1 = -1;
  Clock::time_point t0, t1;
  const bool finalize = std::string(c.after) == "finalize";
  const double bound = kTimeout + kBound + (finalize ? kTimeout : 0.0);
  while (!exited && seconds_since(stopped) < bound) {
    if (waitpid(job, &status, WNOHANG) == job) {
      exited = true;
      break;
    }
    if (waiter_pid < 0) waiter_pid = read_pid(work / ("rank" + std::to_string(waiter) + ".pid"));
    const double since = seconds_since(stopped);
    if (waiter_pid > 0 && cpu0 < 0 && since >= 1.0) {
      cpu0 = cpu_seconds(waiter_pid);
      t0 = Clock::now();
    }
    if (waiter_pid > 0 && cpu0 >= 0 && cpu1 < 0 && since >= kTimeout - 0.5) {
      cpu1 = cpu_seconds(waiter_pid);
      t1 = Clock::now();
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  const double elapsed = seconds_since(stopped);
  // Whatever is left (the stopped rank, if mpiexec left it) goes with the group.
  kill(-job, SIGKILL);
  kill(-job, SIGCONT);
  if (!exited) waitpid(job, &status, 0);
  const std::string out = contents(log);

  ASSERT_TRUE(exited) << "the job still ran " << elapsed << " s after the stop:\n" << out;
  EXPECT_GE(elapsed, 0.8 * kTimeout) << out;
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) != 0) << "status " << status << "\n" << out;
  // c.call: the call the waiting ranks name, or alternatives separated by '|'.
  {
    bool named = false;
    std::string calls = c.call;
    for (std::size_t b = 0, e; b <= calls.size(); b = e + 1) {
      e = std::min(calls.find('|', b), calls.size());
      named = named || out.find("in " + calls.substr(b, e - b) + ", collective #") != std::string::npos;
    }
    EXPECT_TRUE(named) << "'in " << calls << ", collective #' not in:\n" << out;
  }
  for (const std::string& needle :
       {std::string("collective timeout: waited"), std::string(c.collective),
        "ranks not arrived: " + std::string(c.missing) + " (no answer"})
    EXPECT_NE(out.find(needle), std::string::npos) << "'" << needle << "' not in:\n" << out;
  EXPECT_EQ(out.find("completed although"), std::string::npos) << out;
  if (finalize)
    EXPECT_NE(out.find("after the collective timeout's Error(Communication)"), std::string::npos)
        << "the last resort did not end the process:\n" << out;
  // The same Error(Communication) on every rank that waited in the library.
  std::string first;
  for (int r : reporters(c)) {
    const fs::path file = work / ("error" + std::to_string(r) + ".txt");
    ASSERT_TRUE(fs::exists(file)) << "rank " << r << " got no Error(Communication):\n" << out;
    const std::string error = contents(file);
    if (first.empty()) first = error;
    EXPECT_EQ(error, first) << "rank " << r << "'s error differs";
    for (const std::string& needle :
         {std::string("collective timeout (3 s): collective #"), std::string(c.collective),
          "ranks not arrived: " + std::string(c.missing) + " (no answer",
          std::string("cannot be used again"), std::string("end the job with MPI_Abort")})
      EXPECT_NE(error.find(needle), std::string::npos) << "'" << needle << "' not in rank "
                                                       << r << "'s error: " << error;
    if (c.by_node)
      EXPECT_NE(error.find(std::string("; by node: ") + c.by_node), std::string::npos)
          << "'" << c.by_node << "' not in rank " << r << "'s error: " << error;
  }
  ASSERT_GE(cpu0, 0) << "the waiting rank's CPU time was not sampled";
  ASSERT_GE(cpu1, 0);
  const double fraction = (cpu1 - cpu0) / std::chrono::duration<double>(t1 - t0).count();
  EXPECT_LT(fraction, 0.1) << "the waiting rank used " << fraction << " of a core";
  std::printf("stop -> job end: %.2f s (timeout %.1f s); waiting rank's CPU: %.3f of a core\n",
              elapsed, kTimeout, fraction);
  fs::remove_all(work);
}

INSTANTIATE_TEST_SUITE_P(
    Ranks, FrozenRank,
    testing::Values(
        Frozen{2, 1, "mpi", "step", "collective #", "step", "rank 1", 0},
        // The shared-memory communicator's reduce-scatters do not block on one node: the
        // waiting ranks wait for rank 1's part in grad_ready (a staging slot to free) or in
        // step (the step's wait for every reduction), whichever comes first.
        Frozen{3, 1, "shm", "step", "reduce_scatter_sum (shared memory)", "grad_ready|step",
               "rank 1", 0},
        Frozen{3, 0, "mpi", "get_master", "all_reduce_sum", "get_master", "rank 0", 1},
        Frozen{2, 0, "shm", "get_master", "all_reduce_sum", "get_master", "rank 0", 1},
        // With the option at its default (the timeout from the environment):
        Frozen{2, 1, "mpi", "leave", "collective #", "step", "rank 1", 0, true},
        Frozen{3, 2, "mpi", "leave", "collective #", "step", "rank 2", 0, true},
        Frozen{2, 0, "mpi", "alone", "collective #", "step", "rank 1", 0, true},
        Frozen{3, 1, "shm", "alone", "collective #", "step", "ranks 0, 2", 1, true},
        Frozen{2, 0, "shm", "acquire", "collective #", "acquire(unit 1)", "rank 1", 0, true},
        Frozen{3, 0, "mpi", "acquire", "collective #", "acquire(unit 1)", "ranks 1, 2", 0, true},
        Frozen{2, 1, "shm", "c_step", "collective #", "shardopt_step", "rank 0", 1, true},
        // Debug mode: a rank missing from a collective, not only one calling another.
        Frozen{2, 0, "mpi", "alone", "collective #", "step", "rank 1", 0, true, true},
        Frozen{3, 0, "shm", "acquire", "collective #", "acquire(unit 1)", "ranks 1, 2", 0, true,
               true},
        // A whole node frozen (every rank of it stopped), on pretend nodes: 2 nodes of 2 ranks
        // (the hierarchical communicator: node 0 waits in its node's shared-memory
        // reduce-scatter, inside grad_ready) in step(), 3 nodes of 1 rank (plain MPI) in
        // get_master(). The message names the node and its host.
        Frozen{4, 2, "shm", "step", "reduce_scatter_sum (shared memory)", "grad_ready", "ranks 2, 3",
               0, false, false, 2, "2,3",
               "node 1 (host shardopt-node1): ranks 2, 3 (every rank of the node)"},
        Frozen{3, 2, "mpi", "get_master", "all_reduce_sum", "get_master", "rank 2", 1, true, false, 3,
               "2", "node 2 (host shardopt-node2): rank 2 (every rank of the node)"},
        // The program exits without MPI_Abort after the error (one node: hydra ends the job).
        Frozen{.ranks = 2, .stop_rank = 1, .comm = "mpi", .where = "step",
               .collective = "collective #", .call = "step", .missing = "rank 1", .waiter = 0,
               .after = "exit"},
        Frozen{.ranks = 3, .stop_rank = 1, .comm = "shm", .where = "alone",
               .collective = "collective #", .call = "step", .missing = "ranks 0, 2", .waiter = 1,
               .env = true, .after = "exit"},
        // The program calls MPI_Finalize after the error (an RAII guard, a plain return from
        // main): MPI waits there for the stopped ranks, the watchdog's last resort ends it. On
        // one node only: across pretend nodes, hydra's mpiexec kept waiting for the stopped
        // node after the other node's ranks ended without MPI_Abort (a plain exit too), so
        // the Error's text asks for MPI_Abort (docs/architecture.md, "Node faults").
        Frozen{.ranks = 3, .stop_rank = 1, .comm = "shm", .where = "step",
               .collective = "reduce_scatter_sum (shared memory)", .call = "grad_ready|step",
               .missing = "rank 1", .waiter = 0, .after = "finalize"},
        Frozen{.ranks = 2, .stop_rank = 0, .comm = "mpi", .where = "c_step",
               .collective = "collective #", .call = "shardopt_step", .missing = "rank 1",
               .waiter = 0, .env = true, .after = "finalize"}),
    frozen_name);
