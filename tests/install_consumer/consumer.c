/* consumer.c: one AdamW step through the installed C header and library. */
#include <math.h>
#include <stdio.h>

#include <shardopt/shardopt.h>

int main(void) {
  shardopt_optimizer_t opt = NULL;
  shardopt_config_t cfg;
  const float init[2] = {1.0f, -1.0f};
  float grad[2] = {0.5f, -2.0f}, out[2] = {0, 0};
  int ok;
  if (shardopt_version() != SHARDOPT_VERSION_CODE) {
    fprintf(stderr, "header %s, library %s\n", SHARDOPT_VERSION_STRING, shardopt_version_string());
    return 1;
  }
  shardopt_config_init(&cfg);
  cfg.lr = 0.1;
  cfg.weight_decay = 0.0;
  ok = shardopt_create(&opt, &cfg) == SHARDOPT_SUCCESS &&
       shardopt_add_param(opt, "w", 2, 0, NULL) == SHARDOPT_SUCCESS &&
       shardopt_finalize(opt) == SHARDOPT_SUCCESS &&
       shardopt_set_param(opt, 0, init, 2) == SHARDOPT_SUCCESS &&
       shardopt_accumulate_grad_f32(opt, 0, grad, 2) == SHARDOPT_SUCCESS &&
       shardopt_step(opt, NULL) == SHARDOPT_SUCCESS &&
       shardopt_get_master(opt, 0, out, 2) == SHARDOPT_SUCCESS;
  if (!ok) fprintf(stderr, "consumer_c: %s\n", shardopt_last_error(opt));
  shardopt_destroy(opt);
  /* Adam's first step moves each weight by lr against the gradient's sign. */
  if (!ok || fabs(out[0] - 0.9) > 1e-6 || fabs(out[1] + 0.9) > 1e-6) {
    fprintf(stderr, "consumer_c: got %g %g, expected 0.9 -0.9\n", out[0], out[1]);
    return 1;
  }
  printf("consumer_c: shardopt %s works\n", shardopt_version_string());
  return 0;
}
