// fuzz_checkpoint_reader.cpp: libFuzzer target over the checkpoint parsers (metadata file
// and shard header). Each input is parsed twice: as given, and with its checksums fixed up,
// so that mutations get past the CRCs into the field checks. A parse may only succeed or
// throw shardopt::Error; what it accepts must survive an encode/decode round trip.
#include <cstdint>
#include <cstring>
#include <vector>

#include "checkpoint/crc32c.hpp"
#include "checkpoint/format.hpp"
#include "shardopt/error.hpp"

using namespace shardopt;
using namespace shardopt::ckpt;

namespace {

void parse_metadata(std::span<const unsigned char> bytes) {
  try {
    const Metadata m = decode_metadata(bytes);
    // Anything accepted re-encodes to bytes that decode to the same thing.
    const std::vector<unsigned char> again = encode_metadata(m);
    if (encode_metadata(decode_metadata(again)) != again) __builtin_trap();
    ShardHeader h;
    h.world_size = m.world_size;
    h.flat_begin = m.shards[0].flat_begin;
    h.flat_end = m.shards[0].flat_end;
    h.layout_hash = layout_hash(m);
    check_shard_matches(decode_shard_header(encode_shard_header(h)), m, 0);
  } catch (const Error&) {
  }
}

void parse_shard_header(std::span<const unsigned char> bytes) {
  try {
    const ShardHeader h = decode_shard_header(bytes);
    if (h.flat_end < h.flat_begin || h.rank >= h.world_size) __builtin_trap();
  } catch (const Error&) {
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::span<const unsigned char> raw(data, size);
  parse_metadata(raw);
  parse_shard_header(raw);

  std::vector<unsigned char> fixed(data, data + size);
  if (size >= kMetaHeaderBytes) {
    const std::uint32_t body = crc32c(fixed.data() + kMetaHeaderBytes, size - kMetaHeaderBytes);
    std::memcpy(fixed.data() + 24, &body, 4);
    const std::uint32_t head = crc32c(fixed.data(), 28);
    std::memcpy(fixed.data() + 28, &head, 4);
    parse_metadata(fixed);
  }
  if (size >= kShardHeaderBytes) {
    fixed.assign(data, data + size);
    const std::uint32_t head = crc32c(fixed.data(), kShardHeaderBytes - 4);
    std::memcpy(fixed.data() + kShardHeaderBytes - 4, &head, 4);
    parse_shard_header(fixed);
  }
  return 0;
}
