"""Chapter 05 labs: the store-KV kernel and paged decode attention, written in Triton.

Importing this module imports the package's Triton kernels first, which switches Triton to
its CPU interpreter when there is no GPU (it must happen before any ``@triton.jit`` runs).

A student writes a ``@triton.jit`` kernel with the lab's signature (see the two stubs below);
``store_kvcache_from_kernel`` / ``paged_decode_from_kernel`` launch it behind the signature of
the package's ``store_kvcache`` / ``paged_attention``, so one grader judges a student's kernel
and the package's own. The graders compare with the pure-torch references -- attention in
float64 -- on caches whose unowned slots hold NaN, so a read outside a sequence's context
shows up in the output.
"""
from __future__ import annotations

import torch

from course_pkg.kernels import triton_kernels  # noqa: F401 -- first: sets TRITON_INTERPRET before triton
from course_pkg.kernels import paged_attention_ref, store_kvcache_ref
from course_pkg.labs.lab import Grading

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

#: Where the graders put their tensors: the CPU under the interpreter, else the GPU.
DEVICE = "cpu" if triton_kernels.INTERPRET else "cuda"


# ---------------------------------------------------------------- the stubs

@triton.jit
def student_store_kvcache_kernel(key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
                                 block_size, stride_block, stride_slot,
                                 NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Program ``i`` stores new token ``i``: its K and V rows (``[NUM_KV_HEADS, HEAD_DIM]``, at
    ``key_ptr + i * NUM_KV_HEADS * HEAD_DIM``) go to slot ``slot_mapping[i]``, i.e. block
    ``slot // block_size``, offset ``slot % block_size``; slot -1 means "store nothing".
    In the caches a block starts every ``stride_block`` elements and an offset every
    ``stride_slot``; inside that row, head ``h`` dim ``d`` is at ``h * HEAD_DIM + d``."""
    ...


@triton.jit
def student_paged_decode_kernel(out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr,
                                context_lens_ptr, scale, max_blocks_per_seq, block_size,
                                GROUP: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
                                HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr):
    """Program ``(s, h)``: the attention output of sequence ``s``'s one new token, query head ``h``.

    ``q``/``out``: ``[num_seqs, NUM_KV_HEADS * GROUP, HEAD_DIM]``, contiguous. Caches:
    ``[num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM]``, contiguous; head ``h`` reads KV head
    ``h // GROUP``. Sequence ``s`` has ``context_lens[s]`` tokens in the cache (its new one
    included), token ``t`` in block ``block_tables[s * max_blocks_per_seq + t // block_size]`` at
    offset ``t % block_size``. Loop over the context ``BLOCK_N`` positions at a time with an
    online softmax of ``scale * q . k``; never read a position past the context."""
    ...


# ---------------------------------------------------------------- launching a lab-shaped kernel

def _is_kernel(obj) -> bool:
    kinds = [triton.runtime.JITFunction]
    interpreted = getattr(triton.runtime.interpreter, "InterpretedFunction", None)
    if interpreted is not None:
        kinds.append(interpreted)
    return isinstance(obj, tuple(kinds))


def store_kvcache_from_kernel(kernel):
    """``store_kvcache(key, value, k_cache, v_cache, slot_mapping)`` running ``kernel``."""
    def store_kvcache(key, value, k_cache, v_cache, slot_mapping):
        num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
        if k_cache.stride() != v_cache.stride() or k_cache.stride()[2:] != (head_dim, 1):
            raise ValueError("the lab's kernel needs K and V caches with equal strides and contiguous rows")
        key = key.to(k_cache.dtype).contiguous()
        value = value.to(v_cache.dtype).contiguous()
        if key.shape[0]:
            kernel[(key.shape[0],)](key, value, k_cache, v_cache, slot_mapping.contiguous(),
                                    block_size, k_cache.stride(0), k_cache.stride(1),
                                    NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim)
    return store_kvcache


def paged_decode_from_kernel(kernel, block_n: int = 8):
    """``paged_attention(q, k_cache, v_cache, block_tables, context_lens, cu_seqlens_q, scale)``
    for decode steps (one query token per sequence), running ``kernel``."""
    def paged_attention(q, k_cache, v_cache, block_tables, context_lens, cu_seqlens_q, scale):
        num_seqs, num_heads, head_dim = q.shape
        if cu_seqlens_q.tolist() != list(range(num_seqs + 1)):
            raise ValueError("the lab's kernel computes decode steps: one query token per sequence")
        num_kv_heads = k_cache.shape[2]
        out = torch.full_like(q, float("nan")).contiguous()
        tables = block_tables.to(torch.int32).contiguous()
        kernel[(num_seqs, num_heads)](out, q.contiguous(), k_cache.contiguous(), v_cache.contiguous(),
                                      tables, context_lens.to(torch.int32).contiguous(), scale,
                                      tables.shape[1], k_cache.shape[1],
                                      GROUP=num_heads // num_kv_heads, NUM_KV_HEADS=num_kv_heads,
                                      HEAD_DIM=head_dim, BLOCK_N=block_n)
        return out
    return paged_attention


# ---------------------------------------------------------------- graders

SENTINEL = -7.0


def grade_store_kvcache(impl, g: Grading) -> None:
    store = store_kvcache_from_kernel(impl) if _is_kernel(impl) else impl
    cases = [
        ("5 tokens into shuffled blocks, one padding slot (block size 4)", 4, 6, 0, torch.float32,
         [9, 22, 3, -1, 17]),
        ("block size 7, rows padded in memory (a strided cache), the pool's last slot", 7, 5, 1,
         torch.float32, [34, 0, 7, 13, -1, 20]),
        ("block size 1, float16", 1, 4, 0, torch.float16, [3, 0, 2]),
    ]
    gen = torch.Generator().manual_seed(0)
    for name, bs, num_blocks, pad, dtype, slots in cases:
        with g.scenario(name):
            kv_heads, head_dim = 2, 16
            storage = torch.full((2, num_blocks, bs + pad, kv_heads, head_dim), SENTINEL, dtype=dtype,
                                 device=DEVICE)
            k_cache, v_cache = storage[0, :, :bs], storage[1, :, :bs]
            key = torch.randn(len(slots), kv_heads, head_dim, generator=gen).to(DEVICE, dtype)
            value = torch.randn(len(slots), kv_heads, head_dim, generator=gen).to(DEVICE, dtype)
            slot_mapping = torch.tensor(slots, dtype=torch.int64, device=DEVICE)
            expected = storage.clone()            # by hand: token t's rows at (slot // bs, slot % bs)
            for t, slot in enumerate(slots):
                if slot >= 0:
                    expected[0, slot // bs, slot % bs] = key[t]
                    expected[1, slot // bs, slot % bs] = value[t]
            store(key, value, k_cache, v_cache, slot_mapping)
            for t, slot in enumerate(slots):
                if slot < 0:
                    continue
                for cache, src, label in ((k_cache, key, "K"), (v_cache, value, "V")):
                    g.check(torch.equal(cache[slot // bs, slot % bs], src[t]),
                            f"{label} of token {t} is not at block {slot // bs}, offset {slot % bs} (slot {slot})")
            changed = (storage != expected).any(dim=-1).any(dim=-1).nonzero().tolist()
            g.check(not changed, f"cache rows [K/V, block, offset] {changed[:4]} hold what the reference does "
                                 "not write there (a padding token stored, or a wrong address)")


def _attention_case(gen, *, block_size, context_lens, num_kv_heads, group, head_dim=16, q_scale=1.0):
    """Decode inputs over a paged cache: shuffled blocks; unowned slots and an extra poison block
    hold NaN; block tables are padded with the poison block's id (never a valid read)."""
    blocks_per_seq = [-(-c // block_size) for c in context_lens]
    num_blocks = sum(blocks_per_seq) + 1
    poison = num_blocks - 1
    physical = torch.randperm(num_blocks - 1, generator=gen).tolist()
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"))
    v_cache = torch.full(shape, float("nan"))
    tables = torch.full((len(context_lens), max(blocks_per_seq) + 1), poison, dtype=torch.int32)
    for i, (ctx, n) in enumerate(zip(context_lens, blocks_per_seq)):
        table, physical = physical[:n], physical[n:]
        tables[i, :n] = torch.tensor(table, dtype=torch.int32)
        slots = torch.tensor([table[t // block_size] * block_size + t % block_size for t in range(ctx)])
        kv = torch.randn(2, ctx, num_kv_heads, head_dim, generator=gen)
        store_kvcache_ref(kv[0], kv[1], k_cache, v_cache, slots)
    q = torch.randn(len(context_lens), num_kv_heads * group, head_dim, generator=gen) * q_scale
    case = dict(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=tables,
                context_lens=torch.tensor(context_lens, dtype=torch.int32),
                cu_seqlens_q=torch.arange(len(context_lens) + 1, dtype=torch.int32))
    return {**{k: v.to(DEVICE) for k, v in case.items()}, "scale": head_dim ** -0.5}


def _compare_attention(g: Grading, out: torch.Tensor, case: dict, tolerance: float = 1e-4) -> None:
    wide = {k: (v.cpu().double() if v.is_floating_point() else v.cpu()) if torch.is_tensor(v) else v
            for k, v in case.items()}
    expected = paged_attention_ref(**wide)                        # float64, on the CPU
    g.equal(tuple(out.shape), tuple(expected.shape), "output shape")
    error = (out.cpu().double() - expected).abs().amax(dim=-1)    # [num_seqs, num_heads]
    error = torch.where(torch.isnan(error), torch.full_like(error, float("inf")), error)
    seq, head = divmod(int(error.argmax()), error.shape[1])
    worst = float(error[seq, head])
    if worst > tolerance:
        what = ("is NaN or inf (read a slot outside the context, or a row not written?)" if worst == float("inf")
                else f"differs from the float64 reference by {worst:.2e} (tolerance {tolerance:.0e})")
        g.fail(f"output of sequence {seq} (context {int(case['context_lens'][seq])}), head {head} {what}")


def grade_paged_attention(impl, g: Grading) -> None:
    attend = paged_decode_from_kernel(impl) if _is_kernel(impl) else impl
    gen = torch.Generator().manual_seed(0)
    scenarios = [
        ("decode over 1, 5 and 23 tokens (block size 4, 2 query heads per KV head)",
         dict(block_size=4, context_lens=[1, 5, 23], num_kv_heads=2, group=2)),
        ("block size 7, contexts 7, 8, 14 and 30, 4 query heads per KV head",
         dict(block_size=7, context_lens=[7, 8, 14, 30], num_kv_heads=1, group=4)),
        ("large scores (q x 30): the online softmax stays finite (block size 4)",
         dict(block_size=4, context_lens=[19, 9], num_kv_heads=2, group=1, q_scale=30.0)),
    ]
    for name, kwargs in scenarios:
        with g.scenario(name):
            case = _attention_case(gen, **kwargs)
            _compare_attention(g, attend(**case), case)
    with g.scenario("one token in the cache: the output is its value, whatever the scale (block size 4)"):
        case = _attention_case(gen, block_size=4, context_lens=[1, 1], num_kv_heads=2, group=2)
        out = attend(**case)
        for s in range(2):
            block = int(case["block_tables"][s, 0])
            for h in range(4):
                value = case["v_cache"][block, 0, h // 2]          # by hand: softmax over one score is 1
                g.check(torch.allclose(out[s, h].cpu(), value.cpu(), atol=1e-6),
                        f"output of sequence {s}, head {h} is not the value of its one token (KV head {h // 2})")


# ---------------------------------------------------------------- mutants

@triton.jit
def _store_kernel_with_bug(key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
                           block_size, stride_block, stride_slot,
                           NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BUG: tl.constexpr):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token)
    if slot >= 0:
        i = tl.arange(0, NUM_KV_HEADS * HEAD_DIM)
        if BUG == 1:      # the address as if blocks were packed back to back
            row = slot * stride_slot
        else:
            row = (slot // block_size) * stride_block + (slot % block_size) * stride_slot
        k = tl.load(key_ptr + token * NUM_KV_HEADS * HEAD_DIM + i)
        v = tl.load(value_ptr + token * NUM_KV_HEADS * HEAD_DIM + i)
        tl.store(k_cache_ptr + row + i, k)
        if BUG == 2:      # copy-paste: the key goes into the value cache too
            tl.store(v_cache_ptr + row + i, k)
        else:
            tl.store(v_cache_ptr + row + i, v)


@triton.jit
def _decode_kernel_with_bug(out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr,
                            context_lens_ptr, scale, max_blocks_per_seq, block_size,
                            GROUP: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                            BLOCK_N: tl.constexpr, BUG: tl.constexpr):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    if BUG == 3:          # GQA: query heads dealt round-robin instead of in groups
        kv_head = head % NUM_KV_HEADS
    else:
        kv_head = head // GROUP
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + (seq * NUM_KV_HEADS * GROUP + head) * HEAD_DIM + d)
    if BUG == 1:          # the softmax scale forgotten
        q_scale = 1.0
    else:
        q_scale = scale
    context_len = tl.load(context_lens_ptr + seq)
    m_i = tl.max(tl.full([BLOCK_N], -1.0e30, tl.float32), 0)
    l_i = tl.sum(tl.zeros([BLOCK_N], tl.float32), 0)
    acc = tl.zeros([HEAD_DIM], tl.float32)
    for start in range(0, context_len, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        if BUG == 2:      # off by one: the position just past the context is read
            valid = pos <= context_len
        else:
            valid = pos < context_len
        block = tl.load(block_tables_ptr + seq * max_blocks_per_seq + pos // block_size, mask=valid, other=0)
        row = ((block * block_size + pos % block_size) * NUM_KV_HEADS + kv_head) * HEAD_DIM
        k = tl.load(k_cache_ptr + row[:, None] + d[None, :], mask=valid[:, None], other=0.0)
        v = tl.load(v_cache_ptr + row[:, None] + d[None, :], mask=valid[:, None], other=0.0)
        s = tl.where(valid, tl.sum(k * q[None, :], 1) * q_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 0))
        if BUG == 4:      # no rescaling of what was summed under the old maximum
            alpha = 1.0
        else:
            alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new)
        l_i = l_i * alpha + tl.sum(p, 0)
        acc = acc * alpha + tl.sum(p[:, None] * v, 0)
        m_i = m_new
    tl.store(out_ptr + (seq * NUM_KV_HEADS * GROUP + head) * HEAD_DIM + d, acc / l_i)


def _with_bug(kernel, bug: int):
    """``kernel`` with its ``BUG`` constant fixed: a kernel with the lab's signature."""
    class Bugged:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: kernel[grid](*args, BUG=bug, **kwargs)
    return Bugged()


store_ignoring_block_stride = store_kvcache_from_kernel(_with_bug(_store_kernel_with_bug, 1))
store_key_into_both_caches = store_kvcache_from_kernel(_with_bug(_store_kernel_with_bug, 2))
decode_without_scale = paged_decode_from_kernel(_with_bug(_decode_kernel_with_bug, 1))
decode_off_by_one_mask = paged_decode_from_kernel(_with_bug(_decode_kernel_with_bug, 2))
decode_round_robin_gqa = paged_decode_from_kernel(_with_bug(_decode_kernel_with_bug, 3))
decode_without_rescale = paged_decode_from_kernel(_with_bug(_decode_kernel_with_bug, 4))
# The same kernels with no bug: proof that the launchers accept a correct lab-shaped kernel.
store_lab_shaped = store_kvcache_from_kernel(_with_bug(_store_kernel_with_bug, 0))
decode_lab_shaped = paged_decode_from_kernel(_with_bug(_decode_kernel_with_bug, 0))
