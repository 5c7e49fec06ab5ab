/* shardopt.h: the C ABI of shardopt, a ZeRO-style sharded AdamW optimizer.
 *
 * Pure C (C99 and C++): opaque handles, plain structs, and a status code from every
 * function. It is a thin layer over the C++ API (shardopt/optimizer.hpp); no C++ exception,
 * abort or exit ever crosses it. The Fortran module `shardopt` (shardopt.f90) wraps it.
 *
 * ---- Call order -------------------------------------------------------------------------
 *   shardopt_config_init(&cfg); cfg.stage = ...;          (local)
 *   shardopt_create_mpi(&opt, comm, &cfg)                 (collective) or shardopt_create
 *   shardopt_add_group / shardopt_add_param               (local, same on every rank)
 *   shardopt_finalize(opt)                                (collective)
 *   shardopt_set_param(opt, i, values, n)                 (local, same values everywhere)
 *   loop:
 *     read shardopt_param_f32 / shardopt_param_bf16 views       (forward)
 *     write shardopt_grad views or shardopt_accumulate_grad_*   (backward)
 *     stage 2: shardopt_grad_ready(opt, i) in backward order
 *     shardopt_set_lr(opt, lr)                                  (local, same everywhere)
 *     shardopt_step(opt, &result)                               (collective)
 *   shardopt_get_master(opt, i, out, n)                   (collective)
 *   shardopt_destroy(opt)
 *
 * "Collective" calls must be made by every rank of the communicator, in the same order;
 * if one rank fails inside a collective call, every rank returns an error (the others
 * SHARDOPT_ERROR_REMOTE or the same code), so no rank is left waiting.
 *
 * ---- Errors -------------------------------------------------------------------------------
 * Every function returns shardopt_status_t (SHARDOPT_SUCCESS == 0). On failure, outputs are
 * left unchanged and shardopt_last_error(opt) returns a message naming the failing call and
 * the reason; shardopt_status_string(code) names the code.
 *
 * ---- Threads --------------------------------------------------------------------------------
 * One handle must not be used by two threads at once. Different handles are independent.
 * The last-error message without a handle is kept per thread.
 *
 * ---- MPI ------------------------------------------------------------------------------------
 * When the library was built with MPI (SHARDOPT_HAVE_MPI in shardopt_config.h), this header
 * includes <mpi.h> and declares shardopt_create_mpi(MPI_Comm), unless SHARDOPT_NO_MPI is
 * defined first; it is also declared when <mpi.h> was included before. shardopt_create_mpi_f
 * takes a Fortran integer communicator (MPI_Comm_f2c) and is always declared. Without MPI
 * support built in, it returns SHARDOPT_ERROR_UNSUPPORTED.
 */
#ifndef SHARDOPT_H
#define SHARDOPT_H

#include <stddef.h>
#include <stdint.h>

#include "shardopt/shardopt_version.h"
#include "shardopt/shardopt_config.h"

#if defined(SHARDOPT_WITH_MPI) && !defined(MPI_VERSION)
#include <mpi.h>
#endif

/* ---- visibility ------------------------------------------------------------------------- */
#if defined(_WIN32)
#define SHARDOPT_API
#elif defined(__GNUC__) || defined(__clang__)
#define SHARDOPT_API __attribute__((visibility("default")))
#else
#define SHARDOPT_API
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* ---- status codes (one to one with the C++ shardopt::Status) ---------------------------- */
typedef enum shardopt_status {
  SHARDOPT_SUCCESS = 0,
  SHARDOPT_ERROR_INVALID_ARGUMENT = 1, /* bad size, name, index, pointer or hyperparameter */
  SHARDOPT_ERROR_INVALID_STATE = 2,    /* wrong call order (e.g. step before finalize) */
  SHARDOPT_ERROR_LAYOUT_MISMATCH = 3,  /* ranks registered different parameters/options */
  SHARDOPT_ERROR_REMOTE = 4,           /* another rank failed in a collective call */
  SHARDOPT_ERROR_COMMUNICATION = 5,    /* MPI / NCCL reported an error */
  SHARDOPT_ERROR_OUT_OF_MEMORY = 6,
  SHARDOPT_ERROR_IO = 7,               /* a file could not be read or written */
  SHARDOPT_ERROR_CORRUPT_DATA = 8,     /* a checkpoint failed validation */
  SHARDOPT_ERROR_UNSUPPORTED = 9,      /* feature not built in (MPI, CUDA) */
  SHARDOPT_ERROR_CUDA = 10,
  SHARDOPT_ERROR_INTERNAL = 11,        /* a bug in shardopt: please report it */
  SHARDOPT_STATUS_MIN_ENUM = -0x7FFFFFFF - 1,
  SHARDOPT_STATUS_MAX_ENUM = 0x7FFFFFFF
} shardopt_status_t;

/* ---- enums of the options ------------------------------------------------------------- */
/* Each enum ends with *_MIN_ENUM / *_MAX_ENUM (INT_MIN / INT_MAX) so that it is an int and
 * any int a caller (C, Fortran) passes is a value of the type: unknown values are rejected
 * with SHARDOPT_ERROR_INVALID_ARGUMENT, never undefined behaviour. */
typedef enum shardopt_stage {
  SHARDOPT_STAGE_DATA_PARALLEL = 0, /* all-reduce; every rank holds and updates everything */
  SHARDOPT_STAGE_ZERO1 = 1,         /* optimizer state sharded */
  SHARDOPT_STAGE_ZERO2 = 2,         /* state and gradients sharded, reduced in buckets */
  SHARDOPT_STAGE_MIN_ENUM = -0x7FFFFFFF - 1,
  SHARDOPT_STAGE_MAX_ENUM = 0x7FFFFFFF
} shardopt_stage_t;

typedef enum shardopt_dtype {
  SHARDOPT_DTYPE_F32 = 0,
  SHARDOPT_DTYPE_BF16 = 1, /* bfloat16, seen from C as uint16_t bit patterns */
  SHARDOPT_DTYPE_MIN_ENUM = -0x7FFFFFFF - 1,
  SHARDOPT_DTYPE_MAX_ENUM = 0x7FFFFFFF
} shardopt_dtype_t;

typedef enum shardopt_device {
  SHARDOPT_DEVICE_CPU = 0,
  SHARDOPT_DEVICE_CUDA = 1,
  SHARDOPT_DEVICE_MIN_ENUM = -0x7FFFFFFF - 1,
  SHARDOPT_DEVICE_MAX_ENUM = 0x7FFFFFFF
} shardopt_device_t;

typedef enum shardopt_adam_mode {
  SHARDOPT_ADAMW = 0,  /* decoupled weight decay (torch.optim.AdamW) */
  SHARDOPT_ADAM_L2 = 1, /* weight decay added to the gradient (torch.optim.Adam) */
  SHARDOPT_ADAM_MODE_MIN_ENUM = -0x7FFFFFFF - 1,
  SHARDOPT_ADAM_MODE_MAX_ENUM = 0x7FFFFFFF
} shardopt_adam_mode_t;

/* Hyperparameters that may change between steps (shardopt_set_hyper / shardopt_get_hyper).
 * Values are doubles; SHARDOPT_HYPER_ADAM_MODE takes 0.0 or 1.0 (shardopt_adam_mode_t). */
typedef enum shardopt_hyper {
  SHARDOPT_HYPER_LR = 0,            /* >= 0 */
  SHARDOPT_HYPER_BETA1 = 1,         /* [0, 1) */
  SHARDOPT_HYPER_BETA2 = 2,         /* [0, 1) */
  SHARDOPT_HYPER_EPS = 3,           /* > 0 */
  SHARDOPT_HYPER_WEIGHT_DECAY = 4,  /* >= 0 */
  SHARDOPT_HYPER_MAX_GRAD_NORM = 5, /* >= 0; 0 disables clipping */
  SHARDOPT_HYPER_ADAM_MODE = 6,
  SHARDOPT_HYPER_MIN_ENUM = -0x7FFFFFFF - 1,
  SHARDOPT_HYPER_MAX_ENUM = 0x7FFFFFFF
} shardopt_hyper_t;

/* Categories of the memory report (shardopt_memory_usage). */
typedef enum shardopt_mem_category {
  SHARDOPT_MEM_PARAMS = 0,  /* the full parameter replica */
  SHARDOPT_MEM_GRADS = 1,   /* fp32 gradients (full at stages 0/1, a shard at stage 2) */
  SHARDOPT_MEM_MASTER = 2,  /* fp32 master shard (none when the replica is fp32) */
  SHARDOPT_MEM_MOMENTS = 3, /* Adam m and v shards */
  SHARDOPT_MEM_SCRATCH = 4, /* stage 2 bucket staging */
  SHARDOPT_MEM_TOTAL = 5,   /* the sum of the above */
  SHARDOPT_MEM_MIN_ENUM = -0x7FFFFFFF - 1,
  SHARDOPT_MEM_MAX_ENUM = 0x7FFFFFFF
} shardopt_mem_category_t;

/* ---- handle and plain structs ------------------------------------------------------------ */

/* An optimizer. Created by shardopt_create*, freed by shardopt_destroy. */
typedef struct shardopt_optimizer_s* shardopt_optimizer_t;

/* Creation options. Always start from shardopt_config_init(), which fills the defaults and
 * struct_size; the library rejects a config whose struct_size it does not know, so fields
 * can be added later without breaking programs built against this header. */
typedef struct shardopt_config {
  size_t struct_size;   /* sizeof(shardopt_config_t), set by shardopt_config_init */
  int stage;            /* shardopt_stage_t; default SHARDOPT_STAGE_ZERO1 */
  int param_dtype;      /* shardopt_dtype_t of the replica; default SHARDOPT_DTYPE_BF16 */
  int device;           /* shardopt_device_t; default SHARDOPT_DEVICE_CPU */
  int adam_mode;        /* shardopt_adam_mode_t; default SHARDOPT_ADAMW */
  double lr;            /* default 1e-3 */
  double beta1;         /* default 0.9 */
  double beta2;         /* default 0.999 */
  double eps;           /* default 1e-8 */
  double weight_decay;  /* default 0.01 */
  double max_grad_norm; /* default 0 (no clipping) */
  size_t bucket_elems;  /* stage 2 bucket size in elements; default 1048576 */
} shardopt_config_t;

/* What one step did. */
typedef struct shardopt_step_result {
  double grad_norm; /* global L2 norm of the averaged gradient, before clipping */
  double clip_coef; /* factor applied to the gradient (1 when not clipped) */
  int clipped;      /* 1 when clipped */
  int skipped;      /* 1 when a gradient was NaN/Inf on some rank: no update anywhere */
  int64_t step;     /* number of updates applied so far (skipped steps excluded) */
} shardopt_step_result_t;

/* ---- version and errors (local, never fail, callable at any time) ----------------------- */

/* The library's SHARDOPT_VERSION_CODE; compare with the header's to detect a mismatch. */
SHARDOPT_API int shardopt_version(void);
/* The library's version as "major.minor.patch" (a static string). */
SHARDOPT_API const char* shardopt_version_string(void);

/* A static description of a status code ("invalid argument", ...); never NULL. */
SHARDOPT_API const char* shardopt_status_string(shardopt_status_t status);

/* The message of the most recent failed call: of this handle when `opt` is a live handle,
 * otherwise (NULL, destroyed or invalid handle) of the calling thread, which also records
 * every failure on any handle. "" when there was none. The string belongs to the library
 * and stays valid until the next shardopt call on the same handle (or thread); copy it to
 * keep it. */
SHARDOPT_API const char* shardopt_last_error(shardopt_optimizer_t opt);

/* bfloat16 helpers: exact widening, and rounding to nearest even (NaN stays NaN). */
SHARDOPT_API float shardopt_bf16_to_float(uint16_t bits);
SHARDOPT_API uint16_t shardopt_float_to_bf16(float value);

/* ---- lifecycle -------------------------------------------------------------------------- */

/* Fills *config with the defaults above (local; config may not be NULL). */
SHARDOPT_API shardopt_status_t shardopt_config_init(shardopt_config_t* config);

/* Creates a single-process optimizer (no MPI needed). config may be NULL for the defaults;
 * it is only read during the call. On success *opt is a new handle owned by the caller
 * (free it with shardopt_destroy); on failure *opt is set to NULL. */
SHARDOPT_API shardopt_status_t shardopt_create(shardopt_optimizer_t* opt,
                                               const shardopt_config_t* config);

#if defined(MPI_VERSION) || defined(SHARDOPT_WITH_MPI)
/* Collective over `comm`: creates an optimizer whose data-parallel group is `comm`. The
 * library duplicates the communicator, so its traffic never matches the caller's; the
 * caller keeps ownership of `comm`. MPI must stay initialised until shardopt_destroy.
 * Options are checked on every rank; if any rank's are invalid, every rank fails. Only in
 * a library built with MPI (declared when <mpi.h> is included first). */
SHARDOPT_API shardopt_status_t shardopt_create_mpi(shardopt_optimizer_t* opt, MPI_Comm comm,
                                                   const shardopt_config_t* config);
#endif

/* As shardopt_create_mpi, for a Fortran integer communicator (converted with MPI_Comm_f2c;
 * Fortran's MPI_COMM_WORLD from `use mpi` or `mpi_comm_world%mpi_val` from `use mpi_f08`).
 * Returns SHARDOPT_ERROR_UNSUPPORTED when the library was built without MPI. */
SHARDOPT_API shardopt_status_t shardopt_create_mpi_f(shardopt_optimizer_t* opt, int fortran_comm,
                                                     const shardopt_config_t* config);

/* Adds a parameter group with its learning-rate multiplier (>= 0) and whether weight
 * decay applies (0 or 1); *group receives its index. Group 0 exists already (lr_scale 1,
 * decay on). Local; before finalize. group may be NULL. */
SHARDOPT_API shardopt_status_t shardopt_add_group(shardopt_optimizer_t opt, double lr_scale,
                                                  int weight_decay, int* group);

/* Registers a parameter of `numel` (> 0) elements in `group`; *index receives its index
 * (0, 1, 2, ... in registration order). `name` is a NUL-terminated, non-empty string that
 * is unique within the optimizer; it is copied. Local; before finalize; every rank
 * registers the same parameters in the same order. index may be NULL. */
SHARDOPT_API shardopt_status_t shardopt_add_param(shardopt_optimizer_t opt, const char* name,
                                                  size_t numel, int group, size_t* index);

/* Collective. Builds the padded layout, checks that every rank registered the same
 * parameters, groups and options (SHARDOPT_ERROR_LAYOUT_MISMATCH otherwise) and allocates
 * the buffers. Parameters, master weights and moments start at zero. Once only. */
SHARDOPT_API shardopt_status_t shardopt_finalize(shardopt_optimizer_t opt);

/* Frees the optimizer and everything it allocated; every pointer obtained from it becomes
 * invalid. NULL is accepted (and ignored). Using the handle afterwards returns
 * SHARDOPT_ERROR_INVALID_ARGUMENT (as long as its memory was not reused by a new handle).
 * With MPI this frees the duplicated communicator (MPI_Comm_free): call it on every rank,
 * before MPI_Finalize. */
SHARDOPT_API shardopt_status_t shardopt_destroy(shardopt_optimizer_t opt);

/* ---- queries (local) ----------------------------------------------------------------------- */

/* This process's rank and the group's size. Any time after create. */
SHARDOPT_API shardopt_status_t shardopt_comm_rank(shardopt_optimizer_t opt, int* rank);
SHARDOPT_API shardopt_status_t shardopt_comm_size(shardopt_optimizer_t opt, int* size);
/* The number of registered parameters. */
SHARDOPT_API shardopt_status_t shardopt_num_params(shardopt_optimizer_t opt, size_t* count);
/* The element count of parameter `index`. */
SHARDOPT_API shardopt_status_t shardopt_param_numel(shardopt_optimizer_t opt, size_t index,
                                                    size_t* numel);
/* The index of the parameter called `name`; SHARDOPT_ERROR_INVALID_ARGUMENT if none. */
SHARDOPT_API shardopt_status_t shardopt_param_index(shardopt_optimizer_t opt, const char* name,
                                                    size_t* index);
/* The number of updates applied so far. */
SHARDOPT_API shardopt_status_t shardopt_step_count(shardopt_optimizer_t opt, int64_t* step);

/* ---- parameters and gradients (after finalize) --------------------------------------------- */

/* Sets parameter `index` from `numel` fp32 values (numel must be the parameter's size):
 * the replica (rounded to its dtype) and this rank's part of the fp32 master. Every rank
 * must pass the same values. Local; `values` is only read during the call. */
SHARDOPT_API shardopt_status_t shardopt_set_param(shardopt_optimizer_t opt, size_t index,
                                                  const float* values, size_t numel);

/* Collective: copies parameter `index`'s fp32 master weights into out[0, numel) on every
 * rank (numel must be the parameter's size). */
SHARDOPT_API shardopt_status_t shardopt_get_master(shardopt_optimizer_t opt, size_t index,
                                                   float* out, size_t numel);

/* The full-replica values of parameter `index`, as the forward pass reads them: *data
 * points at *numel elements inside the optimizer (64-element aligned). The _f32 form needs
 * param_dtype F32, the _bf16 form BF16 (uint16_t bit patterns; see shardopt_bf16_to_float).
 * The pointer stays valid until shardopt_destroy; the values change at each step. Read
 * only: use shardopt_set_param to change a parameter. Local. numel may be NULL. */
SHARDOPT_API shardopt_status_t shardopt_param_f32(shardopt_optimizer_t opt, size_t index,
                                                  const float** data, size_t* numel);
SHARDOPT_API shardopt_status_t shardopt_param_bf16(shardopt_optimizer_t opt, size_t index,
                                                   const uint16_t** data, size_t* numel);

/* The fp32 gradient of parameter `index` (*numel elements) that backward writes or adds
 * into; it is zero after finalize and after each step. Stages 0/1: a view of the full
 * gradient buffer, valid until shardopt_destroy. Stage 2: a view into the bucket being
 * filled, valid until the next call that reduces a bucket (shardopt_grad or
 * shardopt_accumulate_grad_* of a parameter in a later bucket, shardopt_grad_ready
 * completing the bucket, shardopt_reduce_gradients, shardopt_step, shardopt_zero_grad);
 * parameters must then be visited in backward (reverse registration) order. Local. */
SHARDOPT_API shardopt_status_t shardopt_grad(shardopt_optimizer_t opt, size_t index,
                                             float** data, size_t* numel);

/* grad(index) += src[0, numel), from fp32 or from bf16 bit patterns, in one pass. numel
 * must be the parameter's size; `src` is only read during the call. Local. */
SHARDOPT_API shardopt_status_t shardopt_accumulate_grad_f32(shardopt_optimizer_t opt,
                                                            size_t index, const float* src,
                                                            size_t numel);
SHARDOPT_API shardopt_status_t shardopt_accumulate_grad_bf16(shardopt_optimizer_t opt,
                                                             size_t index, const uint16_t* src,
                                                             size_t numel);

/* Stage 2: parameter `index`'s gradient is complete; a full bucket is reduced at once, so
 * every rank must mark parameters in the same order. A no-op at stages 0/1. */
SHARDOPT_API shardopt_status_t shardopt_grad_ready(shardopt_optimizer_t opt, size_t index);

/* Local. Starts the backward pass of one micro-batch. sync = 0 for every micro-batch but the
 * last of a step: gradients then accumulate locally with no communication; sync != 0 for
 * the last (buckets are reduced as they complete). shardopt_step averages over the
 * micro-batches begun since the previous step (one when this is never called). Fails with
 * SHARDOPT_ERROR_INVALID_STATE once this step's gradients were reduced. */
SHARDOPT_API shardopt_status_t shardopt_begin_backward(shardopt_optimizer_t opt, int sync);

/* Collective. Reduces every bucket not reduced yet and waits: the gradients of this step are
 * then final. Optional: shardopt_step does it too. */
SHARDOPT_API shardopt_status_t shardopt_reduce_gradients(shardopt_optimizer_t opt);

/* Zeroes every gradient. Local. */
SHARDOPT_API shardopt_status_t shardopt_zero_grad(shardopt_optimizer_t opt);

/* ---- the step ------------------------------------------------------------------------------ */

/* Collective: reduces the gradients (averaged over ranks), computes the global norm,
 * clips, skips the update everywhere if any gradient is NaN/Inf, updates this rank's shard
 * with AdamW, all-gathers the replica and zeroes the gradients. result may be NULL. */
SHARDOPT_API shardopt_status_t shardopt_step(shardopt_optimizer_t opt,
                                             shardopt_step_result_t* result);

/* Sets / reads the learning rate used from the next step on (lr >= 0, finite). Local:
 * set the same value on every rank. */
SHARDOPT_API shardopt_status_t shardopt_set_lr(shardopt_optimizer_t opt, double lr);
SHARDOPT_API shardopt_status_t shardopt_get_lr(shardopt_optimizer_t opt, double* lr);

/* Sets / reads one hyperparameter (see shardopt_hyper_t for the valid ranges). Local: set
 * the same values on every rank. An invalid value leaves the optimizer unchanged. */
SHARDOPT_API shardopt_status_t shardopt_set_hyper(shardopt_optimizer_t opt, shardopt_hyper_t key,
                                                  double value);
SHARDOPT_API shardopt_status_t shardopt_get_hyper(shardopt_optimizer_t opt, shardopt_hyper_t key,
                                                  double* value);

/* Changes the options of an existing group (lr_scale >= 0, weight_decay 0 or 1), before or
 * after finalize. Local: same on every rank. */
SHARDOPT_API shardopt_status_t shardopt_set_group(shardopt_optimizer_t opt, int group,
                                                  double lr_scale, int weight_decay);

/* ---- memory report (local) ---------------------------------------------------------------- */

/* Bytes this rank holds now (*bytes) and at most so far (*peak) in one category (for
 * SHARDOPT_MEM_TOTAL: the sums over categories). Either output may be NULL. */
SHARDOPT_API shardopt_status_t shardopt_memory_usage(shardopt_optimizer_t opt,
                                                     shardopt_mem_category_t category,
                                                     size_t* bytes, size_t* peak);
/* A static name of a category ("params", ..., "total"); "?" for an unknown value. */
SHARDOPT_API const char* shardopt_mem_category_name(shardopt_mem_category_t category);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* SHARDOPT_H */
