// make_corpus.cpp: seeds for fuzz_checkpoint_reader from real checkpoints: the metadata
// files and shard headers of saves in a few configurations.
//   fuzz_make_corpus OUTPUT_DIR
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <vector>

#include "checkpoint/format.hpp"
#include "shardopt/checkpoint.hpp"
#include "support/ckpt_model.hpp"

int main(int argc, char** argv) {
  using namespace shardopt;
  namespace fs = std::filesystem;
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s OUTPUT_DIR\n", argv[0]);
    return 2;
  }
  const fs::path out = argv[1];
  fs::create_directories(out);
  LossScaling ls;
  ls.enabled = true;
  const test::CkptSetup setups[] = {{Stage::Zero1, DType::BF16, {}},
                                    {Stage::DataParallel, DType::F32, ls},
                                    {Stage::Zero2, DType::BF16, ls}};
  int n = 0;
  for (const test::CkptSetup& s : setups) {
    const fs::path dir = out / ("save-" + std::to_string(n));
    auto opt = test::make_ckpt_optimizer(make_single_process_communicator(), s);
    for (int step = 1; step <= 2; ++step) test::ckpt_train_step(*opt, step);
    const fs::path ck = save_checkpoint(*opt, dir);
    fs::copy_file(ck / ckpt::kMetadataFile, out / ("metadata-" + std::to_string(n)));
    std::vector<char> header(ckpt::kShardHeaderBytes);
    std::ifstream(ck / ckpt::shard_file_name(0), std::ios::binary).read(header.data(), 64);
    std::ofstream(out / ("shard-header-" + std::to_string(n)), std::ios::binary)
        .write(header.data(), 64);
    fs::remove_all(dir);
    ++n;
  }
  std::printf("wrote %d metadata and %d shard-header seeds to %s\n", n, n, out.c_str());
  return 0;
}
