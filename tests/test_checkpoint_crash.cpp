// test_checkpoint_crash.cpp: a process killed with SIGKILL at any point of a save leaves the
// previous checkpoint complete and loadable; the next save cleans the temporaries. The
// victim is checkpoint_crash_child, run alone and under mpiexec (one rank killed).
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <thread>
#include <vector>

#include "shardopt/checkpoint.hpp"
#include "support/ckpt_model.hpp"

extern char** environ;

using namespace shardopt;
namespace fs = std::filesystem;

namespace {

// What the child's state was at its first (3 steps) and second (5 steps) save.
test::FullState expected_after(int steps) {
  auto opt = test::make_ckpt_optimizer(make_single_process_communicator(), {});
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
};

std::string crash_name(const testing::TestParamInfo<Crash>& i) {
  std::string s = i.param.point + "_np" + std::to_string(i.param.ranks) + "_rank" +
                  std::to_string(i.param.stop_rank);
  for (char& c : s)
    if (c == '-') c = '_';
  return s;
}

void PrintTo(const Crash& c, std::ostream* os) { *os << c.point << " np" << c.ranks; }

class KillDuringSave : public testing::TestWithParam<Crash> {};

}  // namespace

TEST_P(KillDuringSave, PreviousCheckpointLoadsAndTemporariesAreCleaned) {
  const Crash c = GetParam();
#ifndef SHARDOPT_MPIEXEC
  if (c.ranks > 1) GTEST_SKIP() << "built without MPI";
#endif
  std::string tmpl = (fs::temp_directory_path() / "shardopt-crash-XXXXXX").string();
  ASSERT_NE(mkdtemp(tmpl.data()), nullptr);
  const fs::path work = tmpl;
  const fs::path dir = work / "ckpt";
  const fs::path marker = work / "stopped.pid";

  std::vector<std::string> args;
#ifdef SHARDOPT_MPIEXEC
  if (c.ranks > 1) {
    args = {SHARDOPT_MPIEXEC, "-n", std::to_string(c.ranks)};
    for (const char* f : {SHARDOPT_MPIEXEC_EXTRA})
      if (*f) args.push_back(f);
  }
#endif
  for (const std::string& a : {std::string(SHARDOPT_CRASH_CHILD), dir.string(), c.point,
                               std::to_string(c.stop_rank), marker.string(),
                               std::string(c.ranks > 1 ? "mpi" : "single")})
    args.push_back(a);
  // Open MPI refuses to run as root (containers) unless told; MPICH ignores these.
  setenv("OMPI_ALLOW_RUN_AS_ROOT", "1", 0);
  setenv("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1", 0);
  const fs::path log = work / "child.log";
  const pid_t child = spawn(args, log);
  ASSERT_GT(child, 0);

  // Wait for the stop, then kill the stopped rank with SIGKILL.
  pid_t victim = -1;
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  while (victim < 0 && std::chrono::steady_clock::now() < until) {
    std::ifstream f(marker);
    if (!(f >> victim)) victim = -1;
    if (victim < 0) {
      int status = 0;
      ASSERT_NE(waitpid(child, &status, WNOHANG), child) << "the child exited early";
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }
  ASSERT_GT(victim, 0) << "the child never reached " << c.point << "; its output:\n"
                       << std::string(std::istreambuf_iterator<char>(std::ifstream(log).rdbuf()), {});
  ASSERT_EQ(kill(victim, SIGKILL), 0);
  // mpiexec takes the other ranks down when one dies; whatever is left goes with the group.
  if (!wait_exit(child, std::chrono::seconds(60))) {
    kill(-child, SIGKILL);
    waitpid(child, nullptr, 0);
  }
  kill(-child, SIGKILL);  // stray ranks of the job, if any (the group is ours)

  // The newest published checkpoint loads and is complete.
  auto opt = test::make_ckpt_optimizer(make_single_process_communicator(), {});
  load_checkpoint(*opt, dir);
  EXPECT_TRUE(test::gather_state(*opt) == expected_after(c.expect_steps));

  // The next save removes what the killed save left and publishes normally.
  save_checkpoint(*opt, dir);
  for (const fs::directory_entry& e : fs::directory_iterator(dir)) {
    const std::string name = e.path().filename().string();
    EXPECT_TRUE(name == "LATEST" || name.rfind("ckpt-", 0) == 0) << "left over: " << name;
  }
  auto again = test::make_ckpt_optimizer(make_single_process_communicator(), {});
  load_checkpoint(*again, dir);
  EXPECT_TRUE(test::gather_state(*again) == expected_after(c.expect_steps));
  fs::remove_all(work);
}

INSTANTIATE_TEST_SUITE_P(
    Points, KillDuringSave,
    testing::Values(Crash{"prepared", 1, 0, 3}, Crash{"shard-partly-written", 1, 0, 3},
                    Crash{"shard-written", 1, 0, 3}, Crash{"metadata-written", 1, 0, 3},
                    Crash{"renamed", 1, 0, 3}, Crash{"published", 1, 0, 5},
                    Crash{"shard-partly-written", 2, 1, 3}, Crash{"shard-written", 2, 0, 3},
                    Crash{"metadata-written", 2, 0, 3}, Crash{"renamed", 2, 0, 3}),
    crash_name);
