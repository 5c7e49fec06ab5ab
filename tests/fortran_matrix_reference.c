/* fortran_matrix_reference.c: the C side of test_fortran_api's Muon and Adafactor checks. It
 * trains a rows x cols matrix with a whole-matrix rule through the C ABI, stored row-major as C programs store it (element (r, c)
 * at r * cols + c), and returns the master weights; the Fortran test trains the same matrix
 * declared w(cols, rows) and must get these bits. Values and gradients are small multiples of
 * powers of two, exact in both languages. */
#include <stddef.h>

#include "shardopt/shardopt.h"

/* The initial value and the gradient of element (r, c) at `step` (0-based indices). */
static float init_value(int r, int c) { return (float)((r * 7 + c * 3) % 11 - 5) / 8.0f; }
static float grad_value(int step, int r, int c) {
  return (float)((r * 5 + c * 11 + step * 3) % 13 - 6) / 16.0f;
}

/* Trains `steps` steps (whole ownership, fp32 replica, a group of `rule`, SHARDOPT_RULE_MUON
 * or SHARDOPT_RULE_ADAFACTOR, with its defaults) and writes the rows * cols master weights,
 * row-major, to out; for Adafactor also its factored statistics to row_var (rows floats) and
 * col_var (cols floats). Returns a shardopt_status_t. */
int shardopt_test_matrix_c(int rule, int rows, int cols, int steps, float* out, float* row_var,
                           float* col_var) {
  shardopt_optimizer_t opt = NULL;
  shardopt_config_t cfg;
  shardopt_group_t g;
  int group = -1, step, r, c;
  float values[64];
  size_t n = (size_t)rows * (size_t)cols;
  shardopt_status_t st;
  if (n > 64) return SHARDOPT_ERROR_INVALID_ARGUMENT;
  shardopt_config_init(&cfg);
  cfg.param_dtype = SHARDOPT_DTYPE_F32;
  cfg.ownership = SHARDOPT_OWNERSHIP_WHOLE;
  cfg.lr = 0.05;
  if ((st = shardopt_create(&opt, &cfg)) != SHARDOPT_SUCCESS) return st;
  shardopt_group_init(&g);
  g.rule = rule;
  if ((st = shardopt_add_group_ex(opt, &g, &group)) == SHARDOPT_SUCCESS)
    st = shardopt_add_param_2d(opt, "w", (size_t)rows, (size_t)cols, group, NULL);
  if (st == SHARDOPT_SUCCESS) st = shardopt_finalize(opt);
  for (r = 0; r < rows; ++r)
    for (c = 0; c < cols; ++c) values[r * cols + c] = init_value(r, c);
  if (st == SHARDOPT_SUCCESS) st = shardopt_set_param(opt, 0, values, n);
  for (step = 0; st == SHARDOPT_SUCCESS && step < steps; ++step) {
    for (r = 0; r < rows; ++r)
      for (c = 0; c < cols; ++c) values[r * cols + c] = grad_value(step, r, c);
    st = shardopt_accumulate_grad_f32(opt, 0, values, n);
    if (st == SHARDOPT_SUCCESS) st = shardopt_step(opt, NULL);
  }
  if (st == SHARDOPT_SUCCESS) st = shardopt_get_master(opt, 0, out, n);
  if (st == SHARDOPT_SUCCESS && rule == SHARDOPT_RULE_ADAFACTOR)
    st = shardopt_get_factored_state(opt, 0, row_var, (size_t)rows, col_var, (size_t)cols);
  shardopt_destroy(opt);
  return st;
}
