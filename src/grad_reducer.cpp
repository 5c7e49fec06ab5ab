// grad_reducer.cpp: bucketed, optionally overlapped gradient reduction.
#include "grad_reducer.hpp"

#include <algorithm>
#include <chrono>
#include <string>

namespace shardopt {
namespace {

// Adds the wall time of its scope to a counter.
class ScopedSeconds {
 public:
  explicit ScopedSeconds(double& sink) : sink_(sink) {}
  ~ScopedSeconds() {
    sink_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  }

 private:
  double& sink_;
  std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
};

}  // namespace

GradReducer::GradReducer(Communicator& comm, Backend& backend, MemoryTracker& tracker,
                         const FlatLayout& layout, Range owned, Config config,
                         const CollectiveAllocator& allocate_collective)
    : comm_(comm), backend_(backend), tracker_(tracker), layout_(layout), owned_(owned),
      cfg_(config) {
  buckets_ = layout_.make_buckets(cfg_.bucket_elems);
  bucket_of_param_.assign(layout_.num_params(), 0);
  for (std::size_t b = 0; b < buckets_.size(); ++b) {
    slot_capacity_ = std::max(slot_capacity_, buckets_[b].flat.size());
    for (std::size_t p = buckets_[b].first_param; p < buckets_[b].end_param; ++p)
      bucket_of_param_[p] = b;
    std::vector<std::size_t> counts;
    for (int r = 0; r < comm_.size(); ++r)
      counts.push_back(buckets_[b].flat.intersect(layout_.shard_range(r)).size());
    counts_.push_back(std::move(counts));
  }
  ready_in_bucket_.assign(buckets_.size(), 0);
  param_ready_.assign(layout_.num_params(), 0);
  if (cfg_.stage == Stage::Zero2) {
    const int slots = std::max(1, cfg_.slots);
    slots_ = allocate_collective(MemCategory::Scratch,
                                 static_cast<std::size_t>(slots) * slot_capacity_ * sizeof(float));
    shard_ = backend_.allocate(&tracker_, MemCategory::Grads, owned_.size() * sizeof(float));
    slot_of_bucket_.assign(buckets_.size(), -1);
    for (int s = slots - 1; s >= 0; --s) free_slots_.push_back(s);
  } else {
    full_ = allocate_collective(MemCategory::Grads, layout_.padded_size() * sizeof(float));
  }
}

GradReducer::~GradReducer() {
  for (InFlight& f : in_flight_) {
    try {
      f.request->wait();
    } catch (...) {  // nothing to report to from a destructor
    }
  }
}

void GradReducer::begin_backward(bool sync) {
  require(next_start_ == 0, Status::InvalidState,
          "begin_backward: gradients of this step were already reduced (a micro-batch with "
          "sync ran, or buckets were flushed); call step() first");
  if (!sync && cfg_.stage == Stage::Zero2 && accumulate_.data() == nullptr)
    accumulate_ = backend_.allocate(&tracker_, MemCategory::Grads,
                                    layout_.padded_size() * sizeof(float));
  ++micro_batches_;
  sync_ = sync;
  std::fill(ready_in_bucket_.begin(), ready_in_bucket_.end(), 0);
  std::fill(param_ready_.begin(), param_ready_.end(), 0);
}

void GradReducer::require_open(std::size_t b, std::size_t i) const {
  require(b >= next_start_, Status::InvalidState,
          "gradient of parameter '" + layout_.param(i).name +
              "': its bucket was already reduced in this step; gradients must be produced in "
              "backward order (reverse registration order), each bucket once per step");
}

std::span<float> GradReducer::grad(std::size_t i) {
  const ParamInfo& p = layout_.param(i);
  progress();
  if (cfg_.stage != Stage::Zero2) return {full_.as<float>() + p.flat.begin, p.numel};
  if (!sync_) return {accumulate_.as<float>() + p.flat.begin, p.numel};
  const std::size_t b = bucket_of_param_[i];
  require_open(b, i);
  start_through(b);  // earlier buckets are complete by the backward-order contract
  return {slot_for(b) + (p.flat.begin - buckets_[b].flat.begin), p.numel};
}

void GradReducer::grad_ready(std::size_t i) {
  const ParamInfo& p = layout_.param(i);
  require(param_ready_[i] == 0, Status::InvalidState,
          "grad_ready: parameter '" + p.name + "' was already marked ready in this micro-batch");
  if (!sync_) {
    param_ready_[i] = 1;
    return;
  }
  const std::size_t b = bucket_of_param_[i];
  require_open(b, i);
  param_ready_[i] = 1;
  ++ready_in_bucket_[b];
  if (cfg_.overlap || cfg_.stage == Stage::Zero2) {
    // Start complete buckets in bucket order only, so that every rank issues the same
    // sequence of collectives whatever order its parameters became ready in.
    std::size_t end = next_start_;
    while (end < buckets_.size() &&
           ready_in_bucket_[end] == buckets_[end].end_param - buckets_[end].first_param)
      ++end;
    start_through(end);
  }
  progress();
}

void GradReducer::start_through(std::size_t end) {
  while (next_start_ < end) start_bucket(next_start_);
}

void GradReducer::start_bucket(std::size_t b) {
  const Bucket& bk = buckets_[b];
  float* slot = cfg_.stage == Stage::Zero2 ? slot_for(b) : nullptr;
  auto start = [&]() -> std::unique_ptr<CommRequest> {
    const ScopedSeconds timed(blocked_seconds_);
    switch (cfg_.stage) {
      case Stage::DataParallel:
        return comm_.start_all_reduce_sum(full_.as<float>() + bk.flat.begin, bk.flat.size(),
                                          cfg_.wire);
      case Stage::Zero1:
        return comm_.start_reduce_scatter_sum(full_.as<float>() + bk.flat.begin, counts_[b],
                                              cfg_.wire);
      case Stage::Zero2:
        break;
    }
    return comm_.start_reduce_scatter_sum(slot, counts_[b], cfg_.wire);
  };
  in_flight_.push_back(InFlight{b, start()});
  next_start_ = b + 1;
  if (!cfg_.overlap) {
    while (!in_flight_.empty()) complete_oldest();
  }
}

void GradReducer::complete_oldest() {
  const ScopedSeconds timed(blocked_seconds_);
  InFlight f = std::move(in_flight_.front());
  in_flight_.pop_front();
  f.request->wait();
  if (cfg_.stage != Stage::Zero2) return;  // reduced in place, at the owned position
  const Bucket& bk = buckets_[f.bucket];
  const int s = slot_of_bucket_[f.bucket];
  float* slot = slots_.as<float>() + static_cast<std::size_t>(s) * slot_capacity_;
  const Range mine = bk.flat.intersect(owned_);
  if (!mine.empty())
    backend_.accumulate(shard_.as<float>() + (mine.begin - owned_.begin),
                        slot + (mine.begin - bk.flat.begin), DType::F32, mine.size());
  backend_.fill_zero(slot, bk.flat.size() * sizeof(float));
  slot_of_bucket_[f.bucket] = -1;
  free_slots_.push_back(s);
}

float* GradReducer::slot_for(std::size_t b) {
  if (slot_of_bucket_[b] < 0) {
    while (free_slots_.empty()) complete_oldest();
    slot_of_bucket_[b] = free_slots_.back();
    free_slots_.pop_back();
    float* slot = slots_.as<float>() + static_cast<std::size_t>(slot_of_bucket_[b]) * slot_capacity_;
    if (accumulate_.data() != nullptr) {
      // Earlier micro-batches accumulated this bucket locally: it joins the reduction.
      const Range r = buckets_[b].flat;
      backend_.accumulate(slot, accumulate_.as<float>() + r.begin, DType::F32, r.size());
      backend_.fill_zero(accumulate_.as<float>() + r.begin, r.size() * sizeof(float));
    }
  }
  return slots_.as<float>() + static_cast<std::size_t>(slot_of_bucket_[b]) * slot_capacity_;
}

void GradReducer::finish() {
  start_through(buckets_.size());
  while (!in_flight_.empty()) complete_oldest();
}

float* GradReducer::owned_grad() const {
  return cfg_.stage == Stage::Zero2 ? shard_.as<float>() : full_.as<float>() + owned_.begin;
}

void GradReducer::progress() {
  for (InFlight& f : in_flight_)
    if (!f.request->test()) break;
}

void GradReducer::zero() {
  while (!in_flight_.empty()) complete_oldest();
  if (cfg_.stage == Stage::Zero2) {
    backend_.fill_zero(shard_.data(), shard_.bytes());
    for (std::size_t b = 0; b < buckets_.size(); ++b) {
      if (slot_of_bucket_[b] < 0) continue;
      backend_.fill_zero(slots_.as<float>() + static_cast<std::size_t>(slot_of_bucket_[b]) * slot_capacity_,
                         buckets_[b].flat.size() * sizeof(float));
      free_slots_.push_back(slot_of_bucket_[b]);
      slot_of_bucket_[b] = -1;
    }
    if (accumulate_.data() != nullptr) backend_.fill_zero(accumulate_.data(), accumulate_.bytes());
  } else {
    backend_.fill_zero(full_.data(), full_.bytes());
  }
  next_start_ = 0;
  micro_batches_ = 0;
  sync_ = true;
  blocked_seconds_ = 0.0;
  std::fill(ready_in_bucket_.begin(), ready_in_bucket_.end(), 0);
  std::fill(param_ready_.begin(), param_ready_.end(), 0);
}

}  // namespace shardopt
