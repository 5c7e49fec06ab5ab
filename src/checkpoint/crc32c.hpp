// crc32c.hpp: CRC-32C (Castagnoli), the checksum of every checkpoint file, computed in one
// streaming pass (update chunk by chunk) so files are never read twice.
#pragma once

#include <cstddef>
#include <cstdint>

namespace shardopt::ckpt {

/// Continues a CRC-32C over `bytes` more bytes. Start with crc = 0; the value after the
/// last chunk is the checksum (crc32c("123456789") == 0xE3069283).
std::uint32_t crc32c_update(std::uint32_t crc, const void* data, std::size_t bytes) noexcept;

/// The table-driven path alone (for tests: must equal crc32c_update on every input).
std::uint32_t crc32c_update_portable(std::uint32_t crc, const void* data, std::size_t bytes) noexcept;

inline std::uint32_t crc32c(const void* data, std::size_t bytes) noexcept {
  return crc32c_update(0, data, bytes);
}

}  // namespace shardopt::ckpt
