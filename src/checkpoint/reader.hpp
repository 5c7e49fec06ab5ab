// reader.hpp: reading a published checkpoint from files: which directory a path names,
// its validated metadata, and the state values of any canonical ranges, every byte's
// checksum verified. Formats 1 and 2. Used by load_checkpoint() and by the export tool (no
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

/// Receives values of one state array (0 master, 1 exp_avg, 2 exp_avg_sq) at the canonical
/// positions [begin, begin + values.size()).
using ChunkSink =
    std::function<void(std::uint32_t array, std::uint64_t begin, std::span<const float> values)>;

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
