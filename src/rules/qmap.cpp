// qmap.cpp: the two dynamic maps (constants, see qmap.hpp) and their rounding thresholds.
#include "rules/qmap.hpp"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>

#include "shardopt/error.hpp"
#include "shardopt/layout.hpp"  // fnv1a64

namespace shardopt::rules::q8 {
namespace {

// FNV-1a 64 of the 256 little-endian float bits: 0x17e728ba6ba93316
alignas(64) const std::uint32_t kQmapSignedBits[256] = {
    0xbf7e3333u, 0xbf7a999au, 0xbf770000u, 0xbf736666u, 0xbf6fcccdu, 0xbf6c3333u, 0xbf68999au, 0xbf650000u,
    0xbf616666u, 0xbf5dcccdu, 0xbf5a3333u, 0xbf56999au, 0xbf530000u, 0xbf4f6666u, 0xbf4bcccdu, 0xbf483333u,
    0xbf44999au, 0xbf410000u, 0xbf3d6666u, 0xbf39cccdu, 0xbf363334u, 0xbf32999au, 0xbf2f0000u, 0xbf2b6666u,
    0xbf27cccdu, 0xbf243334u, 0xbf20999au, 0xbf1d0000u, 0xbf196666u, 0xbf15cccdu, 0xbf123334u, 0xbf0e999au,
    0xbf0b0000u, 0xbf076666u, 0xbf03ccccu, 0xbf003333u, 0xbef93332u, 0xbef20000u, 0xbeeaccccu, 0xbee3999au,
    0xbedc6666u, 0xbed53333u, 0xbece0000u, 0xbec6ccccu, 0xbebf999au, 0xbeb86666u, 0xbeb13333u, 0xbeaa0000u,
    0xbea2ccccu, 0xbe9b999au, 0xbe946666u, 0xbe8d3334u, 0xbe860000u, 0xbe7d9999u, 0xbe6f3333u, 0xbe60cccdu,
    0xbe526666u, 0xbe440000u, 0xbe35999au, 0xbe273333u, 0xbe18cccdu, 0xbe0a6666u, 0xbdf80000u, 0xbddb3334u,
    0xbdc9eb85u, 0xbdc428f7u, 0xbdbe6667u, 0xbdb8a3d7u, 0xbdb2e148u, 0xbdad1eb8u, 0xbda75c2au, 0xbda1999au,
    0xbd9bd70au, 0xbd96147bu, 0xbd9051ebu, 0xbd8a8f5du, 0xbd84cccdu, 0xbd7e147bu, 0xbd728f5du, 0xbd670a3du,
    0xbd5b851fu, 0xbd500000u, 0xbd447ae1u, 0xbd38f5c3u, 0xbd2d70a3u, 0xbd21eb85u, 0xbd166667u, 0xbd0ae148u,
    0xbcfeb852u, 0xbce7ae15u, 0xbcd0a3d7u, 0xbcb9999au, 0xbca28f5du, 0xbc8b851fu, 0xbc68f5c3u, 0xbc3ae148u,
    0xbc1f3b64u, 0xbc160418u, 0xbc0ccccdu, 0xbc039581u, 0xbbf4bc6au, 0xbbe24dd3u, 0xbbcfdf3bu, 0xbbbd70a4u,
    0xbbab020du, 0xbb989374u, 0xbb8624ddu, 0xbb676c8au, 0xbb428f5cu, 0xbb1db22du, 0xbaf1a9fcu, 0xbaa7ef9du,
    0xba7765ffu, 0xba59e83eu, 0xba3c6a80u, 0xba1eecc1u, 0xba016f01u, 0xb9c7e283u, 0xb98ce705u, 0xb923d70bu,
    0xb8ba1f4bu, 0xb88aefb3u, 0xb8378034u, 0xb7b24206u, 0xb70205ffu, 0xb65a1a94u, 0xb513a3b7u, 0x00000000u,
    0x3513a3b7u, 0x365a1a94u, 0x370205ffu, 0x37b24206u, 0x38378034u, 0x388aefb3u, 0x38ba1f4bu, 0x3923d70bu,
    0x398ce705u, 0x39c7e283u, 0x3a016f01u, 0x3a1eecc1u, 0x3a3c6a80u, 0x3a59e83eu, 0x3a7765ffu, 0x3aa7ef9du,
    0x3af1a9fcu, 0x3b1db22du, 0x3b428f5cu, 0x3b676c8au, 0x3b8624ddu, 0x3b989374u, 0x3bab020du, 0x3bbd70a4u,
    0x3bcfdf3bu, 0x3be24dd3u, 0x3bf4bc6au, 0x3c039581u, 0x3c0ccccdu, 0x3c160418u, 0x3c1f3b64u, 0x3c3ae148u,
    0x3c68f5c3u, 0x3c8b851fu, 0x3ca28f5du, 0x3cb9999au, 0x3cd0a3d7u, 0x3ce7ae15u, 0x3cfeb852u, 0x3d0ae148u,
    0x3d166667u, 0x3d21eb85u, 0x3d2d70a3u, 0x3d38f5c3u, 0x3d447ae1u, 0x3d500000u, 0x3d5b851fu, 0x3d670a3du,
    0x3d728f5du, 0x3d7e147bu, 0x3d84cccdu, 0x3d8a8f5du, 0x3d9051ebu, 0x3d96147bu, 0x3d9bd70au, 0x3da1999au,
    0x3da75c2au, 0x3dad1eb8u, 0x3db2e148u, 0x3db8a3d7u, 0x3dbe6667u, 0x3dc428f7u, 0x3dc9eb85u, 0x3ddb3334u,
    0x3df80000u, 0x3e0a6666u, 0x3e18cccdu, 0x3e273333u, 0x3e35999au, 0x3e440000u, 0x3e526666u, 0x3e60cccdu,
    0x3e6f3333u, 0x3e7d9999u, 0x3e860000u, 0x3e8d3334u, 0x3e946666u, 0x3e9b999au, 0x3ea2ccccu, 0x3eaa0000u,
    0x3eb13333u, 0x3eb86666u, 0x3ebf999au, 0x3ec6ccccu, 0x3ece0000u, 0x3ed53333u, 0x3edc6666u, 0x3ee3999au,
    0x3eeaccccu, 0x3ef20000u, 0x3ef93332u, 0x3f003333u, 0x3f03ccccu, 0x3f076666u, 0x3f0b0000u, 0x3f0e999au,
    0x3f123334u, 0x3f15cccdu, 0x3f196666u, 0x3f1d0000u, 0x3f20999au, 0x3f243334u, 0x3f27cccdu, 0x3f2b6666u,
    0x3f2f0000u, 0x3f32999au, 0x3f363334u, 0x3f39cccdu, 0x3f3d6666u, 0x3f410000u, 0x3f44999au, 0x3f483333u,
    0x3f4bcccdu, 0x3f4f6666u, 0x3f530000u, 0x3f56999au, 0x3f5a3333u, 0x3f5dcccdu, 0x3f616666u, 0x3f650000u,
    0x3f68999au, 0x3f6c3333u, 0x3f6fcccdu, 0x3f736666u, 0x3f770000u, 0x3f7a999au, 0x3f7e3333u, 0x3f800000u,
};
// FNV-1a 64 of the 256 little-endian float bits: 0xe4412cdfa3689880
alignas(64) const std::uint32_t kQmapUnsignedBits[256] = {
    0x00000000u, 0x34ae7baau, 0x35500998u, 0x360e9b38u, 0x3692ccf6u, 0x36de4c51u, 0x3714e5d5u, 0x3783126eu,
    0x37e171a0u, 0x381fe868u, 0x384f1800u, 0x387e479au, 0x3896bb99u, 0x38ae5364u, 0x38c5eb31u, 0x3906594bu,
    0x394154cau, 0x397c5049u, 0x399ba5e4u, 0x39b923a2u, 0x39d6a163u, 0x39f41f22u, 0x3a08ce71u, 0x3a178d50u,
    0x3a264c30u, 0x3a350b10u, 0x3a43c9efu, 0x3a5288d0u, 0x3a6147afu, 0x3a70068eu, 0x3a7ec56eu, 0x3a958106u,
    0x3aba5e35u, 0x3adf3b64u, 0x3b020c4au, 0x3b147ae1u, 0x3b26e978u, 0x3b395810u, 0x3b4bc6a7u, 0x3b5e3540u,
    0x3b70a3d7u, 0x3b818937u, 0x3b8ac082u, 0x3b93f7cfu, 0x3b9d2f1au, 0x3ba66666u, 0x3baf9db2u, 0x3bb8d4fdu,
    0x3bc20c4au, 0x3bcb4395u, 0x3bd47ae1u, 0x3bddb22eu, 0x3be6e978u, 0x3bf020c5u, 0x3bf9580fu, 0x3c0147aeu,
    0x3c05e354u, 0x3c0a7ef9u, 0x3c0f1aa0u, 0x3c13b645u, 0x3c1851ebu, 0x3c1ced92u, 0x3c218937u, 0x3c2f5c2au,
    0x3c466667u, 0x3c5d70a3u, 0x3c747ae2u, 0x3c85c28fu, 0x3c9147afu, 0x3c9ccccdu, 0x3ca851ebu, 0x3cb3d70bu,
    0x3cbf5c29u, 0x3ccae147u, 0x3cd66667u, 0x3ce1eb87u, 0x3ced70a3u, 0x3cf8f5c3u, 0x3d023d70u, 0x3d080000u,
    0x3d0dc28fu, 0x3d13851fu, 0x3d1947afu, 0x3d1f0a3du, 0x3d24cccdu, 0x3d2a8f5cu, 0x3d3051ebu, 0x3d36147bu,
    0x3d3bd70au, 0x3d41999au, 0x3d475c28u, 0x3d4d1eb8u, 0x3d52e147u, 0x3d58a3d7u, 0x3d5e6667u, 0x3d6428f7u,
    0x3d69eb87u, 0x3d6fae15u, 0x3d7570a3u, 0x3d7b3333u, 0x3d807ae2u, 0x3d835c2au, 0x3d863d71u, 0x3d891eb8u,
    0x3d8c0000u, 0x3d8ee148u, 0x3d91c290u, 0x3d94a3d7u, 0x3d97851fu, 0x3d9a6667u, 0x3d9d47afu, 0x3da028f6u,
    0x3da30a3eu, 0x3da5eb85u, 0x3da8cccdu, 0x3dabae15u, 0x3dae8f5cu, 0x3db170a4u, 0x3db451ebu, 0x3db73333u,
    0x3dba147bu, 0x3dbcf5c3u, 0x3dbfd70bu, 0x3dc2b852u, 0x3dc5999au, 0x3dc87ae2u, 0x3dcb5c29u, 0x3dd40000u,
    0x3de26666u, 0x3df0cccdu, 0x3dff3333u, 0x3e06ccccu, 0x3e0e0000u, 0x3e153334u, 0x3e1c6666u, 0x3e23999au,
    0x3e2accccu, 0x3e320000u, 0x3e393334u, 0x3e406666u, 0x3e47999au, 0x3e4eccccu, 0x3e560000u, 0x3e5d3334u,
    0x3e646666u, 0x3e6b999au, 0x3e72ccccu, 0x3e7a0000u, 0x3e809999u, 0x3e843333u, 0x3e87cccdu, 0x3e8b6666u,
    0x3e8f0000u, 0x3e92999au, 0x3e963333u, 0x3e99ccccu, 0x3e9d6666u, 0x3ea10000u, 0x3ea4999au, 0x3ea83333u,
    0x3eabccccu, 0x3eaf6666u, 0x3eb30000u, 0x3eb6999au, 0x3eba3333u, 0x3ebdccccu, 0x3ec16666u, 0x3ec50000u,
    0x3ec8999au, 0x3ecc3333u, 0x3ecfccccu, 0x3ed36666u, 0x3ed70000u, 0x3eda999au, 0x3ede3333u, 0x3ee1ccccu,
    0x3ee56666u, 0x3ee90000u, 0x3eec999au, 0x3ef03333u, 0x3ef3ccccu, 0x3ef76666u, 0x3efb0000u, 0x3efe9999u,
    0x3f01199au, 0x3f02e666u, 0x3f04b333u, 0x3f068000u, 0x3f084cccu, 0x3f0a199au, 0x3f0be666u, 0x3f0db334u,
    0x3f0f8000u, 0x3f114ccdu, 0x3f13199au, 0x3f14e666u, 0x3f16b334u, 0x3f188000u, 0x3f1a4ccdu, 0x3f1c199au,
    0x3f1de666u, 0x3f1fb334u, 0x3f218000u, 0x3f234ccdu, 0x3f25199au, 0x3f26e666u, 0x3f28b334u, 0x3f2a8000u,
    0x3f2c4ccdu, 0x3f2e199au, 0x3f2fe666u, 0x3f31b334u, 0x3f338000u, 0x3f354ccdu, 0x3f37199au, 0x3f38e666u,
    0x3f3ab334u, 0x3f3c8000u, 0x3f3e4ccdu, 0x3f40199au, 0x3f41e666u, 0x3f43b334u, 0x3f458000u, 0x3f474cccu,
    0x3f49199au, 0x3f4ae666u, 0x3f4cb334u, 0x3f4e8000u, 0x3f504cccu, 0x3f52199au, 0x3f53e666u, 0x3f55b334u,
    0x3f578000u, 0x3f594cccu, 0x3f5b199au, 0x3f5ce666u, 0x3f5eb334u, 0x3f608000u, 0x3f624cccu, 0x3f64199au,
    0x3f65e666u, 0x3f67b334u, 0x3f698000u, 0x3f6b4cccu, 0x3f6d199au, 0x3f6ee666u, 0x3f70b334u, 0x3f728000u,
    0x3f744cccu, 0x3f76199au, 0x3f77e666u, 0x3f79b334u, 0x3f7b8000u, 0x3f7d4cccu, 0x3f7f199au, 0x3f800000u,
};

// An integer key with the order of the floats (no NaN): the bits of a non-negative float, the
// complement of the magnitude bits of a negative one, as signed integers.
std::int64_t key_of(float x) {
  const std::uint32_t b = std::bit_cast<std::uint32_t>(x);
  return (b >> 31) ? -static_cast<std::int64_t>(b & 0x7FFFFFFFu) : static_cast<std::int64_t>(b);
}
float float_of(std::int64_t k) {
  return k < 0 ? std::bit_cast<float>(static_cast<std::uint32_t>(-k) | 0x80000000u)
               : std::bit_cast<float>(static_cast<std::uint32_t>(k));
}

// Whether y in [q[c], q[c + 1]) rounds up to c + 1, in torchao's float32 operations.
bool rounds_up(const float* q, unsigned c, float y) {
  const float residual = y - q[c];
  const float half = (q[c + 1] - q[c]) * 0.5f;
  return residual >= half;
}

Qmap make(const std::uint32_t* bits) {
  Qmap m{};
  for (int i = 0; i < 256; ++i) m.value[i] = std::bit_cast<float>(bits[i]);
  for (unsigned c = 0; c < 255; ++c) {
    // The predicate is monotone in y: bisect over the float keys of [q[c], q[c + 1]].
    std::int64_t lo = key_of(m.value[c]), hi = key_of(m.value[c + 1]);  // up(hi) holds
    while (hi - lo > 1) {
      const std::int64_t mid = lo + (hi - lo) / 2;
      if (rounds_up(m.value, c, float_of(mid))) hi = mid;
      else lo = mid;
    }
    m.threshold[c] = rounds_up(m.value, c, float_of(lo)) ? float_of(lo) : float_of(hi);
  }
  m.threshold[255] = m.threshold[256] = std::numeric_limits<float>::quiet_NaN();  // never <= y
  // Bucket bases: thresholds <= the bucket's smallest float; at most two thresholds may lie
  // above it inside the bucket (quantize() compares two).
  auto count_le = [&](float y) {
    unsigned n = 0;
    while (n < 255 && m.threshold[n] <= y) ++n;
    return n;
  };
  for (std::size_t b = 0; b < kBuckets; ++b) {
    const std::uint32_t lo_bits = static_cast<std::uint32_t>(b) << kBucketShift;
    const std::uint32_t hi_bits = std::min<std::uint32_t>(lo_bits + ((1u << kBucketShift) - 1),
                                                          0x3F800000u);
    const float lo = std::bit_cast<float>(lo_bits), hi = std::bit_cast<float>(hi_bits);
    m.base_pos[b] = static_cast<std::uint8_t>(count_le(lo));
    m.base_neg[b] = static_cast<std::uint8_t>(count_le(-hi));
    if (count_le(hi) > m.base_pos[b] + 2u || count_le(-lo) > m.base_neg[b] + 2u)
      throw Error(Status::Internal, "qmap: more than two thresholds in a bucket");
  }
  return m;
}

// The number of thresholds <= y.
unsigned count_le(const Qmap& m, float y) {
  unsigned n = 0;
  while (n < 255 && m.threshold[n] <= y) ++n;
  return n;
}

struct SimdEntries {
  alignas(64) std::uint32_t entry[2 * kSimdBuckets];
};

SimdEntries make_simd_entries(const Qmap& m) {
  SimdEntries t{};
  // The SIMD entries: base and the one threshold inside each bucket (its key: the low 16
  // bits, complemented for negative y, where larger magnitudes come first).
  const float below = std::bit_cast<float>((kSimdLow << kBucketShift) | 0xFFFFu);
  for (unsigned c = 0; c < 255; ++c) {
    if (std::fabs(m.threshold[c]) <= below)
      throw Error(Status::Internal, "qmap: a threshold below the SIMD table's first bucket");
    if (m.value[0] >= 0.0f && m.threshold[c] < 0.0f)  // the kernels' sign-free path
      throw Error(Status::Internal, "qmap: a negative threshold in an unsigned map");
  }
  const std::size_t one = (0x3F800000u >> kBucketShift) - kSimdLow;  // 1.0's bucket
  for (std::size_t b = 0; b < kSimdBuckets; ++b) {
    if (b > one) {  // beyond 1 (infinities, NaN): the code of +-1, as quantize() clamps
      t.entry[b] = t.entry[one];
      t.entry[kSimdBuckets + b] = t.entry[kSimdBuckets + one];
      continue;
    }
    const std::uint32_t lo_bits = static_cast<std::uint32_t>(kSimdLow + b) << kBucketShift;
    const float lo = std::bit_cast<float>(lo_bits), hi = std::bit_cast<float>(lo_bits | 0xFFFFu);
    for (int neg = 0; neg < 2; ++neg) {
      const float first = neg ? -hi : lo, last = neg ? -lo : hi;  // the bucket's least, greatest y
      const unsigned base = count_le(m, first), inside = count_le(m, last) - base;
      if (inside > 1) throw Error(Status::Internal, "qmap: two thresholds in a SIMD bucket");
      std::uint32_t lim = 0x10000u;  // none: key > 0xFFFF never holds
      if (inside == 1) {
        const std::uint32_t low = std::bit_cast<std::uint32_t>(m.threshold[base]) & 0xFFFFu;
        lim = neg ? 0xFFFFu - low : low;  // >= 1: the threshold is above the bucket's first y
        if (lim == 0) throw Error(Status::Internal, "qmap: a threshold at a SIMD bucket's start");
      }
      t.entry[neg * kSimdBuckets + b] = base | (lim - 1) << 16;
    }
  }
  return t;
}

}  // namespace

const Qmap& signed_map() {
  static const Qmap m = make(kQmapSignedBits);
  return m;
}

const Qmap& unsigned_map() {
  static const Qmap m = make(kQmapUnsignedBits);
  return m;
}

const std::uint32_t* simd_entries(const Qmap& q) {
  if (&q == &signed_map()) {
    static const SimdEntries t = make_simd_entries(q);
    return t.entry;
  }
  require(&q == &unsigned_map(), Status::Internal, "simd_entries: not one of the two maps");
  static const SimdEntries t = make_simd_entries(q);
  return t.entry;
}

std::uint64_t map_checksum(const Qmap& q) { return fnv1a64(q.value, sizeof q.value); }

std::uint8_t quantize_reference(const float* q, float y) {
  unsigned c = y >= q[128] ? 128u : 0u;
  for (unsigned step = 64; step > 0; step >>= 1)
    if (y >= q[c + step]) c += step;
  const unsigned up = c + 1 > 255 ? 255 : c + 1;
  const float residual = y - q[c];
  return static_cast<std::uint8_t>(residual >= (q[up] - q[c]) * 0.5f ? up : c);
}

}  // namespace shardopt::rules::q8
