! test_fortran_api.f90: the Fortran module's error paths: status codes and messages for wrong
! sizes, shapes, indices, order and a destroyed handle, never a crash; index 0 (or below) in
! every routine that takes a parameter, group or unit index says that Fortran indices start at
! 1 (issue 27); the argument-order rule: status and errmsg (and the optional arguments)
! passed by keyword, in any order; loss-scaling options validated while loss scaling is off;
! a Lion group (rule and betas by keyword) against Lion written out in single precision here;
! a Muon matrix and an Adafactor matrix declared w(cols, rows) equal C's row-major rows x cols
! bit for bit (Adafactor's row_var and col_var too).
program test_fortran_api
  use, intrinsic :: iso_c_binding, only: c_float, c_double, c_int, c_int16_t, c_int64_t
  use shardopt
  implicit none
  type(shardopt_optimizer) :: opt
  type(shardopt_config) :: cfg
  real(c_float) :: v(10), m(2, 5)
  real(c_float), pointer :: p2(:, :), g(:), p1(:)
  integer(c_int16_t), pointer :: bits(:), flat_bits(:)
  integer(c_int64_t) :: n, off
  real(c_double) :: lr_scale
  logical :: wd
  integer :: status, ia, ib, grp, failures
  interface
    function shardopt_test_matrix_c(rule, rows, cols, steps, out, row_var, col_var) &
        bind(c, name='shardopt_test_matrix_c')
      import :: c_int, c_float
      integer(c_int), value :: rule, rows, cols, steps
      real(c_float), intent(out) :: out(*), row_var(*), col_var(*)
      integer(c_int) :: shardopt_test_matrix_c
    end function shardopt_test_matrix_c
    function c_getpid() bind(c, name='getpid')
      import :: c_int
      integer(c_int) :: c_getpid
    end function c_getpid
  end interface
  character(len=512) :: msg

  failures = 0
  call shardopt_config_init(cfg, status)
  cfg%param_dtype = SHARDOPT_DTYPE_F32
  call shardopt_create(opt, status, config=cfg, errmsg=msg)
  call expect(status, SHARDOPT_SUCCESS, msg, '')
  call shardopt_create(opt, status, errmsg=msg)
  call expect(status, SHARDOPT_ERROR_INVALID_STATE, msg, 'in use')
  call shardopt_add_group(opt, 0.5_c_double, .false., grp, status, msg)
  call expect(status, SHARDOPT_SUCCESS, msg, '')
  if (grp /= 2) call fail('add_group returned group', grp)
  call shardopt_add_param(opt, 'a', 10, ia, status, errmsg=msg)
  call expect(status, SHARDOPT_SUCCESS, msg, '')
  call shardopt_add_param(opt, 'b', 3_c_int64_t, ib, status, group=grp, errmsg=msg)
  call expect(status, SHARDOPT_SUCCESS, msg, '')
  if (ia /= 1 .or. ib /= 2) call fail('1-based indices, got', ia * 10 + ib)
  call shardopt_add_param(opt, 'c', 4, ib, status, group=7, errmsg=msg)
  call expect(status, SHARDOPT_ERROR_INVALID_ARGUMENT, msg, 'shardopt_add_param')
  call shardopt_add_param(opt, 'd', -4, ib, status, errmsg=msg)
  call expect(status, SHARDOPT_ERROR_INVALID_ARGUMENT, msg, 'shardopt_add_param')
  call shardopt_add_param(opt, 'd', 4, ib, status, group=0, errmsg=msg)
  call expect_index('shardopt_add_param', 'group', 0, 2)
  call shardopt_step(opt, status, errmsg=msg)
  call expect(status, SHARDOPT_ERROR_INVALID_STATE, msg, 'shardopt_step')
  call shardopt_finalize(opt, status, msg)
  call expect(status, SHARDOPT_SUCCESS, msg, '')

  v = 1
  call shardopt_set_param(opt, ia, v(1:9), status, msg)
  call expect(status, SHARDOPT_ERROR_INVALID_ARGUMENT, msg, '10 elements')
  call shardopt_set_param(opt, 0, v, status, msg)
  call expect(status, SHARDOPT_ERROR_INVALID_ARGUMENT, msg, 'shardopt_set_param')
  call shardopt_set_param(opt, 3, v, status)  ! no errmsg: the status still tells
  if (status /= SHARDOPT_ERROR_INVALID_ARGUMENT) call fail('bad index without errmsg', status)
  if (index(shardopt_last_error(opt), 'shardopt_set_param') == 0) call fail('last_error', 0)
  m = reshape([(real(ia), ia = 1, 10)], [2, 5])
  call shardopt_set_param(opt, 1, m, status, msg)
  call expect(status, SHARDOPT_SUCCESS, msg, '')
  call shardopt_param(opt, 1, p2, [5, 3], status, msg)
  call expect(status, SHARDOPT_ERROR_INVALID_ARGUMENT, msg, 'shape (5, 3)')
  if (associated(p2)) call fail('pointer set on failure', 0)
  call shardopt_param(opt, 1, p2, [2, 5], status, msg)
  call expect(status, SHARDOPT_SUCCESS, msg, '')
  if (any(p2 /= m)) call fail('rank-2 view differs', 0)
  call shardopt_param_bf16(opt, 1, bits, status, msg)
  call expect(status, SHARDOPT_ERROR_INVALID_ARGUMENT, msg, 'fp32')
  call shardopt_replica_bf16(opt, flat_bits, status, msg)  ! the replica is fp32
  call expect(status, SHARDOPT_ERROR_INVALID_ARGUMENT, msg, 'shardopt_replica_bf16')
  if (associated(flat_bits)) call fail('replica pointer set on failure', 0)
  call shardopt_wait_param(opt, 3, status, msg)
  call expect(status, SHARDOPT_ERROR_INVALID_ARGUMENT, msg, 'shardopt_wait_param')
  call shardopt_get_group(opt, 3, lr_scale, wd, status, msg)
  call expect(status, SHARDOPT_ERROR_INVALID_ARGUMENT, msg, 'no group 2')
  call shardopt_get_exp_avg(opt, 1, v(1:4), status, msg)
  call expect(status, SHARDOPT_ERROR_INVALID_ARGUMENT, msg, 'shardopt_get_exp_avg')
  call shardopt_param_index(opt, 'b', ib, status, msg)
  if (ib /= 2) call fail('param_index of b', ib)
  call shardopt_param_index(opt, 'zz', ib, status, msg)
  call expect(status, SHARDOPT_ERROR_INVALID_ARGUMENT, msg, "'zz'")
  if (shardopt_mem_category_name(SHARDOPT_MEM_MOMENTS) /= 'moments') call fail('mem_category_name', 0)
  call shardopt_save_checkpoint(opt, '', status, errmsg=msg)
  call expect(status, SHARDOPT_ERROR_INVALID_ARGUMENT, msg, 'dir is empty')
  call shardopt_grad(opt, 2, g, status, msg)
  call expect(status, SHARDOPT_SUCCESS, msg, '')
  if (size(g) /= 3) call fail('grad size', size(g))
  call shardopt_param_numel(opt, 2, n, status, msg)
  if (n /= 3) call fail('numel', int(n))
  call check_index_zero()
  call shardopt_set_lr(opt, -1.0_c_double, status, msg)
  call expect(status, SHARDOPT_ERROR_INVALID_ARGUMENT, msg, 'learning rate')
  if (shardopt_bf16_to_real(shardopt_real_to_bf16(-3.0_c_float)) /= -3.0) call fail('bf16', 0)

  call shardopt_destroy(opt, status, msg)
  call expect(status, SHARDOPT_SUCCESS, msg, '')
  if (.not. shardopt_is_null(opt)) call fail('destroy left the handle set', 0)
  call shardopt_step(opt, status, errmsg=msg)
  call expect(status, SHARDOPT_ERROR_INVALID_ARGUMENT, msg, 'NULL')
  call shardopt_destroy(opt, status, msg)  ! a null handle is accepted
  call expect(status, SHARDOPT_SUCCESS, msg, '')

  call check_units_index_zero()
  call check_keywords()
  call check_loss_scaling_options()
  call check_lion()
  call check_adamw8bit()
  call check_muon()
  call check_muon_errors()
  call check_adafactor()
  call check_adafactor_errors()

  if (failures > 0) error stop 1
  print '(a)', 'test_fortran_api: all checks passed'

contains

  !> Index 0 and -1 in every routine of opt (parameters 'a' (10) and 'b' (3), groups 1-2) that
  !> takes a parameter or group index: INVALID_ARGUMENT with the routine, the index and the rule.
  subroutine check_index_zero()
    integer :: bad, k
    do k = 1, 2
      bad = 1 - k  ! 0, then -1
      call shardopt_param(opt, bad, p1, status, msg)
      call expect_index('shardopt_param', 'parameter', bad, 2)
      if (associated(p1)) call fail('pointer set on failure', bad)
      call shardopt_param(opt, bad, p2, [2, 5], status, msg)
      call expect_index('shardopt_param', 'parameter', bad, 2)
      call shardopt_param_bf16(opt, bad, bits, status, msg)
      call expect_index('shardopt_param_bf16', 'parameter', bad, 2)
      call shardopt_grad(opt, bad, g, status, msg)
      call expect_index('shardopt_grad', 'parameter', bad, 2)
      call shardopt_set_param(opt, bad, v, status, msg)
      call expect_index('shardopt_set_param', 'parameter', bad, 2)
      call shardopt_get_master(opt, bad, v, status, msg)
      call expect_index('shardopt_get_master', 'parameter', bad, 2)
      call shardopt_get_exp_avg(opt, bad, v, status, msg)
      call expect_index('shardopt_get_exp_avg', 'parameter', bad, 2)
      call shardopt_get_exp_avg_sq(opt, bad, m, status, msg)
      call expect_index('shardopt_get_exp_avg_sq', 'parameter', bad, 2)
      call shardopt_accumulate_grad(opt, bad, v, status, msg)
      call expect_index('shardopt_accumulate_grad', 'parameter', bad, 2)
      call shardopt_grad_ready(opt, bad, status, msg)
      call expect_index('shardopt_grad_ready', 'parameter', bad, 2)
      call shardopt_param_numel(opt, bad, n, status, msg)
      call expect_index('shardopt_param_numel', 'parameter', bad, 2)
      call shardopt_param_offset(opt, bad, off, status, msg)
      call expect_index('shardopt_param_offset', 'parameter', bad, 2)
      call shardopt_wait_param(opt, bad, status, msg)
      call expect_index('shardopt_wait_param', 'parameter', bad, 2)
      call shardopt_get_group(opt, bad, lr_scale, wd, status, msg)
      call expect_index('shardopt_get_group', 'group', bad, 2)
      call shardopt_set_group(opt, bad, 1.0_c_double, .true., status, msg)
      call expect_index('shardopt_set_group', 'group', bad, 2)
    end do
  end subroutine check_index_zero

  !> The last call failed with INVALID_ARGUMENT and said that `routine` got `kind` index
  !> `bad`, that Fortran indices start at 1, and how many there are.
  subroutine expect_index(routine, kind, bad, have)
    character(len=*), intent(in) :: routine, kind
    integer, intent(in) :: bad, have
    character(len=64) :: want
    write (want, '(a,i0,a,i0,a)') ' index ', bad, ': Fortran indices start at 1 (have ', have, ')'
    call expect(status, SHARDOPT_ERROR_INVALID_ARGUMENT, msg, routine//': '//kind//trim(want))
  end subroutine expect_index

  !> Units are 1-based too: acquire, prefetch and release of unit 0 at stage 3.
  subroutine check_units_index_zero()
    type(shardopt_optimizer) :: z3
    type(shardopt_config) :: c
    integer :: u, k
    call shardopt_config_init(c, status)
    c%stage = SHARDOPT_STAGE_ZERO3
    call shardopt_create(z3, status, config=c, errmsg=msg)
    call expect(status, SHARDOPT_SUCCESS, msg, '')
    do u = 1, 3
      call shardopt_begin_unit(z3, status, errmsg=msg)
      call shardopt_add_param(z3, 'u'//achar(iachar('0') + u), 8, k, status, errmsg=msg)
      call expect(status, SHARDOPT_SUCCESS, msg, '')
    end do
    call shardopt_finalize(z3, status, msg)
    call expect(status, SHARDOPT_SUCCESS, msg, '')
    call shardopt_acquire(z3, 0, status, msg)
    call expect_index('shardopt_acquire', 'unit', 0, 3)
    call shardopt_prefetch(z3, 0, status, msg)
    call expect_index('shardopt_prefetch', 'unit', 0, 3)
    call shardopt_release(z3, 0, status, msg)
    call expect_index('shardopt_release', 'unit', 0, 3)
    call shardopt_acquire(z3, 4, status, msg)  ! too large: the library's own message
    call expect(status, SHARDOPT_ERROR_INVALID_ARGUMENT, msg, 'out of range')
    call shardopt_destroy(z3, status, msg)
    call expect(status, SHARDOPT_SUCCESS, msg, '')
  end subroutine check_units_index_zero

  !> Loss-scaling options are validated while loss scaling is off too; the defaults are valid.
  subroutine check_loss_scaling_options()
    type(shardopt_optimizer) :: o
    type(shardopt_config) :: c
    call shardopt_config_init(c, status)
    if (c%loss_scaling /= 0) call fail('loss scaling is off by default', int(c%loss_scaling))
    c%loss_scale_min = -1
    call shardopt_create(o, status, config=c, errmsg=msg)
    call expect(status, SHARDOPT_ERROR_INVALID_ARGUMENT, msg, 'checked although loss scaling is off')
    if (.not. shardopt_is_null(o)) call fail('a refused create left a handle', 0)
    call shardopt_config_init(c, status)
    c%loss_scaling = 1
    call shardopt_create(o, status, config=c, errmsg=msg)
    call expect(status, SHARDOPT_SUCCESS, msg, '')
    call shardopt_destroy(o, status, msg)
  end subroutine check_loss_scaling_options

  !> The argument-order rule of the module's header: status and errmsg (and the optional
  !> arguments) by keyword, in any order, in routines where status comes right after the
  !> handle (begin_unit, step, create), after the required arguments (add_param, param) or
  !> before optional ones (save_checkpoint, memory_usage). A keyword that did not exist, or a
  !> generic that could not resolve it, would not compile.
  subroutine check_keywords()
    type(shardopt_optimizer) :: k
    type(shardopt_config) :: c
    type(shardopt_step_result) :: res
    real(c_float), pointer :: w1(:), w2(:, :)
    integer(c_int64_t) :: bytes, peak
    integer :: st, u, ix, iy
    character(len=512) :: where, dir
    call shardopt_config_init(errmsg=msg, status=st, cfg=c)
    call expect(st, SHARDOPT_SUCCESS, msg, '')
    c%stage = SHARDOPT_STAGE_ZERO3
    c%param_dtype = SHARDOPT_DTYPE_F32
    call shardopt_create(k, config=c, errmsg=msg, status=st)
    call expect(st, SHARDOPT_SUCCESS, msg, '')
    call shardopt_begin_unit(k, unit=u, errmsg=msg, status=st)
    call expect(st, SHARDOPT_SUCCESS, msg, '')
    if (u /= 1) call fail('begin_unit(unit=) gave', u)
    call shardopt_add_param(k, 'x', 8, errmsg=msg, status=st, index=ix, group=SHARDOPT_DEFAULT_GROUP)
    call expect(st, SHARDOPT_SUCCESS, msg, '')
    call shardopt_add_param(k, name='y', numel=6_c_int64_t, index=iy, status=st)
    if (st /= SHARDOPT_SUCCESS .or. ix /= 1 .or. iy /= 2) call fail('add_param by keyword', st)
    call shardopt_finalize(k, errmsg=msg, status=st)
    call expect(st, SHARDOPT_SUCCESS, msg, '')
    call shardopt_acquire(k, status=st, unit=1, errmsg=msg)
    call expect(st, SHARDOPT_SUCCESS, msg, '')
    call shardopt_param(k, index=ix, status=st, values=w1, errmsg=msg)
    call expect(st, SHARDOPT_SUCCESS, msg, '')
    call shardopt_param(k, iy, w2, errmsg=msg, status=st, shape=[2, 3])
    call expect(st, SHARDOPT_SUCCESS, msg, '')
    if (size(w1) /= 8 .or. size(w2, 1) /= 2) call fail('param by keyword: size', size(w1))
    call shardopt_release(k, 1, errmsg=msg, status=st)
    call expect(st, SHARDOPT_SUCCESS, msg, '')
    call shardopt_step(k, result=res, errmsg=msg, status=st)
    call expect(st, SHARDOPT_SUCCESS, msg, '')
    if (res%step /= 1) call fail('step(result=) step', int(res%step))
    call shardopt_memory_usage(k, SHARDOPT_MEM_TOTAL, peak=peak, status=st, bytes=bytes)
    if (st /= SHARDOPT_SUCCESS .or. bytes <= 0 .or. peak < bytes) call fail('memory_usage by keyword', st)
    write (dir, '(a,i0)') '/tmp/shardopt_fortran_keywords_', c_getpid()
    call shardopt_save_checkpoint(k, trim(dir), keep=1, errmsg=msg, published=where, status=st)
    call expect(st, SHARDOPT_SUCCESS, msg, '')
    if (index(where, trim(dir)) /= 1) call fail('save_checkpoint(published=): '//trim(where), 0)
    call shardopt_load_checkpoint(k, path=trim(dir), status=st, errmsg=msg)
    call expect(st, SHARDOPT_SUCCESS, msg, '')
    call execute_command_line('rm -rf '//trim(dir))
    call shardopt_destroy(k, errmsg=msg, status=st)
    call expect(st, SHARDOPT_SUCCESS, msg, '')
  end subroutine check_keywords

  !> A Lion group added with the optional keywords, trained three steps, bit for bit against
  !> lion-pytorch's update written out below in the same single-precision operations (one
  !> process, one micro-batch: the gradient factor is exactly 1); its momentum is exp_avg, and
  !> it keeps no exp_avg_sq.
  subroutine check_lion()
    type(shardopt_optimizer) :: k
    type(shardopt_config) :: c
    real(c_float), pointer :: gw(:)
    real(c_float) :: p(7), mom(7), got(7), grad(7), decay, b1, omb1, b2, omb2, lr, cc, sgn
    integer :: st, grp, iw, step, j
    real(c_double), parameter :: lr_d = 0.01_c_double, wd_d = 0.1_c_double
    call shardopt_config_init(c, st)
    c%param_dtype = SHARDOPT_DTYPE_F32
    c%lr = lr_d
    c%weight_decay = wd_d
    call shardopt_create(k, st, config=c, errmsg=msg)
    call expect(st, SHARDOPT_SUCCESS, msg, '')
    call shardopt_add_group(k, 1.0_c_double, .true., grp, st, errmsg=msg, &
                            rule=SHARDOPT_RULE_LION, lion_beta1=0.8_c_double)
    call expect(st, SHARDOPT_SUCCESS, msg, '')
    call shardopt_add_param(k, 'w', 7, iw, st, group=grp, errmsg=msg)
    call expect(st, SHARDOPT_SUCCESS, msg, '')
    call shardopt_finalize(k, st, msg)
    call expect(st, SHARDOPT_SUCCESS, msg, '')
    p = [0.5, -0.25, 1.0, 0.0, -2.0, 0.125, 3.0]
    mom = 0
    call shardopt_set_param(k, iw, p, st, msg)
    call expect(st, SHARDOPT_SUCCESS, msg, '')
    b1 = real(0.8_c_double, c_float)
    omb1 = real(1.0_c_double - 0.8_c_double, c_float)
    b2 = real(0.99_c_double, c_float)
    omb2 = real(1.0_c_double - 0.99_c_double, c_float)
    lr = real(lr_d, c_float)
    decay = real(1.0_c_double - lr_d * wd_d, c_float)
    do step = 1, 3
      do j = 1, 7
        grad(j) = real(mod(j * 5 + step * 3, 7) - 3, c_float) / 8.0  ! includes zeros
      end do
      call shardopt_grad(k, iw, gw, st, msg)
      call expect(st, SHARDOPT_SUCCESS, msg, '')
      gw = grad
      call shardopt_step(k, st, errmsg=msg)
      call expect(st, SHARDOPT_SUCCESS, msg, '')
      do j = 1, 7
        p(j) = p(j) * decay
        cc = b1 * mom(j) + omb1 * grad(j)
        sgn = 0
        if (cc > 0) sgn = 1
        if (cc < 0) sgn = -1
        p(j) = p(j) - lr * sgn
        mom(j) = b2 * mom(j) + omb2 * grad(j)
      end do
    end do
    call shardopt_get_master(k, iw, got, st, msg)
    call expect(st, SHARDOPT_SUCCESS, msg, '')
    if (any(got /= p)) call fail('Lion weights differ', 0)
    call shardopt_get_exp_avg(k, iw, got, st, msg)
    call expect(st, SHARDOPT_SUCCESS, msg, '')
    if (any(got /= mom)) call fail('Lion momentum differs', 0)
    call shardopt_get_exp_avg_sq(k, iw, got, st, msg)
    call expect(st, SHARDOPT_ERROR_INVALID_ARGUMENT, msg, 'keeps no exp_avg_sq')
    call shardopt_destroy(k, st, msg)
    call expect(st, SHARDOPT_SUCCESS, msg, '')
  end subroutine check_lion

  !> An AdamW8bit group (rule and threshold by keyword): a 600-element parameter in 8-bit
  !> state, a 100-element one in fp32; both train, their moments read back, and a checkpoint
  !> brings the 8-bit moments back after another step.
  subroutine check_adamw8bit()
    type(shardopt_optimizer) :: k
    real(c_float), pointer :: gw(:)
    real(c_float) :: big(600), small(100), saved(600)
    integer :: st, grp, ia, ib, step
    character(len=512) :: dir
    call shardopt_create(k, st, errmsg=msg)
    call expect(st, SHARDOPT_SUCCESS, msg, '')
    call shardopt_add_group(k, 1.0_c_double, .true., grp, st, errmsg=msg, &
                            rule=SHARDOPT_RULE_ADAMW8BIT, adamw8bit_min_numel=512_c_int64_t)
    call expect(st, SHARDOPT_SUCCESS, msg, '')
    call shardopt_add_param(k, 'big', 600, ia, st, group=grp, errmsg=msg)
    call shardopt_add_param(k, 'small', 100, ib, st, group=grp, errmsg=msg)
    call shardopt_finalize(k, st, msg)
    call expect(st, SHARDOPT_SUCCESS, msg, '')
    do step = 1, 3
      call shardopt_grad(k, ib, gw, st, msg)
      gw = 0.01 * step
      call shardopt_grad(k, ia, gw, st, msg)
      gw = -0.02
      call shardopt_step(k, st, errmsg=msg)
      call expect(st, SHARDOPT_SUCCESS, msg, '')
    end do
    call shardopt_get_exp_avg(k, ia, big, st, msg)
    call expect(st, SHARDOPT_SUCCESS, msg, '')
    if (any(big >= 0)) call fail('AdamW8bit exp_avg of a negative gradient is not negative', 0)
    call shardopt_get_exp_avg_sq(k, ib, small, st, msg)
    call expect(st, SHARDOPT_SUCCESS, msg, '')
    if (any(small <= 0)) call fail('fp32 exp_avg_sq not positive', 0)
    write (dir, '(a,i0)') '/tmp/shardopt_fortran_8bit_', c_getpid()
    call shardopt_save_checkpoint(k, trim(dir), st, errmsg=msg)
    call expect(st, SHARDOPT_SUCCESS, msg, '')
    ! One more step changes the state; loading the checkpoint brings the saved moments back.
    call shardopt_get_exp_avg(k, ia, saved, st, msg)
    call shardopt_grad(k, ib, gw, st, msg)
    gw = 0.5
    call shardopt_grad(k, ia, gw, st, msg)
    gw = 0.5
    call shardopt_step(k, st, errmsg=msg)
    call shardopt_load_checkpoint(k, trim(dir), st, errmsg=msg)
    call expect(st, SHARDOPT_SUCCESS, msg, '')
    call shardopt_get_exp_avg(k, ia, big, st, msg)
    if (any(big /= saved)) call fail('AdamW8bit exp_avg after loading differs from the saved', 0)
    call execute_command_line('rm -rf '//trim(dir))
    call shardopt_destroy(k, st, msg)
    call expect(st, SHARDOPT_SUCCESS, msg, '')
  end subroutine check_adamw8bit

  !> Muon with a transposed declaration (issue 32): a 5 x 3 matrix (rows > cols, so Newton-Schulz
  !> runs on its transpose) declared w(3, 5) here, column-major, is C's row-major 5 x 3 matrix
  !> when registered with rows=size(w, 2), cols=size(w, 1): trained here with the values and
  !> gradients fortran_matrix_reference.c gives C's element (r, c), the master weights equal the
  !> C program's bit for bit. Registered the other way round (3 x 5: the same memory read as
  !> another matrix) they differ, so the comparison can fail. Mistaken shapes are errors.
  subroutine check_muon()
    integer, parameter :: rows = 5, cols = 3, steps = 4
    real(c_float) :: mine(cols, rows), swapped(cols, rows), theirs(cols * rows)
    real(c_float) :: row_var(rows), col_var(cols)
    integer :: st, code
    code = shardopt_test_matrix_c(SHARDOPT_RULE_MUON, rows, cols, steps, theirs, row_var, col_var)
    call expect(code, SHARDOPT_SUCCESS, 'the C reference failed', '')
    call train_matrix(SHARDOPT_RULE_MUON, .false., rows, cols, steps, mine)
    if (any(transfer(mine, 1_c_int, size(mine)) /= transfer(theirs, 1_c_int, size(theirs)))) &
      call fail('Muon through w(cols, rows) differs from C''s rows x cols bits', 0)
    if (all(mine == reshape([(0.0_c_float, st = 1, rows * cols)], [cols, rows]))) &
      call fail('Muon left the matrix zero', 0)
    call train_matrix(SHARDOPT_RULE_MUON, .true., rows, cols, steps, swapped)
    if (all(transfer(swapped, 1_c_int, size(swapped)) == transfer(theirs, 1_c_int, size(theirs)))) &
      call fail('the shape does not matter: the comparison above cannot fail', 0)
  end subroutine check_muon

  !> Adafactor with a transposed declaration (issue 32), as check_muon: a 4 x 6 matrix declared
  !> w(6, 4), registered with rows=size(w, 2), cols=size(w, 1), options by keyword as C's
  !> defaults: its master weights and its factored statistics, row_var(size(w, 2)) and
  !> col_var(size(w, 1)), equal the C program's bit for bit; registered 6 x 4 they differ.
  subroutine check_adafactor()
    integer, parameter :: rows = 4, cols = 6, steps = 5
    real(c_float) :: mine(cols, rows), swapped(cols, rows), theirs(cols * rows)
    real(c_float) :: row_var(rows), col_var(cols), c_row_var(rows), c_col_var(cols)
    real(c_float) :: s_row_var(cols), s_col_var(rows)
    integer :: code
    code = shardopt_test_matrix_c(SHARDOPT_RULE_ADAFACTOR, rows, cols, steps, theirs, c_row_var, &
                                  c_col_var)
    call expect(code, SHARDOPT_SUCCESS, 'the C reference failed', '')
    call train_matrix(SHARDOPT_RULE_ADAFACTOR, .false., rows, cols, steps, mine, row_var, col_var)
    if (any(transfer(mine, 1_c_int, size(mine)) /= transfer(theirs, 1_c_int, size(theirs)))) &
      call fail('Adafactor through w(cols, rows) differs from C''s rows x cols bits', 0)
    if (any(transfer(row_var, 1_c_int, rows) /= transfer(c_row_var, 1_c_int, rows)) .or. &
        any(transfer(col_var, 1_c_int, cols) /= transfer(c_col_var, 1_c_int, cols))) &
      call fail('Adafactor''s row_var/col_var differ from C''s', 0)
    if (all(row_var == 0.0_c_float) .or. all(col_var == 0.0_c_float)) &
      call fail('Adafactor left its statistics zero', 0)
    call train_matrix(SHARDOPT_RULE_ADAFACTOR, .true., rows, cols, steps, swapped, s_row_var, &
                      s_col_var)
    if (all(transfer(swapped, 1_c_int, size(swapped)) == transfer(theirs, 1_c_int, size(theirs)))) &
      call fail('the shape does not matter to Adafactor: the comparison above cannot fail', 0)
  end subroutine check_adafactor

  !> check_muon's and check_adafactor's Fortran side: trains w(cols, rows) with `rule`;
  !> `swap`: registered as rows=size(w, 1), cols=size(w, 2). Adafactor's statistics into
  !> row_var and col_var (sized for the registered shape).
  subroutine train_matrix(rule, swap, rows, cols, steps, out, row_var, col_var)
    integer(c_int), intent(in) :: rule
    logical, intent(in) :: swap
    integer, intent(in) :: rows, cols, steps
    real(c_float), intent(out) :: out(cols, rows)
    real(c_float), intent(out), optional :: row_var(:), col_var(:)
    type(shardopt_optimizer) :: k
    type(shardopt_config) :: c
    real(c_float) :: w(cols, rows), gr(cols, rows)
    integer :: grp, iw, step, i, j, st
    integer(c_int64_t) :: r64, c64
    call shardopt_config_init(c, st)
    c%param_dtype = SHARDOPT_DTYPE_F32
    c%ownership = SHARDOPT_OWNERSHIP_WHOLE
    c%lr = 0.05_c_double
    call shardopt_create(k, st, config=c, errmsg=msg)
    call expect(st, SHARDOPT_SUCCESS, msg, '')
    if (rule == SHARDOPT_RULE_ADAFACTOR) then  ! C's defaults, spelled out by keyword
      call shardopt_add_group(k, 1.0_c_double, .true., grp, st, errmsg=msg, rule=rule, &
                              adafactor_beta2_decay=-0.8_c_double, &
                              adafactor_eps1=1.1920928955078125e-07_c_double, &
                              adafactor_eps2=1e-3_c_double, adafactor_d=1.0_c_double, &
                              adafactor_maximize=.false.)
    else
      call shardopt_add_group(k, 1.0_c_double, .true., grp, st, errmsg=msg, rule=rule)
    end if
    call expect(st, SHARDOPT_SUCCESS, msg, '')
    if (swap) then
      call shardopt_add_param(k, 'w', size(w), iw, st, group=grp, errmsg=msg, &
                              rows=size(w, 1), cols=size(w, 2))
    else
      call shardopt_add_param(k, 'w', size(w), iw, st, group=grp, errmsg=msg, &
                              rows=size(w, 2), cols=size(w, 1))
    end if
    call expect(st, SHARDOPT_SUCCESS, msg, '')
    call shardopt_finalize(k, st, msg)
    call expect(st, SHARDOPT_SUCCESS, msg, '')
    call shardopt_param_shape(k, iw, r64, c64, st, msg)
    call expect(st, SHARDOPT_SUCCESS, msg, '')
    if (.not. swap .and. (r64 /= rows .or. c64 /= cols)) call fail('param_shape rows', int(r64))
    do i = 0, rows - 1  ! C's element (i, j) is w(j + 1, i + 1)
      do j = 0, cols - 1
        w(j + 1, i + 1) = real(mod(i * 7 + j * 3, 11) - 5, c_float) / 8.0_c_float
      end do
    end do
    call shardopt_set_param(k, iw, w, st, msg)
    call expect(st, SHARDOPT_SUCCESS, msg, '')
    do step = 0, steps - 1
      do i = 0, rows - 1
        do j = 0, cols - 1
          gr(j + 1, i + 1) = real(mod(i * 5 + j * 11 + step * 3, 13) - 6, c_float) / 16.0_c_float
        end do
      end do
      call shardopt_accumulate_grad(k, iw, gr, st, msg)
      call expect(st, SHARDOPT_SUCCESS, msg, '')
      call shardopt_step(k, st, errmsg=msg)
      call expect(st, SHARDOPT_SUCCESS, msg, '')
    end do
    call shardopt_get_master(k, iw, out, st, msg)
    call expect(st, SHARDOPT_SUCCESS, msg, '')
    if (present(row_var)) then
      call shardopt_get_factored_state(k, iw, row_var, col_var, st, msg)
      call expect(st, SHARDOPT_SUCCESS, msg, '')
    end if
    call shardopt_destroy(k, st, msg)
  end subroutine train_matrix

  !> Shape mistakes: rows x cols that is not numel, one of rows= and cols= alone, a Muon group
  !> parameter without a shape (refused at finalize, naming it), Muon options by keyword.
  subroutine check_muon_errors()
    type(shardopt_optimizer) :: k
    type(shardopt_config) :: c
    integer :: st, grp, iw
    call shardopt_config_init(c, st)
    c%ownership = SHARDOPT_OWNERSHIP_WHOLE
    call shardopt_create(k, st, config=c, errmsg=msg)
    call expect(st, SHARDOPT_SUCCESS, msg, '')
    call shardopt_add_group(k, 1.0_c_double, .true., grp, st, errmsg=msg, rule=SHARDOPT_RULE_MUON, &
                            muon_momentum=0.9_c_double, muon_nesterov=.false., muon_ns_steps=3, &
                            muon_lr_adjust=SHARDOPT_MUON_LR_MATCH_RMS_ADAMW)
    call expect(st, SHARDOPT_SUCCESS, msg, '')
    call shardopt_add_group(k, 1.0_c_double, .true., iw, st, errmsg=msg, rule=SHARDOPT_RULE_MUON, &
                            muon_momentum=1.5_c_double)
    call expect(st, SHARDOPT_ERROR_INVALID_ARGUMENT, msg, 'Muon momentum')
    call shardopt_add_group(k, 1.0_c_double, .true., iw, st, errmsg=msg, rule=SHARDOPT_RULE_MUON, &
                            muon_lr_adjust=7_c_int)
    call expect(st, SHARDOPT_ERROR_INVALID_ARGUMENT, msg, 'muon_lr_adjust 7')
    call shardopt_add_param(k, 'w', 16, iw, st, group=grp, errmsg=msg, rows=5, cols=3)
    call expect(st, SHARDOPT_ERROR_INVALID_ARGUMENT, msg, '''w'' has 16 elements, but rows x cols is 5 x 3')
    call shardopt_add_param(k, 'w', 15, iw, st, group=grp, errmsg=msg, rows=5)
    call expect(st, SHARDOPT_ERROR_INVALID_ARGUMENT, msg, 'give both rows= and cols=')
    call shardopt_add_param(k, 'w', 0, iw, st, group=grp, errmsg=msg, rows=0, cols=3)
    call expect(st, SHARDOPT_ERROR_INVALID_ARGUMENT, msg, 'rows x cols is 0 x 3')
    call shardopt_add_param(k, 'w', 15_c_int64_t, iw, st, group=grp, errmsg=msg, rows=5, cols=3)
    call expect(st, SHARDOPT_SUCCESS, msg, '')
    call shardopt_add_param(k, 'v', 12, iw, st, group=grp, errmsg=msg)
    call expect(st, SHARDOPT_SUCCESS, msg, '')
    call shardopt_finalize(k, st, msg)
    call expect(st, SHARDOPT_ERROR_INVALID_ARGUMENT, msg, 'parameter ''v'' is in a Muon group')
    call shardopt_destroy(k, st, msg)
    call expect(st, SHARDOPT_SUCCESS, msg, '')
  end subroutine check_muon_errors

  !> Adafactor's mistakes: bad options by keyword (the library's message), Adafactor without
  !> whole ownership (refused at finalize, naming the parameter), and
  !> shardopt_get_factored_state on a vector, with wrong sizes and at index 0.
  subroutine check_adafactor_errors()
    type(shardopt_optimizer) :: k
    type(shardopt_config) :: c
    integer :: st, grp, iw, iv
    real(c_float) :: row_var(5), col_var(3)
    call shardopt_config_init(c, st)
    call shardopt_create(k, st, config=c, errmsg=msg)
    call expect(st, SHARDOPT_SUCCESS, msg, '')
    call shardopt_add_group(k, 1.0_c_double, .false., iw, st, errmsg=msg, &
                            rule=SHARDOPT_RULE_ADAFACTOR, adafactor_beta2_decay=0.5_c_double)
    call expect(st, SHARDOPT_ERROR_INVALID_ARGUMENT, msg, 'Adafactor beta2_decay')
    call shardopt_add_group(k, 1.0_c_double, .false., iw, st, errmsg=msg, &
                            rule=SHARDOPT_RULE_ADAFACTOR, adafactor_d=0.5_c_double)
    call expect(st, SHARDOPT_ERROR_INVALID_ARGUMENT, msg, 'Adafactor d')
    call shardopt_add_group(k, 1.0_c_double, .false., grp, st, errmsg=msg, &
                            rule=SHARDOPT_RULE_ADAFACTOR, adafactor_maximize=.true.)
    call expect(st, SHARDOPT_SUCCESS, msg, '')
    call shardopt_add_param(k, 'w', 15, iw, st, group=grp, errmsg=msg, rows=5, cols=3)
    call expect(st, SHARDOPT_SUCCESS, msg, '')
    call shardopt_finalize(k, st, msg)
    call expect(st, SHARDOPT_ERROR_INVALID_ARGUMENT, msg, 'parameter ''w'' (5 x 3, group 1)')
    call shardopt_destroy(k, st, msg)
    c%ownership = SHARDOPT_OWNERSHIP_WHOLE
    call shardopt_create(k, st, config=c, errmsg=msg)
    call expect(st, SHARDOPT_SUCCESS, msg, '')
    call shardopt_add_group(k, 1.0_c_double, .false., grp, st, errmsg=msg, &
                            rule=SHARDOPT_RULE_ADAFACTOR)
    call expect(st, SHARDOPT_SUCCESS, msg, '')
    call shardopt_add_param(k, 'w', 15, iw, st, group=grp, errmsg=msg, rows=5, cols=3)
    call expect(st, SHARDOPT_SUCCESS, msg, '')
    call shardopt_add_param(k, 'v', 12, iv, st, group=grp, errmsg=msg)
    call expect(st, SHARDOPT_SUCCESS, msg, '')
    call shardopt_finalize(k, st, msg)
    call expect(st, SHARDOPT_SUCCESS, msg, '')
    call shardopt_get_factored_state(k, iw, row_var, col_var, st, msg)
    call expect(st, SHARDOPT_SUCCESS, msg, '')
    call shardopt_get_factored_state(k, iw, col_var, row_var, st, msg)
    call expect(st, SHARDOPT_ERROR_INVALID_ARGUMENT, msg, 'has 5 rows and 3 columns')
    call shardopt_get_factored_state(k, iv, row_var, col_var, st, msg)
    call expect(st, SHARDOPT_ERROR_INVALID_ARGUMENT, msg, 'keeps no factored statistics')
    call shardopt_get_factored_state(k, 0, row_var, col_var, st, msg)
    call expect(st, SHARDOPT_ERROR_INVALID_ARGUMENT, msg, 'indices start at 1')
    call shardopt_destroy(k, st, msg)
    call expect(st, SHARDOPT_SUCCESS, msg, '')
  end subroutine check_adafactor_errors

  subroutine fail(what, value)
    character(len=*), intent(in) :: what
    integer, intent(in) :: value
    print '(a,a,i0)', 'FAILED: ', what, value
    failures = failures + 1
  end subroutine fail

  subroutine expect(status, want, msg, fragment)
    integer, intent(in) :: status, want
    character(len=*), intent(in) :: msg, fragment
    if (status /= want) then
      print '(a,i0,a,i0,a,a)', 'FAILED: status ', status, ' (want ', want, '): ', trim(msg)
      failures = failures + 1
    else if (index(msg, fragment) == 0) then
      print '(a,a,a,a)', 'FAILED: message "', trim(msg), '" lacks ', fragment
      failures = failures + 1
    end if
  end subroutine expect

end program test_fortran_api
