// mpi_util.hpp: what every MPI-based communicator needs: MPI errors as shardopt::Error,
// CommType -> MPI_Datatype, and the int-count check. Internal.
#pragma once

#include <mpi.h>

#include <climits>
#include <cstddef>
#include <string>

#include "shardopt/comm.hpp"

namespace shardopt::mpi {

inline void check(int rc, const char* call) {
  if (rc == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, text, &len);
  throw Error(Status::Communication, std::string(call) + " failed: " + std::string(text, len));
}

inline MPI_Datatype datatype(CommType t) {
  switch (t) {
    case CommType::F32: return MPI_FLOAT;
    case CommType::F64: return MPI_DOUBLE;
    case CommType::U16:
    case CommType::BF16: return MPI_UINT16_T;
    case CommType::U8: return MPI_BYTE;
  }
  return MPI_DATATYPE_NULL;
}

inline std::size_t type_size(CommType t) {
  switch (t) {
    case CommType::F64: return 8;
    case CommType::F32: return 4;
    case CommType::U16:
    case CommType::BF16: return 2;
    case CommType::U8: return 1;
  }
  return 1;
}

// MPI-3 counts are int.
inline int checked_int(std::size_t n, const char* what) {
  if (n > static_cast<std::size_t>(INT_MAX))
    throw Error(Status::Unsupported,
                std::string(what) + ": count " + std::to_string(n) + " exceeds the MPI int limit");
  return static_cast<int>(n);
}

// How many tags point-to-point messages may use: MPI_TAG_UB + 1 (at least 32768); INT_MAX
// before MPI_Init (the communicator refuses to be made then).
inline int tag_space() {
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (!initialized) return INT_MAX;
  void* v = nullptr;
  int flag = 0;
  MPI_Comm_get_attr(MPI_COMM_WORLD, MPI_TAG_UB, &v, &flag);
  const int ub = flag ? *static_cast<int*>(v) : 32767;
  return ub == INT_MAX ? INT_MAX : ub + 1;
}

class Watchdog;  // mpi_watchdog.hpp

/// The plain communicator: MPI collectives on a duplicate of `comm` (mpi_comm.cpp), at most
/// `in_flight` non-blocking ones started at once, waiting under `watchdog` (which it attaches
/// to its duplicate). `direct`: fp32 reduce-scatters as the direct exchange
/// (MpiExchange::Direct; in_flight must then stay below tag_space()).
std::shared_ptr<Communicator> make_plain_communicator(MPI_Comm comm, std::size_t in_flight,
                                                      std::shared_ptr<Watchdog> watchdog,
                                                      bool direct = false);

}  // namespace shardopt::mpi

#define SHARDOPT_MPI(call) ::shardopt::mpi::check((call), #call)
