// memory.hpp: per-category accounting of every buffer the library allocates, and the
// owning handle of one accounted allocation (host or device).
#pragma once

#include <array>
#include <cstddef>
#include <memory>
#include <span>

namespace shardopt {

enum class MemCategory : int { Params = 0, Grads = 1, Master = 2, Moments = 3, Scratch = 4 };
inline constexpr int kNumMemCategories = 5;
const char* mem_category_name(MemCategory c) noexcept;

struct MemoryReport {
  std::array<std::size_t, kNumMemCategories> bytes{};  ///< live bytes per category
  std::array<std::size_t, kNumMemCategories> peak{};   ///< high-water mark per category
  std::size_t operator[](MemCategory c) const { return bytes[static_cast<int>(c)]; }
  std::size_t total() const;
};

class MemoryTracker {
 public:
  void on_alloc(MemCategory c, std::size_t bytes);
  void on_free(MemCategory c, std::size_t bytes);
  const MemoryReport& report() const { return report_; }

 private:
  MemoryReport report_;
};

/// Owner of one accounted allocation; `release` frees it (std::free, cudaFree, ...).
class Allocation {
 public:
  using ReleaseFn = void (*)(void*) noexcept;
  Allocation() = default;
  Allocation(void* data, std::size_t bytes, ReleaseFn release, MemoryTracker* tracker,
             MemCategory category);
  /// Memory owned by `owner` (a window, a pool...): freed when the last reference drops.
  Allocation(void* data, std::size_t bytes, std::shared_ptr<void> owner, MemoryTracker* tracker,
             MemCategory category);
  Allocation(Allocation&& o) noexcept { swap(o); }
  Allocation& operator=(Allocation&& o) noexcept {
    Allocation tmp(static_cast<Allocation&&>(o));
    swap(tmp);
    return *this;
  }
  Allocation(const Allocation&) = delete;
  Allocation& operator=(const Allocation&) = delete;
  ~Allocation();

  void* data() const { return data_; }
  std::size_t bytes() const { return bytes_; }
  template <class T>
  T* as() const { return static_cast<T*>(data_); }

 private:
  void swap(Allocation& o) noexcept;
  void* data_ = nullptr;
  std::size_t bytes_ = 0;
  ReleaseFn release_ = nullptr;
  std::shared_ptr<void> owner_;
  MemoryTracker* tracker_ = nullptr;
  MemCategory category_ = MemCategory::Scratch;
};

/// A 64-byte aligned, zeroed host allocation (tracker may be null).
Allocation allocate_host(MemoryTracker* tracker, MemCategory category, std::size_t bytes);

}  // namespace shardopt
