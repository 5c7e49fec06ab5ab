// omp_threads.hpp: a test's OpenMP thread count for one scope.
#pragma once

#if defined(_OPENMP)
#include <omp.h>
#endif

namespace shardopt::test {

/// Sets OpenMP's thread count while it lives and restores the count before it, also when an
/// ASSERT leaves the test early. A test that uses it links OpenMP (without, _OPENMP is not
/// defined in the test's own translation unit and this does nothing).
class OmpThreads {
 public:
  explicit OmpThreads(int threads) {
#if defined(_OPENMP)
    before_ = omp_get_max_threads();
    omp_set_num_threads(threads);
#else
    (void)threads;
#endif
  }
  ~OmpThreads() {
#if defined(_OPENMP)
    omp_set_num_threads(before_);
#endif
  }
  OmpThreads(const OmpThreads&) = delete;
  OmpThreads& operator=(const OmpThreads&) = delete;

 private:
  int before_ = 1;
};

}  // namespace shardopt::test
