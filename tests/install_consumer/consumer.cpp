// consumer.cpp: one AdamW step through the installed C++ headers (and shardopt.h as C++).
#include <cmath>
#include <cstdio>
#include <vector>

#include <shardopt/optimizer.hpp>
#include <shardopt/shardopt.h>

int main() {
  try {
    shardopt::OptimizerOptions o;
    o.param_dtype = shardopt::DType::F32;
    o.adam.lr = 0.1;
    o.adam.weight_decay = 0.0;
    shardopt::ShardedOptimizer opt(shardopt::make_single_process_communicator(), o);
    opt.add_param("w", 2);
    opt.finalize();
    opt.set_param(0, std::vector<float>{1.0f, -1.0f});
    opt.accumulate_grad(0, std::vector<float>{0.5f, -2.0f});
    opt.step();
    std::vector<float> out(2);
    opt.get_master(0, out);
    if (std::fabs(out[0] - 0.9) > 1e-6 || std::fabs(out[1] + 0.9) > 1e-6) {
      std::fprintf(stderr, "consumer_cpp: got %g %g, expected 0.9 -0.9\n", out[0], out[1]);
      return 1;
    }
  } catch (const shardopt::Error& e) {
    std::fprintf(stderr, "consumer_cpp: %s\n", e.what());
    return 1;
  }
  std::printf("consumer_cpp: shardopt %s works\n", shardopt_version_string());
  return 0;
}
