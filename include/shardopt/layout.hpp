// layout.hpp: the flat, padded buffer that holds every parameter, and its shards.
//
// Parameters are registered in the trainer's order. Each one starts at a multiple of
// kAlignElems elements, so that every per-parameter view is aligned for vector loads (64
// elements = 256 B of fp32, 128 B of bf16). The total is padded to a multiple of
// world_size * kAlignElems, so that all ranks own one contiguous shard of the same length
// that starts aligned too. Parameters may straddle shard boundaries.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "shardopt/dtype.hpp"
#include "shardopt/range.hpp"

namespace shardopt {

struct ParamInfo {
  std::string name;
  std::size_t numel = 0;
  int group = 0;
  Range flat;  ///< where the parameter lives in the flat buffer ([offset, offset + numel))
};

/// The piece of one parameter that falls inside one shard.
struct ShardPiece {
  std::size_t param = 0;  ///< parameter index
  Range flat;             ///< in the flat buffer
  Range local;            ///< relative to the start of the shard
  Range in_param;         ///< relative to the start of the parameter
};

/// A contiguous run of parameters whose gradients are reduced together (stage 2).
struct Bucket {
  Range flat;                 ///< tiles the flat buffer, padding included
  std::size_t first_param;    ///< lowest parameter index in the bucket
  std::size_t end_param;      ///< one past the highest
};

class FlatLayout {
 public:
  static constexpr std::size_t kAlignElems = 64;

  /// Rounds n up to a multiple of `multiple` (multiple > 0).
  static constexpr std::size_t round_up(std::size_t n, std::size_t multiple) {
    return (n + multiple - 1) / multiple * multiple;
  }

  /// Registers a parameter; throws Error(InvalidArgument) for an empty or duplicate name, or
  /// a zero size. Layout offsets are assigned at once; build() fixes the padding.
  std::size_t add(std::string_view name, std::size_t numel, int group);

  /// Pads the total for `world_size` equal, aligned shards. Further add() calls throw.
  void build(int world_size);

  bool built() const { return world_size_ > 0; }
  int world_size() const { return world_size_; }
  std::size_t num_params() const { return params_.size(); }
  const ParamInfo& param(std::size_t i) const;
  const std::vector<ParamInfo>& params() const { return params_; }
  /// Index of the parameter called `name`, or num_params() if there is none.
  std::size_t find(std::string_view name) const;

  std::size_t unpadded_size() const { return unpadded_; }  ///< sum of parameter sizes
  std::size_t padded_size() const { return padded_; }      ///< length of the flat buffer
  std::size_t shard_size() const { return padded_ / static_cast<std::size_t>(world_size_); }
  Range shard_range(int rank) const;

  /// The pieces of parameters inside `window`, in flat order (padding excluded).
  std::vector<ShardPiece> pieces_in(Range window) const;

  /// Buckets of about `bucket_elems` elements in backward order (bucket 0 holds the last
  /// parameters). A parameter larger than bucket_elems gets a bucket of its own.
  std::vector<Bucket> make_buckets(std::size_t bucket_elems) const;

  /// A hash of everything that must agree between ranks (names, sizes, groups, order).
  std::uint64_t fingerprint() const;
  /// One line per parameter, for error messages and logs.
  std::string describe(std::size_t max_lines = 16) const;

 private:
  std::vector<ParamInfo> params_;
  std::unordered_map<std::string, std::size_t> index_;  ///< name -> parameter index
  std::size_t unpadded_ = 0;
  std::size_t end_ = 0;  ///< end of the last parameter, before the final padding
  std::size_t padded_ = 0;
  int world_size_ = 0;
};

/// 64-bit FNV-1a, used for layout fingerprints and checksums of small records.
std::uint64_t fnv1a64(const void* data, std::size_t bytes, std::uint64_t seed = 1469598103934665603ull);

}  // namespace shardopt
