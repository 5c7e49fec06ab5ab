// checkpoint_crash_child.cpp: the process test_checkpoint_crash kills. It trains, saves a
// first checkpoint, trains on, and starts a second save that stops at a named point of the
// save protocol on one rank: that rank writes its pid to a marker file and waits there for
// SIGKILL. Run alone (single process) or under mpiexec ("mpi"). "resume" (under mpiexec, any
// rank count) is the job after the crash: it loads DIR's latest checkpoint, trains steps 4 and
// 5 and saves them into DIR (POINT, RANK and MARKER unused). "whole" trains the Whole-ownership
// model with Muon matrices (ckpt_model.hpp: whole_muon_setup) instead of the Flat one.
//   checkpoint_crash_child DIR POINT RANK MARKER single|mpi|resume [whole]
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>

#include "checkpoint/files.hpp"
#include "shardopt/checkpoint.hpp"
#include "support/ckpt_model.hpp"
#ifdef SHARDOPT_WITH_MPI
#include <mpi.h>

#include "shardopt/mpi_comm.hpp"
#endif

namespace {

const char* g_point = nullptr;
int g_rank = 0;
int g_stop_rank = 0;
std::string g_marker;

void stop_here(const char* point) {
  if (g_rank != g_stop_rank || std::strcmp(point, g_point) != 0) return;
  const std::string tmp = g_marker + ".tmp";
  std::ofstream(tmp) << getpid() << "\n";
  std::rename(tmp.c_str(), g_marker.c_str());
  for (;;) pause();  // until SIGKILL
}

}  // namespace

int main(int argc, char** argv) {
  using namespace shardopt;
  if (argc != 6 && !(argc == 7 && std::strcmp(argv[6], "whole") == 0)) {
    std::fprintf(stderr, "usage: %s DIR POINT RANK MARKER single|mpi|resume [whole]\n", argv[0]);
    return 2;
  }
  const test::CkptSetup setup = argc == 7 ? test::whole_muon_setup() : test::CkptSetup{};
  const std::filesystem::path dir = argv[1];
  g_point = argv[2];
  g_stop_rank = std::atoi(argv[3]);
  g_marker = argv[4];
  const bool resume = std::strcmp(argv[5], "resume") == 0;
  const bool mpi = resume || std::strcmp(argv[5], "mpi") == 0;
  std::shared_ptr<Communicator> comm;
#ifdef SHARDOPT_WITH_MPI
  if (mpi) {
    MPI_Init(&argc, &argv);
    comm = make_mpi_communicator(MPI_COMM_WORLD);
  }
#endif
  if (!comm) {
    if (mpi) return 3;
    comm = make_single_process_communicator();
  }
  g_rank = comm->rank();
  try {
    auto opt = test::make_ckpt_optimizer(comm, setup);
    if (resume) {
      load_checkpoint(*opt, dir);
    } else {
      for (int s = 1; s <= 3; ++s) test::ckpt_train_step(*opt, s);
      save_checkpoint(*opt, dir);
    }
    for (int s = 4; s <= 5; ++s) test::ckpt_train_step(*opt, s);
    if (!resume) ckpt::set_test_hook(&stop_here);
    save_checkpoint(*opt, dir);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rank %d: %s\n", g_rank, e.what());
    return 1;
  }
#ifdef SHARDOPT_WITH_MPI
  if (mpi) MPI_Finalize();
#endif
  return 0;
}
