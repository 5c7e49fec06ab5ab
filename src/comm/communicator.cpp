// communicator.cpp: what all communicators share.
#include "shardopt/comm.hpp"

namespace shardopt {
namespace {

class CompletedRequest final : public CommRequest {
 public:
  bool test() override { return true; }
  void wait() override {}
};

}  // namespace

void Communicator::reduce_scatter_int(void*, std::size_t, IntOp) {
  throw Error(Status::Unsupported,
              "reduce_scatter_int: the " + name() + " communicator has no integer reductions "
              "(reproducible mode needs a host communicator)");
}

void Communicator::all_reduce_int(void*, std::size_t, IntOp) {
  throw Error(Status::Unsupported,
              "all_reduce_int: the " + name() + " communicator has no integer reductions "
              "(reproducible mode needs a host communicator)");
}

std::unique_ptr<CommRequest> completed_request() { return std::make_unique<CompletedRequest>(); }

}  // namespace shardopt
