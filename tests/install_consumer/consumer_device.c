/* consumer_device.c: asks for the CUDA backend from a program that does not link
 * libshardopt_cuda, and prints what happened: "unsupported" when the core cannot provide it
 * (built without CUDA, or libshardopt_cuda not loadable), "loaded" when the backend was
 * found (it then works, or reports that no GPU is usable). run.cmake checks the answer. */
#include <shardopt/shardopt.h>

#include <stdio.h>

int main(void) {
  shardopt_optimizer_t opt = NULL;
  shardopt_config_t cfg;
  shardopt_status_t s;
  shardopt_config_init(&cfg);
  cfg.device = SHARDOPT_DEVICE_CUDA;
  s = shardopt_create(&opt, &cfg);
  if (s == SHARDOPT_SUCCESS) s = shardopt_add_param(opt, "w", 2, 0, NULL);
  if (s == SHARDOPT_SUCCESS) s = shardopt_finalize(opt);
  printf("%s: %s\n", s == SHARDOPT_ERROR_UNSUPPORTED ? "unsupported" : "loaded",
         s == SHARDOPT_SUCCESS ? "ok" : shardopt_last_error(opt));
  shardopt_destroy(opt);
  return 0;
}
