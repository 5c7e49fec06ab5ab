/* train_mlp.c: the MLP trainer of examples/cpp/train_mlp.cpp, written against the C ABI.
 *
 * Same model (16 -> 64 -> 4, ReLU), data, initialisation, hyperparameters, learning-rate
 * schedule, parameter order and groups, and the same float arithmetic in the same order, so
 * its final master weights equal the C++ trainer's bit for bit (tested by ctest).
 *
 *   mpiexec -n 2 ./train_mlp_c [--steps N] [--stage 0|1|2|3] [--dtype bf16|fp32]
 *                              [--params-out FILE] [--save-dir DIR --save-at K]
 *                              [--resume DIR] [--loss-out FILE] [--check-loss FILE]
 *                              [--rule adamw|lion|adamw8bit] [--min-8bit-numel N]
 *                              [--muon | --adafactor] [--zero-grad]
 *
 * --rule and --min-8bit-numel as in the C++ trainer: both groups' update rule (through
 * shardopt_group_t) and AdamW8bit's threshold.
 *
 * --muon as in the C++ trainer: a hidden layer fch (64 -> 96, ReLU) between fc1 and fc2, its
 * 96 x 64 weight registered with shardopt_add_param_2d (row-major, as stored here) in a
 * SHARDOPT_RULE_MUON group, whole-tensor ownership (SHARDOPT_OWNERSHIP_WHOLE) and the automatic
 * bucket size; fc1, fc2 and the biases keep --rule. Stages 0-2, no checkpoints.
 *
 * --adafactor as in the C++ trainer: the same hidden layer, fch.weight (shardopt_add_param_2d:
 * factored row_var/col_var) and fch.bias (a per-element variance) both in a
 * SHARDOPT_RULE_ADAFACTOR group with its defaults (torch.optim.Adafactor's) and no weight
 * decay (torch's default); whole ownership and the automatic bucket size as for --muon.
 *
 * --zero-grad calls shardopt_zero_grad before each step's backward, as a trainer used to
 * torch's optimizer.zero_grad() would; the step already leaves the gradients zero, so the
 * weights must not change by a bit (ctest compares them with the C++ trainer's).
 *
 * Each layer is a unit (shardopt_begin_unit before its parameters, at every stage, so that all
 * stages share one layout). The step runs layer by layer over this rank's samples: forward
 * layer 1, forward layer 2, backward layer 2, backward layer 1. --stage 3 shards the
 * parameters too: forward acquires layer 1 while prefetching layer 2 and releases each layer
 * after use; backward acquires layer 2 while prefetching layer 1, and hands each layer's
 * gradients over before releasing it. Stage 3 gives stage 2's weights bit for bit (ctest).
 *
 * Checkpoints: --save-dir DIR --save-at K saves a checkpoint after step K (collective); then
 * training goes on. --resume DIR loads the latest checkpoint of DIR, at any rank count and
 * stage, and continues from the step it holds. --loss-out writes "step loss" per step;
 * --check-loss compares the steps this run made with such a file (same global batch, so the
 * curves agree up to the order of fp32 gradient sums; tolerance as the C++ trainer's).
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "shardopt/shardopt.h" /* includes <mpi.h> when shardopt was built with MPI */

enum { kIn = 16, kHidden = 64, kMid = 96, kOut = 4, kGlobalBatch = 96, kMaxParams = 6 };
static const double kPi = 3.14159265358979323846;

/* Ends the job after a communication error (a collective timeout: the other ranks are
   missing, so MPI_Finalize and this program's own collectives would wait for them). */
#ifdef SHARDOPT_WITH_MPI
#define ABORT_ON_COMMUNICATION(st) \
  if ((st) == SHARDOPT_ERROR_COMMUNICATION) MPI_Abort(MPI_COMM_WORLD, 1)
#else
#define ABORT_ON_COMMUNICATION(st) (void)(st)
#endif

/* Returns from the enclosing function with the failing call's status and message. */
#define CHECK(call)                                                                      \
  do {                                                                                   \
    shardopt_status_t st_ = (call);                                                      \
    if (st_ != SHARDOPT_SUCCESS) {                                                       \
      fprintf(stderr, "train_mlp_c: %s (%s)\n", shardopt_last_error(opt),                \
              shardopt_status_string(st_));                                              \
      ABORT_ON_COMMUNICATION(st_);                                                       \
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
  int steps, stage, dtype, save_at, rule, zero_grad;
  int hidden_rule; /* the hidden layer's rule (--muon, --adafactor), or -1: no hidden layer */
  size_t min_8bit_numel;
  const char* params_out;
  const char* save_dir;
  const char* resume;
  const char* loss_out;
  const char* check_loss;
} cli_t;

static int parse(int argc, char** argv, cli_t* c) {
  int i;
  c->steps = 200;
  c->stage = SHARDOPT_STAGE_ZERO1;
  c->dtype = SHARDOPT_DTYPE_BF16;
  c->params_out = NULL;
  c->save_dir = NULL;
  c->save_at = -1;
  c->resume = NULL;
  c->loss_out = NULL;
  c->check_loss = NULL;
  c->rule = SHARDOPT_RULE_ADAMW;
  c->min_8bit_numel = 4096;
  c->hidden_rule = -1;
  c->zero_grad = 0;
  for (i = 1; i < argc; ++i) {
    const char* a = argv[i];
    if (strcmp(a, "--muon") == 0 || strcmp(a, "--adafactor") == 0) {
      if (c->hidden_rule != -1) {
        fprintf(stderr, "train_mlp_c: --muon and --adafactor exclude each other\n");
        return 1;
      }
      c->hidden_rule = a[2] == 'm' ? SHARDOPT_RULE_MUON : SHARDOPT_RULE_ADAFACTOR;
      continue;
    }
    if (strcmp(a, "--zero-grad") == 0) {
      c->zero_grad = 1;
      continue;
    }
    if (i + 1 >= argc) {
      fprintf(stderr, "train_mlp_c: %s needs a value\n", a);
      return 1;
    }
    if (strcmp(a, "--steps") == 0) c->steps = atoi(argv[++i]);
    else if (strcmp(a, "--stage") == 0) c->stage = atoi(argv[++i]);
    else if (strcmp(a, "--dtype") == 0) c->dtype = strcmp(argv[++i], "fp32") == 0 ? SHARDOPT_DTYPE_F32 : SHARDOPT_DTYPE_BF16;
    else if (strcmp(a, "--params-out") == 0) c->params_out = argv[++i];
    else if (strcmp(a, "--save-dir") == 0) c->save_dir = argv[++i];
    else if (strcmp(a, "--save-at") == 0) c->save_at = atoi(argv[++i]);
    else if (strcmp(a, "--resume") == 0) c->resume = argv[++i];
    else if (strcmp(a, "--loss-out") == 0) c->loss_out = argv[++i];
    else if (strcmp(a, "--check-loss") == 0) c->check_loss = argv[++i];
    else if (strcmp(a, "--min-8bit-numel") == 0) c->min_8bit_numel = (size_t)strtoull(argv[++i], NULL, 10);
    else if (strcmp(a, "--rule") == 0) {
      const char* r = argv[++i];
      if (strcmp(r, "adamw") == 0) c->rule = SHARDOPT_RULE_ADAMW;
      else if (strcmp(r, "lion") == 0) c->rule = SHARDOPT_RULE_LION;
      else if (strcmp(r, "adamw8bit") == 0) c->rule = SHARDOPT_RULE_ADAMW8BIT;
      else {
        fprintf(stderr, "unknown rule %s (adamw, lion or adamw8bit)\n", r);
        return 2;
      }
    }
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

/* Stage 3: gathers layer `unit` and waits, then starts gathering layer `next` (none if < 0)
 * so that its gather overlaps this layer's compute. Nothing at stages 0-2. */
static shardopt_status_t acquire_layer(shardopt_optimizer_t opt, int stage, size_t unit, int next) {
  shardopt_status_t st;
  if (stage != SHARDOPT_STAGE_ZERO3) return SHARDOPT_SUCCESS;
  st = shardopt_acquire(opt, unit);
  if (st == SHARDOPT_SUCCESS && next >= 0) st = shardopt_prefetch(opt, (size_t)next);
  return st;
}

/* Stage 3: returns the layer's gathered buffer to the pool. Nothing at stages 0-2. */
static shardopt_status_t release_layer(shardopt_optimizer_t opt, int stage, size_t unit) {
  return stage == SHARDOPT_STAGE_ZERO3 ? shardopt_release(opt, unit) : SHARDOPT_SUCCESS;
}

/* Rank 0 writes every parameter's fp32 master weights, in order, as raw floats. */
static int write_params(shardopt_optimizer_t opt, const char* path, int rank) {
  static float buf[kMid * kHidden];
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

/* Rank 0 compares losses[first, last) with the "step loss" lines of `path`; returns 1 when a
 * step is missing there or differs by more than the tolerance, or the loss did not fall. */
static int check_loss(const char* path, const double* losses, int first, int last, int dtype) {
  /* Ranks change only the order of fp32 gradient sums; a bf16 replica turns some last-bit
   * differences into bf16 rounding flips (see examples/cpp/train_mlp.cpp). */
  const double tol = dtype == SHARDOPT_DTYPE_F32 ? 1e-5 : 5e-3;
  double worst = 0;
  int step, matched = 0;
  double loss;
  FILE* f = fopen(path, "r");
  if (f == NULL) {
    fprintf(stderr, "train_mlp_c: cannot read %s\n", path);
    return 1;
  }
  while (fscanf(f, "%d %lf", &step, &loss) == 2) {
    double d;
    if (step < first || step >= last) continue;
    d = fabs(losses[step] - loss) / (fabs(loss) > 1e-12 ? fabs(loss) : 1e-12);
    if (d > worst) worst = d;
    ++matched;
  }
  fclose(f);
  printf("loss curve of steps %d..%d vs %s: max relative difference %.3e (tolerance %.0e)\n",
         first, last - 1, path, worst, tol);
  if (matched != last - first) {
    fprintf(stderr, "train_mlp_c: %s has %d of the %d steps\n", path, matched, last - first);
    return 1;
  }
  return worst > tol || losses[last - 1] >= losses[first] ? 1 : 0;
}

static int train(shardopt_optimizer_t opt, const cli_t* cli) {
  /* fch (hidden, --muon or --adafactor only) sits between fc1 and fc2; fc2 reads `mid`
   * inputs: kMid with the hidden layer, else kHidden. */
  static float w1[kHidden * kIn], b1[kHidden], wh[kMid * kHidden], bh[kMid];
  static float w2[kOut * kMid], b2[kOut];
  static float gw1[kHidden * kIn], gb1[kHidden], gwh[kMid * kHidden], gbh[kMid];
  static float gw2[kOut * kMid], gb2[kOut];
  static float init[kMid * kHidden];
  /* Per sample of this rank's batch: inputs, targets, activations, output and hidden grads. */
  static float xs[kGlobalBatch][kIn], ys[kGlobalBatch][kOut], hs[kGlobalBatch][kHidden];
  static float h2s[kGlobalBatch][kMid], dh2s[kGlobalBatch][kMid];
  static float douts[kGlobalBatch][kOut], dhs[kGlobalBatch][kHidden];
  const int hidden = cli->hidden_rule != -1, mid = hidden ? kMid : kHidden;
  const int adafactor = cli->hidden_rule == SHARDOPT_RULE_ADAFACTOR;
  /* Registration order, with each parameter's initial scale and seed (as the C++ trainer). */
  const char* names[kMaxParams] = {"fc1.weight", "fc1.bias", "fch.weight",
                                   "fch.bias",   "fc2.weight", "fc2.bias"};
  const size_t sizes[kMaxParams] = {kHidden * kIn, kHidden, kMid * kHidden,
                                    kMid,          (size_t)kOut * (size_t)mid, kOut};
  const float scales[kMaxParams] = {1.0f / sqrtf((float)kIn), 0.0f,
                                    1.0f / sqrtf((float)kHidden), 0.0f,
                                    1.0f / sqrtf((float)mid), 0.0f};
  const uint64_t seeds[kMaxParams] = {11, 12, 15, 16, 13, 14};
  size_t W1 = 0, B1 = 0, WH = 0, BH = 0, W2 = 0, B2 = 0, index[kMaxParams];
  const size_t unit1 = 0, unith = 1, unit2 = hidden ? 2 : 1;
  int rank = 0, world = 1, no_decay = 0, hidden_group = 0, start = 0, rc = 0;
  int local, first, step, s, i, j, m, o, p;
  size_t k;
  shardopt_step_result_t r;
  double* losses = (double*)calloc((size_t)(cli->steps > 0 ? cli->steps : 1), sizeof(double));
  int64_t done = 0;

  CHECK(shardopt_comm_rank(opt, &rank));
  CHECK(shardopt_comm_size(opt, &world));
  if (kGlobalBatch % world != 0) {
    if (rank == 0) fprintf(stderr, "global batch %d does not divide over %d ranks\n", kGlobalBatch, world);
    return 2;
  }
  {
    /* Both groups under --rule: group 0 (the default group, with decay) changed, group 1
     * added without decay; with --muon, group 2: Muon (its defaults: torch.optim.Muon's);
     * with --adafactor, group 2: Adafactor (torch.optim.Adafactor's defaults, no decay). */
    shardopt_group_t g;
    shardopt_group_init(&g);
    g.rule = cli->rule;
    g.adamw8bit_min_numel = cli->min_8bit_numel;
    CHECK(shardopt_set_group_ex(opt, 0, &g));
    g.weight_decay = 0;
    CHECK(shardopt_add_group_ex(opt, &g, &no_decay));
    if (hidden) {
      shardopt_group_init(&g);
      g.rule = cli->hidden_rule;
      g.weight_decay = adafactor ? 0 : 1;
      CHECK(shardopt_add_group_ex(opt, &g, &hidden_group));
    }
  }
  for (p = 0; p < kMaxParams; ++p) {
    if (!hidden && (p == 2 || p == 3)) continue; /* no hidden layer */
    if (p % 2 == 0) CHECK(shardopt_begin_unit(opt, NULL)); /* one unit per layer */
    if (p == 2) /* the hidden matrix: kMid rows (outputs) x kHidden columns, row-major */
      CHECK(shardopt_add_param_2d(opt, names[p], kMid, kHidden, hidden_group, &index[p]));
    else if (p == 3 && adafactor) /* Adafactor's bias: a per-element variance */
      CHECK(shardopt_add_param(opt, names[p], sizes[p], hidden_group, &index[p]));
    else
      CHECK(shardopt_add_param(opt, names[p], sizes[p], p % 2 == 1 ? no_decay : 0, &index[p]));
  }
  W1 = index[0], B1 = index[1], W2 = index[4], B2 = index[5];
  if (hidden) WH = index[2], BH = index[3];
  CHECK(shardopt_finalize(opt));

  /* Same initial values on every rank (scaled uniform, like Kaiming-uniform). */
  for (p = 0; p < kMaxParams; ++p) {
    if (!hidden && (p == 2 || p == 3)) continue;
    for (k = 0; k < sizes[p]; ++k) init[k] = scales[p] * uniform(seeds[p], k);
    CHECK(shardopt_set_param(opt, index[p], init, sizes[p]));
  }
  if (cli->resume != NULL) {
    /* Collective: state, step count and hyperparameters of the checkpoint, resharded to this
     * run's ranks and stage; the replica is complete when it returns. */
    CHECK(shardopt_load_checkpoint(opt, cli->resume));
    CHECK(shardopt_step_count(opt, &done));
    start = (int)done;
    if (rank == 0) printf("resumed from %s at step %d on %d ranks\n", cli->resume, start, world);
  }
  CHECK(shardopt_step_result_init(&r));

  local = kGlobalBatch / world;
  first = rank * local;
  for (step = start; step < cli->steps; ++step) {
    /* Linear warm-up then cosine decay; set on every rank alike. */
    const double warm = 20, peak = 1e-2;
    const double lr = step < warm ? peak * (step + 1) / warm
                                  : peak * 0.5 * (1 + cos(kPi * (step - warm) / (cli->steps - warm)));
    double local_sse = 0, loss;
    /* The activations fc2 reads: the hidden layer's with one, else fc1's. */
    float (*last)[kMid] = h2s;
    CHECK(shardopt_set_lr(opt, lr));
    if (cli->zero_grad) CHECK(shardopt_zero_grad(opt)); /* redundant: the step zeroed them */
    memset(gw1, 0, sizeof gw1);
    memset(gb1, 0, sizeof gb1);
    memset(gwh, 0, sizeof gwh);
    memset(gbh, 0, sizeof gbh);
    memset(gw2, 0, sizeof gw2);
    memset(gb2, 0, sizeof gb2);
    /* Forward, layer 1 (the next layer's gather in flight meanwhile at stage 3). */
    CHECK(acquire_layer(opt, cli->stage, unit1, (int)unith));
    CHECK(read_param(opt, cli->dtype, W1, w1));
    CHECK(read_param(opt, cli->dtype, B1, b1));
    for (s = 0; s < local; ++s) {
      make_sample(step, first + s, xs[s], ys[s]);
      for (j = 0; j < kHidden; ++j) {
        float a = b1[j];
        for (i = 0; i < kIn; ++i) a += w1[j * kIn + i] * xs[s][i];
        hs[s][j] = a > 0 ? a : 0;
      }
    }
    CHECK(release_layer(opt, cli->stage, unit1));
    if (hidden) { /* Forward, the hidden layer. */
      CHECK(acquire_layer(opt, cli->stage, unith, (int)unit2));
      CHECK(read_param(opt, cli->dtype, WH, wh));
      CHECK(read_param(opt, cli->dtype, BH, bh));
      for (s = 0; s < local; ++s) {
        for (m = 0; m < kMid; ++m) {
          float a = bh[m];
          for (j = 0; j < kHidden; ++j) a += wh[m * kHidden + j] * hs[s][j];
          h2s[s][m] = a > 0 ? a : 0;
        }
      }
      CHECK(release_layer(opt, cli->stage, unith));
    } else {
      for (s = 0; s < local; ++s) memcpy(h2s[s], hs[s], sizeof hs[s]);
    }
    /* Forward, layer 2, and the loss. */
    CHECK(acquire_layer(opt, cli->stage, unit2, -1));
    CHECK(read_param(opt, cli->dtype, W2, w2));
    CHECK(read_param(opt, cli->dtype, B2, b2));
    for (s = 0; s < local; ++s) {
      for (o = 0; o < kOut; ++o) {
        float a = b2[o], e;
        for (j = 0; j < mid; ++j) a += w2[o * mid + j] * last[s][j];
        e = a - ys[s][o];
        local_sse += (double)e * e;
        douts[s][o] = 2.0f * e / (float)local; /* d(mean over local batch)/d out */
      }
    }
    CHECK(release_layer(opt, cli->stage, unit2));
    /* Backward, layer 2 (the layer below prefetched), then down to layer 1; each layer's
     * gradients are handed over as soon as they are complete (stages 2 and 3 reduce bucket
     * by bucket). */
    CHECK(acquire_layer(opt, cli->stage, unit2, (int)(hidden ? unith : unit1)));
    CHECK(read_param(opt, cli->dtype, W2, w2)); /* the input gradient needs W2 */
    for (s = 0; s < local; ++s) {
      float* d = hidden ? dh2s[s] : dhs[s];
      for (j = 0; j < mid; ++j) d[j] = 0;
      for (o = 0; o < kOut; ++o) {
        gb2[o] += douts[s][o];
        for (j = 0; j < mid; ++j) {
          gw2[o * mid + j] += douts[s][o] * last[s][j];
          d[j] += douts[s][o] * w2[o * mid + j];
        }
      }
    }
    CHECK(shardopt_accumulate_grad_f32(opt, B2, gb2, kOut));
    CHECK(shardopt_grad_ready(opt, B2));
    CHECK(shardopt_accumulate_grad_f32(opt, W2, gw2, sizes[4]));
    CHECK(shardopt_grad_ready(opt, W2));
    CHECK(release_layer(opt, cli->stage, unit2));
    if (hidden) { /* Backward, the hidden layer. */
      CHECK(acquire_layer(opt, cli->stage, unith, (int)unit1));
      CHECK(read_param(opt, cli->dtype, WH, wh));
      for (s = 0; s < local; ++s) {
        for (j = 0; j < kHidden; ++j) dhs[s][j] = 0;
        for (m = 0; m < kMid; ++m) {
          if (h2s[s][m] <= 0) continue;
          gbh[m] += dh2s[s][m];
          for (j = 0; j < kHidden; ++j) {
            gwh[m * kHidden + j] += dh2s[s][m] * hs[s][j];
            dhs[s][j] += dh2s[s][m] * wh[m * kHidden + j];
          }
        }
      }
      CHECK(shardopt_accumulate_grad_f32(opt, BH, gbh, kMid));
      CHECK(shardopt_grad_ready(opt, BH));
      CHECK(shardopt_accumulate_grad_f32(opt, WH, gwh, kMid * kHidden));
      CHECK(shardopt_grad_ready(opt, WH));
      CHECK(release_layer(opt, cli->stage, unith));
    }
    /* Layer 1 computes no input gradient, so it reads no parameter here; a deeper model's
     * layers would (the acquire keeps the pattern). */
    CHECK(acquire_layer(opt, cli->stage, unit1, -1));
    for (s = 0; s < local; ++s) {
      for (j = 0; j < kHidden; ++j) {
        if (hs[s][j] <= 0) continue;
        gb1[j] += dhs[s][j];
        for (i = 0; i < kIn; ++i) gw1[j * kIn + i] += dhs[s][j] * xs[s][i];
      }
    }
    CHECK(shardopt_accumulate_grad_f32(opt, B1, gb1, kHidden));
    CHECK(shardopt_grad_ready(opt, B1));
    CHECK(shardopt_accumulate_grad_f32(opt, W1, gw1, kHidden * kIn));
    CHECK(shardopt_grad_ready(opt, W1));
    CHECK(release_layer(opt, cli->stage, unit1));
    CHECK(shardopt_step(opt, &r));

    loss = sum_over_ranks(local_sse) / kGlobalBatch;
    losses[step] = loss;
    if (r.step != step + 1) {
      fprintf(stderr, "train_mlp_c: the optimizer counts %lld updates after step %d\n", (long long)r.step, step);
      return 1;
    }
    if (cli->save_dir != NULL && step + 1 == cli->save_at) {
      const char* where = NULL;
      CHECK(shardopt_save_checkpoint(opt, cli->save_dir, 2, &where)); /* collective */
      if (rank == 0) printf("saved %s after step %d\n", where, step);
    }
    if (rank == 0 && (step % 20 == 0 || step == cli->steps - 1))
      printf("step %4d  loss %.6f  grad_norm %.4f%s%s  lr %.2e\n", step, loss, r.grad_norm,
             r.clipped ? " (clipped)" : "", r.skipped ? " (skipped)" : "", lr);
  }

  {
    size_t bytes = 0, peak = 0;
    CHECK(shardopt_memory_usage(opt, SHARDOPT_MEM_TOTAL, &bytes, &peak));
    if (rank == 0) printf("rank 0 optimizer memory: %zu bytes (peak %zu)\n", bytes, peak);
  }
  if (rank == 0 && cli->loss_out != NULL) {
    FILE* f = fopen(cli->loss_out, "w");
    if (f == NULL) rc = 1;
    for (step = start; f != NULL && step < cli->steps; ++step) fprintf(f, "%d %.17g\n", step, losses[step]);
    if (f != NULL && fclose(f) != 0) rc = 1;
  }
  if (rank == 0 && cli->check_loss != NULL && start < cli->steps)
    rc |= check_loss(cli->check_loss, losses, start, cli->steps, cli->dtype);
  free(losses);
  if (cli->params_out != NULL) rc |= write_params(opt, cli->params_out, rank);
  return rc;
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
    if (cli.hidden_rule != -1) {
      /* Each Muon/Adafactor tensor updated whole by one rank; the automatic bucket size is
       * raised to the largest, which must fit one bucket. */
      cfg.ownership = SHARDOPT_OWNERSHIP_WHOLE;
      cfg.bucket_elems = 0;
    }
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
