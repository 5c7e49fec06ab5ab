! shardopt.f90: the Fortran module over the C ABI (shardopt.h).
!
! Every procedure is a subroutine with a mandatory integer `status` (SHARDOPT_SUCCESS == 0 or
! one of the SHARDOPT_ERROR_* codes of shardopt.h) and an optional `errmsg` that receives the
! failing call and the reason ('' on success).
! Argument order, one rule everywhere: the handle, then the required arguments, then `status`,
! then the optional arguments, `errmsg` last. So `status` follows `index` in
! shardopt_add_param(opt, name, numel, index, status [, group, errmsg]) but comes right after
! the handle in shardopt_begin_unit(opt, status [, unit, errmsg]), whose `unit` is optional.
! Every argument may be passed by keyword (status=, errmsg=, unit=, keep=, ...), in any order
! after the positional ones: call shardopt_save_checkpoint(opt, dir, keep=3, status=st).
! Indices of parameters, groups and stage-3 units are 1-based here (the C ABI's are
! 0-based): add_param returns 1, 2, ...; the default group is 1; the first unit is 1. An
! index below 1 fails with SHARDOPT_ERROR_INVALID_ARGUMENT and an errmsg that says so
! ("shardopt_param: parameter index 0: Fortran indices start at 1 (have 6)").
! Arrays cross without copies where the C side keeps them: shardopt_param, shardopt_replica and
! shardopt_grad return Fortran pointers (rank 1, or rank 2 with a `shape`) into the optimizer's
! buffers; their contracts (lifetime, when they read new values) are those of shardopt.h.
! Communicators are integers: MPI_COMM_WORLD from `use mpi`, or comm%MPI_VAL of a
! type(MPI_Comm) from `use mpi_f08` (docs/c_api.md).
! 2-D shapes are row-major, as in C (shardopt_add_param_2d): a matrix of `rows` x `cols` has
! element (r, c) at r * cols + c. A Fortran array declared w(cols, rows) is that same memory
! (column-major: w(c+1, r+1) is element r * cols + c), so register it with
! rows = size(w, 2), cols = size(w, 1):
!   call shardopt_add_param(opt, 'w', size(w), iw, st, group=g, rows=size(w, 2), cols=size(w, 1))
! A torch (out_features, in_features) weight is w(in_features, out_features) here; rank-2
! pointers (shardopt_param, shardopt_grad with shape=shape(w)) then index it as w(in, out).
module shardopt
  use, intrinsic :: iso_c_binding, only: c_ptr, c_null_ptr, c_associated, c_f_pointer, &
                                         c_int, c_int16_t, c_int64_t, c_size_t, c_float, &
                                         c_double, c_char, c_null_char
  implicit none
  private

  ! ---- status codes (shardopt_status_t) ----------------------------------------------------
  integer, parameter, public :: SHARDOPT_SUCCESS = 0
  integer, parameter, public :: SHARDOPT_ERROR_INVALID_ARGUMENT = 1
  integer, parameter, public :: SHARDOPT_ERROR_INVALID_STATE = 2
  integer, parameter, public :: SHARDOPT_ERROR_LAYOUT_MISMATCH = 3
  integer, parameter, public :: SHARDOPT_ERROR_REMOTE = 4
  integer, parameter, public :: SHARDOPT_ERROR_COMMUNICATION = 5
  integer, parameter, public :: SHARDOPT_ERROR_OUT_OF_MEMORY = 6
  integer, parameter, public :: SHARDOPT_ERROR_IO = 7
  integer, parameter, public :: SHARDOPT_ERROR_CORRUPT_DATA = 8
  integer, parameter, public :: SHARDOPT_ERROR_UNSUPPORTED = 9
  integer, parameter, public :: SHARDOPT_ERROR_CUDA = 10
  integer, parameter, public :: SHARDOPT_ERROR_INTERNAL = 11

  ! ---- option values -------------------------------------------------------------------------
  integer(c_int), parameter, public :: SHARDOPT_STAGE_DATA_PARALLEL = 0
  integer(c_int), parameter, public :: SHARDOPT_STAGE_ZERO1 = 1
  integer(c_int), parameter, public :: SHARDOPT_STAGE_ZERO2 = 2
  integer(c_int), parameter, public :: SHARDOPT_STAGE_ZERO3 = 3
  integer(c_int), parameter, public :: SHARDOPT_DTYPE_F32 = 0
  integer(c_int), parameter, public :: SHARDOPT_DTYPE_BF16 = 1
  integer(c_int), parameter, public :: SHARDOPT_DEVICE_CPU = 0
  integer(c_int), parameter, public :: SHARDOPT_DEVICE_CUDA = 1
  integer(c_int), parameter, public :: SHARDOPT_ADAMW = 0
  integer(c_int), parameter, public :: SHARDOPT_ADAM_L2 = 1
  integer(c_int), parameter, public :: SHARDOPT_COMM_AUTO = 0
  integer(c_int), parameter, public :: SHARDOPT_COMM_MPI = 1
  integer(c_int), parameter, public :: SHARDOPT_COMM_SHM = 2
  integer(c_int), parameter, public :: SHARDOPT_GATHER_EAGER = 0
  integer(c_int), parameter, public :: SHARDOPT_GATHER_LAZY = 1
  integer(c_int), parameter, public :: SHARDOPT_REDUCTION_DEFAULT = 0
  integer(c_int), parameter, public :: SHARDOPT_REDUCTION_REPRODUCIBLE = 1
  !> A parameter group's update rule (shardopt_add_group's rule argument, shardopt_rule_t).
  integer(c_int), parameter, public :: SHARDOPT_RULE_ADAMW = 0
  integer(c_int), parameter, public :: SHARDOPT_RULE_LION = 1
  integer(c_int), parameter, public :: SHARDOPT_RULE_ADAMW8BIT = 2
  !> Muon on 2-D matrices (shardopt.h): every parameter of the group registered with rows= and
  !> cols=, and shardopt_config%ownership = SHARDOPT_OWNERSHIP_WHOLE.
  integer(c_int), parameter, public :: SHARDOPT_RULE_MUON = 3
  !> Adafactor (shardopt.h): a parameter registered with rows= and cols= (both > 1) keeps
  !> factored second moments, any other a per-element variance; shardopt_config%ownership =
  !> SHARDOPT_OWNERSHIP_WHOLE.
  integer(c_int), parameter, public :: SHARDOPT_RULE_ADAFACTOR = 4
  !> Muon's learning-rate adjustment (shardopt_add_group's muon_lr_adjust).
  integer(c_int), parameter, public :: SHARDOPT_MUON_LR_ORIGINAL = 0
  integer(c_int), parameter, public :: SHARDOPT_MUON_LR_MATCH_RMS_ADAMW = 1
  integer(c_int), parameter, public :: SHARDOPT_MUON_LR_NONE = 2
  !> shardopt_config%ownership: equal slices (default) or whole parameters per rank.
  integer(c_int), parameter, public :: SHARDOPT_OWNERSHIP_FLAT = 0
  integer(c_int), parameter, public :: SHARDOPT_OWNERSHIP_WHOLE = 1
  !> shardopt_config%collective_timeout_s for no timeout; 0 (the default) means 600 s, or
  !> SHARDOPT_COLLECTIVE_TIMEOUT from the environment. A timeout returns
  !> SHARDOPT_ERROR_COMMUNICATION on every waiting rank: end the job with MPI_Abort (not
  !> MPI_Finalize, which would wait for the missing ranks).
  real(c_double), parameter, public :: SHARDOPT_NO_COLLECTIVE_TIMEOUT = -1.0_c_double
  integer(c_int), parameter, public :: SHARDOPT_HYPER_LR = 0
  integer(c_int), parameter, public :: SHARDOPT_HYPER_BETA1 = 1
  integer(c_int), parameter, public :: SHARDOPT_HYPER_BETA2 = 2
  integer(c_int), parameter, public :: SHARDOPT_HYPER_EPS = 3
  integer(c_int), parameter, public :: SHARDOPT_HYPER_WEIGHT_DECAY = 4
  integer(c_int), parameter, public :: SHARDOPT_HYPER_MAX_GRAD_NORM = 5
  integer(c_int), parameter, public :: SHARDOPT_HYPER_ADAM_MODE = 6
  integer(c_int), parameter, public :: SHARDOPT_MEM_PARAMS = 0
  integer(c_int), parameter, public :: SHARDOPT_MEM_GRADS = 1
  integer(c_int), parameter, public :: SHARDOPT_MEM_MASTER = 2
  integer(c_int), parameter, public :: SHARDOPT_MEM_MOMENTS = 3
  integer(c_int), parameter, public :: SHARDOPT_MEM_SCRATCH = 4
  integer(c_int), parameter, public :: SHARDOPT_MEM_TOTAL = 5
  !> The default parameter group (group 0 of the C ABI).
  integer, parameter, public :: SHARDOPT_DEFAULT_GROUP = 1

  ! ---- types -----------------------------------------------------------------------------------
  !> An optimizer; null until shardopt_create, null again after shardopt_destroy.
  type, public :: shardopt_optimizer
    private
    type(c_ptr) :: ptr = c_null_ptr
  end type shardopt_optimizer

  !> Creation options (shardopt_config_t, field for field). Fill with shardopt_config_init,
  !> then change fields; the meaning and defaults of each are in shardopt.h.
  type, bind(c), public :: shardopt_config
    integer(c_size_t) :: struct_size
    integer(c_int) :: stage
    integer(c_int) :: param_dtype
    integer(c_int) :: device
    integer(c_int) :: adam_mode
    real(c_double) :: lr
    real(c_double) :: beta1
    real(c_double) :: beta2
    real(c_double) :: eps
    real(c_double) :: weight_decay
    real(c_double) :: max_grad_norm
    integer(c_size_t) :: bucket_elems
    integer(c_int) :: overlap
    integer(c_int) :: buckets_in_flight
    integer(c_int) :: reduce_dtype
    integer(c_int) :: comm_kind
    integer(c_int) :: comm_simulate_nodes
    integer(c_int) :: gather_mode
    integer(c_int) :: loss_scaling
    integer(c_int) :: loss_scale_growth_interval
    real(c_double) :: loss_scale_initial
    real(c_double) :: loss_scale_growth_factor
    real(c_double) :: loss_scale_backoff_factor
    real(c_double) :: loss_scale_min
    real(c_double) :: loss_scale_max
    integer(c_size_t) :: units_in_flight
    real(c_double) :: collective_timeout_s
    integer(c_int) :: debug_collectives
    integer(c_int) :: comm_mpi_in_flight
    integer(c_int) :: reduction
    integer(c_int) :: reserved0
    integer(c_int) :: ownership
    integer(c_int) :: reserved1
  end type shardopt_config

  !> shardopt_group_t, field for field (internal: shardopt_add_group's optional arguments).
  type, bind(c) :: c_group_options
    integer(c_size_t) :: struct_size
    real(c_double) :: lr_scale
    integer(c_int) :: weight_decay
    integer(c_int) :: rule
    real(c_double) :: lion_beta1
    real(c_double) :: lion_beta2
    integer(c_size_t) :: adamw8bit_min_numel
    real(c_double) :: muon_momentum
    integer(c_int) :: muon_nesterov
    integer(c_int) :: muon_ns_steps
    real(c_double) :: muon_ns_a
    real(c_double) :: muon_ns_b
    real(c_double) :: muon_ns_c
    real(c_double) :: muon_eps
    integer(c_int) :: muon_lr_adjust
    integer(c_int) :: reserved0
    real(c_double) :: adafactor_beta2_decay
    real(c_double) :: adafactor_eps1
    real(c_double) :: adafactor_eps2
    real(c_double) :: adafactor_d
    integer(c_int) :: adafactor_maximize
    integer(c_int) :: reserved1
  end type c_group_options

  !> What one step did (shardopt_step_result_t); clipped and skipped are 0 or 1, times are
  !> seconds on this rank. shardopt_step sets struct_size itself.
  type, bind(c), public :: shardopt_step_result
    integer(c_size_t) :: struct_size
    real(c_double) :: grad_norm
    real(c_double) :: clip_coef
    integer(c_int) :: clipped
    integer(c_int) :: skipped
    integer(c_int64_t) :: step
    integer(c_int64_t) :: skipped_steps
    real(c_double) :: loss_scale
    real(c_double) :: time_reduce
    real(c_double) :: time_norm
    real(c_double) :: time_update
    real(c_double) :: time_gather
    real(c_double) :: time_total
  end type shardopt_step_result

  ! ---- public procedures -----------------------------------------------------------------------
  public :: shardopt_version, shardopt_version_string, shardopt_status_string, shardopt_last_error
  public :: shardopt_bf16_to_real, shardopt_real_to_bf16
  public :: shardopt_config_init, shardopt_create, shardopt_destroy, shardopt_is_null
  public :: shardopt_add_group, shardopt_add_param, shardopt_finalize
  public :: shardopt_comm_rank, shardopt_comm_size, shardopt_num_params, shardopt_param_numel
  public :: shardopt_param_shape
  public :: shardopt_step_count
  public :: shardopt_set_param, shardopt_get_master, shardopt_param, shardopt_param_bf16
  public :: shardopt_grad, shardopt_accumulate_grad, shardopt_grad_ready
  public :: shardopt_begin_backward, shardopt_reduce_gradients, shardopt_zero_grad
  public :: shardopt_step, shardopt_set_lr, shardopt_get_lr, shardopt_set_hyper, shardopt_get_hyper
  public :: shardopt_set_group, shardopt_memory_usage
  public :: shardopt_comm_name, shardopt_get_config, shardopt_num_groups, shardopt_get_group
  public :: shardopt_get_exp_avg, shardopt_get_exp_avg_sq, shardopt_replica, shardopt_replica_bf16
  public :: shardopt_get_factored_state
  public :: shardopt_param_offset, shardopt_wait_param, shardopt_wait_all, shardopt_progress
  public :: shardopt_get_loss_scale, shardopt_set_loss_scale
  public :: shardopt_save_checkpoint, shardopt_load_checkpoint
  public :: shardopt_param_index, shardopt_mem_category_name
  public :: shardopt_begin_unit, shardopt_num_units, shardopt_acquire, shardopt_prefetch
  public :: shardopt_release

  !> Registers a parameter; numel may be a default or a 64-bit integer.
  interface shardopt_add_param
    module procedure add_param_i32, add_param_i64
  end interface shardopt_add_param
  !> Sets a parameter from a rank-1 or rank-2 real(c_float) array (numel elements in all).
  interface shardopt_set_param
    module procedure set_param_r1, set_param_r2
  end interface shardopt_set_param
  !> Collective: the fp32 master weights into a rank-1 or rank-2 array.
  interface shardopt_get_master
    module procedure get_master_r1, get_master_r2
  end interface shardopt_get_master
  !> Collective: the Adam first moment (m) of a parameter into a rank-1 or rank-2 array.
  interface shardopt_get_exp_avg
    module procedure get_exp_avg_r1, get_exp_avg_r2
  end interface shardopt_get_exp_avg
  !> Collective: the Adam second moment (v) of a parameter into a rank-1 or rank-2 array.
  interface shardopt_get_exp_avg_sq
    module procedure get_exp_avg_sq_r1, get_exp_avg_sq_r2
  end interface shardopt_get_exp_avg_sq
  !> A pointer to the fp32 replica: rank 1 (numel), or rank 2 with `shape`.
  interface shardopt_param
    module procedure param_f32_r1, param_f32_r2
  end interface shardopt_param
  !> A pointer to the bf16 replica as integer(c_int16_t) bit patterns.
  interface shardopt_param_bf16
    module procedure param_bf16_r1, param_bf16_r2
  end interface shardopt_param_bf16
  !> A pointer to the fp32 gradient: rank 1 (numel), or rank 2 with `shape`.
  interface shardopt_grad
    module procedure grad_r1, grad_r2
  end interface shardopt_grad
  !> grad += src, from real(c_float) (rank 1 or 2) or bf16 bits (integer(c_int16_t)).
  interface shardopt_accumulate_grad
    module procedure accumulate_f32_r1, accumulate_f32_r2, accumulate_bf16_r1
  end interface shardopt_accumulate_grad

  ! ---- the C functions (private) ---------------------------------------------------------------
  interface
    function c_version() bind(c, name="shardopt_version")
      import :: c_int
      integer(c_int) :: c_version
    end function
    function c_version_string() bind(c, name="shardopt_version_string")
      import :: c_ptr
      type(c_ptr) :: c_version_string
    end function
    function c_status_string(s) bind(c, name="shardopt_status_string")
      import :: c_int, c_ptr
      integer(c_int), value :: s
      type(c_ptr) :: c_status_string
    end function
    function c_last_error(opt) bind(c, name="shardopt_last_error")
      import :: c_ptr
      type(c_ptr), value :: opt
      type(c_ptr) :: c_last_error
    end function
    pure function c_bf16_to_float(bits) bind(c, name="shardopt_bf16_to_float")
      import :: c_int16_t, c_float
      integer(c_int16_t), value :: bits
      real(c_float) :: c_bf16_to_float
    end function
    pure function c_float_to_bf16(x) bind(c, name="shardopt_float_to_bf16")
      import :: c_int16_t, c_float
      real(c_float), value :: x
      integer(c_int16_t) :: c_float_to_bf16
    end function
    function c_strlen(s) bind(c, name="strlen")
      import :: c_ptr, c_size_t
      type(c_ptr), value :: s
      integer(c_size_t) :: c_strlen
    end function
    function c_config_init(cfg) bind(c, name="shardopt_config_init")
      import :: c_int, shardopt_config
      type(shardopt_config), intent(out) :: cfg
      integer(c_int) :: c_config_init
    end function
    function c_create(opt, cfg) bind(c, name="shardopt_create")
      import :: c_int, c_ptr, shardopt_config
      type(c_ptr), intent(out) :: opt
      type(shardopt_config), intent(in) :: cfg
      integer(c_int) :: c_create
    end function
    function c_create_mpi_f(opt, comm, cfg) bind(c, name="shardopt_create_mpi_f")
      import :: c_int, c_ptr, shardopt_config
      type(c_ptr), intent(out) :: opt
      integer(c_int), value :: comm
      type(shardopt_config), intent(in) :: cfg
      integer(c_int) :: c_create_mpi_f
    end function
    function c_destroy(opt) bind(c, name="shardopt_destroy")
      import :: c_int, c_ptr
      type(c_ptr), value :: opt
      integer(c_int) :: c_destroy
    end function
    function c_add_group(opt, lr_scale, wd, group) bind(c, name="shardopt_add_group")
      import :: c_int, c_ptr, c_double
      type(c_ptr), value :: opt
      real(c_double), value :: lr_scale
      integer(c_int), value :: wd
      integer(c_int), intent(out) :: group
      integer(c_int) :: c_add_group
    end function
    subroutine c_group_init(group) bind(c, name="shardopt_group_init")
      import :: c_group_options
      type(c_group_options), intent(out) :: group
    end subroutine
    function c_add_group_ex(opt, group, idx) bind(c, name="shardopt_add_group_ex")
      import :: c_int, c_ptr, c_group_options
      type(c_ptr), value :: opt
      type(c_group_options), intent(in) :: group
      integer(c_int), intent(out) :: idx
      integer(c_int) :: c_add_group_ex
    end function
    function c_set_group_ex(opt, idx, group) bind(c, name="shardopt_set_group_ex")
      import :: c_int, c_ptr, c_group_options
      type(c_ptr), value :: opt
      integer(c_int), value :: idx
      type(c_group_options), intent(in) :: group
      integer(c_int) :: c_set_group_ex
    end function
    function c_get_group_ex(opt, idx, group) bind(c, name="shardopt_get_group_ex")
      import :: c_int, c_ptr, c_group_options
      type(c_ptr), value :: opt
      integer(c_int), value :: idx
      type(c_group_options), intent(inout) :: group
      integer(c_int) :: c_get_group_ex
    end function
    function c_add_param(opt, name, numel, group, idx) bind(c, name="shardopt_add_param")
      import :: c_int, c_ptr, c_char, c_size_t
      type(c_ptr), value :: opt
      character(kind=c_char), intent(in) :: name(*)
      integer(c_size_t), value :: numel
      integer(c_int), value :: group
      integer(c_size_t), intent(out) :: idx
      integer(c_int) :: c_add_param
    end function
    function c_add_param_2d(opt, name, rows, cols, group, idx) bind(c, name="shardopt_add_param_2d")
      import :: c_int, c_ptr, c_char, c_size_t
      type(c_ptr), value :: opt
      character(kind=c_char), intent(in) :: name(*)
      integer(c_size_t), value :: rows, cols
      integer(c_int), value :: group
      integer(c_size_t), intent(out) :: idx
      integer(c_int) :: c_add_param_2d
    end function
    function c_param_shape(opt, idx, rows, cols) bind(c, name="shardopt_param_shape")
      import :: c_int, c_ptr, c_size_t
      type(c_ptr), value :: opt
      integer(c_size_t), value :: idx
      integer(c_size_t), intent(out) :: rows, cols
      integer(c_int) :: c_param_shape
    end function
    function c_finalize(opt) bind(c, name="shardopt_finalize")
      import :: c_int, c_ptr
      type(c_ptr), value :: opt
      integer(c_int) :: c_finalize
    end function
    function c_comm_rank(opt, r) bind(c, name="shardopt_comm_rank")
      import :: c_int, c_ptr
      type(c_ptr), value :: opt
      integer(c_int), intent(out) :: r
      integer(c_int) :: c_comm_rank
    end function
    function c_comm_size(opt, n) bind(c, name="shardopt_comm_size")
      import :: c_int, c_ptr
      type(c_ptr), value :: opt
      integer(c_int), intent(out) :: n
      integer(c_int) :: c_comm_size
    end function
    function c_num_params(opt, n) bind(c, name="shardopt_num_params")
      import :: c_int, c_ptr, c_size_t
      type(c_ptr), value :: opt
      integer(c_size_t), intent(out) :: n
      integer(c_int) :: c_num_params
    end function
    function c_param_numel(opt, idx, n) bind(c, name="shardopt_param_numel")
      import :: c_int, c_ptr, c_size_t
      type(c_ptr), value :: opt
      integer(c_size_t), value :: idx
      integer(c_size_t), intent(out) :: n
      integer(c_int) :: c_param_numel
    end function
    function c_step_count(opt, s) bind(c, name="shardopt_step_count")
      import :: c_int, c_ptr, c_int64_t
      type(c_ptr), value :: opt
      integer(c_int64_t), intent(out) :: s
      integer(c_int) :: c_step_count
    end function
    function c_set_param(opt, idx, v, n) bind(c, name="shardopt_set_param")
      import :: c_int, c_ptr, c_size_t, c_float
      type(c_ptr), value :: opt
      integer(c_size_t), value :: idx
      real(c_float), intent(in) :: v(*)
      integer(c_size_t), value :: n
      integer(c_int) :: c_set_param
    end function
    function c_get_master(opt, idx, v, n) bind(c, name="shardopt_get_master")
      import :: c_int, c_ptr, c_size_t, c_float
      type(c_ptr), value :: opt
      integer(c_size_t), value :: idx
      real(c_float), intent(inout) :: v(*)
      integer(c_size_t), value :: n
      integer(c_int) :: c_get_master
    end function
    function c_param_f32(opt, idx, p, n) bind(c, name="shardopt_param_f32")
      import :: c_int, c_ptr, c_size_t
      type(c_ptr), value :: opt
      integer(c_size_t), value :: idx
      type(c_ptr), intent(out) :: p
      integer(c_size_t), intent(out) :: n
      integer(c_int) :: c_param_f32
    end function
    function c_param_bf16(opt, idx, p, n) bind(c, name="shardopt_param_bf16")
      import :: c_int, c_ptr, c_size_t
      type(c_ptr), value :: opt
      integer(c_size_t), value :: idx
      type(c_ptr), intent(out) :: p
      integer(c_size_t), intent(out) :: n
      integer(c_int) :: c_param_bf16
    end function
    function c_grad(opt, idx, p, n) bind(c, name="shardopt_grad")
      import :: c_int, c_ptr, c_size_t
      type(c_ptr), value :: opt
      integer(c_size_t), value :: idx
      type(c_ptr), intent(out) :: p
      integer(c_size_t), intent(out) :: n
      integer(c_int) :: c_grad
    end function
    function c_accumulate_f32(opt, idx, v, n) bind(c, name="shardopt_accumulate_grad_f32")
      import :: c_int, c_ptr, c_size_t, c_float
      type(c_ptr), value :: opt
      integer(c_size_t), value :: idx
      real(c_float), intent(in) :: v(*)
      integer(c_size_t), value :: n
      integer(c_int) :: c_accumulate_f32
    end function
    function c_accumulate_bf16(opt, idx, v, n) bind(c, name="shardopt_accumulate_grad_bf16")
      import :: c_int, c_ptr, c_size_t, c_int16_t
      type(c_ptr), value :: opt
      integer(c_size_t), value :: idx
      integer(c_int16_t), intent(in) :: v(*)
      integer(c_size_t), value :: n
      integer(c_int) :: c_accumulate_bf16
    end function
    function c_grad_ready(opt, idx) bind(c, name="shardopt_grad_ready")
      import :: c_int, c_ptr, c_size_t
      type(c_ptr), value :: opt
      integer(c_size_t), value :: idx
      integer(c_int) :: c_grad_ready
    end function
    function c_begin_backward(opt, sync) bind(c, name="shardopt_begin_backward")
      import :: c_int, c_ptr
      type(c_ptr), value :: opt
      integer(c_int), value :: sync
      integer(c_int) :: c_begin_backward
    end function
    function c_reduce_gradients(opt) bind(c, name="shardopt_reduce_gradients")
      import :: c_int, c_ptr
      type(c_ptr), value :: opt
      integer(c_int) :: c_reduce_gradients
    end function
    function c_zero_grad(opt) bind(c, name="shardopt_zero_grad")
      import :: c_int, c_ptr
      type(c_ptr), value :: opt
      integer(c_int) :: c_zero_grad
    end function
    function c_step(opt, r) bind(c, name="shardopt_step")
      import :: c_int, c_ptr, shardopt_step_result
      type(c_ptr), value :: opt
      type(shardopt_step_result), intent(out) :: r
      integer(c_int) :: c_step
    end function
    function c_set_lr(opt, lr) bind(c, name="shardopt_set_lr")
      import :: c_int, c_ptr, c_double
      type(c_ptr), value :: opt
      real(c_double), value :: lr
      integer(c_int) :: c_set_lr
    end function
    function c_get_lr(opt, lr) bind(c, name="shardopt_get_lr")
      import :: c_int, c_ptr, c_double
      type(c_ptr), value :: opt
      real(c_double), intent(out) :: lr
      integer(c_int) :: c_get_lr
    end function
    function c_set_hyper(opt, key, v) bind(c, name="shardopt_set_hyper")
      import :: c_int, c_ptr, c_double
      type(c_ptr), value :: opt
      integer(c_int), value :: key
      real(c_double), value :: v
      integer(c_int) :: c_set_hyper
    end function
    function c_get_hyper(opt, key, v) bind(c, name="shardopt_get_hyper")
      import :: c_int, c_ptr, c_double
      type(c_ptr), value :: opt
      integer(c_int), value :: key
      real(c_double), intent(out) :: v
      integer(c_int) :: c_get_hyper
    end function
    function c_set_group(opt, group, lr_scale, wd) bind(c, name="shardopt_set_group")
      import :: c_int, c_ptr, c_double
      type(c_ptr), value :: opt
      integer(c_int), value :: group
      real(c_double), value :: lr_scale
      integer(c_int), value :: wd
      integer(c_int) :: c_set_group
    end function
    function c_memory_usage(opt, cat, bytes, peak) bind(c, name="shardopt_memory_usage")
      import :: c_int, c_ptr, c_size_t
      type(c_ptr), value :: opt
      integer(c_int), value :: cat
      integer(c_size_t), intent(out) :: bytes, peak
      integer(c_int) :: c_memory_usage
    end function
    function c_param_index(opt, name, idx) bind(c, name="shardopt_param_index")
      import :: c_int, c_ptr, c_char, c_size_t
      type(c_ptr), value :: opt
      character(kind=c_char), intent(in) :: name(*)
      integer(c_size_t), intent(out) :: idx
      integer(c_int) :: c_param_index
    end function
    function c_mem_category_name(cat) bind(c, name="shardopt_mem_category_name")
      import :: c_int, c_ptr
      integer(c_int), value :: cat
      type(c_ptr) :: c_mem_category_name
    end function
    function c_step_result_init(r) bind(c, name="shardopt_step_result_init")
      import :: c_int, shardopt_step_result
      type(shardopt_step_result), intent(out) :: r
      integer(c_int) :: c_step_result_init
    end function
    function c_comm_name(opt, name) bind(c, name="shardopt_comm_name")
      import :: c_int, c_ptr
      type(c_ptr), value :: opt
      type(c_ptr), intent(out) :: name
      integer(c_int) :: c_comm_name
    end function
    function c_get_config(opt, cfg) bind(c, name="shardopt_get_config")
      import :: c_int, c_ptr, shardopt_config
      type(c_ptr), value :: opt
      type(shardopt_config), intent(inout) :: cfg
      integer(c_int) :: c_get_config
    end function
    function c_num_groups(opt, n) bind(c, name="shardopt_num_groups")
      import :: c_int, c_ptr
      type(c_ptr), value :: opt
      integer(c_int), intent(out) :: n
      integer(c_int) :: c_num_groups
    end function
    function c_get_group(opt, group, lr_scale, wd) bind(c, name="shardopt_get_group")
      import :: c_int, c_ptr, c_double
      type(c_ptr), value :: opt
      integer(c_int), value :: group
      real(c_double), intent(out) :: lr_scale
      integer(c_int), intent(out) :: wd
      integer(c_int) :: c_get_group
    end function
    function c_get_exp_avg(opt, idx, v, n) bind(c, name="shardopt_get_exp_avg")
      import :: c_int, c_ptr, c_size_t, c_float
      type(c_ptr), value :: opt
      integer(c_size_t), value :: idx
      real(c_float), intent(inout) :: v(*)
      integer(c_size_t), value :: n
      integer(c_int) :: c_get_exp_avg
    end function
    function c_get_exp_avg_sq(opt, idx, v, n) bind(c, name="shardopt_get_exp_avg_sq")
      import :: c_int, c_ptr, c_size_t, c_float
      type(c_ptr), value :: opt
      integer(c_size_t), value :: idx
      real(c_float), intent(inout) :: v(*)
      integer(c_size_t), value :: n
      integer(c_int) :: c_get_exp_avg_sq
    end function
    function c_get_factored_state(opt, idx, row_var, rows, col_var, cols) &
        bind(c, name="shardopt_get_factored_state")
      import :: c_int, c_ptr, c_size_t, c_float
      type(c_ptr), value :: opt
      integer(c_size_t), value :: idx
      real(c_float), intent(inout) :: row_var(*)
      integer(c_size_t), value :: rows
      real(c_float), intent(inout) :: col_var(*)
      integer(c_size_t), value :: cols
      integer(c_int) :: c_get_factored_state
    end function
    function c_replica(opt, p, n) bind(c, name="shardopt_replica")
      import :: c_int, c_ptr, c_size_t
      type(c_ptr), value :: opt
      type(c_ptr), intent(out) :: p
      integer(c_size_t), intent(out) :: n
      integer(c_int) :: c_replica
    end function
    function c_param_offset(opt, idx, off) bind(c, name="shardopt_param_offset")
      import :: c_int, c_ptr, c_size_t
      type(c_ptr), value :: opt
      integer(c_size_t), value :: idx
      integer(c_size_t), intent(out) :: off
      integer(c_int) :: c_param_offset
    end function
    function c_wait_param(opt, idx) bind(c, name="shardopt_wait_param")
      import :: c_int, c_ptr, c_size_t
      type(c_ptr), value :: opt
      integer(c_size_t), value :: idx
      integer(c_int) :: c_wait_param
    end function
    function c_wait_all(opt) bind(c, name="shardopt_wait_all")
      import :: c_int, c_ptr
      type(c_ptr), value :: opt
      integer(c_int) :: c_wait_all
    end function
    function c_progress(opt) bind(c, name="shardopt_progress")
      import :: c_int, c_ptr
      type(c_ptr), value :: opt
      integer(c_int) :: c_progress
    end function
    function c_get_loss_scale(opt, scale, good, skipped) bind(c, name="shardopt_get_loss_scale")
      import :: c_int, c_ptr, c_double, c_int64_t
      type(c_ptr), value :: opt
      real(c_double), intent(out) :: scale
      integer(c_int64_t), intent(out) :: good, skipped
      integer(c_int) :: c_get_loss_scale
    end function
    function c_set_loss_scale(opt, scale, good, skipped) bind(c, name="shardopt_set_loss_scale")
      import :: c_int, c_ptr, c_double, c_int64_t
      type(c_ptr), value :: opt
      real(c_double), value :: scale
      integer(c_int64_t), value :: good, skipped
      integer(c_int) :: c_set_loss_scale
    end function
    function c_save_checkpoint(opt, dir, keep, published) bind(c, name="shardopt_save_checkpoint")
      import :: c_int, c_ptr, c_char
      type(c_ptr), value :: opt
      character(kind=c_char), intent(in) :: dir(*)
      integer(c_int), value :: keep
      type(c_ptr), intent(out) :: published
      integer(c_int) :: c_save_checkpoint
    end function
    function c_load_checkpoint(opt, path) bind(c, name="shardopt_load_checkpoint")
      import :: c_int, c_ptr, c_char
      type(c_ptr), value :: opt
      character(kind=c_char), intent(in) :: path(*)
      integer(c_int) :: c_load_checkpoint
    end function
    function c_begin_unit(opt, unit) bind(c, name="shardopt_begin_unit")
      import :: c_int, c_ptr
      type(c_ptr), value :: opt
      integer(c_int), intent(out) :: unit
      integer(c_int) :: c_begin_unit
    end function
    function c_num_units(opt, n) bind(c, name="shardopt_num_units")
      import :: c_int, c_ptr, c_size_t
      type(c_ptr), value :: opt
      integer(c_size_t), intent(out) :: n
      integer(c_int) :: c_num_units
    end function
    function c_acquire(opt, unit) bind(c, name="shardopt_acquire")
      import :: c_int, c_ptr, c_size_t
      type(c_ptr), value :: opt
      integer(c_size_t), value :: unit
      integer(c_int) :: c_acquire
    end function
    function c_prefetch(opt, unit) bind(c, name="shardopt_prefetch")
      import :: c_int, c_ptr, c_size_t
      type(c_ptr), value :: opt
      integer(c_size_t), value :: unit
      integer(c_int) :: c_prefetch
    end function
    function c_release(opt, unit) bind(c, name="shardopt_release")
      import :: c_int, c_ptr, c_size_t
      type(c_ptr), value :: opt
      integer(c_size_t), value :: unit
      integer(c_int) :: c_release
    end function
  end interface

contains

  ! ---- helpers -------------------------------------------------------------------------------

  !> A copy of a NUL-terminated C string owned by the library.
  function from_c(p) result(s)
    type(c_ptr), intent(in) :: p
    character(len=:), allocatable :: s
    character(kind=c_char), pointer :: chars(:)
    integer(c_size_t) :: n, k
    if (.not. c_associated(p)) then
      s = ''
      return
    end if
    n = c_strlen(p)
    call c_f_pointer(p, chars, [n])
    allocate (character(len=n) :: s)
    do k = 1, n
      s(k:k) = chars(k)
    end do
  end function from_c

  !> Sets status from a C code, and errmsg (when present) from the handle's last error.
  subroutine finish(ptr, code, status, errmsg)
    type(c_ptr), intent(in) :: ptr
    integer(c_int), intent(in) :: code
    integer, intent(out) :: status
    character(len=*), intent(out), optional :: errmsg
    status = int(code)
    if (present(errmsg)) then
      if (code == SHARDOPT_SUCCESS) then
        errmsg = ''
      else
        errmsg = from_c(c_last_error(ptr))
      end if
    end if
  end subroutine finish

  !> The C (0-based) index of a 1-based Fortran index; a non-positive index maps to a huge
  !> value that the library rejects with an error message.
  pure function c_index(index) result(i)
    integer, intent(in) :: index
    integer(c_size_t) :: i
    if (index >= 1) then
      i = int(index - 1, c_size_t)
    else
      i = -1_c_size_t
    end if
  end function c_index

  !> finish, for a call given the 1-based index `idx` of a `kind` ('parameter', 'unit' or
  !> 'group'). The library sees an index below 1 as one far out of range (c_index) and refuses
  !> it (on every rank together where the call is collective); errmsg then says what a Fortran
  !> caller needs to hear: "<routine>: parameter index 0: Fortran indices start at 1 (have 6)".
  !> On the other ranks of a collective, the peer's message names that index "< 1".
  subroutine finish_index(ptr, code, routine, kind, idx, status, errmsg)
    type(c_ptr), intent(in) :: ptr
    integer(c_int), intent(in) :: code
    character(len=*), intent(in) :: routine, kind
    integer, intent(in) :: idx
    integer, intent(out) :: status
    character(len=*), intent(out), optional :: errmsg
    character(len=*), parameter :: huge_index = '18446744073709551615'  ! c_index(0), printed
    character(len=24) :: given, have
    integer(c_size_t) :: n
    integer(c_int) :: count, query
    integer :: at
    call finish(ptr, code, status, errmsg)
    if (code /= SHARDOPT_ERROR_INVALID_ARGUMENT .or. .not. present(errmsg)) return
    if (idx >= 1) then
      at = index(errmsg, huge_index)
      if (at > 0) errmsg = errmsg(:at - 1)//'< 1 (Fortran indices start at 1)'// &
                           errmsg(at + len(huge_index):)
      return
    end if
    n = 0
    count = 0
    select case (kind)
    case ('parameter')
      query = c_num_params(ptr, n)
    case ('unit')
      query = c_num_units(ptr, n)
    case default
      query = c_num_groups(ptr, count)
      n = int(count, c_size_t)
    end select
    write (given, '(i0)') idx
    have = ''
    if (query == SHARDOPT_SUCCESS) write (have, '(a,i0,a)') ' (have ', n, ')'
    errmsg = routine//': '//kind//' index '//trim(given)//': Fortran indices start at 1'//trim(have)
  end subroutine finish_index

  ! ---- version, errors, bf16 -----------------------------------------------------------------

  !> The library's version code (major * 10000 + minor * 100 + patch).
  integer function shardopt_version()
    shardopt_version = int(c_version())
  end function shardopt_version

  function shardopt_version_string() result(s)
    character(len=:), allocatable :: s
    s = from_c(c_version_string())
  end function shardopt_version_string

  !> A description of a status code.
  function shardopt_status_string(status) result(s)
    integer, intent(in) :: status
    character(len=:), allocatable :: s
    s = from_c(c_status_string(int(status, c_int)))
  end function shardopt_status_string

  !> The last error of `opt`, or of this thread when opt is absent or null.
  function shardopt_last_error(opt) result(s)
    type(shardopt_optimizer), intent(in), optional :: opt
    character(len=:), allocatable :: s
    if (present(opt)) then
      s = from_c(c_last_error(opt%ptr))
    else
      s = from_c(c_last_error(c_null_ptr))
    end if
  end function shardopt_last_error

  !> bfloat16 bits -> real (exact).
  elemental function shardopt_bf16_to_real(bits) result(x)
    integer(c_int16_t), intent(in) :: bits
    real(c_float) :: x
    x = c_bf16_to_float(bits)
  end function shardopt_bf16_to_real

  !> real -> bfloat16 bits, round to nearest even.
  elemental function shardopt_real_to_bf16(x) result(bits)
    real(c_float), intent(in) :: x
    integer(c_int16_t) :: bits
    bits = c_float_to_bf16(x)
  end function shardopt_real_to_bf16

  ! ---- lifecycle -------------------------------------------------------------------------------

  !> Fills cfg with the defaults (ZeRO-1, bf16 replica, AdamW, lr 1e-3, ...).
  subroutine shardopt_config_init(cfg, status, errmsg)
    type(shardopt_config), intent(out) :: cfg
    integer, intent(out) :: status
    character(len=*), intent(out), optional :: errmsg
    call finish(c_null_ptr, c_config_init(cfg), status, errmsg)
  end subroutine shardopt_config_init

  !> Creates an optimizer: over the MPI communicator `comm` (an integer, as `use mpi` gives;
  !> collective) or, without comm, for a single process. config defaults as shardopt_config_init.
  subroutine shardopt_create(opt, status, config, comm, errmsg)
    type(shardopt_optimizer), intent(inout) :: opt
    integer, intent(out) :: status
    type(shardopt_config), intent(in), optional :: config
    integer, intent(in), optional :: comm
    character(len=*), intent(out), optional :: errmsg
    type(shardopt_config) :: cfg
    integer(c_int) :: code
    if (c_associated(opt%ptr)) then
      status = SHARDOPT_ERROR_INVALID_STATE
      if (present(errmsg)) errmsg = 'shardopt_create: the handle is in use; destroy it first'
      return
    end if
    if (present(config)) then
      cfg = config
    else
      code = c_config_init(cfg)
    end if
    if (present(comm)) then
      code = c_create_mpi_f(opt%ptr, int(comm, c_int), cfg)
    else
      code = c_create(opt%ptr, cfg)
    end if
    call finish(c_null_ptr, code, status, errmsg)
  end subroutine shardopt_create

  !> Frees the optimizer and resets the handle to null (a null handle is accepted).
  subroutine shardopt_destroy(opt, status, errmsg)
    type(shardopt_optimizer), intent(inout) :: opt
    integer, intent(out) :: status
    character(len=*), intent(out), optional :: errmsg
    integer(c_int) :: code
    code = c_destroy(opt%ptr)
    if (code == SHARDOPT_SUCCESS) opt%ptr = c_null_ptr
    call finish(c_null_ptr, code, status, errmsg)
  end subroutine shardopt_destroy

  !> True while the handle holds no optimizer.
  logical function shardopt_is_null(opt)
    type(shardopt_optimizer), intent(in) :: opt
    shardopt_is_null = .not. c_associated(opt%ptr)
  end function shardopt_is_null

  !> Adds a parameter group (local, before finalize); group receives its 1-based index.
  !> rule (SHARDOPT_RULE_ADAMW, the default, SHARDOPT_RULE_LION, SHARDOPT_RULE_ADAMW8BIT or
  !> SHARDOPT_RULE_MUON, SHARDOPT_RULE_ADAFACTOR) and the rules' options are optional, by
  !> keyword: Lion's betas (default 0.9 and 0.99), AdamW8bit's adamw8bit_min_numel (default
  !> 4096), Muon's muon_momentum (0.95), muon_nesterov (.true.), muon_ns_steps (5),
  !> muon_ns_a/_b/_c (3.4445, -4.7750, 2.0315), muon_eps (1e-7) and muon_lr_adjust
  !> (SHARDOPT_MUON_LR_ORIGINAL), Adafactor's adafactor_beta2_decay (-0.8), adafactor_eps1
  !> (2^-23), adafactor_eps2 (1e-3), adafactor_d (1) and adafactor_maximize (.false.);
  !> shardopt.h's shardopt_group_t says what each means.
  subroutine shardopt_add_group(opt, lr_scale, weight_decay, group, status, errmsg, rule, &
                                lion_beta1, lion_beta2, adamw8bit_min_numel, muon_momentum, &
                                muon_nesterov, muon_ns_steps, muon_ns_a, muon_ns_b, muon_ns_c, &
                                muon_eps, muon_lr_adjust, adafactor_beta2_decay, adafactor_eps1, &
                                adafactor_eps2, adafactor_d, adafactor_maximize)
    type(shardopt_optimizer), intent(in) :: opt
    real(c_double), intent(in) :: lr_scale
    logical, intent(in) :: weight_decay
    integer, intent(out) :: group
    integer, intent(out) :: status
    character(len=*), intent(out), optional :: errmsg
    integer(c_int), intent(in), optional :: rule
    real(c_double), intent(in), optional :: lion_beta1, lion_beta2
    integer(c_int64_t), intent(in), optional :: adamw8bit_min_numel
    real(c_double), intent(in), optional :: muon_momentum, muon_ns_a, muon_ns_b, muon_ns_c, muon_eps
    logical, intent(in), optional :: muon_nesterov
    integer, intent(in), optional :: muon_ns_steps
    integer(c_int), intent(in), optional :: muon_lr_adjust
    real(c_double), intent(in), optional :: adafactor_beta2_decay, adafactor_eps1, adafactor_eps2
    real(c_double), intent(in), optional :: adafactor_d
    logical, intent(in), optional :: adafactor_maximize
    type(c_group_options) :: options
    integer(c_int) :: g, code
    g = -1
    group = 0
    if (present(rule) .or. present(lion_beta1) .or. present(lion_beta2) .or. &
        present(adamw8bit_min_numel) .or. present(muon_momentum) .or. present(muon_nesterov) .or. &
        present(muon_ns_steps) .or. present(muon_ns_a) .or. present(muon_ns_b) .or. &
        present(muon_ns_c) .or. present(muon_eps) .or. present(muon_lr_adjust) .or. &
        present(adafactor_beta2_decay) .or. present(adafactor_eps1) .or. &
        present(adafactor_eps2) .or. present(adafactor_d) .or. present(adafactor_maximize)) then
      call c_group_init(options)
      call set_group_options(options, 'shardopt_add_group', lr_scale, weight_decay, status, &
                             errmsg, rule, lion_beta1, lion_beta2, adamw8bit_min_numel, &
                             muon_momentum, muon_nesterov, muon_ns_steps, muon_ns_a, muon_ns_b, &
                             muon_ns_c, muon_eps, muon_lr_adjust, adafactor_beta2_decay, &
                             adafactor_eps1, adafactor_eps2, adafactor_d, adafactor_maximize)
      if (status /= SHARDOPT_SUCCESS) return
      code = c_add_group_ex(opt%ptr, options, g)
    else
      code = c_add_group(opt%ptr, lr_scale, merge(1_c_int, 0_c_int, weight_decay), g)
    end if
    group = int(g) + 1
    call finish(opt%ptr, code, status, errmsg)
  end subroutine shardopt_add_group

  !> Writes shardopt_add_group's / shardopt_set_group's arguments into `options` (the present
  !> ones; the others keep what options holds). A value that cannot cross to C unchanged (a
  !> negative adamw8bit_min_numel) is SHARDOPT_ERROR_INVALID_ARGUMENT naming `routine`; the
  !> library checks every other value.
  subroutine set_group_options(options, routine, lr_scale, weight_decay, status, errmsg, rule, &
                               lion_beta1, lion_beta2, adamw8bit_min_numel, muon_momentum, &
                               muon_nesterov, muon_ns_steps, muon_ns_a, muon_ns_b, muon_ns_c, &
                               muon_eps, muon_lr_adjust, adafactor_beta2_decay, adafactor_eps1, &
                               adafactor_eps2, adafactor_d, adafactor_maximize)
    type(c_group_options), intent(inout) :: options
    character(len=*), intent(in) :: routine
    real(c_double), intent(in) :: lr_scale
    logical, intent(in) :: weight_decay
    integer, intent(out) :: status
    character(len=*), intent(out), optional :: errmsg
    integer(c_int), intent(in), optional :: rule
    real(c_double), intent(in), optional :: lion_beta1, lion_beta2
    integer(c_int64_t), intent(in), optional :: adamw8bit_min_numel
    real(c_double), intent(in), optional :: muon_momentum, muon_ns_a, muon_ns_b, muon_ns_c, muon_eps
    logical, intent(in), optional :: muon_nesterov
    integer, intent(in), optional :: muon_ns_steps
    integer(c_int), intent(in), optional :: muon_lr_adjust
    real(c_double), intent(in), optional :: adafactor_beta2_decay, adafactor_eps1, adafactor_eps2
    real(c_double), intent(in), optional :: adafactor_d
    logical, intent(in), optional :: adafactor_maximize
    status = SHARDOPT_SUCCESS
    if (present(adamw8bit_min_numel)) then
      if (adamw8bit_min_numel < 0) then
        status = SHARDOPT_ERROR_INVALID_ARGUMENT
        if (present(errmsg)) errmsg = routine//': adamw8bit_min_numel is negative'
        return
      end if
      options%adamw8bit_min_numel = int(adamw8bit_min_numel, c_size_t)
    end if
    options%lr_scale = lr_scale
    options%weight_decay = merge(1_c_int, 0_c_int, weight_decay)
    if (present(rule)) options%rule = rule
    if (present(lion_beta1)) options%lion_beta1 = lion_beta1
    if (present(lion_beta2)) options%lion_beta2 = lion_beta2
    if (present(muon_momentum)) options%muon_momentum = muon_momentum
    if (present(muon_nesterov)) options%muon_nesterov = merge(1_c_int, 0_c_int, muon_nesterov)
    if (present(muon_ns_steps)) options%muon_ns_steps = int(muon_ns_steps, c_int)
    if (present(muon_ns_a)) options%muon_ns_a = muon_ns_a
    if (present(muon_ns_b)) options%muon_ns_b = muon_ns_b
    if (present(muon_ns_c)) options%muon_ns_c = muon_ns_c
    if (present(muon_eps)) options%muon_eps = muon_eps
    if (present(muon_lr_adjust)) options%muon_lr_adjust = muon_lr_adjust
    if (present(adafactor_beta2_decay)) options%adafactor_beta2_decay = adafactor_beta2_decay
    if (present(adafactor_eps1)) options%adafactor_eps1 = adafactor_eps1
    if (present(adafactor_eps2)) options%adafactor_eps2 = adafactor_eps2
    if (present(adafactor_d)) options%adafactor_d = adafactor_d
    if (present(adafactor_maximize)) &
      options%adafactor_maximize = merge(1_c_int, 0_c_int, adafactor_maximize)
  end subroutine set_group_options

  !> Registers a parameter of numel elements (local, before finalize); index receives its
  !> 1-based index. group (default SHARDOPT_DEFAULT_GROUP) by keyword. rows= and cols=, both or
  !> neither, give a 2-D shape (shardopt_add_param_2d; SHARDOPT_RULE_MUON needs one): row-major,
  !> so an array declared w(cols, rows) passes rows=size(w, 2), cols=size(w, 1) (the module's
  !> introduction). numel must equal rows * cols, otherwise SHARDOPT_ERROR_INVALID_ARGUMENT.
  subroutine add_param_i64(opt, name, numel, index, status, group, errmsg, rows, cols)
    type(shardopt_optimizer), intent(in) :: opt
    character(len=*), intent(in) :: name
    integer(c_int64_t), intent(in) :: numel
    integer, intent(out) :: index
    integer, intent(out) :: status
    integer, intent(in), optional :: group
    character(len=*), intent(out), optional :: errmsg
    integer, intent(in), optional :: rows, cols
    integer(c_size_t) :: idx
    integer(c_int) :: g, code
    character(len=160) :: detail
    g = 0
    if (present(group)) g = int(group - 1, c_int)
    idx = 0
    index = 0
    if (present(rows) .neqv. present(cols)) then
      status = SHARDOPT_ERROR_INVALID_ARGUMENT
      if (present(errmsg)) errmsg = 'shardopt_add_param: parameter '''//trim(name)// &
                                    ''': give both rows= and cols= (a 2-D shape), or neither'
      return
    end if
    if (present(rows)) then
      if (rows < 1 .or. cols < 1 .or. int(rows, c_int64_t) * int(cols, c_int64_t) /= numel) then
        status = SHARDOPT_ERROR_INVALID_ARGUMENT
        if (present(errmsg)) then
          write (detail, '(a,i0,a,i0,a,i0,a)') ''' has ', numel, ' elements, but rows x cols is ', &
            rows, ' x ', cols, ' (an array w(cols, rows) has rows = size(w, 2), cols = size(w, 1))'
          errmsg = 'shardopt_add_param: parameter '''//trim(name)//trim(detail)
        end if
        return
      end if
      code = c_add_param_2d(opt%ptr, trim(name)//c_null_char, int(rows, c_size_t), &
                            int(cols, c_size_t), g, idx)
    else if (numel < 0) then
      code = c_add_param(opt%ptr, trim(name)//c_null_char, 0_c_size_t, g, idx)  ! size error
    else
      code = c_add_param(opt%ptr, trim(name)//c_null_char, int(numel, c_size_t), g, idx)
    end if
    index = int(idx) + 1
    call finish_index(opt%ptr, code, 'shardopt_add_param', 'group', int(g) + 1, status, errmsg)
  end subroutine add_param_i64

  subroutine add_param_i32(opt, name, numel, index, status, group, errmsg, rows, cols)
    type(shardopt_optimizer), intent(in) :: opt
    character(len=*), intent(in) :: name
    integer(c_int), intent(in) :: numel
    integer, intent(out) :: index
    integer, intent(out) :: status
    integer, intent(in), optional :: group
    character(len=*), intent(out), optional :: errmsg
    integer, intent(in), optional :: rows, cols
    call add_param_i64(opt, name, int(numel, c_int64_t), index, status, group, errmsg, rows, cols)
  end subroutine add_param_i32

  !> Collective: lays out and allocates the buffers.
  subroutine shardopt_finalize(opt, status, errmsg)
    type(shardopt_optimizer), intent(in) :: opt
    integer, intent(out) :: status
    character(len=*), intent(out), optional :: errmsg
    call finish(opt%ptr, c_finalize(opt%ptr), status, errmsg)
  end subroutine shardopt_finalize

  ! ---- queries ---------------------------------------------------------------------------------

  subroutine shardopt_comm_rank(opt, rank, status, errmsg)
    type(shardopt_optimizer), intent(in) :: opt
    integer, intent(out) :: rank
    integer, intent(out) :: status
    character(len=*), intent(out), optional :: errmsg
    integer(c_int) :: r
    r = -1
    call finish(opt%ptr, c_comm_rank(opt%ptr, r), status, errmsg)
    rank = int(r)
  end subroutine shardopt_comm_rank

  subroutine shardopt_comm_size(opt, size, status, errmsg)
    type(shardopt_optimizer), intent(in) :: opt
    integer, intent(out) :: size
    integer, intent(out) :: status
    character(len=*), intent(out), optional :: errmsg
    integer(c_int) :: n
    n = 0
    call finish(opt%ptr, c_comm_size(opt%ptr, n), status, errmsg)
    size = int(n)
  end subroutine shardopt_comm_size

  subroutine shardopt_num_params(opt, count, status, errmsg)
    type(shardopt_optimizer), intent(in) :: opt
    integer, intent(out) :: count
    integer, intent(out) :: status
    character(len=*), intent(out), optional :: errmsg
    integer(c_size_t) :: n
    n = 0
    call finish(opt%ptr, c_num_params(opt%ptr, n), status, errmsg)
    count = int(n)
  end subroutine shardopt_num_params

  subroutine shardopt_param_numel(opt, index, numel, status, errmsg)
    type(shardopt_optimizer), intent(in) :: opt
    integer, intent(in) :: index
    integer(c_int64_t), intent(out) :: numel
    integer, intent(out) :: status
    character(len=*), intent(out), optional :: errmsg
    integer(c_size_t) :: n
    n = 0
    call finish_index(opt%ptr, c_param_numel(opt%ptr, c_index(index), n), &
                      'shardopt_param_numel', 'parameter', index, status, errmsg)
    numel = int(n, c_int64_t)
  end subroutine shardopt_param_numel

  !> The shape parameter `index` was registered with: rows x cols (row-major, so the Fortran
  !> array is w(cols, rows)); 1 x numel without rows= and cols=.
  subroutine shardopt_param_shape(opt, index, rows, cols, status, errmsg)
    type(shardopt_optimizer), intent(in) :: opt
    integer, intent(in) :: index
    integer(c_int64_t), intent(out) :: rows, cols
    integer, intent(out) :: status
    character(len=*), intent(out), optional :: errmsg
    integer(c_size_t) :: r, c
    r = 0
    c = 0
    call finish_index(opt%ptr, c_param_shape(opt%ptr, c_index(index), r, c), &
                      'shardopt_param_shape', 'parameter', index, status, errmsg)
    rows = int(r, c_int64_t)
    cols = int(c, c_int64_t)
  end subroutine shardopt_param_shape

  subroutine shardopt_step_count(opt, step, status, errmsg)
    type(shardopt_optimizer), intent(in) :: opt
    integer(c_int64_t), intent(out) :: step
    integer, intent(out) :: status
    character(len=*), intent(out), optional :: errmsg
    step = 0
    call finish(opt%ptr, c_step_count(opt%ptr, step), status, errmsg)
  end subroutine shardopt_step_count

  ! ---- parameters --------------------------------------------------------------------------------

  subroutine set_param_r1(opt, index, values, status, errmsg)
    type(shardopt_optimizer), intent(in) :: opt
    integer, intent(in) :: index
    real(c_float), intent(in) :: values(:)
    integer, intent(out) :: status
    character(len=*), intent(out), optional :: errmsg
    call finish_index(opt%ptr, c_set_param(opt%ptr, c_index(index), values, size(values, kind=c_size_t)), &
                      'shardopt_set_param', 'parameter', index, status, errmsg)
  end subroutine set_param_r1

  subroutine set_param_r2(opt, index, values, status, errmsg)
    type(shardopt_optimizer), intent(in) :: opt
    integer, intent(in) :: index
    real(c_float), intent(in) :: values(:, :)
    integer, intent(out) :: status
    character(len=*), intent(out), optional :: errmsg
    call finish_index(opt%ptr, c_set_param(opt%ptr, c_index(index), values, size(values, kind=c_size_t)), &
                      'shardopt_set_param', 'parameter', index, status, errmsg)
  end subroutine set_param_r2

  subroutine get_master_r1(opt, index, values, status, errmsg)
    type(shardopt_optimizer), intent(in) :: opt
    integer, intent(in) :: index
    real(c_float), intent(inout) :: values(:)
    integer, intent(out) :: status
    character(len=*), intent(out), optional :: errmsg
    call finish_index(opt%ptr, c_get_master(opt%ptr, c_index(index), values, size(values, kind=c_size_t)), &
                      'shardopt_get_master', 'parameter', index, status, errmsg)
  end subroutine get_master_r1

  subroutine get_master_r2(opt, index, values, status, errmsg)
    type(shardopt_optimizer), intent(in) :: opt
    integer, intent(in) :: index
    real(c_float), intent(inout) :: values(:, :)
    integer, intent(out) :: status
    character(len=*), intent(out), optional :: errmsg
    call finish_index(opt%ptr, c_get_master(opt%ptr, c_index(index), values, size(values, kind=c_size_t)), &
                      'shardopt_get_master', 'parameter', index, status, errmsg)
  end subroutine get_master_r2

  !> Checks that a requested rank-2 shape holds exactly numel elements.
  subroutine check_shape(what, shape, numel, status, errmsg)
    character(len=*), intent(in) :: what
    integer, intent(in) :: shape(2)
    integer(c_size_t), intent(in) :: numel
    integer, intent(out) :: status
    character(len=*), intent(out), optional :: errmsg
    character(len=96) :: detail
    status = SHARDOPT_SUCCESS
    if (present(errmsg)) errmsg = ''
    if (all(shape >= 0)) then
      if (int(shape(1), c_int64_t) * int(shape(2), c_int64_t) == int(numel, c_int64_t)) return
    end if
    status = SHARDOPT_ERROR_INVALID_ARGUMENT
    if (present(errmsg)) then
      write (detail, '(a,i0,a,i0,a,i0,a)') ' shape (', shape(1), ', ', shape(2), &
        ') does not hold the parameter''s ', numel, ' elements'
      errmsg = what//':'//trim(detail)
    end if
  end subroutine check_shape

  subroutine param_f32_r1(opt, index, values, status, errmsg)
    type(shardopt_optimizer), intent(in) :: opt
    integer, intent(in) :: index
    real(c_float), pointer, intent(out) :: values(:)
    integer, intent(out) :: status
    character(len=*), intent(out), optional :: errmsg
    type(c_ptr) :: p
    integer(c_size_t) :: n
    nullify (values)
    call finish_index(opt%ptr, c_param_f32(opt%ptr, c_index(index), p, n), &
                      'shardopt_param', 'parameter', index, status, errmsg)
    if (status == SHARDOPT_SUCCESS) call c_f_pointer(p, values, [n])
  end subroutine param_f32_r1

  subroutine param_f32_r2(opt, index, values, shape, status, errmsg)
    type(shardopt_optimizer), intent(in) :: opt
    integer, intent(in) :: index
    real(c_float), pointer, intent(out) :: values(:, :)
    integer, intent(in) :: shape(2)
    integer, intent(out) :: status
    character(len=*), intent(out), optional :: errmsg
    type(c_ptr) :: p
    integer(c_size_t) :: n
    nullify (values)
    call finish_index(opt%ptr, c_param_f32(opt%ptr, c_index(index), p, n), &
                      'shardopt_param', 'parameter', index, status, errmsg)
    if (status /= SHARDOPT_SUCCESS) return
    call check_shape('shardopt_param', shape, n, status, errmsg)
    if (status == SHARDOPT_SUCCESS) call c_f_pointer(p, values, shape)
  end subroutine param_f32_r2

  subroutine param_bf16_r1(opt, index, bits, status, errmsg)
    type(shardopt_optimizer), intent(in) :: opt
    integer, intent(in) :: index
    integer(c_int16_t), pointer, intent(out) :: bits(:)
    integer, intent(out) :: status
    character(len=*), intent(out), optional :: errmsg
    type(c_ptr) :: p
    integer(c_size_t) :: n
    nullify (bits)
    call finish_index(opt%ptr, c_param_bf16(opt%ptr, c_index(index), p, n), &
                      'shardopt_param_bf16', 'parameter', index, status, errmsg)
    if (status == SHARDOPT_SUCCESS) call c_f_pointer(p, bits, [n])
  end subroutine param_bf16_r1

  subroutine param_bf16_r2(opt, index, bits, shape, status, errmsg)
    type(shardopt_optimizer), intent(in) :: opt
    integer, intent(in) :: index
    integer(c_int16_t), pointer, intent(out) :: bits(:, :)
    integer, intent(in) :: shape(2)
    integer, intent(out) :: status
    character(len=*), intent(out), optional :: errmsg
    type(c_ptr) :: p
    integer(c_size_t) :: n
    nullify (bits)
    call finish_index(opt%ptr, c_param_bf16(opt%ptr, c_index(index), p, n), &
                      'shardopt_param_bf16', 'parameter', index, status, errmsg)
    if (status /= SHARDOPT_SUCCESS) return
    call check_shape('shardopt_param_bf16', shape, n, status, errmsg)
    if (status == SHARDOPT_SUCCESS) call c_f_pointer(p, bits, shape)
  end subroutine param_bf16_r2

  ! ---- gradients ---------------------------------------------------------------------------------

  subroutine grad_r1(opt, index, values, status, errmsg)
    type(shardopt_optimizer), intent(in) :: opt
    integer, intent(in) :: index
    real(c_float), pointer, intent(out) :: values(:)
    integer, intent(out) :: status
    character(len=*), intent(out), optional :: errmsg
    type(c_ptr) :: p
    integer(c_size_t) :: n
    nullify (values)
    call finish_index(opt%ptr, c_grad(opt%ptr, c_index(index), p, n), &
                      'shardopt_grad', 'parameter', index, status, errmsg)
    if (status == SHARDOPT_SUCCESS) call c_f_pointer(p, values, [n])
  end subroutine grad_r1

  subroutine grad_r2(opt, index, values, shape, status, errmsg)
    type(shardopt_optimizer), intent(in) :: opt
    integer, intent(in) :: index
    real(c_float), pointer, intent(out) :: values(:, :)
    integer, intent(in) :: shape(2)
    integer, intent(out) :: status
    character(len=*), intent(out), optional :: errmsg
    type(c_ptr) :: p
    integer(c_size_t) :: n
    nullify (values)
    call finish_index(opt%ptr, c_grad(opt%ptr, c_index(index), p, n), &
                      'shardopt_grad', 'parameter', index, status, errmsg)
    if (status /= SHARDOPT_SUCCESS) return
    call check_shape('shardopt_grad', shape, n, status, errmsg)
    if (status == SHARDOPT_SUCCESS) call c_f_pointer(p, values, shape)
  end subroutine grad_r2

  subroutine accumulate_f32_r1(opt, index, src, status, errmsg)
    type(shardopt_optimizer), intent(in) :: opt
    integer, intent(in) :: index
    real(c_float), intent(in) :: src(:)
    integer, intent(out) :: status
    character(len=*), intent(out), optional :: errmsg
    call finish_index(opt%ptr, c_accumulate_f32(opt%ptr, c_index(index), src, size(src, kind=c_size_t)), &
                      'shardopt_accumulate_grad', 'parameter', index, status, errmsg)
  end subroutine accumulate_f32_r1

  subroutine accumulate_f32_r2(opt, index, src, status, errmsg)
    type(shardopt_optimizer), intent(in) :: opt
    integer, intent(in) :: index
    real(c_float), intent(in) :: src(:, :)
    integer, intent(out) :: status
    character(len=*), intent(out), optional :: errmsg
    call finish_index(opt%ptr, c_accumulate_f32(opt%ptr, c_index(index), src, size(src, kind=c_size_t)), &
                      'shardopt_accumulate_grad', 'parameter', index, status, errmsg)
  end subroutine accumulate_f32_r2

  subroutine accumulate_bf16_r1(opt, index, src, status, errmsg)
    type(shardopt_optimizer), intent(in) :: opt
    integer, intent(in) :: index
    integer(c_int16_t), intent(in) :: src(:)
    integer, intent(out) :: status
    character(len=*), intent(out), optional :: errmsg
    call finish_index(opt%ptr, c_accumulate_bf16(opt%ptr, c_index(index), src, size(src, kind=c_size_t)), &
                      'shardopt_accumulate_grad', 'parameter', index, status, errmsg)
  end subroutine accumulate_bf16_r1

  !> Parameter `index`'s gradient of this micro-batch is complete; with overlap, a complete
  !> bucket starts its reduction at once.
  subroutine shardopt_grad_ready(opt, index, status, errmsg)
    type(shardopt_optimizer), intent(in) :: opt
    integer, intent(in) :: index
    integer, intent(out) :: status
    character(len=*), intent(out), optional :: errmsg
    call finish_index(opt%ptr, c_grad_ready(opt%ptr, c_index(index)), &
                      'shardopt_grad_ready', 'parameter', index, status, errmsg)
  end subroutine shardopt_grad_ready

  !> Starts one micro-batch's backward; sync = .false. for all but the last micro-batch of a
  !> step (gradients accumulate locally, no communication).
  subroutine shardopt_begin_backward(opt, sync, status, errmsg)
    type(shardopt_optimizer), intent(in) :: opt
    logical, intent(in) :: sync
    integer, intent(out) :: status
    character(len=*), intent(out), optional :: errmsg
    integer(c_int) :: flag
    flag = 0
    if (sync) flag = 1
    call finish(opt%ptr, c_begin_backward(opt%ptr, flag), status, errmsg)
  end subroutine shardopt_begin_backward

  !> Collective: reduces every bucket not reduced yet and waits (optional; step does it too).
  subroutine shardopt_reduce_gradients(opt, status, errmsg)
    type(shardopt_optimizer), intent(in) :: opt
    integer, intent(out) :: status
    character(len=*), intent(out), optional :: errmsg
    call finish(opt%ptr, c_reduce_gradients(opt%ptr), status, errmsg)
  end subroutine shardopt_reduce_gradients

  subroutine shardopt_zero_grad(opt, status, errmsg)
    type(shardopt_optimizer), intent(in) :: opt
    integer, intent(out) :: status
    character(len=*), intent(out), optional :: errmsg
    call finish(opt%ptr, c_zero_grad(opt%ptr), status, errmsg)
  end subroutine shardopt_zero_grad

  ! ---- the step and hyperparameters --------------------------------------------------------------

  !> Collective: one optimizer step; result (optional) says what it did. With the default
  !> SHARDOPT_GATHER_EAGER every replica pointer reads the new values when it returns; with
  !> SHARDOPT_GATHER_LAZY call shardopt_wait_param / shardopt_wait_all first.
  subroutine shardopt_step(opt, status, result, errmsg)
    type(shardopt_optimizer), intent(in) :: opt
    integer, intent(out) :: status
    type(shardopt_step_result), intent(out), optional :: result
    character(len=*), intent(out), optional :: errmsg
    type(shardopt_step_result) :: r
    integer(c_int) :: code
    code = c_step_result_init(r)
    call finish(opt%ptr, c_step(opt%ptr, r), status, errmsg)
    if (present(result)) result = r
  end subroutine shardopt_step

  subroutine shardopt_set_lr(opt, lr, status, errmsg)
    type(shardopt_optimizer), intent(in) :: opt
    real(c_double), intent(in) :: lr
    integer, intent(out) :: status
    character(len=*), intent(out), optional :: errmsg
    call finish(opt%ptr, c_set_lr(opt%ptr, lr), status, errmsg)
  end subroutine shardopt_set_lr

  subroutine shardopt_get_lr(opt, lr, status, errmsg)
    type(shardopt_optimizer), intent(in) :: opt
    real(c_double), intent(out) :: lr
    integer, intent(out) :: status
    character(len=*), intent(out), optional :: errmsg
    lr = 0
    call finish(opt%ptr, c_get_lr(opt%ptr, lr), status, errmsg)
  end subroutine shardopt_get_lr

  subroutine shardopt_set_hyper(opt, key, value, status, errmsg)
    type(shardopt_optimizer), intent(in) :: opt
    integer(c_int), intent(in) :: key
    real(c_double), intent(in) :: value
    integer, intent(out) :: status
    character(len=*), intent(out), optional :: errmsg
    call finish(opt%ptr, c_set_hyper(opt%ptr, key, value), status, errmsg)
  end subroutine shardopt_set_hyper

  subroutine shardopt_get_hyper(opt, key, value, status, errmsg)
    type(shardopt_optimizer), intent(in) :: opt
    integer(c_int), intent(in) :: key
    real(c_double), intent(out) :: value
    integer, intent(out) :: status
    character(len=*), intent(out), optional :: errmsg
    value = 0
    call finish(opt%ptr, c_get_hyper(opt%ptr, key, value), status, errmsg)
  end subroutine shardopt_get_hyper

  !> Changes group `group` (1-based) options. rule and the rules' options (Lion's betas,
  !> adamw8bit_min_numel, Muon's muon_*, Adafactor's adafactor_*) are optional, by keyword, as
  !> in shardopt_add_group
  !> (left out: the group keeps its own; the rule and the threshold are fixed at finalize).
  !> Group 1 is the default group: this is how
  !> it gets another rule.
  subroutine shardopt_set_group(opt, group, lr_scale, weight_decay, status, errmsg, rule, &
                                lion_beta1, lion_beta2, adamw8bit_min_numel, muon_momentum, &
                                muon_nesterov, muon_ns_steps, muon_ns_a, muon_ns_b, muon_ns_c, &
                                muon_eps, muon_lr_adjust, adafactor_beta2_decay, adafactor_eps1, &
                                adafactor_eps2, adafactor_d, adafactor_maximize)
    type(shardopt_optimizer), intent(in) :: opt
    integer, intent(in) :: group
    real(c_double), intent(in) :: lr_scale
    logical, intent(in) :: weight_decay
    integer, intent(out) :: status
    character(len=*), intent(out), optional :: errmsg
    integer(c_int), intent(in), optional :: rule
    real(c_double), intent(in), optional :: lion_beta1, lion_beta2
    integer(c_int64_t), intent(in), optional :: adamw8bit_min_numel
    real(c_double), intent(in), optional :: muon_momentum, muon_ns_a, muon_ns_b, muon_ns_c, muon_eps
    logical, intent(in), optional :: muon_nesterov
    integer, intent(in), optional :: muon_ns_steps
    integer(c_int), intent(in), optional :: muon_lr_adjust
    real(c_double), intent(in), optional :: adafactor_beta2_decay, adafactor_eps1, adafactor_eps2
    real(c_double), intent(in), optional :: adafactor_d
    logical, intent(in), optional :: adafactor_maximize
    type(c_group_options) :: options
    integer(c_int) :: code
    if (.not. (present(rule) .or. present(lion_beta1) .or. present(lion_beta2) .or. &
               present(adamw8bit_min_numel) .or. present(muon_momentum) .or. &
               present(muon_nesterov) .or. present(muon_ns_steps) .or. present(muon_ns_a) .or. &
               present(muon_ns_b) .or. present(muon_ns_c) .or. present(muon_eps) .or. &
               present(muon_lr_adjust) .or. present(adafactor_beta2_decay) .or. &
               present(adafactor_eps1) .or. present(adafactor_eps2) .or. present(adafactor_d) .or. &
               present(adafactor_maximize))) then
      call finish_index(opt%ptr, c_set_group(opt%ptr, int(group - 1, c_int), lr_scale, &
                                             merge(1_c_int, 0_c_int, weight_decay)), &
                        'shardopt_set_group', 'group', group, status, errmsg)
      return
    end if
    call c_group_init(options)
    code = c_get_group_ex(opt%ptr, int(group - 1, c_int), options)
    if (code == SHARDOPT_SUCCESS) then
      call set_group_options(options, 'shardopt_set_group', lr_scale, weight_decay, status, &
                             errmsg, rule, lion_beta1, lion_beta2, adamw8bit_min_numel, &
                             muon_momentum, muon_nesterov, muon_ns_steps, muon_ns_a, muon_ns_b, &
                             muon_ns_c, muon_eps, muon_lr_adjust, adafactor_beta2_decay, &
                             adafactor_eps1, adafactor_eps2, adafactor_d, adafactor_maximize)
      if (status /= SHARDOPT_SUCCESS) return
      code = c_set_group_ex(opt%ptr, int(group - 1, c_int), options)
    end if
    call finish_index(opt%ptr, code, 'shardopt_set_group', 'group', group, status, errmsg)
  end subroutine shardopt_set_group

  !> Bytes held now (and, optionally, at most) in one SHARDOPT_MEM_* category.
  subroutine shardopt_memory_usage(opt, category, bytes, status, peak, errmsg)
    type(shardopt_optimizer), intent(in) :: opt
    integer(c_int), intent(in) :: category
    integer(c_int64_t), intent(out) :: bytes
    integer, intent(out) :: status
    integer(c_int64_t), intent(out), optional :: peak
    character(len=*), intent(out), optional :: errmsg
    integer(c_size_t) :: b, p
    b = 0
    p = 0
    call finish(opt%ptr, c_memory_usage(opt%ptr, category, b, p), status, errmsg)
    bytes = int(b, c_int64_t)
    if (present(peak)) peak = int(p, c_int64_t)
  end subroutine shardopt_memory_usage

  !> The 1-based index of the parameter called `name`. Local.
  subroutine shardopt_param_index(opt, name, index, status, errmsg)
    type(shardopt_optimizer), intent(in) :: opt
    character(len=*), intent(in) :: name
    integer, intent(out) :: index
    integer, intent(out) :: status
    character(len=*), intent(out), optional :: errmsg
    integer(c_size_t) :: idx
    idx = 0
    call finish(opt%ptr, c_param_index(opt%ptr, trim(name)//c_null_char, idx), status, errmsg)
    index = 0
    if (status == SHARDOPT_SUCCESS) index = int(idx) + 1
  end subroutine shardopt_param_index

  !> The name of a SHARDOPT_MEM_* category ("params", ..., "total"; "?" if unknown).
  function shardopt_mem_category_name(category) result(s)
    integer(c_int), intent(in) :: category
    character(len=:), allocatable :: s
    s = from_c(c_mem_category_name(category))
  end function shardopt_mem_category_name

  ! ---- introspection ---------------------------------------------------------------------------

  !> The communicator in use ("single-process", "mpi", "mpi-shm", ...). Local.
  subroutine shardopt_comm_name(opt, name, status, errmsg)
    type(shardopt_optimizer), intent(in) :: opt
    character(len=:), allocatable, intent(out) :: name
    integer, intent(out) :: status
    character(len=*), intent(out), optional :: errmsg
    type(c_ptr) :: p
    p = c_null_ptr
    call finish(opt%ptr, c_comm_name(opt%ptr, p), status, errmsg)
    name = from_c(p)
  end subroutine shardopt_comm_name

  !> The options in effect (current hyperparameters included). Local.
  subroutine shardopt_get_config(opt, cfg, status, errmsg)
    type(shardopt_optimizer), intent(in) :: opt
    type(shardopt_config), intent(out) :: cfg
    integer, intent(out) :: status
    character(len=*), intent(out), optional :: errmsg
    integer(c_int) :: code
    code = c_config_init(cfg)  ! sets struct_size to this module's (= the C header's) size
    call finish(opt%ptr, c_get_config(opt%ptr, cfg), status, errmsg)
  end subroutine shardopt_get_config

  !> The number of parameter groups (the default group included). Local.
  subroutine shardopt_num_groups(opt, count, status, errmsg)
    type(shardopt_optimizer), intent(in) :: opt
    integer, intent(out) :: count
    integer, intent(out) :: status
    character(len=*), intent(out), optional :: errmsg
    integer(c_int) :: n
    n = 0
    call finish(opt%ptr, c_num_groups(opt%ptr, n), status, errmsg)
    count = int(n)
  end subroutine shardopt_num_groups

  !> Group `group`'s (1-based) options. Local.
  subroutine shardopt_get_group(opt, group, lr_scale, weight_decay, status, errmsg)
    type(shardopt_optimizer), intent(in) :: opt
    integer, intent(in) :: group
    real(c_double), intent(out) :: lr_scale
    logical, intent(out) :: weight_decay
    integer, intent(out) :: status
    character(len=*), intent(out), optional :: errmsg
    integer(c_int) :: wd
    lr_scale = 0
    wd = 0
    call finish_index(opt%ptr, c_get_group(opt%ptr, int(group - 1, c_int), lr_scale, wd), &
                      'shardopt_get_group', 'group', group, status, errmsg)
    weight_decay = wd == 1
  end subroutine shardopt_get_group

  ! ---- optimizer state -------------------------------------------------------------------------

  subroutine get_exp_avg_r1(opt, index, values, status, errmsg)
    type(shardopt_optimizer), intent(in) :: opt
    integer, intent(in) :: index
    real(c_float), intent(inout) :: values(:)
    integer, intent(out) :: status
    character(len=*), intent(out), optional :: errmsg
    call finish_index(opt%ptr, c_get_exp_avg(opt%ptr, c_index(index), values, size(values, kind=c_size_t)), &
                      'shardopt_get_exp_avg', 'parameter', index, status, errmsg)
  end subroutine get_exp_avg_r1

  subroutine get_exp_avg_r2(opt, index, values, status, errmsg)
    type(shardopt_optimizer), intent(in) :: opt
    integer, intent(in) :: index
    real(c_float), intent(inout) :: values(:, :)
    integer, intent(out) :: status
    character(len=*), intent(out), optional :: errmsg
    call finish_index(opt%ptr, c_get_exp_avg(opt%ptr, c_index(index), values, size(values, kind=c_size_t)), &
                      'shardopt_get_exp_avg', 'parameter', index, status, errmsg)
  end subroutine get_exp_avg_r2

  subroutine get_exp_avg_sq_r1(opt, index, values, status, errmsg)
    type(shardopt_optimizer), intent(in) :: opt
    integer, intent(in) :: index
    real(c_float), intent(inout) :: values(:)
    integer, intent(out) :: status
    character(len=*), intent(out), optional :: errmsg
    call finish_index(opt%ptr, &
                      c_get_exp_avg_sq(opt%ptr, c_index(index), values, size(values, kind=c_size_t)), &
                      'shardopt_get_exp_avg_sq', 'parameter', index, status, errmsg)
  end subroutine get_exp_avg_sq_r1

  subroutine get_exp_avg_sq_r2(opt, index, values, status, errmsg)
    type(shardopt_optimizer), intent(in) :: opt
    integer, intent(in) :: index
    real(c_float), intent(inout) :: values(:, :)
    integer, intent(out) :: status
    character(len=*), intent(out), optional :: errmsg
    call finish_index(opt%ptr, &
                      c_get_exp_avg_sq(opt%ptr, c_index(index), values, size(values, kind=c_size_t)), &
                      'shardopt_get_exp_avg_sq', 'parameter', index, status, errmsg)
  end subroutine get_exp_avg_sq_r2

  !> Collective: Adafactor's factored statistics of parameter `index` (1-based; registered with
  !> rows= and cols=, both > 1, in a SHARDOPT_RULE_ADAFACTOR group): row_var(rows) and
  !> col_var(cols), rows and cols as registered (row-major: an array declared w(cols, rows)
  !> has row_var(size(w, 2)) and col_var(size(w, 1))), bit for bit on every rank.
  subroutine shardopt_get_factored_state(opt, index, row_var, col_var, status, errmsg)
    type(shardopt_optimizer), intent(in) :: opt
    integer, intent(in) :: index
    real(c_float), intent(inout) :: row_var(:), col_var(:)
    integer, intent(out) :: status
    character(len=*), intent(out), optional :: errmsg
    call finish_index(opt%ptr, &
                      c_get_factored_state(opt%ptr, c_index(index), row_var, &
                                           size(row_var, kind=c_size_t), col_var, &
                                           size(col_var, kind=c_size_t)), &
                      'shardopt_get_factored_state', 'parameter', index, status, errmsg)
  end subroutine shardopt_get_factored_state

  !> The dynamic loss-scaling state. Local.
  subroutine shardopt_get_loss_scale(opt, scale, good_steps, skipped_steps, status, errmsg)
    type(shardopt_optimizer), intent(in) :: opt
    real(c_double), intent(out) :: scale
    integer(c_int64_t), intent(out) :: good_steps, skipped_steps
    integer, intent(out) :: status
    character(len=*), intent(out), optional :: errmsg
    scale = 0
    good_steps = 0
    skipped_steps = 0
    call finish(opt%ptr, c_get_loss_scale(opt%ptr, scale, good_steps, skipped_steps), status, errmsg)
  end subroutine shardopt_get_loss_scale

  !> Sets the loss-scaling state (the same on every rank). Local.
  subroutine shardopt_set_loss_scale(opt, scale, good_steps, skipped_steps, status, errmsg)
    type(shardopt_optimizer), intent(in) :: opt
    real(c_double), intent(in) :: scale
    integer(c_int64_t), intent(in) :: good_steps, skipped_steps
    integer, intent(out) :: status
    character(len=*), intent(out), optional :: errmsg
    call finish(opt%ptr, c_set_loss_scale(opt%ptr, scale, good_steps, skipped_steps), status, errmsg)
  end subroutine shardopt_set_loss_scale

  ! ---- the flat replica and waiting for it ------------------------------------------------------

  !> Checks that the replica's dtype is `want` (for the typed pointers of shardopt_replica*).
  subroutine require_dtype(opt, want, what, status, errmsg)
    type(shardopt_optimizer), intent(in) :: opt
    integer(c_int), intent(in) :: want
    character(len=*), intent(in) :: what
    integer, intent(out) :: status
    character(len=*), intent(out), optional :: errmsg
    type(shardopt_config) :: cfg
    call shardopt_get_config(opt, cfg, status, errmsg)
    if (status /= SHARDOPT_SUCCESS) return
    if (cfg%param_dtype == want) return
    status = SHARDOPT_ERROR_INVALID_ARGUMENT
    if (present(errmsg)) errmsg = what//': the replica''s dtype is not the one this pointer needs'
  end subroutine require_dtype

  !> A pointer to the whole fp32 flat replica (parameter i at values(offset+1:offset+numel),
  !> offset from shardopt_param_offset). Local; waits for every gather of the last step.
  subroutine shardopt_replica(opt, values, status, errmsg)
    type(shardopt_optimizer), intent(in) :: opt
    real(c_float), pointer, intent(out) :: values(:)
    integer, intent(out) :: status
    character(len=*), intent(out), optional :: errmsg
    type(c_ptr) :: p
    integer(c_size_t) :: n
    nullify (values)
    call require_dtype(opt, SHARDOPT_DTYPE_F32, 'shardopt_replica', status, errmsg)
    if (status /= SHARDOPT_SUCCESS) return
    call finish(opt%ptr, c_replica(opt%ptr, p, n), status, errmsg)
    if (status == SHARDOPT_SUCCESS) call c_f_pointer(p, values, [n])
  end subroutine shardopt_replica

  !> As shardopt_replica, for a bf16 replica (integer(c_int16_t) bit patterns).
  subroutine shardopt_replica_bf16(opt, bits, status, errmsg)
    type(shardopt_optimizer), intent(in) :: opt
    integer(c_int16_t), pointer, intent(out) :: bits(:)
    integer, intent(out) :: status
    character(len=*), intent(out), optional :: errmsg
    type(c_ptr) :: p
    integer(c_size_t) :: n
    nullify (bits)
    call require_dtype(opt, SHARDOPT_DTYPE_BF16, 'shardopt_replica_bf16', status, errmsg)
    if (status /= SHARDOPT_SUCCESS) return
    call finish(opt%ptr, c_replica(opt%ptr, p, n), status, errmsg)
    if (status == SHARDOPT_SUCCESS) call c_f_pointer(p, bits, [n])
  end subroutine shardopt_replica_bf16

  !> The number of replica elements before parameter `index` (0-based offset, as in C). Local.
  subroutine shardopt_param_offset(opt, index, offset, status, errmsg)
    type(shardopt_optimizer), intent(in) :: opt
    integer, intent(in) :: index
    integer(c_int64_t), intent(out) :: offset
    integer, intent(out) :: status
    character(len=*), intent(out), optional :: errmsg
    integer(c_size_t) :: off
    off = 0
    call finish_index(opt%ptr, c_param_offset(opt%ptr, c_index(index), off), &
                      'shardopt_param_offset', 'parameter', index, status, errmsg)
    offset = int(off, c_int64_t)
  end subroutine shardopt_param_offset

  !> Waits until parameter `index` holds the last step's values (SHARDOPT_GATHER_LAZY). Local.
  subroutine shardopt_wait_param(opt, index, status, errmsg)
    type(shardopt_optimizer), intent(in) :: opt
    integer, intent(in) :: index
    integer, intent(out) :: status
    character(len=*), intent(out), optional :: errmsg
    call finish_index(opt%ptr, c_wait_param(opt%ptr, c_index(index)), &
                      'shardopt_wait_param', 'parameter', index, status, errmsg)
  end subroutine shardopt_wait_param

  !> Waits until every parameter holds the last step's values (SHARDOPT_GATHER_LAZY). Local.
  subroutine shardopt_wait_all(opt, status, errmsg)
    type(shardopt_optimizer), intent(in) :: opt
    integer, intent(out) :: status
    character(len=*), intent(out), optional :: errmsg
    call finish(opt%ptr, c_wait_all(opt%ptr), status, errmsg)
  end subroutine shardopt_wait_all

  !> Drives collectives in flight (e.g. once per layer of a long backward). Local.
  subroutine shardopt_progress(opt, status, errmsg)
    type(shardopt_optimizer), intent(in) :: opt
    integer, intent(out) :: status
    character(len=*), intent(out), optional :: errmsg
    call finish(opt%ptr, c_progress(opt%ptr), status, errmsg)
  end subroutine shardopt_progress

  ! ---- checkpoints -------------------------------------------------------------------------------

  !> Collective: saves a checkpoint under directory `dir`, keeping the newest `keep` (default
  !> 2); `published` (optional) receives the new checkpoint's directory.
  subroutine shardopt_save_checkpoint(opt, dir, status, keep, published, errmsg)
    type(shardopt_optimizer), intent(in) :: opt
    character(len=*), intent(in) :: dir
    integer, intent(out) :: status
    integer, intent(in), optional :: keep
    character(len=*), intent(out), optional :: published
    character(len=*), intent(out), optional :: errmsg
    type(c_ptr) :: p
    integer(c_int) :: k
    k = 2
    if (present(keep)) k = int(keep, c_int)
    p = c_null_ptr
    call finish(opt%ptr, c_save_checkpoint(opt%ptr, trim(dir)//c_null_char, k, p), status, errmsg)
    if (present(published)) published = from_c(p)
  end subroutine shardopt_save_checkpoint

  !> Collective: loads the checkpoint `path` names (a save directory or one checkpoint), at
  !> any rank count and stage. IO, CORRUPT_DATA, LAYOUT_MISMATCH or UNSUPPORTED on every rank
  !> leave the optimizer unchanged.
  subroutine shardopt_load_checkpoint(opt, path, status, errmsg)
    type(shardopt_optimizer), intent(in) :: opt
    character(len=*), intent(in) :: path
    integer, intent(out) :: status
    character(len=*), intent(out), optional :: errmsg
    call finish(opt%ptr, c_load_checkpoint(opt%ptr, trim(path)//c_null_char), status, errmsg)
  end subroutine shardopt_load_checkpoint

  ! ---- stage 3: parameters sharded, gathered per unit ----------------------------------------
  ! With config%stage = SHARDOPT_STAGE_ZERO3 each rank keeps only its slice of the replica; a
  ! unit (typically one layer) is gathered before its parameters are read (shardopt_param*
  ! point into the gathered unit until it is released). acquire and prefetch are collective
  ! (they start the unit's all-gathers): every rank makes the same unit calls in the same
  ! order (shardopt.h, "stage 3").

  !> Starts a new unit: parameters added from now on belong to it; `unit` (optional) receives
  !> its 1-based index. A unit without parameters yet is reused, so the first call gives 1.
  !> Before shardopt_finalize. Local.
  subroutine shardopt_begin_unit(opt, status, unit, errmsg)
    type(shardopt_optimizer), intent(in) :: opt
    integer, intent(out) :: status
    integer, intent(out), optional :: unit
    character(len=*), intent(out), optional :: errmsg
    integer(c_int) :: u
    u = -1
    call finish(opt%ptr, c_begin_unit(opt%ptr, u), status, errmsg)
    if (present(unit)) unit = int(u) + 1
  end subroutine shardopt_begin_unit

  !> The number of units (after shardopt_finalize; 1 when the trainer declared none). Local.
  subroutine shardopt_num_units(opt, count, status, errmsg)
    type(shardopt_optimizer), intent(in) :: opt
    integer, intent(out) :: count
    integer, intent(out) :: status
    character(len=*), intent(out), optional :: errmsg
    integer(c_size_t) :: n
    n = 0
    call finish(opt%ptr, c_num_units(opt%ptr, n), status, errmsg)
    count = int(n)
  end subroutine shardopt_num_units

  !> Collective: gathers unit `unit` (unless prefetched) and waits; the parameter pointers of
  !> its parameters are then valid until shardopt_release(unit). INVALID_STATE if the unit is
  !> acquired already, if every unit buffer (config%units_in_flight) is held, or at stages 0-2.
  subroutine shardopt_acquire(opt, unit, status, errmsg)
    type(shardopt_optimizer), intent(in) :: opt
    integer, intent(in) :: unit
    integer, intent(out) :: status
    character(len=*), intent(out), optional :: errmsg
    call finish_index(opt%ptr, c_acquire(opt%ptr, c_index(unit)), &
                      'shardopt_acquire', 'unit', unit, status, errmsg)
  end subroutine shardopt_acquire

  !> Collective: starts gathering unit `unit` without waiting (nothing if it is held already).
  !> INVALID_STATE if every unit buffer is held, or at stages 0-2.
  subroutine shardopt_prefetch(opt, unit, status, errmsg)
    type(shardopt_optimizer), intent(in) :: opt
    integer, intent(in) :: unit
    integer, intent(out) :: status
    character(len=*), intent(out), optional :: errmsg
    call finish_index(opt%ptr, c_prefetch(opt%ptr, c_index(unit)), &
                      'shardopt_prefetch', 'unit', unit, status, errmsg)
  end subroutine shardopt_prefetch

  !> Returns the unit's buffer to the pool; pointers into it become invalid. INVALID_STATE if
  !> the unit is not acquired; shardopt_step fails with INVALID_STATE while a unit is held.
  subroutine shardopt_release(opt, unit, status, errmsg)
    type(shardopt_optimizer), intent(in) :: opt
    integer, intent(in) :: unit
    integer, intent(out) :: status
    character(len=*), intent(out), optional :: errmsg
    call finish_index(opt%ptr, c_release(opt%ptr, c_index(unit)), &
                      'shardopt_release', 'unit', unit, status, errmsg)
  end subroutine shardopt_release

end module shardopt
