! test_fortran_mpi.f90: the Fortran module's entry points added for parity with the C++ API
! (issue 13), under mpiexec with an mpi_f08 communicator: the config layout and every new
! field, the communicator kind, groups, kept replica pointers with lazy gathering and the
! documented waits, the flat replica and offsets, m and v, loss scaling, progress, and
! checkpoints (save, load, IO and CORRUPT_DATA on every rank).
program test_fortran_mpi
  use, intrinsic :: iso_c_binding, only: c_float, c_double, c_int, c_int64_t, c_sizeof
  use mpi_f08
  use shardopt
  implicit none
  type(shardopt_optimizer) :: opt, other
  type(shardopt_config) :: cfg, got
  type(shardopt_step_result) :: r
  real(c_float), pointer :: w(:, :), flat(:)
  real(c_float), allocatable :: master(:, :), m(:, :), v(:, :), g(:, :), bias(:), saved(:, :)
  integer(c_int64_t) :: off, good, skipped, steps
  real(c_double) :: scale, lr_scale
  logical :: wd
  integer :: status, iw, ib, grp, ngroups, rank, world, step, i, j, failures, unit, total
  character(len=:), allocatable :: name
  character(len=512) :: msg, where, dir

  call mpi_init()
  call mpi_comm_rank(MPI_COMM_WORLD, rank)
  call mpi_comm_size(MPI_COMM_WORLD, world)
  failures = 0

  call shardopt_config_init(cfg, status)
  if (cfg%struct_size /= c_sizeof(cfg)) call fail('the module''s config differs from the C struct', &
                                                  int(cfg%struct_size))
  cfg%stage = SHARDOPT_STAGE_ZERO2
  cfg%param_dtype = SHARDOPT_DTYPE_F32
  cfg%bucket_elems = 256
  cfg%lr = 1e-2_c_double
  cfg%comm_kind = SHARDOPT_COMM_MPI
  cfg%gather_mode = SHARDOPT_GATHER_LAZY
  cfg%overlap = 1
  cfg%buckets_in_flight = 3
  cfg%loss_scaling = 1
  cfg%loss_scale_initial = 256
  cfg%loss_scale_growth_interval = 1000
  call shardopt_create(opt, status, config=cfg, comm=MPI_COMM_WORLD%MPI_VAL, errmsg=msg)
  call expect(status, SHARDOPT_SUCCESS, msg, '')
  call shardopt_get_config(opt, got, status, msg)
  call expect(status, SHARDOPT_SUCCESS, msg, '')
  if (got%gather_mode /= SHARDOPT_GATHER_LAZY .or. got%buckets_in_flight /= 3 .or. &
      got%comm_kind /= SHARDOPT_COMM_MPI .or. got%loss_scale_initial /= 256 .or. &
      got%bucket_elems /= 256) call fail('get_config did not return the config', 0)
  call shardopt_comm_name(opt, name, status, msg)
  if (name /= 'mpi') call fail('comm_name is not mpi: '//name, 0)

  call shardopt_add_group(opt, 0.5_c_double, .false., grp, status, msg)
  call shardopt_add_param(opt, 'w', 40 * 30, iw, status, errmsg=msg)
  call shardopt_add_param(opt, 'b', 70, ib, status, group=grp, errmsg=msg)
  call shardopt_finalize(opt, status, msg)
  call expect(status, SHARDOPT_SUCCESS, msg, '')
  call shardopt_num_groups(opt, ngroups, status, msg)
  if (ngroups /= 2) call fail('num_groups', ngroups)
  call shardopt_get_group(opt, grp, lr_scale, wd, status, msg)
  if (lr_scale /= 0.5_c_double .or. wd) call fail('get_group', grp)

  allocate (master(40, 30), m(40, 30), v(40, 30), g(40, 30), bias(70), saved(40, 30))
  do j = 1, 30
    do i = 1, 40
      master(i, j) = real(i - j, c_float) / 64
    end do
  end do
  call shardopt_set_param(opt, iw, master, status, msg)
  bias = 0.25
  call shardopt_set_param(opt, ib, bias, status, msg)
  ! Fetched once and kept, as a trainer does.
  call shardopt_param(opt, iw, w, [40, 30], status, msg)
  call expect(status, SHARDOPT_SUCCESS, msg, '')
  call shardopt_replica(opt, flat, status, msg)
  call expect(status, SHARDOPT_SUCCESS, msg, '')
  call shardopt_param_offset(opt, iw, off, status, msg)
  if (mod(off, 64_c_int64_t) /= 0) call fail('offset not aligned', int(off))

  do step = 1, 3
    do j = 1, 30
      do i = 1, 40
        ! Scaled by the loss scale, as a trainer's backward of loss * scale would be.
        g(i, j) = 256 * real(mod(i * 7 + j * 3 + step + rank, 11) - 5, c_float) / 1024
      end do
    end do
    call shardopt_accumulate_grad(opt, ib, 256 * bias, status, msg)
    call shardopt_grad_ready(opt, ib, status, msg)
    call shardopt_progress(opt, status, msg)
    call expect(status, SHARDOPT_SUCCESS, msg, '')
    call shardopt_accumulate_grad(opt, iw, g, status, msg)
    call shardopt_grad_ready(opt, iw, status, msg)
    call shardopt_step(opt, status, result=r, errmsg=msg)
    call expect(status, SHARDOPT_SUCCESS, msg, '')
    if (r%loss_scale /= 256 .or. r%step /= step .or. r%time_total < r%time_update) &
      call fail('step result', step)
    ! Lazy gathering: wait as documented, then the kept pointers read the new values.
    if (step == 2) then
      call shardopt_wait_all(opt, status, msg)
    else
      call shardopt_wait_param(opt, iw, status, msg)
    end if
    call expect(status, SHARDOPT_SUCCESS, msg, '')
    saved = w
    call shardopt_get_master(opt, iw, master, status, msg)
    call expect(status, SHARDOPT_SUCCESS, msg, '')
    if (any(saved /= master)) call fail('kept pointer is stale after the wait, step', step)
    if (any(reshape(flat(off + 1:off + 1200), [40, 30]) /= master)) call fail('flat replica', step)
  end do

  ! m after three steps is nonzero and v >= 0; both gathered on every rank alike.
  call shardopt_get_exp_avg(opt, iw, m, status, msg)
  call expect(status, SHARDOPT_SUCCESS, msg, '')
  call shardopt_get_exp_avg_sq(opt, iw, v, status, msg)
  call expect(status, SHARDOPT_SUCCESS, msg, '')
  if (all(m == 0) .or. any(v < 0)) call fail('moments', 0)
  call shardopt_get_exp_avg(opt, iw, m(1:3, 1:3), status, msg)
  call expect(status, SHARDOPT_ERROR_INVALID_ARGUMENT, msg, 'elements')

  call shardopt_get_loss_scale(opt, scale, good, skipped, status, msg)
  if (scale /= 256 .or. good /= 3 .or. skipped /= 0) call fail('loss scale state', int(good))
  call shardopt_set_loss_scale(opt, 512.0_c_double, 0_c_int64_t, 0_c_int64_t, status, msg)
  call expect(status, SHARDOPT_SUCCESS, msg, '')
  call shardopt_set_loss_scale(opt, -1.0_c_double, 0_c_int64_t, 0_c_int64_t, status, msg)
  call expect(status, SHARDOPT_ERROR_INVALID_ARGUMENT, msg, 'loss')

  ! ---- checkpoints: saved at this rank count, loaded by a fresh optimizer at stage 1 ----
  dir = ''
  if (rank == 0) write (dir, '(a,i0)') '/tmp/shardopt_fortran_mpi_', getpid_of_rank0()
  call mpi_bcast(dir, len(dir), MPI_CHARACTER, 0, MPI_COMM_WORLD)
  call shardopt_save_checkpoint(opt, trim(dir), status, keep=1, published=where, errmsg=msg)
  call expect(status, SHARDOPT_SUCCESS, msg, '')
  if (index(where, trim(dir)) /= 1) call fail('published path: '//trim(where), 0)
  call shardopt_get_master(opt, iw, saved, status, msg)

  cfg%stage = SHARDOPT_STAGE_ZERO1
  cfg%gather_mode = SHARDOPT_GATHER_EAGER
  call shardopt_create(other, status, config=cfg, comm=MPI_COMM_WORLD%MPI_VAL, errmsg=msg)
  call shardopt_add_group(other, 0.5_c_double, .false., grp, status, msg)
  call shardopt_add_param(other, 'w', 40 * 30, iw, status, errmsg=msg)
  call shardopt_add_param(other, 'b', 70, ib, status, group=grp, errmsg=msg)
  call shardopt_finalize(other, status, msg)
  call shardopt_load_checkpoint(other, trim(dir)//'/missing', status, msg)
  call expect(status, SHARDOPT_ERROR_IO, msg, 'shardopt_load_checkpoint')
  call shardopt_load_checkpoint(other, trim(dir), status, msg)
  call expect(status, SHARDOPT_SUCCESS, msg, '')
  call shardopt_step_count(other, steps, status, msg)
  if (steps /= 3) call fail('step count after load', int(steps))
  call shardopt_get_master(other, iw, master, status, msg)
  if (any(master /= saved)) call fail('master after load', 0)
  call shardopt_get_loss_scale(other, scale, good, skipped, status, msg)
  if (scale /= 512) call fail('loss scale after load', int(scale))
  ! A LATEST file that names no checkpoint directory: corrupt data, on every rank.
  if (rank == 0) then
    open (newunit=unit, file=trim(dir)//'/LATEST', status='replace', action='write')
    write (unit, '(a)') 'not/a/checkpoint'
    close (unit)
  end if
  call mpi_barrier(MPI_COMM_WORLD)
  call shardopt_load_checkpoint(other, trim(dir), status, msg)
  call expect(status, SHARDOPT_ERROR_CORRUPT_DATA, msg, 'LATEST')
  call shardopt_destroy(other, status, msg)
  call shardopt_destroy(opt, status, msg)
  call expect(status, SHARDOPT_SUCCESS, msg, '')
  if (rank == 0) call execute_command_line('rm -rf '//trim(dir))

  call mpi_allreduce(failures, total, 1, MPI_INTEGER, MPI_SUM, MPI_COMM_WORLD)
  call mpi_finalize()
  if (total > 0) error stop 1
  if (rank == 0) print '(a)', 'test_fortran_mpi: all checks passed'

contains

  !> A number that makes the scratch directory unique to this run (rank 0's process id).
  integer function getpid_of_rank0()
    interface
      function c_getpid() bind(c, name='getpid')
        import :: c_int
        integer(c_int) :: c_getpid
      end function c_getpid
    end interface
    getpid_of_rank0 = int(c_getpid())
  end function getpid_of_rank0

  subroutine fail(what, value)
    character(len=*), intent(in) :: what
    integer, intent(in) :: value
    print '(a,i0,a,a,a,i0)', '[rank ', rank, '] FAILED: ', what, ' ', value
    failures = failures + 1
  end subroutine fail

  subroutine expect(status, want, msg, fragment)
    integer, intent(in) :: status, want
    character(len=*), intent(in) :: msg, fragment
    if (status /= want) then
      print '(a,i0,a,i0,a,i0,a,a)', '[rank ', rank, '] FAILED: status ', status, ' (want ', want, '): ', &
        trim(msg)
      failures = failures + 1
    else if (index(msg, fragment) == 0) then
      print '(a,i0,a,a,a,a)', '[rank ', rank, '] FAILED: message "', trim(msg), '" lacks ', fragment
      failures = failures + 1
    end if
  end subroutine expect

end program test_fortran_mpi
