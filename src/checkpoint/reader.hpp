// reader.hpp: reading a published checkpoint from files: which directory a path names,
// its validated metadata, and the shard files streamed chunk by chunk with their
// checksums verified. Used by load_checkpoint() and by the export tool (no MPI).
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <span>

#include "format.hpp"

namespace shardopt::ckpt {

namespace fs = std::filesystem;

/// `path` is either a checkpoint directory (holds metadata.bin) or a save directory whose
/// LATEST file names the newest published checkpoint. Throws Error(Io) when neither.
fs::path resolve_checkpoint_dir(const fs::path& path);

/// Reads and validates dir/metadata.bin.
Metadata read_metadata(const fs::path& checkpoint_dir);

/// Receives consecutive chunks of one state array (0 master, 1 exp_avg, 2 exp_avg_sq) of a
/// shard; flat_begin is the position of values[0] in the saving layout's flat buffer.
using ChunkSink =
    std::function<void(std::uint32_t array, std::uint64_t flat_begin, std::span<const float> values)>;

/// Streams shard file `index` through `sink`, then verifies its size and CRC-32C against the
/// metadata (Error(CorruptData) otherwise). The sink sees data before the checksum is
/// known to be good: stage it, and use it only when this returns.
void stream_shard(const fs::path& checkpoint_dir, const Metadata& m, std::size_t index,
                  const ChunkSink& sink);

}  // namespace shardopt::ckpt
