/* test_c_header.c: shardopt.h is pure C. Built as C99 with -pedantic -Werror (twice: once
 * linked and run, once without the library's compile definitions, i.e. without <mpi.h>),
 * it trains a 3-element parameter for one step through the ABI and checks the result, then a
 * 2 x 3 Muon matrix (whole ownership, shardopt_add_param_2d), then a 2 x 3 Adafactor matrix
 * and its factored statistics. */
#include "shardopt/shardopt.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

#define EXPECT(cond)                                                   \
  do {                                                                 \
    if (!(cond)) {                                                     \
      fprintf(stderr, "%s:%d: failed: %s\n", __FILE__, __LINE__, #cond); \
      return 1;                                                        \
    }                                                                  \
  } while (0)

int main(void) {
  shardopt_optimizer_t opt = NULL;
  shardopt_config_t cfg;
  shardopt_step_result_t r;
  const float init[3] = {1.0f, 2.0f, 3.0f};
  const float* p = NULL;
  float* g = NULL;
  size_t index = 99, n = 0;

  EXPECT(shardopt_version() == SHARDOPT_VERSION_CODE);
  EXPECT(strcmp(shardopt_version_string(), SHARDOPT_VERSION_STRING) == 0);
  EXPECT(shardopt_config_init(&cfg) == SHARDOPT_SUCCESS);
  cfg.param_dtype = SHARDOPT_DTYPE_F32;
  cfg.lr = 0.1;
  cfg.weight_decay = 0.0;
  EXPECT(shardopt_create(&opt, &cfg) == SHARDOPT_SUCCESS);
  EXPECT(shardopt_add_param(opt, "w", 3, 0, &index) == SHARDOPT_SUCCESS && index == 0);
  EXPECT(shardopt_step_result_init(&r) == SHARDOPT_SUCCESS && r.struct_size == sizeof r);
  EXPECT(shardopt_step(opt, &r) == SHARDOPT_ERROR_INVALID_STATE);
  EXPECT(strstr(shardopt_last_error(opt), "shardopt_step") != NULL);
  EXPECT(shardopt_finalize(opt) == SHARDOPT_SUCCESS);
  EXPECT(shardopt_set_param(opt, 0, init, 3) == SHARDOPT_SUCCESS);
  EXPECT(shardopt_grad(opt, 0, &g, &n) == SHARDOPT_SUCCESS && n == 3);
  g[0] = 0.5f;
  g[1] = -0.25f;
  g[2] = 0.0f;
  EXPECT(shardopt_step(opt, &r) == SHARDOPT_SUCCESS && r.step == 1 && !r.skipped);
  EXPECT(shardopt_param_f32(opt, 0, &p, &n) == SHARDOPT_SUCCESS && n == 3);
  /* Adam's first step moves each weight by lr * sign(gradient). */
  EXPECT(fabs(p[0] - 0.9) < 1e-6 && fabs(p[1] - 2.1) < 1e-6 && p[2] == 3.0f);
  EXPECT(shardopt_destroy(opt) == SHARDOPT_SUCCESS);
  EXPECT(shardopt_finalize(opt) == SHARDOPT_ERROR_INVALID_ARGUMENT);
  {
    /* Muon (C99): whole ownership, a Muon group, a 2-D parameter; one step moves every
     * element (the orthogonalised update of a rank-1 gradient is dense). */
    shardopt_group_t mg;
    int g = -1;
    size_t rows = 0, cols = 0, k;
    float grad[6] = {1.0f, 2.0f, 3.0f, -1.0f, -2.0f, -3.0f};
    EXPECT(shardopt_config_init(&cfg) == SHARDOPT_SUCCESS);
    cfg.param_dtype = SHARDOPT_DTYPE_F32;
    cfg.ownership = SHARDOPT_OWNERSHIP_WHOLE;
    cfg.weight_decay = 0.0;
    EXPECT(shardopt_create(&opt, &cfg) == SHARDOPT_SUCCESS);
    shardopt_group_init(&mg);
    mg.rule = SHARDOPT_RULE_MUON;
    mg.muon_lr_adjust = SHARDOPT_MUON_LR_NONE;
    EXPECT(shardopt_add_group_ex(opt, &mg, &g) == SHARDOPT_SUCCESS && g == 1);
    EXPECT(shardopt_add_param_2d(opt, "m", 2, 3, g, &index) == SHARDOPT_SUCCESS && index == 0);
    EXPECT(shardopt_finalize(opt) == SHARDOPT_SUCCESS);
    EXPECT(shardopt_param_shape(opt, 0, &rows, &cols) == SHARDOPT_SUCCESS);
    EXPECT(rows == 2 && cols == 3);
    EXPECT(shardopt_accumulate_grad_f32(opt, 0, grad, 6) == SHARDOPT_SUCCESS);
    EXPECT(shardopt_step(opt, NULL) == SHARDOPT_SUCCESS);
    EXPECT(shardopt_param_f32(opt, 0, &p, &n) == SHARDOPT_SUCCESS && n == 6);
    for (k = 0; k < 6; ++k) EXPECT(p[k] != 0.0f && (p[k] < 0) == (grad[k] > 0));
    EXPECT(shardopt_destroy(opt) == SHARDOPT_SUCCESS);
  }
  {
    /* Adafactor (C99): whole ownership, an Adafactor group, a 2-D parameter from zero. The
     * gradient's rows have equal mean squares, so the factored v is exactly g^2, u = sign(g),
     * RMS(u) = 1 (no clipping) and, with RMS(p) = 0, the step is lr * eps2 * sign(g). */
    shardopt_group_t ag;
    int g = -1;
    size_t k;
    float row_var[2], col_var[3];
    const float grad[6] = {1.0f, 2.0f, 3.0f, -1.0f, -2.0f, -3.0f};
    EXPECT(shardopt_config_init(&cfg) == SHARDOPT_SUCCESS);
    cfg.param_dtype = SHARDOPT_DTYPE_F32;
    cfg.ownership = SHARDOPT_OWNERSHIP_WHOLE;
    cfg.lr = 0.1;
    cfg.weight_decay = 0.0;
    cfg.max_grad_norm = 0.0;
    EXPECT(shardopt_create(&opt, &cfg) == SHARDOPT_SUCCESS);
    shardopt_group_init(&ag);
    ag.rule = SHARDOPT_RULE_ADAFACTOR;
    ag.adafactor_eps2 = 1e-3;
    EXPECT(shardopt_add_group_ex(opt, &ag, &g) == SHARDOPT_SUCCESS && g == 1);
    EXPECT(shardopt_add_param_2d(opt, "a", 2, 3, g, &index) == SHARDOPT_SUCCESS && index == 0);
    EXPECT(shardopt_finalize(opt) == SHARDOPT_SUCCESS);
    EXPECT(shardopt_accumulate_grad_f32(opt, 0, grad, 6) == SHARDOPT_SUCCESS);
    EXPECT(shardopt_step(opt, NULL) == SHARDOPT_SUCCESS);
    EXPECT(shardopt_param_f32(opt, 0, &p, &n) == SHARDOPT_SUCCESS && n == 6);
    for (k = 0; k < 6; ++k) EXPECT(fabs(p[k] + (grad[k] > 0 ? 1e-4 : -1e-4)) < 1e-10);
    EXPECT(shardopt_get_factored_state(opt, 0, row_var, 2, col_var, 3) == SHARDOPT_SUCCESS);
    /* torch squares a norm: the means of g^2 to rounding. */
    EXPECT(fabs(row_var[0] - 14.0 / 3) < 1e-5 && row_var[1] == row_var[0]);
    EXPECT(fabs(col_var[0] - 1) < 1e-6 && fabs(col_var[1] - 4) < 1e-5 && fabs(col_var[2] - 9) < 1e-5);
    EXPECT(shardopt_destroy(opt) == SHARDOPT_SUCCESS);
  }
  printf("C header: version %s, one AdamW, one Muon and one Adafactor step as expected\n",
         shardopt_version_string());
  return 0;
}
