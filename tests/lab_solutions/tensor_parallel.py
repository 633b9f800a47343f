"""A correct solution of lab `tensor_parallel`, written from the chapter's explanation, not from the package's code.

Grade it like a student's file: ``python -m course_pkg.labs tensor_parallel tests/lab_solutions/tensor_parallel.py``.
"""
from __future__ import annotations

from course_pkg.distributed import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding


class StudentParallelLayers:
    class Column(ColumnParallelLinear):
        def forward(self, x):
            y = x @ self.weight.T                       # this rank's output features
            return y if self.bias is None else y + self.bias

    class Row(RowParallelLinear):
        def forward(self, x):
            total = self.group.all_reduce(x @ self.weight.T, self.label)   # partial sums, added up
            return total if self.bias is None else total + self.bias      # the bias once, after the sum

    class VocabEmbedding(VocabParallelEmbedding):
        def forward(self, input_ids):
            inside = (self.vocab_start <= input_ids) & (input_ids < self.vocab_end)
            rows = self.weight[(input_ids - self.vocab_start).clamp(0, self.weight.shape[0] - 1)]
            return self.group.all_reduce(rows * inside.unsqueeze(-1), self.label)
