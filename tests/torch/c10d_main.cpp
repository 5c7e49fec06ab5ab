// c10d_main.cpp: GoogleTest main for test binaries whose processes communicate only through
// the c10d gloo communicator (world_c10d.cpp): `mpiexec -n K <binary>` merely launches them
// (ranks from PMI_RANK/PMI_SIZE or OMPI_COMM_WORLD_*), no process calls MPI. Run directly,
// without any rank variable, a binary is a group of one.
//
// Rendezvous: $SHARDOPT_GLOO_FILE, or MASTER_ADDR/MASTER_PORT, if set. Otherwise a file in the
// temporary directory named after the launcher: the parent process (MPICH's hydra_pmi_proxy
// or Open MPI's daemon, shared by the ranks it starts on this machine) and its start time, so
// a recycled process id never meets a stale file; the ranks then bind gloo to loopback (one
// machine). make_gloo_communicator deletes the file once every rank has joined.
//
// Only rank 0 prints the report; the others print their failures tagged with the rank. Every
// rank's verdict counts: the exit status is 1 on every rank if any rank failed.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <sstream>
#include <string>

#include "support/world.hpp"

namespace {

class RankFailurePrinter : public testing::EmptyTestEventListener {
 public:
  explicit RankFailurePrinter(int rank) : rank_(rank) {}
  void OnTestPartResult(const testing::TestPartResult& r) override {
    if (r.failed())
      std::fprintf(stderr, "[rank %d] %s:%d: failure\n%s\n", rank_,
                   r.file_name() ? r.file_name() : "?", r.line_number(), r.summary());
  }

 private:
  int rank_;
};

bool is_set(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0';
}

// The start time of process `pid` in clock ticks since boot (field 22 of /proc/<pid>/stat),
// or "0" where /proc is not available.
std::string start_time(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string stat((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const std::size_t close = stat.rfind(')');  // the command name may hold spaces
  if (close == std::string::npos) return "0";
  std::istringstream fields(stat.substr(close + 2));
  std::string field;
  for (int i = 3; i <= 22 && fields >> field; ++i) {
  }
  return field.empty() ? "0" : field;
}

// Sets up the environment that make_gloo_communicator_from_env reads, where the launcher
// left something out.
void prepare_environment() {
  const bool launched = is_set("RANK") || is_set("WORLD_SIZE") || is_set("PMI_RANK") ||
                        is_set("PMI_SIZE") || is_set("OMPI_COMM_WORLD_RANK") ||
                        is_set("OMPI_COMM_WORLD_SIZE");
  if (!launched) {  // run directly: a group of one
    setenv("RANK", "0", 1);
    setenv("WORLD_SIZE", "1", 1);
  }
  if (is_set("SHARDOPT_GLOO_FILE") || is_set("MASTER_ADDR")) return;
  const pid_t launcher = launched ? getppid() : getpid();
  const std::string name = "shardopt-gloo-" + std::to_string(getuid()) + "-" +
                           std::to_string(launcher) + "-" + start_time(launcher);
  setenv("SHARDOPT_GLOO_FILE", (std::filesystem::temp_directory_path() / name).c_str(), 1);
  setenv("SHARDOPT_GLOO_HOST", "127.0.0.1", 0);  // the ranks share this machine's /tmp
}

}  // namespace

int main(int argc, char** argv) {
  testing::InitGoogleTest(&argc, argv);
  prepare_environment();
  std::shared_ptr<shardopt::Communicator> world;
  try {
    world = shardopt::test::world();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "cannot make the c10d world communicator: %s\n", e.what());
    return 2;
  }
  if (world->rank() != 0) {
    auto& listeners = testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new RankFailurePrinter(world->rank()));
  }
  double failed = RUN_ALL_TESTS() != 0 ? 1.0 : 0.0;
  try {
    world->all_reduce_sum_host(&failed, 1);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "[rank %d] the final verdict exchange failed: %s\n", world->rank(),
                 e.what());
    return 1;
  }
  return failed != 0.0 ? 1 : 0;
}
