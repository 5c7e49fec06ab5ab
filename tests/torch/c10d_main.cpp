// c10d_main.cpp: GoogleTest main for test binaries launched by mpiexec that communicate only
// through the c10d gloo communicator (world_c10d.cpp). The rendezvous file is
// $SHARDOPT_GLOO_FILE, or a name unique to this launch (the launcher's process id, shared by
// the ranks it starts on this machine). Only rank 0 prints the report; every rank's verdict
// counts.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
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

}  // namespace

int main(int argc, char** argv) {
  testing::InitGoogleTest(&argc, argv);
  std::string file;
  if (const char* f = std::getenv("SHARDOPT_GLOO_FILE"); f == nullptr || *f == '\0') {
    file = (std::filesystem::temp_directory_path() /
            ("shardopt-gloo-" + std::to_string(getppid()) + "-" +
             std::to_string(getuid())))
               .string();
    setenv("SHARDOPT_GLOO_FILE", file.c_str(), 1);
  }
  const auto world = shardopt::test::world();
  if (world->rank() != 0) {
    auto& listeners = testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new RankFailurePrinter(world->rank()));
  }
  double failed = RUN_ALL_TESTS() != 0 ? 1.0 : 0.0;
  world->all_reduce_sum_host(&failed, 1);
  world->barrier();
  if (world->rank() == 0 && !file.empty()) std::filesystem::remove(file);
  return failed != 0.0 ? 1 : 0;
}
