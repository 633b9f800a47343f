"""Attention over the paged KV cache: ``AttentionMetadata`` and ``attend``, run by every layer.

One forward pass runs a *flat batch*: the new tokens of several sequences laid end to end
(``[N, ...]``, no padding). ``AttentionMetadata`` tells every layer where each sequence's
tokens start in that batch and where its K/V live in the cache. The layout is the one in
:mod:`course_pkg.kernels.reference` (read its docstring):

* ``slot_mapping`` ``[N]`` -- the cache slot each new token's K/V is written to (-1 skips);
* ``block_tables`` ``[num_seqs, max_blocks]`` int32, padded with -1;
* ``context_lens`` ``[num_seqs]`` -- tokens in the cache per sequence *including* this step's;
* ``cu_seqlens_q`` ``[num_seqs + 1]`` -- sequence ``i``'s queries are rows
  ``cu_seqlens_q[i]:cu_seqlens_q[i + 1]``, its *last* ``q_len`` context positions;
* ``max_q_len``, ``max_context_len`` -- plain ints (kernels size their grids from them);
* ``backend`` -- ``"torch"`` (vectorized torch, the CPU path), ``"triton"`` (the chapter-05
  kernels) or ``"reference"`` (the loop-per-sequence reference, slow, for tests).

Every layer first stores the new K/V (``store_kvcache``), then attends (``paged_attention``)
over everything the sequence has in the cache: its cached prefix and the tokens just stored.
That order is what makes prefill, chunked prefill, prefix-cache hits and decode one code path.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from course_pkg.kernels.reference import gather_kv, paged_attention_ref, store_kvcache_ref, window_first_block

BACKENDS = ("torch", "triton", "reference")


@dataclass
class AttentionMetadata:
    """Where the tokens of one flat batch go in the KV cache and what each one attends to.

    Built once per step by the ModelRunner and shared by every layer of the model.
    """
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    cu_seqlens_q: torch.Tensor
    max_q_len: int
    max_context_len: int
    backend: str = "torch"
    # Host-side plan of the torch path, computed on first use and reused by every layer.
    _plan: dict | None = field(default=None, repr=False, compare=False)

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise ValueError(f"attention backend must be one of {BACKENDS}, got {self.backend!r}")
        num_seqs = self.context_lens.shape[0]
        if self.cu_seqlens_q.shape[0] != num_seqs + 1:
            raise ValueError(f"cu_seqlens_q has {self.cu_seqlens_q.shape[0]} entries, "
                             f"expected num_seqs + 1 = {num_seqs + 1}")
        if self.block_tables.shape[0] != num_seqs:
            raise ValueError(f"block_tables has {self.block_tables.shape[0]} rows for {num_seqs} sequences")

    def plan(self) -> dict:
        """Python lists of the per-sequence lengths, split into decode and prefill sequences.

        Computed once per step: ``.tolist()`` synchronises with the device, so doing it per
        layer would cost ``num_layers`` synchronisations instead of one.
        """
        if self._plan is None:
            cu = self.cu_seqlens_q.tolist()
            ctx = self.context_lens.tolist()
            q_lens = [cu[i + 1] - cu[i] for i in range(len(ctx))]
            if cu[0] != 0 or min(q_lens, default=0) < 0:
                raise ValueError(f"cu_seqlens_q must start at 0 and never decrease, got {cu}")
            for i, (q_len, c) in enumerate(zip(q_lens, ctx)):
                if q_len > c:
                    raise ValueError(f"sequence {i}: {q_len} query tokens but context_len {c}")
            self._plan = {
                "cu": cu, "ctx": ctx, "q_lens": q_lens,
                "decode": [i for i, q in enumerate(q_lens) if q == 1],
                "prefill": [i for i, q in enumerate(q_lens) if q > 1],
            }
        return self._plan


def store_kvcache_torch(key, value, k_cache, v_cache, slot_mapping) -> None:
    """Same contract as :func:`store_kvcache_ref`; skips the mask when no slot is -1."""
    num_kv_heads, head_dim = k_cache.shape[-2:]
    slots = slot_mapping.long()
    if bool((slots < 0).any()):
        store_kvcache_ref(key, value, k_cache, v_cache, slot_mapping)
        return
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, key.to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, value.to(v_cache.dtype))


def _context_blocks(attn: AttentionMetadata, seqs: list[int], block_size: int, sliding_window: int | None = None):
    """The blocks holding the contexts of ``seqs``, end to end, and where each context starts.
    With ``sliding_window``, a decode's context is its last ``w`` positions only: the blocks before
    them are not gathered at all (a local layer reads at most ``cdiv(w - 1, block_size) + 1`` blocks).

    One index for the whole step: each layer then gathers all the K/V it needs with a single
    ``index_select`` of whole blocks (a block is one contiguous run of memory, copied at full
    speed) instead of one gather per sequence. Sequence ``j``'s context is rows
    ``starts[j]:starts[j] + context_len`` of the gathered tokens; the unused tail of its last
    block is never read. Computed once per step, shared by every layer.
    """
    key = ("context_blocks", block_size, tuple(seqs), sliding_window)
    plan = attn.plan()
    if key not in plan:
        ctx = [plan["ctx"][i] for i in seqs]
        num_blocks = [(c + block_size - 1) // block_size for c in ctx]
        first = [max(0, c - sliding_window) // block_size if sliding_window else 0 for c in ctx]
        device = attn.block_tables.device
        tables = attn.block_tables[torch.tensor(seqs, device=device)][:, :max(num_blocks)].long()
        columns = torch.arange(tables.shape[1], device=device)
        used = (columns < torch.tensor(num_blocks, device=device).unsqueeze(1)) & \
            (columns >= torch.tensor(first, device=device).unsqueeze(1))
        starts = [0]   # where each sequence's gathered rows start, and the position they start at
        for n, f in zip(num_blocks, first):
            starts.append(starts[-1] + (n - f) * block_size)
        plan[key] = (tables[used], starts, [f * block_size for f in first])
    return plan[key]


def _gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """``cache[block_ids]`` as ``[len(block_ids) * block_size, num_kv_heads, head_dim]``."""
    if cache.is_contiguous():   # rows of block_size * heads * dim elements: the fastest copy
        rows = cache.view(cache.shape[0], -1).index_select(0, block_ids)
    else:
        rows = cache.index_select(0, block_ids)
    return rows.view(-1, *cache.shape[2:])


def _attend_one(q, k, v, scale: float, sliding_window: int | None = None) -> torch.Tensor:
    """Causal attention of one sequence: ``q`` ``[q_len, heads, dim]`` over its last ``q_len``
    positions of ``k``/``v`` ``[context_len, kv_heads, dim]``. With ``sliding_window = w`` a query
    at position ``i`` sees positions ``i - w + 1 .. i`` only (a local layer, chapter 16: Hugging
    Face's ``sliding_attention``, the same bound).

    A single query (decode) is a few small matmuls: the query heads that share a KV head
    form the rows of one product, so GQA costs no copy of K/V. Several queries go through
    SDPA's fused kernel, fed 4-D contiguous tensors (its fast CPU path; strided 3-D inputs
    take a path that is many times slower).
    """
    q_len, num_heads, dim = q.shape
    context_len, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    if q_len == 1 and sliding_window is not None:   # a decode sees its last w positions
        k, v = k[-sliding_window:], v[-sliding_window:]
    if q_len == 1:
        qg = q.reshape(num_kv_heads, group, dim).to(k.dtype)          # [kv_heads, group, dim]
        scores = torch.matmul(qg, k.permute(1, 2, 0)).mul_(scale)     # [kv_heads, group, ctx]
        probs = scores.float().softmax(-1).to(v.dtype)                # softmax in float32
        out = torch.matmul(probs, v.transpose(0, 1))                  # [kv_heads, group, dim]
        return out.reshape(1, num_heads, dim)
    if q_len == context_len and sliding_window is None:
        mask, causal = None, True
    else:   # the queries are the last q_len positions: shift the causal diagonal
        q_pos = torch.arange(context_len - q_len, context_len, device=q.device).unsqueeze(1)
        k_pos = torch.arange(context_len, device=q.device).unsqueeze(0)
        mask, causal = k_pos <= q_pos, False
        if sliding_window is not None:
            mask &= k_pos > q_pos - sliding_window
    out = F.scaled_dot_product_attention(
        q.to(k.dtype).transpose(0, 1).contiguous().unsqueeze(0),
        k.transpose(0, 1).contiguous().unsqueeze(0), v.transpose(0, 1).contiguous().unsqueeze(0),
        attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True)   # [1, heads, q, dim]
    return out[0].transpose(0, 1)


def paged_attention_torch(q, k_cache, v_cache, attn: AttentionMetadata, scale: float,
                          key=None, value=None, sliding_window: int | None = None) -> torch.Tensor:
    """Same result as :func:`paged_attention_ref`, shaped for a CPU.

    * decode sequences (``q_len == 1``): the blocks of all their contexts gathered with one
      ``index_select`` per layer (no padding to the longest context), then a few small
      matmuls per sequence;
    * prefill sequences: a sequence with no cached prefix (``q_len == context_len``) uses
      this step's ``key``/``value`` directly -- exactly what was just stored, when the cache
      has the model's dtype; one with a cached prefix gathers its K/V through its block table.
    """
    plan = attn.plan()
    out = torch.empty_like(q)
    cu, ctx = plan["cu"], plan["ctx"]
    if plan["decode"]:
        block_ids, starts, offsets = _context_blocks(attn, plan["decode"], k_cache.shape[1], sliding_window)
        k_all, v_all = _gather_blocks(k_cache, block_ids), _gather_blocks(v_cache, block_ids)
        for j, i in enumerate(plan["decode"]):
            lo, hi = starts[j], starts[j] + ctx[i] - offsets[j]   # (rows from position offsets[j] on)
            out[cu[i]:cu[i] + 1] = _attend_one(q[cu[i]:cu[i] + 1], k_all[lo:hi], v_all[lo:hi], scale,
                                               sliding_window)
    fresh_ok = key is not None and key.dtype == k_cache.dtype
    for i in plan["prefill"]:
        start, end, context_len = cu[i], cu[i + 1], ctx[i]
        if fresh_ok and end - start == context_len:
            k, v = key[start:end], value[start:end]
        else:   # a local layer reads from its first query's window on (the blocks before may be gone)
            first = window_first_block(context_len - (end - start), sliding_window, k_cache.shape[1])
            table = attn.block_tables[i][first:]
            k = gather_kv(k_cache, table, context_len - first * k_cache.shape[1])
            v = gather_kv(v_cache, table, context_len - first * k_cache.shape[1])
        out[start:end] = _attend_one(q[start:end], k, v, scale, sliding_window)
    return out


def _triton_ops():
    # Imported lazily: triton is heavy to import and only the GPU path (or a test under
    # TRITON_INTERPRET=1) needs it.
    from course_pkg.kernels import triton_kernels
    return triton_kernels


def attend(q, key, value, kv_cache, attn: AttentionMetadata, scale: float,
           sliding_window: int | None = None) -> torch.Tensor:
    """Store ``key``/``value`` in the cache, then attend with ``q``: ``[N, heads, dim]``.
    ``sliding_window``: the layer is local and a query sees its last ``w`` positions only.

    ``kv_cache`` is this layer's ``(k_cache, v_cache)``, or ``None`` to run without a cache
    (every sequence must then be a whole prompt: ``q_len == context_len``; used for warmup).
    """
    if kv_cache is None:
        plan = attn.plan()
        if plan["q_lens"] != plan["ctx"]:
            raise ValueError("without a KV cache every sequence must be a whole prompt "
                             "(q_len == context_len)")
        out = torch.empty_like(q)
        cu = plan["cu"]
        for i in range(len(plan["ctx"])):
            if cu[i + 1] > cu[i]:
                s, e = cu[i], cu[i + 1]
                out[s:e] = _attend_one(q[s:e], key[s:e], value[s:e], scale, sliding_window)
        return out
    k_cache, v_cache = kv_cache
    if attn.backend == "torch":
        store_kvcache_torch(key, value, k_cache, v_cache, attn.slot_mapping)
        return paged_attention_torch(q, k_cache, v_cache, attn, scale, key, value, sliding_window)
    if attn.backend == "reference":
        store_kvcache_ref(key, value, k_cache, v_cache, attn.slot_mapping)
        return paged_attention_ref(q, k_cache, v_cache, attn.block_tables, attn.context_lens,
                                   attn.cu_seqlens_q, scale, sliding_window)
    kernels = _triton_ops()
    kernels.store_kvcache(key, value, k_cache, v_cache, attn.slot_mapping)
    # The metadata already carries max_q_len / max_context_len, so the launch reads nothing
    # back from the device (paged_attention() would, once per layer, to check the values).
    num_splits = kernels.choose_num_splits(q, k_cache, attn.context_lens.shape[0], attn.max_q_len,
                                           attn.max_context_len)
    return kernels.launch_paged_attention(
        torch.empty_like(q), q, k_cache, v_cache, attn.block_tables, attn.context_lens,
        attn.cu_seqlens_q, scale, max_q_len=attn.max_q_len, num_splits=num_splits,
        sliding_window=sliding_window)
