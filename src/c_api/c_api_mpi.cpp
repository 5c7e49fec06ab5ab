// c_api_mpi.cpp: the MPI creation entry points (built when shardopt has MPI).
#include <mpi.h>

#include "handle.hpp"
#include "shardopt/mpi_comm.hpp"

using namespace shardopt;

extern "C" {

shardopt_status_t shardopt_create_mpi(shardopt_optimizer_t* opt, MPI_Comm comm,
                                      const shardopt_config_t* config) {
  if (opt != nullptr) *opt = nullptr;
  return capi::guarded("shardopt_create_mpi", nullptr,
                       [&] { capi::create_on(make_mpi_communicator(comm), opt, config); });
}

shardopt_status_t shardopt_create_mpi_f(shardopt_optimizer_t* opt, int fortran_comm,
                                        const shardopt_config_t* config) {
  if (opt != nullptr) *opt = nullptr;
  return capi::guarded("shardopt_create_mpi_f", nullptr, [&] {
    int initialized = 0;
    MPI_Initialized(&initialized);
    require(initialized != 0, Status::InvalidState, "MPI is not initialised");
    const MPI_Comm comm = MPI_Comm_f2c(static_cast<MPI_Fint>(fortran_comm));
    require(comm != MPI_COMM_NULL, Status::InvalidArgument, "the Fortran communicator is MPI_COMM_NULL");
    capi::create_on(make_mpi_communicator(comm), opt, config);
  });
}

}  // extern "C"
