// crc32c.cpp: CRC-32C with the SSE4.2 instruction where the CPU has it, otherwise
// slicing-by-8 tables; both give the same value. Measured on the 2-core EPYC dev VM (256 MiB,
// loaded machine): SSE4.2 ~0.7x memcpy bandwidth, about 5x the table version.
#include "crc32c.hpp"

#include <array>
#include <cstring>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <nmmintrin.h>
#define SHARDOPT_CRC_X86 1
#endif

namespace shardopt::ckpt {
namespace {

constexpr std::uint32_t kPoly = 0x82F63B78u;  // reflected Castagnoli polynomial

using Tables = std::array<std::array<std::uint32_t, 256>, 8>;

constexpr Tables make_tables() {
  Tables t{};
  for (std::uint32_t i = 0; i < 256; ++i) {
    std::uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c >> 1) ^ ((c & 1u) ? kPoly : 0u);
    t[0][i] = c;
  }
  for (std::size_t s = 1; s < 8; ++s)
    for (std::size_t i = 0; i < 256; ++i) t[s][i] = (t[s - 1][i] >> 8) ^ t[0][t[s - 1][i] & 0xFFu];
  return t;
}
constexpr Tables kTables = make_tables();

std::uint32_t update_portable(std::uint32_t c, const unsigned char* p, std::size_t n) {
  while (n >= 8) {
    std::uint64_t w;
    std::memcpy(&w, p, 8);  // little-endian hosts only (checked in format.cpp)
    w ^= c;
    c = kTables[7][w & 0xFF] ^ kTables[6][(w >> 8) & 0xFF] ^ kTables[5][(w >> 16) & 0xFF] ^
        kTables[4][(w >> 24) & 0xFF] ^ kTables[3][(w >> 32) & 0xFF] ^
        kTables[2][(w >> 40) & 0xFF] ^ kTables[1][(w >> 48) & 0xFF] ^ kTables[0][w >> 56];
    p += 8;
    n -= 8;
  }
  while (n--) c = (c >> 8) ^ kTables[0][(c ^ *p++) & 0xFFu];
  return c;
}

#ifdef SHARDOPT_CRC_X86
__attribute__((target("sse4.2"))) std::uint32_t update_sse42(std::uint32_t c,
                                                             const unsigned char* p,
                                                             std::size_t n) {
  std::uint64_t c64 = c;
  while (n >= 8) {
    std::uint64_t w;
    std::memcpy(&w, p, 8);
    c64 = _mm_crc32_u64(c64, w);
    p += 8;
    n -= 8;
  }
  c = static_cast<std::uint32_t>(c64);
  while (n--) c = _mm_crc32_u8(c, *p++);
  return c;
}
bool have_sse42() {
  static const bool yes = __builtin_cpu_supports("sse4.2");
  return yes;
}
#endif

}  // namespace

std::uint32_t crc32c_update(std::uint32_t crc, const void* data, std::size_t bytes) noexcept {
  const auto* p = static_cast<const unsigned char*>(data);
  std::uint32_t c = ~crc;
#ifdef SHARDOPT_CRC_X86
  if (have_sse42()) return ~update_sse42(c, p, bytes);
#endif
  return ~update_portable(c, p, bytes);
}

std::uint32_t crc32c_update_portable(std::uint32_t crc, const void* data,
                                     std::size_t bytes) noexcept {
  return ~update_portable(~crc, static_cast<const unsigned char*>(data), bytes);
}

}  // namespace shardopt::ckpt
