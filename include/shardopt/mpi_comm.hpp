// mpi_comm.hpp: the MPI communicator (host buffers). Only available when shardopt was built
// with MPI (SHARDOPT_WITH_MPI); includes <mpi.h>.
#pragma once

#include <mpi.h>

#include <memory>

#include "shardopt/comm.hpp"

namespace shardopt {

/// Duplicates `comm` (so the library's traffic never matches the caller's) and sets it to
/// return errors, which become Error(Status::Communication) naming the MPI call.
/// MPI must be initialised, and stay so until the returned object is destroyed.
std::shared_ptr<Communicator> make_mpi_communicator(MPI_Comm comm);

}  // namespace shardopt
