! test_fortran_mpi.f90: the Fortran module's entry points added for parity with the C++ API
! (issue 13), under mpiexec with an mpi_f08 communicator: the config layout and every new
! field, the communicator kind, groups, kept replica pointers with lazy gathering and the
! documented waits, the flat replica and offsets, m and v, loss scaling, progress, and
! checkpoints (save, load, IO and CORRUPT_DATA on every rank); and stage 3's unit calls
! (issue 17): begin_unit, num_units, acquire / prefetch / release, their errors, and training
! at stage 3 equal to stage 2 on the same units bit for bit (exactly summable gradients);
! index 0 in a collective on one rank only (issue 27).
program test_fortran_mpi
  use, intrinsic :: iso_c_binding, only: c_float, c_double, c_int, c_int16_t, c_int64_t, c_sizeof
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
  ! Index 0 on the last rank only, in a collective: that rank hears that Fortran indices start
  ! at 1, the others which rank gave an index below 1; none is left waiting.
  call shardopt_get_exp_avg(opt, merge(0, iw, rank == world - 1), m, status, msg)
  if (rank == world - 1) then
    call expect(status, SHARDOPT_ERROR_INVALID_ARGUMENT, msg, &
                'shardopt_get_exp_avg: parameter index 0: Fortran indices start at 1 (have 2)')
  else
    write (where, '(a,i0,a)') 'shardopt_get_exp_avg: rank ', world - 1, &
      ': no parameter index < 1 (Fortran indices start at 1) (there are 2)'
    call expect(status, SHARDOPT_ERROR_INVALID_ARGUMENT, msg, trim(where))
  end if

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

  call check_stage3()

  call mpi_allreduce(failures, total, 1, MPI_INTEGER, MPI_SUM, MPI_COMM_WORLD)
  call mpi_finalize()
  if (total > 0) error stop 1
  if (rank == 0) print '(a)', 'test_fortran_mpi: all checks passed'

contains

  !> Stage 3 next to stage 2 on the same layout: three units {a b} {c} {d}. The forward
  !> acquires unit u with u + 1 prefetched and reads its parameters (equal to stage 2's replica
  !> bit for bit); the backward acquires units in reverse order with u - 1 prefetched and hands
  !> over their gradients, multiples of 2**-10 (exact sums in any order). After three steps
  !> the master weights are equal bit for bit.
  subroutine check_stage3()
    type(shardopt_optimizer) :: z2, z3
    type(shardopt_config) :: c
    integer(c_int16_t), pointer :: p2(:), p3(:)
    real(c_float), allocatable :: g(:), m2(:), m3(:)
    integer, parameter :: n_params = 4
    integer, parameter :: sizes(n_params) = [300, 70, 1200, 5], unit_of(n_params) = [1, 1, 2, 3]
    integer :: idx(n_params), first(3), last(3), u, nu, p, k, s
    call shardopt_config_init(c, status)
    c%stage = SHARDOPT_STAGE_ZERO2
    c%bucket_elems = 256
    c%lr = 1e-2_c_double
    call shardopt_create(z2, status, config=c, comm=MPI_COMM_WORLD%MPI_VAL, errmsg=msg)
    call expect(status, SHARDOPT_SUCCESS, msg, '')
    c%stage = SHARDOPT_STAGE_ZERO3
    call shardopt_create(z3, status, config=c, comm=MPI_COMM_WORLD%MPI_VAL, errmsg=msg)
    call expect(status, SHARDOPT_SUCCESS, msg, '')
    first = 0
    do p = 1, n_params
      if (p == 1 .or. unit_of(max(p - 1, 1)) /= unit_of(p)) then
        ! A unit without parameters yet is reused: the first call gives unit 1.
        call shardopt_begin_unit(z2, status, errmsg=msg)
        call expect(status, SHARDOPT_SUCCESS, msg, '')
        call shardopt_begin_unit(z3, status, unit=u, errmsg=msg)
        call expect(status, SHARDOPT_SUCCESS, msg, '')
        if (u /= unit_of(p)) call fail('begin_unit returned unit', u)
        first(u) = p
      end if
      last(unit_of(p)) = p
      call shardopt_add_param(z2, 'p'//achar(iachar('0') + p), sizes(p), idx(p), status, errmsg=msg)
      call shardopt_add_param(z3, 'p'//achar(iachar('0') + p), sizes(p), idx(p), status, errmsg=msg)
      call expect(status, SHARDOPT_SUCCESS, msg, '')
    end do
    call shardopt_num_units(z3, nu, status, msg)
    call expect(status, SHARDOPT_ERROR_INVALID_STATE, msg, 'finalize')
    call shardopt_finalize(z2, status, msg)
    call expect(status, SHARDOPT_SUCCESS, msg, '')
    call shardopt_finalize(z3, status, msg)
    call expect(status, SHARDOPT_SUCCESS, msg, '')
    call shardopt_num_units(z3, nu, status, msg)
    if (status /= SHARDOPT_SUCCESS .or. nu /= 3) call fail('num_units', nu)
    call shardopt_begin_unit(z3, status, errmsg=msg)
    call expect(status, SHARDOPT_ERROR_INVALID_STATE, msg, '')
    do p = 1, n_params
      allocate (g(sizes(p)))
      do k = 1, sizes(p)
        g(k) = real(mod(k * 13 + p * 5, 17) - 8, c_float) / 32
      end do
      call shardopt_set_param(z2, idx(p), g, status, msg)
      call shardopt_set_param(z3, idx(p), g, status, msg)
      call expect(status, SHARDOPT_SUCCESS, msg, '')
      deallocate (g)
    end do

    ! ---- the unit calls' errors (the same calls on every rank, so no rank waits) ----
    call shardopt_param_bf16(z3, idx(3), p3, status, msg)
    call expect(status, SHARDOPT_ERROR_INVALID_STATE, msg, 'not acquired')
    call shardopt_release(z3, 2, status, msg)  ! messages name units by their C index
    call expect(status, SHARDOPT_ERROR_INVALID_STATE, msg, 'unit 1 is not acquired')
    call shardopt_acquire(z3, 1, status, msg)
    call expect(status, SHARDOPT_SUCCESS, msg, '')
    call shardopt_acquire(z3, 1, status, msg)
    call expect(status, SHARDOPT_ERROR_INVALID_STATE, msg, 'already acquired')
    call shardopt_prefetch(z3, 2, status, msg)
    call expect(status, SHARDOPT_SUCCESS, msg, '')
    call shardopt_release(z3, 2, status, msg)  ! prefetched, not acquired
    call expect(status, SHARDOPT_ERROR_INVALID_STATE, msg, 'not acquired')
    call shardopt_prefetch(z3, 3, status, msg)  ! both buffers (units_in_flight = 2) held
    call expect(status, SHARDOPT_ERROR_INVALID_STATE, msg, 'units_in_flight')
    call shardopt_step(z3, status, errmsg=msg)
    call expect(status, SHARDOPT_ERROR_INVALID_STATE, msg, '')
    call shardopt_acquire(z3, 0, status, msg)
    call expect(status, SHARDOPT_ERROR_INVALID_ARGUMENT, msg, &
                'shardopt_acquire: unit index 0: Fortran indices start at 1 (have 3)')
    call shardopt_acquire(z3, 4, status, msg)
    call expect(status, SHARDOPT_ERROR_INVALID_ARGUMENT, msg, 'out of range')
    call shardopt_release(z3, 1, status, msg)
    call expect(status, SHARDOPT_SUCCESS, msg, '')
    call shardopt_acquire(z3, 2, status, msg)  ! in flight since the prefetch
    call expect(status, SHARDOPT_SUCCESS, msg, '')
    call shardopt_release(z3, 2, status, msg)
    call expect(status, SHARDOPT_SUCCESS, msg, '')
    call shardopt_acquire(z2, 1, status, msg)
    call expect(status, SHARDOPT_ERROR_INVALID_STATE, msg, '')

    ! ---- training: stage 3 equals stage 2 ----
    do s = 1, 3
      call shardopt_acquire(z3, 1, status, msg)
      call expect(status, SHARDOPT_SUCCESS, msg, '')
      do u = 1, 3
        if (u < 3) then
          call shardopt_prefetch(z3, u + 1, status, msg)
          call expect(status, SHARDOPT_SUCCESS, msg, '')
        end if
        do p = first(u), last(u)
          call shardopt_param_bf16(z2, idx(p), p2, status, msg)
          call shardopt_param_bf16(z3, idx(p), p3, status, msg)
          call expect(status, SHARDOPT_SUCCESS, msg, '')
          if (status == SHARDOPT_SUCCESS) then
            if (size(p3) /= sizes(p) .or. any(p2 /= p3)) call fail('stage-3 parameter differs', p)
          end if
        end do
        call shardopt_release(z3, u, status, msg)
        call expect(status, SHARDOPT_SUCCESS, msg, '')
        if (u < 3) then
          call shardopt_acquire(z3, u + 1, status, msg)
          call expect(status, SHARDOPT_SUCCESS, msg, '')
        end if
      end do
      do u = 3, 1, -1
        call shardopt_acquire(z3, u, status, msg)
        call expect(status, SHARDOPT_SUCCESS, msg, '')
        if (u > 1) then
          call shardopt_prefetch(z3, u - 1, status, msg)
          call expect(status, SHARDOPT_SUCCESS, msg, '')
        end if
        do p = last(u), first(u), -1
          allocate (g(sizes(p)))
          do k = 1, sizes(p)
            g(k) = real(mod(k * 7 + p * 3 + s * 5 + rank * 11, 23) - 11, c_float) / 1024
          end do
          call shardopt_accumulate_grad(z2, idx(p), g, status, msg)
          call shardopt_grad_ready(z2, idx(p), status, msg)
          call shardopt_accumulate_grad(z3, idx(p), g, status, msg)
          call expect(status, SHARDOPT_SUCCESS, msg, '')
          call shardopt_grad_ready(z3, idx(p), status, msg)
          call expect(status, SHARDOPT_SUCCESS, msg, '')
          deallocate (g)
        end do
        call shardopt_release(z3, u, status, msg)
        call expect(status, SHARDOPT_SUCCESS, msg, '')
      end do
      call shardopt_step(z2, status, errmsg=msg)
      call expect(status, SHARDOPT_SUCCESS, msg, '')
      call shardopt_step(z3, status, errmsg=msg)
      call expect(status, SHARDOPT_SUCCESS, msg, '')
    end do
    do p = 1, n_params
      allocate (m2(sizes(p)), m3(sizes(p)))
      call shardopt_get_master(z2, idx(p), m2, status, msg)
      call shardopt_get_master(z3, idx(p), m3, status, msg)
      call expect(status, SHARDOPT_SUCCESS, msg, '')
      if (any(transfer(m2, [0_c_int]) /= transfer(m3, [0_c_int]))) &
        call fail('stage-3 master differs', p)
      deallocate (m2, m3)
    end do
    call shardopt_destroy(z3, status, msg)
    call expect(status, SHARDOPT_SUCCESS, msg, '')
    call shardopt_destroy(z2, status, msg)
  end subroutine check_stage3

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
