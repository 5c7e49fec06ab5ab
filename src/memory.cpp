// memory.cpp: accounting and aligned host allocations.
#include "shardopt/memory.hpp"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>

#include "backend.hpp"  // set_allocation_test_hook
#include "shardopt/error.hpp"

namespace shardopt {

const char* mem_category_name(MemCategory c) noexcept {
  switch (c) {
    case MemCategory::Params: return "params";
    case MemCategory::Grads: return "grads";
    case MemCategory::Master: return "master";
    case MemCategory::Moments: return "moments";
    case MemCategory::Scratch: return "scratch";
  }
  return "?";
}

std::size_t MemoryReport::total() const {
  std::size_t t = 0;
  for (std::size_t b : bytes) t += b;
  return t;
}

void MemoryTracker::on_alloc(MemCategory c, std::size_t bytes) {
  const int i = static_cast<int>(c);
  report_.bytes[i] += bytes;
  report_.peak[i] = std::max(report_.peak[i], report_.bytes[i]);
}

void MemoryTracker::on_free(MemCategory c, std::size_t bytes) {
  report_.bytes[static_cast<int>(c)] -= bytes;
}

Allocation::Allocation(void* data, std::size_t bytes, ReleaseFn release, MemoryTracker* tracker,
                       MemCategory category)
    : data_(data), bytes_(bytes), release_(release), tracker_(tracker), category_(category) {
  if (tracker_ && data_) tracker_->on_alloc(category_, bytes_);
}

Allocation::Allocation(void* data, std::size_t bytes, std::shared_ptr<void> owner,
                       MemoryTracker* tracker, MemCategory category)
    : data_(data), bytes_(bytes), owner_(std::move(owner)), tracker_(tracker),
      category_(category) {
  if (tracker_ && data_) tracker_->on_alloc(category_, bytes_);
}

Allocation::~Allocation() {
  if (data_ == nullptr) return;
  if (release_) release_(data_);
  owner_.reset();
  if (tracker_) tracker_->on_free(category_, bytes_);
}

void Allocation::swap(Allocation& o) noexcept {
  std::swap(data_, o.data_);
  std::swap(bytes_, o.bytes_);
  std::swap(release_, o.release_);
  std::swap(owner_, o.owner_);
  std::swap(tracker_, o.tracker_);
  std::swap(category_, o.category_);
}

namespace {
std::atomic<AllocationTestHook> g_allocation_test_hook{nullptr};
}  // namespace

void set_allocation_test_hook(AllocationTestHook hook) { g_allocation_test_hook = hook; }

Allocation allocate_host(MemoryTracker* tracker, MemCategory category, std::size_t bytes) {
  if (bytes == 0) return Allocation{};
  constexpr std::size_t kAlign = 64;
  const std::size_t rounded = (bytes + kAlign - 1) / kAlign * kAlign;
  const AllocationTestHook hook = g_allocation_test_hook.load(std::memory_order_relaxed);
  void* p = hook != nullptr && hook(category, bytes) ? nullptr : std::aligned_alloc(kAlign, rounded);
  if (p == nullptr)
    throw Error(Status::OutOfMemory, "cannot allocate " + std::to_string(bytes) +
                                         " bytes of host memory for " +
                                         mem_category_name(category));
  std::memset(p, 0, rounded);
  return Allocation(p, bytes, [](void* q) noexcept { std::free(q); }, tracker, category);
}

}  // namespace shardopt
