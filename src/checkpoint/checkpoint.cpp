// checkpoint.cpp: save_checkpoint() and load_checkpoint(): the optimizer glue around the
// format (format.hpp), the files (files.hpp) and the reader (reader.hpp).
#include "shardopt/checkpoint.hpp"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "files.hpp"
#include "format.hpp"
#include "reader.hpp"

namespace shardopt {

namespace fs = std::filesystem;
using namespace ckpt;

namespace {

struct Outcome {
  Status status = Status::Ok;
  std::string message;
};

// Runs one rank's local part of a collective operation; its failure becomes an Outcome
// that agree_or_throw() turns into the same error on every rank.
template <class F>
Outcome locally(F&& f) {
  try {
    f();
    return {};
  } catch (const Error& e) {
    return {e.status(), e.what()};
  } catch (const fs::filesystem_error& e) {
    return {Status::Io, std::string("checkpoint: ") + e.what()};
  } catch (const std::bad_alloc&) {
    return {Status::OutOfMemory, "checkpoint: out of host memory"};
  } catch (const std::exception& e) {
    return {Status::Internal, std::string("checkpoint: ") + e.what()};
  }
}

void agree(Communicator& comm, const Outcome& o) { agree_or_throw(comm, o.status, o.message); }

constexpr const char* kPrefix = "ckpt-";
constexpr const char* kTmpPrefix = ".tmp-";

// Sequence number of a published checkpoint directory name, or 0 for other names.
std::uint64_t sequence_of(const std::string& name) {
  if (name.rfind(kPrefix, 0) != 0 || name.size() != 13) return 0;
  std::uint64_t v = 0;
  for (char c : name.substr(5)) {
    if (c < '0' || c > '9') return 0;
    v = v * 10 + static_cast<std::uint64_t>(c - '0');
  }
  return v;
}

std::vector<std::pair<std::uint64_t, fs::path>> published(const fs::path& dir) {
  std::vector<std::pair<std::uint64_t, fs::path>> out;
  for (const fs::directory_entry& e : fs::directory_iterator(dir))
    if (const std::uint64_t s = sequence_of(e.path().filename().string()); s > 0 && e.is_directory())
      out.emplace_back(s, e.path());
  std::sort(out.begin(), out.end());
  return out;
}

// Rank 0, before a save: removes what killed saves left (never referenced by LATEST) and
// returns the name of the next checkpoint.
std::string prepare_save_directory(const fs::path& dir) {
  fs::create_directories(dir);
  for (const fs::directory_entry& e : fs::directory_iterator(dir))
    if (e.path().filename().string().rfind(kTmpPrefix, 0) == 0) fs::remove_all(e.path());
  const auto existing = published(dir);
  const std::uint64_t next = existing.empty() ? 1 : existing.back().first + 1;
  char name[32];
  std::snprintf(name, sizeof name, "%s%08llu", kPrefix, static_cast<unsigned long long>(next));
  fs::create_directory(dir / (std::string(kTmpPrefix) + name));
  return name;
}

Metadata describe(ShardedOptimizer& opt) {
  Metadata m;
  const FlatLayout& l = opt.layout();
  m.step_count = opt.step_count();
  m.world_size = static_cast<std::uint32_t>(l.world_size());
  m.stage = opt.options().stage;
  m.param_dtype = opt.options().param_dtype;
  m.adam = opt.options().adam;
  m.loss_scaling = opt.options().loss_scaling;
  m.loss_state = opt.loss_scale_state();
  m.groups = opt.groups();
  for (const ParamInfo& p : l.params())
    m.params.push_back(MetaParam{p.name, p.numel, static_cast<std::uint32_t>(p.group), p.flat.begin});
  m.padded_size = l.padded_size();
  for (int r = 0; r < l.world_size(); ++r) {
    const Range s{l.shard_size() * static_cast<std::size_t>(r), l.shard_size() * static_cast<std::size_t>(r + 1)};  // FIXME(v2 format)
    m.shards.push_back(MetaShard{s.begin, s.end, kShardHeaderBytes + kNumArrays * s.size() * 4, 0});
  }
  return m;
}

struct ShardRecord {
  std::uint64_t bytes;
  std::uint32_t crc;
  std::uint32_t pad;
};

// Writes this rank's shard file: the state over layout.shard_range(rank), which lies in the
// owned range in every stage (data-parallel ranks own everything but write one slice each).
ShardRecord write_shard(ShardedOptimizer& opt, const Metadata& m, const fs::path& tmp_dir) {
  const int rank = opt.comm().rank();
  const Range file{opt.layout().shard_size() * static_cast<std::size_t>(rank), opt.layout().shard_size() * static_cast<std::size_t>(rank + 1)};  // FIXME(v2 format)
  const std::size_t base = 0;
  ShardHeader h;
  h.rank = static_cast<std::uint32_t>(rank);
  h.world_size = m.world_size;
  h.flat_begin = file.begin;
  h.flat_end = file.end;
  h.layout_hash = layout_hash(m);
  OutFile f(tmp_dir / shard_file_name(static_cast<std::size_t>(rank)));
  const auto header = encode_shard_header(h);
  f.write(header.data(), header.size());
  constexpr std::size_t kChunk = std::size_t{1} << 20;
  std::vector<float> host(std::min(kChunk, file.size()));
  for (StateArray a : {StateArray::Master, StateArray::ExpAvg, StateArray::ExpAvgSq}) {
    for (std::size_t off = 0; off < file.size(); off += kChunk) {
      const std::size_t n = std::min(kChunk, file.size() - off);
      opt.copy_state_to_host(a, base + off, std::span<float>(host.data(), n));
      f.write(host.data(), n * sizeof(float));
    }
    if (a == StateArray::Master) test_point("shard-partly-written");
  }
  f.close();
  return ShardRecord{f.bytes(), f.crc(), 0};
}

// Rank 0: metadata into the temporary directory, then publish (see the protocol in
// docs/checkpoint-format.md), then prune old checkpoints.
void publish(const Metadata& m, const fs::path& dir, const std::string& name, int keep) {
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
  write_file_atomically(dir, kLatestFile, name + "\n");
  test_point("published");
  auto all = published(dir);
  while (all.size() > static_cast<std::size_t>(keep)) {
    if (all.front().second.filename() != name) fs::remove_all(all.front().second);
    all.erase(all.begin());
  }
}

}  // namespace

fs::path save_checkpoint(ShardedOptimizer& opt, const fs::path& dir, const SaveOptions& options) {
  Communicator& comm = opt.comm();
  const int rank = comm.rank();
  agree(comm, locally([&] {
          require(opt.finalized(), Status::InvalidState, "save_checkpoint: finalize() first");
          require(options.keep >= 1, Status::InvalidArgument, "save_checkpoint: keep must be >= 1");
        }));

  // 1. Rank 0 prepares the directory and names the checkpoint; everyone learns the name.
  char name[32] = {};
  agree(comm, locally([&] {
          if (rank != 0) return;
          const std::string n = prepare_save_directory(dir);
          std::memcpy(name, n.c_str(), n.size() + 1);
        }));
  comm.broadcast_bytes(name, sizeof name, 0);
  test_point("prepared");

  // 2. Every rank writes and flushes its shard; rank 0 collects the checksums.
  Metadata m = describe(opt);
  ShardRecord mine{};
  const Outcome wrote = locally([&] {
    mine = write_shard(opt, m, dir / (std::string(kTmpPrefix) + name));
  });
  test_point("shard-written");
  std::vector<ShardRecord> all(static_cast<std::size_t>(comm.size()));
  comm.all_gather_bytes(&mine, all.data(), sizeof(ShardRecord));
  agree(comm, wrote);
  for (std::size_t r = 0; r < all.size(); ++r) m.shards[r].crc = all[r].crc;

  // 3. Rank 0 writes the metadata and publishes atomically.
  agree(comm, locally([&] {
          if (rank == 0) publish(m, dir, name, options.keep);
        }));
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

// This rank's new state, read from the shard files overlapping its owned range.
struct Staged {
  std::vector<float> arrays[kNumArrays];
};

// One parameter piece of the owned range: where it was in the saving layout.
struct Target {
  std::uint64_t old_begin;  // flat position in the saving layout
  std::uint64_t old_end;
  std::size_t local;        // offset in the owned range
};

Staged read_owned_state(const fs::path& dir, const Metadata& m, const ShardedOptimizer& opt) {
  const Range owned{0, opt.local_size()};
  std::vector<Target> targets;
  for (const ShardPiece& p : opt.local_pieces()) {
    const std::uint64_t at = m.params[p.param].offset + p.in_param.begin;
    targets.push_back(Target{at, at + p.in_param.size(), p.local.begin});
  }
  Staged st;
  for (auto& a : st.arrays) a.assign(owned.size(), 0.0f);  // padding stays zero
  if (targets.empty()) return st;
  const std::uint64_t lo = targets.front().old_begin, hi = targets.back().old_end;
  const ChunkSink sink = [&](std::uint32_t a, std::uint64_t begin, std::span<const float> v) {
    const std::uint64_t end = begin + v.size();
    // Targets are in flat order in both layouts: start at the first that ends after `begin`.
    auto it = std::upper_bound(targets.begin(), targets.end(), begin,
                               [](std::uint64_t x, const Target& t) { return x < t.old_end; });
    for (; it != targets.end() && it->old_begin < end; ++it) {
      const std::uint64_t b = std::max(begin, it->old_begin), e = std::min(end, it->old_end);
      std::copy(v.begin() + static_cast<std::ptrdiff_t>(b - begin),
                v.begin() + static_cast<std::ptrdiff_t>(e - begin),
                st.arrays[a].begin() + static_cast<std::ptrdiff_t>(it->local + (b - it->old_begin)));
    }
  };
  for (std::size_t s = 0; s < m.shards.size(); ++s)
    if (m.shards[s].flat_begin < hi && m.shards[s].flat_end > lo) stream_shard(dir, m, s, sink);
  return st;
}

}  // namespace

void load_checkpoint(ShardedOptimizer& opt, const fs::path& path) {
  Communicator& comm = opt.comm();
  Metadata m;
  Staged st;
  LossScaleState loss;
  std::uint64_t identity = 0;  // must agree: every rank loads the same checkpoint
  agree(comm, locally([&] {
          require(opt.finalized(), Status::InvalidState, "load_checkpoint: finalize() first");
          const fs::path dir = resolve_checkpoint_dir(path);
          m = read_metadata(dir);
          check_compatible(m, opt);
          loss = adapt_loss_state(m.loss_state, opt.options().loss_scaling);
          st = read_owned_state(dir, m, opt);
          identity = layout_hash(m) ^ (static_cast<std::uint64_t>(m.step_count) * 0x9E3779B97F4A7C15ull);
          for (const MetaShard& s : m.shards) identity = identity * 31 + s.crc;
        }));
  std::vector<std::uint64_t> ids(static_cast<std::size_t>(comm.size()));
  comm.all_gather_bytes(&identity, ids.data(), sizeof identity);
  if (std::any_of(ids.begin(), ids.end(), [&](std::uint64_t x) { return x != ids[0]; }))
    throw Error(Status::Io, "load_checkpoint: ranks read different checkpoints (is '" +
                                path.string() + "' on a file system every rank shares, and "
                                "was it saved to during the load?)");

  // Everything is validated: commit (nothing below can fail on bad input).
  const StateArray kinds[kNumArrays] = {StateArray::Master, StateArray::ExpAvg, StateArray::ExpAvgSq};
  for (std::uint32_t a = 0; a < kNumArrays; ++a) opt.copy_state_from_host(kinds[a], 0, st.arrays[a]);
  opt.set_step_count(m.step_count);
  opt.set_adam_config(m.adam);
  for (std::size_t g = 0; g < m.groups.size(); ++g) opt.set_group(static_cast<int>(g), m.groups[g]);
  opt.set_loss_scale_state(loss);
  opt.refresh_replica();
}

}  // namespace shardopt
