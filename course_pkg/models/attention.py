"""Attention over the paged KV cache: ``AttentionMetadata`` and the per-layer ``Attention``.

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

from course_pkg.kernels.reference import gather_kv, paged_attention_ref, store_kvcache_ref

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
            for i, (q_len, c) in enumerate(zip(q_lens, ctx)):
                if q_len > c:
                    raise ValueError(f"sequence {i}: {q_len} query tokens but context_len {c}")
            decode = [i for i, q in enumerate(q_lens) if q == 1]
            device = self.context_lens.device
            self._plan = {
                "cu": cu, "ctx": ctx, "q_lens": q_lens,
                "prefill": [i for i, q in enumerate(q_lens) if q > 1],
                "decode": decode,
                "decode_rows": torch.tensor([cu[i] for i in decode], dtype=torch.long, device=device),
                "decode_seqs": torch.tensor(decode, dtype=torch.long, device=device),
                "all_decode": len(decode) == len(ctx),
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


def _decode_batched(q, k_cache, v_cache, block_tables, context_lens, scale):
    """All sequences with one query token at once, over K/V gathered into a padded batch.

    ``q`` is ``[B, heads, dim]``. Each sequence's blocks are gathered up to the longest
    context in the batch; positions past a sequence's own context are masked out.
    """
    block_size = k_cache.shape[1]
    max_ctx = int(context_lens.max())
    num_blocks = (max_ctx + block_size - 1) // block_size
    tables = block_tables[:, :num_blocks].long().clamp_min(0)        # -1 padding -> any block
    batch = q.shape[0]
    valid = torch.arange(max_ctx, device=q.device) < context_lens.unsqueeze(1)   # [B, ctx]
    # Slots past a context hold whatever the pool held (an empty tensor may even hold NaN):
    # masking the scores is not enough, since softmax weight 0 times NaN is still NaN.
    invalid = ~valid[:, :, None, None]
    k = k_cache[tables].flatten(1, 2)[:, :max_ctx].masked_fill_(invalid, 0).transpose(1, 2)
    v = v_cache[tables].flatten(1, 2)[:, :max_ctx].masked_fill_(invalid, 0).transpose(1, 2)
    out = F.scaled_dot_product_attention(                              # k, v: [B, kv_heads, ctx, dim]
        q.unsqueeze(2).to(k.dtype), k, v, attn_mask=valid[:, None, None, :], scale=scale,
        enable_gqa=True)                                                    # [B, heads, 1, dim]
    return out.reshape(batch, q.shape[1], q.shape[2]).to(q.dtype)


def paged_attention_torch(q, k_cache, v_cache, attn: AttentionMetadata, scale: float,
                          key=None, value=None) -> torch.Tensor:
    """Same result as :func:`paged_attention_ref`, vectorized where it pays on a CPU.

    * decode sequences (``q_len == 1``): one batched SDPA call over padded gathered K/V;
    * prefill sequences: one SDPA call each. A sequence with no cached prefix
      (``q_len == context_len``) uses this step's ``key``/``value`` directly (they are exactly
      what was just stored, when the cache has the model's dtype) with a plain causal mask;
      otherwise it gathers its K/V from the cache and shifts the causal mask by the prefix.
    """
    plan = attn.plan()
    if plan["all_decode"]:
        return _decode_batched(q, k_cache, v_cache, attn.block_tables, attn.context_lens, scale)
    out = torch.empty_like(q)
    if plan["decode"]:
        rows, seqs = plan["decode_rows"], plan["decode_seqs"]
        out[rows] = _decode_batched(q[rows], k_cache, v_cache, attn.block_tables[seqs],
                                    attn.context_lens[seqs], scale)
    fresh_ok = key is not None and key.dtype == k_cache.dtype
    cu, ctx = plan["cu"], plan["ctx"]
    for i in plan["prefill"]:
        start, end, context_len = cu[i], cu[i + 1], ctx[i]
        q_len = end - start
        if fresh_ok and q_len == context_len:
            k, v = key[start:end], value[start:end]
            mask, causal = None, True
        else:
            k = gather_kv(k_cache, attn.block_tables[i], context_len)
            v = gather_kv(v_cache, attn.block_tables[i], context_len)
            q_pos = torch.arange(context_len - q_len, context_len, device=q.device).unsqueeze(1)
            mask, causal = torch.arange(context_len, device=q.device).unsqueeze(0) <= q_pos, False
        o = F.scaled_dot_product_attention(
            q[start:end].transpose(0, 1).to(k.dtype), k.transpose(0, 1), v.transpose(0, 1),
            attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True)
        out[start:end] = o.transpose(0, 1).to(q.dtype)
    return out


def _triton_ops():
    # Imported lazily: triton is heavy to import and only the GPU path (or a test under
    # TRITON_INTERPRET=1) needs it.
    from course_pkg.kernels.triton_kernels import paged_attention, store_kvcache
    return store_kvcache, paged_attention


def attend(q, key, value, kv_cache, attn: AttentionMetadata, scale: float) -> torch.Tensor:
    """Store ``key``/``value`` in the cache, then attend with ``q``: ``[N, heads, dim]``.

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
            s, e = cu[i], cu[i + 1]
            if e > s:
                out[s:e] = F.scaled_dot_product_attention(
                    q[s:e].transpose(0, 1), key[s:e].transpose(0, 1), value[s:e].transpose(0, 1),
                    is_causal=True, scale=scale, enable_gqa=True).transpose(0, 1)
        return out
    k_cache, v_cache = kv_cache
    if attn.backend == "torch":
        store_kvcache_torch(key, value, k_cache, v_cache, attn.slot_mapping)
        return paged_attention_torch(q, k_cache, v_cache, attn, scale, key, value)
    if attn.backend == "reference":
        store_kvcache_ref(key, value, k_cache, v_cache, attn.slot_mapping)
        return paged_attention_ref(q, k_cache, v_cache, attn.block_tables, attn.context_lens,
                                   attn.cu_seqlens_q, scale)
    store_kvcache, paged_attention = _triton_ops()
    store_kvcache(key, value, k_cache, v_cache, attn.slot_mapping)
    return paged_attention(q, k_cache, v_cache, attn.block_tables, attn.context_lens,
                           attn.cu_seqlens_q, scale)
