#!/usr/bin/env python3
"""PyTorch BF16 baseline for the GPU benchmark: one layer of decode attention,
q [B, 32, 1, 128], k/v [B, 8, S, 128], torch scaled_dot_product_attention with
enable_gqa=True under SDPBackend.CUDNN_ATTENTION, at the shapes of
gpu_bench.cc. CUDA events around each call after warm-up, medians, timed twice:
calls issued one by one (sdpa_us) and batches queued behind a spin kernel (GPU
side, sdpa_gpu_us); k/v rotate
over several buffers so that L2 never holds them; random inputs.

usage: sdpa_baseline.py --json sdpa.json [--iters 200] [--q-heads 32]
(--q-heads: query heads over the 8 kv heads, as gpu_bench's --q-heads)
"""
import argparse
import json
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

SHAPES = [(1, 8192), (1, 32768), (1, 65536), (1, 131072), (8, 32768), (8, 65536)]
L2_BYTES = 60 << 20


def time_events(fn, warmup, iters):
    for i in range(warmup):
        fn(i)
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for i in range(iters):
        starts[i].record()
        fn(i)
        ends[i].record()
    torch.cuda.synchronize()
    t = sorted(s.elapsed_time(e) * 1000.0 for s, e in zip(starts, ends))
    return t[len(t) // 2]


def time_events_queued(fn, warmup, iters, batch=25):
    """GPU-side time: each batch of calls is queued behind a spin kernel, so
    the events time the GPU's work alone, not Python's launch calls."""
    for i in range(warmup):
        fn(i)
    t = []
    for b0 in range(0, iters, batch):
        n = min(batch, iters - b0)
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
        torch.cuda._sleep(20_000_000)  # ~10 ms: longer than enqueueing the batch
        for j in range(n):
            starts[j].record()
            fn(b0 + j)
            ends[j].record()
        torch.cuda.synchronize()
        t += [s.elapsed_time(e) * 1000.0 for s, e in zip(starts, ends)]
    t.sort()
    return t[len(t) // 2]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", required=True)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--q-heads", type=int, default=32)
    args = ap.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "sdpa_us": {},
           "sdpa_gpu_us": {}, "q_heads": args.q_heads}

    n = 1 << 28  # 512 MiB of bf16
    a = torch.empty(n, dtype=torch.bfloat16, device=dev).normal_()
    b = torch.empty_like(a)
    us = time_events(lambda i: b.copy_(a), 3, 20)
    out["copy_gbs"] = 2 * a.numel() * 2 / us / 1e3
    del a, b
    print(f"torch copy bandwidth (read+write): {out['copy_gbs']:.0f} GB/s")

    print(f"{'shape':<10} {'sdpa_us':>9} {'gpu_us':>9} {'sets':>5} {'GB/s':>7}")
    for batch, s in SHAPES:
        kv_bytes = 2 * batch * 8 * s * 128 * 2
        sets = max(2, min(8, (4 * L2_BYTES) // kv_bytes + 1))
        q = torch.randn(batch, args.q_heads, 1, 128, dtype=torch.bfloat16, device=dev)
        ks = [torch.randn(batch, 8, s, 128, dtype=torch.bfloat16, device=dev) for _ in range(sets)]
        vs = [torch.randn(batch, 8, s, 128, dtype=torch.bfloat16, device=dev) for _ in range(sets)]
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            def call(i):
                F.scaled_dot_product_attention(q, ks[i % sets], vs[i % sets], enable_gqa=True)
            us = time_events(call, 3 * sets, args.iters)
            gpu_us = time_events_queued(call, 3 * sets, args.iters)
        key = f"B{batch}_S{s}"
        out["sdpa_us"][key] = us
        out["sdpa_gpu_us"][key] = gpu_us
        print(f"{key:<10} {us:9.1f} {gpu_us:9.1f} {sets:5d} {kv_bytes / us / 1e3:7.0f}")
        del ks, vs
        torch.cuda.empty_cache()
    with open(args.json, "w") as f:
        json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
