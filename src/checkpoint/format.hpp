// format.hpp: the on-disk checkpoint format (version 1), as bytes: encoding and validating
// decoding of the metadata file and of shard headers. No files, no MPI: the fuzzer and the
// export tool use it alone. docs/checkpoint-format.md describes every field.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "shardopt/optimizer.hpp"
#include "shardopt/options.hpp"

namespace shardopt::ckpt {

inline constexpr std::uint32_t kFormatVersion = 1;
inline constexpr std::size_t kMetaHeaderBytes = 32;
inline constexpr std::size_t kShardHeaderBytes = 64;
inline constexpr std::uint32_t kNumArrays = 3;  ///< master, exp_avg, exp_avg_sq (fp32 each)
/// Limits applied before any allocation from a header field.
inline constexpr std::size_t kMaxMetadataBytes = std::size_t{1} << 28;  // 256 MiB
inline constexpr std::size_t kMaxNameBytes = 4096;

struct MetaParam {
  std::string name;
  std::uint64_t numel = 0;
  std::uint32_t group = 0;
  std::uint64_t offset = 0;  ///< flat offset in the saving layout
};

/// One shard file: the arrays over [flat_begin, flat_end) of the saving layout.
struct MetaShard {
  std::uint64_t flat_begin = 0;
  std::uint64_t flat_end = 0;
  std::uint64_t file_bytes = 0;
  std::uint32_t crc = 0;  ///< CRC-32C of the whole file, header included
};

struct Metadata {
  std::uint32_t version = kFormatVersion;
  std::int64_t step_count = 0;
  std::uint32_t world_size = 0;  ///< ranks at save time = number of shard files
  Stage stage = Stage::Zero1;
  DType param_dtype = DType::BF16;
  AdamConfig adam;
  LossScaling loss_scaling;
  LossScaleState loss_state;
  std::vector<GroupOptions> groups;
  std::vector<MetaParam> params;
  std::uint64_t padded_size = 0;
  std::vector<MetaShard> shards;
};

/// Hash of the parameter table (names, sizes, groups, offsets): ties shards to metadata.
std::uint64_t layout_hash(const Metadata& m);

std::vector<unsigned char> encode_metadata(const Metadata& m);
/// Parses and validates a whole metadata file. Throws Error(CorruptData) for anything
/// inconsistent (truncation, checksum, bounds, impossible layout) and Error(Unsupported) for
/// a newer format version. Never allocates more than the input's size implies.
Metadata decode_metadata(std::span<const unsigned char> file);

struct ShardHeader {
  std::uint32_t version = kFormatVersion;
  std::uint32_t rank = 0;
  std::uint32_t world_size = 0;
  std::uint64_t flat_begin = 0;
  std::uint64_t flat_end = 0;
  std::uint64_t layout_hash = 0;
};

std::array<unsigned char, kShardHeaderBytes> encode_shard_header(const ShardHeader& h);
/// Validates the header's own fields and checksum (Error(CorruptData) / Error(Unsupported)).
ShardHeader decode_shard_header(std::span<const unsigned char> bytes);
/// Checks that header `h` is shard `index` of `m` (Error(CorruptData) otherwise).
void check_shard_matches(const ShardHeader& h, const Metadata& m, std::size_t index);

/// File names inside a checkpoint directory.
std::string shard_file_name(std::size_t rank);
inline constexpr const char* kMetadataFile = "metadata.bin";
inline constexpr const char* kLatestFile = "LATEST";

}  // namespace shardopt::ckpt
