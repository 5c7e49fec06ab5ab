// make_corpus.cpp: seeds for fuzz_checkpoint_reader from real checkpoints: the metadata
// files, shard headers and LATEST files of saves in a few configurations (current format; one
// of them Whole ownership with a Muon group and 2-D shapes, one with Adafactor's variance and
// factored statistics), and the committed format-1, -2, -5 and -6 fixtures' (tests/data/ckpt_v1,
// ckpt_v2, ckpt_v5, ckpt_v6).
//   fuzz_make_corpus OUTPUT_DIR
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "checkpoint/format.hpp"
#include "shardopt/checkpoint.hpp"
#include "support/ckpt_model.hpp"

namespace {

namespace fs = std::filesystem;

// Copies a checkpoint's metadata, first shard header and the save directory's LATEST.
void seeds_from(const fs::path& save_dir, const fs::path& ck, const fs::path& out, const std::string& tag) {
  fs::copy_file(ck / shardopt::ckpt::kMetadataFile, out / ("metadata-" + tag),
                fs::copy_options::overwrite_existing);
  std::vector<char> header(shardopt::ckpt::kShardHeaderBytes);
  std::ifstream(ck / shardopt::ckpt::shard_file_name(0), std::ios::binary).read(header.data(), header.size());
  std::ofstream(out / ("shard-header-" + tag), std::ios::binary).write(header.data(), header.size());
  fs::copy_file(save_dir / shardopt::ckpt::kLatestFile, out / ("latest-" + tag),
                fs::copy_options::overwrite_existing);
}

}  // namespace

int main(int argc, char** argv) {
  using namespace shardopt;
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
                                    {Stage::Zero2, DType::BF16, ls},
                                    test::whole_muon_setup(), test::whole_adafactor_setup()};
  int n = 0;
  for (const test::CkptSetup& s : setups) {
    const fs::path dir = out / ("save-" + std::to_string(n));
    auto opt = test::make_ckpt_optimizer(make_single_process_communicator(), s);
    for (int step = 1; step <= 2; ++step) test::ckpt_train_step(*opt, step);
    seeds_from(dir, save_checkpoint(*opt, dir), out, std::to_string(n));
    fs::remove_all(dir);
    ++n;
  }
  for (const char* v : {"v1", "v2", "v5", "v6"}) {
    const fs::path old = fs::path(SHARDOPT_TEST_DATA) / (std::string("ckpt_") + v) / "save";
    seeds_from(old, old / "ckpt-00000001", out, v);
  }
  std::printf("wrote %d sets of metadata, shard-header and LATEST seeds to %s\n", n + 4, out.c_str());
  return 0;
}
