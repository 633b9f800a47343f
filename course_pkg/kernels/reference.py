"""Pure-torch paged attention: the reference for the Triton kernels and the engine's CPU path.

Layout shared by every backend (chapter 05):

* ``k_cache``, ``v_cache``: ``[num_blocks, block_size, num_kv_heads, head_dim]`` -- one pair per
  layer. Token ``t`` of a sequence lives in physical block ``block_table[t // block_size]`` at
  offset ``t % block_size``; its *slot* is ``block_id * block_size + offset``.
* ``slot_mapping``: ``[num_new_tokens]`` int, the slot each new token's K/V is written to
  (-1 = do not write, e.g. padding).
* ``block_tables``: ``[num_seqs, max_blocks]`` int32, padded with -1.
* ``context_lens``: ``[num_seqs]``, tokens of each sequence in the cache *including* this
  step's new tokens (their K/V are stored before attention runs).
* ``cu_seqlens_q``: ``[num_seqs + 1]``, where each sequence's query tokens start in ``q``.
  The ``q_len`` query tokens of a sequence are its *last* ``q_len`` context positions; query
  ``j`` attends to positions ``<= context_len - q_len + j`` (causal). Decode is ``q_len == 1``.
"""
from __future__ import annotations

import torch


def store_kvcache_ref(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write ``key``/``value`` (``[N, num_kv_heads, head_dim]``) into their slots; -1 skips."""
    num_kv_heads, head_dim = k_cache.shape[-2:]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    k_cache.view(-1, num_kv_heads, head_dim)[slots] = key[keep].to(k_cache.dtype)
    v_cache.view(-1, num_kv_heads, head_dim)[slots] = value[keep].to(v_cache.dtype)


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, context_len: int) -> torch.Tensor:
    """The first ``context_len`` tokens of one sequence, read through its block table:
    ``[context_len, num_kv_heads, head_dim]``."""
    block_size = cache.shape[1]
    num_blocks = (context_len + block_size - 1) // block_size
    blocks = cache[block_table[:num_blocks].long()]          # [n, block_size, kv_heads, dim]
    return blocks.reshape(-1, *cache.shape[2:])[:context_len]


def window_first_block(first_query_pos: int, sliding_window: int | None, block_size: int) -> int:
    """The first block a query at ``first_query_pos`` (or later) reads: 0 in a full-attention
    layer; in a local one the block of position ``first_query_pos - w + 1``. The blocks before it
    are never read -- a hybrid model's manager may have given them back (chapter 16)."""
    if sliding_window is None:
        return 0
    return max(0, first_query_pos - sliding_window + 1) // block_size


def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        block_tables: torch.Tensor, context_lens: torch.Tensor,
                        cu_seqlens_q: torch.Tensor, scale: float, sliding_window: int | None = None) -> torch.Tensor:
    """Causal attention of ``q`` (``[total_q, num_heads, head_dim]``) over the paged cache.
    With ``sliding_window = w``, a query at position ``i`` sees positions ``i - w + 1 .. i`` only.

    Computed in float32 (or the input's dtype if wider) and returned in ``q.dtype``. Query
    heads are grouped over KV heads (GQA): head ``h`` reads KV head ``h // (num_heads //
    num_kv_heads)``.
    """
    num_heads = q.shape[1]
    num_kv_heads = k_cache.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    group = num_heads // num_kv_heads
    compute_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    out = torch.empty_like(q)
    cu = cu_seqlens_q.tolist()
    for i, context_len in enumerate(context_lens.tolist()):
        start, end = cu[i], cu[i + 1]
        q_len = end - start
        if q_len == 0:
            continue
        first = window_first_block(context_len - q_len, sliding_window, k_cache.shape[1])
        offset = first * k_cache.shape[1]   # the position the gathered keys start at
        k = gather_kv(k_cache, block_tables[i][first:], context_len - offset).to(compute_dtype)
        v = gather_kv(v_cache, block_tables[i][first:], context_len - offset).to(compute_dtype)
        k = k.repeat_interleave(group, dim=1).transpose(0, 1)   # [heads, ctx, dim]
        v = v.repeat_interleave(group, dim=1).transpose(0, 1)
        qs = q[start:end].to(compute_dtype).transpose(0, 1)     # [heads, q_len, dim]
        scores = (qs @ k.transpose(1, 2)) * scale                # [heads, q_len, ctx]
        q_pos = torch.arange(context_len - q_len, context_len).unsqueeze(1)
        k_pos = torch.arange(offset, context_len).unsqueeze(0)
        hidden = k_pos > q_pos
        if sliding_window is not None:
            hidden |= k_pos <= q_pos - sliding_window
        scores = scores.masked_fill(hidden, float("-inf"))
        out[start:end] = (scores.softmax(-1) @ v).transpose(0, 1).to(q.dtype)
    return out
