"""Triton kernels for the paged KV cache: ``store_kvcache`` and ``paged_attention``.

Both have the signatures and semantics of ``store_kvcache_ref`` / ``paged_attention_ref`` in
``reference.py``, which documents the layout: ``k_cache``/``v_cache`` are
``[num_blocks, block_size, num_kv_heads, head_dim]``, and token ``t`` of a sequence lives in
physical block ``block_table[t // block_size]`` at offset ``t % block_size``.

Running without a GPU. Triton's interpreter executes the kernels on the CPU, program after
program, with numpy. It is chosen by the environment variable ``TRITON_INTERPRET=1``, which
Triton reads when ``@triton.jit`` decorates a function -- so it must be set before this module
runs its decorators, and before anything imports ``triton.language`` (whose own helpers,
``tl.zeros`` and friends, are jit functions decorated on first import). This module sets it
itself (unless you set it) when torch sees no CUDA device, and raises a clear ImportError if
triton was imported too early. The safe ways: import this module (or ``course_pkg.models``)
before transformers, or put ``TRITON_INTERPRET=1`` in the environment. To debug on a GPU
machine with the interpreter, start Python with ``TRITON_INTERPRET=1`` (and pass CPU tensors).

Three interpreter facts shape the code. Its bfloat16 arithmetic is wrong (values are held as
raw 16-bit integers), so under the interpreter every tile is converted to float32 right
after ``tl.load`` (``UPCAST``). Its float32 -> bfloat16 conversion truncates instead of
rounding to nearest even, so the wrappers never ask a kernel for that conversion under the
interpreter: torch does it. And an out-of-bounds load does not fail, it reads garbage, so
every load that can leave a tensor is masked.

Versions. GPU machines often carry an older Triton than the newest release (3.6 with torch
2.11 was seen), so the kernels use only long-standing APIs; ``tests/test_kernels.py`` compiles
them ahead of time for sm_90 with the installed Triton (checked with 3.6 and 3.9). One known
gap: Triton 3.6's *interpreter* cannot run a loop whose bounds are tensors once numpy is 2.4
or newer (it converts a 1-element array to an int), so on a CPU use the pinned Triton (3.9).
"""
from __future__ import annotations

import math
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")   # before the decorators below run

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
import triton.runtime.interpreter  # noqa: E402

#: True when the kernels run under Triton's CPU interpreter (decided once, at import).
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

# Triton's own helpers (tl.zeros, tl.cdiv, tl.max, ...) are jit functions too, decorated when
# triton.language is first imported. If that happened before TRITON_INTERPRET=1 was set (for
# example through torch._dynamo), every launch would fail deep
# inside the interpreter; say so now, with the fix.
if INTERPRET and not isinstance(tl.zeros, triton.runtime.interpreter.InterpretedFunction):
    raise ImportError(
        "triton was imported before TRITON_INTERPRET=1 was set, so its helpers are compiled for "
        "a GPU and the interpreter cannot run the kernels. Set TRITON_INTERPRET=1 in the "
        "environment before starting Python, or import course_pkg.kernels.triton_kernels (or "
        "course_pkg.models) before anything that imports triton, such as transformers.")

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# --------------------------------------------------------------------------------------------
# store_kvcache: one program per new token copies its K and V rows into the token's slot.
# --------------------------------------------------------------------------------------------

@triton.jit
def _store_kvcache_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    stride_key_n, stride_key_h, stride_key_d,
    stride_value_n, stride_value_h, stride_value_d,
    stride_kc_b, stride_kc_s, stride_kc_h, stride_kc_d,
    stride_vc_b, stride_vc_s, stride_vc_h, stride_vc_d,
    block_size, num_kv_heads, head_dim,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:             # -1: a padding token, nothing to store
        return
    # A slot is a (physical block, offset) pair: the same arithmetic the attention kernel
    # uses to read the token back.
    block_id = slot // block_size
    offset = slot % block_size
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < num_kv_heads) & (d < head_dim)     # BLOCK_H, BLOCK_D are powers of two
    k = tl.load(key_ptr + token * stride_key_n + h * stride_key_h + d * stride_key_d, mask=mask)
    v = tl.load(value_ptr + token * stride_value_n + h * stride_value_h + d * stride_value_d,
                mask=mask)
    # A pure copy (the wrapper matched the dtypes): no arithmetic, exact on every backend.
    tl.store(k_cache_ptr + block_id * stride_kc_b + offset * stride_kc_s
             + h * stride_kc_h + d * stride_kc_d, k, mask=mask)
    tl.store(v_cache_ptr + block_id * stride_vc_b + offset * stride_vc_s
             + h * stride_vc_h + d * stride_vc_d, v, mask=mask)


def store_kvcache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write ``key``/``value`` (``[N, num_kv_heads, head_dim]``) into their slots; -1 skips.

    Same contract as ``store_kvcache_ref``. ``key`` and ``value`` may be strided views (for
    example slices of a fused QKV projection); they are converted to the cache's dtype.
    """
    _check_cache_pair(k_cache, v_cache)
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    for name, t in (("key", key), ("value", value)):
        if t.dim() != 3 or tuple(t.shape[1:]) != (num_kv_heads, head_dim):
            raise ValueError(f"{name} must be [N, {num_kv_heads}, {head_dim}] to match the cache, "
                             f"got {tuple(t.shape)}")
        if t.dtype not in _DTYPES:
            raise TypeError(f"{name} has dtype {t.dtype}; supported: {_DTYPES}")
    if key.shape[0] != value.shape[0]:
        raise ValueError(f"key has {key.shape[0]} tokens but value has {value.shape[0]}")
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != key.shape[0]:
        raise ValueError(f"slot_mapping must be [{key.shape[0]}] (one slot per token), "
                         f"got {tuple(slot_mapping.shape)}")
    if slot_mapping.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"slot_mapping must be int32 or int64, got {slot_mapping.dtype}")
    _check_devices(key=key, value=value, k_cache=k_cache, v_cache=v_cache,
                   slot_mapping=slot_mapping)
    n = key.shape[0]
    if n == 0:
        return
    # The kernel only copies; a dtype change (rare: the model computes in the cache's dtype)
    # is done by torch, which rounds to nearest even on every backend.
    key, value = key.to(k_cache.dtype), value.to(v_cache.dtype)
    _store_kvcache_kernel[(n,)](
        key, value, k_cache, v_cache, slot_mapping,
        *key.stride(), *value.stride(), *k_cache.stride(), *v_cache.stride(),
        block_size, num_kv_heads, head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
    )


# --------------------------------------------------------------------------------------------
# paged_attention, built from two small pieces: addresses from the block table, and one step
# of the online softmax.
# --------------------------------------------------------------------------------------------

@triton.jit
def _block_and_offset(block_table_row_ptr, pos, pos_valid, block_size):
    """Where context positions ``pos`` live: (physical block, offset inside the block).

    Position ``t`` lives in block ``block_table[t // block_size]`` at offset
    ``t % block_size``. Positions past the context are masked: the block table holds -1
    there (or ends), and the cache has no such row.
    """
    block_id = tl.load(block_table_row_ptr + pos // block_size, mask=pos_valid, other=0)
    return block_id.to(tl.int64), (pos % block_size).to(tl.int64)


@triton.jit
def _online_softmax_step(m_i, l_i, acc, s, v):
    """Fold one tile of scores ``s`` (``[M, N]``, base-2 logits) and values ``v`` into the
    running max ``m_i``, running sum ``l_i`` and unnormalised output ``acc``.

    Invariant after each step: ``acc / l_i`` is the softmax-weighted mean of the values seen
    so far. A new maximum rescales what was summed before by ``2 ** (m_old - m_new)``.
    """
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    # p goes to the value dtype so fp16/bf16 use tensor cores; fp32 accumulates.
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    return m_new, l_i, acc


@triton.jit
def _paged_attention_kernel(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr,
    block_tables_ptr, context_lens_ptr, cu_seqlens_q_ptr,
    part_out_ptr, part_ml_ptr,
    qk_scale,
    stride_q_t, stride_q_h, stride_q_d,
    stride_o_t, stride_o_h, stride_o_d,
    stride_kc_b, stride_kc_s, stride_kc_h, stride_kc_d,
    stride_vc_b, stride_vc_s, stride_vc_h, stride_vc_d,
    stride_bt, block_size, head_dim, total_q, num_heads, sliding_window,
    GROUP: tl.constexpr, NUM_SPLITS: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """One program: one sequence, one KV head, ``BLOCK_M`` query rows, one KV split.

    GQA packing: the ``GROUP`` query heads that share a KV head are stacked as rows of one
    tile, so each K/V tile is loaded once for all of them. Row ``r`` is query token
    ``r // GROUP`` of the sequence and head ``kv_head * GROUP + r % GROUP``. Decode is the
    case ``q_len == 1`` (``GROUP`` rows); prefill stacks ``q_len * GROUP`` rows.
    ``sliding_window > 0`` (a local layer): a row at position ``i`` sees ``i - w + 1 .. i``, and the
    keys before the tile's first row's window are never loaded -- whole blocks skipped.
    """
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    q_tile = tl.program_id(2) // NUM_SPLITS
    split = tl.program_id(2) % NUM_SPLITS

    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    context_len = tl.load(context_lens_ptr + seq)
    if q_tile * BLOCK_M >= q_len * GROUP:      # this tile has no rows (short q_len)
        return

    rows = q_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    q_idx = rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_valid = q_idx < q_len
    # The query tokens are the last q_len positions of the context (causal bound per row).
    q_pos = context_len - q_len + q_idx
    d = tl.arange(0, BLOCK_D)
    d_valid = d < head_dim
    token = (q_start + q_idx).to(tl.int64)

    q = tl.load(q_ptr + token[:, None] * stride_q_t + head[:, None] * stride_q_h
                + d[None, :] * stride_q_d, mask=row_valid[:, None] & d_valid[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    # Keys this tile can see end after its last row's position; a split takes one chunk.
    last_row = tl.minimum(q_tile * BLOCK_M + BLOCK_M - 1, q_len * GROUP - 1)
    kv_end = tl.minimum(context_len, context_len - q_len + last_row // GROUP + 1)
    kv_start = 0   # and, in a local layer, they begin at the first row's window
    if sliding_window > 0:
        kv_start = tl.maximum(context_len - q_len + (q_tile * BLOCK_M) // GROUP - sliding_window + 1, 0)
    chunk = tl.cdiv(tl.cdiv(kv_end - kv_start, NUM_SPLITS), BLOCK_N) * BLOCK_N
    kv_lo = kv_start + split * chunk
    kv_hi = tl.minimum(kv_end, kv_lo + chunk)

    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)   # finite: an all-masked tile stays NaN-free
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    block_table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    k_head = k_cache_ptr + kv_head.to(tl.int64) * stride_kc_h
    v_head = v_cache_ptr + kv_head.to(tl.int64) * stride_vc_h

    for start in range(kv_lo, kv_hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        pos_valid = pos < kv_hi
        kv_mask = pos_valid[:, None] & d_valid[None, :]
        block_id, offset = _block_and_offset(block_table_row, pos, pos_valid, block_size)
        k_rows = block_id * stride_kc_b + offset * stride_kc_s
        v_rows = block_id * stride_vc_b + offset * stride_vc_s
        k = tl.load(k_head + k_rows[:, None] + d[None, :] * stride_kc_d, mask=kv_mask, other=0.0)
        v = tl.load(v_head + v_rows[:, None] + d[None, :] * stride_vc_d, mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale     # [BLOCK_M, BLOCK_N]
        visible = pos_valid[None, :] & (pos[None, :] <= q_pos[:, None])    # causal
        if sliding_window > 0:
            visible = visible & (pos[None, :] > q_pos[:, None] - sliding_window)
        s = tl.where(visible, s, float("-inf"))
        m_i, l_i, acc = _online_softmax_step(m_i, l_i, acc, s, v)

    if NUM_SPLITS == 1:
        l_safe = tl.where(l_i > 0, l_i, 1.0)
        o = acc / l_safe[:, None]
        tl.store(out_ptr + token[:, None] * stride_o_t + head[:, None] * stride_o_h
                 + d[None, :] * stride_o_d, o.to(out_ptr.dtype.element_ty),
                 mask=row_valid[:, None] & d_valid[None, :])
    else:
        # Partial results of this split, [NUM_SPLITS, total_q, num_heads, (BLOCK_D | 2)] float32,
        # merged by _merge_splits_kernel.
        row = (split * total_q + token) * num_heads + head
        tl.store(part_out_ptr + row[:, None] * BLOCK_D + d[None, :], acc, mask=row_valid[:, None])
        tl.store(part_ml_ptr + row * 2, m_i, mask=row_valid)
        tl.store(part_ml_ptr + row * 2 + 1, l_i, mask=row_valid)


@triton.jit
def _merge_splits_kernel(
    out_ptr, part_out_ptr, part_ml_ptr,
    stride_o_t, stride_o_h, stride_o_d, head_dim, total_q, num_heads,
    NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Combine the splits of one (query token, head): rescale each to the common max."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    sp = tl.arange(0, BLOCK_S)
    sp_valid = sp < NUM_SPLITS
    d = tl.arange(0, BLOCK_D)
    row = (sp * total_q + token) * num_heads + head
    m = tl.load(part_ml_ptr + row * 2, mask=sp_valid, other=-1.0e30)
    l_part = tl.load(part_ml_ptr + row * 2 + 1, mask=sp_valid, other=0.0)
    acc = tl.load(part_out_ptr + row[:, None] * BLOCK_D + d[None, :], mask=sp_valid[:, None], other=0.0)
    w = tl.exp2(m - tl.max(m, 0))
    o = tl.sum(acc * w[:, None], 0) / tl.sum(l_part * w, 0)
    tl.store(out_ptr + token * stride_o_t + head * stride_o_h + d * stride_o_d,
             o.to(out_ptr.dtype.element_ty), mask=d < head_dim)


def launch_paged_attention(out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor,
                           v_cache: torch.Tensor, block_tables: torch.Tensor,
                           context_lens: torch.Tensor, cu_seqlens_q: torch.Tensor, scale: float,
                           *, max_q_len: int, num_splits: int = 1, block_n: int | None = None,
                           num_warps: int | None = None, num_stages: int | None = None,
                           sliding_window: int | None = None) -> torch.Tensor:
    """Launch the attention kernel into ``out`` (``[total_q, num_heads, head_dim]``, any strides).

    The caller promises ``max_q_len`` (the longest ``q_len``), so this function never reads a
    device tensor back to the host -- what an engine or a benchmark wants. Shapes, dtypes and
    devices are checked; the *values* of the metadata are checked by ``paged_attention``.
    ``num_splits > 1`` splits each sequence's keys into chunks run by separate programs and
    merges them (flash-decoding): more parallelism when there are few sequences.
    """
    _check_attention_args(q, k_cache, v_cache, block_tables, context_lens, cu_seqlens_q)
    if out.shape != q.shape or out.dtype != q.dtype or out.device != q.device:
        raise ValueError(f"out must match q: shape {tuple(q.shape)}, {q.dtype}, {q.device}; "
                         f"got {tuple(out.shape)}, {out.dtype}, {out.device}")
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    total_q, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    num_seqs = context_lens.shape[0]
    if INTERPRET and num_seqs and max_q_len < int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max()):
        # a broken promise would leave rows unwritten; on the CPU checking it costs nothing
        raise ValueError(f"max_q_len={max_q_len} is smaller than the longest q_len in cu_seqlens_q")
    if total_q == 0 or max_q_len <= 0:
        return out
    # tl.dot needs every tile side >= 16 on GPUs; the interpreter uses the same sizes.
    block_m = max(16, min(64, triton.next_power_of_2(max_q_len * group)))
    block_d = max(16, triton.next_power_of_2(head_dim))
    if block_n is None:
        block_n = default_block_n(q.dtype)
    num_q_tiles = triton.cdiv(max_q_len * group, block_m)
    if num_splits > 1:
        part_out = torch.empty((num_splits, total_q, num_heads, block_d), dtype=torch.float32, device=q.device)
        part_ml = torch.empty((num_splits, total_q, num_heads, 2), dtype=torch.float32, device=q.device)
    else:
        part_out = part_ml = q       # unused: the kernel writes out directly
    # Under the interpreter a bf16 result is written as float32 and rounded by torch (see the
    # module docstring). The buffer starts as NaN so a row the kernel misses stays visible.
    target = out
    if INTERPRET and out.dtype == torch.bfloat16:
        target = torch.full(out.shape, float("nan"), dtype=torch.float32, device=out.device)
    launch = {}
    if num_warps is not None:
        launch["num_warps"] = num_warps
    if num_stages is not None:
        launch["num_stages"] = num_stages
    _paged_attention_kernel[(num_seqs, num_kv_heads, num_q_tiles * num_splits)](
        target, q, k_cache, v_cache, block_tables, context_lens, cu_seqlens_q,
        part_out, part_ml,
        scale * math.log2(math.e),
        *q.stride(), *target.stride(), *k_cache.stride(), *v_cache.stride(),
        block_tables.stride(0), k_cache.shape[1], head_dim, total_q, num_heads, sliding_window or 0,
        GROUP=group, NUM_SPLITS=num_splits, UPCAST=INTERPRET,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, **launch,
    )
    if num_splits > 1:
        _merge_splits_kernel[(total_q, num_heads)](
            target, part_out, part_ml, *target.stride(), head_dim, total_q, num_heads,
            NUM_SPLITS=num_splits, BLOCK_S=triton.next_power_of_2(num_splits), BLOCK_D=block_d,
        )
    if target is not out:
        out.copy_(target)
    return out


def default_block_n(dtype: torch.dtype) -> int:
    """Keys per tile (``BLOCK_N``) when the caller gives none.

    Interpreter: 16, small tiles, so the chapter's short contexts still loop. GPU: 64 keys per
    tile, 32 in float32 (the tiles and their pipeline copies must fit in shared memory).
    """
    return 16 if INTERPRET else 32 if dtype == torch.float32 else 64


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, context_lens: torch.Tensor,
                    cu_seqlens_q: torch.Tensor, scale: float, sliding_window: int | None = None) -> torch.Tensor:
    """Causal attention of ``q`` (``[total_q, num_heads, head_dim]``) over the paged cache.

    Same contract as ``paged_attention_ref`` (``sliding_window`` included): decode (``q_len == 1``) and prefill over a cached
    prefix (``q_len`` new tokens, causal among themselves, after ``context_len - q_len`` cached
    ones) in one kernel; GQA; fp32/fp16/bf16; any block size; ``q`` may be strided. Softmax
    runs online in float32. Returns a new contiguous tensor in ``q.dtype``.

    This wrapper reads ``cu_seqlens_q`` and ``context_lens`` back to the host once, to check
    them and size the grid; ``launch_paged_attention`` skips that.
    """
    _check_attention_args(q, k_cache, v_cache, block_tables, context_lens, cu_seqlens_q)
    cu = cu_seqlens_q.tolist()
    lens = context_lens.tolist()
    block_size = k_cache.shape[1]
    if cu[0] != 0 or cu[-1] != q.shape[0]:
        raise ValueError(f"cu_seqlens_q must start at 0 and end at total_q={q.shape[0]}, got {cu}")
    q_lens = [b - a for a, b in zip(cu, cu[1:])]
    for i, (q_len, ctx) in enumerate(zip(q_lens, lens)):
        if q_len < 0 or q_len > ctx:
            raise ValueError(f"sequence {i}: need 0 <= q_len <= context_len, got q_len={q_len}, "
                             f"context_len={ctx}")
        if -(-ctx // block_size) > block_tables.shape[1]:
            raise ValueError(f"sequence {i}: context_len={ctx} needs {-(-ctx // block_size)} blocks "
                             f"but block_tables has {block_tables.shape[1]} columns")
    if sliding_window is not None and (not isinstance(sliding_window, int) or sliding_window < 1):
        raise ValueError(f"sliding_window must be an int >= 1 or None, got {sliding_window!r}")
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    max_q_len = max(q_lens, default=0)
    return launch_paged_attention(out, q, k_cache, v_cache, block_tables, context_lens,
                                  cu_seqlens_q, scale, max_q_len=max_q_len,
                                  num_splits=choose_num_splits(q, k_cache, len(lens), max_q_len,
                                                                 max(lens, default=0)),
                                  sliding_window=sliding_window)


def choose_num_splits(q, k_cache, num_seqs, max_q_len, max_context_len) -> int:
    """How many KV splits ``paged_attention`` uses: split long contexts only when the grid
    alone (sequences x KV heads x query tiles) would leave streaming multiprocessors idle;
    never under the interpreter, where there is nothing to fill."""
    if INTERPRET or not q.is_cuda:
        return 1
    group = q.shape[1] // k_cache.shape[2]
    programs = num_seqs * k_cache.shape[2] * triton.cdiv(max_q_len * group, 64)
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    if programs >= 2 * sms:
        return 1
    return max(1, min(triton.cdiv(2 * sms, programs), triton.cdiv(max_context_len, 512), 16))


# --------------------------------------------------------------------------------------------
# Argument checks: a bad call raises a clear error before any kernel touches memory.
# --------------------------------------------------------------------------------------------

def _check_cache_pair(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if k_cache.dim() != 4:
        raise ValueError(f"k_cache must be [num_blocks, block_size, num_kv_heads, head_dim], "
                         f"got shape {tuple(k_cache.shape)}")
    if v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"v_cache ({tuple(v_cache.shape)}, {v_cache.dtype}) must match k_cache "
                         f"({tuple(k_cache.shape)}, {k_cache.dtype})")
    if k_cache.dtype not in _DTYPES:
        raise TypeError(f"cache dtype {k_cache.dtype} is not supported; supported: {_DTYPES}")


def _check_attention_args(q, k_cache, v_cache, block_tables, context_lens, cu_seqlens_q) -> None:
    _check_cache_pair(k_cache, v_cache)
    if q.dim() != 3:
        raise ValueError(f"q must be [total_q, num_heads, head_dim], got shape {tuple(q.shape)}")
    num_kv_heads, head_dim = k_cache.shape[2:]
    if q.shape[2] != head_dim:
        raise ValueError(f"q has head_dim {q.shape[2]} but the cache has {head_dim}")
    if q.shape[1] % num_kv_heads:
        raise ValueError(f"num_heads={q.shape[1]} is not a multiple of num_kv_heads={num_kv_heads}")
    if q.dtype != k_cache.dtype:
        raise TypeError(f"q is {q.dtype} but the cache is {k_cache.dtype}; cast one of them")
    if block_tables.dim() != 2 or context_lens.dim() != 1 or cu_seqlens_q.dim() != 1:
        raise ValueError("block_tables must be 2-D, context_lens and cu_seqlens_q 1-D")
    num_seqs = context_lens.shape[0]
    if block_tables.shape[0] != num_seqs or cu_seqlens_q.shape[0] != num_seqs + 1:
        raise ValueError(f"{num_seqs} sequences need block_tables with {num_seqs} rows and "
                         f"cu_seqlens_q of length {num_seqs + 1}; got {tuple(block_tables.shape)} "
                         f"and {tuple(cu_seqlens_q.shape)}")
    for name, t in (("block_tables", block_tables), ("context_lens", context_lens),
                    ("cu_seqlens_q", cu_seqlens_q)):
        if t.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"{name} must be int32 or int64, got {t.dtype}")
    if block_tables.stride(1) != 1:
        raise ValueError("block_tables rows must be contiguous (stride 1 along a row)")
    _check_devices(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables,
                   context_lens=context_lens, cu_seqlens_q=cu_seqlens_q)


def _check_devices(**tensors: torch.Tensor) -> None:
    devices = {t.device for t in tensors.values()}
    if len(devices) > 1:
        raise ValueError("all tensors must be on one device, got "
                         + ", ".join(f"{n}: {t.device}" for n, t in tensors.items()))
    device = devices.pop()
    if not INTERPRET and device.type != "cuda":
        raise ValueError(f"the Triton kernels need CUDA tensors (got {device}); to run them on the "
                         f"CPU, start Python with TRITON_INTERPRET=1")
