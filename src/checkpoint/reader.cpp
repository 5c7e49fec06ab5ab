// reader.cpp: resolving, validating and streaming a checkpoint from files.
#include "reader.hpp"

#include <vector>

#include "crc32c.hpp"
#include "files.hpp"
#include "shardopt/error.hpp"

namespace shardopt::ckpt {

fs::path resolve_checkpoint_dir(const fs::path& path) {
  std::error_code ec;
  if (fs::is_regular_file(path / kMetadataFile, ec)) return path;
  if (!fs::is_regular_file(path / kLatestFile, ec))
    throw Error(Status::Io, "checkpoint: '" + path.string() +
                                "' holds neither a checkpoint (metadata.bin) nor a LATEST file");
  const std::vector<unsigned char> raw = read_whole_file(path / kLatestFile, 256);
  std::string name(raw.begin(), raw.end());
  while (!name.empty() && (name.back() == '\n' || name.back() == '\r')) name.pop_back();
  // LATEST names a sibling directory; anything else is not ours.
  const bool plain = !name.empty() && name.find('/') == std::string::npos && name != "." &&
                     name != ".." && name.find('\0') == std::string::npos;
  if (!plain) throw Error(Status::CorruptData, "checkpoint: '" + (path / kLatestFile).string() +
                                                   "' does not name a checkpoint directory");
  return path / name;
}

Metadata read_metadata(const fs::path& checkpoint_dir) {
  const std::vector<unsigned char> bytes =
      read_whole_file(checkpoint_dir / kMetadataFile, kMaxMetadataBytes);
  try {
    return decode_metadata(bytes);
  } catch (const Error& e) {
    throw Error(e.status(), std::string(e.what()) + " [" +
                                (checkpoint_dir / kMetadataFile).string() + "]");
  }
}

void stream_shard(const fs::path& checkpoint_dir, const Metadata& m, std::size_t index,
                  const ChunkSink& sink) {
  const MetaShard& s = m.shards.at(index);
  const fs::path path = checkpoint_dir / shard_file_name(index);
  InFile f(path);
  if (f.size() != s.file_bytes)
    throw Error(Status::CorruptData, "checkpoint: '" + path.string() + "' has " +
                                         std::to_string(f.size()) + " bytes, expected " +
                                         std::to_string(s.file_bytes) + " (truncated?)");
  std::array<unsigned char, kShardHeaderBytes> header{};
  f.read(header.data(), header.size());
  try {
    check_shard_matches(decode_shard_header(header), m, index);
  } catch (const Error& e) {
    throw Error(e.status(), std::string(e.what()) + " [" + path.string() + "]");
  }
  std::uint32_t crc = crc32c(header.data(), header.size());
  const std::uint64_t count = s.flat_end - s.flat_begin;
  constexpr std::uint64_t kChunk = std::uint64_t{1} << 20;  // elements: 4 MiB reads
  std::vector<float> buf(static_cast<std::size_t>(std::min(count, kChunk)));
  for (std::uint32_t a = 0; a < kNumArrays; ++a) {
    for (std::uint64_t off = 0; off < count; off += kChunk) {
      const std::size_t n = static_cast<std::size_t>(std::min(kChunk, count - off));
      f.read(buf.data(), n * sizeof(float));
      crc = crc32c_update(crc, buf.data(), n * sizeof(float));
      sink(a, s.flat_begin + off, std::span<const float>(buf.data(), n));
    }
  }
  if (crc != s.crc)
    throw Error(Status::CorruptData,
                "checkpoint: '" + path.string() + "' fails its checksum (the file is corrupted)");
}

}  // namespace shardopt::ckpt
