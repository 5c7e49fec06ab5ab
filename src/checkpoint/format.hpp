// format.hpp: the on-disk checkpoint format, as bytes: encoding (version 7) and validating
// decoding (versions 1 to 7) of the metadata file and of shard headers, the names of
// checkpoint directories, and bytes from checkpoint files made fit for messages. No files,
// no MPI: the fuzzer and the export tool use it alone. docs/checkpoint-format.md describes
// every field.
//
// Canonical coordinates: parameter i's element k is at canonical position
// sum_{j<i} numel_j + k (registration order, no padding). Format 2 stores state by canonical
// position, so nothing on disk depends on the saving world size, stage, flat layout or
// ownership (Flat's equal slices or Whole's ragged per-rank ranges).
// Format 1 stored flat ranges of the saving layout; its decoder derives the canonical
// ranges each shard holds, so readers work in canonical coordinates for both.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "shardopt/optimizer.hpp"
#include "shardopt/options.hpp"

namespace shardopt::ckpt {

inline constexpr std::uint32_t kFormatVersion = 7;  ///< written; versions 1..7 are read
inline constexpr std::size_t kMetaHeaderBytes = 32;
inline constexpr std::size_t kShardHeaderBytes = 64;
/// Formats 1-4: master, exp_avg, exp_avg_sq (fp32 each) for every element; an array the
/// element's rule does not keep (Lion's exp_avg_sq) is stored as zeros and ignored on load.
inline constexpr std::uint32_t kNumArrays = 3;

/// The arrays of a format-5/6/7 block, in file order. Each holds the entries of the block's
/// elements whose rule keeps it (rules/rules.hpp; piece_entries() says how many), in
/// canonical order: master every element (fp32), exp_avg those under AdamW, Lion and Muon
/// (fp32: AdamW's first moment, Lion's and Muon's momentum), exp_avg_sq those under AdamW
/// and Adafactor's unfactored parameters (fp32: the second moment, the variance), the
/// AdamW8bit elements' exp_avg and exp_avg_sq scales (fp32, one per 256-element quantization
/// block counted from the parameter's first element), format 7: Adafactor's factored
/// statistics (fp32, rows + cols per factored matrix: row_var then col_var, in the run
/// holding the matrix's first element), and the AdamW8bit codes (u8 per element). Formats
/// 1-4 hold the first three, every element each; formats 5 and 6 all but Factors (their
/// shard headers count 7 arrays).
enum class FileArray : std::uint32_t { Master, ExpAvg, ExpAvgSq, ScaleM, ScaleV, Factors, CodeM, CodeV };
inline constexpr std::uint32_t kNumFileArrays = 8;
/// The arrays before the codes hold fp32 entries, the codes one byte each.
constexpr bool is_fp32(FileArray a) { return a < FileArray::CodeM; }
/// The arrays a shard header of format `version` (>= 5) counts.
constexpr std::uint32_t file_arrays_in(std::uint32_t version) { return version >= 7 ? 8 : 7; }
/// The quantization block of AdamW8bit state (rules/qmap.hpp's kBlock).
inline constexpr std::uint64_t kQuantBlock = 256;
/// Format 2: the most elements in one block (the unit of reading and checksumming: 3 MiB of
/// state), so a reader needing part of a shard reads at most one block more per boundary.
inline constexpr std::uint64_t kBlockElems = std::uint64_t{1} << 18;
/// Limits applied before any allocation from a header field.
inline constexpr std::size_t kMaxMetadataBytes = std::size_t{1} << 28;  // 256 MiB
inline constexpr std::size_t kMaxNameBytes = 4096;
inline constexpr std::uint64_t kMaxElements = std::uint64_t{1} << 52;  ///< canonical size bound

struct MetaParam {
  std::string name;
  std::uint64_t numel = 0;
  std::uint32_t group = 0;
  std::uint64_t offset = 0;  ///< format 1 only: flat offset in the saving layout
  /// Format 6: the 2-D shape it was registered with (ParamInfo::rows x cols; 1 x numel
  /// without one). 0 x 0: not recorded (formats 1-5; encoded as 1 x numel).
  std::uint64_t rows = 0;
  std::uint64_t cols = 0;
};

/// The first format version that stores the state of `rule` (its rule options included:
/// AdamW 1, Lion 4, AdamW8bit 5, Muon 6, Adafactor 7). A decoder refuses a group whose rule
/// its file's version cannot hold; a new rule gets its version here.
std::uint32_t first_format_with(Rule rule);

/// Format 2: canonical elements [begin, begin + count) of one shard file, stored as the
/// master, exp_avg and exp_avg_sq values of that range back to back (12 * count bytes);
/// format 5: its FileArray arrays back to back (block_bytes()). A format-5 block boundary
/// inside an AdamW8bit parameter is a multiple of 256 elements from the parameter's start.
struct Block {
  std::uint64_t begin = 0;
  std::uint64_t count = 0;
  std::uint32_t crc = 0;          ///< CRC-32C of the block's bytes
  std::uint64_t file_offset = 0;  ///< derived on decode: where the block starts in its file
};

/// One shard file.
struct MetaShard {
  std::uint64_t file_bytes = 0;
  std::vector<Block> blocks;  ///< format 2: ascending, disjoint canonical ranges
  // Format 1 only: the file holds the flat range [flat_begin, flat_end) of the saving
  // layout, padding included, and `crc` is the CRC-32C of the whole file.
  std::uint64_t flat_begin = 0;
  std::uint64_t flat_end = 0;
  std::uint32_t crc = 0;
};

struct Metadata {
  std::uint32_t version = kFormatVersion;
  /// Format 3: the checkpoint's sequence number, the K of its directory ckpt-K and of the
  /// LATEST that published it. 0 in formats 1 and 2, which did not record it.
  std::uint64_t sequence = 0;
  std::int64_t step_count = 0;
  std::uint32_t world_size = 0;  ///< ranks at save time = number of shard files
  Stage stage = Stage::Zero1;
  DType param_dtype = DType::BF16;
  AdamConfig adam;
  LossScaling loss_scaling;
  LossScaleState loss_state;
  /// Format 5 also records adamw8bit.min_8bit_numel; format 6 the options of a Muon group
  /// (MuonConfig; other rules' options records are empty).
  std::vector<GroupOptions> groups;
  /// Format 5: the FNV-1a checksums of the signed and unsigned quantization maps the
  /// AdamW8bit codes index (rules/qmap.hpp), written whatever the rules.
  bool has_qmap_checksums = false;
  std::uint64_t qmap_checksum[2] = {0, 0};
  std::vector<MetaParam> params;
  std::uint64_t padded_size = 0;  ///< format 1 only
  std::vector<MetaShard> shards;
  std::uint32_t body_crc = 0;  ///< derived on decode: identifies the checkpoint's contents
};

/// Canonical position of each parameter's first element (size: params + 1; the last entry
/// is the canonical size).
std::vector<std::uint64_t> canonical_offsets(const Metadata& m);

/// The rule parameter i's state is kept under (its group's rule and min_8bit_numel).
Rule param_rule(const Metadata& m, std::size_t i);

/// A stored run of one parameter inside a block: canonical [begin, begin + count).
struct BlockPiece {
  std::size_t param = 0;
  std::uint64_t begin = 0;
  std::uint64_t count = 0;
  Rule rule = Rule::AdamW;
  bool first = false;  ///< the run starts at the parameter's first element
  /// Quantization blocks of the run (AdamW8bit only; the run starts on one).
  std::uint64_t quant_blocks() const { return rule == Rule::AdamW8bit ? (count + kQuantBlock - 1) / kQuantBlock : 0; }
};
/// The pieces of canonical range [begin, begin + count), in order (`canonical`:
/// canonical_offsets(m)).
std::vector<BlockPiece> block_pieces(const Metadata& m, const std::vector<std::uint64_t>& canonical,
                                     std::uint64_t begin, std::uint64_t count);
/// Entries of each FileArray that the stored run `p` has: the one place that says what a
/// rule's state looks like on disk (the writer, the decoder's block sizes and the reader all
/// ask it). Per element (master; exp_avg for AdamW, Lion, Muon; exp_avg_sq for AdamW and
/// Adafactor's unfactored parameters; AdamW8bit's codes), per 256-element quantization block
/// (AdamW8bit's scales), per parameter (Adafactor's factored matrices: rows + cols Factors
/// entries, from MetaParam::rows/cols, in the run holding the matrix's first element: the
/// rule needs Whole ownership, where one rank saves every run of a matrix and a loading rank
/// holds all of it); formats 1-4: master, exp_avg, exp_avg_sq for every element.
std::array<std::uint64_t, kNumFileArrays> piece_entries(const Metadata& m, const BlockPiece& p);
/// Entries of each FileArray in a block made of `pieces`: the sum of their piece_entries().
std::array<std::uint64_t, kNumFileArrays> block_entries(const Metadata& m,
                                                        std::span<const BlockPiece> pieces);
/// Bytes of a block with those entries.
std::uint64_t block_bytes(const std::array<std::uint64_t, kNumFileArrays>& entries);

/// The canonical ranges shard `index` holds, ascending: its blocks (format 2) or the parts
/// of parameters inside its flat range (format 1).
std::vector<Range> shard_extents(const Metadata& m, std::size_t index);

/// Hash of the parameter table (names, sizes, groups; format 1 also offsets and padded
/// size): ties shards to metadata.
std::uint64_t layout_hash(const Metadata& m);

/// Encodes `m` in the current format (m.version is ignored).
std::vector<unsigned char> encode_metadata(const Metadata& m);
/// Parses and validates a whole metadata file, formats 1 to 6. Throws Error(CorruptData) for
/// anything inconsistent (truncation, checksum, bounds, shards that do not cover every
/// element exactly once) and Error(Unsupported) for a newer format version. Never allocates
/// more than the input's size implies.
Metadata decode_metadata(std::span<const unsigned char> file);

struct ShardHeader {
  std::uint32_t version = kFormatVersion;
  std::uint32_t rank = 0;
  std::uint32_t world_size = 0;
  std::uint64_t layout_hash = 0;
  // Format 2: the number of elements and blocks, and a hash of the block table's ranges.
  std::uint64_t elements = 0;
  std::uint64_t blocks = 0;
  std::uint32_t table_hash = 0;
  // Format 1: the flat range of the saving layout.
  std::uint64_t flat_begin = 0;
  std::uint64_t flat_end = 0;
};

/// The header shard `index` of `m` has (current format; needs m.params and the shard's
/// blocks' ranges, not their checksums).
ShardHeader shard_header(const Metadata& m, std::size_t index);
std::array<unsigned char, kShardHeaderBytes> encode_shard_header(const ShardHeader& h);
/// Validates the header's own fields and checksum (Error(CorruptData) / Error(Unsupported)),
/// formats 1 to 6.
ShardHeader decode_shard_header(std::span<const unsigned char> bytes);
/// Checks that header `h` is shard `index` of `m` (Error(CorruptData) otherwise).
void check_shard_matches(const ShardHeader& h, const Metadata& m, std::size_t index);

/// The LATEST file's contents for checkpoint directory `name`: the name and its CRC-32C.
std::string encode_latest(const std::string& name);
/// The directory name a LATEST file holds, its checksum verified (Error(CorruptData)).
/// Format 1 wrote a bare name without checksum: then `legacy` is set and the caller must
/// cross-check the name.
std::string decode_latest(std::span<const unsigned char> bytes, bool& legacy);

/// File names inside a checkpoint directory.
std::string shard_file_name(std::size_t rank);
inline constexpr const char* kMetadataFile = "metadata.bin";
inline constexpr const char* kLatestFile = "LATEST";
/// Created in a checkpoint directory once LATEST names it (format 3 saves): a LATEST that
/// names an older checkpoint than one marked so was replaced or restored.
inline constexpr const char* kPublishedFile = "PUBLISHED";
/// In a save directory: the lock a saving job holds (flock) while its optimizer lives.
inline constexpr const char* kLockFile = ".shardopt.lock";

/// Published checkpoint directories are named ckpt-K, K a sequence number of 8 or more
/// digits (ckpt-00000007). The K of such a name, or 0 for any other name.
std::uint64_t checkpoint_sequence(std::string_view name);
/// The directory name of checkpoint K (K >= 1).
std::string checkpoint_name(std::uint64_t sequence);

// ---- bytes from files in messages -----------------------------------------------------------

/// Is `s` well-formed UTF-8 (no overlong forms, surrogates or code points above U+10FFFF)?
bool valid_utf8(std::string_view s);
/// `s` fit to quote in a message or a listing: control characters, DEL, backslashes and
/// bytes that are not well-formed UTF-8 as \xNN (so "\n" shows as \x0A and a NUL does
/// not end the text), cut after `max_bytes` bytes of `s` with "... (N bytes)".
std::string printable(std::string_view s, std::size_t max_bytes = std::string_view::npos);

}  // namespace shardopt::ckpt
