// layout.hpp: the flat, padded buffer that holds every parameter, its buckets, and which
// slice of every bucket each rank owns.
//
// Parameters are registered in the trainer's (forward) order and laid out back to back in
// the flat buffer, each starting at a multiple of kAlignElems elements so that every
// per-parameter view is aligned for vector loads (64 elements = 256 B of fp32, 128 B of
// bf16). The flat buffer is cut into buckets: the unit of every collective. A bucket starts
// at a multiple of N x 64 elements (N ranks) and its length is a multiple of N x 64, so it
// splits into N equal, aligned slices; rank r owns the r-th slice of every bucket (the
// distributed-optimizer layout of Megatron-LM). Buckets are numbered in backward order:
// bucket 0 holds the last parameters, whose gradients backward produces first.
//
// Buckets close at a parameter boundary (padded up to N x 64) when the next parameter does
// not fit; a parameter larger than the remaining room of a bucket *and* larger than a whole
// bucket is cut at multiples of N x 64 instead, so it spans several buckets with no padding
// inside it. Each parameter is therefore one contiguous range of the flat buffer.
//
// Units (stage 3's unit of parameter gathering, typically one layer) are runs of
// consecutively registered parameters. A bucket never straddles units: a unit boundary
// closes the open bucket (padded up to N x 64), so a unit is a whole number of buckets and
// one contiguous range of the flat buffer. A layout without units is one unit (unit 0).
//
// Coordinates (all half-open Ranges):
//   flat     position in the flat buffer (the replica, the full gradient buffer)
//   bucket   the bucket's own range of the flat buffer; slice(b, r) is rank r's part of it
//   local    position in a rank's own arrays (master, m, v, the sharded gradient): the
//            concatenation of its slices in flat order; bucket b's slice starts at
//            local_begin = flat.begin / N on every rank
//   param    position inside one parameter (0 .. numel)
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "shardopt/dtype.hpp"
#include "shardopt/ownership.hpp"
#include "shardopt/range.hpp"

namespace shardopt {

struct ParamInfo {
  std::string name;
  std::size_t numel = 0;
  int group = 0;
  int unit = 0;   ///< the unit it belongs to (units are contiguous in registration order)
  Range flat;     ///< where the parameter lives in the flat buffer (valid once built)
  Range buckets;  ///< indices of the buckets it has elements in (valid once built)
  /// Its 2-D shape (rows x cols == numel; 1 x numel when registered without one). Only the
  /// owner rule of whole-tensor ownership reads it (Newton-Schulz cost, ownership.hpp).
  std::size_t rows = 1;
  std::size_t cols = 0;
};

/// An optional 2-D shape for FlatLayout::add: rows x cols (in the trainer's storage order,
/// e.g. torch's (out_features, in_features)). {0, 0}: none, the parameter is 1 x numel.
struct Shape2D {
  std::size_t rows = 0;
  std::size_t cols = 0;
};

/// The piece of one parameter that falls inside one range (a rank's slice of a bucket).
struct ShardPiece {
  std::size_t param = 0;  ///< parameter index
  Range flat;             ///< in the flat buffer
  Range local;            ///< in the owning rank's local arrays (see the coordinates above)
  Range in_param;         ///< relative to the start of the parameter
};

/// One bucket: a range of the flat buffer every rank owns an equal slice of.
struct Bucket {
  Range flat;                   ///< starts at a multiple of N x 64; length a multiple of N x 64
  std::size_t first_param = 0;  ///< lowest index of a parameter with elements in the bucket
  std::size_t end_param = 0;    ///< one past the highest
  std::size_t slice_elems = 0;  ///< flat.size() / N: every rank's share
  std::size_t local_begin = 0;  ///< flat.begin / N: where the slice sits in the local arrays

  /// Whole ownership (FlatLayout::apply_owners): per rank, its range's elements, where it
  /// starts (from flat.begin) and where it sits in that rank's local arrays. Empty for a Flat
  /// layout (and a Whole one before apply_owners): equal slices, slice_elems / local_begin.
  std::vector<std::size_t> counts, offsets, local_begins;
  bool equal_cut = true;  ///< every rank's count is slice_elems (the equal collectives apply)

  bool ragged() const { return !counts.empty(); }
  /// Rank r's slice (its range), in flat coordinates.
  Range slice(int rank) const {
    if (ragged()) {
      const std::size_t r = static_cast<std::size_t>(rank);
      return {flat.begin + offsets[r], flat.begin + offsets[r] + counts[r]};
    }
    const std::size_t b = flat.begin + static_cast<std::size_t>(rank) * slice_elems;
    return {b, b + slice_elems};
  }
  /// Rank r's elements of the bucket.
  std::size_t slice_size(int rank) const {
    return ragged() ? counts[static_cast<std::size_t>(rank)] : slice_elems;
  }
  /// Where rank r's slice sits in rank r's local arrays.
  std::size_t local_begin_of(int rank) const {
    return ragged() ? local_begins[static_cast<std::size_t>(rank)] : local_begin;
  }
  /// The slice's place in rank r's local arrays.
  Range local(int rank) const {
    const std::size_t b = local_begin_of(rank);
    return {b, b + slice_size(rank)};
  }
  /// The largest rank's elements (slice_elems when equal).
  std::size_t max_slice() const;
  /// The slice's place in every rank's local arrays (Flat layouts).
  Range local() const { return {local_begin, local_begin + slice_elems}; }
  std::size_t num_params() const { return end_param - first_param; }
};

/// One unit: consecutive parameters whose buckets it alone fills.
struct Unit {
  Range params;   ///< parameter indices
  Range buckets;  ///< bucket indices (backward order: buckets.begin holds its last parameters)
  Range flat;     ///< its range of the flat buffer: the union of its buckets
};

class FlatLayout {
 public:
  static constexpr std::size_t kAlignElems = 64;
  /// The alignment when some parameter keeps 8-bit block-quantized state (AdamW8bit): every
  /// 256-element quantization block, counted from its parameter's first element, then lies
  /// inside one rank's slice (build()'s `align`).
  static constexpr std::size_t kQuantBlockElems = 256;

  /// Rounds n up to a multiple of `multiple` (multiple > 0).
  static constexpr std::size_t round_up(std::size_t n, std::size_t multiple) {
    return (n + multiple - 1) / multiple * multiple;
  }
  /// Where a parameter starts: the next multiple of kAlignElems (aligned vector loads).
  static constexpr std::size_t param_start(std::size_t end_of_previous,
                                           std::size_t align = kAlignElems) {
    return round_up(end_of_previous, align);
  }
  /// The granule of bucket boundaries for `world_size` ranks: N x 64 elements, so every
  /// rank's slice of a bucket is equal and starts aligned.
  static constexpr std::size_t bucket_quantum(int world_size, std::size_t align = kAlignElems) {
    return align * static_cast<std::size_t>(world_size);
  }
  /// Automatic bucket size (bucket_elems 0): an eighth of the model, at least 4096 and at most
  /// `max_elems` elements: 2^20 on the CPU, 2^24 on a GPU (kMaxAutoBucketElemsDevice). Stage 2
  /// holds buckets_in_flight (default 2) staging buckets instead of a full gradient: with 8 or
  /// more buckets that is at most a quarter of it, where one bucket holding the whole model
  /// saves nothing; 4096 fp32 elements (16 KiB) keeps a small model's collectives few; CPU
  /// models above 8 Mi elements get 2^20, the fixed default of earlier releases. A GPU pays
  /// about 6.2 us of launches and copies per bucket and step beyond the kernels' own time
  /// (measured on an H200: a 1 Gi-parameter step took 18.2 ms in 1024 buckets, 10.3 ms in 64,
  /// against 7.7 ms for the update kernel alone; docs/performance.md), hence the larger cap.
  /// The same at every stage and rank count, so stages share one layout.
  static constexpr std::size_t kAutoBuckets = 8;
  static constexpr std::size_t kMinAutoBucketElems = 4096;
  static constexpr std::size_t kMaxAutoBucketElems = std::size_t{1} << 20;
  static constexpr std::size_t kMaxAutoBucketElemsDevice = std::size_t{1} << 24;
  static constexpr std::size_t auto_bucket_elems(std::size_t model_elems,
                                                 std::size_t max_elems = kMaxAutoBucketElems) {
    const std::size_t eighth = (model_elems + kAutoBuckets - 1) / kAutoBuckets;
    return eighth < kMinAutoBucketElems ? kMinAutoBucketElems
           : eighth > max_elems         ? max_elems
                                        : eighth;
  }
  /// The capacity of every bucket: bucket_elems rounded up to the quantum.
  static constexpr std::size_t bucket_capacity(std::size_t bucket_elems, int world_size,
                                               std::size_t align = kAlignElems) {
    return round_up(bucket_elems == 0 ? 1 : bucket_elems, bucket_quantum(world_size, align));
  }

  /// Registers a parameter in `unit`; throws Error(InvalidArgument) for an empty or duplicate
  /// name, a zero size, or a unit other than the last parameter's unit or the next one
  /// (units are contiguous, numbered from 0). Offsets are assigned by build(). `shape`, when
  /// given, is the parameter's 2-D shape: rows x cols must equal numel (InvalidArgument
  /// otherwise); without it the parameter is 1 x numel. The shape enters the fingerprint only
  /// of a Whole layout (set_ownership), so Flat layouts and their checkpoints are unchanged.
  std::size_t add(std::string_view name, std::size_t numel, int group, int unit = 0,
                  Shape2D shape = {});

  /// Whole-tensor ownership (ownership.hpp): marks the layout as one whose buckets are cut by
  /// an OwnerPlan (assign_owners) rather than into equal slices. build() forms the same
  /// buckets either way, except that in a Whole layout a parameter larger than a bucket gets
  /// buckets of its own (its first piece opens one, its last piece closes one), so that every
  /// piece of it is cut in equal slices and no ragged bucket holds a piece pinned to one rank
  /// (Bucket::slice() and owner_of() describe the equal cut until apply_owners); the mark adds
  /// the ownership and every parameter's shape to the fingerprint. Before build() only
  /// (InvalidState after).
  void set_ownership(Ownership ownership);
  Ownership ownership() const { return ownership_; }
  /// Whole ownership, after build(): cuts every bucket as `plan` (assign_owners of this
  /// layout) says. Parameters move to plan.flat (their place inside their bucket, ordered by
  /// owner); Bucket::slice(r), local_begin_of(r), shard_size(r), owner_of, pieces_in and
  /// owned_pieces then describe the ragged ranges. InvalidState unless built Whole and not
  /// applied yet; InvalidArgument for a plan of another layout.
  void apply_owners(const OwnerPlan& plan);
  /// True once apply_owners ran.
  bool owners_applied() const { return !shard_sizes_.empty(); }
  /// Whole, applied: parameter i's owner (kAllRanks: spanning); Flat: kAllRanks.
  int param_owner(std::size_t i) const {
    return owners_.empty() ? kAllRanks : owners_[i];
  }

  /// Places the parameters and cuts the buckets for `world_size` ranks and buckets of about
  /// `bucket_elems` elements (0: auto_bucket_elems of the registered elements, at most
  /// `max_auto_elems`; bucket_elems() tells the size used). Further add() calls throw.
  /// `align` (kAlignElems or kQuantBlockElems) replaces 64 in the rules above: parameters
  /// start at its multiples, buckets at multiples of N x align.
  void build(int world_size, std::size_t bucket_elems,
             std::size_t max_auto_elems = kMaxAutoBucketElems, std::size_t align = kAlignElems);

  bool built() const { return world_size_ > 0; }
  int world_size() const { return world_size_; }
  std::size_t num_params() const { return params_.size(); }
  const ParamInfo& param(std::size_t i) const;
  const std::vector<ParamInfo>& params() const { return params_; }
  /// Index of the parameter called `name`, or num_params() if there is none.
  std::size_t find(std::string_view name) const;

  std::size_t unpadded_size() const { return unpadded_; }  ///< sum of parameter sizes
  std::size_t padded_size() const { return padded_; }      ///< length of the flat buffer
  /// Elements every rank owns: padded_size() / N, the length of its local arrays (Flat; for
  /// a Whole layout with owners applied: the largest rank's, see shard_size(rank)).
  std::size_t shard_size() const {
    return shard_sizes_.empty() ? padded_ / static_cast<std::size_t>(world_size_)
                                : *std::max_element(shard_sizes_.begin(), shard_sizes_.end());
  }
  /// Elements rank r owns: the length of its local arrays.
  std::size_t shard_size(int rank) const {
    return shard_sizes_.empty() ? padded_ / static_cast<std::size_t>(world_size_)
                                : shard_sizes_[static_cast<std::size_t>(rank)];
  }
  /// The bucket_elems the layout was built with, and the capacity of every bucket.
  std::size_t bucket_elems() const { return bucket_elems_; }
  std::size_t bucket_capacity() const { return capacity_; }
  /// The alignment the layout was built with (kAlignElems or kQuantBlockElems).
  std::size_t align_elems() const { return align_; }

  /// Units: 1 + the last parameter's unit (valid once built; 1 for a layout without units).
  std::size_t num_units() const { return units_.size(); }
  const Unit& unit(std::size_t u) const { return units_[u]; }
  const std::vector<Unit>& units() const { return units_; }
  /// The largest unit's flat size: a gathered unit's buffer.
  std::size_t max_unit_elems() const;

  std::size_t num_buckets() const { return buckets_.size(); }
  const Bucket& bucket(std::size_t b) const { return buckets_[b]; }
  /// In backward order (bucket 0 at the end of the flat buffer).
  const std::vector<Bucket>& buckets() const { return buckets_; }
  /// The bucket holding flat element x (x < padded_size()).
  std::size_t bucket_at(std::size_t flat) const;
  /// The rank that owns flat element x.
  int owner_of(std::size_t flat) const;

  /// The pieces of parameters inside `window` (flat), in flat order (padding excluded);
  /// local ranges are relative to window.begin.
  std::vector<ShardPiece> pieces_in(Range window) const;
  /// Every piece rank r owns (its slices of all buckets), in local order, with local ranges
  /// in its local arrays.
  std::vector<ShardPiece> owned_pieces(int rank) const;

  /// A hash of everything that must agree between ranks (names, sizes, groups, units, order,
  /// world size, bucket size; for a Whole layout also the ownership and the shapes).
  std::uint64_t fingerprint() const;
  /// One line per parameter, for error messages and logs.
  std::string describe(std::size_t max_lines = 16) const;

 private:
  std::vector<ParamInfo> params_;
  std::unordered_map<std::string, std::size_t> index_;  ///< name -> parameter index
  std::vector<Bucket> buckets_;
  std::vector<Unit> units_;
  std::size_t unpadded_ = 0;
  std::size_t padded_ = 0;
  std::size_t bucket_elems_ = 0;
  std::size_t capacity_ = 0;
  std::size_t align_ = kAlignElems;
  int world_size_ = 0;
  Ownership ownership_ = Ownership::Flat;
  // Whole ownership, applied (apply_owners); empty otherwise.
  std::vector<std::size_t> shard_sizes_;  ///< per rank
  std::vector<int> owners_;               ///< per parameter
  std::vector<std::size_t> by_flat_;      ///< parameter indices in flat order
};

/// 64-bit FNV-1a, used for layout fingerprints and checksums of small records.
std::uint64_t fnv1a64(const void* data, std::size_t bytes, std::uint64_t seed = 1469598103934665603ull);

}  // namespace shardopt
