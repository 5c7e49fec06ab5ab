// step_check.hpp: step()'s cross-rank check, folded into the all-reduce of the gradient norm:
// every rank must step with the same hyperparameters, group settings, micro-batch count (in
// reproducible mode: the same total over the ranks, which every rank computed), step count
// and loss scaling state. Internal.
#pragma once

#include <cstdint>
#include <vector>

#include "shardopt/comm.hpp"
#include "shardopt/optimizer.hpp"

namespace shardopt {

/// What every rank must hold alike when it steps.
struct StepSettings {
  AdamConfig adam;
  std::vector<GroupOptions> groups;
  LossScaling loss_scaling;
  int micro_batches = 1;
  std::int64_t step = 0;
  LossScaleState loss_scale;
};

/// Collective: sums this rank's `sumsq` over all ranks in one all-reduce (of 10 doubles) that
/// also carries whether this rank's local part of the step failed (`local`) and a fingerprint
/// of `mine`. Returns the global sum of squares when every rank succeeded with the same
/// settings. Otherwise every rank throws the same Error: the ranks' failures as agree()
/// combines them, or, when the settings differ, Error(InvalidArgument) naming each setting
/// that differs and its value on each rank (found by one more all-gather, on this rare path).
double sum_over_ranks_checked(Communicator& comm, double sumsq, const LocalOutcome& local,
                              const StepSettings& mine);

}  // namespace shardopt
