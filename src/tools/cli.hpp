// cli.hpp: the command line of every shardopt executable (tools, examples, benchmarks):
// CLI11 plus the two things all of them share, so they agree on them:
//   - sizes: "16", "1M", "7.5G", "64Ki", "80GiB", "7.5B": a number with an optional suffix
//     K M G T (powers of 1000) or Ki Mi Gi Ti (powers of 1024). One parser, two modes: a count
//     (parameters, elements, ranks) also takes B for billion (7B, 70B) and k m g b t in
//     lowercase; a byte size may end in "B" (bytes), so there B never means billion. The value
//     must come out a whole number >= 0; anything else is an error, never a silent 0 or 1;
//   - --help and --version, one way to parse, and one exit convention: 0 after --help or
//     --version, CLI11's non-zero code (with a one-line reason on stderr) for bad input.
#pragma once

#include <CLI/CLI.hpp>

#include <cctype>
#include <cmath>
#include <cstddef>
#include <cstdlib>
#include <iostream>
#include <map>
#include <optional>
#include <ostream>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "shardopt/shardopt_version.h"

namespace shardopt::cli {

enum class Unit { Count, Bytes };

/// The value of a size, or nothing with the reason in `*error`.
inline std::optional<std::size_t> parse_size(std::string_view text, Unit unit, std::string* error) {
  const std::string s(text);
  const auto fail = [&](const std::string& why) -> std::optional<std::size_t> {
    if (error) *error = "'" + s + "' " + why;
    return std::nullopt;
  };
  if (s.empty()) return fail("is empty");
  if (s[0] == '-' || s[0] == '+' || std::isspace(static_cast<unsigned char>(s[0])))
    return fail("is not a size (a number >= 0, e.g. 16, 1M, 64Ki)");
  char* end = nullptr;
  const double value = std::strtod(s.c_str(), &end);
  const bool hex = s.size() > 1 && s[0] == '0' && (s[1] == 'x' || s[1] == 'X');
  if (end == s.c_str() || !std::isfinite(value) || hex)
    return fail("is not a size (a number >= 0, e.g. 16, 1M, 64Ki)");
  std::string suffix(end);
  if (unit == Unit::Bytes && !suffix.empty() && suffix.back() == 'B') suffix.pop_back();
  static const std::map<std::string, double> kScale = {
      {"", 1},         {"k", 1e3},       {"K", 1e3},       {"M", 1e6},      {"G", 1e9},
      {"T", 1e12},     {"Ki", 0x1p10},   {"Mi", 0x1p20},   {"Gi", 0x1p30},  {"Ti", 0x1p40}};
  // Counts are written as people write model sizes: 7B, 70B, 1.3b, 350m. A byte size keeps
  // B for bytes, and m or b there would read as milli or bits: not accepted.
  static const std::map<std::string, double> kCountScale = {
      {"m", 1e6}, {"g", 1e9}, {"b", 1e9}, {"B", 1e9}, {"t", 1e12}};
  const auto scale = [&]() -> std::optional<double> {
    if (const auto it = kScale.find(suffix); it != kScale.end()) return it->second;
    if (unit != Unit::Count) return std::nullopt;
    if (const auto it = kCountScale.find(suffix); it != kCountScale.end()) return it->second;
    return std::nullopt;
  }();
  if (!scale) {
    return fail(std::string("has an unknown suffix '") + end + "' (" +
                (unit == Unit::Bytes
                     ? "K M G T are powers of 1000, Ki Mi Gi Ti powers of 1024, optionally followed by B)"
                     : "K M B|G T are thousand, million, billion, trillion, also in lowercase; "
                       "Ki Mi Gi Ti powers of 1024)"));
  }
  const double n = value * *scale;
  if (n > 0x1p62) return fail("is too large");
  if (n != std::floor(n)) return fail("is not a whole number");
  return static_cast<std::size_t>(n);
}

/// A CLI11 transform that turns a size into its plain integer, for options of integer type.
inline CLI::Validator size(Unit unit = Unit::Count) {
  return CLI::Validator(
      [unit](std::string& s) -> std::string {
        std::string error;
        const std::optional<std::size_t> v = parse_size(s, unit, &error);
        if (!v) return error;
        s = std::to_string(*v);
        return {};
      },
      unit == Unit::Bytes ? "BYTES" : "SIZE", unit == Unit::Bytes ? "BYTES" : "SIZE");
}

/// A CLI11 transform for a choice among names, for options of enum (or integer) type:
/// choice<Stage>({{"dp", Stage::DataParallel}, {"1", Stage::Zero1}}). Anything else is an
/// error that lists the names.
template <class T>
CLI::Validator choice(std::vector<std::pair<std::string, T>> values) {
  std::string names;
  for (const auto& [name, v] : values) names += (names.empty() ? "" : "|") + name;
  return CLI::Validator(
      [values, names](std::string& s) -> std::string {
        for (const auto& [name, v] : values) {
          if (name != s) continue;
          if constexpr (std::is_enum_v<T>)
            s = std::to_string(static_cast<long long>(static_cast<std::underlying_type_t<T>>(v)));
          else
            s = std::to_string(v);
          return {};
        }
        return "'" + s + "' is not one of " + names;
      },
      names, "CHOICE");
}

/// One line for --help's footer: what sizes accept.
inline constexpr const char* kSizeHelp =
    "SIZE: a whole number with an optional suffix: K M B T (thousand, million, billion, "
    "trillion; G = B; also in lowercase) or Ki Mi Gi Ti (powers of 1024), e.g. 16, 1M, 7.5B, "
    "64Ki. BYTES: K M G T or Ki Mi Gi Ti, optionally followed by B for bytes (80GiB, 40GB).";

/// An App named `name` with --version ("NAME (shardopt X.Y.Z)") and the size note in --help.
inline void init(CLI::App& app, const std::string& name) {
  app.name(name);
  app.set_version_flag("--version", name + " (shardopt " SHARDOPT_VERSION_STRING ")");
  app.footer(kSizeHelp);
}

/// Parses argv. Returns -1 to go on, or the exit code after --help, --version or an error
/// (printed by this process only when `print`, e.g. only on MPI rank 0; every rank parses
/// the same argv and so gets the same code).
inline int parse(CLI::App& app, int argc, const char* const* argv, bool print = true) {
  std::ostream null(nullptr);
  const auto fail = [&](const CLI::Error& e) { return print ? app.exit(e) : app.exit(e, null, null); };
  try {
    app.parse(argc, argv);
    return -1;
  } catch (const CLI::CallForHelp& e) {
    return fail(e);
  } catch (const CLI::CallForVersion& e) {
    return fail(e);
  } catch (const CLI::ParseError& e) {
    // CLI11 checks required options before it complains about unknown ones; a misspelt
    // option is the likelier mistake, so it is named first.
    if (!app.get_allow_extras() && !app.remaining(true).empty())
      return fail(CLI::ExtrasError(app.remaining(true)));
    return fail(e);
  }
}

}  // namespace shardopt::cli
