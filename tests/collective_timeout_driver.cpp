// collective_timeout_driver.cpp: the job test_collective_timeout freezes. Every rank trains
// one step under a collective timeout and writes its pid to DIR/rank<R>.pid; then rank STOP
// writes DIR/stopped and stops itself with SIGSTOP, and the others enter a collective (WHERE:
// "step" or "get_master") that can never complete. The job must end by the watchdog's
// MPI_Abort; reaching the end is a failure (exit code 1).
//   collective_timeout_driver DIR STOP_RANK TIMEOUT_SECONDS step|get_master
#include <mpi.h>
#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "shardopt/mpi_comm.hpp"
#include "shardopt/optimizer.hpp"

using namespace shardopt;

namespace {

void write_file(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp";
  std::ofstream(tmp) << text;
  std::rename(tmp.c_str(), path.c_str());
}

void backward(ShardedOptimizer& opt, int rank) {
  for (std::size_t i = opt.layout().num_params(); i-- > 0;) {
    std::span<float> g = opt.grad(i);
    for (std::size_t k = 0; k < g.size(); ++k)
      g[k] = 0.001f * static_cast<float>((k + i + static_cast<std::size_t>(rank)) % 7);
    opt.grad_ready(i);
  }
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  if (argc != 5) {
    std::fprintf(stderr, "usage: %s DIR STOP_RANK TIMEOUT_SECONDS step|get_master\n", argv[0]);
    return 2;
  }
  const std::string dir = argv[1];
  const int stop_rank = std::atoi(argv[2]);
  const std::string where = argv[4];
  try {
    auto comm = make_mpi_communicator(MPI_COMM_WORLD);
    const int rank = comm->rank();
    OptimizerOptions o;
    o.bucket_elems = 4096;
    o.collective_timeout_s = std::atof(argv[3]);
    ShardedOptimizer opt(comm, o);
    opt.add_param("a", 5000);
    opt.add_param("b", 3000);
    opt.finalize();
    backward(opt, rank);
    opt.step();
    // The step's gathers complete on every rank before the stop (plain MPI starts them one at
    // a time, later), so the next collective is the one under test.
    for (std::size_t i = 0; i < 2; ++i) opt.wait_param(i);
    write_file(dir + "/rank" + std::to_string(rank) + ".pid", std::to_string(getpid()) + "\n");
    if (rank == stop_rank) {
      write_file(dir + "/stopped", std::to_string(getpid()) + "\n");
      raise(SIGSTOP);
      return 0;  // continued: the test is over
    }
    if (where == "get_master") {
      std::vector<float> out(5000);
      opt.get_master(0, out);
    } else {
      backward(opt, rank);
      opt.step();
    }
    std::fprintf(stderr, "rank %d: the collective completed although rank %d is stopped\n", rank,
                 stop_rank);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
  }
  return 1;
}
