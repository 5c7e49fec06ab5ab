// fake_control.hpp: what tests of the fake device can ask it (tests/fake_cuda).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "cuda_runtime_api.h"
#include "nccl.h"

namespace fakecuda {

/// One line of the fake's log: an op queued, or a host wait/query on device work.
struct LogEntry {
  enum Kind { Queued, HostSync, HostQuery } kind;
  std::uint64_t op;    ///< Queued: the op's id
  std::string name;    ///< op name ("kernel adam_update", "ncclAllGather", "memcpy HtoD", ...)
  int stream;          ///< Queued: stream id (0: the legacy default stream)
};

/// Position in the log; entries from a position on.
std::size_t log_mark();
std::vector<LogEntry> log_since(std::size_t mark);
/// True when op a is ordered before op b (a must complete before b starts).
bool happens_before(std::uint64_t a, std::uint64_t b);

/// Races and misuse: abort with the message (the default, so that any test of the suite
/// fails on one), or collect them.
void set_collect_problems(bool collect);
std::vector<std::string> take_problems();

/// cudaOccupancyMaxActiveBlocksPerMultiprocessor calls so far, and the fake's answer.
int occupancy_queries();
inline constexpr int kFakeBlocksPerSm = 5;
inline constexpr int kFakeSmCount = 132;
/// The launch shape of the last grid-stride kernel.
struct Launch {
  unsigned blocks = 0, threads = 0;
};
Launch last_grid_stride_launch();

/// Queues on `stream` an op that completes `seconds` after it starts (a kernel that runs that
/// long, as far as the stream's order is concerned).
void hold_stream(cudaStream_t stream, double seconds);

/// Makes ncclCommGetAsyncError report `error` on every NCCL communicator of this process.
void nccl_inject_async_error(ncclResult_t error);

}  // namespace fakecuda
