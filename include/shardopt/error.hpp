// error.hpp: the one exception type of the C++ API, carrying a status code for the C ABI.
#pragma once

#include <stdexcept>
#include <string>

namespace shardopt {

/// Error categories; the C ABI maps them one to one onto shardopt_status_t.
enum class Status : int {
  Ok = 0,
  InvalidArgument = 1,   ///< bad size, name, index or hyperparameter
  InvalidState = 2,      ///< call made in the wrong order (e.g. step before finalize)
  LayoutMismatch = 3,    ///< ranks registered different parameters
  RemoteError = 4,       ///< another rank failed in a collective call
  Communication = 5,     ///< MPI / NCCL reported an error
  OutOfMemory = 6,
  Io = 7,                ///< file could not be read or written
  CorruptData = 8,       ///< checkpoint failed validation
  Unsupported = 9,       ///< feature not built in (e.g. CUDA without nvcc)
  Cuda = 10,
  Internal = 11,
};

const char* status_name(Status s) noexcept;

class Error : public std::runtime_error {
 public:
  Error(Status status, const std::string& message)
      : std::runtime_error(message), status_(status) {}
  Status status() const noexcept { return status_; }

 private:
  Status status_;
};

/// Throws Error(status, message) when cond is false. For argument checks at API entry points.
inline void require(bool cond, Status status, const std::string& message) {
  if (!cond) throw Error(status, message);
}

}  // namespace shardopt
