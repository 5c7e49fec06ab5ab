// checkpoint.cpp: save_checkpoint() and load_checkpoint(): the optimizer glue around the
// format (format.hpp), the files (files.hpp) and the reader (reader.hpp).
#include "shardopt/checkpoint.hpp"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "crc32c.hpp"
#include "files.hpp"
#include "format.hpp"
#include "pieces.hpp"
#include "reader.hpp"
#include "rules/qmap.hpp"
#include "rules/rules.hpp"

namespace shardopt {

namespace fs = std::filesystem;
using namespace ckpt;

// ---- the layout's one entry point -------------------------------------------------------------

std::vector<ShardPiece> ckpt::owned_pieces(const ShardedOptimizer& opt, PieceSet which) {
  // Every rank saves its slice of every bucket (data-parallel ranks hold everything but save
  // the same share), and holds what its local arrays cover.
  return which == PieceSet::Written ? opt.saved_pieces() : opt.local_pieces();
}

std::size_t ckpt::owned_state_elems(const ShardedOptimizer& opt) { return opt.local_size(); }

namespace {

constexpr const char* kTmpPrefix = ".tmp-";

std::vector<std::pair<std::uint64_t, fs::path>> published(const fs::path& dir) {
  std::vector<std::pair<std::uint64_t, fs::path>> out;
  for (const fs::directory_entry& e : fs::directory_iterator(dir))
    if (const std::uint64_t s = checkpoint_sequence(e.path().filename().string()); s > 0 && e.is_directory())
      out.emplace_back(s, e.path());
  std::sort(out.begin(), out.end());
  return out;
}

// The save directories an optimizer holds locked (its checkpoint_state()), by canonical path;
// a null lock where the file system cannot lock (warned about once).
struct SaveLocks {
  std::map<fs::path, std::unique_ptr<FileLock>> held;
};

// Rank 0: locks the save directory `dir` for this optimizer, from its first save into it
// until the optimizer is destroyed, so that a second job saving into the same directory is
// refused at once instead of failing later in the middle of its own (or the first job's)
// save. The lock dies with the process: a killed job leaves nothing that blocks.
void lock_save_directory(ShardedOptimizer& opt, const fs::path& dir) {
  std::shared_ptr<void>& state = opt.checkpoint_state();
  if (!state) state = std::make_shared<SaveLocks>();
  SaveLocks& locks = *std::static_pointer_cast<SaveLocks>(state);
  const fs::path key = fs::canonical(dir);
  if (locks.held.count(key) != 0) return;
  char host[256] = {};
  if (::gethostname(host, sizeof host - 1) != 0) std::strcpy(host, "?");
  const std::string note = "host " + std::string(host) + " pid " + std::to_string(::getpid()) + "\n";
  const fs::path file = key / kLockFile;
  std::string holder;
  std::unique_ptr<FileLock> lock;
  try {
    lock = FileLock::try_lock(file, note, &holder);
  } catch (const Error& e) {
    if (e.status() != Status::Unsupported) throw;
    std::fprintf(stderr, "shardopt: warning: save_checkpoint: %s; saving into '%s' without a "
                 "lock, so a second job saving there would not be refused\n",
                 e.what(), dir.c_str());
    locks.held.emplace(key, nullptr);
    return;
  }
  if (!lock) {
    while (!holder.empty() && (holder.back() == '\n' || holder.back() == ' ')) holder.pop_back();
    throw Error(Status::Io,
                "save_checkpoint: '" + dir.string() + "' is in use: another job saves into it (" +
                    (holder.empty() ? std::string("its host and pid not written yet")
                                    : printable(holder, 160)) +
                    ", holding the lock " + file.string() +
                    "). Give each job a save directory of its own, or end the other job first");
  }
  locks.held.emplace(key, std::move(lock));
}

// Rank 0, before a save: creates the save directory durably, locks it for this optimizer,
// removes what killed saves left (never referenced by LATEST) and returns the name of the
// next checkpoint.
std::string prepare_save_directory(ShardedOptimizer& opt, const fs::path& dir) {
  create_directories_durably(dir);
  lock_save_directory(opt, dir);  // before touching anything another job could be writing
  for (const fs::directory_entry& e : fs::directory_iterator(dir))
    if (e.path().filename().string().rfind(kTmpPrefix, 0) == 0) fs::remove_all(e.path());
  const auto existing = published(dir);
  const std::string name = checkpoint_name(existing.empty() ? 1 : existing.back().first + 1);
  fs::create_directory(dir / (kTmpPrefix + name));
  return name;
}

Metadata describe(ShardedOptimizer& opt) {
  Metadata m;
  const FlatLayout& l = opt.layout();
  m.step_count = opt.step_count();
  m.world_size = static_cast<std::uint32_t>(opt.comm().size());
  m.stage = opt.options().stage;
  m.param_dtype = opt.options().param_dtype;
  m.adam = opt.options().adam;
  m.loss_scaling = opt.options().loss_scaling;
  m.loss_state = opt.loss_scale_state();
  m.groups = opt.groups();
  for (const ParamInfo& p : l.params())
    m.params.push_back(MetaParam{p.name, p.numel, static_cast<std::uint32_t>(p.group), 0, p.rows,
                                 p.cols});
  m.shards.resize(m.world_size);
  return m;
}

// Where a run of a block's values lies in the state arrays.
struct Source {
  std::uint64_t canonical;
  std::size_t local;
  std::size_t count;
  Rule rule;
  std::size_t param;
  bool first;  // starts at the parameter's first element
  BlockPiece piece() const { return BlockPiece{param, canonical, count, rule, first}; }
};

struct PlannedBlock {
  Block block;
  std::vector<Source> sources;  // in canonical order, filling the block
};

// This rank's saved pieces as blocks: in canonical order, canonically adjacent pieces
// merged, at most kBlockElems elements each, cut inside an AdamW8bit parameter only between
// quantization blocks (its pieces start on one: the layout is aligned to 256 then).
std::vector<PlannedBlock> plan_blocks(const ShardedOptimizer& opt, const std::vector<std::uint64_t>& canonical) {
  std::vector<Source> sources;
  for (const ShardPiece& p : owned_pieces(opt, PieceSet::Written))
    if (!p.in_param.empty())
      sources.push_back(Source{canonical[p.param] + p.in_param.begin, p.local.begin,
                               p.in_param.size(), opt.rule_of(p.param), p.param,
                               p.in_param.begin == 0});
  std::sort(sources.begin(), sources.end(),
            [](const Source& a, const Source& b) { return a.canonical < b.canonical; });
  // How much of s fits in `room` elements.
  const auto fit = [](const Source& s, std::size_t room) {
    std::size_t take = std::min<std::size_t>(s.count, room);
    if (s.rule == Rule::AdamW8bit && take < s.count) take -= take % kQuantBlock;
    return take;
  };
  std::vector<PlannedBlock> blocks;
  for (Source s : sources) {
    while (s.count > 0) {
      std::size_t take = 0;
      if (!blocks.empty() && blocks.back().block.begin + blocks.back().block.count == s.canonical)
        take = fit(s, static_cast<std::size_t>(kBlockElems - blocks.back().block.count));
      if (take == 0) {
        blocks.push_back(PlannedBlock{Block{s.canonical, 0, 0, 0}, {}});
        take = fit(s, static_cast<std::size_t>(kBlockElems));
      }
      Block& b = blocks.back().block;
      blocks.back().sources.push_back(Source{s.canonical, s.local, take, s.rule, s.param, s.first});
      s.first = false;
      b.count += take;
      s.canonical += take;
      s.local += take;
      s.count -= take;
    }
  }
  return blocks;
}

// Writes this rank's shard file: a header, then per block its arrays (format.hpp: FileArray)
// over its canonical range. Returns the blocks with their checksums.
std::vector<Block> write_shard(ShardedOptimizer& opt, Metadata& m, const fs::path& tmp_dir) {
  const std::size_t rank = static_cast<std::size_t>(opt.comm().rank());
  std::vector<PlannedBlock> plan = plan_blocks(opt, canonical_offsets(m));
  std::vector<Block>& blocks = m.shards[rank].blocks;
  for (const PlannedBlock& p : plan) blocks.push_back(p.block);
  OutFile f(tmp_dir / shard_file_name(rank));
  const auto header = encode_shard_header(shard_header(m, rank));
  f.write(header.data(), header.size());
  if (plan.empty()) test_point("shard-partly-written");
  const std::size_t most = plan.empty() ? 0 : static_cast<std::size_t>(kBlockElems);
  std::vector<float> host(most), scales[2], factors;
  std::vector<std::uint8_t> codes[2];
  for (std::size_t k = 0; k < plan.size(); ++k) {
    const std::uint64_t start = f.bytes();
    std::uint32_t crc = 0;
    const auto put = [&](const void* data, std::size_t bytes) {
      if (bytes == 0) return;  // (an empty array's data() may be null)
      crc = crc32c_update(crc, data, bytes);
      f.write(data, bytes);
    };
    // The fp32 arrays (FileArray Master, ExpAvg, ExpAvgSq: StateArray's numbering): each
    // source whose rule stores the array (piece_entries; AdamW8bit: its master only).
    for (StateArray a : {StateArray::Master, StateArray::ExpAvg, StateArray::ExpAvgSq}) {
      std::size_t at = 0;
      for (const Source& s : plan[k].sources)
        if (piece_entries(m, s.piece())[static_cast<std::size_t>(a)] > 0) {
          opt.copy_state_to_host(a, s.local, std::span<float>(host.data() + at, s.count));
          at += s.count;
        }
      put(host.data(), at * sizeof(float));
      if (k == 0 && a == StateArray::Master) test_point("shard-partly-written");
    }
    // AdamW8bit's scales, then its codes.
    for (int x = 0; x < 2; ++x) {
      scales[x].clear();
      codes[x].clear();
    }
    for (const Source& s : plan[k].sources) {
      if (s.rule != Rule::AdamW8bit) continue;
      const std::size_t nb = (s.count + kQuantBlock - 1) / kQuantBlock;
      for (int x = 0; x < 2; ++x) {
        scales[x].resize(scales[x].size() + nb);
        codes[x].resize(codes[x].size() + s.count);
      }
      opt.copy_q8_state_to_host(s.local, s.count,
                                {codes[0].data() + codes[0].size() - s.count,
                                 codes[1].data() + codes[1].size() - s.count,
                                 scales[0].data() + scales[0].size() - nb,
                                 scales[1].data() + scales[1].size() - nb});
    }
    for (int x = 0; x < 2; ++x) put(scales[x].data(), scales[x].size() * sizeof(float));
    // Adafactor's factored matrices whose first element the block holds: row_var, col_var.
    factors.clear();
    for (const Source& s : plan[k].sources)
      if (const auto n = piece_entries(m, s.piece())[static_cast<std::size_t>(FileArray::Factors)]) {
        factors.resize(factors.size() + n);
        opt.copy_factors_to_host(s.param, std::span<float>(factors).last(n));
      }
    put(factors.data(), factors.size() * sizeof(float));
    for (int x = 0; x < 2; ++x) put(codes[x].data(), codes[x].size());
    blocks[k].crc = crc;
    blocks[k].file_offset = start;
  }
  f.close();
  return blocks;
}

// Gathers every rank's block table into m.shards (their sizes differ: padded to the largest).
void gather_block_tables(Communicator& comm, Metadata& m, const std::vector<Block>& mine) {
  const std::uint64_t count = mine.size();
  std::vector<std::uint64_t> counts(static_cast<std::size_t>(comm.size()));
  comm.all_gather_bytes(&count, counts.data(), sizeof count);
  const std::size_t most = static_cast<std::size_t>(*std::max_element(counts.begin(), counts.end()));
  if (most == 0) return;
  const std::vector<std::uint64_t> canonical = canonical_offsets(m);
  std::vector<Block> send(most), all(most * counts.size());
  std::copy(mine.begin(), mine.end(), send.begin());
  comm.all_gather_bytes(send.data(), all.data(), most * sizeof(Block));
  for (std::size_t r = 0; r < counts.size(); ++r) {
    MetaShard& s = m.shards[r];
    s.blocks.assign(all.begin() + static_cast<std::ptrdiff_t>(r * most),
                    all.begin() + static_cast<std::ptrdiff_t>(r * most + counts[r]));
    s.file_bytes = kShardHeaderBytes;
    for (const Block& b : s.blocks)
      s.file_bytes += block_bytes(block_entries(m, block_pieces(m, canonical, b.begin, b.count)));
  }
}

// Rank 0: metadata into the temporary directory, then publish (see the protocol in
// docs/checkpoint-format.md).
void publish(const Metadata& m, const fs::path& dir, const std::string& name) {
  const fs::path tmp = dir / (std::string(kTmpPrefix) + name);
  const std::vector<unsigned char> bytes = encode_metadata(m);
  OutFile meta(tmp / kMetadataFile);
  meta.write(bytes.data(), bytes.size());
  meta.close();
  sync_directory(tmp);
  test_point("metadata-written");
  rename_path(tmp, dir / name);
  sync_directory(dir);
  test_point("renamed");
  write_file_atomically(dir, kLatestFile, encode_latest(name));
  test_point("published");
}

// Rank 0, after the save is agreed: marks the new checkpoint published (a LATEST that names
// an older one is then refused on load), then removes published checkpoints beyond `keep`,
// oldest first, never `name`. Failures are warnings: the new checkpoint is already published.
void after_publish(const fs::path& dir, const std::string& name, int keep) {
  const auto warn = [&](const char* what, const std::exception& e) {
    std::fprintf(stderr, "shardopt: warning: save_checkpoint: %s/%s was saved, but %s: %s\n",
                 dir.c_str(), name.c_str(), what, e.what());
  };
  try {
    OutFile marker(dir / name / kPublishedFile);
    marker.close();
    sync_directory(dir / name);
  } catch (const std::exception& e) {
    warn("it could not be marked published", e);
  }
  try {
    auto all = published(dir);
    while (all.size() > static_cast<std::size_t>(keep)) {
      if (all.front().second.filename() != name) {
        test_point("pruning");
        fs::remove_all(all.front().second);
      }
      all.erase(all.begin());
    }
  } catch (const std::exception& e) {
    warn("an old checkpoint could not be removed", e);
  }
}

}  // namespace

fs::path save_checkpoint(ShardedOptimizer& opt, const fs::path& dir, const SaveOptions& options) {
  Communicator& comm = opt.comm();
  const int rank = comm.rank();
  collective(comm, "save_checkpoint", [&] {
    require(opt.finalized(), Status::InvalidState, "save_checkpoint: finalize() first");
    require(options.keep >= 1, Status::InvalidArgument, "save_checkpoint: keep must be >= 1");
  });

  // 1. Rank 0 prepares the directory and names the checkpoint; everyone learns the name.
  char name[32] = {};
  collective(comm, "save_checkpoint: prepare", [&] {
    if (rank != 0) return;
    const std::string n = prepare_save_directory(opt, dir);
    std::memcpy(name, n.c_str(), n.size() + 1);
  });
  comm.broadcast_bytes(name, sizeof name, 0);
  test_point("prepared");

  // 2. Every rank writes and flushes its shard; everyone learns every block table.
  Metadata m = describe(opt);
  m.sequence = checkpoint_sequence(name);
  std::vector<Block> mine;
  const LocalOutcome wrote = capture("save_checkpoint", [&] {
    mine = write_shard(opt, m, dir / (std::string(kTmpPrefix) + name));
  });
  test_point("shard-written");
  gather_block_tables(comm, m, mine);
  agree(comm, "save_checkpoint: write", wrote);

  // 3. Rank 0 writes the metadata and publishes atomically; then, the save being agreed,
  //    removes old checkpoints.
  collective(comm, "save_checkpoint: publish", [&] {
    if (rank == 0) publish(m, dir, name);
  });
  if (rank == 0) after_publish(dir, name, options.keep);
  return dir / name;
}

// ---- load -------------------------------------------------------------------------------------

namespace {

// Everything the optimizer fixes and a checkpoint must match (the world size and stage may
// differ). Throws Error(LayoutMismatch) naming the first difference.
void check_compatible(const Metadata& m, const ShardedOptimizer& opt) {
  auto mismatch = [](const std::string& what) {
    throw Error(Status::LayoutMismatch, "load_checkpoint: " + what);
  };
  if (m.param_dtype != opt.options().param_dtype)
    mismatch(std::string("the checkpoint's parameter dtype is ") + dtype_name(m.param_dtype) +
             ", the optimizer's is " + dtype_name(opt.options().param_dtype));
  const FlatLayout& l = opt.layout();
  if (m.params.size() != l.num_params())
    mismatch("the checkpoint has " + std::to_string(m.params.size()) +
             " parameters, the optimizer " + std::to_string(l.num_params()));
  if (m.groups.size() != opt.groups().size())
    mismatch("the checkpoint has " + std::to_string(m.groups.size()) +
             " parameter groups, the optimizer " + std::to_string(opt.groups().size()));
  for (std::size_t i = 0; i < m.params.size(); ++i) {
    const MetaParam& c = m.params[i];
    const ParamInfo& p = l.param(i);
    if (c.name != p.name || c.numel != p.numel || c.group != static_cast<std::uint32_t>(p.group))
      mismatch("parameter " + std::to_string(i) + " is '" + c.name + "' (" +
               std::to_string(c.numel) + " elements, group " + std::to_string(c.group) +
               ") in the checkpoint but '" + p.name + "' (" + std::to_string(p.numel) +
               " elements, group " + std::to_string(p.group) + ") in the optimizer");
  }
  // The state arrays are the rule's: a parameter whose rule changed cannot take them.
  bool any8 = false;
  for (std::size_t i = 0; i < m.params.size(); ++i) {
    const Rule saved = param_rule(m, i);
    const Rule now = opt.rule_of(i);
    any8 = any8 || now == Rule::AdamW8bit;
    if (saved != now)
      mismatch("parameter '" + l.param(i).name + "' (group " + std::to_string(m.params[i].group) +
               ") was saved under rule " + rule_name(saved) + ", the optimizer updates it with " +
               rule_name(now) + "; its optimizer state does not carry over (load with the saved "
               "rule and min_8bit_numel, or start that group's state fresh without this checkpoint)");
    // A matrix rule's state is laid out by the shape (Muon's momentum, row by row): a
    // transposed or reshaped registration would misread it.
    const ParamInfo& p = l.param(i);
    if (rules::needs_whole(now) && (m.params[i].rows != p.rows || m.params[i].cols != p.cols))
      mismatch("parameter '" + p.name + "' (rule " + rule_name(now) + ") was saved as a " +
               std::to_string(m.params[i].rows) + " x " + std::to_string(m.params[i].cols) +
               " matrix, the optimizer registers it as " + std::to_string(p.rows) + " x " +
               std::to_string(p.cols) + "; its " + rule_name(now) +
               " state does not carry over to another shape");
  }
  // 8-bit codes mean nothing under other maps.
  const std::uint64_t ours[2] = {rules::q8::map_checksum(rules::q8::signed_map()),
                                 rules::q8::map_checksum(rules::q8::unsigned_map())};
  if (any8 && (!m.has_qmap_checksums || m.qmap_checksum[0] != ours[0] || m.qmap_checksum[1] != ours[1])) {
    char buf[160];
    std::snprintf(buf, sizeof buf, "%016llx/%016llx, this shardopt's are %016llx/%016llx",
                  static_cast<unsigned long long>(m.qmap_checksum[0]),
                  static_cast<unsigned long long>(m.qmap_checksum[1]),
                  static_cast<unsigned long long>(ours[0]), static_cast<unsigned long long>(ours[1]));
    mismatch(std::string("the checkpoint's AdamW8bit codes index quantization maps with checksums ") +
             buf + ": its 8-bit state cannot be decoded here");
  }
}

// The loss-scaling state to restore under the optimizer's current loss-scaling options.
LossScaleState adapt_loss_state(LossScaleState s, const LossScaling& now) {
  if (!now.enabled) {
    s.scale = 1.0;
    s.good_steps = 0;
  } else if (s.scale == 1.0 && s.good_steps == 0 && now.initial_scale != 1.0) {
    s.scale = now.initial_scale;  // saved without loss scaling
  }
  if (now.enabled) s.scale = std::clamp(s.scale, now.min_scale, now.max_scale);
  return s;
}

// This rank's new state arrays, staged on the host: the fp32 arrays, and AdamW8bit's codes
// (per local element) and scales (per 256 local elements) when some parameter keeps them.
struct Staged {
  std::vector<float> arrays[kNumArrays];
  std::vector<std::uint8_t> codes[2];
  std::vector<float> scales[2];
  std::vector<Range> fp32_pieces;  ///< with 8-bit state: the local ranges of the other pieces
  /// Adafactor's factored matrices this rank holds: row_var then col_var, by parameter.
  std::map<std::size_t, std::vector<float>> factors;
};

// One held piece: its canonical range and where it goes in the state arrays.
struct Target {
  std::uint64_t begin;
  std::uint64_t end;
  std::size_t local;
};

Staged read_held_state(const fs::path& dir, const Metadata& m, const ShardedOptimizer& opt) {
  const std::vector<std::uint64_t> canonical = canonical_offsets(m);
  std::vector<Target> targets;
  std::vector<Range> fp32_ranges;
  bool any8 = false;
  Staged st;
  for (const ShardPiece& p : owned_pieces(opt, PieceSet::Held))
    if (!p.in_param.empty()) {
      const std::uint64_t at = canonical[p.param] + p.in_param.begin;
      targets.push_back(Target{at, at + p.in_param.size(), p.local.begin});
      const bool q8 = opt.rule_of(p.param) == Rule::AdamW8bit;
      any8 = any8 || q8;
      const ParamInfo& info = opt.layout().param(p.param);
      if (rules::factored(opt.rule_of(p.param), info.rows, info.cols)) st.factors[p.param];
      if (!q8) fp32_ranges.push_back(p.local);
    }
  std::sort(targets.begin(), targets.end(),
            [](const Target& a, const Target& b) { return a.begin < b.begin; });
  std::vector<Range> wanted;
  for (const Target& t : targets) {
    if (!wanted.empty() && wanted.back().end == t.begin)
      wanted.back().end = t.end;
    else
      wanted.push_back(Range{t.begin, t.end});
  }
  const std::size_t local = owned_state_elems(opt);
  for (auto& a : st.arrays) a.assign(local, 0.0f);  // padding stays zero
  if (any8) st.fp32_pieces = std::move(fp32_ranges);
  // Padding in an 8-bit block holds zeros, whose code is not 0 (code 0 is the map's
  // lowest value): the codes of 0.0 keep them zero.
  const std::uint8_t zero[2] = {rules::q8::quantize(rules::q8::signed_map(), 0.0f),
                                rules::q8::quantize(rules::q8::unsigned_map(), 0.0f)};
  if (any8)
    for (int x = 0; x < 2; ++x) {
      st.codes[x].assign(local, zero[x]);
      st.scales[x].assign((local + kQuantBlock - 1) / kQuantBlock, 0.0f);
    }
  // Copies the values of canonical [begin, begin + v.size()) that this rank holds to their
  // local positions in `to`.
  const auto place = [&](auto v, std::uint64_t begin, auto& to) {
    const std::uint64_t end = begin + v.size();
    auto it = std::upper_bound(targets.begin(), targets.end(), begin,
                               [](std::uint64_t x, const Target& t) { return x < t.end; });
    for (; it != targets.end() && it->begin < end; ++it) {
      const std::uint64_t b = std::max(begin, it->begin), e = std::min(end, it->end);
      std::copy(v.begin() + static_cast<std::ptrdiff_t>(b - begin),
                v.begin() + static_cast<std::ptrdiff_t>(e - begin),
                to.begin() + static_cast<std::ptrdiff_t>(it->local + (b - it->begin)));
    }
  };
  const ChunkSink sink = [&](const Chunk& c) {
    const auto a = static_cast<std::uint32_t>(c.array);
    if (a < kNumArrays) {
      place(c.values, c.begin, st.arrays[a]);
    } else if (c.array == FileArray::Factors) {  // a whole matrix's, at its first element
      const auto i = static_cast<std::size_t>(
          std::lower_bound(canonical.begin(), canonical.end(), c.begin) - canonical.begin());
      if (auto it = st.factors.find(i); it != st.factors.end())
        it->second.assign(c.values.begin(), c.values.end());
    } else if (!any8) {
      return;  // (the rules agree: no 8-bit state is stored either)
    } else if (c.array == FileArray::CodeM || c.array == FileArray::CodeV) {
      place(c.codes, c.begin, st.codes[c.array == FileArray::CodeV]);
    } else {  // one scale per quantization block, each where its block's first element goes
      std::vector<float>& to = st.scales[c.array == FileArray::ScaleV];
      for (std::size_t j = 0; j < c.values.size(); ++j) {
        const std::uint64_t pos = c.begin + j * kQuantBlock;
        auto it = std::upper_bound(targets.begin(), targets.end(), pos,
                                   [](std::uint64_t x, const Target& t) { return x < t.end; });
        if (it != targets.end() && it->begin <= pos)
          to[static_cast<std::size_t>((it->local + (pos - it->begin)) / kQuantBlock)] = c.values[j];
      }
    }
  };
  read_state(dir, m, wanted, sink);
  for (const auto& [i, v] : st.factors)  // (piece_entries gives every stored matrix its own)
    require(v.size() == opt.layout().param(i).rows + opt.layout().param(i).cols,
            Status::CorruptData, "load_checkpoint: the checkpoint lacks the factored statistics "
            "of parameter '" + opt.layout().param(i).name + "'");
  return st;
}

}  // namespace

void load_checkpoint(ShardedOptimizer& opt, const fs::path& path) {
  Communicator& comm = opt.comm();
  Metadata m;
  Staged st;
  LossScaleState loss;
  std::uint64_t identity = 0;  // must agree: every rank loads the same checkpoint
  collective(comm, "load_checkpoint", [&] {
          require(opt.finalized(), Status::InvalidState, "load_checkpoint: finalize() first");
          const fs::path dir = resolve_checkpoint_dir(path);
          m = read_metadata(dir);
          check_compatible(m, opt);
          loss = adapt_loss_state(m.loss_state, opt.options().loss_scaling);
          st = read_held_state(dir, m, opt);
          identity = layout_hash(m) ^ (std::uint64_t{m.body_crc} << 32 | m.version);
        });
  std::vector<std::uint64_t> ids(static_cast<std::size_t>(comm.size()));
  comm.all_gather_bytes(&identity, ids.data(), sizeof identity);
  if (std::any_of(ids.begin(), ids.end(), [&](std::uint64_t x) { return x != ids[0]; }))
    throw Error(Status::Io, "load_checkpoint: ranks read different checkpoints (is '" +
                                path.string() + "' on a file system every rank shares, and "
                                "was it saved to during the load?)");

  // Everything is validated: commit (nothing below can fail on bad input).
  // AdamW8bit's fp32 views are not written (its state is the codes and scales).
  const StateArray kinds[kNumArrays] = {StateArray::Master, StateArray::ExpAvg, StateArray::ExpAvgSq};
  for (std::uint32_t a = 0; a < kNumArrays; ++a) {
    if (!st.codes[0].empty() && a > 0) {
      for (const Range& r : st.fp32_pieces)
        opt.copy_state_from_host(kinds[a], r.begin,
                                 std::span<const float>(st.arrays[a]).subspan(r.begin, r.size()));
      continue;
    }
    opt.copy_state_from_host(kinds[a], 0, st.arrays[a]);
  }
  for (const auto& [i, v] : st.factors) opt.copy_factors_from_host(i, v);
  if (!st.codes[0].empty())
    opt.copy_q8_state_from_host(0, st.codes[0].size(),
                                {st.codes[0].data(), st.codes[1].data(), st.scales[0].data(),
                                 st.scales[1].data()});
  opt.set_step_count(m.step_count);
  opt.set_adam_config(m.adam);
  // The hyperparameters come from the checkpoint; the rule and its layout options stay (they
  // were checked to give every parameter its saved rule). Muon's (Adafactor's) options come
  // from a group saved as Muon (Adafactor); a group saved under another rule (no parameters:
  // the rules agreed) keeps the optimizer's.
  for (std::size_t g = 0; g < m.groups.size(); ++g) {
    GroupOptions go = m.groups[g];
    go.rule = opt.groups()[g].rule;
    go.adamw8bit = opt.groups()[g].adamw8bit;
    if (m.groups[g].rule != Rule::Muon) go.muon = opt.groups()[g].muon;
    if (m.groups[g].rule != Rule::Adafactor) go.adafactor = opt.groups()[g].adafactor;
    opt.set_group(static_cast<int>(g), go);
  }
  opt.set_loss_scale_state(loss);
  opt.refresh_replica();
}

}  // namespace shardopt
