// test_adamw8bit.cpp: AdamW8bit's block quantization (src/rules/qmap.*) against PyTorch: the
// maps are the ones torch computes (checksums of tests/data/adamw8bit/qmap_*.bin, written by
// make_golden.py with PyTorch 2.11), the threshold search gives torchao's binary-search code
// for every float near every threshold and map entry, torch's codes and scales of 24
// blocks (ties at every midpoint included) are reproduced bit for bit, and ten AdamW8bit steps
// of the kernel on parameters of shapes (6, 1024), (3, 1024), 5000 and 300 (the small ones in
// fp32 state, the threshold being 4096 elements) end in torch's weights, codes and scales.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <iterator>
#include <limits>
#include <string>
#include <vector>

#include "cpu/kernel_table.hpp"
#include "cpu/kernels.hpp"
#include "rules/adamw8bit.hpp"
#include "rules/qmap.hpp"

namespace shardopt::rules::q8 {
namespace {

std::vector<unsigned char> read_file(const std::string& name) {
  std::ifstream f(std::string(SHARDOPT_TEST_DATA) + "/adamw8bit/" + name, std::ios::binary);
  EXPECT_TRUE(f.good()) << name;
  return std::vector<unsigned char>(std::istreambuf_iterator<char>(f), {});
}

float next_up(float x) { return std::nextafter(x, std::numeric_limits<float>::infinity()); }
float next_down(float x) { return std::nextafter(x, -std::numeric_limits<float>::infinity()); }

TEST(Qmap, TheMapsAreTorchsBitForBitAndTheChecksumsPinThem) {
  for (const auto& [file, map, sum] :
       {std::tuple{"qmap_signed.bin", &signed_map(), kSignedChecksum},
        std::tuple{"qmap_unsigned.bin", &unsigned_map(), kUnsignedChecksum}}) {
    const std::vector<unsigned char> bytes = read_file(file);
    ASSERT_EQ(bytes.size(), 1024u);
    EXPECT_EQ(std::memcmp(bytes.data(), map->value, 1024), 0) << file;
    EXPECT_EQ(map_checksum(*map), sum) << file;
    for (int i = 1; i < 256; ++i) ASSERT_LT(map->value[i - 1], map->value[i]) << file << " " << i;
    EXPECT_EQ(map->value[255], 1.0f);
  }
  EXPECT_EQ(signed_map().value[127], 0.0f);  // zero is a code: padding stays zero
  EXPECT_EQ(unsigned_map().value[0], 0.0f);
}

// The threshold search equals torchao's binary search with its rounding for every float in
// a window around every threshold and every entry, at signed zeros and subnormals, and
// beyond [-1, 1] (2, infinities: the code of +-1).
TEST(Qmap, ThresholdSearchIsTorchaosRoundingForEveryFloatNearEveryBoundary) {
  for (const Qmap* m : {&signed_map(), &unsigned_map()}) {
    std::vector<float> probes = {0.0f, -0.0f, 1.0f, -1.0f, 2.0f, -2.0f, 1e-30f, -1e-30f,
                                 std::numeric_limits<float>::infinity(),
                                 -std::numeric_limits<float>::infinity(),
                                 std::numeric_limits<float>::denorm_min()};
    for (int c = 0; c < 256; ++c)
      for (float center : {m->value[c], c < 255 ? m->threshold[c] : 1.0f}) {
        float lo = center, hi = center;
        for (int k = 0; k < 64; ++k) {
          probes.push_back(lo);
          probes.push_back(hi);
          lo = next_down(lo);
          hi = next_up(hi);
        }
      }
    for (float y : probes)
      ASSERT_EQ(quantize(*m, y), quantize_reference(m->value, y)) << std::hexfloat << y;
    // NaN never reaches the quantizer: a step with a non-finite gradient is skipped.
    // Random floats in [-1, 1].
    std::uint32_t s = 12345;
    for (int i = 0; i < 200000; ++i) {
      s = s * 1664525u + 1013904223u;
      const float y = static_cast<float>(static_cast<double>(s) / 4294967296.0 * 2.0 - 1.0);
      ASSERT_EQ(quantize(*m, y), quantize_reference(m->value, y)) << std::hexfloat << y;
    }
  }
}

// The SIMD kernels' quantizer (one gather of simd_entries(), one comparison) gives
// quantize()'s code for the same floats as above, bucket edges, values beyond [-1, 1],
// infinities and NaNs of both signs (inf / inf, a scale that overflowed, gives x86's
// negative NaN), per ISA that has one; its sign-free path too, for the unsigned map. (A run
// over all 2^32 floats agreed as well; it takes a minute, so it is not a test.)
TEST(Qmap, SimdQuantizerIsTheThresholdSearch) {
  const cpu::RangeKernels* tables[] = {&cpu::kPortableKernels,
#if defined(SHARDOPT_CPU_X86)
                                       &cpu::kAvx2Kernels, &cpu::kAvx512Kernels,
#endif
  };
  const cpu::Isa isas[] = {cpu::Isa::Portable,
#if defined(SHARDOPT_CPU_X86)
                           cpu::Isa::Avx2, cpu::Isa::Avx512,
#endif
  };
  int tested = 0;
  for (std::size_t t = 0; t < std::size(tables); ++t) {
    const cpu::RangeKernels& k = *tables[t];
    if (!k.q8_quantize || !cpu::isa_supported(isas[t])) continue;
    ++tested;
    for (const Qmap* m : {&signed_map(), &unsigned_map()}) {
      const float inf = std::numeric_limits<float>::infinity();
      std::vector<float> probes = {0.0f, -0.0f, 1.0f, -1.0f, 1e-30f, -1e-30f, 2.0f, -2.0f,
                                   1e30f, -1e30f, inf, -inf,
                                   std::numeric_limits<float>::denorm_min(),
                                   -std::numeric_limits<float>::denorm_min(),
                                   std::numeric_limits<float>::min(), -std::numeric_limits<float>::min()};
      for (std::uint32_t nan : {0x7FC00000u, 0xFFC00000u, 0x7F800001u, 0xFFBFFFFFu, 0x7FFFFFFFu})
        probes.push_back(std::bit_cast<float>(nan));
      volatile float big = inf;
      probes.push_back(big / big);  // the hardware's default NaN
      for (int c = 0; c < 256; ++c)
        for (float center : {m->value[c], c < 255 ? m->threshold[c] : 1.0f, -m->value[c]}) {
          float lo = center, hi = center;
          for (int k2 = 0; k2 < 64; ++k2) {
            probes.push_back(lo);
            probes.push_back(hi);
            lo = next_down(lo);
            hi = next_up(hi);
          }
        }
      for (std::uint32_t b = 0x33000000u; b <= 0x3F800000u; b += 0x8000u) {  // bucket edges
        for (std::uint32_t d : {0u, 1u, 0x7FFFu, 0xFFFFu}) {
          probes.push_back(std::bit_cast<float>(b + d));
          probes.push_back(-std::bit_cast<float>(b + d));
        }
      }
      std::uint32_t s = 777;
      for (int i = 0; i < 200000; ++i) {
        s = s * 1664525u + 1013904223u;
        probes.push_back(static_cast<float>(static_cast<double>(s) / 4294967296.0 * 2.0 - 1.0));
      }
      const std::vector<float>& y = probes;
      const cpu::Q8Map q{m->value, simd_entries(*m)};
      std::vector<std::uint8_t> got(y.size());
      for (bool nonneg : {false, true}) {
        if (nonneg && m != &unsigned_map()) continue;  // the sign-free path is the unsigned map's
        k.q8_quantize(y.data(), y.size(), q, nonneg, got.data());
        for (std::size_t i = 0; i < y.size(); ++i)
          ASSERT_EQ(got[i], quantize(*m, y[i]))
              << k.name << (nonneg ? " sign-free " : " ") << std::hexfloat << y[i] << " bits "
              << std::bit_cast<std::uint32_t>(y[i]);
      }
      // Odd lengths: the tails.
      for (std::size_t n : {1u, 7u, 15u, 17u, 33u}) {
        got.assign(n, 0);
        k.q8_quantize(y.data() + 5, n, q, false, got.data());
        for (std::size_t i = 0; i < n; ++i) ASSERT_EQ(got[i], quantize(*m, y[5 + i])) << k.name << " n " << n;
      }
    }
  }
#if defined(SHARDOPT_CPU_X86)
  if (cpu::isa_supported(cpu::Isa::Avx2)) EXPECT_GE(tested, 1);
#endif
}

// 24 blocks quantized by torch (torchao's algorithm written in torch ops): the same scales and
// codes. Block 0 holds the midpoint between every two neighbouring codes (ties go up).
TEST(Qmap, BlocksQuantizeAsTorchDoes) {
  const std::vector<unsigned char> bytes = read_file("quant_cases.bin");
  std::uint32_t n = 0;
  ASSERT_GE(bytes.size(), 4u);
  std::memcpy(&n, bytes.data(), 4);
  ASSERT_EQ(n % kBlock, 0u);
  const std::size_t blocks = n / kBlock;
  ASSERT_EQ(bytes.size(), 4 + 4 * n + 2 * (n + 4 * blocks));
  const unsigned char* at = bytes.data() + 4;
  std::vector<float> x(n), ss(blocks), su(blocks);
  std::vector<std::uint8_t> cs(n), cu(n);
  std::memcpy(x.data(), at, 4 * n);
  at += 4 * n;
  std::memcpy(cs.data(), at, n);
  at += n;
  std::memcpy(ss.data(), at, 4 * blocks);
  at += 4 * blocks;
  std::memcpy(cu.data(), at, n);
  at += n;
  std::memcpy(su.data(), at, 4 * blocks);
  for (std::size_t b = 0; b < blocks; ++b) {
    float amax_s = 0.0f, amax_u = 0.0f;
    for (std::size_t k = 0; k < kBlock; ++k) {
      amax_s = std::max(amax_s, std::fabs(x[b * kBlock + k]));
      amax_u = std::max(amax_u, std::fabs(x[b * kBlock + k]));
    }
    amax_s = std::max(amax_s, kMinScale);
    amax_u = std::max(amax_u, kMinScale);
    ASSERT_EQ(std::bit_cast<std::uint32_t>(amax_s), std::bit_cast<std::uint32_t>(ss[b])) << b;
    ASSERT_EQ(std::bit_cast<std::uint32_t>(amax_u), std::bit_cast<std::uint32_t>(su[b])) << b;
    for (std::size_t k = 0; k < kBlock; ++k) {
      const float v = x[b * kBlock + k];
      ASSERT_EQ(quantize(signed_map(), v / amax_s), cs[b * kBlock + k]) << "block " << b << " " << k;
      ASSERT_EQ(quantize(unsigned_map(), std::fabs(v) / amax_u), cu[b * kBlock + k])
          << "block " << b << " " << k;
    }
  }
  // Block 0's ties: each midpoint went up (to the larger code) unless it rounds below it.
  int up = 0;
  for (std::size_t k = 0; k + 1 < kBlock; ++k) up += cs[k] == k + 1;
  EXPECT_GT(up, 200) << "the midpoints should mostly round up";
}

// make_golden.py's dyadic(): an exactly representable value from integers.
float golden_value(std::uint64_t a, std::uint64_t b, std::uint64_t c, std::uint64_t k, int shift) {
  std::uint64_t h = (a * 2654435761ull + b * 40503ull + c * 97ull + k * 2246822519ull) % 4294967296ull;
  h ^= h >> 15;
  h = (h * 2246822519ull) % 4294967296ull;
  h ^= h >> 13;
  const double mant = static_cast<double>(static_cast<std::int64_t>(h % 65536) - 32768);
  const int exp = shift + static_cast<int>((h >> 16) % 8);
  return static_cast<float>(std::ldexp(mant, -15 - exp));
}

struct Golden {
  std::vector<float> p;
  std::vector<std::uint8_t> cm, cv;
  std::vector<float> sm, sv, m, v;  // scales of 8-bit parameters; fp32 m, v of the others
};

TEST(AdamW8bitKernel, TenStepsEqualTorchBitForBit) {
  const std::size_t shapes[4] = {6 * 1024, 3 * 1024, 5000, 300};
  const std::size_t threshold = 4096;
  // torch's final state.
  const std::vector<unsigned char> bytes = read_file("trajectory.bin");
  std::vector<Golden> want(4);
  std::size_t at = 0;
  auto take = [&](auto& vec, std::size_t count) {
    vec.resize(count);
    const std::size_t nbytes = count * sizeof(vec[0]);
    ASSERT_LE(at + nbytes, bytes.size());
    std::memcpy(vec.data(), bytes.data() + at, nbytes);
    at += nbytes;
  };
  for (int i = 0; i < 4; ++i) {
    const std::size_t n = shapes[i], blocks = (n + kBlock - 1) / kBlock;
    take(want[i].p, n);
    if (n >= threshold) {
      take(want[i].cm, n);
      take(want[i].sm, blocks);
      take(want[i].cv, n);
      take(want[i].sv, blocks);
    } else {
      take(want[i].m, n);
      take(want[i].v, n);
    }
  }
  ASSERT_EQ(at, bytes.size());

  // The same ten steps through the kernels: 8-bit state padded to whole blocks (zeros), the
  // small parameters with fp32 state through adam_element.
  const std::uint8_t zero_m = quantize(signed_map(), 0.0f), zero_v = quantize(unsigned_map(), 0.0f);
  std::vector<Golden> got(4);
  for (int i = 0; i < 4; ++i) {
    const std::size_t n = shapes[i], padded = (n + kBlock - 1) / kBlock * kBlock;
    got[i].p.assign(padded, 0.0f);
    for (std::size_t k = 0; k < n; ++k) got[i].p[k] = golden_value(1, 0, i, k, 0);
    if (n >= threshold) {
      got[i].cm.assign(padded, zero_m);
      got[i].cv.assign(padded, zero_v);
      got[i].sm.assign(padded / kBlock, kMinScale);
      got[i].sv.assign(padded / kBlock, kMinScale);
    } else {
      got[i].m.assign(n, 0.0f);
      got[i].v.assign(n, 0.0f);
    }
  }
  for (int step = 1; step <= 10; ++step) {
    const StepHyper h{1e-3, 0.9, 0.999, 1e-8, 0.01, AdamMode::AdamW, step};
    const StepScalars s = make_step_scalars(h, 1.0);
    const SegmentScalars g = make_segment_scalars(h, 1.0, true);
    for (int i = 0; i < 4; ++i) {
      const std::size_t n = shapes[i], padded = got[i].p.size();
      std::vector<float> grad(padded, 0.0f);
      for (std::size_t k = 0; k < n; ++k) grad[k] = golden_value(2, step, i, k, 4);
      Golden& st = got[i];
      if (n >= threshold) {
        const UpdateSegment seg{0, padded, g};
        adamw8bit_update(s, std::span(&seg, 1), st.p.data(), grad.data(), st.cm.data(),
                         st.cv.data(), st.sm.data(), st.sv.data(), nullptr, nullptr);
      } else {
        for (std::size_t k = 0; k < n; ++k) adam_element(s, g, st.p[k], grad[k], st.m[k], st.v[k]);
      }
    }
  }
  for (int i = 0; i < 4; ++i) {
    std::size_t bad = 0, first = 0;
    for (std::size_t k = 0; k < shapes[i]; ++k)
      if (std::memcmp(&got[i].p[k], &want[i].p[k], 4) != 0 && bad++ == 0) first = k;
    if (bad) ADD_FAILURE() << "parameter " << i << ": " << bad << " weights differ, first at " << first
                           << ": " << std::hexfloat << got[i].p[first] << " vs " << want[i].p[first];
  }
  for (int i = 0; i < 4; ++i) {
    SCOPED_TRACE("parameter " + std::to_string(i));
    const std::size_t n = shapes[i];
    ASSERT_EQ(std::memcmp(got[i].p.data(), want[i].p.data(), n * 4), 0) << "weights";
    if (n >= threshold) {
      ASSERT_EQ(std::memcmp(got[i].cm.data(), want[i].cm.data(), n), 0) << "exp_avg codes";
      ASSERT_EQ(std::memcmp(got[i].cv.data(), want[i].cv.data(), n), 0) << "exp_avg_sq codes";
      ASSERT_EQ(std::memcmp(got[i].sm.data(), want[i].sm.data(), want[i].sm.size() * 4), 0);
      ASSERT_EQ(std::memcmp(got[i].sv.data(), want[i].sv.data(), want[i].sv.size() * 4), 0);
    } else {
      ASSERT_EQ(std::memcmp(got[i].m.data(), want[i].m.data(), n * 4), 0) << "exp_avg";
      ASSERT_EQ(std::memcmp(got[i].v.data(), want[i].v.data(), n * 4), 0) << "exp_avg_sq";
    }
  }
}

// Every ISA's block kernel (AVX2 and AVX-512: gathers, the SIMD quantizer, many blocks per
// call with one block's requantization overlapping the next one's update) gives the portable
// block's bits: weights, replica (bf16 and fp32), codes and scales, over 67 blocks of values
// spread over many binades (some blocks all zero), in three segments whose boundaries do not
// fall on the kernel's units, AdamW and Adam-L2, three steps.
TEST(AdamW8bitKernel, EveryIsaGivesThePortableBits) {
#if defined(SHARDOPT_CPU_X86)
  // The SIMD tables have a kernel (else this test would compare the portable block to itself).
  EXPECT_NE(cpu::kAvx2Kernels.adamw8bit_blocks, nullptr);
  EXPECT_NE(cpu::kAvx512Kernels.adamw8bit_blocks, nullptr);
#endif
  const cpu::Isa keep = cpu::active_isa();
  const std::size_t n = 67 * kBlock;
  for (AdamMode mode : {AdamMode::AdamW, AdamMode::AdamL2}) {
    std::vector<std::vector<std::uint8_t>> codes;
    std::vector<std::vector<float>> results;
    for (cpu::Isa isa : {cpu::Isa::Portable, cpu::Isa::Avx2, cpu::Isa::Avx512}) {
      if (!cpu::isa_supported(isa)) continue;
      cpu::set_isa(isa);
      std::vector<float> p(n), grad(n), sm(n / kBlock, 0.0f), sv(n / kBlock, 0.0f), o32(n);
      std::vector<std::uint8_t> cm(n, 0), cv(n, 0);
      std::vector<bf16> o16(n);
      for (std::size_t k = 0; k < n; ++k) p[k] = golden_value(5, 0, 0, k, 0);
      for (int step = 1; step <= 3; ++step) {
        for (std::size_t k = 0; k < n; ++k)
          grad[k] = (k / kBlock) % 9 == 4 ? 0.0f : golden_value(6, step, 0, k, static_cast<int>(k / kBlock) % 20);
        // Block 30 overflows: its v (and scale) become Inf at step 2, then v / scale = NaN.
        if (step == 2)
          for (std::size_t k = 30 * kBlock; k < 31 * kBlock; k += 7) grad[k] = 3e38f;
        const StepHyper h{1e-2, 0.9, 0.999, 1e-8, 0.1, mode, step};
        const UpdateSegment segs[3] = {{0, 21 * kBlock, make_segment_scalars(h, 1.0, true)},
                                       {21 * kBlock, 40 * kBlock, make_segment_scalars(h, 0.5, false)},
                                       {40 * kBlock, n, make_segment_scalars(h, 2.0, true)}};
        adamw8bit_update(make_step_scalars(h, 0.25), segs, p.data(), grad.data(), cm.data(),
                         cv.data(), sm.data(), sv.data(), step == 2 ? nullptr : o16.data(),
                         step == 2 ? o32.data() : nullptr);
      }
      std::vector<float> all = p;
      all.insert(all.end(), sm.begin(), sm.end());
      all.insert(all.end(), sv.begin(), sv.end());
      all.insert(all.end(), o32.begin(), o32.end());
      for (const bf16& b : o16) all.push_back(static_cast<float>(b.bits));
      std::vector<std::uint8_t> c = cm;
      c.insert(c.end(), cv.begin(), cv.end());
      results.push_back(std::move(all));
      codes.push_back(std::move(c));
      if (results.size() > 1) {
        EXPECT_EQ(std::memcmp(results.back().data(), results.front().data(), results.front().size() * 4), 0)
            << cpu::isa_name(isa) << " weights, replica or scales";
        EXPECT_EQ(codes.back(), codes.front()) << cpu::isa_name(isa) << " codes";
      }
    }
    cpu::set_isa(keep);
  }
}

}  // namespace
}  // namespace shardopt::rules::q8
