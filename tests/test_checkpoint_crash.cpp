// test_checkpoint_crash.cpp: a process killed with SIGKILL at any point of a save leaves the
// previous checkpoint complete and loadable; the next save cleans the temporaries. The
// victim is checkpoint_crash_child, run alone, under mpiexec (one rank killed) and on pretend
// nodes (scripts/mpiexec_nodes.sh: the stopped rank's whole node killed; a job on the nodes
// left then resumes from the checkpoint and trains on), with the Flat model and with the Whole
// one (Muon matrices: ragged per-rank ranges). Also two jobs saving into one directory: the
// second is refused while the first lives.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <thread>
#include <vector>

#include "checkpoint/format.hpp"
#include "shardopt/checkpoint.hpp"
#include "support/ckpt_model.hpp"

extern char** environ;

using namespace shardopt;
namespace fs = std::filesystem;

namespace {

// The child's model: Flat, or Whole with Muon matrices.
test::CkptSetup setup_of(bool whole) {
  return whole ? test::whole_muon_setup() : test::CkptSetup{};
}

// What the child's state was at its first (3 steps) and second (5 steps) save.
test::FullState expected_after(int steps, bool whole = false) {
  auto opt = test::make_ckpt_optimizer(make_single_process_communicator(), setup_of(whole));
  for (int s = 1; s <= steps; ++s) test::ckpt_train_step(*opt, s);
  return test::gather_state(*opt);
}

// Starts argv in its own process group, output to `log`; returns its pid. (mpiexec reports
// the killed rank loudly: expected, so kept out of the test's output.)
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

// Waits for `pid` to exit (true) or for the timeout (false).
bool wait_exit(pid_t pid, std::chrono::seconds timeout) {
  const auto until = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < until) {
    int status = 0;
    if (waitpid(pid, &status, WNOHANG) == pid) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return false;
}

struct Crash {
  std::string point;
  int ranks;      // 1: the child alone; more: under mpiexec
  int stop_rank;
  int expect_steps;  // 3: the previous checkpoint survives; 5: the save had published
  int nodes = 0;     // > 0: on that many pretend nodes, ranks / nodes each; the node dies
  // The job after the crash (nodes > 1): on resume_nodes pretend nodes of resume_per_node
  // ranks; 0: the nodes left (nodes - 1), as many ranks each as before.
  int resume_nodes = 0;
  int resume_per_node = 0;
  bool whole = false;  // the Whole model (Muon matrices) instead of the Flat one
};

std::string crash_name(const testing::TestParamInfo<Crash>& i) {
  std::string s = i.param.point + "_np" + std::to_string(i.param.ranks) + "_rank" +
                  std::to_string(i.param.stop_rank) +
                  (i.param.nodes ? "_nodes" + std::to_string(i.param.nodes) : "") +
                  (i.param.resume_nodes ? "_resume" + std::to_string(i.param.resume_nodes) + "x" +
                                              std::to_string(i.param.resume_per_node)
                                        : "") +
                  (i.param.whole ? "_whole" : "");
  for (char& c : s)
    if (c == '-') c = '_';
  return s;
}

void PrintTo(const Crash& c, std::ostream* os) {
  *os << c.point << " np" << c.ranks << (c.whole ? " whole" : "");
}

class KillDuringSave : public testing::TestWithParam<Crash> {};

// A checkpoint_crash_child job (c.ranks processes) stopped at c.point of its second save,
// on rank c.stop_rank.
struct StoppedJob {
  pid_t child = -1;   // the job (the child alone, or mpiexec)
  pid_t victim = -1;  // the stopped rank's process
};

// Starts the job saving into `dir` and waits until its rank stops at the point.
StoppedJob start_stopped_job(const Crash& c, const fs::path& dir, const fs::path& work) {
  const fs::path marker = work / "stopped.pid";
  std::vector<std::string> args;
#ifdef SHARDOPT_NODES_LAUNCHER
  if (c.nodes > 0) {
    setenv("MPIEXEC", SHARDOPT_MPIEXEC, 1);  // the build's MPICH launcher
    args = {"/bin/bash", SHARDOPT_NODES_LAUNCHER, std::to_string(c.nodes),
            std::to_string(c.ranks / c.nodes), "--"};
  }
#endif
#ifdef SHARDOPT_MPIEXEC
  if (c.ranks > 1 && c.nodes == 0) {
    args = {SHARDOPT_MPIEXEC, "-n", std::to_string(c.ranks)};
    for (const char* f : {SHARDOPT_MPIEXEC_EXTRA})
      if (*f) args.push_back(f);
  }
#endif
  for (const std::string& a : {std::string(SHARDOPT_CRASH_CHILD), dir.string(), c.point,
                               std::to_string(c.stop_rank), marker.string(),
                               std::string(c.ranks > 1 ? "mpi" : "single")})
    args.push_back(a);
  if (c.whole) args.push_back("whole");
  // Open MPI refuses to run as root (containers) unless told; MPICH ignores these.
  setenv("OMPI_ALLOW_RUN_AS_ROOT", "1", 0);
  setenv("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1", 0);
  const fs::path log = work / "child.log";
  StoppedJob job;
  job.child = spawn(args, log);
  EXPECT_GT(job.child, 0);
  if (job.child <= 0) return job;

  // Wait for the stop.
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  while (job.victim < 0 && std::chrono::steady_clock::now() < until) {
    std::ifstream f(marker);
    if (!(f >> job.victim)) job.victim = -1;
    if (job.victim < 0) {
      int status = 0;
      if (waitpid(job.child, &status, WNOHANG) == job.child) {
        ADD_FAILURE() << "the child exited early";
        return job;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }
  EXPECT_GT(job.victim, 0) << "the child never reached " << c.point << "; its output:\n"
                           << std::string(std::istreambuf_iterator<char>(std::ifstream(log).rdbuf()), {});
  return job;
}

// The UTS namespace of `pid` ("uts:[4026532...]"), "" when unreadable.
std::string uts_of(pid_t pid) {
  std::error_code ec;
  const fs::path link = fs::read_symlink("/proc/" + std::to_string(pid) + "/ns/uts", ec);
  return ec ? std::string() : link.string();
}

// Kills every process of the pretend node `pid` runs on: its UTS namespace (hydra's proxy of
// that node and its ranks), the way a machine that loses power takes its processes with it.
// Returns how many it killed.
int kill_node_of(pid_t pid) {
  const std::string node = uts_of(pid);
  if (node.empty() || node == uts_of(getpid())) return 0;  // never this test's own namespace
  int killed = 0;
  for (const fs::directory_entry& e : fs::directory_iterator("/proc")) {
    const std::string name = e.path().filename();
    if (name.empty() || !std::all_of(name.begin(), name.end(), ::isdigit)) continue;
    const pid_t p = static_cast<pid_t>(std::stol(name));
    if (uts_of(p) == node && kill(p, SIGKILL) == 0) ++killed;
  }
  return killed;
}

// Kills the stopped rank with SIGKILL (on pretend nodes: its whole node); mpiexec takes the
// other ranks down, and whatever is left goes with the process group.
void kill_job(const StoppedJob& job, int node_ranks = 0) {
  // The node's ranks and hydra's proxy, at least.
  if (job.victim > 0 && node_ranks > 0) EXPECT_GT(kill_node_of(job.victim), node_ranks);
  if (job.victim > 0) kill(job.victim, SIGKILL);
  if (!wait_exit(job.child, std::chrono::seconds(60))) {
    kill(-job.child, SIGKILL);
    waitpid(job.child, nullptr, 0);
  }
  kill(-job.child, SIGKILL);  // stray ranks of the job, if any (the group is ours)
}

fs::path make_work_dir() {
  std::string tmpl = (fs::temp_directory_path() / "shardopt-crash-XXXXXX").string();
  EXPECT_NE(mkdtemp(tmpl.data()), nullptr);
  return tmpl;
}

}  // namespace

TEST_P(KillDuringSave, PreviousCheckpointLoadsAndTemporariesAreCleaned) {
  const Crash c = GetParam();
#ifndef SHARDOPT_MPIEXEC
  if (c.ranks > 1) GTEST_SKIP() << "built without MPI";
#endif
#ifndef SHARDOPT_NODES_LAUNCHER
  if (c.nodes > 0) GTEST_SKIP() << "pretend nodes are not available here (root and unshare --uts)";
#endif
  const fs::path work = make_work_dir();
  const fs::path dir = work / "ckpt";
  const StoppedJob job = start_stopped_job(c, dir, work);
  ASSERT_GT(job.victim, 0);
  kill_job(job, c.nodes > 0 ? c.ranks / c.nodes : 0);

  // The newest published checkpoint loads and is complete.
  auto opt = test::make_ckpt_optimizer(make_single_process_communicator(), setup_of(c.whole));
  load_checkpoint(*opt, dir);
  EXPECT_TRUE(test::gather_state(*opt) == expected_after(c.expect_steps, c.whole));
#ifdef SHARDOPT_NODES_LAUNCHER
  if (c.nodes > 1) {
    // The nodes left (one fewer, as many ranks each), or the dead node restarted with another
    // rank count per node, load it, train steps 4 and 5 and save: the state of a run that
    // never crashed, bit for bit (the model's sums are exact).
    // MPICH keeps allocations of its own alive at exit (scripts/ci_sanitizers.sh): in a
    // sanitizer build, a leak check would fail the resumed MPI job for MPICH's sake.
    const char* asan = std::getenv("ASAN_OPTIONS");
    setenv("ASAN_OPTIONS", ((asan && *asan ? std::string(asan) + ":" : std::string()) + "detect_leaks=0").c_str(), 1);
    const int nodes = c.resume_nodes ? c.resume_nodes : c.nodes - 1;
    const int per_node = c.resume_per_node ? c.resume_per_node : c.ranks / c.nodes;
    std::vector<std::string> args = {"/bin/bash", SHARDOPT_NODES_LAUNCHER, std::to_string(nodes),
                                     std::to_string(per_node), "--", SHARDOPT_CRASH_CHILD,
                                     dir.string(), "-", "0", "-", "resume"};
    if (c.whole) args.push_back("whole");
    const pid_t resume = spawn(args, work / "resume.log");
    ASSERT_GT(resume, 0);
    int status = -1;
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(120);
    while (waitpid(resume, &status, WNOHANG) != resume) {
      if (std::chrono::steady_clock::now() > until) {
        kill(-resume, SIGKILL);
        waitpid(resume, &status, 0);
        FAIL() << "the resumed job did not end within 120 s";
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
        << std::string(std::istreambuf_iterator<char>(std::ifstream(work / "resume.log").rdbuf()), {});
    auto resumed = test::make_ckpt_optimizer(make_single_process_communicator(), setup_of(c.whole));
    load_checkpoint(*resumed, dir);
    EXPECT_TRUE(test::gather_state(*resumed) == expected_after(5, c.whole));
    for (const fs::directory_entry& e : fs::directory_iterator(dir)) {
      const std::string name = e.path().filename().string();
      EXPECT_TRUE(name == "LATEST" || name == ckpt::kLockFile || name.rfind("ckpt-", 0) == 0)
          << "left over: " << name;
    }
    fs::remove_all(work);
    return;
  }
#endif

  // The next save removes what the killed save left and publishes normally (the killed
  // job's lock died with it; the file it lived in is this job's lock now).
  save_checkpoint(*opt, dir);
  for (const fs::directory_entry& e : fs::directory_iterator(dir)) {
    const std::string name = e.path().filename().string();
    EXPECT_TRUE(name == "LATEST" || name == ckpt::kLockFile || name.rfind("ckpt-", 0) == 0)
        << "left over: " << name;
  }
  auto again = test::make_ckpt_optimizer(make_single_process_communicator(), setup_of(c.whole));
  load_checkpoint(*again, dir);
  EXPECT_TRUE(test::gather_state(*again) == expected_after(c.expect_steps, c.whole));
  fs::remove_all(work);
}

// Two jobs saving into one directory (issue 27): while the first job lives (here stopped in
// its second save, on rank 0, which holds the lock), a second job's save is refused at once,
// naming the directory and the first job's host and pid, and changes nothing; once the first
// job is killed, its lock is gone (the lock file alone is not a lock) and the second job
// saves normally.
TEST(TwoJobs, TheSecondIsRefusedUntilTheFirstIsGone) {
  for (const Crash& c : {Crash{"prepared", 1, 0, 3}, Crash{"shard-written", 2, 0, 3}}) {
#ifndef SHARDOPT_MPIEXEC
    if (c.ranks > 1) continue;
#endif
    SCOPED_TRACE(std::to_string(c.ranks) + " rank(s)");
    const fs::path work = make_work_dir();
    const fs::path dir = work / "ckpt";
    const StoppedJob job = start_stopped_job(c, dir, work);
    ASSERT_GT(job.victim, 0);
    auto opt = test::make_ckpt_optimizer(make_single_process_communicator(), {});
    char host[256] = {};
    gethostname(host, sizeof host - 1);
    const auto entries = [&] {
      std::vector<std::string> names;
      for (const fs::directory_entry& e : fs::directory_iterator(dir)) names.push_back(e.path().filename());
      std::sort(names.begin(), names.end());
      return names;
    };
    const std::vector<std::string> before = entries();
    try {
      save_checkpoint(*opt, dir);
      ADD_FAILURE() << "a second job saved into a directory another job holds";
    } catch (const Error& e) {
      EXPECT_EQ(e.status(), Status::Io);
      const std::string what = e.what();
      EXPECT_NE(what.find("'" + dir.string() + "' is in use: another job saves into it (host " +
                          host + " pid " + std::to_string(job.victim) + ","),
                std::string::npos)
          << what;
    }
    EXPECT_EQ(entries(), before) << "the refused save changed the directory";
    kill_job(job);
    EXPECT_NO_THROW(save_checkpoint(*opt, dir));
    auto again = test::make_ckpt_optimizer(make_single_process_communicator(), {});
    load_checkpoint(*again, dir);
    EXPECT_TRUE(test::gather_state(*again) == test::gather_state(*opt));
    fs::remove_all(work);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Points, KillDuringSave,
    testing::Values(Crash{"prepared", 1, 0, 3}, Crash{"shard-partly-written", 1, 0, 3},
                    Crash{"shard-written", 1, 0, 3}, Crash{"metadata-written", 1, 0, 3},
                    Crash{"renamed", 1, 0, 3}, Crash{"published", 1, 0, 5},
                    Crash{"shard-partly-written", 2, 1, 3}, Crash{"shard-written", 2, 0, 3},
                    Crash{"metadata-written", 2, 0, 3}, Crash{"renamed", 2, 0, 3},
                    // A node dies mid-save: 2 nodes of 2 ranks, the stopped rank's node killed
                    // at three points of the save; the node left resumes.
                    Crash{"shard-partly-written", 4, 3, 3, 2}, Crash{"metadata-written", 4, 0, 3, 2},
                    Crash{"renamed", 4, 0, 3, 2},
                    // The killed node restarted with another rank count: 2 nodes of 1 rank,
                    // and 2 nodes of 3 ranks (6 ranks, where the crashed job had 4).
                    Crash{"metadata-written", 4, 0, 3, 2, 2, 1},
                    Crash{"shard-partly-written", 4, 0, 3, 2, 2, 3},
                    // The Whole model (Muon matrices, ragged ranges), alone and one rank of 2 or 3.
                    Crash{"shard-partly-written", 1, 0, 3, 0, 0, 0, true},
                    Crash{"published", 1, 0, 5, 0, 0, 0, true},
                    Crash{"shard-partly-written", 2, 1, 3, 0, 0, 0, true},
                    Crash{"renamed", 3, 0, 3, 0, 0, 0, true},
                    Crash{"metadata-written", 4, 0, 3, 2, 0, 0, true}),
    crash_name);
