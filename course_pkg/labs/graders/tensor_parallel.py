"""Chapter 10 grader: the forward passes of the column-, row- and vocabulary-parallel layers.

No process is started: the ``k`` ranks run as ``k`` threads of this process, each with a
``SimulatedGroup`` whose ``all_reduce`` sums the ranks' tensors (in rank order) and hands every
rank the sum, as ``torch.distributed`` would. Each rank's layer holds its slice of a weight
drawn here, and its output is compared with the whole layer computed by hand (``x @ W.T``,
float64), so the oracle is the arithmetic, not the package's layers.
"""
from __future__ import annotations

import threading

import torch
import torch.nn.functional as F

from course_pkg.distributed import TensorParallelGroup
from course_pkg.labs.lab import Grading

#: Seconds a rank waits for the others at an all-reduce before the grader gives up on it.
RENDEZVOUS_SECONDS = 10.0


class _Rendezvous:
    def __init__(self, world_size: int):
        self.barrier = threading.Barrier(world_size, timeout=RENDEZVOUS_SECONDS)
        self.slots: list[torch.Tensor | None] = [None] * world_size
        self.total: torch.Tensor | None = None


class SimulatedGroup(TensorParallelGroup):
    """Rank ``rank`` of ``world_size`` threads: ``all_reduce`` meets the other threads."""

    def __init__(self, rank: int, world_size: int, rendezvous: _Rendezvous):
        super().__init__(rank, world_size, torch.device("cpu"))
        self.rendezvous = rendezvous

    def all_reduce(self, x: torch.Tensor, label: str = "") -> torch.Tensor:
        self.all_reduce_calls += 1
        r = self.rendezvous
        r.slots[self.rank] = x.clone()
        r.barrier.wait()
        if self.rank == 0:
            r.total = torch.stack(r.slots).sum(0)     # fails, on every rank, if the shapes differ
        r.barrier.wait()
        x.copy_(r.total)
        r.barrier.wait()                               # nobody starts the next sum before all copied
        return x


def run_ranks(world_size: int, fn) -> list:
    """``fn(group)`` on ``world_size`` ranks at once; their results in rank order (or the first error)."""
    rendezvous = _Rendezvous(world_size)
    results: list = [None] * world_size
    errors: list = [None] * world_size

    def rank_main(rank: int) -> None:
        try:
            with torch.no_grad():                      # grad mode is per thread
                results[rank] = fn(SimulatedGroup(rank, world_size, rendezvous))
        except BaseException as e:  # noqa: BLE001 -- reported below, in the main thread
            errors[rank] = e
            rendezvous.barrier.abort()                 # the others must not wait for this rank

    threads = [threading.Thread(target=rank_main, args=(r,), daemon=True) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(RENDEZVOUS_SECONDS * 4)
    if any(t.is_alive() for t in threads):
        raise RuntimeError(f"a rank is still running after {RENDEZVOUS_SECONDS * 4:g} s")
    first = next((e for e in errors if e is not None and not isinstance(e, threading.BrokenBarrierError)), None)
    if first is not None:
        raise first
    if any(errors):
        raise RuntimeError("the ranks did not meet at the same all-reduces (one rank made more calls than "
                           "another, or none at all while the others waited)")
    return results


def _weights(seed: int, *shape) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64)


def _check_every_rank(g: Grading, outputs: list, expected: torch.Tensor, what: str, exact: bool = False) -> None:
    for rank, y in enumerate(outputs):
        if not isinstance(y, torch.Tensor) or tuple(y.shape) != tuple(expected.shape):
            g.fail(f"{what}: rank {rank} returned {type(y).__name__} of shape "
                   f"{tuple(y.shape) if isinstance(y, torch.Tensor) else '-'}, expected shape {tuple(expected.shape)}")
        same = torch.equal(y, expected) if exact else torch.allclose(y, expected, rtol=1e-10, atol=1e-10)
        if not same:
            g.fail(f"{what}: rank {rank}'s output differs from the whole layer's by up to "
                   f"{(y - expected).abs().max().item():.3g}")


def _row_layer(layers, group, w: torch.Tensor, bias: torch.Tensor | None):
    layer = layers.Row(w.shape[1], w.shape[0], group, bias=bias is not None).double()
    per = w.shape[1] // group.world_size
    with torch.no_grad():
        layer.weight.copy_(w[:, group.rank * per:(group.rank + 1) * per])
        if bias is not None:
            layer.bias.copy_(bias)
    return layer, per


def _column_layer(layers, group, w: torch.Tensor, bias: torch.Tensor | None):
    layer = layers.Column(w.shape[1], w.shape[0], group, bias=bias is not None).double()
    per = w.shape[0] // group.world_size
    with torch.no_grad():
        layer.weight.copy_(w[group.rank * per:(group.rank + 1) * per])
        if bias is not None:
            layer.bias.copy_(bias[group.rank * per:(group.rank + 1) * per])
    return layer, per


def grade_tensor_parallel(layers, g: Grading) -> None:
    x = _weights(1, 5, 8)
    for k, bias in ((2, False), (4, True)):
        name = f"row-parallel on {k} ranks{', with a bias' if bias else ''}"
        with g.scenario(f"{name}: every rank gets the whole layer's output"):
            w, b = _weights(2, 6, 8), (_weights(3, 6) if bias else None)

            def rank(group):
                layer, per = _row_layer(layers, group, w, b)
                y = layer(x[:, group.rank * per:(group.rank + 1) * per])
                return y, group.all_reduce_calls

            outs = run_ranks(k, rank)
            expected = x @ w.T + (b if bias else 0)
            _check_every_rank(g, [y for y, _ in outs], expected,
                              f"x @ W.T{' + b (the bias added once, after the sum)' if bias else ''}")
            g.equal([calls for _, calls in outs], [1] * k, "all-reduces per rank in one forward pass")
    for k, bias in ((2, True), (4, False)):
        with g.scenario(f"column-parallel on {k} ranks{', with a bias' if bias else ''}: rank r's slice of the "
                        "output features, no communication"):
            w, b = _weights(4, 8, 6), (_weights(5, 8) if bias else None)

            def rank(group):
                layer, per = _column_layer(layers, group, w, b)
                return layer(x[:, :6]), group.all_reduce_calls, per

            outs = run_ranks(k, rank)
            whole = x[:, :6] @ w.T + (b if bias else 0)
            for r, (y, calls, per) in enumerate(outs):
                _check_every_rank(g, [y], whole[:, r * per:(r + 1) * per], f"rank {r}'s slice of x @ W.T")
                g.equal(calls, 0, f"all-reduces on rank {r} (a column-parallel layer needs none)")
    with g.scenario("column- then row-parallel on 2 ranks (an MLP without its activation): the whole product"):
        a, b = _weights(6, 12, 8), _weights(7, 8, 12)

        def rank(group):
            up, _ = _column_layer(layers, group, a, None)
            down, _ = _row_layer(layers, group, b, None)
            return down(up(x))

        _check_every_rank(g, run_ranks(2, rank), (x @ a.T) @ b.T, "(x @ A.T) @ B.T")
    for k in (2, 3):
        with g.scenario(f"vocabulary-parallel embedding on {k} ranks: exactly the whole table's rows"):
            table = _weights(8, 12, 4)
            ids = torch.tensor([[0, 3, 4, 7], [8, 11, 5, 0]])          # the ends of every slice, repeats

            def rank(group):
                layer = layers.VocabEmbedding(12, 4, group).double()
                per = 12 // group.world_size
                with torch.no_grad():
                    layer.weight.copy_(table[group.rank * per:(group.rank + 1) * per])
                return layer(ids)

            _check_every_rank(g, run_ranks(k, rank), F.embedding(ids, table),
                              "F.embedding(ids, table), bit for bit (one real row and k - 1 rows of zeros)",
                              exact=True)
