// make_ckpt_fixture.cpp: writes a checkpoint of the fixture model (tests/support/ckpt_model.hpp)
// in this build's format, plus the state it holds, for the old-format compatibility test.
// tests/data/ckpt_v1 was made with it at format version 1 (see tests/data/README.md):
//   mpiexec -n 2 build/tests/make_ckpt_fixture OUTPUT_DIR
// OUTPUT_DIR/save is the save directory; OUTPUT_DIR/expected.bin holds master, exp_avg and
// exp_avg_sq (fp32, little-endian), each per parameter in registration order, unpadded.
#include <mpi.h>

#include <cstdio>
#include <filesystem>
#include <fstream>

#include "shardopt/checkpoint.hpp"
#include "shardopt/mpi_comm.hpp"
#include "support/ckpt_model.hpp"

int main(int argc, char** argv) {
  using namespace shardopt;
  MPI_Init(&argc, &argv);
  if (argc != 2) {
    std::fprintf(stderr, "usage: mpiexec -n 2 %s OUTPUT_DIR\n", argv[0]);
    MPI_Abort(MPI_COMM_WORLD, 2);
  }
  const std::filesystem::path out = argv[1];
  int rc = 0;
  try {
    auto opt = test::make_fixture_optimizer(make_mpi_communicator(MPI_COMM_WORLD), Stage::Zero1);
    for (int s = 1; s <= 3; ++s) test::ckpt_train_step(*opt, s);
    // Hyperparameters and loss-scaling state that differ from the model's defaults, so that a
    // load is seen to restore them.
    opt->set_lr(3e-3);
    opt->set_group(1, GroupOptions{0.25, false});
    opt->set_loss_scale_state(LossScaleState{8192.0, 1, 4});
    save_checkpoint(*opt, out / "save");
    const test::FullState st = test::gather_state(*opt);
    if (opt->comm().rank() == 0) {
      std::ofstream f(out / "expected.bin", std::ios::binary | std::ios::trunc);
      for (const auto& a : st.arrays)
        f.write(reinterpret_cast<const char*>(a.data()), static_cast<std::streamsize>(a.size() * 4));
      if (!f) throw Error(Status::Io, "cannot write expected.bin");
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "make_ckpt_fixture: %s\n", e.what());
    rc = 1;
  }
  MPI_Finalize();
  return rc;
}
