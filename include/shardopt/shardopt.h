/* shardopt.h: the C ABI of shardopt, a ZeRO-style sharded AdamW optimizer.
 *
 * Pure C (C99 and C++): opaque handles, plain structs, and a status code from every
 * function. It is a thin layer over the C++ API (shardopt/optimizer.hpp, checkpoint.hpp); no
 * C++ exception, abort or exit ever crosses it. The Fortran module `shardopt` (shardopt.f90)
 * wraps it. docs/c_api.md maps every C++ entry point to its C and Fortran counterpart.
 *
 * ---- Call order -------------------------------------------------------------------------
 *   shardopt_config_init(&cfg); cfg.stage = ...;          (local)
 *   shardopt_create_mpi(&opt, comm, &cfg)                 (collective) or shardopt_create
 *   shardopt_add_group / shardopt_add_param               (local, same on every rank)
 *   shardopt_finalize(opt)                                (collective)
 *   shardopt_set_param(opt, i, values, n)                 (local, same values everywhere)
 *     or shardopt_load_checkpoint(opt, path)              (collective)
 *   loop:
 *     read shardopt_param_f32 / _bf16 views or shardopt_replica   (forward)
 *     write shardopt_grad views or shardopt_accumulate_grad_*     (backward)
 *     shardopt_grad_ready(opt, i) in backward order               (optional: starts buckets early)
 *     shardopt_set_lr(opt, lr)                                    (local, same everywhere)
 *     shardopt_step(opt, &result)                                 (collective)
 *     every few steps: shardopt_save_checkpoint(opt, dir, ...)    (collective)
 *   shardopt_get_master(opt, i, out, n)                   (collective)
 *   shardopt_destroy(opt)                                 (every rank)
 *
 * "Collective" calls must be made by every rank of the communicator, in the same order;
 * if one rank fails inside a collective call, every rank returns an error (the others
 * SHARDOPT_ERROR_REMOTE or the same code), so no rank is left waiting. A NULL or destroyed
 * handle is the exception: such a rank cannot reach its peers and returns at once. "Local"
 * calls communicate with no other rank (some complete communication other ranks started in
 * the same collective; they say so).
 *
 * ---- Replica pointers and the step ------------------------------------------------------
 * Pointers into the parameter replica (shardopt_param_f32/_bf16, shardopt_replica) stay valid
 * until shardopt_destroy. With the default SHARDOPT_GATHER_EAGER, shardopt_step returns only
 * when the replica holds the new values everywhere, so a pointer fetched once and kept reads
 * current weights after every step, whatever the communicator. With SHARDOPT_GATHER_LAZY the
 * all-gathers of the updated shards may still be running when shardopt_step returns (forward
 * can then overlap them): before reading through a kept pointer call shardopt_wait_param for
 * that parameter or shardopt_wait_all (fetching the pointer again also waits for it).
 *
 * ---- Growable structs ----------------------------------------------------------------------
 * shardopt_config_t, shardopt_group_t and shardopt_step_result_t start with struct_size
 * (NCCL-config style).
 * The library accepts any struct_size up to its own sizeof that ends on a field boundary: a
 * program built against an older, smaller struct keeps working with a newer library. Input
 * fields beyond the caller's struct_size take their defaults; output fields beyond it are not
 * written. Fields are only ever appended, and each version ends 8-byte aligned, so an older
 * struct's sizeof never covers part of a newer field.
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

/* The communicator shardopt_create_mpi* builds over the caller's MPI communicator. */
typedef enum shardopt_comm_kind {
  SHARDOPT_COMM_AUTO = 0, /* the SHARDOPT_COMM environment variable (mpi, shm or auto) if set;
                             else shared memory when some node holds two or more ranks, else
                             plain MPI */
  SHARDOPT_COMM_MPI = 1,  /* plain MPI collectives */
  SHARDOPT_COMM_SHM = 2,  /* node-local MPI-3 shared-memory windows, hierarchical across nodes */
  SHARDOPT_COMM_KIND_MIN_ENUM = -0x7FFFFFFF - 1,
  SHARDOPT_COMM_KIND_MAX_ENUM = 0x7FFFFFFF
} shardopt_comm_kind_t;

/* How the gradient sums are computed (docs/architecture.md, "Reproducible mode"). */
typedef enum shardopt_reduction {
  SHARDOPT_REDUCTION_DEFAULT = 0,      /* fp32 (or bf16-wire) sums in the collectives' order */
  SHARDOPT_REDUCTION_REPRODUCIBLE = 1, /* exact sums: the same step, bit for bit, at any number
                                          of ranks, bucket size and communicator (CPU;
                                          CUDA at stages 0-2 with Flat ownership) */
  SHARDOPT_REDUCTION_MIN_ENUM = -0x7FFFFFFF - 1,
  SHARDOPT_REDUCTION_MAX_ENUM = 0x7FFFFFFF
} shardopt_reduction_t;

/* Which rank updates which elements (docs/architecture.md, "Whole-tensor ownership"). */
typedef enum shardopt_ownership {
  SHARDOPT_OWNERSHIP_FLAT = 0,  /* equal slices of every bucket (every rank owns a piece of
                                   most parameters) */
  SHARDOPT_OWNERSHIP_WHOLE = 1, /* ragged per-rank ranges: every parameter inside a bucket has
                                   one owner, which updates it whole (SHARDOPT_RULE_MUON needs
                                   it); stages 0-3 on the CPU, 0-2 on CUDA; checkpoints
                                   load in either ownership */
  SHARDOPT_OWNERSHIP_MIN_ENUM = -0x7FFFFFFF - 1,
  SHARDOPT_OWNERSHIP_MAX_ENUM = 0x7FFFFFFF
} shardopt_ownership_t;

/* shardopt_config_t.collective_timeout_s for no timeout (any negative value). */
#define SHARDOPT_NO_COLLECTIVE_TIMEOUT (-1.0)
/* The default collective timeout in seconds (60 with debug_collectives). */
#define SHARDOPT_DEFAULT_COLLECTIVE_TIMEOUT 600.0

/* When shardopt_step's all-gather of the updated replica completes (see the introduction). */
typedef enum shardopt_gather_mode {
  SHARDOPT_GATHER_EAGER = 0, /* before shardopt_step returns: kept pointers are always current */
  SHARDOPT_GATHER_LAZY = 1,  /* in the background; shardopt_wait_param / shardopt_wait_all */
  SHARDOPT_GATHER_MODE_MIN_ENUM = -0x7FFFFFFF - 1,
  SHARDOPT_GATHER_MODE_MAX_ENUM = 0x7FFFFFFF
} shardopt_gather_mode_t;

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

/* Creation options: every field of the C++ OptimizerOptions, plus the communicator and the
 * gather mode. Start from shardopt_config_init(), which fills the defaults and struct_size.
 * A growable struct (see the introduction): a caller built against an older header passes
 * its smaller struct_size and gets the defaults for the fields it does not have. */
typedef struct shardopt_config {
  size_t struct_size;   /* sizeof(shardopt_config_t), set by shardopt_config_init */
  /* ---- since 0.1.0 (struct_size 80 on LP64) ---- */
  int stage;            /* shardopt_stage_t; default SHARDOPT_STAGE_ZERO1 */
  int param_dtype;      /* shardopt_dtype_t of the replica; default SHARDOPT_DTYPE_BF16 */
  int device;           /* shardopt_device_t; default SHARDOPT_DEVICE_CPU */
  int adam_mode;        /* shardopt_adam_mode_t; default SHARDOPT_ADAMW */
  double lr;            /* default 1e-3 */
  double beta1;         /* default 0.9 */
  double beta2;         /* default 0.999 */
  double eps;           /* default 1e-8 */
  double weight_decay;  /* default 0.01 */
  double max_grad_norm; /* clip the global L2 norm to this; default 0 (no clipping) */
  size_t bucket_elems;  /* elements per bucket, at every stage: gradients are reduced, and at
                           stages 1/2 the replica gathered, bucket by bucket; a parameter
                           larger than this spans several; 0: automatic, an eighth of the
                           model between 4096 and 1048576 elements, 16777216 with
                           SHARDOPT_DEVICE_CUDA (shardopt_get_config reports the size
                           chosen); default 0 (earlier releases: 1048576) */
  /* ---- since 0.2.0 ---- */
  int overlap;          /* 1: start each bucket's reduction as soon as its gradients are
                           ready (shardopt_grad_ready) and gather bucket by bucket; 0: all
                           communication inside shardopt_step; default 1 */
  int buckets_in_flight; /* stage 2: staging buckets in flight at once (>= 1); default 2 */
  int reduce_dtype;     /* wire type of the gradient reduction: SHARDOPT_DTYPE_F32 or _BF16
                           (half the bytes, each partial sum rounded to bf16); default F32 */
  int comm_kind;        /* shardopt_comm_kind_t; default SHARDOPT_COMM_AUTO; ignored by
                           shardopt_create (one process needs no communicator) */
  int comm_simulate_nodes; /* > 0: split the ranks into this many groups of consecutive ranks
                           and treat each as a node (tests of the hierarchical path); 0: the
                           SHARDOPT_SIMULATE_NODES environment variable, else the real nodes;
                           default 0 */
  int gather_mode;      /* shardopt_gather_mode_t; default SHARDOPT_GATHER_EAGER */
  int loss_scaling;     /* 1: dynamic loss scaling (docs/loss-scaling.md); default 0 */
  int loss_scale_growth_interval; /* finite steps in a row before the scale grows; default 2000 */
  double loss_scale_initial;      /* default 65536 */
  double loss_scale_growth_factor; /* >= 1; default 2 */
  double loss_scale_backoff_factor; /* in (0, 1); default 0.5 */
  double loss_scale_min;          /* backoff never goes below this; default 1 */
  double loss_scale_max;          /* growth never goes above this; default 16777216 (2^24) */
  /* Since 0.2.0 (stage 3): */
  size_t units_in_flight; /* stage 3: gathered units held at once (the pool); default 2 */
  /* Since 0.2.0 (collective safety, plain MPI): */
  double collective_timeout_s; /* > 0: a rank that waits longer than this in one collective
                           reports the call and collective every rank is in and the ranks
                           that have not arrived, and returns SHARDOPT_ERROR_COMMUNICATION
                           with the same message on every rank that was waiting; end the
                           job with MPI_Abort then (MPI_Finalize would wait for the missing
                           ranks; a process still running this long after the error is
                           ended by the library, code 14) (docs/architecture.md,
                           "Errors and collectives"); 0: the SHARDOPT_COLLECTIVE_TIMEOUT
                           environment variable (seconds; 0, off or none: no timeout), else
                           SHARDOPT_DEFAULT_COLLECTIVE_TIMEOUT (600 s; 60 s with
                           debug_collectives); SHARDOPT_NO_COLLECTIVE_TIMEOUT (negative): no
                           timeout; default 0. NaN is invalid. */
  int debug_collectives; /* 1: before every collective the ranks compare what they enter and
                           fail together at the first divergence (costs one small all-gather
                           per collective); 0: the SHARDOPT_DEBUG_COLLECTIVES environment
                           variable, else off; default 0 */
  int comm_mpi_in_flight; /* plain MPI: non-blocking collectives started at once, the rest
                           start in call order (MpiCommOptions::mpi_in_flight); 0: the
                           SHARDOPT_MPI_IN_FLIGHT environment variable, else 1; default 0 */
  /* Since 0.2.0 (reproducible mode): */
  int reduction;        /* shardopt_reduction_t; default SHARDOPT_REDUCTION_DEFAULT. Call
                           shardopt_begin_backward once per micro-batch: each micro-batch is
                           summed exactly (docs/architecture.md, "Reproducible mode") */
  int reserved0;        /* must be 0 (keeps the struct free of trailing padding) */
  /* Since 0.5.0 (whole-tensor ownership, issue 32): */
  int ownership;        /* shardopt_ownership_t; default SHARDOPT_OWNERSHIP_FLAT. WHOLE is
                           needed by SHARDOPT_RULE_MUON groups; it runs stages 0-3 on the CPU
                           with either reduction and stages 0-2 on SHARDOPT_DEVICE_CUDA with
                           the default one (finalize returns SHARDOPT_ERROR_UNSUPPORTED for
                           the rest); checkpoints load in either ownership */
  int reserved1;        /* must be 0 (keeps the struct free of trailing padding) */
} shardopt_config_t;

/* What one step did. An output struct: set struct_size (shardopt_step_result_init does)
 * before passing it; the library writes only the fields that lie within struct_size. */
typedef struct shardopt_step_result {
  size_t struct_size; /* set by the caller: sizeof(shardopt_step_result_t) */
  double grad_norm;   /* global L2 norm of the averaged (and unscaled) gradient, before
                         clipping; of a skipped step: NaN or +Inf, the non-finite norm */
  double clip_coef;   /* factor applied to the gradient (1 when not clipped or skipped) */
  int clipped;        /* 1 when clipped */
  int skipped;        /* 1 when a gradient was NaN/Inf on some rank: no update anywhere */
  int64_t step;       /* number of updates applied so far (skipped steps excluded) */
  /* ---- end of the smallest accepted struct (40 bytes on LP64) ---- */
  int64_t skipped_steps; /* steps skipped so far for non-finite gradients */
  double loss_scale;  /* the scale for the next backward (1 without loss scaling) */
  /* Wall-clock seconds of the phases of this step on this rank (C++ StepTimings). */
  double time_reduce; /* blocked in gradient reductions, in the step and during backward */
  double time_norm;   /* local sum of squares + one scalar all-reduce */
  double time_update; /* the fused AdamW pass */
  double time_gather; /* the all-gather of the updated shards: with SHARDOPT_GATHER_EAGER its
                         whole duration, with _LAZY the time to start it */
  double time_total;  /* the step from entry to return, plus time blocked in reductions during
                         backward */
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

/* Local. Fills every field of *config with its default and struct_size with
 * sizeof(shardopt_config_t). config may not be NULL. */
SHARDOPT_API shardopt_status_t shardopt_config_init(shardopt_config_t* config);

/* Local. Zeroes *result and sets its struct_size to sizeof(shardopt_step_result_t). */
SHARDOPT_API shardopt_status_t shardopt_step_result_init(shardopt_step_result_t* result);

/* Creates a single-process optimizer (no MPI needed). Local. config may be NULL for the
 * defaults; it is only read during the call (struct_size as described in the introduction;
 * comm_kind and comm_simulate_nodes are ignored). On success *opt is a new handle owned by
 * the caller (free it with shardopt_destroy); on failure *opt is set to NULL. */
SHARDOPT_API shardopt_status_t shardopt_create(shardopt_optimizer_t* opt,
                                               const shardopt_config_t* config);

#if defined(MPI_VERSION) || defined(SHARDOPT_WITH_MPI)
/* Collective over `comm`: creates an optimizer whose data-parallel group is `comm`, over the
 * communicator config->comm_kind selects. The library duplicates the communicator, so its
 * traffic never matches the caller's; the caller keeps ownership of `comm`. MPI must stay
 * initialised until shardopt_destroy. The config (read only during the call) is checked on
 * every rank; if any rank's is invalid, or ranks chose different communicators, every rank
 * fails. *opt as for shardopt_create. Only in a library built with MPI (declared when
 * <mpi.h> is included first). */
SHARDOPT_API shardopt_status_t shardopt_create_mpi(shardopt_optimizer_t* opt, MPI_Comm comm,
                                                   const shardopt_config_t* config);
#endif

/* As shardopt_create_mpi (collective), for a Fortran integer communicator, converted with
 * MPI_Comm_f2c: MPI_COMM_WORLD from `use mpi`, or comm%MPI_VAL of a type(MPI_Comm) from
 * `use mpi_f08`. Returns SHARDOPT_ERROR_INVALID_STATE when MPI is not initialised and
 * SHARDOPT_ERROR_UNSUPPORTED when the library was built without MPI. */
SHARDOPT_API shardopt_status_t shardopt_create_mpi_f(shardopt_optimizer_t* opt, int fortran_comm,
                                                     const shardopt_config_t* config);

/* ---- parameter groups with an update rule (growable struct) -------------------------------
 * A group's rule is fixed at finalize. shardopt_add_group / shardopt_set_group /
 * shardopt_get_group below are the AdamW-era forms: add makes an AdamW group, set changes
 * lr_scale and weight_decay and keeps the rest, get reads those two. */
typedef enum {
  SHARDOPT_RULE_ADAMW = 0, /* the config's Adam (adam_mode): AdamW or Adam-L2 */
  SHARDOPT_RULE_LION = 1,  /* Lion: p *= 1 - lr wd; p -= lr sign(b1 m + (1 - b1) g);
                              m = b2 m + (1 - b2) g (no exp_avg_sq) */
  SHARDOPT_RULE_ADAMW8BIT = 2, /* AdamW with 8-bit block-quantized m and v (bitsandbytes /
                                  torchao semantics); parameters below adamw8bit_min_numel
                                  elements keep fp32 state; CPU and CUDA */
  SHARDOPT_RULE_MUON = 3, /* Muon (torch.optim.Muon's semantics) on 2-D matrices: M = lerp(M, g,
                            1 - mu); U = nesterov ? lerp(g, M, mu) : M; O = Newton-Schulz(U)
                            once per step on the reduced gradient; p *= 1 - lr wd;
                            p -= adjusted lr * O (state: the momentum M as exp_avg). Every
                            parameter of the group must be registered with
                            shardopt_add_param_2d (rows > 1, cols > 1) and the config's
                            ownership must be SHARDOPT_OWNERSHIP_WHOLE; finalize refuses
                            anything else (SHARDOPT_ERROR_INVALID_ARGUMENT, naming the
                            parameter). CPU (stages 0-3) and CUDA (stages 0-2,
                            Newton-Schulz through cuBLAS) */
  SHARDOPT_RULE_ADAFACTOR = 4 /* Adafactor (torch.optim.Adafactor's semantics, PyTorch >= 2.5;
                                 since 0.6.0): rho = min(lr, 1 / sqrt(t)), alpha =
                                 max(eps2, RMS(p)) rho; p *= 1 - lr wd; a parameter registered
                                 with shardopt_add_param_2d (rows > 1, cols > 1) keeps factored
                                 second moments (row_var, col_var: rows + cols floats,
                                 shardopt_get_factored_state), any other the per-element
                                 variance (shardopt_get_exp_avg_sq); u = g / sqrt(max(v,
                                 eps1^2)); p -= alpha / max(1, RMS(u) / d) u. RMS(p) and RMS(u)
                                 are whole-tensor statistics, so the config's ownership must be
                                 SHARDOPT_OWNERSHIP_WHOLE; finalize refuses otherwise
                                 (SHARDOPT_ERROR_INVALID_ARGUMENT). CPU stages 0-3, CUDA
                                 stages 0-2.
                                 torch's defaults: lr 1e-2, weight_decay 0 (set them in the
                                 config or the group) */
} shardopt_rule_t;

/* Muon's learning-rate adjustment (torch.optim.Muon's adjust_lr_fn), rows x cols the
 * parameter's shape. */
typedef enum shardopt_muon_lr_adjust {
  SHARDOPT_MUON_LR_ORIGINAL = 0,         /* lr * sqrt(max(1, rows / cols)) (torch's default) */
  SHARDOPT_MUON_LR_MATCH_RMS_ADAMW = 1,  /* lr * 0.2 * sqrt(max(rows, cols)) (Moonshot) */
  SHARDOPT_MUON_LR_NONE = 2,             /* lr unchanged */
  SHARDOPT_MUON_LR_MIN_ENUM = -0x7FFFFFFF - 1,
  SHARDOPT_MUON_LR_MAX_ENUM = 0x7FFFFFFF
} shardopt_muon_lr_adjust_t;

typedef struct {
  size_t struct_size;  /* sizeof(shardopt_group_t), set by shardopt_group_init */
  /* ---- since 0.4.0 ---- */
  double lr_scale;     /* this group's lr is lr * lr_scale (>= 0); default 1 */
  int weight_decay;    /* 0 or 1: whether weight decay applies; default 1 */
  int rule;            /* shardopt_rule_t; default SHARDOPT_RULE_ADAMW */
  double lion_beta1;   /* Lion's interpolation beta, 0 <= b < 1; default 0.9 */
  double lion_beta2;   /* Lion's momentum decay, 0 <= b < 1; default 0.99 */
  size_t adamw8bit_min_numel; /* AdamW8bit: smaller parameters keep fp32 state; default 4096 */
  /* ---- since 0.5.0 (Muon; lr is the config's lr x lr_scale, the decay the config's
     weight_decay where weight_decay is 1) ---- */
  double muon_momentum; /* mu, 0 <= mu < 1; default 0.95 */
  int muon_nesterov;    /* 0 or 1; default 1 */
  int muon_ns_steps;    /* Newton-Schulz iterations, 0..99; default 5 */
  double muon_ns_a;     /* the quintic's coefficients; default 3.4445, -4.7750, 2.0315 */
  double muon_ns_b;
  double muon_ns_c;
  double muon_eps;      /* Newton-Schulz's Frobenius-norm clamp, > 0; default 1e-7 */
  int muon_lr_adjust;   /* shardopt_muon_lr_adjust_t; default SHARDOPT_MUON_LR_ORIGINAL */
  int reserved0;        /* must be 0 (keeps the struct free of trailing padding) */
  /* ---- since 0.6.0 (Adafactor, C++'s AdafactorConfig; lr and decay as for Muon) ---- */
  double adafactor_beta2_decay; /* the second moments' lerp weight is t^beta2_decay; <= 0;
                                   default -0.8 */
  double adafactor_eps1; /* floor of mean(row_var) and, squared, of the variance; >= 0;
                            default 2^-23 (fp32's machine epsilon: torch's None) */
  double adafactor_eps2; /* floor of RMS(p) in the step size; >= 0; default 1e-3 */
  double adafactor_d;    /* update clipping threshold on RMS(u); >= 1; default 1 */
  int adafactor_maximize; /* 0 or 1; default 0 */
  int reserved1;          /* must be 0 (keeps the struct free of trailing padding) */
} shardopt_group_t;

/* Fills the defaults (an AdamW group like group 0) and struct_size. */
SHARDOPT_API void shardopt_group_init(shardopt_group_t* group);
/* Adds a group with these options; *index receives it (may be NULL). Local; before
 * finalize; the same on every rank. */
SHARDOPT_API shardopt_status_t shardopt_add_group_ex(shardopt_optimizer_t opt,
                                                     const shardopt_group_t* group, int* index);
/* Replaces group `index`'s options (after finalize its rule must stay the same). Local: same
 * on every rank. */
SHARDOPT_API shardopt_status_t shardopt_set_group_ex(shardopt_optimizer_t opt, int index,
                                                     const shardopt_group_t* group);
/* Group `index`'s options into *group (its struct_size set by the caller: the fields within
 * it are written). */
SHARDOPT_API shardopt_status_t shardopt_get_group_ex(shardopt_optimizer_t opt, int index,
                                                     shardopt_group_t* group);

/* Adds a parameter group with its learning-rate multiplier (>= 0) and whether weight
 * decay applies (0 or 1); *group receives its index. Group 0 exists already (lr_scale 1,
 * decay on). Local; before finalize; the same on every rank. group may be NULL. */
SHARDOPT_API shardopt_status_t shardopt_add_group(shardopt_optimizer_t opt, double lr_scale,
                                                  int weight_decay, int* group);

/* Registers a parameter of `numel` (> 0) elements in `group`; *index receives its index
 * (0, 1, 2, ... in registration order). `name` is a NUL-terminated, non-empty string that
 * is unique within the optimizer; it is copied. Local; before finalize; every rank
 * registers the same parameters in the same order. index may be NULL. */
SHARDOPT_API shardopt_status_t shardopt_add_param(shardopt_optimizer_t opt, const char* name,
                                                  size_t numel, int group, size_t* index);

/* As shardopt_add_param, for a 2-D parameter of rows x cols elements (rows > 0, cols > 0; its
 * numel is rows * cols) stored row-major: element (r, c) at r * cols + c, as torch stores
 * an (out_features, in_features) weight. A Fortran array declared w(cols, rows) is the same
 * memory (the Fortran module takes rows = size(w, 2), cols = size(w, 1)). The layout keeps
 * the shape: SHARDOPT_RULE_MUON works on it, SHARDOPT_RULE_ADAFACTOR factors its second
 * moments, and whole-tensor ownership weighs the
 * Newton-Schulz cost with it. A zero extent, or rows * cols beyond size_t, is
 * SHARDOPT_ERROR_INVALID_ARGUMENT naming the parameter and its shape. Local; before
 * finalize; the same on every rank (the shape is part of the layout every rank agrees on). */
SHARDOPT_API shardopt_status_t shardopt_add_param_2d(shardopt_optimizer_t opt, const char* name,
                                                     size_t rows, size_t cols, int group,
                                                     size_t* index);

/* Collective. Builds the padded layout, checks that every rank registered the same
 * parameters, groups and options (SHARDOPT_ERROR_LAYOUT_MISMATCH otherwise) and allocates
 * the buffers. Parameters, master weights and moments start at zero. Once only. */
SHARDOPT_API shardopt_status_t shardopt_finalize(shardopt_optimizer_t opt);

/* Frees the optimizer and everything it allocated; every pointer obtained from it becomes
 * invalid. Waits for gathers still in flight (SHARDOPT_GATHER_LAZY). NULL is accepted (and
 * ignored). Using the handle afterwards returns SHARDOPT_ERROR_INVALID_ARGUMENT (as long as
 * its memory was not reused by a new handle). With MPI this frees the duplicated
 * communicator (MPI_Comm_free, collective in MPI's sense): call it on every rank, before
 * MPI_Finalize. */
SHARDOPT_API shardopt_status_t shardopt_destroy(shardopt_optimizer_t opt);

/* ---- queries (local, any time after create unless noted) ----------------------------------- */

/* This process's rank and the group's size. */
SHARDOPT_API shardopt_status_t shardopt_comm_rank(shardopt_optimizer_t opt, int* rank);
SHARDOPT_API shardopt_status_t shardopt_comm_size(shardopt_optimizer_t opt, int* size);
/* The communicator in use, e.g. "single-process", "mpi", "mpi-shm",
 * "mpi-shm-hierarchical(2 nodes)". *name belongs to the handle, valid until destroy. */
SHARDOPT_API shardopt_status_t shardopt_comm_name(shardopt_optimizer_t opt, const char** name);
/* The options in effect: every field of *config that lies within config->struct_size
 * (which the caller sets, e.g. with shardopt_config_init) is written; hyperparameters are
 * their current values (after shardopt_set_hyper or a checkpoint load). */
SHARDOPT_API shardopt_status_t shardopt_get_config(shardopt_optimizer_t opt,
                                                   shardopt_config_t* config);
/* The number of registered parameters. */
SHARDOPT_API shardopt_status_t shardopt_num_params(shardopt_optimizer_t opt, size_t* count);
/* The element count of parameter `index`. */
SHARDOPT_API shardopt_status_t shardopt_param_numel(shardopt_optimizer_t opt, size_t index,
                                                    size_t* numel);
/* The shape parameter `index` was registered with: rows x cols from shardopt_add_param_2d,
 * 1 x numel from shardopt_add_param. Either output may be NULL. */
SHARDOPT_API shardopt_status_t shardopt_param_shape(shardopt_optimizer_t opt, size_t index,
                                                    size_t* rows, size_t* cols);
/* The index of the parameter called `name`; SHARDOPT_ERROR_INVALID_ARGUMENT if none. */
SHARDOPT_API shardopt_status_t shardopt_param_index(shardopt_optimizer_t opt, const char* name,
                                                    size_t* index);
/* The number of parameter groups (1 + the groups added). */
SHARDOPT_API shardopt_status_t shardopt_num_groups(shardopt_optimizer_t opt, int* count);
/* Group `group`'s learning-rate multiplier and weight-decay flag (0 or 1); either output
 * may be NULL. */
SHARDOPT_API shardopt_status_t shardopt_get_group(shardopt_optimizer_t opt, int group,
                                                  double* lr_scale, int* weight_decay);
/* The number of updates applied so far. */
SHARDOPT_API shardopt_status_t shardopt_step_count(shardopt_optimizer_t opt, int64_t* step);

/* ---- parameters (after finalize) ------------------------------------------------------------ */

/* Sets parameter `index` from `numel` fp32 values (numel must be the parameter's size):
 * the replica (rounded to its dtype) and this rank's part of the fp32 master. Every rank
 * must pass the same values. Local; waits for gathers in flight first; `values` is only
 * read during the call. */
SHARDOPT_API shardopt_status_t shardopt_set_param(shardopt_optimizer_t opt, size_t index,
                                                  const float* values, size_t numel);

/* Collective: copies parameter `index`'s fp32 master weights into out[0, numel) on every
 * rank (numel must be the parameter's size; `out` is written only during the call). The
 * values are the master's bit for bit (-0.0 and NaN payloads included). */
SHARDOPT_API shardopt_status_t shardopt_get_master(shardopt_optimizer_t opt, size_t index,
                                                   float* out, size_t numel);

/* Collective: copies parameter `index`'s Adam first moment (exp_avg, "m") or second moment
 * (exp_avg_sq, "v") into out[0, numel) on every rank, bit for bit, like shardopt_get_master.
 * An argument that is wrong on one rank fails the call on every rank. */
SHARDOPT_API shardopt_status_t shardopt_get_exp_avg(shardopt_optimizer_t opt, size_t index,
                                                    float* out, size_t numel);
SHARDOPT_API shardopt_status_t shardopt_get_exp_avg_sq(shardopt_optimizer_t opt, size_t index,
                                                       float* out, size_t numel);

/* Collective: Adafactor's factored second moments of parameter `index` (a 2-D parameter,
 * rows > 1 and cols > 1, of a SHARDOPT_RULE_ADAFACTOR group): row_var[0, rows) and
 * col_var[0, cols) on every rank, bit for bit (its owner's, gathered). rows and cols must be
 * the parameter's shape (shardopt_param_shape). A parameter without them (any other
 * parameter keeps its variance in exp_avg_sq), a wrong size or a NULL buffer on any rank
 * fails the call on every rank (SHARDOPT_ERROR_INVALID_ARGUMENT). Since 0.6.0. */
SHARDOPT_API shardopt_status_t shardopt_get_factored_state(shardopt_optimizer_t opt, size_t index,
                                                           float* row_var, size_t rows,
                                                           float* col_var, size_t cols);

/* The full-replica values of parameter `index`, as the forward pass reads them: *data
 * points at *numel elements inside the optimizer (64-element aligned); device memory when
 * the device is CUDA. The _f32 form needs param_dtype F32, the _bf16 form BF16 (uint16_t bit
 * patterns; see shardopt_bf16_to_float). Local; waits until this parameter's gather of the
 * last step is complete (a no-op with SHARDOPT_GATHER_EAGER). The pointer stays valid until
 * shardopt_destroy and always points at the same memory; the values change at each step (and
 * at shardopt_set_param / shardopt_load_checkpoint). Read only: use shardopt_set_param to
 * change a parameter. numel may be NULL. */
SHARDOPT_API shardopt_status_t shardopt_param_f32(shardopt_optimizer_t opt, size_t index,
                                                  const float** data, size_t* numel);
SHARDOPT_API shardopt_status_t shardopt_param_bf16(shardopt_optimizer_t opt, size_t index,
                                                   const uint16_t** data, size_t* numel);

/* The whole flat replica: *data points at *elems elements of param_dtype (float or bf16 bit
 * patterns; device memory when the device is CUDA), parameter i at element
 * shardopt_param_offset(i); the elements between parameters are padding (zero). Local; waits
 * until every gather of the last step is complete. Pointer contract as shardopt_param_f32.
 * elems may be NULL. */
SHARDOPT_API shardopt_status_t shardopt_replica(shardopt_optimizer_t opt, const void** data,
                                                size_t* elems);
/* Parameter `index`'s offset in the flat replica, in elements (a multiple of 64). Local. */
SHARDOPT_API shardopt_status_t shardopt_param_offset(shardopt_optimizer_t opt, size_t index,
                                                     size_t* offset);

/* Local. Waits until parameter `index` (shardopt_wait_param) or every parameter
 * (shardopt_wait_all) holds the values of the last step in the replica. Needed only with
 * SHARDOPT_GATHER_LAZY, before reading through a pointer kept from an earlier call; a no-op
 * when nothing is in flight. The gathers are collectives every rank started in
 * shardopt_step: a rank may have to wait until the others make MPI progress (their own
 * wait, shardopt_progress, or any later collective call). */
SHARDOPT_API shardopt_status_t shardopt_wait_param(shardopt_optimizer_t opt, size_t index);
SHARDOPT_API shardopt_status_t shardopt_wait_all(shardopt_optimizer_t opt);

/* ---- gradients (after finalize) ------------------------------------------------------------- */

/* The fp32 gradient of parameter `index` (*numel elements) that backward writes or adds
 * into; it is zero after finalize and after each step. Local (at stage 2 it may start the
 * reduction of earlier buckets, like shardopt_grad_ready). Stages 0/1: a view of the full
 * gradient buffer, valid until shardopt_destroy. Stage 2: a view into the bucket being
 * filled, valid until the next call that reduces a bucket (shardopt_grad or
 * shardopt_accumulate_grad_* of a parameter in a later bucket, shardopt_grad_ready
 * completing the bucket, shardopt_reduce_gradients, shardopt_step, shardopt_zero_grad);
 * parameters must then be visited in backward (reverse registration) order. A gradient may
 * not be changed after its bucket's reduction started (SHARDOPT_ERROR_INVALID_STATE for
 * calls that would). numel may be NULL. */
SHARDOPT_API shardopt_status_t shardopt_grad(shardopt_optimizer_t opt, size_t index,
                                             float** data, size_t* numel);

/* grad(index) += src[0, numel), from fp32 or from bf16 bit patterns, in one pass. numel
 * must be the parameter's size; `src` is only read during the call. Local (at stage 2 it
 * may start the reduction of earlier buckets). */
SHARDOPT_API shardopt_status_t shardopt_accumulate_grad_f32(shardopt_optimizer_t opt,
                                                            size_t index, const float* src,
                                                            size_t numel);
SHARDOPT_API shardopt_status_t shardopt_accumulate_grad_bf16(shardopt_optimizer_t opt,
                                                             size_t index, const uint16_t* src,
                                                             size_t numel);

/* Parameter `index`'s gradient of this micro-batch is complete, at any stage. Optional:
 * shardopt_step reduces every bucket not started yet. With overlap (and always at stage 2)
 * a bucket whose parameters are all marked starts its reduction at once, in bucket order on
 * every rank, so every rank must mark the same parameters; its gradients may not change
 * afterwards. Marking a parameter twice in one micro-batch is SHARDOPT_ERROR_INVALID_STATE.
 * Local (non-blocking collectives are started, never waited for). */
SHARDOPT_API shardopt_status_t shardopt_grad_ready(shardopt_optimizer_t opt, size_t index);

/* Local. Drives collectives in flight (MPI progresses non-blocking collectives only inside
 * MPI calls). A trainer whose backward computes for long between shardopt_grad_ready calls
 * may call it, e.g. once per layer; cheap. */
SHARDOPT_API shardopt_status_t shardopt_progress(shardopt_optimizer_t opt);

/* Local. Starts the backward pass of one micro-batch. sync = 0 for every micro-batch but the
 * last of a step: gradients then accumulate locally with no communication; sync != 0 for
 * the last (buckets are reduced as they complete). shardopt_step averages over the
 * micro-batches begun since the previous step (one when this is never called). Fails with
 * SHARDOPT_ERROR_INVALID_STATE once this step's gradients were reduced. */
SHARDOPT_API shardopt_status_t shardopt_begin_backward(shardopt_optimizer_t opt, int sync);

/* Collective. Reduces every bucket not reduced yet and waits: the gradients of this step are
 * then final. Optional: shardopt_step does it too. */
SHARDOPT_API shardopt_status_t shardopt_reduce_gradients(shardopt_optimizer_t opt);

/* Zeroes every gradient. Local; waits for reductions in flight first. */
SHARDOPT_API shardopt_status_t shardopt_zero_grad(shardopt_optimizer_t opt);

/* ---- the step and hyperparameters ------------------------------------------------------------ */

/* Collective: reduces the gradients (averaged over ranks and micro-batches, divided by the
 * loss scale), computes the global norm, clips, skips the update everywhere if any gradient
 * is NaN/Inf, updates this rank's shard with AdamW, all-gathers the replica and zeroes the
 * gradients. With SHARDOPT_GATHER_EAGER (the default) it returns once the gather is
 * complete, so every replica pointer reads the new values; with _LAZY see
 * shardopt_wait_param. result may be NULL; otherwise result->struct_size must be set
 * (shardopt_step_result_init): at least 40 (the fields up to `step`) and on a field
 * boundary when below sizeof(shardopt_step_result_t); only fields within it are written.
 * A result whose struct_size is not acceptable returns SHARDOPT_ERROR_INVALID_ARGUMENT
 * after the step was applied (on every rank alike, so that no rank waits for another) and
 * leaves *result unchanged. */
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

/* Changes the learning-rate multiplier and decay flag of an existing group (lr_scale >= 0,
 * weight_decay 0 or 1), before or after finalize, keeping its rule and the rule's options.
 * Local: same on every rank. */
SHARDOPT_API shardopt_status_t shardopt_set_group(shardopt_optimizer_t opt, int group,
                                                  double lr_scale, int weight_decay);

/* The dynamic loss-scaling state: the scale the trainer multiplies its loss by (1 when loss
 * scaling is off), the finite steps since the last growth or backoff, and every skipped step
 * (with or without loss scaling). Local; any output may be NULL. The set form is local too:
 * set the same values on every rank; the scale must lie in [loss_scale_min, loss_scale_max]
 * (exactly 1 without loss scaling) and the counts be >= 0, otherwise nothing changes
 * (SHARDOPT_ERROR_INVALID_ARGUMENT). Checkpoints save and restore this state. */
SHARDOPT_API shardopt_status_t shardopt_get_loss_scale(shardopt_optimizer_t opt, double* scale,
                                                       int64_t* good_steps,
                                                       int64_t* skipped_steps);
SHARDOPT_API shardopt_status_t shardopt_set_loss_scale(shardopt_optimizer_t opt, double scale,
                                                       int64_t good_steps, int64_t skipped_steps);

/* ---- checkpoints (collective; docs/checkpoint-format.md) ------------------------------------- */

/* Collective. Saves the full optimizer state (fp32 master, moments, step count, loss scale,
 * hyperparameters, groups, layout) under directory `dir` (created if missing; every rank
 * must see the same file system path) as a new checkpoint, and keeps the newest `keep`
 * (>= 1) checkpoints there. The save is crash-safe: published by rename, so the previous
 * checkpoint stays the latest until the new one is complete. On any rank's failure every
 * rank returns the same error (SHARDOPT_ERROR_IO for a file that cannot be written).
 * From its first save into `dir` until shardopt_destroy, the handle holds `dir` locked: a
 * save into it through another handle (another job) returns SHARDOPT_ERROR_IO at once on
 * every rank, naming the directory and the holder's host and pid, and changes nothing; a
 * killed job's lock dies with it. *published (may be NULL) receives the new checkpoint's
 * directory, a string owned by the handle, valid until the next save or destroy. Waits for
 * gathers in flight. AdamW8bit's state is saved as its 8-bit codes and block scales. */
SHARDOPT_API shardopt_status_t shardopt_save_checkpoint(shardopt_optimizer_t opt, const char* dir,
                                                        int keep, const char** published);

/* Collective. Loads the checkpoint that `path` names: a save directory (its latest
 * checkpoint) or one checkpoint directory. The optimizer must be finalized with the same
 * parameters (names, sizes, order, groups) and parameter dtype; the rank count and stage may
 * differ (bit-exact resharding). Restores master weights, moments, step count,
 * hyperparameters, group options and the loss-scaling state, and rebuilds the replica
 * (complete when it returns). Everything is validated first: a missing or unreadable
 * checkpoint is SHARDOPT_ERROR_IO, a truncated or corrupted one SHARDOPT_ERROR_CORRUPT_DATA
 * (so is an intact checkpoint in the wrong place: a ckpt-K directory holding another
 * checkpoint, or a LATEST naming an older checkpoint than one published after it), another
 * layout SHARDOPT_ERROR_LAYOUT_MISMATCH, a newer format SHARDOPT_ERROR_UNSUPPORTED, on every
 * rank, and the optimizer is left unchanged. */
SHARDOPT_API shardopt_status_t shardopt_load_checkpoint(shardopt_optimizer_t opt,
                                                        const char* path);

/* ---- memory report (local) ---------------------------------------------------------------- */

/* Bytes this rank holds now (*bytes) and at most so far (*peak) in one category (for
 * SHARDOPT_MEM_TOTAL: the sums over categories). Either output may be NULL. */
SHARDOPT_API shardopt_status_t shardopt_memory_usage(shardopt_optimizer_t opt,
                                                     shardopt_mem_category_t category,
                                                     size_t* bytes, size_t* peak);
/* A static name of a category ("params", ..., "total"); "?" for an unknown value. */
SHARDOPT_API const char* shardopt_mem_category_name(shardopt_mem_category_t category);

/* ---- stage 3: parameters sharded, gathered per unit ----------------------------------------
 * config.stage = SHARDOPT_STAGE_ZERO3 keeps only this rank's slice of the replica; the
 * trainer groups parameters into units (typically one layer) and gathers a unit before
 * reading its parameters. See docs/architecture.md ("Stage 3"). config.units_in_flight units
 * (default 2) may be held at once. acquire/prefetch/release are collective:
 * every rank makes the same calls in the same order. */
#define SHARDOPT_STAGE_ZERO3 3

/* Starts a new unit: parameters added from now on belong to it. A unit without parameters
 * yet is reused, so the first call gives 0. Before shardopt_finalize. Local. unit may be
 * NULL. */
SHARDOPT_API shardopt_status_t shardopt_begin_unit(shardopt_optimizer_t opt, int* unit);
/* The number of units (after shardopt_finalize). */
SHARDOPT_API shardopt_status_t shardopt_num_units(shardopt_optimizer_t opt, size_t* count);
/* Gathers `unit` (unless prefetched) and waits: shardopt_param_f32/_bf16 of its parameters
 * then point into the gathered unit until shardopt_release(unit). INVALID_STATE if the unit
 * is acquired already, if every unit buffer is held, or at stages 0-2. */
SHARDOPT_API shardopt_status_t shardopt_acquire(shardopt_optimizer_t opt, size_t unit);
/* Starts gathering `unit` without waiting (nothing if it is held already). INVALID_STATE if
 * every unit buffer is held, or at stages 0-2. */
SHARDOPT_API shardopt_status_t shardopt_prefetch(shardopt_optimizer_t opt, size_t unit);
/* Returns the unit's buffer to the pool; pointers into it become invalid. INVALID_STATE if
 * the unit is not acquired. shardopt_step fails with INVALID_STATE while a unit is held. */
SHARDOPT_API shardopt_status_t shardopt_release(shardopt_optimizer_t opt, size_t unit);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* SHARDOPT_H */
