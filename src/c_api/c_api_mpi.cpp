// c_api_mpi.cpp: the MPI creation entry points (built when shardopt has MPI).
#include <mpi.h>

#include <vector>

#include "handle.hpp"
#include "shardopt/mpi_comm.hpp"

using namespace shardopt;

static_assert(SHARDOPT_COMM_AUTO == static_cast<int>(MpiCommKind::Auto));
static_assert(SHARDOPT_COMM_MPI == static_cast<int>(MpiCommKind::Plain));
static_assert(SHARDOPT_COMM_SHM == static_cast<int>(MpiCommKind::SharedMemory));

namespace {

// Collective over `comm`. The config is agreed on over a plain duplicate first (a bad config
// on one rank fails every rank, whatever communicator it asked for); then the communicator
// the config chose is built (make_mpi_communicator checks that every rank chose the same).
void create_over(MPI_Comm comm, const shardopt_config_t* config, shardopt_optimizer_t* out) {
  const capi::CreateRequest request = capi::read_config(config, out);
  std::shared_ptr<Communicator> plain =
      make_mpi_communicator(comm, MpiCommOptions{MpiCommKind::Plain, 0, request.mpi_in_flight});
  capi::agree_on_request(*plain, request);
  // Every rank must build the same kind of communicator, or they would wait in different
  // collectives: compare the choices first (all ranks see the same table, so all agree).
  const int mine[2] = {request.comm_kind, request.simulate_nodes};
  std::vector<int> all(2 * static_cast<std::size_t>(plain->size()));
  plain->all_gather_bytes(mine, all.data(), sizeof mine);
  for (std::size_t r = 0; r < all.size(); r += 2)
    require(all[r] == all[0] && all[r + 1] == all[1], Status::InvalidArgument,
            "ranks chose different communicators (config->comm_kind or "
            "config->comm_simulate_nodes differ)");
  std::shared_ptr<Communicator> chosen =
      request.comm_kind == SHARDOPT_COMM_MPI
          ? std::move(plain)
          : make_mpi_communicator(comm, MpiCommOptions{static_cast<MpiCommKind>(request.comm_kind),
                                                       request.simulate_nodes,
                                                       request.mpi_in_flight});
  capi::create_on(std::move(chosen), request, out);
}

}  // namespace

extern "C" {

shardopt_status_t shardopt_create_mpi(shardopt_optimizer_t* opt, MPI_Comm comm,
                                      const shardopt_config_t* config) {
  if (opt != nullptr) *opt = nullptr;
  return capi::guarded("shardopt_create_mpi", nullptr, [&] { create_over(comm, config, opt); });
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
    create_over(comm, config, opt);
  });
}

}  // extern "C"
