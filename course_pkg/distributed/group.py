"""One rank's handle on the tensor-parallel group: who it is, and the collectives the model needs.

A step needs three collective operations, and this class is the only place that calls
``torch.distributed``:

* ``all_reduce`` -- sum a tensor over the ranks, every rank gets the sum (after a
  row-parallel layer and after the vocabulary-parallel embedding);
* ``gather_to_first`` -- rank 0 receives every rank's slice (the LM head's logits);
* ``broadcast`` -- every rank receives rank 0's tensor (each step's metadata).

Outside the steps: ``gather_text`` brings a short text from every rank to rank 0 (reports,
traces, start-up errors), ``min_over_ranks`` agrees on the pool size, ``time_all_reduce``
measures the link.

The three step collectives are counted (calls, bytes, and the seconds spent waiting in them),
so a run can be compared with what the formula predicts, and a trace can be switched on that
records one line per collective.

With ``world_size == 1`` every operation is the identity and ``torch.distributed`` is never
touched: the same layers then run in a single process.
"""
from __future__ import annotations

import os
import socket
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from course_pkg.validation import check_positive_int

#: How long a collective may wait for the other ranks. Workers wait between steps inside a
#: collective (the broadcast of the next step), so this is also how long an idle LLM keeps
#: them: days, not gloo's default half hour.
COLLECTIVE_TIMEOUT = timedelta(days=7)
#: How long rank 0 waits for the workers to connect at start-up.
STARTUP_TIMEOUT = timedelta(seconds=60)


def find_free_port() -> int:
    """A TCP port nobody listens on now: bind port 0 and let the kernel choose."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def backend_for(device_type: str) -> str:
    """NCCL between GPUs, gloo between CPU processes."""
    return "nccl" if device_type == "cuda" else "gloo"


def max_tensor_parallel_size(device_type: str) -> int:
    """How many ranks this machine can hold: one per GPU on CUDA; one per CPU core on a CPU.

    On a CPU nothing stops more processes than cores, but they would only take turns on the
    cores, and every all-reduce would wait for the slowest: one rank per core is the limit.
    """
    if device_type == "cuda":
        return torch.cuda.device_count()
    return os.cpu_count() or 1


def check_tensor_parallel_size(tensor_parallel_size, config, device_type: str) -> None:
    """Raise ``ValueError`` naming the problem if ``config`` cannot be split
    ``tensor_parallel_size`` ways on this machine (or it is not an integer >= 1). Starts nothing."""
    k = check_positive_int("tensor_parallel_size", tensor_parallel_size)
    if k == 1:
        return
    for field in ("num_attention_heads", "num_key_value_heads", "intermediate_size", "vocab_size"):
        value = getattr(config, field)
        if value % k:
            raise ValueError(f"tensor_parallel_size={k} does not divide the model's {field}={value}: "
                             f"every rank must hold the same share")
    limit = max_tensor_parallel_size(device_type)
    if k > limit:
        what = f"{limit} CUDA device(s)" if device_type == "cuda" else f"{limit} CPU core(s) (os.cpu_count())"
        raise ValueError(f"tensor_parallel_size={k} is more than this machine's {what}: one rank per device")


class TensorParallelGroup:
    """Rank ``rank`` of ``world_size``; tensors it communicates live on ``device``."""

    def __init__(self, rank: int, world_size: int, device: torch.device):
        self.rank = rank
        self.world_size = world_size
        self.device = torch.device(device)
        self.all_reduce_calls = 0
        self.all_reduce_bytes = 0
        self.gather_bytes = 0
        self.broadcast_bytes = 0
        self.collective_calls = 0               # all_reduce, gather_to_first and broadcast calls
        self.comm_seconds = 0.0                 # seconds inside all_reduce, gather_to_first, broadcast
        self.events: list[str] | None = None    # a list while a trace is being recorded

    # ---------------------------------------------------------------- set-up

    @classmethod
    def connect(cls, rank: int, world_size: int, port: int, device: torch.device,
                workers=()) -> "TensorParallelGroup":
        """Join the default process group over TCP on 127.0.0.1:``port``.

        Rank 0 hosts the rendezvous store and waits for every worker to check in, watching
        ``workers`` (their processes): a worker that dies first -- e.g. a script without the
        ``if __name__ == "__main__":`` guard that *spawn* needs -- is reported at once
        instead of after a timeout.
        """
        if dist.is_initialized():
            raise RuntimeError("this process already belongs to a torch.distributed group: only one "
                               "tensor-parallel LLM per process at a time (close() the other one first)")
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=(rank == 0),
                              timeout=STARTUP_TIMEOUT, wait_for_workers=False)
        if rank == 0:
            cls._wait_for_workers(store, world_size, workers)
        else:
            store.set(f"checked-in/{rank}", "1")
        dist.init_process_group(backend_for(device.type), store=store, rank=rank, world_size=world_size,
                                timeout=COLLECTIVE_TIMEOUT)
        return cls(rank, world_size, device)

    @staticmethod
    def _wait_for_workers(store, world_size: int, workers) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT.total_seconds()
        for rank in range(1, world_size):
            while not store.check([f"checked-in/{rank}"]):
                time.sleep(0.05)
                dead = [p for p in workers if not p.is_alive()]
                if dead:
                    raise RuntimeError(
                        f"tensor-parallel worker {dead[0].name} exited (code {dead[0].exitcode}) before joining "
                        f"the group; its error is printed above. Started with spawn, a worker imports the main "
                        f"script again: a script must create the LLM under `if __name__ == \"__main__\":`")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"tensor-parallel rank {rank} did not join within "
                                       f"{STARTUP_TIMEOUT.total_seconds():.0f} s")

    def disconnect(self) -> None:
        if self.world_size > 1 and dist.is_initialized():
            dist.destroy_process_group()

    # ---------------------------------------------------------------- tracing

    def record(self, line: str) -> None:
        if self.events is not None:
            self.events.append(line)

    @staticmethod
    def _describe(x: torch.Tensor) -> str:
        return f"{list(x.shape)} {str(x.dtype).removeprefix('torch.')}, {x.numel() * x.element_size()} B"

    # ---------------------------------------------------------------- collectives

    def all_reduce(self, x: torch.Tensor, label: str = "") -> torch.Tensor:
        """Sum ``x`` over the ranks, in place; every rank ends with the sum."""
        self.all_reduce_calls += 1
        self.collective_calls += 1
        self.all_reduce_bytes += x.numel() * x.element_size()
        self.record(f"{label}: all_reduce {self._describe(x)}")
        if self.world_size > 1:
            start = time.perf_counter()
            dist.all_reduce(x)
            self.comm_seconds += time.perf_counter() - start
        return x

    def gather_to_first(self, x: torch.Tensor, label: str = "") -> list[torch.Tensor] | None:
        """Every rank's ``x`` (same shape on every rank), in rank order, on rank 0; None elsewhere."""
        self.gather_bytes += x.numel() * x.element_size()
        self.collective_calls += 1
        self.record(f"{label}: gather to rank 0 {self._describe(x)}")
        if self.world_size == 1:
            return [x]
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)] if self.rank == 0 else None
        start = time.perf_counter()
        dist.gather(x, parts, dst=0)
        self.comm_seconds += time.perf_counter() - start
        return parts

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's ``x`` on every rank, in place (the others pass a buffer of the same shape)."""
        self.broadcast_bytes += x.numel() * x.element_size()
        self.collective_calls += 1
        if self.world_size > 1:
            start = time.perf_counter()
            dist.broadcast(x, src=0)
            self.comm_seconds += time.perf_counter() - start
        return x

    def gather_text(self, text: str) -> list[str] | None:
        """Every rank's ``text`` on rank 0 (None elsewhere): its UTF-8 bytes, padded to the longest."""
        if self.world_size == 1:
            return [text]
        data = torch.tensor(list(text.encode()), dtype=torch.uint8, device=self.device)
        length = torch.tensor([data.numel()], dtype=torch.int64, device=self.device)
        lengths = [torch.empty_like(length) for _ in range(self.world_size)] if self.rank == 0 else None
        dist.gather(length, lengths, dst=0)
        longest = torch.tensor([data.numel()], dtype=torch.int64, device=self.device)
        dist.all_reduce(longest, op=dist.ReduceOp.MAX)
        padded = torch.zeros(max(int(longest), 1), dtype=torch.uint8, device=self.device)   # never empty
        padded[:data.numel()] = data
        parts = [torch.empty_like(padded) for _ in range(self.world_size)] if self.rank == 0 else None
        dist.gather(padded, parts, dst=0)
        if self.rank != 0:
            return None
        return [bytes(p[:int(n)].tolist()).decode() for p, n in zip(parts, lengths)]

    def time_all_reduce(self, numel: int, repeats: int) -> float:
        """Seconds per bare all-reduce of ``numel`` float32 values, every rank calling it at once
        (not counted: a measurement of the link, not part of a step)."""
        if self.world_size == 1:
            return 0.0
        x = torch.zeros(numel, dtype=torch.float32, device=self.device)
        for _ in range(max(repeats // 10, 1)):       # warm-up
            dist.all_reduce(x)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        start = time.perf_counter()
        for _ in range(repeats):
            dist.all_reduce(x)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return (time.perf_counter() - start) / repeats

    def min_over_ranks(self, value: int) -> int:
        """The smallest ``value`` of all ranks, on every rank (not counted: set-up only)."""
        if self.world_size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t)
