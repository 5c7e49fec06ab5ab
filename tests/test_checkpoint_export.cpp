// test_checkpoint_export.cpp: shardopt-export refuses parameter names a safetensors header
// cannot hold (the reserved key "__metadata__", names that are not UTF-8), escapes the
// ones it can, and never touches a file it did not create (an existing OUTPUT.tmp), whether
// the export succeeds or fails; --list shows every name whole, escaped. Single process: the
// tool reads files only.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <set>
#include <string>
#include <vector>

#include "checkpoint/files.hpp"
#include "shardopt/checkpoint.hpp"
#include "support/ckpt_model.hpp"

using namespace shardopt;
namespace fs = std::filesystem;

namespace {

// Saves a checkpoint of parameters with these names (3 elements each, values 1, 2, 3, ...).
void save_named(const fs::path& dir, const std::vector<std::string>& names) {
  auto comm = make_single_process_communicator();
  OptimizerOptions o;
  o.param_dtype = DType::F32;
  ShardedOptimizer opt(comm, o);
  for (const std::string& n : names) opt.add_param(n, 3);
  opt.finalize();
  float v = 1;
  for (std::size_t i = 0; i < names.size(); ++i) {
    const std::vector<float> vals = {v, v + 1, v + 2};
    v += 3;
    opt.set_param(i, vals);
  }
  save_checkpoint(opt, dir);
}

struct ExportRun {
  int status;
  std::string err;
};

ExportRun export_to(const fs::path& ckpt, const fs::path& out) {
  const fs::path err = out.parent_path() / "stderr.txt";
  const std::string cmd = std::string(SHARDOPT_EXPORT_EXE) + " '" + ckpt.string() + "' '" +
                          out.string() + "' > /dev/null 2> '" + err.string() + "'";
  ExportRun r{std::system(cmd.c_str()), {}};
  std::ifstream f(err);
  r.err.assign(std::istreambuf_iterator<char>(f), {});
  fs::remove(err);
  return r;
}

std::set<std::string> entries(const fs::path& dir) {
  std::set<std::string> out;
  for (const fs::directory_entry& e : fs::directory_iterator(dir)) out.insert(e.path().filename().string());
  return out;
}

std::string slurp(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

class ExportTest : public testing::Test {
 protected:
  void SetUp() override {
    std::string tmpl = (fs::temp_directory_path() / "shardopt-export-XXXXXX").string();
    ASSERT_NE(mkdtemp(tmpl.data()), nullptr);
    root_ = tmpl;
    fs::create_directory(root_ / "out");
  }
  void TearDown() override { fs::remove_all(root_); }
  fs::path root_;
};

}  // namespace

TEST_F(ExportTest, ReservedAndNonUtf8NamesAreRefusedWithoutOutput) {
  const std::vector<std::pair<std::string, std::string>> bad = {
      {"__metadata__", "__metadata__"},
      {std::string("w\xff", 2), "not valid UTF-8"},
      {std::string("over\xc0\xaflong"), "not valid UTF-8"},
      {std::string("surrogate\xed\xa0\x80"), "not valid UTF-8"},
      {std::string("cut\xe2\x82"), "not valid UTF-8"},
  };
  int k = 0;
  for (const auto& [name, why] : bad) {
    const fs::path ck = root_ / ("ck" + std::to_string(k++));
    save_named(ck, {"fine", name});
    const fs::path out = root_ / "out" / "model.safetensors";
    const ExportRun r = export_to(ck, out);
    EXPECT_NE(r.status, 0) << why;
    EXPECT_NE(r.err.find(why), std::string::npos) << r.err;
    EXPECT_TRUE(entries(root_ / "out").empty()) << "output or a temporary left behind (" << why << ")";
  }
}

TEST_F(ExportTest, AwkwardButValidNamesAreEscaped) {
  const std::vector<std::string> names = {"gr\xc3\xb6\xc3\x9f" "e", "quote\"back\\slash", "tab\there",
                                          "smile \xf0\x9f\x99\x82", "__metadata__x"};
  save_named(root_ / "ck", names);
  const fs::path out = root_ / "out" / "model.safetensors";
  const ExportRun r = export_to(root_ / "ck", out);
  ASSERT_EQ(r.status, 0) << r.err;
  const std::string file = slurp(out);
  std::uint64_t n = 0;
  std::memcpy(&n, file.data(), 8);
  const std::string header = file.substr(8, n);
  for (const char* key : {"\"gr\xc3\xb6\xc3\x9f" "e\":{", "\"quote\\\"back\\\\slash\":{", "\"tab\\u0009here\":{",
                          "\"smile \xf0\x9f\x99\x82\":{", "\"__metadata__x\":{"})
    EXPECT_NE(header.find(key), std::string::npos) << key << " in " << header;
  // The data: 1, 2, ..., 15 in parameter order.
  ASSERT_EQ(file.size(), 8 + n + 15 * 4);
  for (int i = 0; i < 15; ++i) {
    float v = 0;
    std::memcpy(&v, file.data() + 8 + n + 4 * i, 4);
    EXPECT_EQ(v, static_cast<float>(i + 1));
  }
}

TEST_F(ExportTest, AnExistingTmpFileIsNeverTouched) {
  save_named(root_ / "ck", {"a", "b"});
  const fs::path out = root_ / "out" / "model.safetensors";
  const fs::path tmp = root_ / "out" / "model.safetensors.tmp";
  std::ofstream(tmp) << "somebody else's file";

  ASSERT_EQ(export_to(root_ / "ck", out).status, 0);
  EXPECT_EQ(slurp(tmp), "somebody else's file");
  EXPECT_EQ(entries(root_ / "out"), (std::set<std::string>{"model.safetensors", "model.safetensors.tmp"}));
  EXPECT_EQ(fs::file_size(out) % 4, 0u);

  // A failed export (a corrupted checkpoint) leaves it too, and the previous output.
  const std::string before = slurp(out);
  const fs::path shard = root_ / "ck" / "ckpt-00000001" / "shard-00000.bin";
  {
    std::fstream f(shard, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(70);
    f.put('\x7f');
  }
  const ExportRun r = export_to(root_ / "ck", out);
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.err.find("checksum"), std::string::npos) << r.err;
  EXPECT_EQ(slurp(tmp), "somebody else's file");
  EXPECT_EQ(slurp(out), before);
  EXPECT_EQ(entries(root_ / "out"), (std::set<std::string>{"model.safetensors", "model.safetensors.tmp"}));
}

// --list prints every parameter name whole, on one line: a NUL (which cut the name before),
// a newline or a tab in it is shown as \xNN, a backslash too (so the escape is unambiguous);
// valid UTF-8 is shown as it is.
TEST_F(ExportTest, ListShowsNamesWithControlCharactersEscaped) {
  save_named(root_ / "ck", {std::string("a\0b", 3), "line\nbreak", "tab\there", "back\\slash",
                            "gr\xc3\xb6\xc3\x9f" "e", std::string("bad\xff", 4)});
  const fs::path out = root_ / "out" / "list.txt";
  const std::string cmd = std::string(SHARDOPT_EXPORT_EXE) + " --list '" + (root_ / "ck").string() +
                          "' > '" + out.string() + "'";
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  const std::string listed = slurp(out);
  for (const char* line : {"\na\\x00b\t3\tgroup 0\n", "\nline\\x0Abreak\t3\tgroup 0\n",
                           "\ntab\\x09here\t3\tgroup 0\n", "\nback\\x5Cslash\t3\tgroup 0\n",
                           "\ngr\xc3\xb6\xc3\x9f" "e\t3\tgroup 0\n", "\nbad\\xFF\t3\tgroup 0\n"})
    EXPECT_NE(listed.find(line), std::string::npos) << "missing " << line << " in:\n" << listed;
  EXPECT_EQ(std::count(listed.begin(), listed.end(), '\n'), 7) << listed;  // a header, 6 names
}

// The reader's checks apply to the tool too: a checkpoint directory that holds another
// checkpoint (renamed, swapped or linked) is refused, not exported.
TEST_F(ExportTest, ACheckpointInTheWrongDirectoryIsRefused) {
  save_named(root_ / "ck", {"a"});
  save_named(root_ / "ck2", {"a"});
  fs::rename(root_ / "ck2" / "ckpt-00000001", root_ / "ck" / "ckpt-00000005");
  const ExportRun r = export_to(root_ / "ck" / "ckpt-00000005", root_ / "out" / "m.safetensors");
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.err.find("holds checkpoint ckpt-00000001 (its metadata says so), not ckpt-00000005"),
            std::string::npos) << r.err;
  EXPECT_TRUE(entries(root_ / "out").empty());
}
