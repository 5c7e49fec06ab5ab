// format.cpp: byte-level encoding of checkpoint metadata, shard headers and LATEST, with
// decoders (formats 1 to 7) that bounds-check every field before it is used (they are
// fuzzed: tests/fuzz/); checkpoint directory names; bytes from files made fit for messages.
#include "format.hpp"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <set>
#include <string_view>
#include <utility>

#include "crc32c.hpp"
#include "rules/qmap.hpp"
#include "rules/rules.hpp"
#include "shardopt/error.hpp"
#include "shardopt/layout.hpp"

namespace shardopt::ckpt {

static_assert(std::endian::native == std::endian::little,
              "the checkpoint format is little-endian; add byte swapping for this host");

namespace {

constexpr char kMetaMagic[8] = {'S', 'H', 'R', 'D', 'O', 'P', 'T', 'M'};
constexpr char kShardMagic[8] = {'S', 'H', 'R', 'D', 'O', 'P', 'T', 'S'};

[[noreturn]] void corrupt(const std::string& what) {
  throw Error(Status::CorruptData, "checkpoint: " + what);
}

void check_version(std::uint32_t v, const char* file) {
  if (v == 0) corrupt(std::string(file) + ": format version 0 is invalid");
  if (v > kFormatVersion)
    throw Error(Status::Unsupported,
                std::string("checkpoint: ") + file + " has format version " + std::to_string(v) +
                    "; this shardopt reads versions up to " + std::to_string(kFormatVersion) +
                    " (written by a newer shardopt?)");
}

class Writer {
 public:
  template <class T>
  void put(T v) {
    unsigned char b[sizeof(T)];
    std::memcpy(b, &v, sizeof(T));
    out_.insert(out_.end(), b, b + sizeof(T));
  }
  void bytes(const void* p, std::size_t n) {
    const auto* c = static_cast<const unsigned char*>(p);
    out_.insert(out_.end(), c, c + n);
  }
  std::vector<unsigned char>& out() { return out_; }

 private:
  std::vector<unsigned char> out_;
};

// Reads fields from a span; running past the end is corruption, never a read past it.
class Reader {
 public:
  explicit Reader(std::span<const unsigned char> in) : in_(in) {}
  template <class T>
  T get(const char* what) {
    need(sizeof(T), what);
    T v;
    std::memcpy(&v, in_.data() + pos_, sizeof(T));
    pos_ += sizeof(T);
    return v;
  }
  std::string_view str(std::size_t n, const char* what) {
    need(n, what);
    std::string_view s(reinterpret_cast<const char*>(in_.data() + pos_), n);
    pos_ += n;
    return s;
  }
  /// A record count, refused unless `count` records of at least `min_record` bytes fit.
  std::uint64_t count(std::uint64_t count, std::size_t min_record, const char* what) {
    if (count > remaining() / min_record)
      corrupt(std::string(what) + " count " + std::to_string(count) +
              " does not fit in the remaining " + std::to_string(remaining()) + " bytes");
    return count;
  }
  std::size_t remaining() const { return in_.size() - pos_; }

 private:
  void need(std::size_t n, const char* what) {
    if (n > remaining()) corrupt(std::string("truncated while reading ") + what);
  }
  std::span<const unsigned char> in_;
  std::size_t pos_ = 0;
};

bool finite(double x) { return std::isfinite(x); }

}  // namespace

std::uint64_t checkpoint_sequence(std::string_view name) {
  constexpr std::string_view prefix = "ckpt-";
  if (name.substr(0, prefix.size()) != prefix) return 0;
  const std::string_view digits = name.substr(prefix.size());
  if (digits.size() < 8 || digits.size() > 19 ||
      digits.find_first_not_of("0123456789") != std::string_view::npos)
    return 0;
  std::uint64_t v = 0;
  for (char c : digits) v = v * 10 + static_cast<std::uint64_t>(c - '0');
  return v > 0 && checkpoint_name(v) == name ? v : 0;  // one spelling per number
}

std::string checkpoint_name(std::uint64_t sequence) {
  char name[32];
  std::snprintf(name, sizeof name, "ckpt-%08llu", static_cast<unsigned long long>(sequence));
  return name;
}

namespace {

// The length of the well-formed UTF-8 sequence at s[i] (1 for ASCII), or 0 if there is none.
std::size_t utf8_sequence(std::string_view s, std::size_t i) {
  const auto c = static_cast<unsigned char>(s[i]);
  std::size_t len = 0;
  std::uint32_t cp = 0;
  if (c < 0x80) return 1;
  if (c >= 0xC2 && c <= 0xDF) {
    len = 2;
    cp = c & 0x1F;
  } else if (c >= 0xE0 && c <= 0xEF) {
    len = 3;
    cp = c & 0x0F;
  } else if (c >= 0xF0 && c <= 0xF4) {
    len = 4;
    cp = c & 0x07;
  } else {
    return 0;
  }
  if (i + len > s.size()) return 0;
  for (std::size_t k = 1; k < len; ++k) {
    const auto d = static_cast<unsigned char>(s[i + k]);
    if ((d & 0xC0) != 0x80) return 0;
    cp = cp << 6 | (d & 0x3F);
  }
  if ((len == 3 && (cp < 0x800 || (cp >= 0xD800 && cp <= 0xDFFF))) ||
      (len == 4 && (cp < 0x10000 || cp > 0x10FFFF)))
    return 0;
  return len;
}

}  // namespace

bool valid_utf8(std::string_view s) {
  for (std::size_t i = 0; i < s.size();) {
    const std::size_t n = utf8_sequence(s, i);
    if (n == 0) return false;
    i += n;
  }
  return true;
}

std::string printable(std::string_view s, std::size_t max_bytes) {
  const std::string_view shown = s.substr(0, std::min(s.size(), max_bytes));
  std::string out;
  for (std::size_t i = 0; i < shown.size();) {
    const auto c = static_cast<unsigned char>(shown[i]);
    const std::size_t n = utf8_sequence(shown, i);
    if (n > 1 || (n == 1 && c >= 0x20 && c != 0x7F && c != '\\')) {
      out.append(shown.substr(i, n));
      i += n;
    } else {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\x%02X", c);
      out += buf;
      ++i;
    }
  }
  if (shown.size() < s.size()) out += "... (" + std::to_string(s.size()) + " bytes)";
  return out;
}

std::string shard_file_name(std::size_t rank) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "shard-%05zu.bin", rank);
  return buf;
}

std::vector<std::uint64_t> canonical_offsets(const Metadata& m) {
  std::vector<std::uint64_t> c(m.params.size() + 1, 0);
  for (std::size_t i = 0; i < m.params.size(); ++i) c[i + 1] = c[i] + m.params[i].numel;
  return c;
}

std::uint32_t first_format_with(Rule rule) {
  switch (rule) {
    case Rule::AdamW: return 1;
    case Rule::Lion: return 4;
    case Rule::AdamW8bit: return 5;
    case Rule::Muon: return 6;
    case Rule::Adafactor: return 7;
  }
  return 0;
}

Rule param_rule(const Metadata& m, std::size_t i) {
  const MetaParam& p = m.params.at(i);
  return rules::param_rule(m.groups.at(p.group), static_cast<std::size_t>(p.numel));
}

std::vector<BlockPiece> block_pieces(const Metadata& m, const std::vector<std::uint64_t>& canonical,
                                     std::uint64_t begin, std::uint64_t count) {
  std::vector<BlockPiece> out;
  const std::uint64_t end = begin + count;
  // The parameter holding `begin`: the last whose first element is <= begin.
  std::size_t i = static_cast<std::size_t>(
      std::upper_bound(canonical.begin(), canonical.end() - 1, begin) - canonical.begin());
  for (i = i == 0 ? 0 : i - 1; i < m.params.size() && canonical[i] < end; ++i) {
    const std::uint64_t b = std::max(begin, canonical[i]), e = std::min(end, canonical[i + 1]);
    if (b < e) out.push_back(BlockPiece{i, b, e - b, param_rule(m, i), b == canonical[i]});
  }
  return out;
}

std::array<std::uint64_t, kNumFileArrays> piece_entries(const Metadata& m, const BlockPiece& p) {
  std::array<std::uint64_t, kNumFileArrays> n{};
  n[0] = p.count;
  if (m.version < 5) {  // three fp32 arrays, every element
    n[1] = p.count;
    n[2] = p.count;
    return n;
  }
  // Per element: the fp32 arrays the rule keeps (Muon's momentum is an exp_avg, as Lion's).
  using rules::Slot;
  const MetaParam& mp = m.params.at(p.param);
  const bool factored = rules::factored(p.rule, static_cast<std::size_t>(mp.rows),
                                        static_cast<std::size_t>(mp.cols));
  if (rules::keeps(p.rule, Slot::ExpAvg, factored)) n[1] = p.count;
  if (rules::keeps(p.rule, Slot::ExpAvgSq, factored)) n[2] = p.count;
  // Per quantization block, then per element: AdamW8bit's scales and codes.
  n[3] = p.quant_blocks();
  n[4] = p.quant_blocks();
  if (p.rule == Rule::AdamW8bit) {
    n[static_cast<std::size_t>(FileArray::CodeM)] = p.count;
    n[static_cast<std::size_t>(FileArray::CodeV)] = p.count;
  }
  // Per factored matrix, in the run holding its first element: row_var and col_var.
  if (factored && p.first) n[static_cast<std::size_t>(FileArray::Factors)] = mp.rows + mp.cols;
  return n;
}

std::array<std::uint64_t, kNumFileArrays> block_entries(const Metadata& m,
                                                        std::span<const BlockPiece> pieces) {
  std::array<std::uint64_t, kNumFileArrays> n{};
  for (const BlockPiece& p : pieces) {
    const auto e = piece_entries(m, p);
    for (std::size_t a = 0; a < n.size(); ++a) n[a] += e[a];
  }
  return n;
}

std::uint64_t block_bytes(const std::array<std::uint64_t, kNumFileArrays>& n) {
  std::uint64_t bytes = 0;
  for (std::uint32_t a = 0; a < kNumFileArrays; ++a)
    bytes += n[a] * (is_fp32(static_cast<FileArray>(a)) ? sizeof(float) : 1);
  return bytes;
}

std::vector<Range> shard_extents(const Metadata& m, std::size_t index) {
  const MetaShard& s = m.shards.at(index);
  std::vector<Range> out;
  if (m.version >= 2) {
    for (const Block& b : s.blocks) out.push_back(Range{b.begin, b.begin + b.count});
    return out;
  }
  const std::vector<std::uint64_t> c = canonical_offsets(m);
  auto it = std::upper_bound(m.params.begin(), m.params.end(), s.flat_begin,
                             [](std::uint64_t x, const MetaParam& p) { return x < p.offset + p.numel; });
  for (; it != m.params.end() && it->offset < s.flat_end; ++it) {
    const std::uint64_t b = std::max(s.flat_begin, it->offset);
    const std::uint64_t e = std::min(s.flat_end, it->offset + it->numel);
    const std::uint64_t at = c[static_cast<std::size_t>(it - m.params.begin())] + (b - it->offset);
    out.push_back(Range{at, at + (e - b)});
  }
  return out;
}

std::uint64_t layout_hash(const Metadata& m) {
  if (m.version == 1) {
    std::uint64_t h = fnv1a64(&m.padded_size, sizeof m.padded_size);
    for (const MetaParam& p : m.params) {
      h = fnv1a64(p.name.data(), p.name.size(), h);
      const std::uint64_t rec[4] = {p.name.size(), p.numel, p.group, p.offset};
      h = fnv1a64(rec, sizeof rec, h);
    }
    return h;
  }
  std::uint64_t h = fnv1a64(kMetaMagic, sizeof kMetaMagic);
  for (const MetaParam& p : m.params) {
    h = fnv1a64(p.name.data(), p.name.size(), h);
    const std::uint64_t rec[3] = {p.name.size(), p.numel, p.group};
    h = fnv1a64(rec, sizeof rec, h);
  }
  return h;
}

// ---- metadata -------------------------------------------------------------------------------

namespace {

// A group's rule options after its fixed record (format 6): what the rule's update reads
// beyond the record's fields, empty for the rules before format 6. A rule with options of
// its own (Muon's MuonConfig, format 6; Adafactor's AdafactorConfig, format 7) adds them
// here and in decode_rule_options, with a new format version.
void encode_rule_options(Writer& w, const GroupOptions& g) {
  if (g.rule == Rule::Adafactor) {
    const AdafactorConfig& c = g.adafactor;
    for (double x : {c.beta2_decay, c.eps1, c.eps2, c.d}) w.put<double>(x);
    w.put<std::uint32_t>(c.maximize ? 1 : 0);
    return;
  }
  if (g.rule != Rule::Muon) return;
  const MuonConfig& c = g.muon;
  w.put<double>(c.momentum);
  w.put<std::uint32_t>(c.nesterov ? 1 : 0);
  w.put<std::uint32_t>(static_cast<std::uint32_t>(c.ns_steps));
  for (double x : {c.ns_a, c.ns_b, c.ns_c, c.eps}) w.put<double>(x);
  w.put<std::uint32_t>(static_cast<std::uint32_t>(c.lr_adjust));
}

void decode_rule_options(Reader& r, GroupOptions& g) {
  if (g.rule == Rule::Adafactor) {  // (formats before 7 refused the rule)
    AdafactorConfig& c = g.adafactor;
    c.beta2_decay = r.get<double>("group Adafactor beta2_decay");
    c.eps1 = r.get<double>("group Adafactor eps1");
    c.eps2 = r.get<double>("group Adafactor eps2");
    c.d = r.get<double>("group Adafactor d");
    const auto maximize = r.get<std::uint32_t>("group Adafactor maximize flag");
    if (maximize > 1) corrupt("bad group Adafactor maximize flag");
    c.maximize = maximize == 1;
    return;
  }
  if (g.rule != Rule::Muon) return;
  MuonConfig& c = g.muon;
  c.momentum = r.get<double>("group Muon momentum");
  const auto nesterov = r.get<std::uint32_t>("group Muon nesterov flag");
  if (nesterov > 1) corrupt("bad group Muon nesterov flag");
  c.nesterov = nesterov == 1;
  const auto steps = r.get<std::uint32_t>("group Muon ns_steps");
  if (steps > 99) corrupt("impossible group Muon ns_steps " + std::to_string(steps));
  c.ns_steps = static_cast<int>(steps);
  c.ns_a = r.get<double>("group Muon ns_a");
  c.ns_b = r.get<double>("group Muon ns_b");
  c.ns_c = r.get<double>("group Muon ns_c");
  c.eps = r.get<double>("group Muon eps");
  const auto adjust = r.get<std::uint32_t>("group Muon lr_adjust");
  if (adjust > 2) corrupt("unknown group Muon lr_adjust " + std::to_string(adjust));
  c.lr_adjust = static_cast<MuonLrAdjust>(adjust);
}

// The fields formats 1 and 2 share, from the step count to the groups.
void encode_common(Writer& w, const Metadata& m) {
  w.put<std::int64_t>(m.step_count);
  w.put<std::uint32_t>(m.world_size);
  w.put<std::uint32_t>(static_cast<std::uint32_t>(m.stage));
  w.put<std::uint32_t>(static_cast<std::uint32_t>(m.param_dtype));
  w.put<std::uint32_t>(static_cast<std::uint32_t>(m.adam.mode));
  for (double x : {m.adam.lr, m.adam.beta1, m.adam.beta2, m.adam.eps, m.adam.weight_decay,
                   m.adam.max_grad_norm})
    w.put<double>(x);
  const LossScaling& ls = m.loss_scaling;
  w.put<std::uint32_t>(ls.enabled ? 1 : 0);
  w.put<std::int32_t>(ls.growth_interval);
  for (double x : {ls.initial_scale, ls.growth_factor, ls.backoff_factor, ls.min_scale,
                   ls.max_scale})
    w.put<double>(x);
  w.put<double>(m.loss_state.scale);
  w.put<std::int64_t>(m.loss_state.good_steps);
  w.put<std::int64_t>(m.loss_state.skipped_steps);
  w.put<std::uint32_t>(static_cast<std::uint32_t>(m.groups.size()));
  for (const GroupOptions& g : m.groups) {
    w.put<double>(g.lr_scale);
    w.put<std::uint32_t>(g.weight_decay ? 1 : 0);
    w.put<std::uint32_t>(static_cast<std::uint32_t>(g.rule));  // format 4
    w.put<double>(g.lion.beta1);
    w.put<double>(g.lion.beta2);
    w.put<std::uint64_t>(g.adamw8bit.min_8bit_numel);  // format 5
    encode_rule_options(w, g);                         // format 6
  }
  // Format 5: the maps AdamW8bit codes index (this build's, unless m names others).
  w.put<std::uint64_t>(m.has_qmap_checksums ? m.qmap_checksum[0]
                                            : rules::q8::map_checksum(rules::q8::signed_map()));
  w.put<std::uint64_t>(m.has_qmap_checksums ? m.qmap_checksum[1]
                                            : rules::q8::map_checksum(rules::q8::unsigned_map()));
}

void decode_common(Reader& r, Metadata& m) {
  m.step_count = r.get<std::int64_t>("step count");
  m.world_size = r.get<std::uint32_t>("world size");
  const auto stage = r.get<std::uint32_t>("stage");
  const auto dtype = r.get<std::uint32_t>("dtype");
  const auto mode = r.get<std::uint32_t>("adam mode");
  if (m.step_count < 0) corrupt("negative step count");
  if (m.world_size == 0 || m.world_size > (1u << 20)) corrupt("impossible world size");
  if (stage > 3) corrupt("unknown stage " + std::to_string(stage));
  if (dtype > 1) corrupt("unknown parameter dtype " + std::to_string(dtype));
  if (mode > 1) corrupt("unknown Adam mode " + std::to_string(mode));
  m.stage = static_cast<Stage>(stage);
  m.param_dtype = static_cast<DType>(dtype);
  m.adam.mode = static_cast<AdamMode>(mode);
  m.adam.lr = r.get<double>("lr");
  m.adam.beta1 = r.get<double>("beta1");
  m.adam.beta2 = r.get<double>("beta2");
  m.adam.eps = r.get<double>("eps");
  m.adam.weight_decay = r.get<double>("weight decay");
  m.adam.max_grad_norm = r.get<double>("max grad norm");
  if (const std::string p = validate(m.adam); !p.empty()) corrupt("hyperparameters: " + p);

  LossScaling& ls = m.loss_scaling;
  const auto enabled = r.get<std::uint32_t>("loss scaling flag");
  if (enabled > 1) corrupt("bad loss scaling flag");
  ls.enabled = enabled == 1;
  ls.growth_interval = r.get<std::int32_t>("growth interval");
  ls.initial_scale = r.get<double>("initial scale");
  ls.growth_factor = r.get<double>("growth factor");
  ls.backoff_factor = r.get<double>("backoff factor");
  ls.min_scale = r.get<double>("min scale");
  ls.max_scale = r.get<double>("max scale");
  // Options saved while loss scaling was off were not checked before issue 27, and a load
  // uses the loading optimizer's options anyway: checked only when they were in use.
  if (const std::string p = validate(ls); ls.enabled && !p.empty()) corrupt("loss scaling: " + p);
  m.loss_state.scale = r.get<double>("loss scale");
  m.loss_state.good_steps = r.get<std::int64_t>("good steps");
  m.loss_state.skipped_steps = r.get<std::int64_t>("skipped steps");
  if (!finite(m.loss_state.scale) || m.loss_state.scale <= 0 || m.loss_state.good_steps < 0 ||
      m.loss_state.skipped_steps < 0)
    corrupt("invalid loss scale state");

  const std::uint64_t ngroups =
      r.count(r.get<std::uint32_t>("group count"), m.version >= 5 ? 40 : m.version >= 4 ? 32 : 12,
              "group");
  if (ngroups == 0) corrupt("no parameter groups");
  m.groups.reserve(ngroups);
  for (std::uint64_t g = 0; g < ngroups; ++g) {
    GroupOptions go;
    go.lr_scale = r.get<double>("group lr scale");
    const auto wd = r.get<std::uint32_t>("group decay flag");
    if (wd > 1) corrupt("bad group decay flag");
    go.weight_decay = wd == 1;
    if (m.version >= 4) {  // formats 1-3: every group was AdamW
      const auto rule = r.get<std::uint32_t>("group rule");
      if (rule >= static_cast<std::uint32_t>(kNumRules))
        corrupt("unknown group rule " + std::to_string(rule));
      go.rule = static_cast<Rule>(rule);
      if (first_format_with(go.rule) == 0 || m.version < first_format_with(go.rule))
        corrupt("format " + std::to_string(m.version) + " cannot hold " + rule_name(go.rule) +
                " state");  // (saves refused it then)
      go.lion.beta1 = r.get<double>("group Lion beta1");
      go.lion.beta2 = r.get<double>("group Lion beta2");
    }
    if (m.version >= 5) {  // formats 1-4 had no 8-bit state: the default threshold
      go.adamw8bit.min_8bit_numel = r.get<std::uint64_t>("group min_8bit_numel");
      if (go.adamw8bit.min_8bit_numel > kMaxElements) corrupt("impossible group min_8bit_numel");
    }
    if (m.version >= 6) decode_rule_options(r, go);
    if (const std::string p = validate(go); !p.empty()) corrupt("group: " + p);
    m.groups.push_back(go);
  }
  if (m.version >= 5) {
    m.has_qmap_checksums = true;
    m.qmap_checksum[0] = r.get<std::uint64_t>("signed map checksum");
    m.qmap_checksum[1] = r.get<std::uint64_t>("unsigned map checksum");
  }
}

// One parameter record's name, size and group (both formats); the caller reads the rest.
MetaParam decode_param(Reader& r, const Metadata& m, std::set<std::string_view>& names) {
  MetaParam p;
  const auto len = r.get<std::uint32_t>("name length");
  if (len == 0 || len > kMaxNameBytes) corrupt("parameter name length " + std::to_string(len));
  const std::string_view name = r.str(len, "parameter name");
  if (!names.insert(name).second) corrupt("duplicate parameter name '" + std::string(name) + "'");
  p.name = std::string(name);
  p.numel = r.get<std::uint64_t>("numel");
  p.group = r.get<std::uint32_t>("group");
  if (p.numel == 0 || p.numel > (std::uint64_t{1} << 50))
    corrupt("parameter '" + p.name + "' has an impossible size");
  if (p.group >= m.groups.size()) corrupt("parameter '" + p.name + "' names an unknown group");
  if (m.version >= 6) {  // its 2-D shape
    p.rows = r.get<std::uint64_t>("rows");
    p.cols = r.get<std::uint64_t>("cols");
    if (p.rows == 0 || p.numel % p.rows != 0 || p.numel / p.rows != p.cols)
      corrupt("parameter '" + p.name + "' has " + std::to_string(p.numel) +
              " elements but shape " + std::to_string(p.rows) + " x " + std::to_string(p.cols));
  }
  return p;
}

// Format 1: parameters with flat offsets, the padded size, and shards tiling the flat buffer.
void decode_v1_tail(Reader& r, Metadata& m) {
  constexpr std::size_t kMinParamRecord = 4 + 1 + 8 + 4 + 8;
  const std::uint64_t nparams = r.count(r.get<std::uint64_t>("parameter count"),
                                        kMinParamRecord, "parameter");
  if (nparams == 0) corrupt("no parameters");
  m.params.reserve(nparams);
  std::set<std::string_view> names;
  std::uint64_t end = 0;  // end of the previous parameter
  for (std::uint64_t i = 0; i < nparams; ++i) {
    MetaParam p = decode_param(r, m, names);
    p.offset = r.get<std::uint64_t>("offset");
    if (p.offset % FlatLayout::kAlignElems != 0 || p.offset < end ||
        p.offset > (std::uint64_t{1} << 52))
      corrupt("parameter '" + p.name + "' has a misplaced offset");
    end = p.offset + p.numel;
    m.params.push_back(std::move(p));
  }
  m.padded_size = r.get<std::uint64_t>("padded size");
  const std::uint64_t quantum = FlatLayout::kAlignElems * std::uint64_t{m.world_size};
  if (m.padded_size < end || m.padded_size % quantum != 0 || m.padded_size - end >= quantum)
    corrupt("padded size " + std::to_string(m.padded_size) +
            " does not match the parameters and world size");

  const std::uint64_t nshards = r.count(r.get<std::uint32_t>("shard count"), 28, "shard");
  if (nshards != m.world_size) corrupt("shard count differs from the world size");
  m.shards.reserve(nshards);
  const std::uint64_t per = m.padded_size / m.world_size;
  for (std::uint64_t s = 0; s < nshards; ++s) {
    MetaShard sh;
    sh.flat_begin = r.get<std::uint64_t>("shard begin");
    sh.flat_end = r.get<std::uint64_t>("shard end");
    sh.file_bytes = r.get<std::uint64_t>("shard file size");
    sh.crc = r.get<std::uint32_t>("shard checksum");
    if (sh.flat_begin != s * per || sh.flat_end != (s + 1) * per ||
        sh.file_bytes != kShardHeaderBytes + kNumArrays * per * sizeof(float))
      corrupt("shard " + std::to_string(s) + " does not tile the flat buffer");
    m.shards.push_back(std::move(sh));
  }
}

// Format 2: parameters (canonical order), and shards of blocks that together cover every
// canonical element exactly once.
void decode_v2_tail(Reader& r, Metadata& m) {
  const std::size_t min_param_record = 4 + 1 + 8 + 4 + (m.version >= 6 ? 16 : 0);  // (shape)
  const std::uint64_t nparams = r.count(r.get<std::uint64_t>("parameter count"),
                                        min_param_record, "parameter");
  if (nparams == 0) corrupt("no parameters");
  m.params.reserve(nparams);
  std::set<std::string_view> names;
  std::uint64_t total = 0;
  for (std::uint64_t i = 0; i < nparams; ++i) {
    m.params.push_back(decode_param(r, m, names));
    total += m.params.back().numel;
    if (total > kMaxElements) corrupt("the parameters hold an impossible number of elements");
  }

  constexpr std::size_t kBlockRecord = 8 + 8 + 4;
  const std::uint64_t nshards = r.count(r.get<std::uint32_t>("shard count"), 16, "shard");
  if (nshards != m.world_size) corrupt("shard count differs from the world size");
  m.shards.reserve(nshards);
  const std::vector<std::uint64_t> canonical = canonical_offsets(m);
  std::vector<std::pair<std::uint64_t, std::uint64_t>> all;  // every block: begin, count
  for (std::uint64_t s = 0; s < nshards; ++s) {
    MetaShard sh;
    sh.file_bytes = r.get<std::uint64_t>("shard file size");
    const std::uint64_t nblocks = r.count(r.get<std::uint64_t>("block count"), kBlockRecord, "block");
    sh.blocks.reserve(nblocks);
    std::uint64_t bytes = kShardHeaderBytes, prev_end = 0;
    for (std::uint64_t b = 0; b < nblocks; ++b) {
      Block blk;
      blk.begin = r.get<std::uint64_t>("block begin");
      blk.count = r.get<std::uint64_t>("block count");
      blk.crc = r.get<std::uint32_t>("block checksum");
      const std::string which = "shard " + std::to_string(s) + " block " + std::to_string(b);
      if (blk.count == 0 || blk.count > kBlockElems || blk.begin > total ||
          blk.count > total - blk.begin || (b > 0 && blk.begin < prev_end))
        corrupt(which + " is not an ascending range of at most " + std::to_string(kBlockElems) +
                " elements inside the parameters");
      const std::vector<BlockPiece> pieces = block_pieces(m, canonical, blk.begin, blk.count);
      // Format 5: an AdamW8bit parameter's blocks are whole quantization blocks (its last
      // may be partial, ending with the parameter).
      for (const BlockPiece& p : pieces)
        if (p.rule == Rule::AdamW8bit &&
            ((p.begin - canonical[p.param]) % kQuantBlock != 0 ||
             (p.begin + p.count != canonical[p.param + 1] &&
              (p.begin + p.count - canonical[p.param]) % kQuantBlock != 0)))
          corrupt(which + " cuts a quantization block of AdamW8bit parameter '" +
                  m.params[p.param].name + "'");
      blk.file_offset = bytes;
      bytes += block_bytes(block_entries(m, pieces));
      prev_end = blk.begin + blk.count;
      all.emplace_back(blk.begin, blk.count);
      sh.blocks.push_back(blk);
    }
    if (sh.file_bytes != bytes)
      corrupt("shard " + std::to_string(s) + " file size does not match its blocks");
    m.shards.push_back(std::move(sh));
  }
  std::sort(all.begin(), all.end());
  std::uint64_t covered = 0;
  for (const auto& [begin, count] : all) {
    if (begin != covered)
      corrupt("the shards " + std::string(begin < covered ? "store element " : "miss element ") +
              std::to_string(std::min(begin, covered)) + (begin < covered ? " twice" : ""));
    covered += count;
  }
  if (covered != total)
    corrupt("the shards miss elements " + std::to_string(covered) + " to " + std::to_string(total));
}

}  // namespace

std::vector<unsigned char> encode_metadata(const Metadata& m) {
  Writer w;
  w.put<std::uint64_t>(m.sequence);  // format 3
  encode_common(w, m);
  w.put<std::uint64_t>(m.params.size());
  for (const MetaParam& p : m.params) {
    w.put<std::uint32_t>(static_cast<std::uint32_t>(p.name.size()));
    w.bytes(p.name.data(), p.name.size());
    w.put<std::uint64_t>(p.numel);
    w.put<std::uint32_t>(p.group);
    w.put<std::uint64_t>(p.rows == 0 ? 1 : p.rows);  // format 6 (unrecorded: 1 x numel)
    w.put<std::uint64_t>(p.rows == 0 ? p.numel : p.cols);
  }
  w.put<std::uint32_t>(static_cast<std::uint32_t>(m.shards.size()));
  for (const MetaShard& s : m.shards) {
    w.put<std::uint64_t>(s.file_bytes);
    w.put<std::uint64_t>(s.blocks.size());
    for (const Block& b : s.blocks) {
      w.put<std::uint64_t>(b.begin);
      w.put<std::uint64_t>(b.count);
      w.put<std::uint32_t>(b.crc);
    }
  }
  const std::vector<unsigned char>& body = w.out();

  Writer file;
  file.bytes(kMetaMagic, 8);
  file.put<std::uint32_t>(kFormatVersion);
  file.put<std::uint32_t>(static_cast<std::uint32_t>(kMetaHeaderBytes));
  file.put<std::uint64_t>(body.size());
  file.put<std::uint32_t>(crc32c(body.data(), body.size()));
  file.put<std::uint32_t>(crc32c(file.out().data(), 28));
  file.bytes(body.data(), body.size());
  return std::move(file.out());
}

Metadata decode_metadata(std::span<const unsigned char> in) {
  if (in.size() < kMetaHeaderBytes)
    corrupt("metadata file is truncated (" + std::to_string(in.size()) + " bytes)");
  if (std::memcmp(in.data(), kMetaMagic, 8) != 0)
    corrupt("metadata file does not start with the shardopt magic");
  Reader hdr(in.first(kMetaHeaderBytes));
  hdr.str(8, "magic");
  Metadata m;
  m.version = hdr.get<std::uint32_t>("version");
  const auto header_bytes = hdr.get<std::uint32_t>("header size");
  const auto body_bytes = hdr.get<std::uint64_t>("body size");
  const auto body_crc = hdr.get<std::uint32_t>("body checksum");
  const auto header_crc = hdr.get<std::uint32_t>("header checksum");
  if (crc32c(in.data(), 28) != header_crc) corrupt("metadata header checksum mismatch");
  check_version(m.version, "metadata");
  if (header_bytes != kMetaHeaderBytes) corrupt("metadata header size is wrong");
  if (body_bytes != in.size() - kMetaHeaderBytes)
    corrupt("metadata is truncated or has trailing bytes (body " + std::to_string(body_bytes) +
            " bytes declared, " + std::to_string(in.size() - kMetaHeaderBytes) + " present)");
  const std::span<const unsigned char> body = in.subspan(kMetaHeaderBytes);
  if (crc32c(body.data(), body.size()) != body_crc)
    corrupt("metadata body checksum mismatch (the file is corrupted)");
  m.body_crc = body_crc;

  Reader r(body);
  if (m.version >= 3) {
    m.sequence = r.get<std::uint64_t>("sequence number");
    if (m.sequence == 0) corrupt("sequence number 0 is invalid");
  }
  decode_common(r, m);
  if (m.version == 1)
    decode_v1_tail(r, m);
  else
    decode_v2_tail(r, m);
  if (r.remaining() != 0) corrupt("trailing bytes after the shard table");
  return m;
}

// ---- shard headers ------------------------------------------------------------------------

namespace {

std::uint32_t table_crc(const std::vector<Block>& blocks) {
  std::uint32_t crc = 0;
  for (const Block& b : blocks) {
    const std::uint64_t rec[2] = {b.begin, b.count};
    crc = crc32c_update(crc, rec, sizeof rec);
  }
  return crc;
}

}  // namespace

ShardHeader shard_header(const Metadata& m, std::size_t index) {
  const MetaShard& s = m.shards.at(index);
  ShardHeader h;
  h.rank = static_cast<std::uint32_t>(index);
  h.world_size = m.world_size;
  h.layout_hash = layout_hash(m);
  for (const Block& b : s.blocks) h.elements += b.count;
  h.blocks = s.blocks.size();
  h.table_hash = table_crc(s.blocks);
  return h;
}

std::array<unsigned char, kShardHeaderBytes> encode_shard_header(const ShardHeader& h) {
  Writer w;
  w.bytes(kShardMagic, 8);
  w.put<std::uint32_t>(kFormatVersion);
  w.put<std::uint32_t>(static_cast<std::uint32_t>(kShardHeaderBytes));
  w.put<std::uint32_t>(h.rank);
  w.put<std::uint32_t>(h.world_size);
  w.put<std::uint64_t>(h.elements);
  w.put<std::uint64_t>(h.blocks);
  w.put<std::uint32_t>(kNumFileArrays);  // format 5 (7: 8 arrays): entries as the rules say
  w.put<std::uint32_t>(0);
  w.put<std::uint64_t>(h.layout_hash);
  w.put<std::uint32_t>(h.table_hash);
  w.put<std::uint32_t>(crc32c(w.out().data(), kShardHeaderBytes - 4));
  std::array<unsigned char, kShardHeaderBytes> out{};
  std::memcpy(out.data(), w.out().data(), kShardHeaderBytes);
  return out;
}

ShardHeader decode_shard_header(std::span<const unsigned char> in) {
  if (in.size() < kShardHeaderBytes) corrupt("shard file is truncated (no header)");
  if (std::memcmp(in.data(), kShardMagic, 8) != 0)
    corrupt("shard file does not start with the shardopt magic");
  Reader r(in.first(kShardHeaderBytes));
  r.str(8, "magic");
  ShardHeader h;
  h.version = r.get<std::uint32_t>("version");
  const auto header_bytes = r.get<std::uint32_t>("header size");
  h.rank = r.get<std::uint32_t>("rank");
  h.world_size = r.get<std::uint32_t>("world size");
  const auto a = r.get<std::uint64_t>("begin / elements");
  const auto b = r.get<std::uint64_t>("end / blocks");
  const auto arrays = r.get<std::uint32_t>("array count");
  const auto elem = r.get<std::uint32_t>("element size");
  h.layout_hash = r.get<std::uint64_t>("layout hash");
  const auto table = r.get<std::uint32_t>("table hash");
  const auto crc = r.get<std::uint32_t>("header checksum");
  if (crc32c(in.data(), kShardHeaderBytes - 4) != crc) corrupt("shard header checksum mismatch");
  check_version(h.version, "shard file");
  const bool layout_ok = h.version >= 5 ? arrays == file_arrays_in(h.version) && elem == 0
                                        : arrays == kNumArrays && elem == sizeof(float);
  if (header_bytes != kShardHeaderBytes || !layout_ok)
    corrupt("shard header describes an unknown record layout");
  if (h.rank >= h.world_size) corrupt("shard header is inconsistent");
  if (h.version == 1) {
    h.flat_begin = a;
    h.flat_end = b;
    if (h.flat_end < h.flat_begin || table != 0) corrupt("shard header is inconsistent");
  } else {
    h.elements = a;
    h.blocks = b;
    h.table_hash = table;
    if (h.blocks > h.elements || h.elements > h.blocks * kBlockElems)
      corrupt("shard header is inconsistent");
  }
  return h;
}

void check_shard_matches(const ShardHeader& h, const Metadata& m, std::size_t index) {
  bool same = h.version == m.version && h.rank == index && h.world_size == m.world_size &&
              h.layout_hash == layout_hash(m);
  if (m.version == 1) {
    const MetaShard& s = m.shards.at(index);
    same = same && h.flat_begin == s.flat_begin && h.flat_end == s.flat_end;
  } else {
    const ShardHeader want = shard_header(m, index);
    same = same && h.elements == want.elements && h.blocks == want.blocks &&
           h.table_hash == want.table_hash;
  }
  if (!same) corrupt(shard_file_name(index) + " belongs to another checkpoint or rank");
}

// ---- LATEST ---------------------------------------------------------------------------------

std::string encode_latest(const std::string& name) {
  char crc[16];
  std::snprintf(crc, sizeof crc, "%08x", crc32c(name.data(), name.size()));
  return name + " " + crc + "\n";
}

std::string decode_latest(std::span<const unsigned char> bytes, bool& legacy) {
  std::string text(bytes.begin(), bytes.end());
  if (!text.empty() && text.back() == '\n') text.pop_back();
  const std::size_t space = text.find(' ');
  legacy = space == std::string::npos;
  const std::string name = text.substr(0, space);
  // LATEST names a sibling directory; anything else is not ours.
  const bool plain = !name.empty() && name.find('/') == std::string::npos && name != "." &&
                     name != ".." && name.find('\0') == std::string::npos &&
                     name.find('\n') == std::string::npos;
  // Quoted escaped and cut: the bytes may be anything.
  const std::string quoted = std::string("'").append(printable(text, 64)).append("'");
  if (!plain) corrupt("LATEST holds " + quoted + ", which does not name a checkpoint directory");
  if (!legacy) {
    const std::string crc = text.substr(space + 1);
    const bool hex = crc.size() == 8 && crc.find_first_not_of("0123456789abcdef") == std::string::npos;
    if (!hex || std::stoul(crc, nullptr, 16) != crc32c(name.data(), name.size()))
      corrupt("LATEST holds " + quoted + ", which fails its checksum (the file is corrupted)");
  }
  return name;
}

}  // namespace shardopt::ckpt
