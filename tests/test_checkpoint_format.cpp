// test_checkpoint_format.cpp: the byte format alone: CRC-32C, metadata round trip, the
// decoder's refusal of every truncation, every single-byte corruption, shards that do not
// cover every element exactly once and newer versions; format 1 (the committed fixture's
// files) decoded and checked the same way; LATEST's checksum; non-blocking opens; the reader
// opening only the files and reading only the blocks a range needs.
#include <gtest/gtest.h>

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "checkpoint/crc32c.hpp"
#include "checkpoint/files.hpp"
#include "checkpoint/format.hpp"
#include "checkpoint/reader.hpp"
#include "rules/qmap.hpp"
#include "shardopt/checkpoint.hpp"
#include "support/reference.hpp"

using namespace shardopt;
using namespace shardopt::ckpt;

namespace {

// A shard of these blocks, its size from m's parameters and rules.
MetaShard shard_of(const Metadata& m, std::vector<Block> blocks) {
  MetaShard s;
  s.file_bytes = kShardHeaderBytes;
  for (const Block& b : blocks)
    s.file_bytes += block_bytes(block_entries(m, block_pieces(m, canonical_offsets(m), b.begin, b.count)));
  s.blocks = std::move(blocks);
  return s;
}

// 3 parameters (1103 elements) in 4 shards: one of two blocks, one empty.
Metadata sample() {
  Metadata m;
  m.sequence = 7;
  m.step_count = 42;
  m.world_size = 4;
  m.stage = Stage::Zero2;
  m.param_dtype = DType::BF16;
  m.adam.lr = 3e-4;
  m.adam.mode = AdamMode::AdamL2;
  m.loss_scaling.enabled = true;
  m.loss_state = LossScaleState{1024.0, 17, 3};
  GroupOptions lion;
  lion.lr_scale = 0.25;
  lion.weight_decay = false;
  lion.rule = Rule::Lion;
  lion.lion = {0.95, 0.975};
  m.groups = {GroupOptions{}, lion};
  m.params = {{"embed", 100, 0, 0}, {"w\"eird name", 1000, 1, 0}, {"b", 3, 0, 0}};
  m.shards = {shard_of(m, {{0, 400, 0x1234u, 0}}),
              shard_of(m, {{400, 300, 0x1235u, 0}, {700, 100, 0x99u, 0}}), shard_of(m, {}),
              shard_of(m, {{800, 303, 0x1236u, 0}})};
  return m;
}

// Recomputes a metadata file's body and header checksums after a test edited its body.
void reseal(std::vector<unsigned char>& bytes) {
  const std::uint32_t body_crc = crc32c(bytes.data() + 32, bytes.size() - 32);
  std::memcpy(bytes.data() + 24, &body_crc, 4);
  const std::uint32_t header_crc = crc32c(bytes.data(), 28);
  std::memcpy(bytes.data() + 28, &header_crc, 4);
}

// A metadata file's bytes with the version field set to `v` (and the header checksum fixed).
std::vector<unsigned char> with_version(std::vector<unsigned char> bytes, std::uint32_t v) {
  std::memcpy(bytes.data() + 8, &v, 4);
  const std::uint32_t header_crc = crc32c(bytes.data(), 28);
  std::memcpy(bytes.data() + 28, &header_crc, 4);
  return bytes;
}

std::vector<unsigned char> fixture_file(const char* name) {
  std::ifstream f(std::string(SHARDOPT_TEST_DATA) + "/ckpt_v1/save/ckpt-00000001/" + name,
                  std::ios::binary);
  return std::vector<unsigned char>(std::istreambuf_iterator<char>(f), {});
}

void expect_refused(const Metadata& m, const std::string& why) {
  try {
    decode_metadata(encode_metadata(m));
    ADD_FAILURE() << why << ": accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), Status::CorruptData) << why << ": " << e.what();
  }
}

}  // namespace

TEST(Crc32c, KnownValuesAndBothImplementationsAgree) {
  EXPECT_EQ(crc32c("123456789", 9), 0xE3069283u);
  EXPECT_EQ(crc32c("", 0), 0u);
  const std::vector<unsigned char> zeros(32, 0);
  EXPECT_EQ(crc32c(zeros.data(), zeros.size()), 0x8A9136AAu);  // RFC 3720 B.4
  std::vector<unsigned char> data(10007);
  for (std::size_t i = 0; i < data.size(); ++i) data[i] = static_cast<unsigned char>(i * 131 + 7);
  for (std::size_t n : {0u, 1u, 7u, 8u, 9u, 63u, 1000u, 10007u}) {
    EXPECT_EQ(crc32c(data.data(), n), crc32c_update_portable(0, data.data(), n)) << n;
    // Streaming in two pieces gives the same value.
    const std::size_t cut = n / 3;
    EXPECT_EQ(crc32c_update(crc32c(data.data(), cut), data.data() + cut, n - cut),
              crc32c(data.data(), n)) << n;
  }
}

TEST(Format, MetadataRoundTrip) {
  const Metadata m = sample();
  const std::vector<unsigned char> bytes = encode_metadata(m);
  const Metadata d = decode_metadata(bytes);
  EXPECT_EQ(d.version, kFormatVersion);
  EXPECT_EQ(d.sequence, 7u);
  EXPECT_EQ(d.step_count, 42);
  EXPECT_EQ(d.world_size, 4u);
  EXPECT_EQ(d.stage, Stage::Zero2);
  EXPECT_EQ(d.adam.lr, 3e-4);
  EXPECT_EQ(d.adam.mode, AdamMode::AdamL2);
  EXPECT_TRUE(d.loss_scaling.enabled);
  EXPECT_EQ(d.loss_state.scale, 1024.0);
  EXPECT_EQ(d.loss_state.skipped_steps, 3);
  ASSERT_EQ(d.groups.size(), 2u);
  EXPECT_FALSE(d.groups[1].weight_decay);
  EXPECT_EQ(d.groups[0].rule, Rule::AdamW);
  EXPECT_EQ(d.groups[1].rule, Rule::Lion);  // format 4: the rule and Lion's betas
  EXPECT_EQ(d.groups[1].lion.beta1, 0.95);
  EXPECT_EQ(d.groups[1].lion.beta2, 0.975);
  ASSERT_EQ(d.params.size(), 3u);
  EXPECT_EQ(d.params[1].name, "w\"eird name");
  EXPECT_EQ(canonical_offsets(d), (std::vector<std::uint64_t>{0, 100, 1100, 1103}));
  ASSERT_EQ(d.shards.size(), 4u);
  ASSERT_EQ(d.shards[1].blocks.size(), 2u);
  EXPECT_EQ(d.shards[1].blocks[1].crc, 0x99u);
  // Format 5 stores what each rule keeps: Lion elements 8 bytes, AdamW 12.
  EXPECT_EQ(d.shards[1].blocks[1].file_offset, kShardHeaderBytes + 8 * 300);
  EXPECT_EQ(d.shards[0].file_bytes, kShardHeaderBytes + 12 * 100 + 8 * 300);
  EXPECT_TRUE(d.has_qmap_checksums);
  EXPECT_EQ(d.qmap_checksum[0], rules::q8::kSignedChecksum);
  EXPECT_EQ(d.qmap_checksum[1], rules::q8::kUnsignedChecksum);
  EXPECT_TRUE(d.shards[2].blocks.empty());
  EXPECT_EQ(shard_extents(d, 3), (std::vector<Range>{{800, 1103}}));
  EXPECT_EQ(layout_hash(d), layout_hash(m));
  EXPECT_EQ(encode_metadata(d), bytes);
}

// Format 3 records the checkpoint's sequence number; 0 is no sequence number.
TEST(Format, SequenceNumberZeroIsRefused) {
  Metadata m = sample();
  m.sequence = 0;
  expect_refused(m, "sequence number 0");
}

// Loss-scaling options saved while loss scaling was off were not validated before issue 27
// (the load keeps the loading optimizer's options): such a checkpoint still decodes; options
// that were in use must be valid.
TEST(Format, LossScalingOptionsAreCheckedOnlyWhereTheyWereInUse) {
  Metadata m = sample();
  m.loss_scaling.enabled = false;
  m.loss_scaling.growth_interval = 0;
  m.loss_state = LossScaleState{1.0, 0, 0};
  EXPECT_EQ(decode_metadata(encode_metadata(m)).loss_scaling.growth_interval, 0);
  m.loss_scaling.enabled = true;
  expect_refused(m, "invalid loss-scaling options in use");
}

// Checkpoint directory names: ckpt- and the sequence number in 8 or more digits, one spelling.
TEST(Format, CheckpointNames) {
  EXPECT_EQ(checkpoint_name(7), "ckpt-00000007");
  EXPECT_EQ(checkpoint_name(123456789), "ckpt-123456789");
  EXPECT_EQ(checkpoint_sequence("ckpt-00000007"), 7u);
  EXPECT_EQ(checkpoint_sequence("ckpt-123456789"), 123456789u);
  for (const char* other : {"ckpt-0000007", "ckpt-000000007", "ckpt-00000000", "ckpt-0000000x",
                            "ckpt-00000007/", "xckpt-00000007", "LATEST", ""})
    EXPECT_EQ(checkpoint_sequence(other), 0u) << other;
}

TEST(Format, ShardsMustCoverEveryElementExactlyOnce) {
  Metadata m = sample();
  m.shards[3].blocks[0].count = 302;
  m.shards[3].file_bytes -= 12;
  expect_refused(m, "the last element missing");
  m = sample();
  m.shards[1].blocks[1].begin = 699;
  expect_refused(m, "an element stored twice");
  m = sample();
  m.shards[0].blocks[0].begin = 1;
  expect_refused(m, "the first element missing");
  m = sample();
  m.shards[3].blocks[0].count = 304;
  m.shards[3].file_bytes += 12;
  expect_refused(m, "past the last element");
  m = sample();
  std::swap(m.shards[1].blocks[0], m.shards[1].blocks[1]);
  expect_refused(m, "blocks out of order in a shard");
  m = sample();
  m.shards[0].file_bytes += 4;
  expect_refused(m, "file size not matching the blocks");
  m = sample();
  m.shards[0].blocks[0].count = 0;
  expect_refused(m, "an empty block");
  m = sample();
  m.params[0].numel = std::uint64_t{1} << 50;
  m.params[1].numel = std::uint64_t{1} << 50;
  m.params[2].numel = std::uint64_t{1} << 50;
  m.params.push_back(m.params[0]);
  m.params.back().name = "d";
  m.params.push_back(m.params[0]);
  m.params.back().name = "e";
  expect_refused(m, "more elements than any machine holds");
  // Blocks are at most kBlockElems long; longer runs are split into several blocks.
  auto sized = [](Metadata x) {
    for (MetaShard& sh : x.shards) sh = shard_of(x, sh.blocks);
    return x;
  };
  m = sample();
  m.params[1].numel = kBlockElems + 700;  // 100 + kBlockElems + 700 + 3 elements
  m.shards[2].blocks = {{800, kBlockElems, 0, 0}};
  m.shards[3].blocks = {{800 + kBlockElems, 3, 0, 0}};
  EXPECT_NO_THROW(decode_metadata(encode_metadata(sized(m))));
  m.shards[2].blocks = {{800, kBlockElems / 2, 0, 0}, {800 + kBlockElems / 2, kBlockElems / 2, 0, 0}};
  EXPECT_NO_THROW(decode_metadata(encode_metadata(sized(m))));
  m.shards[2].blocks = {{800, kBlockElems + 1, 0, 0}};
  m.shards[3].blocks = {{801 + kBlockElems, 2, 0, 0}};
  m = sized(m);
  expect_refused(m, "a block longer than kBlockElems");
}

namespace {
// Every truncation of `bytes` and every flip of one bit (0x04) in it is refused.
void expect_every_corruption_refused(const std::vector<unsigned char>& bytes) {
  for (std::size_t n = 0; n < bytes.size(); ++n) {
    EXPECT_THROW(decode_metadata(std::span(bytes.data(), n)), Error) << "length " << n;
  }
  for (std::size_t i = 0; i < bytes.size(); ++i) {
    std::vector<unsigned char> bad = bytes;
    bad[i] ^= 0x04;
    try {
      decode_metadata(bad);
      ADD_FAILURE() << "flip at byte " << i << " accepted";
    } catch (const Error& e) {
      EXPECT_TRUE(e.status() == Status::CorruptData || e.status() == Status::Unsupported) << i;
    }
  }
}
}  // namespace

TEST(Format, EveryTruncationAndEveryByteFlipIsRefused) {
  expect_every_corruption_refused(encode_metadata(sample()));
}

TEST(Format, NewerVersionIsUnsupportedWithAClearMessage) {
  const std::vector<unsigned char> bytes =
      with_version(encode_metadata(sample()), kFormatVersion + 1);
  try {
    decode_metadata(bytes);
    FAIL() << "accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), Status::Unsupported);
    EXPECT_NE(std::string(e.what()).find("newer"), std::string::npos) << e.what();
  }
}

TEST(Format, HugeCountsAreRefusedBeforeAllocating) {
  // A parameter count of 2^60 with a valid checksum: refused by the remaining-bytes bound.
  Metadata m = sample();
  std::vector<unsigned char> bytes = encode_metadata(m);
  // Locate the parameter count: it follows the groups (fixed-size prefix + 40 bytes each in
  // format 5) and the two map checksums, after format 3's sequence number.
  const std::size_t prefix = 32 + 8 + 8 + 4 * 4 + 6 * 8 + 4 + 4 + 5 * 8 + 8 + 8 + 8 + 4 + 2 * 40 + 16;
  std::uint64_t count = 0;
  std::memcpy(&count, bytes.data() + prefix, 8);
  ASSERT_EQ(count, 3u);  // the parameter count
  count = std::uint64_t{1} << 60;
  std::memcpy(bytes.data() + prefix, &count, 8);
  reseal(bytes);
  try {
    decode_metadata(bytes);
    FAIL() << "accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), Status::CorruptData);
    EXPECT_NE(std::string(e.what()).find("does not fit"), std::string::npos) << e.what();
  }
}

TEST(Format, ShardHeaderRoundTripAndChecks) {
  const Metadata m = sample();
  const ShardHeader h = shard_header(m, 1);
  EXPECT_EQ(h.elements, 400u);
  EXPECT_EQ(h.blocks, 2u);
  auto bytes = encode_shard_header(h);
  const ShardHeader d = decode_shard_header(bytes);
  EXPECT_NO_THROW(check_shard_matches(d, m, 1));
  EXPECT_THROW(check_shard_matches(d, m, 0), Error);
  Metadata moved = m;  // the same sizes, other ranges: another checkpoint's shard
  moved.shards[1].blocks[1].begin = 701;
  EXPECT_THROW(check_shard_matches(d, moved, 1), Error);
  for (std::size_t i = 0; i < bytes.size(); ++i) {
    auto bad = bytes;
    bad[i] ^= 0x20;
    EXPECT_THROW(decode_shard_header(bad), Error) << i;
  }
  EXPECT_THROW(decode_shard_header(std::span(bytes.data(), 10)), Error);
}

// ---- format 1: the committed fixture's files ----------------------------------------------

TEST(FormatOne, FixtureMetadataDecodesAndEveryCorruptionIsRefused) {
  const std::vector<unsigned char> bytes = fixture_file("metadata.bin");
  ASSERT_GT(bytes.size(), kMetaHeaderBytes);
  const Metadata m = decode_metadata(bytes);
  EXPECT_EQ(m.version, 1u);
  EXPECT_EQ(m.world_size, 2u);
  EXPECT_EQ(m.step_count, 3);
  // The shards' canonical extents cover every element exactly once, in order.
  const std::vector<std::uint64_t> c = canonical_offsets(m);
  std::uint64_t covered = 0;
  for (std::size_t s = 0; s < m.shards.size(); ++s)
    for (const Range& r : shard_extents(m, s)) {
      EXPECT_EQ(r.begin, covered);
      covered = r.end;
    }
  EXPECT_EQ(covered, c.back());
  EXPECT_EQ(shard_extents(m, 0).size(), 3u);  // parameters 0, 1 and the first part of 2

  for (std::size_t n = 0; n < bytes.size(); ++n)
    EXPECT_THROW(decode_metadata(std::span(bytes.data(), n)), Error) << "length " << n;
  for (std::size_t i = 0; i < bytes.size(); ++i) {
    std::vector<unsigned char> bad = bytes;
    bad[i] ^= 0x04;
    EXPECT_THROW(decode_metadata(bad), Error) << "flip at byte " << i;
  }
}

TEST(FormatOne, FixtureShardHeadersMatchTheirMetadata) {
  const Metadata m = decode_metadata(fixture_file("metadata.bin"));
  for (std::size_t s = 0; s < 2; ++s) {
    const std::vector<unsigned char> file = fixture_file(s == 0 ? "shard-00000.bin" : "shard-00001.bin");
    ASSERT_EQ(file.size(), m.shards[s].file_bytes);
    EXPECT_EQ(crc32c(file.data(), file.size()), m.shards[s].crc);
    const ShardHeader h = decode_shard_header(std::span(file.data(), kShardHeaderBytes));
    EXPECT_EQ(h.version, 1u);
    EXPECT_NO_THROW(check_shard_matches(h, m, s));
    EXPECT_THROW(check_shard_matches(h, m, 1 - s), Error);
    for (std::size_t i = 0; i < kShardHeaderBytes; ++i) {
      std::vector<unsigned char> bad(file.begin(), file.begin() + kShardHeaderBytes);
      bad[i] ^= 0x20;
      EXPECT_THROW(decode_shard_header(bad), Error) << i;
    }
  }
}

// ---- LATEST -----------------------------------------------------------------------------------

TEST(Latest, CarriesAChecksumThatCatchesEveryBitFlip) {
  const std::string good = encode_latest("ckpt-00000003");
  bool legacy = true;
  EXPECT_EQ(decode_latest(std::span(reinterpret_cast<const unsigned char*>(good.data()), good.size()), legacy),
            "ckpt-00000003");
  EXPECT_FALSE(legacy);
  for (std::size_t i = 0; i < good.size(); ++i)
    for (int bit = 0; bit < 8; ++bit) {
      std::string bad = good;
      bad[i] = static_cast<char>(bad[i] ^ (1 << bit));
      try {
        const std::string name =
            decode_latest(std::span(reinterpret_cast<const unsigned char*>(bad.data()), bad.size()), legacy);
        // Only a flip that removes the separator can decode: as a bare (format-1) name,
        // which the reader accepts only if it is the newest checkpoint present.
        EXPECT_TRUE(legacy) << "byte " << i << " bit " << bit << " decoded as " << name;
        EXPECT_NE(name, "ckpt-00000002");
      } catch (const Error& e) {
        EXPECT_EQ(e.status(), Status::CorruptData);
      }
    }
  const std::string old = "ckpt-00000007\n";  // format 1
  EXPECT_EQ(decode_latest(std::span(reinterpret_cast<const unsigned char*>(old.data()), old.size()), legacy),
            "ckpt-00000007");
  EXPECT_TRUE(legacy);
}

// LATEST's bytes in a message: escaped and cut, whatever they are.
TEST(Latest, MessagesQuoteItsContentEscapedAndCut) {
  bool legacy = false;
  const std::string bad = "ckpt-1/../x\x1b]0;t\a 0000000" + std::string(100, 'z');
  try {
    decode_latest(std::span(reinterpret_cast<const unsigned char*>(bad.data()), bad.size()), legacy);
    FAIL() << "accepted";
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()),
              "checkpoint: LATEST holds 'ckpt-1/../x\\x1B]0;t\\x07 0000000" + std::string(39, 'z') +
                  "... (125 bytes)', which does not name a checkpoint directory");
  }
}

// ---- text from files in messages --------------------------------------------------------------

TEST(Text, PrintableEscapesControlBytesAndInvalidUtf8AndCuts) {
  EXPECT_EQ(printable(std::string("a\0b\n\x7f\\", 6)), "a\\x00b\\x0A\\x7F\\x5C");
  EXPECT_EQ(printable("gr\xc3\xb6\xc3\x9f" "e \xf0\x9f\x99\x82"), "gr\xc3\xb6\xc3\x9f" "e \xf0\x9f\x99\x82");
  EXPECT_EQ(printable("bad\xff\xc0\xaf\xed\xa0\x80"), "bad\\xFF\\xC0\\xAF\\xED\\xA0\\x80");
  EXPECT_EQ(printable(std::string(100, 'x'), 10), std::string(10, 'x') + "... (100 bytes)");
  EXPECT_EQ(printable("\xc3\xb6", 1), "\\xC3... (2 bytes)");  // a character cut: escaped
  EXPECT_TRUE(valid_utf8("gr\xc3\xb6\xc3\x9f" "e"));
  EXPECT_FALSE(valid_utf8("cut\xe2\x82"));
}

// ---- files ------------------------------------------------------------------------------------

TEST(Files, AFifoIsRefusedWithoutBlocking) {
  std::string tmpl = (std::filesystem::temp_directory_path() / "shardopt-fifo-XXXXXX").string();
  ASSERT_NE(mkdtemp(tmpl.data()), nullptr);
  const std::filesystem::path fifo = std::filesystem::path(tmpl) / "shard-00000.bin";
  ASSERT_EQ(mkfifo(fifo.c_str(), 0644), 0);
  alarm(60);  // a hang becomes a failure
  try {
    InFile f(fifo);  // blocked here forever before the fix
    ADD_FAILURE() << "a FIFO was opened as a checkpoint file";
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), Status::Io);
    EXPECT_NE(std::string(e.what()).find("not a regular file"), std::string::npos) << e.what();
  }
  EXPECT_THROW(read_whole_file(fifo, 100), Error);
  alarm(0);
  std::filesystem::remove_all(tmpl);
}

// ---- the reader reads what a range needs, nothing else ----------------------------------------

TEST(Reader, ReadsOnlyTheBlocksAndFilesARangeNeeds) {
  std::string tmpl = (std::filesystem::temp_directory_path() / "shardopt-reader-XXXXXX").string();
  ASSERT_NE(mkdtemp(tmpl.data()), nullptr);
  const std::filesystem::path root = tmpl;
  auto counting = [](std::uint64_t& n) {
    return [&n](const ckpt::Chunk& c) { n += c.values.size(); };
  };

  // Format 2, one shard of two blocks (one parameter longer than a block): a corrupted
  // second block does not stop a read of the first block's range.
  {
    OptimizerOptions o;
    o.param_dtype = DType::F32;
    ShardedOptimizer opt(make_single_process_communicator(), o);
    opt.add_param("big", kBlockElems + 1000);
    opt.finalize();
    const std::filesystem::path ck = save_checkpoint(opt, root / "v2");
    const Metadata m = read_metadata(ck);
    ASSERT_EQ(m.shards[0].blocks.size(), 2u);
    {
      std::fstream f(ck / shard_file_name(0), std::ios::in | std::ios::out | std::ios::binary);
      f.seekp(static_cast<std::streamoff>(m.shards[0].blocks[1].file_offset + 8));
      f.put('\x55');
    }
    std::uint64_t n = 0;
    const Range first{10, 20};
    read_state(ck, m, std::span(&first, 1), counting(n));
    EXPECT_EQ(n, 3 * kBlockElems);  // the whole first block, three arrays
    const Range second{kBlockElems + 5, kBlockElems + 6};
    EXPECT_THROW(read_state(ck, m, std::span(&second, 1), counting(n)), Error);
  }

  // Format 1 (the fixture, two shard files): without shard 1, ranges inside shard 0 read.
  {
    const std::filesystem::path v1 = root / "v1";
    std::filesystem::copy(std::string(SHARDOPT_TEST_DATA) + "/ckpt_v1/save/ckpt-00000001", v1);
    std::filesystem::remove(v1 / shard_file_name(1));
    const Metadata m = read_metadata(v1);
    std::uint64_t n = 0;
    const Range head{0, 305};  // parameters 0 and 1, in shard 0
    read_state(v1, m, std::span(&head, 1), counting(n));
    EXPECT_EQ(n, 3 * shard_extents(m, 0).back().end);  // shard 0 streamed, padding left out
    const Range all{0, canonical_offsets(m).back()};
    EXPECT_THROW(read_state(v1, m, std::span(&all, 1), counting(n)), Error);
  }
  std::filesystem::remove_all(root);
}

// A format-4 group record with a rule that does not exist is corrupt data, not a crash.
TEST(Format, UnknownRuleIsCorrupt) {
  Metadata m = sample();
  std::vector<unsigned char> bytes = encode_metadata(m);
  // Group 1's rule field: after the fixed prefix, group 0's 40 bytes, group 1's lr_scale and
  // decay flag.
  const std::size_t at = 32 + 8 + 8 + 4 * 4 + 6 * 8 + 4 + 4 + 5 * 8 + 8 + 8 + 8 + 4 + 40 + 12;
  std::uint32_t rule = 0;
  std::memcpy(&rule, bytes.data() + at, 4);
  ASSERT_EQ(rule, 1u);  // Lion
  rule = 9;
  std::memcpy(bytes.data() + at, &rule, 4);
  reseal(bytes);
  try {
    decode_metadata(bytes);
    FAIL() << "accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), Status::CorruptData);
    EXPECT_NE(std::string(e.what()).find("unknown group rule 9"), std::string::npos) << e.what();
  }
}

// Format 5 with AdamW8bit: a parameter's quantization blocks (256 elements from its start, the
// last partial) are never cut by a block boundary, and the block sizes count codes and scales.
TEST(Format, EightBitBlocksFollowTheQuantizationBlocks) {
  Metadata m = sample();
  GroupOptions q8;
  q8.rule = Rule::AdamW8bit;
  q8.adamw8bit.min_8bit_numel = 500;
  m.groups = {GroupOptions{}, q8};
  m.params = {{"embed", 100, 0, 0}, {"big", 1000, 1, 0}, {"small", 3, 1, 0}};  // small: AdamW
  EXPECT_EQ(param_rule(m, 1), Rule::AdamW8bit);
  EXPECT_EQ(param_rule(m, 2), Rule::AdamW);
  // big = canonical [100, 1100): blocks at 100 + 256k.
  m.shards = {shard_of(m, {{0, 356, 1u, 0}}), shard_of(m, {{356, 512, 2u, 0}}),
              shard_of(m, {{868, 235, 3u, 0}}), shard_of(m, {})};
  const Metadata d = decode_metadata(encode_metadata(m));
  // Shard 0: 100 AdamW (12 bytes each) + 256 8-bit (4 master + 2 codes each, 2 scales).
  EXPECT_EQ(d.shards[0].file_bytes, kShardHeaderBytes + 12 * 100 + 6 * 256 + 8 * 1);
  // Shard 2: 232 8-bit in one partial block + 3 AdamW.
  EXPECT_EQ(d.shards[2].file_bytes, kShardHeaderBytes + 6 * 232 + 8 * 1 + 12 * 3);
  EXPECT_EQ(d.groups[1].adamw8bit.min_8bit_numel, 500u);
  // A boundary inside a quantization block of `big` is corrupt.
  Metadata bad = m;
  bad.shards = {shard_of(bad, {{0, 357, 1u, 0}}), shard_of(bad, {{357, 511, 2u, 0}}),
                shard_of(bad, {{868, 235, 3u, 0}}), shard_of(bad, {})};
  expect_refused(bad, "a block cutting a quantization block");
  // Format 4 could not hold AdamW8bit: such a group in a format-4 file is corrupt.
  // (40-byte groups read as 32: corrupt either way)
  EXPECT_THROW(decode_metadata(with_version(encode_metadata(sample()), 4)), Error);
}

// Format 6: a Muon group's options follow its record; every parameter's 2-D shape follows its
// group; Muon's momentum is an exp_avg (8 bytes per element with its master).
namespace {
Metadata muon_sample() {
  Metadata m = sample();
  GroupOptions muon;
  muon.rule = Rule::Muon;
  muon.lr_scale = 2.0;
  muon.muon.momentum = 0.8;
  muon.muon.nesterov = false;
  muon.muon.ns_steps = 7;
  muon.muon.ns_a = 3.0;
  muon.muon.ns_b = -4.0;
  muon.muon.ns_c = 2.5;
  muon.muon.eps = 1e-6;
  muon.muon.lr_adjust = MuonLrAdjust::None;
  m.groups.push_back(muon);
  m.params = {{"embed", 100, 0, 0, 0, 0}, {"w", 1000, 2, 0, 25, 40}, {"b", 3, 1, 0, 1, 3}};
  m.shards = {shard_of(m, {{0, 400, 0x1234u, 0}}),
              shard_of(m, {{400, 300, 0x1235u, 0}, {700, 100, 0x99u, 0}}), shard_of(m, {}),
              shard_of(m, {{800, 303, 0x1236u, 0}})};
  return m;
}
}  // namespace

TEST(Format, MuonOptionsAndShapesRoundTrip) {
  const Metadata m = muon_sample();
  const std::vector<unsigned char> bytes = encode_metadata(m);
  // The same metadata without the Muon group: its options take 52 bytes.
  Metadata adamw = m;
  adamw.groups[2] = GroupOptions{};
  EXPECT_EQ(bytes.size(), encode_metadata(adamw).size() + 52);
  const Metadata d = decode_metadata(bytes);
  EXPECT_EQ(d.version, kFormatVersion);
  // Without Adafactor groups format 7's metadata is format 6's: read as 6, the same.
  const Metadata six = decode_metadata(with_version(bytes, 6));
  EXPECT_EQ(six.version, 6u);
  EXPECT_EQ(six.shards[3].file_bytes, d.shards[3].file_bytes);
  EXPECT_EQ(six.groups[2].muon.ns_steps, 7);
  ASSERT_EQ(d.groups.size(), 3u);
  const MuonConfig& c = d.groups[2].muon;
  EXPECT_EQ(d.groups[2].rule, Rule::Muon);
  EXPECT_EQ(d.groups[2].lr_scale, 2.0);
  EXPECT_EQ(c.momentum, 0.8);
  EXPECT_FALSE(c.nesterov);
  EXPECT_EQ(c.ns_steps, 7);
  EXPECT_EQ(c.ns_a, 3.0);
  EXPECT_EQ(c.ns_b, -4.0);
  EXPECT_EQ(c.ns_c, 2.5);
  EXPECT_EQ(c.eps, 1e-6);
  EXPECT_EQ(c.lr_adjust, MuonLrAdjust::None);
  // Another group keeps the default Muon options (its record holds none).
  EXPECT_EQ(d.groups[1].muon.momentum, MuonConfig{}.momentum);
  // Shapes: as given, and 1 x numel where none was recorded.
  EXPECT_EQ(d.params[0].rows, 1u);
  EXPECT_EQ(d.params[0].cols, 100u);
  EXPECT_EQ(d.params[1].rows, 25u);
  EXPECT_EQ(d.params[1].cols, 40u);
  EXPECT_EQ(param_rule(d, 1), Rule::Muon);
  // Shard 0: 100 AdamW elements (12 bytes) and 300 Muon (8: master and momentum); shard 3:
  // the Muon tail (300 elements, 8 bytes each) and 3 Lion (8).
  EXPECT_EQ(d.shards[0].file_bytes, kShardHeaderBytes + 12 * 100 + 8 * 300);
  EXPECT_EQ(d.shards[3].file_bytes, kShardHeaderBytes + 8 * 300 + 8 * 3);
  expect_every_corruption_refused(bytes);
}

TEST(Format, ShapesMustMatchTheSizesAndMuonNeedsFormatSix) {
  Metadata m = muon_sample();
  m.params[1].rows = 30;  // 30 x 40 != 1000
  expect_refused(m, "a shape of another size");
  m.params[1].rows = 25;
  m.params[1].cols = 41;
  expect_refused(m, "a shape of another size");
  // The same bytes read as format 5 (no options, no shapes) are refused: format 5 cannot hold
  // Muon state.
  try {
    decode_metadata(with_version(encode_metadata(muon_sample()), 5));
    ADD_FAILURE() << "format 5 with a Muon group accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), Status::CorruptData);
    EXPECT_NE(std::string(e.what()).find("format 5 cannot hold Muon state"), std::string::npos)
        << e.what();
  }
  EXPECT_EQ(first_format_with(Rule::AdamW), 1u);
  EXPECT_EQ(first_format_with(Rule::Lion), 4u);
  EXPECT_EQ(first_format_with(Rule::AdamW8bit), 5u);
  EXPECT_EQ(first_format_with(Rule::Muon), 6u);
}

// Format 7: an Adafactor group's options follow its record; a factored matrix stores rows +
// cols Factors entries (row_var, col_var) in the run holding its first element, an unfactored
// Adafactor parameter its variance as exp_avg_sq.
namespace {
Metadata adafactor_sample() {
  Metadata m = sample();
  GroupOptions ada;
  ada.rule = Rule::Adafactor;
  ada.lr_scale = 0.5;
  ada.adafactor.beta2_decay = -0.6;
  ada.adafactor.eps1 = 1e-25;
  ada.adafactor.eps2 = 4e-3;
  ada.adafactor.d = 2.25;
  ada.adafactor.maximize = true;
  m.groups.push_back(ada);
  m.params = {{"embed", 100, 0, 0, 0, 0}, {"w", 1000, 2, 0, 25, 40}, {"b", 3, 2, 0, 1, 3}};
  m.shards = {shard_of(m, {{0, 400, 0x1234u, 0}}),
              shard_of(m, {{400, 300, 0x1235u, 0}, {700, 100, 0x99u, 0}}), shard_of(m, {}),
              shard_of(m, {{800, 303, 0x1236u, 0}})};
  return m;
}
}  // namespace

TEST(Format, AdafactorOptionsAndFactoredStateRoundTrip) {
  const Metadata m = adafactor_sample();
  const std::vector<unsigned char> bytes = encode_metadata(m);
  // The same metadata with an AdamW group instead: Adafactor's options take 36 bytes.
  Metadata adamw = m;
  adamw.groups[2] = GroupOptions{};
  EXPECT_EQ(bytes.size(), encode_metadata(adamw).size() + 36);
  const Metadata d = decode_metadata(bytes);
  EXPECT_EQ(d.version, 7u);
  ASSERT_EQ(d.groups.size(), 3u);
  const AdafactorConfig& c = d.groups[2].adafactor;
  EXPECT_EQ(d.groups[2].rule, Rule::Adafactor);
  EXPECT_EQ(d.groups[2].lr_scale, 0.5);
  EXPECT_EQ(c.beta2_decay, -0.6);
  EXPECT_EQ(c.eps1, 1e-25);
  EXPECT_EQ(c.eps2, 4e-3);
  EXPECT_EQ(c.d, 2.25);
  EXPECT_TRUE(c.maximize);
  EXPECT_EQ(d.groups[1].adafactor.d, AdafactorConfig{}.d);  // another group: the defaults
  EXPECT_EQ(param_rule(d, 1), Rule::Adafactor);
  // Shard 0: 100 AdamW elements (12 bytes) and w's first 300 (master, 4) with w's 25 + 40
  // factors; shard 1: w's middle (masters only); shard 3: w's tail and b (master and its
  // variance, 8 bytes each).
  EXPECT_EQ(d.shards[0].file_bytes, kShardHeaderBytes + 12 * 100 + 4 * 300 + 4 * (25 + 40));
  EXPECT_EQ(d.shards[1].file_bytes, kShardHeaderBytes + 4 * 400);
  EXPECT_EQ(d.shards[3].file_bytes, kShardHeaderBytes + 4 * 300 + 8 * 3);
  const std::vector<std::uint64_t> canonical = canonical_offsets(d);
  const auto first = block_entries(d, block_pieces(d, canonical, 0, 400));
  EXPECT_EQ(first[static_cast<std::size_t>(FileArray::Factors)], 65u);
  EXPECT_EQ(first[static_cast<std::size_t>(FileArray::ExpAvgSq)], 100u);  // AdamW's only
  const auto tail = block_entries(d, block_pieces(d, canonical, 800, 303));
  EXPECT_EQ(tail[static_cast<std::size_t>(FileArray::Factors)], 0u);
  EXPECT_EQ(tail[static_cast<std::size_t>(FileArray::ExpAvgSq)], 3u);  // b's variance
  expect_every_corruption_refused(bytes);
  // A bad maximize flag with valid checksums is corrupt (the flag follows d, whose value
  // appears nowhere else in the file).
  std::vector<unsigned char> bad = bytes;
  const double d_value = 2.25;
  const unsigned char* at = std::search(bad.data(), bad.data() + bad.size(),
                                        reinterpret_cast<const unsigned char*>(&d_value),
                                        reinterpret_cast<const unsigned char*>(&d_value) + 8);
  ASSERT_NE(at, bad.data() + bad.size());
  const std::size_t pos = static_cast<std::size_t>(at - bad.data()) + 8;
  std::uint32_t v = 0;
  std::memcpy(&v, bad.data() + pos, 4);
  ASSERT_EQ(v, 1u);
  v = 2;
  std::memcpy(bad.data() + pos, &v, 4);
  reseal(bad);
  try {
    decode_metadata(bad);
    ADD_FAILURE() << "a maximize flag of 2 accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), Status::CorruptData);
    EXPECT_NE(std::string(e.what()).find("Adafactor maximize flag"), std::string::npos) << e.what();
  }
}

TEST(Format, AdafactorNeedsFormatSevenAndItsShardHeaderCountsEightArrays) {
  EXPECT_EQ(first_format_with(Rule::Adafactor), 7u);
  try {
    decode_metadata(with_version(encode_metadata(adafactor_sample()), 6));
    ADD_FAILURE() << "format 6 with an Adafactor group accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), Status::CorruptData);
    EXPECT_NE(std::string(e.what()).find("format 6 cannot hold Adafactor state"), std::string::npos)
        << e.what();
  }
  // Shard headers: format 7 counts 8 arrays, formats 5 and 6 counted 7; either other count
  // is refused.
  const auto header = encode_shard_header(shard_header(adafactor_sample(), 0));
  EXPECT_EQ(decode_shard_header(header).version, 7u);
  const auto with = [&](std::uint32_t version, std::uint32_t arrays) {
    auto h = header;
    std::memcpy(h.data() + 8, &version, 4);
    std::memcpy(h.data() + 40, &arrays, 4);
    const std::uint32_t crc = crc32c(h.data(), kShardHeaderBytes - 4);
    std::memcpy(h.data() + kShardHeaderBytes - 4, &crc, 4);
    return h;
  };
  EXPECT_NO_THROW(decode_shard_header(with(7, 8)));
  EXPECT_NO_THROW(decode_shard_header(with(6, 7)));
  EXPECT_NO_THROW(decode_shard_header(with(5, 7)));
  EXPECT_THROW(decode_shard_header(with(7, 7)), Error);
  EXPECT_THROW(decode_shard_header(with(6, 8)), Error);
}
