// proc_memory.hpp: what this process holds, from /proc/self (Linux): RSS, PSS, anonymous and
// shared memory, and the peak RSS. Used by the memory-scaling benchmark and its test.
#pragma once

#include <cstddef>
#include <fstream>
#include <map>
#include <string>

#include "shardopt/error.hpp"

namespace shardopt::bench {

// RSS counts every resident page the process maps, a page shared by k processes once in each
// of them; PSS (proportional set size) counts it 1/k in each, so PSS summed over the ranks of
// a node is what the node holds. Anonymous: private memory (heap, mmap); shmem: shared memory
// (MPI-3 shared windows, MPICH's own segments).
struct ProcMemory {
  std::size_t rss = 0, hwm = 0, rss_anon = 0, rss_shmem = 0, pss = 0, pss_anon = 0, pss_shmem = 0;
};

// Fields of a /proc/self file ("Key:   123 kB" lines), in bytes.
inline std::map<std::string, std::size_t> proc_fields(const char* path) {
  std::ifstream in(path);
  std::map<std::string, std::size_t> out;
  for (std::string line; std::getline(in, line);) {
    const std::size_t colon = line.find(':');
    if (colon == std::string::npos || line.find(" kB") == std::string::npos) continue;
    out[line.substr(0, colon)] = std::stoull(line.substr(colon + 1)) * 1024;
  }
  return out;
}

// What this process holds now; throws Error(Io) when the kernel does not report a field
// (smaps_rollup needs Linux 4.14).
inline ProcMemory measure_process_memory() {
  constexpr const char* kStatus = "/proc/self/status";
  constexpr const char* kRollup = "/proc/self/smaps_rollup";
  const auto status = proc_fields(kStatus);
  const auto rollup = proc_fields(kRollup);
  auto field = [](const std::map<std::string, std::size_t>& f, const char* path, const char* key) {
    const auto it = f.find(key);
    if (it == f.end()) throw Error(Status::Io, std::string("no ") + key + " in " + path);
    return it->second;
  };
  ProcMemory m;
  m.rss = field(status, kStatus, "VmRSS");
  m.hwm = field(status, kStatus, "VmHWM");
  m.rss_anon = field(status, kStatus, "RssAnon");
  m.rss_shmem = field(status, kStatus, "RssShmem");
  m.pss = field(rollup, kRollup, "Pss");
  m.pss_anon = field(rollup, kRollup, "Pss_Anon");
  m.pss_shmem = field(rollup, kRollup, "Pss_Shmem");
  return m;
}

}  // namespace shardopt::bench
