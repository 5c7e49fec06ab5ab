! consumer_f08.f90: a program that uses mpi_f08 itself next to the installed Fortran module.
! shardopt::fortran and shardopt-fortran.pc bring only the C MPI library (the module reaches
! MPI through the C ABI), so this program needs MPI's Fortran bindings as well: mpif90, or
! MPI::MPI_Fortran in CMake (docs/packaging.md). run.cmake checks both ways and that it does
! not link without them.
program consumer_f08
  use mpi_f08
  use shardopt
  implicit none
  type(shardopt_optimizer) :: opt
  integer :: status, rank, w, n
  character(len=256) :: msg

  call mpi_init()
  call mpi_comm_rank(MPI_COMM_WORLD, rank)
  call shardopt_create(opt, status, comm=MPI_COMM_WORLD%MPI_VAL, errmsg=msg)
  if (status == SHARDOPT_SUCCESS) call shardopt_add_param(opt, 'w', 4, w, status, errmsg=msg)
  if (status == SHARDOPT_SUCCESS) call shardopt_finalize(opt, status, msg)
  if (status == SHARDOPT_SUCCESS) call shardopt_comm_size(opt, n, status, msg)
  if (status /= SHARDOPT_SUCCESS) then
    print '(a,a)', 'consumer_f08: ', trim(msg)
    error stop 1
  end if
  call shardopt_destroy(opt, status)
  call mpi_finalize()
  print '(a,i0,a,i0)', 'consumer_f08: rank ', rank, ' of ', n
end program consumer_f08
