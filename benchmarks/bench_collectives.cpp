// bench_collectives.cpp: shardopt's data collectives (in-place reduce-scatter, all-gather,
// all-reduce over equal per-rank blocks) on each MPI communicator, printed in the
// nccl-tests convention: one line per size of a -b/-e/-f sweep with the buffer size in
// bytes, element count, type, reduction, time, algbw, busbw and #wrong, the number of
// elements that differ from the exact expected result (a correctness check of every size).
//
//   mpiexec -n 2 bench_collectives -b 1Mi -e 64Mi -f 4 [-o reduce_scatter,all_gather,pair,uneven_pair]
//                                  [-d float|bf16] [--comm mpi,shm] [-n 20] [-w 3] [--csv]
//
// size = bytes of the whole in-place buffer (all ranks' blocks, as nccl-tests counts it),
// count = its elements. time = median over iterations of the slowest rank, in microseconds
// (ranks synchronised by the communicator's barrier before each iteration).
// algbw = size / time; busbw = algbw * (n-1)/n for reduce-scatter and all-gather and
// algbw * 2(n-1)/n for all-reduce (nccl-tests' bus bandwidth). -d bf16 sends bf16 over the
// wire: reduce-scatter and all-reduce of fp32 buffers summed as bf16, all-gather of a bf16
// replica; size then counts 2 bytes per element. Inputs are small integers, so every sum is
// exact in either type and #wrong must be 0.
// Issue 32's comparison: -o pair,uneven_pair times a reduce-scatter followed by an
// all-gather of the same fp32 buffer, with equal blocks (pair) and with the whole buffer
// owned by rank 0 and every other count 0 (uneven_pair: start_reduce_scatter_sum_v and
// start_all_gather_v); busbw counts them as an all-reduce. uneven_reduce_scatter and
// uneven_all_gather time the two halves of uneven_pair alone. Float only.
#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "cli.hpp"
#include "shardopt/bf16.hpp"
#include "shardopt/memory.hpp"
#include "shardopt/mpi_comm.hpp"

using namespace shardopt;

namespace {

enum class Op { ReduceScatter, AllGather, AllReduce, Pair, UnevenPair, UnevenReduceScatter, UnevenAllGather };
enum class Type { Float, Bf16 };

struct Args {
  std::size_t min_bytes = std::size_t{1} << 20, max_bytes = std::size_t{64} << 20;
  std::size_t factor = 4;
  std::vector<Op> ops{Op::ReduceScatter, Op::AllGather, Op::AllReduce};
  std::vector<std::string> comms{"mpi", "shm"};
  Type type = Type::Float;
  int iters = 20, warmup = 3;
  bool csv = false;
};

const char* op_name(Op op) {
  switch (op) {
    case Op::ReduceScatter: return "reduce_scatter";
    case Op::AllGather: return "all_gather";
    case Op::AllReduce: return "all_reduce";
    case Op::Pair: return "pair";
    case Op::UnevenPair: return "uneven_pair";
    case Op::UnevenReduceScatter: return "uneven_reduce_scatter";
    case Op::UnevenAllGather: return "uneven_all_gather";
  }
  return "?";
}

int parse(int argc, char** argv, bool print, Args& a) {
  CLI::App app{"shardopt's in-place collectives on the MPI communicators, in the nccl-tests "
               "output convention (size, count, type, redop, time, algbw, busbw, #wrong); run "
               "under mpiexec."};
  cli::init(app, "bench_collectives");
  app.add_option("-b,--minbytes", a.min_bytes, "smallest buffer (all ranks' blocks)")
      ->transform(cli::size(cli::Unit::Bytes))->check(CLI::PositiveNumber)->default_str("1MiB");
  app.add_option("-e,--maxbytes", a.max_bytes, "largest buffer")
      ->transform(cli::size(cli::Unit::Bytes))->check(CLI::PositiveNumber)->default_str("64MiB");
  app.add_option("-f,--stepfactor", a.factor, "multiply the size by this from -b to -e")
      ->check(CLI::Range(2, 1 << 20))->capture_default_str();
  app.add_option("-o,--op", a.ops, "collectives, comma separated")
      ->delimiter(',')
      ->transform(cli::choice<Op>({{"reduce_scatter", Op::ReduceScatter},
                                   {"all_gather", Op::AllGather},
                                   {"all_reduce", Op::AllReduce},
                                   {"pair", Op::Pair},
                                   {"uneven_pair", Op::UnevenPair},
                                   {"uneven_reduce_scatter", Op::UnevenReduceScatter},
                                   {"uneven_all_gather", Op::UnevenAllGather}}))
      ->default_str("reduce_scatter,all_gather,all_reduce");
  app.add_option("-d,--datatype", a.type, "float, or bf16 on the wire")
      ->transform(cli::choice<Type>({{"float", Type::Float}, {"bf16", Type::Bf16}}))
      ->default_str("float");
  app.add_option("--comm", a.comms, "communicators, comma separated: mpi (plain MPI), shm "
                 "(shared memory), default (what the optimizer gets)")
      ->delimiter(',')->check(CLI::IsMember({"mpi", "shm", "default"}))->default_str("mpi,shm");
  app.add_option("-n,--iters", a.iters, "timed iterations per size")->check(CLI::Range(1, 1 << 20))
      ->capture_default_str();
  app.add_option("-w,--warmup_iters", a.warmup, "untimed iterations first")
      ->check(CLI::Range(0, 1 << 20))->capture_default_str();
  app.add_flag("--csv", a.csv, "CSV instead of the table");
  const int rc = cli::parse(app, argc, argv, print);
  if (rc < 0 && a.min_bytes > a.max_bytes) {
    if (print) std::fprintf(stderr, "bench_collectives: -b %zu is larger than -e %zu\n", a.min_bytes, a.max_bytes);
    return 2;
  }
  return rc;
}

// The one place that calls the Communicator's data collectives: blocks of count_per_rank
// elements, block r at offset r * count_per_rank, in place (NCCL's convention).
void run_collective(Communicator& c, Op op, Type type, void* buf, std::size_t count_per_rank) {
  const CommType wire = type == Type::Bf16 ? CommType::BF16 : CommType::F32;
  const std::size_t n = static_cast<std::size_t>(c.size());
  switch (op) {
    case Op::ReduceScatter:
      c.reduce_scatter_sum_inplace(static_cast<float*>(buf), count_per_rank, wire);
      return;
    case Op::AllGather:
      c.all_gather_inplace(buf, count_per_rank, type == Type::Bf16 ? CommType::U16 : CommType::F32);
      return;
    case Op::AllReduce:
      c.start_all_reduce_sum(static_cast<float*>(buf), count_per_rank * n, wire)->wait();
      return;
    case Op::Pair:
      c.reduce_scatter_sum_inplace(static_cast<float*>(buf), count_per_rank, CommType::F32);
      c.all_gather_inplace(buf, count_per_rank, CommType::F32);
      return;
    case Op::UnevenPair:
    case Op::UnevenReduceScatter:
    case Op::UnevenAllGather: {  // rank 0 owns the whole bucket
      std::vector<std::size_t> counts(n, 0);
      counts[0] = count_per_rank * n;
      if (op != Op::UnevenAllGather)
        c.reduce_scatter_sum_v_inplace(static_cast<float*>(buf), counts, CommType::F32);
      if (op != Op::UnevenReduceScatter) c.all_gather_v_inplace(buf, counts, CommType::F32);
      return;
    }
  }
}

// Small integers: every partial sum of up to 2^10 ranks is exact in fp32 and in bf16.
float input(int rank, std::size_t i) { return static_cast<float>((i * 7 + static_cast<std::size_t>(rank) * 3) % 5); }

struct Case {
  Op op;
  Type type;
  int rank, ranks;
  std::size_t per;  // elements per rank
  std::size_t total() const { return per * static_cast<std::size_t>(ranks); }
  std::size_t elem_bytes() const { return type == Type::Bf16 ? 2 : 4; }
  bool gathers_bf16() const { return op == Op::AllGather && type == Type::Bf16; }
};

// Fills the in-place input: own block for all-gather (others poisoned), the whole buffer
// otherwise.
void prepare(const Case& k, void* buf) {
  const std::size_t own = static_cast<std::size_t>(k.rank) * k.per;
  if (k.gathers_bf16()) {
    auto* p = static_cast<bf16*>(buf);
    std::fill(p, p + k.total(), to_bf16(-1.0f));
    for (std::size_t i = 0; i < k.per; ++i) p[own + i] = to_bf16(input(k.rank, own + i));
    return;
  }
  auto* p = static_cast<float*>(buf);
  if (k.op == Op::AllGather) {
    std::fill(p, p + k.total(), -1.0f);
    for (std::size_t i = 0; i < k.per; ++i) p[own + i] = input(k.rank, own + i);
    return;
  }
  for (std::size_t i = 0; i < k.total(); ++i) p[i] = input(k.rank, i);
}

// Elements of this rank's result that differ from the exact answer.
std::size_t count_wrong(const Case& k, const void* buf) {
  const auto sum = [&](std::size_t i) {
    float s = 0;
    for (int r = 0; r < k.ranks; ++r) s += input(r, i);
    return s;
  };
  std::size_t wrong = 0;
  if (k.op == Op::UnevenReduceScatter) {
    const auto* p = static_cast<const float*>(buf);
    if (k.rank == 0)
      for (std::size_t i = 0; i < k.total(); ++i) wrong += p[i] != sum(i);
  } else if (k.op == Op::UnevenAllGather) {
    const auto* p = static_cast<const float*>(buf);
    for (std::size_t i = 0; i < k.total(); ++i) wrong += p[i] != input(0, i);
  } else if (k.op == Op::ReduceScatter) {
    const auto* p = static_cast<const float*>(buf);
    const std::size_t own = static_cast<std::size_t>(k.rank) * k.per;
    for (std::size_t i = own; i < own + k.per; ++i) wrong += p[i] != sum(i);
  } else if (k.op == Op::AllReduce || k.op == Op::Pair || k.op == Op::UnevenPair) {
    const auto* p = static_cast<const float*>(buf);
    for (std::size_t i = 0; i < k.total(); ++i) wrong += p[i] != sum(i);
  } else {
    for (std::size_t i = 0; i < k.total(); ++i) {
      const int owner = static_cast<int>(i / k.per);
      const float got = k.gathers_bf16() ? to_float(static_cast<const bf16*>(buf)[i])
                                         : static_cast<const float*>(buf)[i];
      wrong += got != input(owner, i);
    }
  }
  return wrong;
}

struct Result {
  double seconds;
  std::size_t wrong;
};

Result measure(Communicator& c, const Case& k, void* buf, const Args& a) {
  std::vector<double> times;
  for (int it = 0; it < a.warmup + a.iters; ++it) {
    prepare(k, buf);  // outside the timing: in place, the input is consumed
    // Synchronised through the communicator, so the benchmark waits as the library does
    // (MpiWait: oversubscribed ranks yield).
    c.barrier();
    const double t0 = MPI_Wtime();
    run_collective(c, k.op, k.type, buf, k.per);
    const double dt = MPI_Wtime() - t0;
    std::vector<double> all(static_cast<std::size_t>(c.size()));
    c.all_gather_bytes(&dt, all.data(), sizeof dt);
    if (it >= a.warmup) times.push_back(*std::max_element(all.begin(), all.end()));
  }
  unsigned long long wrong = count_wrong(k, buf);  // the last iteration's result
  MPI_Allreduce(MPI_IN_PLACE, &wrong, 1, MPI_UNSIGNED_LONG_LONG, MPI_SUM, MPI_COMM_WORLD);
  std::sort(times.begin(), times.end());
  return {times[times.size() / 2], static_cast<std::size_t>(wrong)};
}

int run(const Args& a, int rank, int ranks) {
  const std::map<std::string, MpiCommOptions> kinds{
      {"mpi", {MpiCommKind::Plain, 0}}, {"shm", {MpiCommKind::SharedMemory, 0}}, {"default", {}}};
  const double frac = static_cast<double>(ranks - 1) / ranks;
  std::size_t total_wrong = 0;
  if (rank == 0 && a.csv)
    std::printf("comm,collective,ranks,size_bytes,count,type,redop,time_us,algbw_GBs,busbw_GBs,wrong\n");
  for (const std::string& which : a.comms) {
    std::shared_ptr<Communicator> comm = make_mpi_communicator(MPI_COMM_WORLD, kinds.at(which));
    // One buffer of the largest size (fp32: the widest element), from where the communicator
    // moves data fastest (the shared-memory one: its window).
    MemoryTracker tracker;
    const std::size_t max_elems = a.max_bytes / 2;  // bf16 sizes count 2 bytes per element
    Allocation buffer = comm->allocate_collective_buffer(&tracker, MemCategory::Scratch, max_elems * 4);
    if (!buffer.data()) buffer = allocate_host(&tracker, MemCategory::Scratch, max_elems * 4);
    for (Op op : a.ops) {
      if ((op == Op::Pair || op >= Op::UnevenPair) && a.type != Type::Float) {
        if (rank == 0) std::printf("# %s: float only, skipped\n", op_name(op));
        continue;
      }
      if (rank == 0 && !a.csv) {
        std::printf("#\n# %s, communicator %s (--comm %s), %d ranks, in place\n", op_name(op),
                    comm->name().c_str(), which.c_str(), ranks);
        std::printf("# %12s %12s %8s %6s %10s %8s %8s %7s\n", "size", "count", "type", "redop",
                    "time", "algbw", "busbw", "#wrong");
        std::printf("# %12s %12s %8s %6s %10s %8s %8s %7s\n", "(B)", "(elements)", "", "", "(us)",
                    "(GB/s)", "(GB/s)", "");
      }
      for (std::size_t bytes = a.min_bytes; bytes <= a.max_bytes; bytes *= a.factor) {
        const Case k{op, a.type, rank, ranks, bytes / (a.type == Type::Bf16 ? 2 : 4) / static_cast<std::size_t>(ranks)};
        if (k.per == 0) continue;
        const Result r = measure(*comm, k, buffer.data(), a);
        total_wrong += r.wrong;
        const double size = static_cast<double>(k.total() * k.elem_bytes());
        const double algbw = size / r.seconds / 1e9;
        const bool one = op == Op::ReduceScatter || op == Op::AllGather ||
                         op == Op::UnevenReduceScatter || op == Op::UnevenAllGather;
        const double busbw = algbw * (one ? frac : 2 * frac);
        const char* type = a.type == Type::Bf16 ? "bf16" : "float";
        const char* redop = op == Op::AllGather || op == Op::UnevenAllGather ? "none" : "sum";
        if (rank != 0) continue;
        if (a.csv)
          std::printf("%s,%s,%d,%zu,%zu,%s,%s,%.2f,%.3f,%.3f,%zu\n", comm->name().c_str(),
                      op_name(op), ranks, k.total() * k.elem_bytes(), k.total(), type, redop,
                      r.seconds * 1e6, algbw, busbw, r.wrong);
        else
          std::printf("  %12zu %12zu %8s %6s %10.1f %8.2f %8.2f %7zu\n", k.total() * k.elem_bytes(),
                      k.total(), type, redop, r.seconds * 1e6, algbw, busbw, r.wrong);
      }
    }
  }
  if (rank == 0 && !a.csv) std::printf("# out of bounds values: %zu %s\n", total_wrong, total_wrong ? "ERROR" : "OK");
  return total_wrong == 0 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0, ranks = 1, rc = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &ranks);
  try {
    Args a;
    rc = parse(argc, argv, rank == 0, a);
    if (rc < 0) rc = run(a, rank, ranks);
  } catch (const Error& e) {
    std::fprintf(stderr, "bench_collectives: rank %d: %s\n", rank, e.what());
    rc = 1;
  }
  MPI_Finalize();
  return rc;
}
