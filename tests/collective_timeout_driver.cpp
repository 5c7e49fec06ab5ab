// collective_timeout_driver.cpp: the jobs test_collective_timeout runs, each leaving the
// collective sequence in a way real programs do. Every rank trains one step (a stage-3 run
// for `acquire`) and writes its pid to DIR/rank<R>.pid; then rank RANK (or each rank of a
// list, "2,3": a whole node) writes DIR/stopped and:
//   step | get_master: stops itself with SIGSTOP while the others enter that collective;
//   alone:   calls step() alone while the others wait in their own MPI_Barrier (a rank
//            evaluating or stepping on its own);
//   acquire: gathers unit 1 alone (an evaluation pass on rank 0 only at stage 3), the others
//            in their own MPI_Barrier;
//   leave:   leaves its loop cleanly (destroys its optimizer, MPI_Finalize) while the others
//            run another step;
//   c_step:  as alone, through the C ABI (shardopt_step alone).
// A rank whose shardopt call throws Error(Communication) (the watchdog gave up) writes the
// message to DIR/error<R>.txt and then, as programs do: calls MPI_Abort (AFTER `abort`, the
// default), exits with code 3 without MPI_Finalize (`exit`), or calls MPI_Finalize first
// (`finalize`: MPI waits there for the missing ranks, so the watchdog's last resort must end
// the process). Reaching the end otherwise is a failure (exit code 1).
// TIMEOUT_SECONDS 0 leaves collective_timeout_s at its default (the test sets
// SHARDOPT_COLLECTIVE_TIMEOUT).
//   collective_timeout_driver DIR RANK[,RANK...] TIMEOUT_SECONDS
//                             step|get_master|alone|acquire|leave|c_step [abort|exit|finalize]
#include <mpi.h>
#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "shardopt/mpi_comm.hpp"
#include "shardopt/optimizer.hpp"
#include "shardopt/shardopt.h"

using namespace shardopt;

namespace {

void write_file(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp";
  std::ofstream(tmp) << text;
  std::rename(tmp.c_str(), path.c_str());
}

// Writes this rank's gradients; mark_ready: marks each ready (reductions start in backward),
// else step() starts them all.
void backward(ShardedOptimizer& opt, int rank, bool mark_ready = true) {
  for (std::size_t i = opt.layout().num_params(); i-- > 0;) {
    std::span<float> g = opt.grad(i);
    for (std::size_t k = 0; k < g.size(); ++k)
      g[k] = 0.001f * static_cast<float>((k + i + static_cast<std::size_t>(rank)) % 7);
    if (mark_ready) opt.grad_ready(i);
  }
}

void write_pid(const std::string& dir, int rank) {
  write_file(dir + "/rank" + std::to_string(rank) + ".pid", std::to_string(getpid()) + "\n");
}

// What the program does after the watchdog's Error(Communication).
enum class After {
  Abort,     // MPI_Abort (the MPI idiom), once every rank in `peers` has written its error
  Exit,      // exit code 3 without MPI_Finalize
  Finalize,  // MPI_Finalize, then exit code 3 (an RAII guard, a plain return from main)
};
After after = After::Abort;
std::set<int> peers;  // the ranks expected to get the error too

// Records the error in DIR/error<R>.txt, then ends as `after` says.
int gave_up(const std::string& dir, const std::string& message) {
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  write_file(dir + "/error" + std::to_string(rank) + ".txt", message);
  if (after == After::Finalize) MPI_Finalize();
  if (after == After::Abort) {
    // The first MPI_Abort ends every rank: let the others record theirs first (10 s at most).
    for (int k = 0; k < 1000; ++k) {
      bool all = true;
      for (int p : peers)
        all = all && access((dir + "/error" + std::to_string(p) + ".txt").c_str(), F_OK) == 0;
      if (all) break;
      usleep(10000);
    }
    MPI_Abort(MPI_COMM_WORLD, 3);
  }
  return 3;
}

// The C ABI trainer: one step on every rank, then rank `alone` steps alone.
int c_step(const std::string& dir, int alone, double timeout) {
  shardopt_config_t c;
  shardopt_config_init(&c);
  c.bucket_elems = 4096;
  c.collective_timeout_s = timeout;
  shardopt_optimizer_t opt = nullptr;
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  if (shardopt_create_mpi(&opt, MPI_COMM_WORLD, &c) != SHARDOPT_SUCCESS ||
      shardopt_add_param(opt, "a", 5000, 0, nullptr) != SHARDOPT_SUCCESS ||
      shardopt_finalize(opt) != SHARDOPT_SUCCESS) {
    std::fprintf(stderr, "error: %s\n", shardopt_last_error(opt));
    return 1;
  }
  auto step = [&] {
    float* g = nullptr;
    size_t n = 0;
    shardopt_grad(opt, 0, &g, &n);
    for (size_t k = 0; k < n; ++k) g[k] = 0.001f * static_cast<float>((k + rank) % 7);
    return shardopt_step(opt, nullptr);
  };
  step();
  MPI_Barrier(MPI_COMM_WORLD);
  write_pid(dir, rank);
  if (rank == alone) {
    write_file(dir + "/stopped", std::to_string(getpid()) + "\n");
    if (step() == SHARDOPT_ERROR_COMMUNICATION) return gave_up(dir, shardopt_last_error(opt));
  } else {
    MPI_Barrier(MPI_COMM_WORLD);
  }
  std::fprintf(stderr, "rank %d: c_step completed although rank %d diverged\n", rank, alone);
  return 1;
}

// "2,3" -> {2, 3}.
std::set<int> rank_set(const std::string& list) {
  std::set<int> ranks;
  std::istringstream in(list);
  for (std::string r; std::getline(in, r, ',');) ranks.insert(std::atoi(r.c_str()));
  return ranks;
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  if (argc != 5 && argc != 6) {
    std::fprintf(stderr,
                 "usage: %s DIR RANK TIMEOUT_SECONDS step|get_master|alone|acquire|leave|c_step "
                 "[abort|exit|finalize]\n",
                 argv[0]);
    return 2;
  }
  const std::string then = argc == 6 ? argv[5] : "abort";
  after = then == "finalize" ? After::Finalize : then == "exit" ? After::Exit : After::Abort;
  const std::string dir = argv[1];
  const std::set<int> stop_ranks = rank_set(argv[2]);
  const int stop_rank = *stop_ranks.begin();
  const std::string where = argv[4];
  {  // the ranks that wait in the library, as test_collective_timeout's reporters()
    int size = 1;
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    if (where == "alone" || where == "acquire" || where == "c_step") {
      peers = {stop_rank};
    } else {
      for (int r = 0; r < size; ++r)
        if (stop_ranks.count(r) == 0) peers.insert(r);
    }
  }
  if (where == "c_step") return c_step(dir, stop_rank, std::atof(argv[3]));
  try {
    auto comm = make_mpi_communicator(MPI_COMM_WORLD);
    const int rank = comm->rank();
    OptimizerOptions o;
    o.bucket_elems = 4096;
    o.collective_timeout_s = std::atof(argv[3]);
    if (where == "acquire") o.stage = Stage::Zero3;
    auto opt_ptr = std::make_unique<ShardedOptimizer>(comm, o);
    ShardedOptimizer& opt = *opt_ptr;
    opt.add_param("a", 5000);
    if (where == "acquire") opt.begin_unit();
    opt.add_param("b", 3000);
    opt.finalize();
    backward(opt, rank);
    opt.step();
    // The step's gathers complete on every rank before the stop (plain MPI starts them one at
    // a time, later), so the next collective is the one under test.
    if (where != "acquire")
      for (std::size_t i = 0; i < 2; ++i) opt.wait_param(i);
    MPI_Barrier(MPI_COMM_WORLD);
    write_pid(dir, rank);
    const bool diverges = stop_ranks.count(rank) != 0;
    if (diverges) write_file(dir + "/stopped", std::to_string(getpid()) + "\n");
    if (where == "alone" || where == "acquire") {
      if (diverges) {
        if (where == "alone") {
          backward(opt, rank, false);
          opt.step();
        } else {
          opt.acquire(1);
        }
      } else {
        MPI_Barrier(MPI_COMM_WORLD);  // the program's own collective, waiting for the one
      }
      std::fprintf(stderr, "rank %d: %s completed although rank %s diverged\n", rank,
                   where.c_str(), argv[2]);
      return 1;
    }
    if (where == "leave" && diverges) {
      opt_ptr.reset();
      comm.reset();
      MPI_Finalize();
      return 0;
    }
    if (diverges) {
      raise(SIGSTOP);
      return 0;  // continued: the test is over
    }
    if (where == "get_master") {
      std::vector<float> out(5000);
      opt.get_master(0, out);
    } else {
      backward(opt, rank, where != "leave");
      opt.step();
    }
    std::fprintf(stderr, "rank %d: the collective completed although rank %s is stopped\n", rank,
                 argv[2]);
  } catch (const Error& e) {
    if (e.status() == Status::Communication) return gave_up(dir, e.what());
    std::fprintf(stderr, "error: %s\n", e.what());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
  }
  return 1;
}
