"""Paged attention on a CUDA GPU: correctness first, then decode bandwidth.

    python benchmarks/attention_gpu.py            # on a machine with a CUDA GPU (a few minutes)
    python benchmarks/attention_gpu.py --smoke    # tiny sizes under Triton's CPU interpreter:
                                                  # checks that the script runs, measures nothing

1. Correctness: ``store_kvcache`` must equal ``store_kvcache_ref`` bit for bit, and
   ``paged_attention`` must match ``paged_attention_ref`` computed in float64 (decode and
   prefill over a cached prefix; fp32/fp16/bf16; GQA 1 and 4; with and without KV splits) on
   caches whose unowned slots hold NaN. Any failure stops the script (exit code 1).
2. Bandwidth: decode (one query token per sequence) in bf16 with a Llama-3-8B / Qwen3-8B
   attention shape (32 query heads, 8 KV heads, head_dim 128), block_size 16, block tables in
   shuffled physical order. Each point is the median of ``triton.testing.do_bench`` (which
   flushes L2 between runs). Achieved GB/s counts the bytes the kernel must move: every K and
   V row of every context, plus q and the output. Next to it: the device-to-device copy
   bandwidth measured in the same run (bytes read + bytes written per second), and torch's
   ``scaled_dot_product_attention`` over the same K/V already gathered into contiguous
   ``[batch, kv_heads, context, head_dim]`` tensors (the gather is not timed).

A short sweep of launch settings at the target point (batch 64, context 4096) picks the
settings used for the table; the script prints the sweep, the table and whether the kernel
reaches 80% of the copy bandwidth at the target point.
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # run from a plain checkout too

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--smoke", action="store_true",
                    help="tiny sizes under the CPU interpreter (runs the code paths, measures nothing)")
parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 64, 256])
parser.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 8192, 32768])
parser.add_argument("--no-sweep", action="store_true", help="use the default launch settings")
ARGS = parser.parse_args()
if ARGS.smoke:
    os.environ["TRITON_INTERPRET"] = "1"        # before the kernels module is imported

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from course_pkg.kernels import paged_attention_ref, store_kvcache_ref  # noqa: E402
from course_pkg.kernels.triton_kernels import (  # noqa: E402
    INTERPRET, choose_num_splits, launch_paged_attention, store_kvcache)

if ARGS.smoke:
    DEVICE = "cpu"
    NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 4, 2, 32, 16
    BATCHES, CONTEXTS, TARGET = [1, 4], [32, 64], (4, 64)
else:
    if not torch.cuda.is_available() or INTERPRET:
        sys.exit("No CUDA GPU here (or TRITON_INTERPRET=1 is set): nothing to measure. "
                 "Run with --smoke to check the script under the interpreter.")
    DEVICE = "cuda"
    NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
    BATCHES, CONTEXTS, TARGET = ARGS.batches, ARGS.contexts, (64, 4096)
TARGET_FRACTION = 0.80


def bench_ms(fn) -> float:
    """Median milliseconds per call: do_bench on a GPU, a wall clock under the interpreter."""
    if DEVICE == "cuda":
        import triton.testing
        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
    fn()
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


# ----------------------------------------------------------------------------- 1. correctness

def random_case(gen, dtype, block_size, context_lens, q_lens, num_kv_heads, group, head_dim):
    """Shuffled block tables; every slot no sequence owns is NaN."""
    per_seq = [math.ceil(c / block_size) for c in context_lens]
    num_blocks = sum(per_seq) + 2
    physical = torch.randperm(num_blocks, generator=gen).tolist()
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    tables = torch.full((len(context_lens), max(per_seq)), -1, dtype=torch.int32)
    for i, (ctx, n) in enumerate(zip(context_lens, per_seq)):
        table, physical = physical[:n], physical[n:]
        tables[i, :n] = torch.tensor(table, dtype=torch.int32)
        slots = torch.tensor([table[t // block_size] * block_size + t % block_size for t in range(ctx)])
        kv = torch.randn(2, ctx, num_kv_heads, head_dim, generator=gen)
        store_kvcache_ref(kv[0], kv[1], k_cache, v_cache, slots)
    q = torch.randn(sum(q_lens), num_kv_heads * group, head_dim, generator=gen).to(dtype)
    cu = torch.tensor([0] + [sum(q_lens[:i + 1]) for i in range(len(q_lens))], dtype=torch.int32)
    return [t.to(DEVICE) for t in (q, k_cache, v_cache, tables,
                                   torch.tensor(context_lens, dtype=torch.int32), cu)]


def check_correctness() -> bool:
    gen = torch.Generator().manual_seed(0)
    ok = True
    print("correctness (relative error vs float64 reference; limits 1e-5 fp32, 1e-2 fp16/bf16)")
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        # store_kvcache: bit-exact, slot -1 skipped
        k_cache = torch.randn(8, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
        v_cache = torch.randn(8, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
        kv = torch.randn(2, 10, NUM_KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
        slots = torch.randperm(8 * BLOCK_SIZE, generator=gen)[:10]
        slots[::3] = -1
        k_ref, v_ref = k_cache.clone(), v_cache.clone()
        store_kvcache_ref(kv[0], kv[1], k_ref, v_ref, slots)
        k_dev, v_dev = k_cache.to(DEVICE), v_cache.to(DEVICE)
        store_kvcache(kv[0].to(DEVICE), kv[1].to(DEVICE), k_dev, v_dev, slots.to(DEVICE))
        same = torch.equal(k_dev.cpu(), k_ref) and torch.equal(v_dev.cpu(), v_ref)
        ok &= same
        print(f"  store_kvcache {str(dtype):15s} bit-exact: {same}")
        limit = 1e-5 if dtype == torch.float32 else 1e-2
        bs, long = BLOCK_SIZE, (40 if DEVICE == "cpu" else 300)
        for group in (1, 4):
            for kind, contexts, q_lens in (("decode", [1, bs - 1, bs, bs + 1, long], [1] * 5),
                                           ("prefill", [1, bs - 1, bs + 1, long, 37], [1, bs - 1, 5, long - 10, 0])):
                for splits in (1, 3):
                    case = random_case(gen, dtype, bs, contexts, q_lens, 2, group, HEAD_DIM)
                    q = case[0]
                    out = torch.full_like(q, float("nan"))
                    launch_paged_attention(out, *case, HEAD_DIM ** -0.5, max_q_len=max(q_lens),
                                           num_splits=splits)
                    ref = paged_attention_ref(*[t.cpu().double() if t.is_floating_point() else t.cpu()
                                                for t in case], HEAD_DIM ** -0.5)
                    err = ((out.cpu().double() - ref).abs().max() / ref.abs().max()).item()
                    good = not out.isnan().any().item() and err < limit
                    ok &= good
                    print(f"  paged_attention {str(dtype):15s} {kind:7s} GQA {group} splits {splits}: "
                          f"rel err {err:.1e} {'ok' if good else 'FAILED'}")
    return ok


# ------------------------------------------------------------------------------- 2. bandwidth

def copy_bandwidth_gbs() -> float:
    n = (1 << 30) // 2 if DEVICE == "cuda" else 1 << 20
    src = torch.randn(n, device=DEVICE).to(torch.bfloat16)
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src))
    return 2 * src.numel() * src.element_size() / ms / 1e6


class DecodePoint:
    """One (batch, context) decode problem over a shared pool of physical blocks."""

    def __init__(self, k_cache, v_cache, batch, context, gen):
        self.batch, self.context = batch, context
        blocks_per_seq = math.ceil(context / BLOCK_SIZE)
        num_blocks = k_cache.shape[0]
        perm = torch.randperm(num_blocks, generator=gen)[: batch * blocks_per_seq]
        self.block_tables = perm.view(batch, blocks_per_seq).to(torch.int32).to(DEVICE)
        self.context_lens = torch.full((batch,), context, dtype=torch.int32, device=DEVICE)
        self.cu_seqlens_q = torch.arange(batch + 1, dtype=torch.int32, device=DEVICE)
        self.q = torch.randn(batch, NUM_HEADS, HEAD_DIM, generator=gen).to(torch.bfloat16).to(DEVICE)
        self.out = torch.empty_like(self.q)
        self.k_cache, self.v_cache = k_cache, v_cache
        self.num_splits = choose_num_splits(self.q, k_cache, batch, 1, context)
        element = k_cache.element_size()
        self.bytes = (2 * batch * context * NUM_KV_HEADS * HEAD_DIM + 2 * self.q.numel()) * element

    def triton(self, **settings):
        settings.setdefault("num_splits", self.num_splits)
        return lambda: launch_paged_attention(
            self.out, self.q, self.k_cache, self.v_cache, self.block_tables, self.context_lens,
            self.cu_seqlens_q, HEAD_DIM ** -0.5, max_q_len=1, **settings)

    def gathered(self, cache):
        """[batch, kv_heads, context, head_dim], contiguous: what SDPA reads."""
        g = cache[self.block_tables.long()].flatten(1, 2)[:, : self.context]
        return g.transpose(1, 2).contiguous()

    def sdpa(self):
        k, v = self.gathered(self.k_cache), self.gathered(self.v_cache)
        q = self.q.unsqueeze(2)                                   # [batch, heads, 1, head_dim]
        try:
            F.scaled_dot_product_attention(q, k, v, scale=HEAD_DIM ** -0.5, enable_gqa=True)
            return lambda: F.scaled_dot_product_attention(q, k, v, scale=HEAD_DIM ** -0.5, enable_gqa=True)
        except (TypeError, RuntimeError):       # torch < 2.5 has no enable_gqa: repeat the KV heads
            group = NUM_HEADS // NUM_KV_HEADS
            k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
            return lambda: F.scaled_dot_product_attention(q, k, v, scale=HEAD_DIM ** -0.5)


def sweep(point: DecodePoint) -> dict:
    """A handful of launch settings at the target point; returns the fastest."""
    grid = [dict(block_n=bn, num_warps=w, num_stages=s)
            for bn, w, s in ((32, 4, 3), (64, 4, 2), (64, 4, 3), (64, 8, 3), (128, 4, 3), (128, 8, 3))]
    if DEVICE == "cpu":
        grid = grid[:2]
    print(f"\nlaunch settings at batch {point.batch}, context {point.context} "
          f"(splits {point.num_splits}):")
    best, best_ms = {}, float("inf")
    for settings in grid:
        try:
            ms = bench_ms(point.triton(**settings))
        except Exception as exc:          # e.g. out of shared memory for big tiles
            print(f"  {settings}: failed ({type(exc).__name__})")
            continue
        print(f"  {settings}: {ms * 1e3:8.1f} us  {point.bytes / ms / 1e6:7.0f} GB/s")
        if ms < best_ms:
            best, best_ms = settings, ms
    return best


def main() -> int:
    torch.manual_seed(0)
    if DEVICE == "cuda":
        print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}, "
              f"triton {__import__('triton').__version__}")
    else:
        print("SMOKE RUN under Triton's CPU interpreter: the timings below say nothing about a GPU.")
    if not check_correctness():
        print("correctness FAILED: no timings")
        return 1

    copy_gbs = copy_bandwidth_gbs()
    print(f"\ndevice-to-device copy bandwidth (read + write): {copy_gbs:.0f} GB/s")

    # one pool of physical blocks, big enough for the largest point that fits in memory
    per_token = 2 * NUM_KV_HEADS * HEAD_DIM * 2                         # K + V, bf16
    budget = (torch.cuda.mem_get_info()[0] * 0.3) if DEVICE == "cuda" else 1 << 28
    points = [(b, c) for b in BATCHES for c in CONTEXTS]
    fits = [(b, c) for b, c in points if b * c * per_token <= budget]
    max_tokens = max(b * math.ceil(c / BLOCK_SIZE) * BLOCK_SIZE for b, c in fits)
    num_blocks = max_tokens // BLOCK_SIZE
    k_cache = torch.randn(num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, device=DEVICE, dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    gen = torch.Generator().manual_seed(1)

    settings = {}
    if not ARGS.no_sweep and TARGET in fits:
        settings = sweep(DecodePoint(k_cache, v_cache, *TARGET, gen))
    print(f"\ndecode, bf16, {NUM_HEADS} query heads / {NUM_KV_HEADS} KV heads, head_dim {HEAD_DIM}, "
          f"block_size {BLOCK_SIZE}; launch settings {settings or 'default'}")
    print(f"{'batch':>5} {'context':>7} {'splits':>6} {'triton us':>10} {'GB/s':>6} {'% copy':>6} "
          f"{'SDPA us':>9} {'GB/s':>6} {'triton/SDPA':>11}")
    target_fraction = None
    for batch, context in points:
        if (batch, context) not in fits:
            print(f"{batch:>5} {context:>7}  skipped: K+V would not fit the memory budget")
            continue
        point = DecodePoint(k_cache, v_cache, batch, context, gen)
        ms = bench_ms(point.triton(**settings))
        gbs = point.bytes / ms / 1e6
        try:
            sdpa_ms = bench_ms(point.sdpa())
            sdpa = f"{sdpa_ms * 1e3:9.1f} {point.bytes / sdpa_ms / 1e6:6.0f} {sdpa_ms / ms:10.2f}x"
        except torch.cuda.OutOfMemoryError:
            sdpa = f"{'(no memory for the gathered copy)':>28}"
        except RuntimeError as exc:             # no SDPA backend for this shape: say which
            sdpa = f"  SDPA failed: {str(exc).splitlines()[0][:60]}"
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
        print(f"{batch:>5} {context:>7} {point.num_splits:>6} {ms * 1e3:10.1f} {gbs:6.0f} "
              f"{gbs / copy_gbs:6.0%} {sdpa}")
        if (batch, context) == TARGET:
            target_fraction = gbs / copy_gbs
    if ARGS.smoke:
        print("\nsmoke run: every code path ran; the figures above mean nothing (CPU interpreter)")
    elif target_fraction is not None:
        verdict = "MET" if target_fraction >= TARGET_FRACTION else "NOT MET"
        print(f"\ntarget: batch {TARGET[0]}, context {TARGET[1]} reaches {target_fraction:.0%} of the "
              f"copy bandwidth (goal >= {TARGET_FRACTION:.0%}): {verdict}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
