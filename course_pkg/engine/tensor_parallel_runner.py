"""The tensor-parallel model runner: rank 0 schedules and samples, every rank computes (chapter 10).

``LLM(..., tensor_parallel_size=k)`` runs ``k`` ranks. Rank 0 is the calling process: it holds
the engine, the one Scheduler and the one BlockManager, exactly as with a single device. Ranks
``1 .. k-1`` are worker processes (``torch.multiprocessing``, *spawn*: a fresh interpreter
that imports :func:`worker_main` from this package, so it works from a notebook too). Every
rank holds:

* its shard of the model (:mod:`course_pkg.distributed.model`): ``1/k`` of the query heads,
  of the KV heads, of the MLP width and of the vocabulary;
* its own paged KV cache, ``[2, layers, num_blocks, block_size, num_kv_heads / k, head_dim]``,
  with the **same number of blocks** as every other rank.

The block ids need no translation: block ``b`` of rank ``r`` holds, for the same tokens, the
K/V of rank ``r``'s heads. So the BlockManager knows nothing of tensor parallelism -- it
hands out block numbers, and a block number means the same thing on every rank. What the
ranks must share is the step: every step rank 0 broadcasts the flat batch it prepared
(token ids, positions, slot mapping, block tables, context lengths, ``cu_seqlens_q``, the
rows that need logits). Then all ranks run the same forward pass on different weights,
meeting at the all-reduces; the LM head's vocabulary slices are gathered on rank 0, which
samples (the workers never see a Sequence, a SamplingParams or a random generator). A
copy-on-write (chapter 08) is broadcast the same way: every rank copies the same block ids in
its own cache.

Why ``torch.distributed`` for the step metadata, where Nano-vLLM writes it (pickled) into a
shared-memory segment and wakes the workers with events: one mechanism carries both the
tensors of the forward pass and the orders that start it; it works the same between
processes on one machine and between machines (shared memory does not leave the machine);
and there is no segment to size, name and unlink -- nothing left behind if a process dies.
The price is two small broadcasts per step (a fixed header, then the payload): two more
collectives next to the ``2 * layers + 1`` all-reduces of the forward pass. The metadata
travels as integer tensors, not pickles: no rank ever unpickles what another sent.

Shutdown: ``close()`` sends the workers an exit order and joins them; if a step was
interrupted half-way (the ranks would no longer agree on which collective comes next), it
terminates them instead. A finalizer does the same when the runner is garbage-collected or
the interpreter exits, and each worker ends itself when rank 0's process disappears (a
watchdog thread on the parent's sentinel), so no worker outlives its LLM.
"""
from __future__ import annotations

import json
import multiprocessing
import multiprocessing.connection
import os
import sys
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch

from course_pkg.distributed.group import TensorParallelGroup, find_free_port
from course_pkg.distributed.model import check_checkpoint, load_shard_model, parameter_bytes, shard_config
from course_pkg.engine.model_runner import ModelRunner
from course_pkg.models import AttentionMetadata
from course_pkg.validation import check_int, check_positive_int

# Commands in the first word of the step header.
EXIT, RUN, REPORT, TIME_ALL_REDUCE, COPY_BLOCKS = 0, 1, 2, 3, 4
HEADER = ("command", "num_tokens", "num_seqs", "max_blocks", "num_rows", "max_q_len", "max_context_len", "trace")
WORKER_JOIN_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class RankReport:
    """What one rank holds and what its collectives moved so far (measured on that rank)."""

    rank: int
    kv_heads: tuple[int, int]           # [first, last) of the model's KV heads
    query_heads: tuple[int, int]
    vocab: tuple[int, int]              # [first, last) of the vocabulary
    weight_bytes: int
    kv_cache_bytes: int
    all_reduce_calls: int
    all_reduce_bytes: int
    gather_bytes: int
    broadcast_bytes: int
    collective_calls: int               # all-reduces, gathers and broadcasts
    comm_seconds: float                 # time inside collectives (waiting for the others included)
    trace: tuple[str, ...]              # the last traced step, one line per event


class StartupFailed(RuntimeError):
    pass


def device_for_rank(device_type: str, rank: int) -> torch.device:
    """Rank ``r`` uses GPU ``r``; on a CPU every rank is a process on the same CPU."""
    if device_type == "cuda":
        torch.cuda.set_device(rank)
        return torch.device("cuda", rank)
    return torch.device("cpu")


class TensorParallelModelRunner(ModelRunner):
    """A :class:`ModelRunner` over one rank's shard. Rank 0 calls ``run(seqs)`` like the
    single-device runner; the workers sit in :meth:`serve` and execute what rank 0 sends."""

    def __init__(self, model_path, config, group: TensorParallelGroup, *, dtype: torch.dtype, **runner_kwargs):
        self.group = group
        error = ""
        try:
            model = load_shard_model(model_path, config, group, dtype, group.device)
        except Exception as e:                      # reported by rank 0, for every rank
            error = f"{type(e).__name__}: {e}"
        self._agree_started(error)
        super().__init__(model, shard_config(config, group.world_size), **runner_kwargs)
        self.full_config = config
        # Same block ids on every rank: the pool is the smallest any rank can hold (on a GPU
        # each rank measured its own free memory).
        num_blocks = group.min_over_ranks(self.num_kvcache_blocks)
        if num_blocks != self.num_kvcache_blocks:
            self.num_kvcache_blocks = num_blocks
            self.kv_cache = self.kv_cache[:, :, :num_blocks].clone()
            self.kv_caches = [(self.kv_cache[0, i], self.kv_cache[1, i]) for i in range(self.num_layers)]
        self.weight_bytes = parameter_bytes(model)
        self.processes: list[multiprocessing.Process] = []
        self.step_log: list[tuple[int, int]] = []   # rank 0: (tokens, bytes all-reduced) per step
        self.last_trace: list[str] = []
        self.broken = False                          # a step stopped half-way: ranks out of step
        self._trace_next = False
        self._traced = False
        self._finalizer = None

    def _agree_started(self, error: str) -> None:
        """Every rank says whether it loaded its shard; all stop together if one did not."""
        errors = self.group.gather_text(error)
        verdict = torch.tensor([0], dtype=torch.int64, device=self.group.device)
        if self.group.rank == 0:
            verdict[0] = int(any(errors))
        self.group.broadcast(verdict)
        if int(verdict):
            if self.group.rank == 0:
                raise StartupFailed("tensor-parallel start-up failed: " +
                                    "; ".join(f"rank {r}: {e}" for r, e in enumerate(errors) if e))
            raise StartupFailed(error or "another rank failed to start")

    # ---------------------------------------------------------------- start and stop (rank 0)

    @classmethod
    def launch(cls, model_path, config, tensor_parallel_size: int, *, device: torch.device, dtype: torch.dtype,
               **runner_kwargs) -> "TensorParallelModelRunner":
        """Start ranks ``1 .. k-1``, join them as rank 0; return rank 0's runner."""
        k = tensor_parallel_size
        check_checkpoint(model_path, config)      # a broken folder fails here, before any process starts
        ctx = torch.multiprocessing.get_context("spawn")
        port = find_free_port()
        procs = [ctx.Process(target=worker_main, name=f"tensor-parallel-rank-{rank}", daemon=True,
                             args=(rank, k, port, str(model_path), dtype, device.type, runner_kwargs,
                                   torch.get_num_threads()))
                 for rank in range(1, k)]
        for p in procs:
            p.start()
        group = None
        try:
            group = TensorParallelGroup.connect(0, k, port, device_for_rank(device.type, 0), procs)
            runner = cls(model_path, config, group, dtype=dtype, **runner_kwargs)
        except BaseException:
            _stop(procs, group, graceful=False)
            raise
        runner.processes = procs
        runner._finalizer = weakref.finalize(runner, _stop, procs, group, False)
        return runner

    @property
    def worker_pids(self) -> list[int]:
        return [p.pid for p in self.processes]

    def close(self) -> None:
        """Stop the workers and leave the process group. Safe to call twice."""
        if self._finalizer is None or not self._finalizer.alive:
            return
        graceful = not self.broken and all(p.is_alive() for p in self.processes)
        if graceful:
            try:
                self.group.broadcast(self._header(EXIT))
            except Exception:           # a worker died meanwhile: terminate the others
                graceful = False
        self._finalizer.detach()
        _stop(self.processes, self.group, graceful)

    # ---------------------------------------------------------------- one step (rank 0)

    def _header(self, command: int, **fields) -> torch.Tensor:
        values = [command] + [fields.get(name, 0) for name in HEADER[1:]]
        return torch.tensor(values, dtype=torch.int64, device=self.group.device)

    def _check_usable(self) -> None:
        if self.group.rank != 0:
            raise RuntimeError("only rank 0 drives the tensor-parallel group")
        if self._finalizer is None or not self._finalizer.alive:
            raise RuntimeError("this LLM is closed: its tensor-parallel workers have stopped")
        if self.broken:
            raise RuntimeError("a tensor-parallel step was interrupted half-way, so the ranks no longer "
                               "agree on the next collective: close() this LLM and create a new one")
        dead = [p.name for p in self.processes if not p.is_alive()]
        if dead:
            raise RuntimeError(f"tensor-parallel worker(s) {', '.join(dead)} died: close() this LLM")

    def check_usable(self) -> None:
        self._check_usable()

    def trace_next_step(self) -> None:
        """Record, on every rank, what the next step does (read it with :meth:`report`)."""
        self._trace_next = True

    def _forward(self, seqs):
        """As :meth:`ModelRunner._forward`, on all ranks: prepare, broadcast, forward, gather.

        ``run`` and ``run_with_logprobs`` are the single-device runner's, unchanged: they call
        this and sample (and take log-probabilities) from the gathered logits, on rank 0 only.
        """
        self._check_usable()
        input_ids, positions, attn, logits_rows, sample_seqs = self.prepare(seqs)
        trace, self._trace_next = self._trace_next, False
        tensors = [input_ids, positions, attn.slot_mapping, attn.block_tables.flatten(), attn.context_lens,
                   attn.cu_seqlens_q, logits_rows]
        header = self._header(RUN, num_tokens=input_ids.numel(), num_seqs=attn.context_lens.numel(),
                              max_blocks=attn.block_tables.shape[1], num_rows=logits_rows.numel(),
                              max_q_len=attn.max_q_len, max_context_len=attn.max_context_len, trace=int(trace))
        before = self.group.all_reduce_bytes
        self.broken = True            # until every rank is past this step's last collective
        self.group.broadcast(header)
        self.group.broadcast(torch.cat([t.long() for t in tensors]))
        logits = self._execute(input_ids, positions, attn, logits_rows, trace)
        self.broken = False
        self.step_log.append((input_ids.numel(), self.group.all_reduce_bytes - before))
        self._traced = trace
        return logits, sample_seqs

    @torch.inference_mode()
    def run_with_logprobs(self, seqs, num_samples=None, num_logprobs=None):
        """As :meth:`ModelRunner.run_with_logprobs`; a traced step also records what rank 0 sampled."""
        self._traced = False
        result = super().run_with_logprobs(seqs, num_samples, num_logprobs)
        if self._traced:
            sampled = [t[0] if len(t) == 1 else t for t in result.sampled_token_ids if t]
            self.last_trace.append(f"sampled {sampled}" if sampled else "nothing sampled (a chunk of a prompt)")
        return result

    @torch.inference_mode()
    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write on every rank: each copies block ``src`` to ``dst`` in its own cache
        (its own heads), so the block ids stay interchangeable between the ranks."""
        if not pairs:
            return
        self._check_usable()
        self.broken = True
        self.group.broadcast(self._header(COPY_BLOCKS, num_tokens=len(pairs)))
        self.group.broadcast(torch.tensor(pairs, dtype=torch.int64, device=self.group.device).flatten())
        super().copy_blocks(pairs)
        self.broken = False

    def report(self) -> list[RankReport]:
        """Every rank's :class:`RankReport`, measured by that rank, in rank order."""
        self._check_usable()
        self.broken = True
        self.group.broadcast(self._header(REPORT))
        texts = self.group.gather_text(self._report_json())
        self.broken = False
        return [RankReport(**{k: tuple(v) if isinstance(v, list) else v for k, v in json.loads(t).items()})
                for t in texts]

    def time_all_reduce(self, num_bytes: int, repeats: int = 200) -> float:
        """Seconds per bare all-reduce of ``num_bytes`` (float32) between all ranks: the link's
        cost alone, without a model around it."""
        check_int("num_bytes", num_bytes, minimum=4)
        check_positive_int("repeats", repeats)
        self._check_usable()
        numel = num_bytes // 4
        self.broken = True
        self.group.broadcast(self._header(TIME_ALL_REDUCE, num_tokens=numel, num_seqs=repeats))
        seconds = self.group.time_all_reduce(numel, repeats)
        self.broken = False
        return seconds

    # ---------------------------------------------------------------- every rank

    def _execute(self, input_ids, positions, attn: AttentionMetadata, logits_rows, trace: bool):
        """The forward pass every rank runs; the logits ``[rows, vocab]`` on rank 0, else None."""
        g = self.group
        if trace:
            g.events = [f"step of {input_ids.numel()} token(s): block_tables {attn.block_tables.tolist()}, "
                        f"slot_mapping {attn.slot_mapping.tolist()}"]
            lo, hi = self._kv_heads()
            g.record(f"KV cache: writes KV heads [{lo}, {hi}) of {self.full_config.num_key_value_heads} "
                     f"into those slots, in every layer")
        try:
            hidden = self.model(input_ids, positions, attn, self.kv_caches)
            logits = self.model.compute_logits(hidden[logits_rows]) if logits_rows.numel() else None
        finally:
            if trace:
                self.last_trace, g.events = g.events, None
        return logits

    def _kv_heads(self) -> tuple[int, int]:
        n = self.num_kv_heads
        return self.group.rank * n, (self.group.rank + 1) * n

    def _report_json(self) -> str:
        g, n_q = self.group, self.full_config.num_attention_heads // self.group.world_size
        per_vocab = self.full_config.vocab_size // g.world_size
        return json.dumps(dict(
            rank=g.rank, kv_heads=self._kv_heads(), query_heads=(g.rank * n_q, (g.rank + 1) * n_q),
            vocab=(g.rank * per_vocab, (g.rank + 1) * per_vocab), weight_bytes=self.weight_bytes,
            kv_cache_bytes=self.kv_cache_bytes, all_reduce_calls=g.all_reduce_calls,
            all_reduce_bytes=g.all_reduce_bytes, gather_bytes=g.gather_bytes, broadcast_bytes=g.broadcast_bytes,
            collective_calls=g.collective_calls, comm_seconds=g.comm_seconds, trace=self.last_trace))

    # ---------------------------------------------------------------- the workers' loop

    @torch.inference_mode()
    def serve(self) -> None:
        """Ranks 1..k-1: execute every step rank 0 broadcasts, until it says exit."""
        g = self.group
        while True:
            header = g.broadcast(torch.empty(len(HEADER), dtype=torch.int64, device=g.device))
            h = dict(zip(HEADER, header.tolist()))
            if h["command"] == EXIT:
                return
            if h["command"] == REPORT:
                g.gather_text(self._report_json())
                continue
            if h["command"] == TIME_ALL_REDUCE:
                g.time_all_reduce(h["num_tokens"], h["num_seqs"])
                continue
            if h["command"] == COPY_BLOCKS:
                pairs = g.broadcast(torch.empty(2 * h["num_tokens"], dtype=torch.int64, device=g.device))
                ModelRunner.copy_blocks(self, [tuple(p) for p in pairs.view(-1, 2).tolist()])
                continue
            n, s, b, r = h["num_tokens"], h["num_seqs"], h["max_blocks"], h["num_rows"]
            sizes = [n, n, n, s * b, s, s + 1, r]
            payload = g.broadcast(torch.empty(sum(sizes), dtype=torch.int64, device=g.device))
            ids, pos, slots, tables, ctx, cu, rows = payload.split(sizes)
            attn = AttentionMetadata(
                slot_mapping=slots, block_tables=tables.view(s, b).int(), context_lens=ctx.int(),
                cu_seqlens_q=cu.int(), max_q_len=h["max_q_len"], max_context_len=h["max_context_len"],
                backend=self.attention_backend)
            self._execute(ids, pos, attn, rows, bool(h["trace"]))


def _stop(processes, group, graceful: bool) -> None:
    """Join the workers (after an exit order) or terminate them; then leave the group."""
    for p in processes:
        if graceful:
            p.join(WORKER_JOIN_TIMEOUT_S)
        if p.is_alive():
            p.terminate()
            p.join(WORKER_JOIN_TIMEOUT_S)
        if p.is_alive():
            p.kill()
            p.join()
    if group is not None:
        group.disconnect()


def _exit_with_parent() -> None:
    """A watchdog thread: when rank 0's process ends (killed included), so does this one."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch():
        multiprocessing.connection.wait([parent.sentinel])
        os._exit(1)

    threading.Thread(target=watch, name="parent-watchdog", daemon=True).start()


def worker_main(rank: int, world_size: int, port: int, model_path: str, dtype: torch.dtype, device_type: str,
                runner_kwargs: dict, num_threads: int) -> None:
    """Entry point of ranks 1..k-1 (a spawned process): join, load the shard, serve, leave."""
    from course_pkg.models import load_config

    _exit_with_parent()
    torch.set_num_threads(num_threads)
    group = TensorParallelGroup.connect(rank, world_size, port, device_for_rank(device_type, rank))
    try:
        runner = TensorParallelModelRunner(Path(model_path), load_config(model_path), group, dtype=dtype,
                                           **runner_kwargs)
    except StartupFailed:
        pass                          # rank 0 raises the error, naming this rank
    else:
        runner.serve()
    group.disconnect()
    # Everything this process owns is released now. Leave without the interpreter's teardown,
    # which now and then aborts inside torch.distributed's background threads ("terminate
    # called without an active exception", exit code -6) after a clean exit.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
