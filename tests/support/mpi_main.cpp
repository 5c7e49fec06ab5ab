// mpi_main.cpp: GoogleTest main for tests run under mpiexec. Every rank runs every test;
// only rank 0 prints the usual report, other ranks print their failures tagged with the rank.
#include <gtest/gtest.h>
#include <mpi.h>

#include <cstdio>

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
#if SHARDOPT_MPI_THREAD_MULTIPLE  // the fake device's thread takes part in MPI (tests/fake_cuda)
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  if (provided < MPI_THREAD_MULTIPLE) {
    std::fprintf(stderr, "this test needs MPI_THREAD_MULTIPLE, MPI provides level %d\n", provided);
    MPI_Abort(MPI_COMM_WORLD, 2);
  }
#else
  MPI_Init(&argc, &argv);
#endif
  testing::InitGoogleTest(&argc, argv);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  if (rank != 0) {
    auto& listeners = testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new RankFailurePrinter(rank));
  }
  const int local = RUN_ALL_TESTS();
  // Every rank's verdict counts: the process fails if any rank failed.
  int global = 0;
  MPI_Allreduce(&local, &global, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  MPI_Finalize();
  return global;
}
