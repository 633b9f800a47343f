"""Chapter 10 lab: the forward passes of the parallel layers -- the stub, the package's layers
under the stub's names, and the mutants. A module of its own because it imports torch, which
the other labs' stubs and mutants do not need.

A solution is a class with three nested layer classes, ``Column``, ``Row`` and
``VocabEmbedding``, each a subclass of the package's layer whose ``forward`` it writes (the
constructors, which allocate each rank's slice, are the package's).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from course_pkg.distributed import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding


class StudentParallelLayers:
    """Lab ``tensor_parallel``: what each rank computes in the three parallel layers of chapter 10."""

    class Column(ColumnParallelLinear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            """``x [N, in]`` -> this rank's slice of the output features, ``[N, out/k]``:
            ``self.weight`` (and ``self.bias``, or None) hold this rank's rows. No communication."""
            ...

    class Row(RowParallelLinear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            """``x[:, slice] [N, in/k]`` -> the whole output ``[N, out]``, the same on every rank:
            ``self.weight`` holds this rank's columns; ``self.group.all_reduce(t, self.label)`` sums
            ``t`` over the ranks. ``self.bias`` (or None) is whole on every rank."""
            ...

    class VocabEmbedding(VocabParallelEmbedding):
        def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
            """The embeddings of ``input_ids``, the same on every rank: ``self.weight`` holds rows
            ``self.vocab_start`` .. ``self.vocab_end - 1`` of the table; the other ranks hold the rest."""
            ...


class PackageParallelLayers:
    """The package's three layers under the stub's names: the lab's reference."""

    Column = ColumnParallelLinear
    Row = RowParallelLinear
    VocabEmbedding = VocabParallelEmbedding


# ---------------------------------------------------------------- mutants (never use them)

class BiasOnEveryRankLayers(PackageParallelLayers):
    """The row-parallel bias is added before the all-reduce: the sum counts it ``k`` times."""

    class Row(RowParallelLinear):
        def forward(self, x):
            return self.group.all_reduce(F.linear(x, self.weight, self.bias), self.label)


class NoAllReduceLayers(PackageParallelLayers):
    """The row-parallel layer returns its partial product: each rank holds a different part of the sum."""

    class Row(RowParallelLinear):
        def forward(self, x):
            y = F.linear(x, self.weight)
            return y if self.bias is None else y + self.bias


class ReducedColumnLayers(PackageParallelLayers):
    """The column-parallel layer all-reduces its output: it adds slices of *different* features."""

    class Column(ColumnParallelLinear):
        def forward(self, x):
            return self.group.all_reduce(F.linear(x, self.weight, self.bias))


class UnmaskedEmbeddingLayers(PackageParallelLayers):
    """The embedding looks ids of other ranks up as row 0 and forgets to zero them: the sum adds
    rows that do not belong to the token."""

    class VocabEmbedding(VocabParallelEmbedding):
        def forward(self, input_ids):
            mine = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
            local_ids = torch.where(mine, input_ids - self.vocab_start, 0)
            return self.group.all_reduce(F.embedding(local_ids, self.weight), self.label)


class UnshiftedEmbeddingLayers(PackageParallelLayers):
    """The embedding masks right but indexes its slice with the global id (no ``- vocab_start``),
    clamped into the slice: ranks after the first return the wrong rows."""

    class VocabEmbedding(VocabParallelEmbedding):
        def forward(self, input_ids):
            mine = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
            local_ids = torch.where(mine, input_ids, 0).clamp(max=self.weight.shape[0] - 1)
            x = F.embedding(local_ids, self.weight).masked_fill(~mine.unsqueeze(-1), 0)
            return self.group.all_reduce(x, self.label)
