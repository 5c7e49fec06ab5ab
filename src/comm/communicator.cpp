// communicator.cpp: what all communicators share.
#include "shardopt/comm.hpp"

#include <algorithm>
#include <cstring>

namespace shardopt {
namespace {

struct CallName {
  int depth = 0;
  char name[64] = {};
};
thread_local CallName call_name;

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

bool Communicator::reduce_scatter_combine(const void*, std::size_t, float*, std::size_t,
                                          BlockCombiner&) {
  return false;
}

void Communicator::all_reduce_int(void*, std::size_t, IntOp) {
  throw Error(Status::Unsupported,
              "all_reduce_int: the " + name() + " communicator has no integer reductions "
              "(reproducible mode needs a host communicator)");
}

CallScope::CallScope(std::string_view name) noexcept {
  if (call_name.depth++ > 0) return;
  const std::size_t n = std::min(name.size(), sizeof call_name.name - 1);
  std::memcpy(call_name.name, name.data(), n);
  call_name.name[n] = '\0';
}

CallScope::~CallScope() {
  if (--call_name.depth == 0) call_name.name[0] = '\0';
}

const char* CallScope::current() noexcept { return call_name.name; }

std::unique_ptr<CommRequest> completed_request() { return std::make_unique<CompletedRequest>(); }

}  // namespace shardopt
