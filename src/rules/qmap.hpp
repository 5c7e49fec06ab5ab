// qmap.hpp: the 8-bit block quantization of AdamW8bit's state (issue 31).
//
// The maps are bitsandbytes' / torchao's create_dynamic_map(signed, 7, 8): 256 float values,
// sorted, in [-0.993, 1] (signed, for exp_avg) and [0, 1] (unsigned, for exp_avg_sq). The
// reference libraries compute them in float32 (torch.linspace and float32 arithmetic); a float64
// regeneration differs in the last bits of 72 (signed) and 100 (unsigned) entries, so they are
// shipped as constants (qmap.cpp), generated once with PyTorch 2.11 by
// tests/data/adamw8bit/make_golden.py, with a checksum the checkpoints record.
//
// A block is 256 elements counted from its parameter's first element; its scale is
// max(|x|) over the block, floored at 1e-12. Quantizing x: y = x / scale (fp32), then torchao's
// quantize_8bit_with_qmap (implementation 1): c = the largest code with q[c] <= y (0 when
// none), and c + 1 when c < 255 and fl(y - q[c]) >= fl(fl(q[c + 1] - q[c]) * 0.5) (ties up).
// Dequantizing: q[code] * scale (fp32).
//
// The rounding decision is monotone in y, so code(y) = the number of thresholds t_c <= y,
// t_c the smallest float that rounds c up (Qmap::threshold, computed once from the map). The
// count comes from a table indexed by the top bits of |y| (kBucketShift: 2^16 ulps, 1/128 of
// a binade, never more than two thresholds, which the construction checks) and at most two
// comparisons: no branch and no search. The same code as the reference wherever
// tests/test_adamw8bit.cpp looks: 64 floats on each side of every threshold and entry,
// 200000 random floats in [-1, 1], signed zeros, subnormals and values beyond [-1, 1].
//
// The SIMD kernels read one 32-bit entry per code instead (simd_entries(), one gather):
// within a bucket of 2^16 ulps there is at most one threshold (the construction checks), so
// the entry holds the base and that threshold's low 16 bits, and the code is base + (key >
// lim - 1), an integer comparison of y's low 16 bits. Buckets below kSimdLow hold no
// threshold (checked too) and share kSimdLow's entry; the buckets beyond 1.0's (|y| > 1,
// infinities, NaN) repeat 1.0's entry, where the code is that of +-1 by the sign bit whatever
// the key, as in quantize(). The unsigned map has no negative threshold (checked), so there every y with the
// sign bit set has code 0, the first bucket's base: its kernels skip the sign.
#pragma once

#include <cstddef>
#include <cstdint>

#include "shardopt/host_device.hpp"

namespace shardopt::rules::q8 {

inline constexpr std::size_t kBlock = 256;   ///< elements per quantization block
inline constexpr float kMinScale = 1e-12f;   ///< the floor of a block's scale

inline constexpr unsigned kBucketShift = 16;
/// Buckets of |y| in [0, 1] (bits of 1.0f >> kBucketShift, plus one).
inline constexpr std::size_t kBuckets = (0x3F800000u >> kBucketShift) + 1;

/// The first bucket of simd_entries() (|y| >= 2^-23); smaller |y| use its entry.
inline constexpr std::uint32_t kSimdLow = 0x3400u;
/// Buckets per sign in simd_entries(): kSimdLow to the last one of any float (infinities
/// and NaN included; those above 1.0's bucket repeat its entry), so no index needs clamping
/// from above.
inline constexpr std::size_t kSimdBuckets = (0x7FFFFFFFu >> kBucketShift) - kSimdLow + 1;

struct Qmap {
  float value[256];
  /// threshold[c]: the smallest float y that quantizes to c + 1 or more (c < 255);
  /// threshold[255] and [256] = NaN (sentinels: no y compares >= them).
  float threshold[257];
  /// The number of thresholds <= the smallest float of each bucket of |y| (y >= 0: the
  /// bucket's lowest value; y < 0: minus its largest magnitude).
  std::uint8_t base_pos[kBuckets];
  std::uint8_t base_neg[kBuckets];
};

/// The signed (exp_avg) and unsigned (exp_avg_sq) maps.
const Qmap& signed_map();
const Qmap& unsigned_map();
/// The SIMD quantizer's entries of signed_map() or unsigned_map() (2 * kSimdBuckets of them,
/// 152 KiB, kept apart from Qmap, which the CUDA backend copies to the device whole):
/// [neg * kSimdBuckets + max(bits(|y|) >> 16, kSimdLow) - kSimdLow] = base | (lim - 1) << 16.
/// The code of y is base + (key > lim - 1), key = bits(y) & 0xFFFF for y >= +0 and 0xFFFF -
/// (bits(y) & 0xFFFF) for y <= -0 (the order of y inside the bucket), lim the key of the
/// threshold inside the bucket (>= 1); lim - 1 = 0xFFFF where none lies inside. (key << 16 >
/// entry as unsigned is the same test.)
const std::uint32_t* simd_entries(const Qmap& q);
/// FNV-1a 64 of a map's 256 little-endian float bits (saved in checkpoints).
std::uint64_t map_checksum(const Qmap& q);
inline constexpr std::uint64_t kSignedChecksum = 0x17e728ba6ba93316ull;
inline constexpr std::uint64_t kUnsignedChecksum = 0xe4412cdfa3689880ull;

/// torchao's binary search with rounding, as written there (the reference).
std::uint8_t quantize_reference(const float* q, float y);

/// The code of y: bitwise quantize_reference(q.value, y) for every float y in [-1, 1] (the
/// range of x / scale; beyond it, the code of +-1).
SHARDOPT_HD std::uint8_t quantize(const Qmap& q, float y) {
  std::uint32_t bits;
  __builtin_memcpy(&bits, &y, sizeof bits);
  std::uint32_t idx = (bits & 0x7FFFFFFFu) >> kBucketShift;
  idx = idx < kBuckets ? idx : static_cast<std::uint32_t>(kBuckets - 1);
  const unsigned base = (bits >> 31) ? q.base_neg[idx] : q.base_pos[idx];
  return static_cast<std::uint8_t>(base + static_cast<unsigned>(y >= q.threshold[base]) +
                                   static_cast<unsigned>(y >= q.threshold[base + 1]));
}

}  // namespace shardopt::rules::q8
