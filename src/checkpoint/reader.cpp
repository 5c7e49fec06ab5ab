// reader.cpp: resolving, validating and reading a checkpoint from files.
#include "reader.hpp"

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "crc32c.hpp"
#include "files.hpp"
#include "shardopt/error.hpp"

namespace shardopt::ckpt {

namespace {

[[noreturn]] void corrupt_file(const fs::path& p, const std::string& what) {
  throw Error(Status::CorruptData, "checkpoint: '" + p.string() + "' " + what);
}

// The published checkpoint directories of a save directory (ckpt-K holding metadata.bin),
// by sequence number, oldest first.
std::vector<std::pair<std::uint64_t, std::string>> checkpoints_in(const fs::path& save_dir) {
  std::vector<std::pair<std::uint64_t, std::string>> out;
  std::error_code ec;
  for (const fs::directory_entry& e : fs::directory_iterator(save_dir, ec)) {
    const std::string n = e.path().filename().string();
    if (const std::uint64_t k = checkpoint_sequence(n); k > 0 && fs::is_regular_file(e.path() / kMetadataFile, ec))
      out.emplace_back(k, n);
  }
  std::sort(out.begin(), out.end());
  return out;
}

// The newest checkpoint directory name in a save directory, or "" when there is none.
std::string newest_checkpoint(const fs::path& save_dir) {
  const auto all = checkpoints_in(save_dir);
  return all.empty() ? std::string() : all.back().second;
}

// How LATEST's bytes are quoted in messages: escaped and cut.
constexpr std::size_t kQuotedLatestBytes = 64;

// Is some range of `wanted` (ascending, disjoint) overlapping r?
bool overlaps(std::span<const Range> wanted, Range r) {
  auto it = std::upper_bound(wanted.begin(), wanted.end(), r.begin,
                             [](std::size_t x, const Range& w) { return x < w.end; });
  return it != wanted.end() && it->begin < r.end && !r.empty();
}

// Checks shard file `index`, opened as f, against the metadata: its size and header.
void check_shard_file(InFile& f, const fs::path& dir, const Metadata& m, std::size_t index,
                      std::array<unsigned char, kShardHeaderBytes>& header) {
  const fs::path path = dir / shard_file_name(index);
  const MetaShard& s = m.shards[index];
  if (f.size() != s.file_bytes)
    corrupt_file(path, "has " + std::to_string(f.size()) + " bytes, expected " +
                           std::to_string(s.file_bytes) + " (truncated?)");
  f.read(header.data(), header.size());
  try {
    check_shard_matches(decode_shard_header(header), m, index);
  } catch (const Error& e) {
    throw Error(e.status(), std::string(e.what()) + " [" + path.string() + "]");
  }
}

// Formats 2-7: the blocks of shard `index` that overlap `wanted`, each verified, then passed
// on.
void read_blocks(const fs::path& dir, const Metadata& m, std::size_t index,
                 const std::vector<std::uint64_t>& canonical, std::span<const Range> wanted,
                 const ChunkSink& sink) {
  std::array<unsigned char, kShardHeaderBytes> header{};
  InFile f(dir / shard_file_name(index));
  check_shard_file(f, dir, m, index, header);
  std::vector<float> buf;  // floats first in every block: the fp32 arrays stay aligned
  for (const Block& b : m.shards[index].blocks) {
    if (!overlaps(wanted, Range{b.begin, b.begin + b.count})) continue;
    const std::vector<BlockPiece> pieces = block_pieces(m, canonical, b.begin, b.count);
    const auto entries = block_entries(m, pieces);
    const std::size_t bytes = static_cast<std::size_t>(block_bytes(entries));
    buf.resize((bytes + sizeof(float) - 1) / sizeof(float));
    f.read_at(b.file_offset, buf.data(), bytes);
    if (crc32c(buf.data(), bytes) != b.crc)
      corrupt_file(dir / shard_file_name(index),
                   "fails the checksum of its block at element " + std::to_string(b.begin) +
                       " (the file is corrupted)");
    // Where each array starts in the block, and how far each has been consumed.
    std::array<std::size_t, kNumFileArrays> at{};
    std::size_t start = 0;
    for (std::uint32_t a = 0; a < kNumFileArrays; ++a) {
      at[a] = start;
      start += static_cast<std::size_t>(entries[a]) *
               (is_fp32(static_cast<FileArray>(a)) ? sizeof(float) : 1);
    }
    const auto* base = reinterpret_cast<const unsigned char*>(buf.data());
    const auto pass = [&](FileArray a, std::uint64_t begin, std::size_t n) {
      const auto k = static_cast<std::uint32_t>(a);
      Chunk c{a, begin, {}, {}};
      if (is_fp32(a)) {
        c.values = std::span<const float>(reinterpret_cast<const float*>(base + at[k]), n);
        at[k] += n * sizeof(float);
      } else {
        c.codes = std::span<const std::uint8_t>(base + at[k], n);
        at[k] += n;
      }
      if (n > 0) sink(c);
    };
    // Each array holds its entries of every piece in turn (piece_entries: per element, per
    // quantization block, per factored matrix; formats 2-4: the three fp32 arrays of every
    // element), the fp32, scale and factor arrays starting at the piece's first element.
    for (std::uint32_t k = 0; k < kNumFileArrays; ++k)
      for (const BlockPiece& p : pieces)
        pass(static_cast<FileArray>(k), p.begin, static_cast<std::size_t>(piece_entries(m, p)[k]));
  }
}

// Format 1: the whole shard file streamed, its flat chunks cut at parameter boundaries and
// passed on in canonical coordinates; the file's checksum is verified at the end.
void stream_v1_shard(const fs::path& dir, const Metadata& m, std::size_t index,
                     const std::vector<std::uint64_t>& canonical, const ChunkSink& sink) {
  std::array<unsigned char, kShardHeaderBytes> header{};
  InFile f(dir / shard_file_name(index));
  check_shard_file(f, dir, m, index, header);
  const MetaShard& s = m.shards[index];
  std::uint32_t crc = crc32c(header.data(), header.size());
  const std::uint64_t count = s.flat_end - s.flat_begin;
  constexpr std::uint64_t kChunk = std::uint64_t{1} << 20;  // elements: 4 MiB reads
  std::vector<float> buf(static_cast<std::size_t>(std::min(count, kChunk)));
  for (std::uint32_t a = 0; a < kNumArrays; ++a) {
    for (std::uint64_t off = 0; off < count; off += kChunk) {
      const std::size_t n = static_cast<std::size_t>(std::min(kChunk, count - off));
      f.read(buf.data(), n * sizeof(float));
      crc = crc32c_update(crc, buf.data(), n * sizeof(float));
      const std::uint64_t begin = s.flat_begin + off, end = begin + n;
      auto it = std::upper_bound(m.params.begin(), m.params.end(), begin,
                                 [](std::uint64_t x, const MetaParam& p) { return x < p.offset + p.numel; });
      for (; it != m.params.end() && it->offset < end; ++it) {
        const std::uint64_t b = std::max(begin, it->offset), e = std::min(end, it->offset + it->numel);
        const std::size_t i = static_cast<std::size_t>(it - m.params.begin());
        sink(Chunk{static_cast<FileArray>(a), canonical[i] + (b - it->offset),
                   std::span<const float>(buf.data() + (b - begin), static_cast<std::size_t>(e - b)),
                   {}});
      }
    }
  }
  if (crc != s.crc) corrupt_file(dir / shard_file_name(index), "fails its checksum (the file is corrupted)");
}

}  // namespace

fs::path resolve_checkpoint_dir(const fs::path& path) {
  std::error_code ec;
  if (fs::is_regular_file(path / kMetadataFile, ec)) return path;
  const fs::path latest = path / kLatestFile;
  if (!fs::is_regular_file(latest, ec))
    throw Error(Status::Io, "checkpoint: '" + path.string() +
                                "' holds neither a checkpoint (metadata.bin) nor a LATEST file");
  const std::vector<unsigned char> raw = read_whole_file(latest, 256);
  bool legacy = false;
  std::string name;
  try {
    name = decode_latest(raw, legacy);
  } catch (const Error& e) {
    throw Error(e.status(), std::string(e.what()) + " [" + latest.string() + "]");
  }
  const std::string quoted = std::string("'").append(printable(name, kQuotedLatestBytes)).append("'");
  // A LATEST without checksum (format 1) is trusted only if it names the newest checkpoint.
  if (legacy && name != newest_checkpoint(path))
    corrupt_file(latest, "names " + quoted + ", which is not the newest checkpoint present (" +
                             newest_checkpoint(path) + "); it has no checksum (format 1), so "
                             "it may be corrupted: load a checkpoint directory explicitly");
  // A checksum cannot tell an older LATEST, intact, put back in place: a checkpoint that
  // was published after the one it names can (format 3 marks each published checkpoint).
  const std::uint64_t named = checkpoint_sequence(name);
  for (const auto& [k, newer] : checkpoints_in(path))
    if (k > named && fs::is_regular_file(path / newer / kPublishedFile, ec))
      corrupt_file(latest, "names " + quoted + ", but " + newer +
                               " was published after it: LATEST was replaced by an older one. "
                               "Load a checkpoint directory explicitly to use an older checkpoint");
  if (!fs::is_regular_file(path / name / kMetadataFile, ec))
    throw Error(Status::Io, "checkpoint: '" + latest.string() + "' names " + quoted +
                                ", which holds no checkpoint (metadata.bin): removed?");
  return path / name;
}

Metadata read_metadata(const fs::path& checkpoint_dir) {
  const std::vector<unsigned char> bytes =
      read_whole_file(checkpoint_dir / kMetadataFile, kMaxMetadataBytes);
  Metadata m;
  try {
    m = decode_metadata(bytes);
  } catch (const Error& e) {
    throw Error(e.status(), std::string(e.what()) + " [" +
                                (checkpoint_dir / kMetadataFile).string() + "]");
  }
  // The directory's name (and so LATEST's, which names it) carries the sequence number the
  // metadata records: a directory renamed, swapped with another or linked to an older one
  // holds intact files of another checkpoint, which no checksum can tell.
  fs::path named = checkpoint_dir.lexically_normal();
  if (named.filename().empty()) named = named.parent_path();
  const std::uint64_t k = checkpoint_sequence(named.filename().string());
  if (m.sequence != 0 && k != 0 && k != m.sequence)
    corrupt_file(checkpoint_dir, "holds checkpoint " + checkpoint_name(m.sequence) +
                                     " (its metadata says so), not " + named.filename().string() +
                                     ": checkpoint directories were renamed, swapped or linked "
                                     "to another. Load the one you mean by its own name");
  return m;
}

void read_state(const fs::path& dir, const Metadata& m, std::span<const Range> wanted,
                const ChunkSink& sink) {
  const std::vector<std::uint64_t> canonical = canonical_offsets(m);
  for (std::size_t s = 0; s < m.shards.size(); ++s) {
    const std::vector<Range> extents = shard_extents(m, s);
    if (std::none_of(extents.begin(), extents.end(), [&](Range r) { return overlaps(wanted, r); }))
      continue;
    if (m.version == 1)
      stream_v1_shard(dir, m, s, canonical, sink);
    else
      read_blocks(dir, m, s, canonical, wanted, sink);
  }
}

}  // namespace shardopt::ckpt
