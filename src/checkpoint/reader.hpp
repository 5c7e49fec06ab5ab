// reader.hpp: reading a published checkpoint from files: which directory a path names,
// its validated metadata, and the state values of any canonical ranges, every byte's
// checksum verified. Formats 1 to 7. Used by load_checkpoint() and by the export tool (no
// MPI).
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <span>

#include "format.hpp"

namespace shardopt::ckpt {

namespace fs = std::filesystem;

/// `path` is either a checkpoint directory (holds metadata.bin) or a save directory whose
/// LATEST file names the newest published checkpoint. Throws Error(Io) when neither, and
/// Error(CorruptData) when LATEST fails its checksum (or, for a format-1 LATEST without
/// one, does not name the newest checkpoint directory present).
fs::path resolve_checkpoint_dir(const fs::path& path);

/// Reads and validates dir/metadata.bin.
Metadata read_metadata(const fs::path& checkpoint_dir);

/// Entries of one stored array (format.hpp: FileArray) at canonical positions: `begin` is
/// the canonical position of the first element (scales: of the first quantization block's
/// first element, one value per 256 elements from there; Factors: of the matrix's first
/// element, its rows + cols values). fp32 arrays, scales and factors fill `values`, codes
/// fill `codes`. Formats 1-4 pass Master, ExpAvg and ExpAvgSq only.
struct Chunk {
  FileArray array = FileArray::Master;
  std::uint64_t begin = 0;
  std::span<const float> values;
  std::span<const std::uint8_t> codes;
};
using ChunkSink = std::function<void(const Chunk&)>;

/// Passes every stored value whose canonical position lies in `wanted` (ascending, disjoint
/// ranges), and possibly others near them, through `sink`; opens only the shard files that
/// hold some of them. Checks each file's size and header against the metadata
/// (Error(CorruptData) otherwise). Format 2 reads only the blocks that overlap `wanted` and
/// verifies each block's checksum before the sink sees it. Format 1 streams whole files and
/// verifies a file's checksum after its last chunk: the sink must stage what it receives and
/// use it only when this returns.
void read_state(const fs::path& checkpoint_dir, const Metadata& m, std::span<const Range> wanted,
                const ChunkSink& sink);

}  // namespace shardopt::ckpt
