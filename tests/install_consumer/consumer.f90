! consumer.f90: one AdamW step through the installed Fortran module.
program consumer_f
  use, intrinsic :: iso_c_binding, only: c_float, c_double
  use shardopt
  implicit none
  type(shardopt_optimizer) :: opt
  type(shardopt_config) :: cfg
  real(c_float) :: out(2)
  real(c_float), pointer :: g(:)
  integer :: status, w
  character(len=256) :: msg

  call shardopt_config_init(cfg, status)
  cfg%lr = 0.1_c_double
  cfg%weight_decay = 0
  call shardopt_create(opt, status, config=cfg, errmsg=msg)
  if (status == SHARDOPT_SUCCESS) call shardopt_add_param(opt, 'w', 2, w, status, errmsg=msg)
  if (status == SHARDOPT_SUCCESS) call shardopt_finalize(opt, status, msg)
  if (status == SHARDOPT_SUCCESS) call shardopt_set_param(opt, w, [1.0_c_float, -1.0_c_float], status, msg)
  if (status == SHARDOPT_SUCCESS) call shardopt_grad(opt, w, g, status, msg)
  if (status == SHARDOPT_SUCCESS) then
    g = [0.5_c_float, -2.0_c_float]  ! written in place, through the pointer
    call shardopt_step(opt, status, errmsg=msg)
  end if
  if (status == SHARDOPT_SUCCESS) call shardopt_get_master(opt, w, out, status, msg)
  if (status /= SHARDOPT_SUCCESS) then
    print '(a,a)', 'consumer_f: ', trim(msg)
    error stop 1
  end if
  call shardopt_destroy(opt, status)
  if (.not. shardopt_is_null(opt) .or. abs(out(1) - 0.9) > 1e-6 .or. abs(out(2) + 0.9) > 1e-6) then
    print *, 'consumer_f: got', out, ', expected 0.9 -0.9'
    error stop 1
  end if
  print '(a,a,a)', 'consumer_f: shardopt ', shardopt_version_string(), ' works'
end program consumer_f
