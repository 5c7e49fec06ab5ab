// c_api_no_mpi.cpp: the always-declared MPI entry point of a library built without MPI.
#include "handle.hpp"

extern "C" shardopt_status_t shardopt_create_mpi_f(shardopt_optimizer_t* opt, int,
                                                   const shardopt_config_t*) {
  if (opt != nullptr) *opt = nullptr;
  return shardopt::capi::record_failure(
      nullptr, "shardopt_create_mpi_f", shardopt::Status::Unsupported,
      "shardopt was built without MPI (configure with SHARDOPT_MPI=ON)");
}
