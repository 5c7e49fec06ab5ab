! train_mlp.f90: the MLP trainer of examples/cpp/train_mlp.cpp, written against the Fortran
! module `shardopt`.
!
! Same model (16 -> 64 -> 4, ReLU), data, initialisation, hyperparameters, learning-rate
! schedule, parameter order and groups, and the same float arithmetic in the same order, so its
! final master weights equal the C++ trainer's bit for bit (tested by ctest). A weight matrix
! w(i, j) here is element j * n_in + i of the C++ trainer's row-major w[j][i].
!
!   mpiexec -n 2 ./train_mlp_f [--steps N] [--stage 0|1|2|3] [--dtype bf16|fp32]
!                              [--params-out FILE] [--save-dir DIR --save-at K]
!                              [--resume DIR] [--loss-out FILE] [--check-loss FILE]
!                              [--rule adamw|lion|adamw8bit] [--min-8bit-numel N]
!                              [--muon | --adafactor] [--zero-grad]
!
! --rule and --min-8bit-numel as in the C++ trainer: both groups' update rule (group 1 through
! shardopt_set_group's rule=, group 2 through shardopt_add_group's) and AdamW8bit's threshold.
!
! --muon as in the C++ trainer: a hidden layer fch (64 -> 96, ReLU) between fc1 and fc2, in a
! SHARDOPT_RULE_MUON group with SHARDOPT_OWNERSHIP_WHOLE and the automatic bucket size. Its
! weight is declared wh(n_hidden, n_mid), column-major: the same memory as C's row-major
! 96 x 64 matrix, so it is registered with rows=size(wh, 2), cols=size(wh, 1), and Muon sees
! the C trainer's matrix bit for bit (ctest compares the weights).
!
! --adafactor as in the C++ trainer: the same hidden layer, fch.weight (rows=, cols=: factored
! row_var/col_var) and fch.bias (a per-element variance) in a SHARDOPT_RULE_ADAFACTOR group
! with its defaults and no weight decay (torch.optim.Adafactor's); whole ownership as --muon.
!
! --zero-grad as in the C trainer: shardopt_zero_grad before each step's backward, as a
! trainer used to torch's optimizer.zero_grad() would; the step already leaves the gradients
! zero, so the weights stay the C++ trainer's bit for bit (ctest).
!
! Each layer is a unit (shardopt_begin_unit before its parameters, at every stage, so that all
! stages share one layout), and the step runs layer by layer as in examples/c/train_mlp.c:
! --stage 3 acquires layer 1 with layer 2 prefetched in forward, layer 2 with layer 1
! prefetched in backward, and releases each layer after use; it gives stage 2's weights bit
! for bit (ctest).
!
! Checkpoints as in examples/c/train_mlp.c: --save-dir/--save-at save after step K, --resume
! loads the latest checkpoint of DIR (any rank count and stage) and continues; --loss-out and
! --check-loss write and compare "step loss" lines. MPI comes from mpi_f08: the library takes
! the communicator's integer handle, MPI_COMM_WORLD%MPI_VAL.
program train_mlp_f
  use, intrinsic :: iso_c_binding, only: c_float, c_double, c_int16_t, c_int64_t, c_int
  use, intrinsic :: iso_fortran_env, only: error_unit, int64
  use mpi_f08
  use shardopt
  implicit none

  integer, parameter :: n_in = 16, n_hidden = 64, n_mid = 96, n_out = 4, global_batch = 96
  real(c_double), parameter :: pi = 3.14159265358979323846_c_double

  type(shardopt_optimizer) :: opt
  type(shardopt_config) :: cfg
  type(shardopt_step_result) :: r
  integer :: steps, stage, status, rank, world, rc, save_at
  integer(c_int) :: dtype, rule
  integer(c_int64_t) :: min_8bit_numel
  logical :: muon, adafactor, hidden  ! hidden: a hidden layer (--muon or --adafactor)
  logical :: zero_grad
  character(len=:), allocatable :: params_out, save_dir, resume, loss_out, check_loss
  character(len=512) :: msg

  call mpi_init()
  call parse_arguments()

  call shardopt_config_init(cfg, status)
  cfg%stage = stage
  cfg%param_dtype = dtype
  cfg%lr = 1e-2_c_double
  cfg%weight_decay = 0.01_c_double
  cfg%max_grad_norm = 1.0_c_double
  cfg%bucket_elems = 1024  ! several stage-2 buckets even for this small model
  if (hidden) then
    ! Each Muon/Adafactor tensor updated whole by one rank; the automatic bucket size is raised
    ! to the largest, which must fit one bucket.
    cfg%ownership = SHARDOPT_OWNERSHIP_WHOLE
    cfg%bucket_elems = 0
  end if
  call shardopt_create(opt, status, config=cfg, comm=MPI_COMM_WORLD%MPI_VAL, errmsg=msg)
  call check(status, msg)

  rc = train()
  call mpi_allreduce(MPI_IN_PLACE, rc, 1, MPI_INTEGER, MPI_MAX, MPI_COMM_WORLD)
  call shardopt_destroy(opt, status)  ! before mpi_finalize: frees the library's communicator
  call mpi_finalize()
  if (rc /= 0) error stop 1

contains

  !> Stops with the library's message when a call failed.
  subroutine check(status, msg)
    integer, intent(in) :: status
    character(len=*), intent(in) :: msg
    if (status == SHARDOPT_SUCCESS) return
    write (error_unit, '(a,a,a,a,a)') 'train_mlp_f: ', trim(msg), ' (', shardopt_status_string(status), ')'
    ! A collective timeout: the missing ranks would keep the job waiting (mpi_finalize too).
    if (status == SHARDOPT_ERROR_COMMUNICATION) call mpi_abort(MPI_COMM_WORLD, 1)
    error stop 1
  end subroutine check

  subroutine parse_arguments()
    character(len=512) :: flag, value
    integer :: i
    steps = 200
    stage = SHARDOPT_STAGE_ZERO1
    dtype = SHARDOPT_DTYPE_BF16
    save_at = -1
    params_out = ''
    save_dir = ''
    resume = ''
    loss_out = ''
    check_loss = ''
    rule = SHARDOPT_RULE_ADAMW
    min_8bit_numel = 4096
    muon = .false.
    adafactor = .false.
    zero_grad = .false.
    i = 1
    do while (i <= command_argument_count())
      call get_command_argument(i, flag)
      if (trim(flag) == '--muon' .or. trim(flag) == '--adafactor') then
        muon = muon .or. trim(flag) == '--muon'
        adafactor = adafactor .or. trim(flag) == '--adafactor'
        if (muon .and. adafactor) then
          write (error_unit, '(a)') 'train_mlp_f: --muon and --adafactor exclude each other'
          error stop 2
        end if
        i = i + 1
        cycle
      end if
      if (trim(flag) == '--zero-grad') then
        zero_grad = .true.
        i = i + 1
        cycle
      end if
      if (i + 1 > command_argument_count()) then
        write (error_unit, '(a,a,a)') 'train_mlp_f: ', trim(flag), ' needs a value'
        error stop 2
      end if
      call get_command_argument(i + 1, value)
      select case (trim(flag))
      case ('--steps')
        read (value, *) steps
      case ('--stage')
        read (value, *) stage
      case ('--dtype')
        dtype = merge(SHARDOPT_DTYPE_F32, SHARDOPT_DTYPE_BF16, trim(value) == 'fp32')
      case ('--params-out')
        params_out = trim(value)
      case ('--save-dir')
        save_dir = trim(value)
      case ('--save-at')
        read (value, *) save_at
      case ('--resume')
        resume = trim(value)
      case ('--loss-out')
        loss_out = trim(value)
      case ('--check-loss')
        check_loss = trim(value)
      case ('--rule')
        select case (trim(value))
        case ('adamw')
          rule = SHARDOPT_RULE_ADAMW
        case ('lion')
          rule = SHARDOPT_RULE_LION
        case ('adamw8bit')
          rule = SHARDOPT_RULE_ADAMW8BIT
        case default
          write (error_unit, '(a,a)') 'train_mlp_f: unknown rule ', trim(value)
          error stop 2
        end select
      case ('--min-8bit-numel')
        read (value, *) min_8bit_numel
      case default
        write (error_unit, '(a,a)') 'train_mlp_f: unknown option ', trim(flag)
        error stop 2
      end select
      i = i + 2
    end do
    hidden = muon .or. adafactor
  end subroutine parse_arguments

  !> Rank 0 compares losses(first:last) with the "step loss" lines of `path` (tolerance as the
  !> C++ trainer's: ranks change only the order of fp32 gradient sums); 1 when they differ,
  !> a step is missing, or the loss did not fall.
  integer function compare_losses(path, losses, first, last)
    character(len=*), intent(in) :: path
    real(c_double), intent(in) :: losses(0:)
    integer, intent(in) :: first, last
    real(c_double) :: tol, worst, loss
    integer :: unit, step, ios, matched
    tol = merge(1e-5_c_double, 5e-3_c_double, dtype == SHARDOPT_DTYPE_F32)
    worst = 0
    matched = 0
    open (newunit=unit, file=path, status='old', action='read', iostat=ios)
    if (ios /= 0) then
      write (error_unit, '(a,a)') 'train_mlp_f: cannot read ', path
      compare_losses = 1
      return
    end if
    do
      read (unit, *, iostat=ios) step, loss
      if (ios /= 0) exit
      if (step < first .or. step > last) cycle
      worst = max(worst, abs(losses(step) - loss) / max(1e-12_c_double, abs(loss)))
      matched = matched + 1
    end do
    close (unit)
    write (*, '(a,i0,a,i0,a,es10.3,a,es8.1,a)') 'loss curve of steps ', first, '..', last, &
      ': max relative difference ', worst, ' (tolerance ', tol, ')'
    compare_losses = 0
    if (matched /= last - first + 1 .or. worst > tol .or. losses(last) >= losses(first)) compare_losses = 1
  end function compare_losses

  !> Deterministic uniform value in [-1, 1) from integers (splitmix64). The arithmetic wraps
  !> modulo 2**64 like C's uint64_t (built with -fwrapv); shiftr is a logical shift.
  real(c_float) function uniform(a, b)
    integer(int64), intent(in) :: a, b
    integer(int64) :: z
    z = a * (-7046029254386353131_int64) + b * (-3335678366873096957_int64) + 7146057691288625177_int64
    z = ieor(z, shiftr(z, 30)) * (-4658895280553007687_int64)
    z = ieor(z, shiftr(z, 27)) * (-7723592293110705685_int64)
    z = ieor(z, shiftr(z, 31))
    uniform = real(real(shiftr(z, 11), c_double) * 2.0_c_double**(-53) * 2.0_c_double - 1.0_c_double, c_float)
  end function uniform

  !> Sample s of step t: inputs x and targets y = teacher(x).
  subroutine make_sample(step, s, x, y)
    integer, intent(in) :: step, s
    real(c_float), intent(out) :: x(n_in), y(n_out)
    integer(int64) :: id
    real(c_double) :: acc
    integer :: i, o
    id = int(step, int64) * global_batch + int(s, int64)
    do i = 1, n_in
      x(i) = uniform(id, int(i - 1, int64))
    end do
    do o = 1, n_out
      acc = 0
      do i = 1, n_in
        acc = acc + real(uniform(int(1000003 + o - 1, int64), int(i - 1, int64)) * x(i), c_double)
      end do
      y(o) = real(sin(acc), c_float)
    end do
  end subroutine make_sample

  !> Sets a parameter to scale * uniform(seed, k), the same on every rank.
  subroutine init_param(index, n, scale, seed)
    integer, intent(in) :: index, n
    real(c_float), intent(in) :: scale
    integer, intent(in) :: seed
    real(c_float) :: v(n)
    integer :: k
    do k = 1, n
      v(k) = scale * uniform(int(seed, int64), int(k - 1, int64))
    end do
    call shardopt_set_param(opt, index, v, status, msg)
    call check(status, msg)
  end subroutine init_param

  !> Copies a rank-2 parameter's replica into w, whatever the replica dtype: through a
  !> pointer of the right shape into the optimizer's buffer, without a copy on its side.
  subroutine read_matrix(index, w)
    integer, intent(in) :: index
    real(c_float), intent(out) :: w(:, :)
    real(c_float), pointer :: p(:, :)
    integer(c_int16_t), pointer :: bits(:, :)
    if (dtype == SHARDOPT_DTYPE_BF16) then
      call shardopt_param_bf16(opt, index, bits, shape(w), status, msg)
      call check(status, msg)
      w = shardopt_bf16_to_real(bits)
    else
      call shardopt_param(opt, index, p, shape(w), status, msg)
      call check(status, msg)
      w = p
    end if
  end subroutine read_matrix

  subroutine read_vector(index, v)
    integer, intent(in) :: index
    real(c_float), intent(out) :: v(:)
    real(c_float), pointer :: p(:)
    integer(c_int16_t), pointer :: bits(:)
    if (dtype == SHARDOPT_DTYPE_BF16) then
      call shardopt_param_bf16(opt, index, bits, status, msg)
      call check(status, msg)
      v = shardopt_bf16_to_real(bits)
    else
      call shardopt_param(opt, index, p, status, msg)
      call check(status, msg)
      v = p
    end if
  end subroutine read_vector

  !> Stage 3: gathers layer `unit` and waits, then starts gathering layer `next` (none if 0)
  !> so that its gather overlaps this layer's compute. Nothing at stages 0-2.
  subroutine acquire_layer(unit, next)
    integer, intent(in) :: unit, next
    if (stage /= SHARDOPT_STAGE_ZERO3) return
    call shardopt_acquire(opt, unit, status, msg)
    call check(status, msg)
    if (next < 1) return
    call shardopt_prefetch(opt, next, status, msg)
    call check(status, msg)
  end subroutine acquire_layer

  !> Stage 3: returns the layer's gathered buffer to the pool. Nothing at stages 0-2.
  subroutine release_layer(unit)
    integer, intent(in) :: unit
    if (stage /= SHARDOPT_STAGE_ZERO3) return
    call shardopt_release(opt, unit, status, msg)
    call check(status, msg)
  end subroutine release_layer

  !> Forward of one ReLU layer for one sample: y(o) = max(0, b(o) + sum_i w(i, o) x(i)), summed
  !> in input order as the C and C++ trainers do (w(i, o) is their row-major w[o][i]).
  subroutine dense_relu(w, b, x, y)
    real(c_float), intent(in) :: w(:, :), b(:), x(:)
    real(c_float), intent(out) :: y(:)
    real(c_float) :: a
    integer :: i, o
    do o = 1, size(b)
      a = b(o)
      do i = 1, size(x)
        a = a + w(i, o) * x(i)
      end do
      y(o) = 0
      if (a > 0) y(o) = a
    end do
  end subroutine dense_relu

  !> Backward: adds parameter `index`'s gradient (n elements of any rank, in storage order) to
  !> the optimizer's and marks it ready, so its bucket's reduction may start.
  subroutine hand_over(index, n, grad)
    integer, intent(in) :: index, n
    real(c_float), intent(in) :: grad(n)
    call shardopt_accumulate_grad(opt, index, grad, status, msg)
    call check(status, msg)
    call shardopt_grad_ready(opt, index, status, msg)
    call check(status, msg)
  end subroutine hand_over

  !> Rank 0 writes every parameter's fp32 master weights, in order, as raw floats.
  subroutine write_params(path)
    character(len=*), intent(in) :: path
    real(c_float), allocatable :: master(:)
    integer(c_int64_t) :: n
    integer :: p, count, unit
    call shardopt_num_params(opt, count, status, msg)
    call check(status, msg)
    if (rank == 0) open (newunit=unit, file=path, access='stream', form='unformatted', status='replace')
    do p = 1, count
      call shardopt_param_numel(opt, p, n, status, msg)
      call check(status, msg)
      allocate (master(n))
      call shardopt_get_master(opt, p, master, status, msg)  ! collective
      call check(status, msg)
      if (rank == 0) write (unit) master
      deallocate (master)
    end do
    if (rank == 0) close (unit)
  end subroutine write_params

  integer function train()
    ! fc2 reads `mid` inputs: the hidden layer's n_mid with one, else fc1's n_hidden. The
    ! hidden weight wh(n_hidden, n_mid) is C's row-major n_mid x n_hidden matrix.
    real(c_float) :: w1(n_in, n_hidden), b1(n_hidden), wh(n_hidden, n_mid), bh(n_mid), b2(n_out)
    real(c_float) :: gw1(n_in, n_hidden), gb1(n_hidden), gwh(n_hidden, n_mid), gbh(n_mid)
    real(c_float) :: gb2(n_out)
    real(c_float), allocatable :: w2(:, :), gw2(:, :)
    ! Per sample of this rank's batch: inputs, targets, activations, output and hidden grads;
    ! last(:, s) is what fc2 reads and dlast its gradient.
    real(c_float) :: xs(n_in, global_batch), ys(n_out, global_batch), hs(n_hidden, global_batch)
    real(c_float) :: douts(n_out, global_batch), dhs(n_hidden, global_batch), a, e
    real(c_float), allocatable :: last(:, :), dlast(:, :)
    real(c_double) :: lr, local_sse, loss
    real(c_double), parameter :: warm = 20, peak = 1e-2_c_double
    real(c_double), allocatable :: losses(:)
    integer :: iw1, ib1, iwh, ibh, iw2, ib2, no_decay, hidden_group, local, first, step, s, i, j
    integer :: m, o
    integer :: start, unit, mid, unit1, unith, unit2
    integer(c_int64_t) :: bytes, peak_bytes, done
    character(len=512) :: where

    train = 0
    call shardopt_comm_rank(opt, rank, status)
    call shardopt_comm_size(opt, world, status)
    if (mod(global_batch, world) /= 0) then
      if (rank == 0) write (error_unit, '(a)') 'the global batch does not divide over the ranks'
      train = 2
      return
    end if
    ! Both groups under --rule: group 1 (the default group, with decay) changed, group 2 added
    ! without decay.
    call shardopt_set_group(opt, 1, 1.0_c_double, .true., status, msg, rule=rule, &
                            adamw8bit_min_numel=min_8bit_numel)
    call check(status, msg)
    call shardopt_add_group(opt, 1.0_c_double, .false., no_decay, status, msg, rule=rule, &
                            adamw8bit_min_numel=min_8bit_numel)
    call check(status, msg)
    mid = n_hidden
    unit1 = 1
    unith = 2
    unit2 = 2
    iwh = 0
    ibh = 0
    if (hidden) then  ! group 3: Muon (torch.optim.Muon's defaults, with decay) or Adafactor
      ! (torch.optim.Adafactor's defaults, no decay)
      call shardopt_add_group(opt, 1.0_c_double, muon, hidden_group, status, msg, &
                              rule=merge(SHARDOPT_RULE_MUON, SHARDOPT_RULE_ADAFACTOR, muon))
      call check(status, msg)
      mid = n_mid
      unit2 = 3
    end if
    allocate (w2(mid, n_out), gw2(mid, n_out), last(mid, global_batch), dlast(mid, global_batch))
    call shardopt_begin_unit(opt, status, errmsg=msg)  ! layer 1: unit 1
    call check(status, msg)
    call shardopt_add_param(opt, 'fc1.weight', n_hidden * n_in, iw1, status, errmsg=msg)
    call check(status, msg)
    call shardopt_add_param(opt, 'fc1.bias', n_hidden, ib1, status, group=no_decay, errmsg=msg)
    call check(status, msg)
    if (hidden) then  ! the hidden layer: unit 2
      call shardopt_begin_unit(opt, status, errmsg=msg)
      call check(status, msg)
      call shardopt_add_param(opt, 'fch.weight', size(wh), iwh, status, group=hidden_group, &
                              errmsg=msg, rows=size(wh, 2), cols=size(wh, 1))
      call check(status, msg)
      call shardopt_add_param(opt, 'fch.bias', n_mid, ibh, status, &
                              group=merge(no_decay, hidden_group, muon), errmsg=msg)
      call check(status, msg)
    end if
    call shardopt_begin_unit(opt, status, errmsg=msg)  ! the last layer
    call check(status, msg)
    call shardopt_add_param(opt, 'fc2.weight', n_out * mid, iw2, status, errmsg=msg)
    call check(status, msg)
    call shardopt_add_param(opt, 'fc2.bias', n_out, ib2, status, group=no_decay, errmsg=msg)
    call check(status, msg)
    call shardopt_finalize(opt, status, msg)
    call check(status, msg)

    call init_param(iw1, n_hidden * n_in, 1.0_c_float / sqrt(real(n_in, c_float)), 11)
    call init_param(ib1, n_hidden, 0.0_c_float, 12)
    call init_param(iw2, n_out * mid, 1.0_c_float / sqrt(real(mid, c_float)), 13)
    call init_param(ib2, n_out, 0.0_c_float, 14)
    if (hidden) then
      call init_param(iwh, n_mid * n_hidden, 1.0_c_float / sqrt(real(n_hidden, c_float)), 15)
      call init_param(ibh, n_mid, 0.0_c_float, 16)
    end if
    start = 0
    if (len(resume) > 0) then
      ! Collective: the checkpoint's state, resharded to this run's ranks and stage.
      call shardopt_load_checkpoint(opt, resume, status, msg)
      call check(status, msg)
      call shardopt_step_count(opt, done, status, msg)
      call check(status, msg)
      start = int(done)
      if (rank == 0) write (*, '(a,a,a,i0,a,i0,a)') 'resumed from ', resume, ' at step ', start, &
                                                   ' on ', world, ' ranks'
    end if
    allocate (losses(0:max(steps, 1) - 1))
    losses = 0

    local = global_batch / world
    first = rank * local
    do step = start, steps - 1
      ! Linear warm-up then cosine decay; set on every rank alike.
      if (step < warm) then
        lr = (peak * real(step + 1, c_double)) / warm
      else
        lr = (peak * 0.5_c_double) * (1.0_c_double + cos((pi * (real(step, c_double) - warm)) &
                                                          / (real(steps, c_double) - warm)))
      end if
      call shardopt_set_lr(opt, lr, status, msg)
      call check(status, msg)
      if (zero_grad) then  ! redundant: the step zeroed them
        call shardopt_zero_grad(opt, status, msg)
        call check(status, msg)
      end if
      gw1 = 0
      gb1 = 0
      gwh = 0
      gbh = 0
      gw2 = 0
      gb2 = 0
      local_sse = 0
      ! Forward, layer 1 (the next layer's gather in flight meanwhile at stage 3).
      call acquire_layer(unit1, unith)
      call read_matrix(iw1, w1)
      call read_vector(ib1, b1)
      do s = 1, local
        call make_sample(step, first + s - 1, xs(:, s), ys(:, s))
        call dense_relu(w1, b1, xs(:, s), hs(:, s))
      end do
      call release_layer(unit1)
      if (hidden) then  ! Forward, the hidden layer.
        call acquire_layer(unith, unit2)
        call read_matrix(iwh, wh)
        call read_vector(ibh, bh)
        do s = 1, local
          call dense_relu(wh, bh, hs(:, s), last(:, s))
        end do
        call release_layer(unith)
      else
        last(:, 1:local) = hs(:, 1:local)
      end if
      ! Forward, the last layer, and the loss.
      call acquire_layer(unit2, 0)
      call read_matrix(iw2, w2)
      call read_vector(ib2, b2)
      do s = 1, local
        do o = 1, n_out
          a = b2(o)
          do j = 1, mid
            a = a + w2(j, o) * last(j, s)
          end do
          e = a - ys(o, s)
          local_sse = local_sse + real(e, c_double) * real(e, c_double)
          douts(o, s) = (2.0_c_float * e) / real(local, c_float)  ! d(mean over local batch)/d out
        end do
      end do
      call release_layer(unit2)
      ! Backward, the last layer (the one below prefetched), then down to layer 1; each layer's
      ! gradients are handed over as soon as they are complete (stages 2 and 3 reduce bucket
      ! by bucket).
      call acquire_layer(unit2, merge(unith, unit1, hidden))
      call read_matrix(iw2, w2)  ! the input gradient needs W2
      do s = 1, local
        dlast(:, s) = 0
        do o = 1, n_out
          gb2(o) = gb2(o) + douts(o, s)
          do j = 1, mid
            gw2(j, o) = gw2(j, o) + douts(o, s) * last(j, s)
            dlast(j, s) = dlast(j, s) + douts(o, s) * w2(j, o)
          end do
        end do
      end do
      call hand_over(ib2, size(gb2), gb2)
      call hand_over(iw2, size(gw2), gw2)
      call release_layer(unit2)
      if (hidden) then  ! Backward, the hidden layer.
        call acquire_layer(unith, unit1)
        call read_matrix(iwh, wh)
        do s = 1, local
          dhs(:, s) = 0
          do m = 1, n_mid
            if (last(m, s) <= 0) cycle
            gbh(m) = gbh(m) + dlast(m, s)
            do j = 1, n_hidden
              gwh(j, m) = gwh(j, m) + dlast(m, s) * hs(j, s)
              dhs(j, s) = dhs(j, s) + dlast(m, s) * wh(j, m)
            end do
          end do
        end do
        call hand_over(ibh, size(gbh), gbh)
        call hand_over(iwh, size(gwh), gwh)
        call release_layer(unith)
      else
        dhs(:, 1:local) = dlast(:, 1:local)
      end if
      ! Layer 1 computes no input gradient, so it reads no parameter here; a deeper model's
      ! layers would (the acquire keeps the pattern).
      call acquire_layer(unit1, 0)
      do s = 1, local
        do j = 1, n_hidden
          if (hs(j, s) <= 0) cycle
          gb1(j) = gb1(j) + dhs(j, s)
          do i = 1, n_in
            gw1(i, j) = gw1(i, j) + dhs(j, s) * xs(i, s)
          end do
        end do
      end do
      call hand_over(ib1, size(gb1), gb1)
      call hand_over(iw1, size(gw1), gw1)
      call release_layer(unit1)
      call shardopt_step(opt, status, result=r, errmsg=msg)
      call check(status, msg)

      call mpi_allreduce(local_sse, loss, 1, MPI_DOUBLE_PRECISION, MPI_SUM, MPI_COMM_WORLD)
      loss = loss / global_batch
      losses(step) = loss
      if (r%step /= step + 1) then
        write (error_unit, '(a,i0)') 'train_mlp_f: wrong update count after step ', step
        train = 1
        return
      end if
      if (len(save_dir) > 0 .and. step + 1 == save_at) then
        call shardopt_save_checkpoint(opt, save_dir, status, keep=2, published=where, errmsg=msg)
        call check(status, msg)
        if (rank == 0) write (*, '(a,a,a,i0)') 'saved ', trim(where), ' after step ', step
      end if
      if (rank == 0 .and. (mod(step, 20) == 0 .or. step == steps - 1)) then
        write (*, '(a,i4,a,f9.6,a,f7.4,a,es9.2)') 'step ', step, '  loss ', loss, &
          '  grad_norm ', r%grad_norm, '  lr ', lr
      end if
    end do

    call shardopt_memory_usage(opt, SHARDOPT_MEM_TOTAL, bytes, status, peak=peak_bytes)
    call check(status, 'shardopt_memory_usage')
    if (rank == 0) write (*, '(a,i0,a,i0,a)') 'rank 0 optimizer memory: ', bytes, ' bytes (peak ', &
                                            peak_bytes, ')'
    if (rank == 0 .and. len(loss_out) > 0) then
      open (newunit=unit, file=loss_out, status='replace', action='write')
      do step = start, steps - 1
        write (unit, '(i0,1x,es25.17)') step, losses(step)
      end do
      close (unit)
    end if
    if (rank == 0 .and. len(check_loss) > 0 .and. start < steps) &
      train = compare_losses(check_loss, losses, start, steps - 1)
    if (len(params_out) > 0) call write_params(params_out)
  end function train

end program train_mlp_f
