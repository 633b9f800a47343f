"""Megatron-style parallel layers: each rank holds a slice of a weight matrix.

A linear layer ``y = x W^T`` with ``W`` of shape ``[out, in]`` splits two ways (Shoeybi et
al., Megatron-LM, 2019):

* **column-parallel** -- rank ``r`` holds rows ``[r*out/k, (r+1)*out/k)`` of ``W``, so it
  computes its own slice of the *output features* from the whole input. No communication.
  Used for Q, K, V (a slice of the heads) and for the MLP's gate and up projections (a slice
  of the intermediate features).
* **row-parallel** -- rank ``r`` holds columns ``[r*in/k, (r+1)*in/k)`` of ``W`` and receives
  only that slice of the input features -- exactly what a column-parallel layer before it
  produced. Its product is a *partial sum* of ``y``; an all-reduce adds the ``k`` partial
  sums and every rank has the whole ``y``. Used for ``o_proj`` and ``down_proj``.

So a decoder layer communicates twice: after attention and after the MLP. Between the two
all-reduces everything is local: attention needs only the rank's own heads (and their
K/V), SwiGLU is element-wise on the rank's own intermediate features.

The vocabulary splits the same way: the embedding table by rows (rank ``r`` looks up only
the ids in its slice, writes zeros for the others, and an all-reduce assembles the rows);
the LM head by rows of its weight, i.e. a column-parallel layer whose output slices -- the
logits of the rank's slice of the vocabulary -- are gathered on rank 0 for sampling.

``shard_dims`` names, per parameter, the dimension a checkpoint tensor is sliced along
(absent: the whole tensor, replicated on every rank); the loader reads it.
"""
from __future__ import annotations

import torch
from torch import nn
import torch.nn.functional as F

from course_pkg.distributed.group import TensorParallelGroup


def _shard(size: int, group: TensorParallelGroup, what: str) -> int:
    if size % group.world_size:
        raise ValueError(f"{what}={size} does not split over {group.world_size} ranks")
    return size // group.world_size


class ColumnParallelLinear(nn.Module):
    """``x [N, in] -> y[:, slice] [N, out/k]``: this rank's slice of the output features."""

    def __init__(self, in_features: int, out_features: int, group: TensorParallelGroup, bias: bool = False):
        super().__init__()
        self.group = group
        self.out_per_rank = _shard(out_features, group, "out_features")
        self.weight = nn.Parameter(torch.empty(self.out_per_rank, in_features))
        self.bias = nn.Parameter(torch.empty(self.out_per_rank)) if bias else None
        self.shard_dims = {"weight": 0, "bias": 0}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """``x[:, slice] [N, in/k] -> y [N, out]``: a partial product, then an all-reduce.

    The bias (if any) is replicated and added once, after the sum -- adding it on every rank
    before the all-reduce would count it ``k`` times.
    """

    def __init__(self, in_features: int, out_features: int, group: TensorParallelGroup, bias: bool = False,
                 label: str = "row-parallel"):
        super().__init__()
        self.group = group
        self.label = label
        self.weight = nn.Parameter(torch.empty(out_features, _shard(in_features, group, "in_features")))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.shard_dims = {"weight": 1}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.group.all_reduce(F.linear(x, self.weight), self.label)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Rows ``[r*V/k, (r+1)*V/k)`` of the embedding table; an id outside them gives zeros.

    Exactly one rank holds each id's row, so the all-reduce adds one row and ``k - 1`` zeros:
    every rank ends with the same embeddings, bit for bit, as a whole table would give.
    """

    def __init__(self, vocab_size: int, hidden_size: int, group: TensorParallelGroup, label: str = "embed_tokens"):
        super().__init__()
        self.group = group
        self.label = label
        self.vocab_size = vocab_size
        per_rank = _shard(vocab_size, group, "vocab_size")
        self.vocab_start, self.vocab_end = group.rank * per_rank, (group.rank + 1) * per_rank
        self.weight = nn.Parameter(torch.empty(per_rank, hidden_size))
        self.shard_dims = {"weight": 0}

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        mine = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local_ids = torch.where(mine, input_ids - self.vocab_start, 0)
        x = F.embedding(local_ids, self.weight).masked_fill_(~mine.unsqueeze(-1), 0)
        if self.group.events is not None:
            self.group.record(f"{self.label}: {int(mine.sum())} of {input_ids.numel()} tokens in this rank's "
                              f"vocabulary [{self.vocab_start}, {self.vocab_end})")
        return self.group.all_reduce(x, self.label)


class ParallelLMHead(nn.Module):
    """Logits of this rank's vocabulary slice, gathered on rank 0: ``[n, V]`` there, None elsewhere.

    With tied embeddings its weight *is* the embedding's slice, so a rank's head and table
    cover the same ids.
    """

    def __init__(self, vocab_size: int, hidden_size: int, group: TensorParallelGroup, label: str = "lm_head"):
        super().__init__()
        self.group = group
        self.label = label
        self.weight = nn.Parameter(torch.empty(_shard(vocab_size, group, "vocab_size"), hidden_size))
        self.shard_dims = {"weight": 0}

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        parts = self.group.gather_to_first(F.linear(hidden, self.weight), self.label)
        return None if parts is None else torch.cat(parts, dim=-1)
