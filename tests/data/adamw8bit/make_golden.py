#!/usr/bin/env python3
"""make_golden.py: golden data for shardopt's AdamW8bit, computed with PyTorch (CPU, float32).

Not run in CI (Debian has no PyTorch 2.x here); run once where PyTorch is installed:

    python3 tests/data/adamw8bit/make_golden.py OUT_DIR

It writes, little-endian:
  qmap_signed.bin, qmap_unsigned.bin   the 256 float32 entries of bitsandbytes' / torchao's
                                       create_dynamic_map(signed, 7, 8), computed as they do it
                                       (torch.linspace in float32, float32 arithmetic)
  qmap_f64_differences.txt             how many entries a float64 regeneration gets wrong
  quant_cases.bin                      blocks of inputs, their absmax and codes under torchao's
                                       quantize_8bit_with_qmap (implementation 1: binary search,
                                       ties up)
  trajectory.bin                       ten AdamW8bit steps on parameters of shapes (6, 1024),
                                       (3, 1024), (5000,), (300,): the fp32 masters, the codes and
                                       block scales of the 8-bit ones, fp32 m and v of the others
The step is the one shardopt's issue 31 specifies, written with separate float32 torch ops in
the order of shardopt's adam_element() (the square root correctly rounded: see the step); inputs are dyadic values made from integers, so the C++
test regenerates them exactly (adamw8bit_golden.hpp documents the formulas).
"""
import math
import struct
import sys

import torch

torch.set_num_threads(1)


def create_dynamic_map(signed=True, max_exponent_bits=7, total_bits=8, dtype=torch.float32):
    # bitsandbytes.functional.create_dynamic_map (torchao copies it), with the dtype made a
    # parameter so that the float64 regeneration can be compared.
    data = []
    non_sign_bits = total_bits - 1
    additional_items = 2 ** (non_sign_bits - max_exponent_bits) - 1
    for i in range(max_exponent_bits):
        fraction_items = int(2 ** (i + non_sign_bits - max_exponent_bits) + 1 if signed
                             else 2 ** (i + non_sign_bits - max_exponent_bits + 1) + 1)
        boundaries = torch.linspace(0.1, 1, fraction_items, dtype=dtype)
        means = (boundaries[:-1] + boundaries[1:]) / 2.0
        data += ((10 ** (-(max_exponent_bits - 1) + i)) * means).tolist()
        if signed:
            data += (-(10 ** (-(max_exponent_bits - 1) + i)) * means).tolist()
    assert additional_items == 0
    data.append(0)
    data.append(1.0)
    assert len(data) == 2 ** total_bits
    data.sort()
    return torch.tensor(data, dtype=torch.float32)


def quantize(x, qmap, block=256):
    """torchao quantize_8bit_with_qmap, implementation 1, on a flat tensor whose length is a
    multiple of `block`; returns (codes, scale)."""
    x = x.view(-1, block)
    scale = x.abs().amax(-1).clip(1e-12)
    x = (x / scale.view(-1, 1)).view(-1)
    codes = torch.where(x >= qmap[128], 128, 0)
    for step in (64, 32, 16, 8, 4, 2, 1):
        codes += torch.where(x >= qmap[codes + step], step, 0)
    codes_up = (codes + 1).clip(max=255)
    val_down = qmap[codes]
    val_up = qmap[codes_up]
    residual = x - val_down
    codes = torch.where(residual >= (val_up - val_down) * 0.5, codes_up, codes)
    return codes.to(torch.uint8), scale


def dequantize(codes, qmap, scale, block=256):
    return (qmap[codes.long()].view(-1, block) * scale.view(-1, 1)).view(-1)


def dyadic(a, b, c, k, shift):
    """An exactly representable value from integers (adamw8bit_golden.hpp: golden_value)."""
    h = (a * 2654435761 + b * 40503 + c * 97 + k * 2246822519) % 4294967296
    h ^= h >> 15
    h = (h * 2246822519) % 4294967296
    h ^= h >> 13
    mant = (h % 65536) - 32768          # -32768 .. 32767
    exp = shift + (h >> 16) % 8          # spread magnitudes over 8 binades
    return mant * 2.0 ** (-15 - exp)


def f32(x):
    return torch.tensor(x, dtype=torch.float64).to(torch.float32)


def main(out):
    qs = create_dynamic_map(True)
    qu = create_dynamic_map(False)
    for name, q in (("qmap_signed.bin", qs), ("qmap_unsigned.bin", qu)):
        with open(f"{out}/{name}", "wb") as f:
            f.write(q.numpy().astype("<f4").tobytes())
    with open(f"{out}/qmap_f64_differences.txt", "w") as f:
        for signed, q in ((True, qs), (False, qu)):
            q64 = create_dynamic_map(signed, dtype=torch.float64)
            f.write(f"signed={signed}: {(q64 != q).sum().item()} of 256 entries differ\n")

    # Quantization cases: 24 blocks, magnitudes from 2^-30 to 2^10, with exact ties.
    blocks = []
    for b in range(24):
        vals = [dyadic(7, b, 0, k, b - 10) for k in range(256)]
        blocks.append(vals)
    x = torch.tensor(blocks, dtype=torch.float64).to(torch.float32).view(-1)
    # Block 0: the midpoints between neighbouring codes, scaled by an absmax of 1 (entry 255).
    mids = [(qs[i].item() + qs[i + 1].item()) / 2 for i in range(255)] + [1.0]
    x[0:256] = torch.tensor(mids, dtype=torch.float64).to(torch.float32)
    cs, ss = quantize(x, qs)
    xu = x.abs()
    cu, su = quantize(xu, qu)
    with open(f"{out}/quant_cases.bin", "wb") as f:
        f.write(struct.pack("<I", x.numel()))
        f.write(x.numpy().astype("<f4").tobytes())
        f.write(cs.numpy().tobytes())
        f.write(ss.numpy().astype("<f4").tobytes())
        f.write(cu.numpy().tobytes())
        f.write(su.numpy().astype("<f4").tobytes())

    # Ten steps.
    shapes = [6 * 1024, 3 * 1024, 5000, 300]
    lr, b1, b2, eps, wd, threshold = 1e-3, 0.9, 0.999, 1e-8, 0.01, 4096
    params, state = [], []
    for i, n in enumerate(shapes):
        params.append(torch.tensor([dyadic(1, 0, i, k, 0) for k in range(n)],
                                   dtype=torch.float64).to(torch.float32))
        if n >= threshold:
            padded = (n + 255) // 256 * 256
            z = torch.zeros(padded, dtype=torch.float32)
            state.append(("8bit", quantize(z, qs), quantize(z, qu), padded))
        else:
            state.append(("f32", torch.zeros(n), torch.zeros(n), n))
    for step in range(1, 11):
        beta1, beta2 = f32(b1), f32(b2)
        omb1, omb2 = f32(1 - b1), f32(1 - b2)
        bc2 = f32(math.sqrt(1 - b2 ** step))
        step_size = f32(lr / (1 - b1 ** step))
        decay = f32(1 - lr * wd)
        epsf = f32(eps)
        for i, n in enumerate(shapes):
            g = torch.tensor([dyadic(2, step, i, k, 4) for k in range(n)],
                             dtype=torch.float64).to(torch.float32)
            kind, ms, vs, padded = state[i]
            if kind == "8bit":
                m = dequantize(ms[0], qs, ms[1])[:n]
                v = dequantize(vs[0], qu, vs[1])[:n]
            else:
                m, v = ms, vs
            p = params[i] * decay
            m = beta1 * m + omb1 * g
            v = beta2 * v + omb2 * (g * g)
            # torch.sqrt on the CPU (its AVX-512 path) is not correctly rounded: it differs
            # from IEEE sqrt in the last bit now and then (found on this very trajectory);
            # shardopt's kernels use the IEEE square root, as CUDA's sqrtf is. The float64
            # root rounded to float32 is the correctly rounded one.
            denom = torch.sqrt(v.double()).float() / bc2 + epsf
            p = p - step_size * (m / denom)
            params[i] = p
            if kind == "8bit":
                mp = torch.zeros(padded)
                vp = torch.zeros(padded)
                mp[:n] = m
                vp[:n] = v
                state[i] = (kind, quantize(mp, qs), quantize(vp, qu), padded)
            else:
                state[i] = (kind, m, v, n)
    with open(f"{out}/trajectory.bin", "wb") as f:
        for i, n in enumerate(shapes):
            f.write(params[i].numpy().astype("<f4").tobytes())
            kind, ms, vs, padded = state[i]
            if kind == "8bit":
                f.write(ms[0][:n].numpy().tobytes())
                f.write(ms[1].numpy().astype("<f4").tobytes())
                f.write(vs[0][:n].numpy().tobytes())
                f.write(vs[1].numpy().astype("<f4").tobytes())
            else:
                f.write(ms.numpy().astype("<f4").tobytes())
                f.write(vs.numpy().astype("<f4").tobytes())
    print("torch", torch.__version__, "wrote", out)


if __name__ == "__main__":
    main(sys.argv[1])
