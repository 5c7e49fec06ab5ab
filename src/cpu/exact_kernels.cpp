// exact_kernels.cpp: reproducible mode's exact arithmetic on the CPU (kernels.hpp): the
// integer sum of squares, the one rounding of an exact sum, the portable references of the
// combines and deposits, and their threading. The SIMD versions live in kernels_avx2.cpp and
// kernels_avx512.cpp and return the same bits (test_exact_kernels.cpp compares every path
// with an independent oracle and with exact_sum.cpp's accumulator).
#include <algorithm>
#include <bit>
#include <cstdint>
#include <limits>
#include <vector>

#include "../exact_element.hpp"
#include "kernel_table.hpp"
#include "kernels.hpp"

namespace shardopt::cpu {

static_assert(exact_grid_exponent(0) == -150 && exact_grid_exponent(23) == -150 &&
                  exact_grid_exponent(24) == -126 && exact_grid_exponent(254) == 90,
              "levels of 24 exponents, level 1's grid at 2^-150");

// ---- SquareDigits -------------------------------------------------------------------------

void SquareDigits::add(float v) {
  static_assert(kBase == exact::elem::kDigitBase, "the shared digit decomposition");
  exact::elem::SquareParts p;
  switch (exact::elem::square_parts(v, p)) {
    case 0: return;
    case 2: infs += 1; return;
    case 3: nans += 1; return;
    default: break;
  }
  digit[p.at] += p.d0;
  digit[p.at + 1] += p.d1;
  digit[p.at + 2] += p.d2;
  if (++pending == (std::uint64_t{1} << 29)) normalize();  // digits stay below 2^63
}

void SquareDigits::add_scaled(std::uint64_t value, int exp2) {
  if (value == 0) return;
  const int s = exp2 - kBase;
  const auto at = static_cast<std::size_t>(s / 32);
  const int o = s % 32;
  // value * 2^o (up to 94 bits) as three digits below 2^32 each.
  const std::uint64_t lo = value << o;
  const std::uint64_t hi = o == 0 ? 0 : value >> (64 - o);  // < 2^30
  digit[at] += lo & 0xffffffffu;
  digit[at + 1] += lo >> 32;
  digit[at + 2] += hi;
  if (++pending == (std::uint64_t{1} << 29)) normalize();
}

void SquareDigits::normalize() {
  std::uint64_t carry = 0;
  for (std::uint64_t& d : digit) {
    const std::uint64_t v = d + carry;
    d = v & 0xffffffffu;
    carry = v >> 32;
  }
  digit.back() += carry << 32;  // never reached by fp32 squares
  pending = 0;
}

void SquareDigits::merge(SquareDigits& other) {
  normalize();
  other.normalize();
  for (std::size_t i = 0; i < digit.size(); ++i) digit[i] += other.digit[i];
  nans += other.nans;
  infs += other.infs;
  normalize();
}

using exact::elem::pow2;
using exact::elem::round_to_integer;

float exact_to_float(std::int64_t n, int e) { return exact::elem::to_float(n, e); }

// ---- the portable range kernels (the reference) --------------------------------------------

namespace portable {

// Rank r's element i, for the element functions of exact_element.hpp.
template <class T>
struct RankValue {
  const T* const* src;
  std::size_t i;
  T operator()(int r) const { return src[r][i]; }
};

void exact_combine_tail(const float* const* src, int ranks, float* dst, std::size_t from, std::size_t n) {
  for (std::size_t i = from; i < n; ++i) dst[i] = exact::elem::combine_raw(RankValue<float>{src, i}, ranks);
}

void exact_combine(const float* const* src, int ranks, float* dst, std::size_t n) {
  exact_combine_tail(src, ranks, dst, 0, n);
}

void exact_square_add(const float* x, std::size_t n, SquareDigits& squares) {
  for (std::size_t i = 0; i < n; ++i) squares.add(x[i]);
}

void exact_combine_packed_tail(const std::uint64_t* const* src, int ranks, float* dst, std::size_t from,
                               std::size_t n) {
  for (std::size_t i = from; i < n; ++i)
    dst[i] = exact::elem::combine_packed(RankValue<std::uint64_t>{src, i}, ranks);
}

void exact_combine_packed(const std::uint64_t* const* src, int ranks, float* dst, std::size_t n) {
  exact_combine_packed_tail(src, ranks, dst, 0, n);
}

void exact_combine_packed_raw_tail(const std::uint64_t* const* words, const float* const* last, int ranks,
                                   float* dst, std::size_t from, std::size_t n) {
  for (std::size_t i = from; i < n; ++i)
    dst[i] = exact::elem::combine_packed_raw(RankValue<std::uint64_t>{words, i}, RankValue<float>{last, i}, ranks);
}

void exact_combine_packed_raw(const std::uint64_t* const* words, const float* const* last, int ranks,
                              float* dst, std::size_t n) {
  exact_combine_packed_raw_tail(words, last, ranks, dst, 0, n);
}

using exact::elem::pack;
using exact::elem::unpack;

void exact_deposit(const float* g, std::size_t n, std::int64_t* top, std::int64_t* low,
                   std::uint8_t* level) {
  for (std::size_t j = 0; j < n; ++j) exact::elem::deposit(g[j], top[j], low[j], level[j]);
}

void exact_deposit_packed(const float* g, std::size_t n, const std::uint64_t* in, std::uint64_t* out) {
  for (std::size_t j = 0; j < n; ++j) {
    std::uint8_t l = 0;
    std::int64_t t = 0, lo = 0;
    if (in != nullptr) unpack(in[j], l, t, lo);
    exact::elem::deposit(g[j], t, lo, l);
    out[j] = pack(l, t, lo);
  }
}

void exact_deposit_pack(const float* g, std::size_t n, const std::int64_t* top,
                        const std::int64_t* low, const std::uint8_t* level, std::uint64_t* out) {
  for (std::size_t j = 0; j < n; ++j) {
    std::int64_t t = top[j], lo = low[j];
    std::uint8_t l = level[j];
    exact::elem::deposit(g[j], t, lo, l);
    out[j] = pack(l, t, lo);
  }
}

// ---- the two-phase method's passes (exact::ExactGrads::reduce) ----

void exact_levels(const float* g, std::size_t n, std::uint8_t* level) {
  for (std::size_t j = 0; j < n; ++j) level[j] = exact::elem::level_of(g[j]);
}

void exact_round_to_levels(const float* g, std::size_t n, const std::uint8_t* level, std::int64_t* out) {
  for (std::size_t j = 0; j < n; ++j) out[j] = exact::elem::round_to_level(g[j], level[j]);
}

void exact_lift(const std::uint8_t* mine, const std::uint8_t* level, std::int64_t* top,
                const std::int64_t* low, std::size_t n) {
  for (std::size_t j = 0; j < n; ++j) top[j] = exact::elem::lift(mine[j], level[j], top[j], low[j]);
}

void exact_sums_to_float(const std::int64_t* sum, const std::uint8_t* level, float* dst, std::size_t n) {
  for (std::size_t j = 0; j < n; ++j) dst[j] = exact::elem::sum_to_float(sum[j], level[j]);
}

std::uint32_t max_exponent_field(const std::uint32_t* lanes, int nlanes, const float* x, std::size_t n) {
  std::uint32_t e = 0;
  for (int k = 0; k < nlanes; ++k) e = std::max(e, lanes[k]);
  for (std::size_t i = 0; i < n; ++i) e = std::max(e, (std::bit_cast<std::uint32_t>(x[i]) >> 23) & 0xffu);
  return e;
}

}  // namespace portable

// ---- threading -----------------------------------------------------------------------------

namespace {

// Elements per OpenMP work item (a multiple of kExactChunk, so the SIMD windows do not
// depend on the thread count; the digits do not either: they are integers).
constexpr std::size_t kExactGrain = kExactChunk * 16;

// The threading of the combines: fixed chunks of kExactGrain, each a window of kExactChunk
// at a time; window(w, len, scratch) writes dst[w, w + len) (`scratch`: the thread's own,
// default-constructed), and its results are still in cache when their squares are taken; every
// thread's squares join `squares` (integers: any split gives the same sum).
template <class Scratch, class Window>
void combine_windows(float* dst, std::size_t n, SquareDigits* squares, const Window& window) {
  const RangeKernels& k = active_kernels();
  const std::ptrdiff_t items = static_cast<std::ptrdiff_t>((n + kExactGrain - 1) / kExactGrain);
#pragma omp parallel if (items > 1)
  {
    SquareDigits part;
    Scratch scratch;
#pragma omp for schedule(static)
    for (std::ptrdiff_t c = 0; c < items; ++c) {
      const std::size_t b = static_cast<std::size_t>(c) * kExactGrain;
      const std::size_t e = std::min(b + kExactGrain, n);
      for (std::size_t w = b; w < e; w += kExactChunk) {
        const std::size_t len = std::min(kExactChunk, e - w);
        window(w, len, scratch);
        if (squares != nullptr) k.exact_square_add(dst + w, len, part);
      }
    }
    if (squares != nullptr) {
#pragma omp critical(shardopt_exact_squares)
      squares->merge(part);
    }
  }
}

template <class T>
void combine_threaded(void (*kernel)(const T* const*, int, float*, std::size_t), const T* const* src,
                      int ranks, float* dst, std::size_t n, SquareDigits* squares) {
  combine_windows<std::vector<const T*>>(dst, n, squares, [&](std::size_t w, std::size_t len, std::vector<const T*>& at) {
    at.resize(static_cast<std::size_t>(ranks));
    for (int r = 0; r < ranks; ++r) at[static_cast<std::size_t>(r)] = src[r] + w;
    kernel(at.data(), ranks, dst + w, len);
  });
}

// The threading of the elementwise exact kernels: body(b, len) on fixed chunks of kExactGrain.
template <class Body>
void for_grains(std::size_t n, const Body& body) {
  const std::ptrdiff_t items = static_cast<std::ptrdiff_t>((n + kExactGrain - 1) / kExactGrain);
#pragma omp parallel for schedule(static) if (items > 1)
  for (std::ptrdiff_t c = 0; c < items; ++c) {
    const std::size_t b = static_cast<std::size_t>(c) * kExactGrain;
    body(b, std::min(kExactGrain, n - b));
  }
}

}  // namespace


void exact_combine(const float* const* src, int ranks, float* dst, std::size_t n,
                   SquareDigits* squares) {
  combine_threaded(active_kernels().exact_combine, src, ranks, dst, n, squares);
}

void exact_deposit(const float* g, std::size_t n, std::int64_t* top, std::int64_t* low,
                   std::uint8_t* level) {
  const RangeKernels& k = active_kernels();
  for_grains(n, [&](std::size_t b, std::size_t len) { k.exact_deposit(g + b, len, top + b, low + b, level + b); });
}

void exact_deposit_pack(const float* g, std::size_t n, const std::int64_t* top,
                        const std::int64_t* low, const std::uint8_t* level, std::uint64_t* out) {
  const RangeKernels& k = active_kernels();
  for_grains(n, [&](std::size_t b, std::size_t len) {
    k.exact_deposit_pack(g + b, len, top + b, low + b, level + b, out + b);
  });
}

void exact_levels(const float* g, std::size_t n, std::uint8_t* level) {
  const RangeKernels& k = active_kernels();
  for_grains(n, [&](std::size_t b, std::size_t len) { k.exact_levels(g + b, len, level + b); });
}

void exact_round_to_levels(const float* g, std::size_t n, const std::uint8_t* level, std::int64_t* out) {
  const RangeKernels& k = active_kernels();
  for_grains(n, [&](std::size_t b, std::size_t len) { k.exact_round_to_levels(g + b, len, level + b, out + b); });
}

void exact_lift(const std::uint8_t* mine, const std::uint8_t* level, std::int64_t* top,
                const std::int64_t* low, std::size_t n) {
  const RangeKernels& k = active_kernels();
  for_grains(n, [&](std::size_t b, std::size_t len) { k.exact_lift(mine + b, level + b, top + b, low + b, len); });
}

void exact_sums_to_float(const std::int64_t* sum, const std::uint8_t* level, float* dst, std::size_t n) {
  const RangeKernels& k = active_kernels();
  for_grains(n, [&](std::size_t b, std::size_t len) { k.exact_sums_to_float(sum + b, level + b, dst + b, len); });
}

void exact_pack(const std::uint8_t* level, const std::int64_t* top, const std::int64_t* low,
                std::uint64_t* out, std::size_t n) {
  const std::ptrdiff_t count = static_cast<std::ptrdiff_t>(n);
#pragma omp parallel for schedule(static) if (count > std::ptrdiff_t{1} << 16)
  for (std::ptrdiff_t i = 0; i < count; ++i) {
    out[i] = exact::elem::pack(level[i], top[i], low[i]);
  }
}

namespace {

// Both packed deposits. clear (g itself, or null): each grain of g (256 KiB) is set to +0
// right after the kernel has read it, while its lines are still in cache, instead of a second
// pass over the whole buffer.
void deposit_packed_threaded(const float* g, std::size_t n, const std::uint64_t* in, std::uint64_t* out,
                             float* clear) {
  const RangeKernels& k = active_kernels();
  for_grains(n, [&](std::size_t b, std::size_t len) {
    k.exact_deposit_packed(g + b, len, in == nullptr ? nullptr : in + b, out + b);
    if (clear != nullptr) k.fill_zero(clear + b, len, false);
  });
}

}  // namespace

void exact_deposit_packed(const float* g, std::size_t n, const std::uint64_t* in, std::uint64_t* out) {
  deposit_packed_threaded(g, n, in, out, nullptr);
}

void exact_deposit_packed_clear(float* g, std::size_t n, const std::uint64_t* in, std::uint64_t* out) {
  deposit_packed_threaded(g, n, in, out, g);
}

void exact_deposit_packed_multi(const float* const* g, int nsrc, std::size_t n, const std::uint64_t* in,
                                std::uint64_t* out) {
  if (nsrc < 1) {  // nothing deposited: the words as they were (empty without `in`)
    if (in == nullptr) std::fill(out, out + n, std::uint64_t{0});
    else if (in != out) std::copy(in, in + n, out);
    return;
  }
  const RangeKernels& k = active_kernels();
  for_grains(n, [&](std::size_t b, std::size_t len) {
    const std::uint64_t* from = in == nullptr ? nullptr : in + b;
    if (k.exact_deposit_packed_multi != nullptr) {
      std::vector<const float*> at(static_cast<std::size_t>(nsrc));
      for (int s = 0; s < nsrc; ++s) at[static_cast<std::size_t>(s)] = g[s] + b;
      k.exact_deposit_packed_multi(at.data(), nsrc, len, from, out + b);
      return;
    }
    for (int s = 0; s < nsrc; ++s) k.exact_deposit_packed(g[s] + b, len, s == 0 ? from : out + b, out + b);
  });
}

void exact_unpack(const std::uint64_t* words, std::size_t n, std::uint8_t* level, std::int64_t* top,
                  std::int64_t* low) {
  for_grains(n, [&](std::size_t b, std::size_t len) {
    for (std::size_t i = b; i < b + len; ++i) exact::elem::unpack(words[i], level[i], top[i], low[i]);
  });
}

void exact_combine_packed(const std::uint64_t* const* src, int ranks, float* dst, std::size_t n,
                          SquareDigits* squares) {
  combine_threaded(active_kernels().exact_combine_packed, src, ranks, dst, n, squares);
}

void exact_square_add(const float* x, std::size_t n, SquareDigits& squares) {
  const RangeKernels& k = active_kernels();
  const std::ptrdiff_t items = static_cast<std::ptrdiff_t>((n + kExactGrain - 1) / kExactGrain);
#pragma omp parallel if (items > 1)
  {
    SquareDigits part;
#pragma omp for schedule(static)
    for (std::ptrdiff_t c = 0; c < items; ++c) {
      const std::size_t b = static_cast<std::size_t>(c) * kExactGrain;
      k.exact_square_add(x + b, std::min(kExactGrain, n - b), part);
    }
#pragma omp critical(shardopt_exact_squares)
    squares.merge(part);
  }
}

void exact_deposit_combine_packed(const std::uint64_t* const* words, const float* const* last, int ranks,
                                  float* dst, std::size_t n, SquareDigits* squares) {
  const RangeKernels& k = active_kernels();
  // No deposit is stored: each last value is rounded straight to its element's final grid
  // (exact::elem::combine_packed_raw says why that is the deposit's result).
  struct Scratch {
    std::vector<const std::uint64_t*> words;
    std::vector<const float*> last;
  };
  combine_windows<Scratch>(dst, n, squares, [&](std::size_t w, std::size_t len, Scratch& s) {
    const auto nr = static_cast<std::size_t>(ranks);
    s.words.resize(nr);
    s.last.resize(nr);
    for (std::size_t r = 0; r < nr; ++r) {
      s.words[r] = words[r] + w;
      s.last[r] = last[r] + w;
    }
    k.exact_combine_packed_raw(s.words.data(), s.last.data(), ranks, dst + w, len);
  });
}

}  // namespace shardopt::cpu
