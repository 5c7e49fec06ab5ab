// shardopt_export.cpp: writes the consolidated fp32 master weights of a sharded checkpoint
// as one safetensors file (names, shapes, fp32 data), reading files only: no MPI, any
// number of saving ranks. Usage in docs/checkpoint-format.md.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "checkpoint/reader.hpp"
#include "cli.hpp"
#include "shardopt/error.hpp"

namespace {

using namespace shardopt;
using namespace shardopt::ckpt;

std::string json_string(const std::string& s) {
  std::string out = "\"";
  for (unsigned char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", c);
      out += buf;
    } else {
      out += static_cast<char>(c);
    }
  }
  return out + "\"";
}

// The safetensors header is UTF-8 JSON whose key "__metadata__" is reserved: a parameter
// name that is not UTF-8 or is that key cannot be a tensor name. Refused, naming it.
void check_tensor_names(const Metadata& m) {
  for (std::size_t i = 0; i < m.params.size(); ++i) {
    const std::string& n = m.params[i].name;
    if (n == "__metadata__")
      throw Error(Status::Unsupported, "parameter " + std::to_string(i) +
                                           " is named '__metadata__', the key safetensors reserves "
                                           "for its metadata; it cannot be exported as a tensor");
    if (!valid_utf8(n))
      throw Error(Status::Unsupported, "parameter " + std::to_string(i) + " '" + printable(n) +
                                           "' has a name that is not valid UTF-8, which a "
                                           "safetensors header cannot hold");
  }
}

// The safetensors header: a JSON object, padded with spaces to a multiple of 8 bytes.
std::string safetensors_header(const Metadata& m, const std::vector<std::uint64_t>& canonical) {
  std::string h = "{\"__metadata__\":{\"producer\":\"shardopt-export\",\"step\":\"" +
                  std::to_string(m.step_count) + "\",\"saved_world_size\":\"" +
                  std::to_string(m.world_size) + "\"}";
  for (std::size_t i = 0; i < m.params.size(); ++i) {
    const std::uint64_t b = canonical[i] * 4, e = b + m.params[i].numel * 4;
    h += ',';
    h += json_string(m.params[i].name);
    // Format 6 records 2-D shapes: a parameter registered as a matrix is exported as one.
    const MetaParam& p = m.params[i];
    h += ":{\"dtype\":\"F32\",\"shape\":[" +
         (p.rows > 1 ? std::to_string(p.rows) + "," + std::to_string(p.cols)
                     : std::to_string(p.numel));
    h += "],\"data_offsets\":[" + std::to_string(b) + "," + std::to_string(e) + "]}";
  }
  h += "}";
  while (h.size() % 8 != 0) h += ' ';
  return h;
}

[[noreturn]] void io_fail(const std::string& what, const std::string& path) {
  throw Error(Status::Io, what + " '" + path + "': " + std::strerror(errno));
}

void pwrite_all(int fd, const void* data, std::size_t bytes, std::uint64_t at, const std::string& path) {
  const char* p = static_cast<const char*>(data);
  while (bytes > 0) {
    const ssize_t n = ::pwrite(fd, p, bytes, static_cast<off_t>(at));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) io_fail("cannot write", path);
    p += n;
    bytes -= static_cast<std::size_t>(n);
    at += static_cast<std::uint64_t>(n);
  }
}

void export_master(const fs::path& dir, const Metadata& m, const std::string& out_path) {
  check_tensor_names(m);
  // Tensors are stored back to back in parameter order (no padding): a tensor's data offset
  // is its canonical position.
  const std::vector<std::uint64_t> canonical = canonical_offsets(m);
  const std::uint64_t total = canonical.back();
  const std::string header = safetensors_header(m, canonical);
  const std::uint64_t data_start = 8 + header.size();

  // Written to a new temporary file of our own (never an existing one) and renamed over
  // OUTPUT, so a failed export leaves no partial output and touches nothing else.
  std::string tmp = out_path + ".tmp-XXXXXX";
  const int fd = ::mkstemp(tmp.data());
  if (fd < 0) io_fail("cannot create a temporary file like", tmp);
  try {
    const mode_t mask = ::umask(0);
    ::umask(mask);
    if (::fchmod(fd, 0666 & ~mask) != 0) io_fail("cannot set the mode of", tmp);
    const std::uint64_t header_len = header.size();  // little-endian u64, then the JSON
    pwrite_all(fd, &header_len, 8, 0, tmp);
    pwrite_all(fd, header.data(), header.size(), 8, tmp);
    const ChunkSink sink = [&](const Chunk& c) {
      if (c.array == FileArray::Master)
        pwrite_all(fd, c.values.data(), c.values.size() * 4, data_start + c.begin * 4, tmp);
    };
    const Range everything{0, static_cast<std::size_t>(total)};
    read_state(dir, m, std::span<const Range>(&everything, 1), sink);
    if (::fsync(fd) != 0) io_fail("cannot flush", tmp);
  } catch (...) {
    ::close(fd);
    ::unlink(tmp.c_str());
    throw;
  }
  if (::close(fd) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    errno = err;
    io_fail("cannot close", tmp);
  }
  if (::rename(tmp.c_str(), out_path.c_str()) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    errno = err;
    io_fail("cannot rename to " + out_path + ":", tmp);
  }
  std::printf("wrote %s: %zu tensors, %llu fp32 values, step %lld (saved at %u ranks, format %u)\n",
              out_path.c_str(), m.params.size(), static_cast<unsigned long long>(total),
              static_cast<long long>(m.step_count), m.world_size, m.version);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Writes the fp32 master weights of a shardopt checkpoint as one safetensors file, "
               "one tensor per parameter (shape [rows, cols] for a parameter registered with a 2-D "
               "shape, else [numel]), reading files only (no MPI). "
               "CHECKPOINT is a save directory (its LATEST checkpoint is used) or one "
               "checkpoint directory. See docs/checkpoint-format.md."};
  shardopt::cli::init(app, "shardopt-export");
  std::string checkpoint, output;
  bool list = false;
  app.add_option("CHECKPOINT", checkpoint, "save directory or checkpoint directory")->required();
  auto* out = app.add_option("OUTPUT", output, "the .safetensors file to write");
  app.add_flag("--list", list, "print the checkpoint's parameters instead of exporting")
      ->excludes(out);
  if (const int rc = shardopt::cli::parse(app, argc, argv); rc >= 0) return rc;
  if (!list && output.empty()) {
    std::fprintf(stderr, "shardopt-export: give OUTPUT, or --list (see --help)\n");
    return 2;
  }
  try {
    const fs::path dir = resolve_checkpoint_dir(checkpoint);
    const Metadata m = read_metadata(dir);
    if (list) {
      std::printf("checkpoint %s: format %u, step %lld, %u shards, stage %s, replica %s\n",
                  printable(dir.string()).c_str(), m.version,
                  static_cast<long long>(m.step_count), m.world_size, stage_name(m.stage),
                  dtype_name(m.param_dtype));
      // Names are bytes from the file: a NUL, newline or tab in one is shown as \xNN, so
      // every line is one whole parameter.
      for (const MetaParam& p : m.params)
        std::printf("%s\t%llu\tgroup %u\n", printable(p.name).c_str(),
                    static_cast<unsigned long long>(p.numel), p.group);
      return 0;
    }
    export_master(dir, m, output);
    return 0;
  } catch (const Error& e) {
    std::fprintf(stderr, "shardopt-export: %s (%s)\n", e.what(), status_name(e.status()));
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "shardopt-export: %s\n", e.what());
    return 1;
  }
}
