! test_fortran_api.f90: the Fortran module's error paths: status codes and messages for wrong
! sizes, shapes, indices, order and a destroyed handle, never a crash.
program test_fortran_api
  use, intrinsic :: iso_c_binding, only: c_float, c_double, c_int16_t, c_int64_t
  use shardopt
  implicit none
  type(shardopt_optimizer) :: opt
  type(shardopt_config) :: cfg
  real(c_float) :: v(10), m(2, 5)
  real(c_float), pointer :: p2(:, :), g(:)
  integer(c_int16_t), pointer :: bits(:), flat_bits(:)
  integer(c_int64_t) :: n
  real(c_double) :: lr_scale
  logical :: wd
  integer :: status, ia, ib, grp, failures
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

  if (failures > 0) error stop 1
  print '(a)', 'test_fortran_api: all checks passed'

contains

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
