// units.cpp: stage 3's pool of gathered units.
#include "units.hpp"

#include <algorithm>
#include <span>
#include <string>

#include "buckets.hpp"

namespace shardopt {

UnitSet::UnitSet(Communicator& comm, Backend& backend, const FlatLayout& layout,
                 const BufferPlan& plan, DType param_dtype,
                 Allocation pool, const void* replica, std::size_t batch)
    : comm_(comm), backend_(backend), layout_(layout), plan_(plan), dtype_(param_dtype),
      batch_(std::max<std::size_t>(batch, 1)), replica_(static_cast<const char*>(replica)),
      pool_(std::move(pool)) {
  for (int b = plan_.unit_buffers - 1; b >= 0; --b) free_buffers_.push_back(b);
  state_.resize(layout_.num_units());
}

UnitSet::~UnitSet() {
  for (State& s : state_)
    for (auto& r : s.gathers) {
      try {
        r->wait();
      } catch (...) {  // nothing to report to from a destructor
      }
    }
}

void UnitSet::require_unit(std::size_t u, const char* what) const {
  require(u < state_.size(), Status::InvalidArgument,
          std::string(what) + ": unit " + std::to_string(u) + " out of range (have " +
              std::to_string(state_.size()) + ")");
}

void UnitSet::check_prefetch(std::size_t u) const {
  require_unit(u, "prefetch");
  require(state_[u].hold != Hold::None || !free_buffers_.empty(), Status::InvalidState,
          "prefetch/acquire of unit " + std::to_string(u) + ": all " +
              std::to_string(plan_.unit_buffers) +
              " unit buffers are held (units_in_flight); release a unit first");
}

void UnitSet::check_acquire(std::size_t u) const {
  require_unit(u, "acquire");
  require(state_[u].hold != Hold::Acquired, Status::InvalidState,
          "acquire: unit " + std::to_string(u) + " is already acquired; release it first");
  check_prefetch(u);
}

void UnitSet::prefetch(std::size_t u) {
  check_prefetch(u);
  State& s = state_[u];
  if (s.hold != Hold::None) return;
  s.buffer = free_buffers_.back();
  free_buffers_.pop_back();
  s.hold = Hold::Prefetched;
  const Unit& unit = layout_.unit(u);
  const std::size_t elem = dtype_size(dtype_);
  char* buf = pool_.as<char>() + static_cast<std::size_t>(s.buffer) * plan_.unit_elems * elem;
  const CommType type = dtype_ == DType::F32 ? CommType::F32 : CommType::U16;
  const int rank = comm_.rank();
  std::vector<BatchedCollective> ops;
  for (std::size_t b = unit.buckets.begin; b < unit.buckets.end; ++b) {
    const Bucket& bk = layout_.bucket(b);
    char* bucket = buf + (bk.flat.begin - unit.flat.begin) * elem;
    // This rank's slice (Whole ownership: its ragged range, possibly empty) from the local
    // replica into its place in the bucket, then the bucket's (uneven) all-gather.
    if (const std::size_t mine = bk.slice_size(rank); mine > 0)
      backend_.copy(bucket + (bk.slice(rank).begin - bk.flat.begin) * elem,
                    replica_ + bk.local_begin_of(rank) * elem, mine * elem);
    ops.push_back(bucket_gather(bk, bucket, type));
  }
  // The unit's buckets in batches of batch_ (every rank gathers the same unit here: the
  // prefetch and acquire calls are agreed, see units.hpp), in bucket order.
  for (std::size_t at = 0; at < ops.size(); at += batch_) {
    const std::span<const BatchedCollective> group(ops.data() + at,
                                                   std::min(batch_, ops.size() - at));
    for (auto& r : comm_.start_batch(group)) s.gathers.push_back(std::move(r));
  }
}

void UnitSet::wait(State& s) {
  for (auto& r : s.gathers) r->wait();
  s.gathers.clear();
}

void UnitSet::acquire(std::size_t u) {
  check_acquire(u);
  State& s = state_[u];
  prefetch(u);
  wait(s);
  s.hold = Hold::Acquired;
}

void UnitSet::release(std::size_t u) {
  require_unit(u, "release");
  State& s = state_[u];
  require(s.hold == Hold::Acquired, Status::InvalidState,
          "release: unit " + std::to_string(u) + " is not acquired");
  free_buffers_.push_back(s.buffer);
  s.buffer = -1;
  s.hold = Hold::None;
}

void* UnitSet::param_data(std::size_t i) const {
  const ParamInfo& p = layout_.param(i);
  const State& s = state_[static_cast<std::size_t>(p.unit)];
  require(s.hold == Hold::Acquired, Status::InvalidState,
          "param: parameter '" + p.name + "' is in unit " + std::to_string(p.unit) +
              ", which is not acquired (stage 3 gathers parameters per unit: acquire it)");
  const Unit& unit = layout_.unit(static_cast<std::size_t>(p.unit));
  const std::size_t elem = dtype_size(dtype_);
  return pool_.as<char>() +
         (static_cast<std::size_t>(s.buffer) * plan_.unit_elems + p.flat.begin - unit.flat.begin) *
             elem;
}

std::size_t UnitSet::held() const {
  std::size_t n = 0;
  for (const State& s : state_) n += s.hold != Hold::None;
  return n;
}

void UnitSet::progress() {
  for (State& s : state_) {
    if (s.gathers.empty()) continue;
    bool done = true;
    for (auto& r : s.gathers) done = r->test() && done;
    if (done) s.gathers.clear();
  }
}

}  // namespace shardopt
