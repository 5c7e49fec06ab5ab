// fuzz_checkpoint_reader.cpp: libFuzzer target over the checkpoint parsers (metadata file,
// formats 1 to 6; shard header; LATEST). Each input is parsed as given, and with its
// checksums fixed up, so that mutations get past the CRCs into the field checks. A parse may
// only succeed or throw shardopt::Error. What it accepts must make sense: the shards cover
// every element exactly once, a current-format metadata survives an encode/decode round
// trip and matches the header written for its shards, a LATEST name re-encodes to itself.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
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
    std::vector<Range> all;
    for (std::size_t s = 0; s < m.shards.size(); ++s) {
      const std::vector<Range> e = shard_extents(m, s);
      all.insert(all.end(), e.begin(), e.end());
    }
    std::sort(all.begin(), all.end(), [](Range a, Range b) { return a.begin < b.begin; });
    std::uint64_t covered = 0;
    for (const Range& r : all) {
      if (r.begin != covered || r.empty()) __builtin_trap();
      covered = r.end;
    }
    if (covered != canonical_offsets(m).back()) __builtin_trap();
    if (m.version != kFormatVersion) return;
    // Anything accepted re-encodes to bytes that decode to the same thing.
    const std::vector<unsigned char> again = encode_metadata(m);
    if (encode_metadata(decode_metadata(again)) != again) __builtin_trap();
    for (std::size_t s = 0; s < m.shards.size(); ++s)
      check_shard_matches(decode_shard_header(encode_shard_header(shard_header(m, s))), m, s);
  } catch (const Error&) {
  }
}

void parse_shard_header(std::span<const unsigned char> bytes) {
  try {
    const ShardHeader h = decode_shard_header(bytes);
    if (h.rank >= h.world_size) __builtin_trap();
    if (h.version == 1 && h.flat_end < h.flat_begin) __builtin_trap();
    if (h.version >= 2 && h.blocks > h.elements) __builtin_trap();
  } catch (const Error&) {
  }
}

void parse_latest(std::span<const unsigned char> bytes) {
  if (bytes.size() > 256) return;  // the reader refuses larger LATEST files before parsing
  try {
    bool legacy = false;
    const std::string name = decode_latest(bytes, legacy);
    if (legacy) return;
    const std::string text = encode_latest(name);
    bool again = true;
    const std::string back = decode_latest(
        std::span(reinterpret_cast<const unsigned char*>(text.data()), text.size()), again);
    if (back != name || again) __builtin_trap();
  } catch (const Error&) {
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::span<const unsigned char> raw(data, size);
  parse_metadata(raw);
  parse_shard_header(raw);
  parse_latest(raw);

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
