// consumer_torch.cpp: a LibTorch program using the installed adapter (shardopt::torch) as its
// optimizer, one process: one step must move the weights, which stay views of the replica.
#include <shardopt/torch/optimizer.hpp>
#include <torch/torch.h>

#include <cstdio>

int main() {
  torch::manual_seed(0);
  torch::nn::Linear model(4, 3);
  shardopt::OptimizerOptions o;
  o.stage = shardopt::Stage::Zero2;
  shardopt::libtorch::ShardedAdamW opt(model->named_parameters(), torch::optim::AdamWOptions(0.1),
                                       shardopt::make_single_process_communicator(), o);
  const torch::Tensor before = model->weight.detach().clone();
  opt.zero_grad();
  model->forward(torch::ones({2, 4})).pow(2).sum().backward();
  opt.step();
  const bool moved = !torch::equal(before, model->weight.detach());
  const bool view = model->weight.data_ptr() == opt.core().param<float>(0).data();
  std::printf("consumer_torch: moved %d, view %d, norm %.4f\n", moved, view,
              opt.last_result().grad_norm);
  return moved && view ? 0 : 1;
}
