// checkpoint.hpp: crash-safe, reshardable checkpoints of the optimizer state.
//
// A save directory holds published checkpoints (ckpt-00000001, ckpt-00000002, ...) and a
// checksummed LATEST file naming the newest. Each checkpoint is one metadata file plus one
// shard file per rank of the saving run, holding the state per parameter without padding
// (independent of the saving world size and stage); every file and block is CRC-32C
// checksummed. A save writes into a temporary directory and publishes it by rename, so a
// process killed at any moment leaves the previous checkpoint complete. A checkpoint saved at
// N ranks loads at any M ranks, in any stage and either ownership (Flat or Whole), bit for
// bit; checkpoints of the previous formats (1 to 6) still load. Each parameter's state is its
// rule's (AdamW's moments, Lion's and Muon's momentum, AdamW8bit's codes and block scales,
// Adafactor's variance or factored row and column statistics).
// Format and protocol: docs/checkpoint-format.md. All ranks must see the same file system
// path.
#pragma once

#include <filesystem>

#include "shardopt/optimizer.hpp"

namespace shardopt {

struct SaveOptions {
  /// Published checkpoints kept in the directory, >= 1. Older ones are removed once the new
  /// one is published; a failure to remove one is a warning (stderr), not a failed save.
  int keep = 2;
};

/// Collective. Saves the full optimizer state (fp32 master, moments, step count, loss scale,
/// hyperparameters, groups, layout) under `dir` (created if missing) and returns the
/// published checkpoint's directory. On any rank's failure every rank throws the same
/// Error (Io, ...) and the previous checkpoint stays the latest. From its first save into
/// `dir` until it is destroyed, the optimizer holds `dir` locked: another optimizer's (another
/// job's) save into it throws Error(Io) at once on every rank, naming the directory and the
/// holder's host and pid, and changes nothing. The lock dies with its process.
std::filesystem::path save_checkpoint(ShardedOptimizer& opt, const std::filesystem::path& dir,
                                      const SaveOptions& options = {});

/// Collective. Loads the checkpoint that `path` names: a save directory (its LATEST
/// checkpoint) or one checkpoint directory. The optimizer must be finalized with the same
/// parameters (names, sizes, order, groups; a Muon parameter also its shape) and parameter
/// dtype; the world size, stage, bucket size and ownership may differ. Restores master weights, moments, step count, hyperparameters, group options
/// and the loss-scaling state, then rebuilds the replica. Everything is validated first: on a
/// missing, truncated, corrupted, mismatched or newer-version checkpoint every rank throws
/// (Io, CorruptData, LayoutMismatch, Unsupported) and the optimizer is left unchanged; so does
/// an intact checkpoint in the wrong place (a directory whose name is not its sequence number,
/// or a LATEST naming an older checkpoint than one published after it).
void load_checkpoint(ShardedOptimizer& opt, const std::filesystem::path& path);

}  // namespace shardopt
