/* train_mlp.c: the MLP trainer of examples/cpp/train_mlp.cpp, written against the C ABI.
 *
 * Same model (16 -> 64 -> 4, ReLU), data, initialisation, hyperparameters, learning-rate
 * schedule, parameter order and groups, and the same float arithmetic in the same order, so
 * its final master weights equal the C++ trainer's bit for bit (tested by ctest).
 *
 *   mpiexec -n 2 ./train_mlp_c [--steps N] [--stage 0|1|2] [--dtype bf16|fp32]
 *                              [--params-out FILE]
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "shardopt/shardopt.h" /* includes <mpi.h> when shardopt was built with MPI */

enum { kIn = 16, kHidden = 64, kOut = 4, kGlobalBatch = 96, kParams = 4 };
static const double kPi = 3.14159265358979323846;

/* Returns from the enclosing function with the failing call's status and message. */
#define CHECK(call)                                                                      \
  do {                                                                                   \
    shardopt_status_t st_ = (call);                                                      \
    if (st_ != SHARDOPT_SUCCESS) {                                                       \
      fprintf(stderr, "train_mlp_c: %s (%s)\n", shardopt_last_error(opt),                \
              shardopt_status_string(st_));                                              \
      return 1;                                                                          \
    }                                                                                    \
  } while (0)

/* Deterministic uniform value in [-1, 1) from integers (splitmix64). */
static float uniform(uint64_t a, uint64_t b) {
  uint64_t z = a * 0x9E3779B97F4A7C15ull + b * 0xD1B54A32D192ED03ull + 0x632BE59BD9B4E019ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return (float)((double)(z >> 11) * 0x1.0p-53 * 2.0 - 1.0);
}

/* Sample s of step t: inputs x and targets y = teacher(x). */
static void make_sample(int step, int s, float* x, float* y) {
  const uint64_t id = (uint64_t)step * kGlobalBatch + (uint64_t)s;
  int i, o;
  for (i = 0; i < kIn; ++i) x[i] = uniform(id, (uint64_t)i);
  for (o = 0; o < kOut; ++o) {
    double acc = 0;
    for (i = 0; i < kIn; ++i) acc += uniform(1000003 + o, (uint64_t)i) * x[i];
    y[o] = (float)sin(acc);
  }
}

typedef struct {
  int steps, stage, dtype;
  const char* params_out;
} cli_t;

static int parse(int argc, char** argv, cli_t* c) {
  int i;
  c->steps = 200;
  c->stage = SHARDOPT_STAGE_ZERO1;
  c->dtype = SHARDOPT_DTYPE_BF16;
  c->params_out = NULL;
  for (i = 1; i < argc; ++i) {
    const char* a = argv[i];
    if (i + 1 >= argc) {
      fprintf(stderr, "train_mlp_c: %s needs a value\n", a);
      return 1;
    }
    if (strcmp(a, "--steps") == 0) c->steps = atoi(argv[++i]);
    else if (strcmp(a, "--stage") == 0) c->stage = atoi(argv[++i]);
    else if (strcmp(a, "--dtype") == 0) c->dtype = strcmp(argv[++i], "fp32") == 0 ? SHARDOPT_DTYPE_F32 : SHARDOPT_DTYPE_BF16;
    else if (strcmp(a, "--params-out") == 0) c->params_out = argv[++i];
    else {
      fprintf(stderr, "train_mlp_c: unknown option %s\n", a);
      return 1;
    }
  }
  return 0;
}

static double sum_over_ranks(double x) {
#ifdef SHARDOPT_WITH_MPI
  MPI_Allreduce(MPI_IN_PLACE, &x, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
#endif
  return x;
}

/* Copies parameter p's replica into out as float, whatever the replica dtype. */
static shardopt_status_t read_param(shardopt_optimizer_t opt, int dtype, size_t p, float* out) {
  size_t n = 0, k;
  shardopt_status_t st;
  if (dtype == SHARDOPT_DTYPE_BF16) {
    const uint16_t* v = NULL;
    st = shardopt_param_bf16(opt, p, &v, &n);
    for (k = 0; st == SHARDOPT_SUCCESS && k < n; ++k) out[k] = shardopt_bf16_to_float(v[k]);
  } else {
    const float* v = NULL;
    st = shardopt_param_f32(opt, p, &v, &n);
    if (st == SHARDOPT_SUCCESS) memcpy(out, v, n * sizeof(float));
  }
  return st;
}

/* Rank 0 writes every parameter's fp32 master weights, in order, as raw floats. */
static int write_params(shardopt_optimizer_t opt, const char* path, int rank) {
  static float buf[kHidden * kIn];
  FILE* f = NULL;
  size_t nparams = 0, p, n = 0;
  int failed = 0;
  CHECK(shardopt_num_params(opt, &nparams));
  if (rank == 0 && (f = fopen(path, "wb")) == NULL) {
    fprintf(stderr, "train_mlp_c: cannot write %s\n", path);
    failed = 1;
  }
  for (p = 0; p < nparams; ++p) {
    CHECK(shardopt_param_numel(opt, p, &n));
    CHECK(shardopt_get_master(opt, p, buf, n)); /* collective: every rank calls it */
    if (f != NULL && fwrite(buf, sizeof(float), n, f) != n) failed = 1;
  }
  if (f != NULL && fclose(f) != 0) failed = 1;
  return failed;
}

static int train(shardopt_optimizer_t opt, const cli_t* cli) {
  static float w1[kHidden * kIn], b1[kHidden], w2[kOut * kHidden], b2[kOut];
  static float gw1[kHidden * kIn], gb1[kHidden], gw2[kOut * kHidden], gb2[kOut];
  static float init[kHidden * kIn];
  float x[kIn], y[kOut], h[kHidden], dout[kOut], dh[kHidden];
  const float scales[kParams] = {1.0f / sqrtf((float)kIn), 0.0f, 1.0f / sqrtf((float)kHidden), 0.0f};
  const size_t sizes[kParams] = {kHidden * kIn, kHidden, kOut * kHidden, kOut};
  const char* names[kParams] = {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"};
  size_t W1, B1, W2, B2, index[kParams];
  int rank = 0, world = 1, no_decay = 0, local, first, step, s, i, j, o, p;
  size_t k;
  shardopt_step_result_t r;

  CHECK(shardopt_comm_rank(opt, &rank));
  CHECK(shardopt_comm_size(opt, &world));
  if (kGlobalBatch % world != 0) {
    if (rank == 0) fprintf(stderr, "global batch %d does not divide over %d ranks\n", kGlobalBatch, world);
    return 2;
  }
  CHECK(shardopt_add_group(opt, 1.0, 0, &no_decay));
  for (p = 0; p < kParams; ++p)
    CHECK(shardopt_add_param(opt, names[p], sizes[p], p % 2 == 1 ? no_decay : 0, &index[p]));
  W1 = index[0], B1 = index[1], W2 = index[2], B2 = index[3];
  CHECK(shardopt_finalize(opt));

  /* Same initial values on every rank (scaled uniform, like Kaiming-uniform). */
  for (p = 0; p < kParams; ++p) {
    for (k = 0; k < sizes[p]; ++k) init[k] = scales[p] * uniform((uint64_t)(11 + p), k);
    CHECK(shardopt_set_param(opt, index[p], init, sizes[p]));
  }

  local = kGlobalBatch / world;
  first = rank * local;
  for (step = 0; step < cli->steps; ++step) {
    /* Linear warm-up then cosine decay; set on every rank alike. */
    const double warm = 20, peak = 1e-2;
    const double lr = step < warm ? peak * (step + 1) / warm
                                  : peak * 0.5 * (1 + cos(kPi * (step - warm) / (cli->steps - warm)));
    double local_sse = 0, loss;
    CHECK(shardopt_set_lr(opt, lr));
    CHECK(read_param(opt, cli->dtype, W1, w1));
    CHECK(read_param(opt, cli->dtype, B1, b1));
    CHECK(read_param(opt, cli->dtype, W2, w2));
    CHECK(read_param(opt, cli->dtype, B2, b2));
    memset(gw1, 0, sizeof gw1);
    memset(gb1, 0, sizeof gb1);
    memset(gw2, 0, sizeof gw2);
    memset(gb2, 0, sizeof gb2);
    for (s = first; s < first + local; ++s) {
      make_sample(step, s, x, y);
      for (j = 0; j < kHidden; ++j) {
        float a = b1[j];
        for (i = 0; i < kIn; ++i) a += w1[j * kIn + i] * x[i];
        h[j] = a > 0 ? a : 0;
      }
      for (o = 0; o < kOut; ++o) {
        float a = b2[o], e;
        for (j = 0; j < kHidden; ++j) a += w2[o * kHidden + j] * h[j];
        e = a - y[o];
        local_sse += (double)e * e;
        dout[o] = 2.0f * e / (float)local; /* d(mean over local batch)/d out */
      }
      /* Backward, layer 2 then layer 1. */
      for (j = 0; j < kHidden; ++j) dh[j] = 0;
      for (o = 0; o < kOut; ++o) {
        gb2[o] += dout[o];
        for (j = 0; j < kHidden; ++j) {
          gw2[o * kHidden + j] += dout[o] * h[j];
          dh[j] += dout[o] * w2[o * kHidden + j];
        }
      }
      for (j = 0; j < kHidden; ++j) {
        if (h[j] <= 0) continue;
        gb1[j] += dh[j];
        for (i = 0; i < kIn; ++i) gw1[j * kIn + i] += dh[j] * x[i];
      }
    }
    /* Hand the gradients over in backward order (stage 2 reduces bucket by bucket). */
    CHECK(shardopt_accumulate_grad_f32(opt, B2, gb2, kOut));
    CHECK(shardopt_grad_ready(opt, B2));
    CHECK(shardopt_accumulate_grad_f32(opt, W2, gw2, kOut * kHidden));
    CHECK(shardopt_grad_ready(opt, W2));
    CHECK(shardopt_accumulate_grad_f32(opt, B1, gb1, kHidden));
    CHECK(shardopt_grad_ready(opt, B1));
    CHECK(shardopt_accumulate_grad_f32(opt, W1, gw1, kHidden * kIn));
    CHECK(shardopt_grad_ready(opt, W1));
    CHECK(shardopt_step(opt, &r));

    loss = sum_over_ranks(local_sse) / kGlobalBatch;
    if (rank == 0 && (step % 20 == 0 || step == cli->steps - 1))
      printf("step %4d  loss %.6f  grad_norm %.4f%s%s  lr %.2e\n", step, loss, r.grad_norm,
             r.clipped ? " (clipped)" : "", r.skipped ? " (skipped)" : "", lr);
  }

  {
    size_t bytes = 0, peak = 0;
    CHECK(shardopt_memory_usage(opt, SHARDOPT_MEM_TOTAL, &bytes, &peak));
    if (rank == 0) printf("rank 0 optimizer memory: %zu bytes (peak %zu)\n", bytes, peak);
  }
  return cli->params_out != NULL ? write_params(opt, cli->params_out, rank) : 0;
}

int main(int argc, char** argv) {
  shardopt_optimizer_t opt = NULL;
  shardopt_config_t cfg;
  cli_t cli;
  int rc;
#ifdef SHARDOPT_WITH_MPI
  MPI_Init(&argc, &argv);
#endif
  rc = parse(argc, argv, &cli);
  if (rc == 0) {
    shardopt_status_t st;
    shardopt_config_init(&cfg);
    cfg.stage = cli.stage;
    cfg.param_dtype = cli.dtype;
    cfg.lr = 1e-2;
    cfg.weight_decay = 0.01;
    cfg.max_grad_norm = 1.0;
    cfg.bucket_elems = 1024; /* several stage-2 buckets even for this small model */
#ifdef SHARDOPT_WITH_MPI
    st = shardopt_create_mpi(&opt, MPI_COMM_WORLD, &cfg);
#else
    st = shardopt_create(&opt, &cfg);
#endif
    if (st != SHARDOPT_SUCCESS) {
      fprintf(stderr, "train_mlp_c: %s\n", shardopt_last_error(NULL));
      rc = 1;
    } else {
      rc = train(opt, &cli);
    }
    shardopt_destroy(opt); /* before MPI_Finalize: frees the library's communicator */
  }
#ifdef SHARDOPT_WITH_MPI
  {
    int any = rc;
    MPI_Allreduce(MPI_IN_PLACE, &any, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    rc = any;
  }
  MPI_Finalize();
#endif
  return rc;
}
