// test_checkpoint_format.cpp: the byte format alone: CRC-32C, metadata round trip, and the
// decoder's refusal of every truncation, every single-byte corruption and newer versions.
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "checkpoint/crc32c.hpp"
#include "checkpoint/format.hpp"
#include "support/reference.hpp"

using namespace shardopt;
using namespace shardopt::ckpt;

namespace {

Metadata sample() {
  Metadata m;
  m.step_count = 42;
  m.world_size = 3;
  m.stage = Stage::Zero2;
  m.param_dtype = DType::BF16;
  m.adam.lr = 3e-4;
  m.adam.mode = AdamMode::AdamL2;
  m.loss_scaling.enabled = true;
  m.loss_state = LossScaleState{1024.0, 17, 3};
  m.groups = {GroupOptions{}, GroupOptions{0.25, false}};
  m.params = {{"embed", 100, 0, 0}, {"w\"eird name", 1000, 1, 128}, {"b", 3, 0, 1152}};
  m.padded_size = 1152;
  while (m.padded_size < 1155) m.padded_size += 64 * 3;
  const std::uint64_t per = m.padded_size / 3;
  for (std::uint64_t r = 0; r < 3; ++r)
    m.shards.push_back({r * per, (r + 1) * per, kShardHeaderBytes + 3 * per * 4, 0x1234u + static_cast<std::uint32_t>(r)});
  return m;
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
  EXPECT_EQ(d.step_count, 42);
  EXPECT_EQ(d.world_size, 3u);
  EXPECT_EQ(d.stage, Stage::Zero2);
  EXPECT_EQ(d.adam.lr, 3e-4);
  EXPECT_EQ(d.adam.mode, AdamMode::AdamL2);
  EXPECT_TRUE(d.loss_scaling.enabled);
  EXPECT_EQ(d.loss_state.scale, 1024.0);
  EXPECT_EQ(d.loss_state.skipped_steps, 3);
  ASSERT_EQ(d.groups.size(), 2u);
  EXPECT_FALSE(d.groups[1].weight_decay);
  ASSERT_EQ(d.params.size(), 3u);
  EXPECT_EQ(d.params[1].name, "w\"eird name");
  EXPECT_EQ(d.params[2].offset, 1152u);
  EXPECT_EQ(d.shards[2].crc, 0x1236u);
  EXPECT_EQ(layout_hash(d), layout_hash(m));
  EXPECT_EQ(encode_metadata(d), bytes);
}

TEST(Format, EveryTruncationAndEveryByteFlipIsRefused) {
  const std::vector<unsigned char> bytes = encode_metadata(sample());
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

TEST(Format, NewerVersionIsUnsupportedWithAClearMessage) {
  std::vector<unsigned char> bytes = encode_metadata(sample());
  const std::uint32_t v = kFormatVersion + 1;
  std::memcpy(bytes.data() + 8, &v, 4);
  const std::uint32_t crc = crc32c(bytes.data(), 28);
  std::memcpy(bytes.data() + 28, &crc, 4);
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
  // Locate the parameter count: it follows the groups (fixed-size prefix + 12 bytes each).
  const std::size_t prefix = 32 + 8 + 4 * 4 + 6 * 8 + 4 + 4 + 5 * 8 + 8 + 8 + 8 + 4 + 2 * 12;
  std::uint64_t count = 0;
  std::memcpy(&count, bytes.data() + prefix, 8);
  ASSERT_EQ(count, 3u);
  count = std::uint64_t{1} << 60;
  std::memcpy(bytes.data() + prefix, &count, 8);
  const std::uint32_t body_crc = crc32c(bytes.data() + 32, bytes.size() - 32);
  std::memcpy(bytes.data() + 24, &body_crc, 4);
  const std::uint32_t header_crc = crc32c(bytes.data(), 28);
  std::memcpy(bytes.data() + 28, &header_crc, 4);
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
  ShardHeader h;
  h.rank = 1;
  h.world_size = 3;
  h.flat_begin = m.shards[1].flat_begin;
  h.flat_end = m.shards[1].flat_end;
  h.layout_hash = layout_hash(m);
  auto bytes = encode_shard_header(h);
  const ShardHeader d = decode_shard_header(bytes);
  EXPECT_NO_THROW(check_shard_matches(d, m, 1));
  EXPECT_THROW(check_shard_matches(d, m, 0), Error);
  for (std::size_t i = 0; i < bytes.size(); ++i) {
    auto bad = bytes;
    bad[i] ^= 0x20;
    EXPECT_THROW(decode_shard_header(bad), Error) << i;
  }
  EXPECT_THROW(decode_shard_header(std::span(bytes.data(), 10)), Error);
}
