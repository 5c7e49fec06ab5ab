/* consumer_mpi.c: shardopt.h included before <mpi.h>, as a pkg-config user writes it; built
 * with -Werror=implicit-function-declaration, so shardopt_create_mpi must be declared by the
 * header alone. One step on MPI_COMM_WORLD (a singleton without mpiexec). */
#include <shardopt/shardopt.h>

#include <stdio.h>

int main(int argc, char** argv) {
  shardopt_optimizer_t opt = NULL;
  float grad[2] = {0.5f, -2.0f};
  int ok;
  MPI_Init(&argc, &argv);
  ok = shardopt_create_mpi(&opt, MPI_COMM_WORLD, NULL) == SHARDOPT_SUCCESS &&
       shardopt_add_param(opt, "w", 2, 0, NULL) == SHARDOPT_SUCCESS &&
       shardopt_finalize(opt) == SHARDOPT_SUCCESS &&
       shardopt_accumulate_grad_f32(opt, 0, grad, 2) == SHARDOPT_SUCCESS &&
       shardopt_step(opt, NULL) == SHARDOPT_SUCCESS;
  if (!ok) fprintf(stderr, "consumer_mpi: %s\n", shardopt_last_error(opt));
  shardopt_destroy(opt);
  MPI_Finalize();
  if (ok) printf("consumer_mpi: shardopt_create_mpi works\n");
  return ok ? 0 : 1;
}
