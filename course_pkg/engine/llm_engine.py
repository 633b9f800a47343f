"""The LLMEngine: requests in, one scheduled forward pass per ``step()``, outputs out (chapter 06).

It wires the three parts the earlier chapters built::

    add_request(prompt) -> Sequence -> Scheduler.add         (validated: clear errors, nothing queued)
    step():  Scheduler.schedule()        -> SchedulerOutput  (what the step does)
             ModelRunner.execute_model() -> ModelRunnerOutput (copies, forward pass, sampling)
             Scheduler.update_from_output -> finished seqs    (cached tokens, new tokens, releases)
    abort_request(request_id)                                 (blocks freed, finish_reason "abort")

and keeps the numbers a serving system reports: per request the time to first token and the
tokens the prefix cache provided; for the engine the counters vLLM exports under the same
names (prefix-cache queries, hits and hit rate, KV cache usage, preemptions, tokens).

Faults. A step is a transaction (``course_pkg.undo``; ARCHITECTURE.md, "The journal"): if
anything raises on any line between the first of ``schedule`` and the commit -- the model,
the sampler, the block manager, an interrupt -- the scheduler's journal is played backwards
and the model runner puts its generators back (``_finish_interrupted_step``), the engine is
as it was before the step, and the next step computes the same tokens, seeded samples
included. The requests a step finishes are marked ready inside it; their outputs are built
after it and moved to an outbox in one transaction, which ``step()`` empties: a tokenizer
error, failing metrics or an interrupt leave them there for the next call, exactly once. A
SIGINT (Ctrl-C, "interrupt the kernel") waits until the step has committed or been undone.

Threads. One engine serves one thread at a time: a call from a second thread while another
one is inside ``step``/``generate``/``add_request``/``abort_request`` raises ``RuntimeError``
at once, instead of interleaving two callers' steps.
"""
from __future__ import annotations

import json
import threading
import time
from collections.abc import Sequence as SequenceABC
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path

import torch

from course_pkg.engine.config import EngineConfig
from course_pkg.engine.inputs import PromptType, parse_prompt
from course_pkg.engine.model_runner import ModelRunner, kv_block_bytes
from course_pkg.engine.outputs import (CompletionOutput, EngineCoreOutput, EngineMetrics, ModelRunnerOutput,
                                       RequestMetrics, RequestOutput, StepInfo)
from course_pkg.beam_search import BeamSearch
from course_pkg.block_manager import BlockManager
from course_pkg.hybrid_block_manager import HybridBlockManager
from course_pkg.kv_cache_spec import KVCacheConfig, get_kv_cache_config
from course_pkg.sampling_params import BeamSearchParams, SamplingParams
from course_pkg.scheduler import Scheduler, SchedulerOutput
from course_pkg.sequence import Sequence
from course_pkg.undo import deferred_interrupts, transaction
from course_pkg.validation import check_token_ids, is_int


class LLMEngine:
    """Offline inference engine: a model, its paged KV cache, a scheduler.

    ``LLMEngine(model=None, **kwargs)``: the arguments are :class:`EngineConfig`'s, checked
    there before anything loads (``self.engine_config`` keeps them). ``model`` is a Hugging
    Face checkpoint folder (``None``: the tiny default shipped with the package).

    ``tensor_parallel_size=k > 1`` splits the model over ``k`` ranks (chapter 10,
    :mod:`course_pkg.distributed`): this process is rank 0 and keeps the one scheduler;
    ``self.model`` is then rank 0's shard, and the byte budget is per rank. Call ``close()``
    (or use ``with LLM(...) as llm:``) to stop the worker processes. The metrics are also kept
    in a Prometheus registry, ``self.metrics_registry``, under vLLM's names.
    """

    def __init__(self, model: str | Path | None = None, **kwargs):
        from course_pkg.engine.metrics import PrometheusMetrics
        from course_pkg.models import default_model_path, load_config, load_model, load_tokenizer

        cfg = self.engine_config = EngineConfig(model=model, **kwargs)
        device, dtype = cfg.torch_device, cfg.torch_dtype
        k = cfg.tensor_parallel_size
        if k == 1:
            self.model, self.config, self.tokenizer = load_model(model, dtype=dtype, device=device)
        else:       # the ranks load their own shards; rank 0 needs the config and tokenizer only
            from course_pkg.distributed import check_tensor_parallel_size
            path = default_model_path() if model is None else Path(model)
            self.config, self.tokenizer = load_config(path), load_tokenizer(path)
            check_tensor_parallel_size(k, self.config, device.type)
        self.max_model_len, spec = cfg.check_against_model(self.config)
        kv_transfer = cfg.kv_transfer_config   # (chapter 15; a size in bytes becomes blocks of this model's)
        disk_tier = None
        if kv_transfer is not None:
            kv_transfer = kv_transfer.in_blocks(kv_block_bytes(self.config, cfg.block_size, dtype))
            if kv_transfer.disk_path is not None:
                disk_tier = open_disk_tier(kv_transfer.disk_path, model, self.config, cfg.block_size, dtype)
        self.speculative_config = spec
        proposer = make_proposer(spec) if spec is not None else None
        # The KV cache groups (chapter 16): one, unless the model has sliding-window layers.
        self.kv_cache_config = get_kv_cache_config(
            self.config, cfg.block_size, torch.empty((), dtype=dtype).element_size(),
            disable_hybrid_kv_cache_manager=cfg.disable_hybrid_kv_cache_manager)
        if self.kv_cache_config.is_hybrid:
            check_hybrid_options(cfg, spec)
        runner_kwargs = dict(
            block_size=cfg.block_size, attention_backend=cfg.attention_backend, seed=cfg.seed,
            num_kvcache_blocks=cfg.num_kvcache_blocks, kv_cache_memory_bytes=cfg.kv_cache_memory_bytes,
            gpu_memory_utilization=cfg.gpu_memory_utilization, max_num_batched_tokens=cfg.max_num_batched_tokens,
            max_model_len=self.max_model_len)
        if k == 1:
            self.model_runner = ModelRunner(self.model, self.config, **runner_kwargs,
                                            num_cpu_blocks=cfg.num_cpu_blocks or 0, proposer=proposer,
                                            num_offload_blocks=kv_transfer.num_cpu_blocks if kv_transfer else 0,
                                            disk_tier=disk_tier, kv_cache_config=self.kv_cache_config)
        else:
            from course_pkg.engine.tensor_parallel_runner import TensorParallelModelRunner
            self.model_runner = TensorParallelModelRunner.launch(
                path, self.config, k, device=device, dtype=dtype, **runner_kwargs)
            self.model = self.model_runner.model
        num_blocks = self.model_runner.num_kvcache_blocks
        self.scheduler = Scheduler(
            num_blocks, cfg.block_size, max_num_seqs=cfg.max_num_seqs,
            max_num_batched_tokens=cfg.max_num_batched_tokens, max_model_len=self.max_model_len,
            enable_prefix_caching=cfg.enable_prefix_caching,
            eos_token_id=stop_token_ids(model, self.config, self.tokenizer),
            block_manager=make_block_manager(num_blocks, cfg, self.kv_cache_config),
            scheduling=cfg.scheduling, preemption_mode=cfg.preemption_mode, num_cpu_blocks=cfg.num_cpu_blocks,
            same_step_prefix_hits=cfg.same_step_prefix_hits,
            num_lookahead_tokens=spec.num_speculative_tokens if spec is not None else 0,
            # torch-free (n-gram): the scheduler proposes before it takes slots
            proposer=proposer if spec is not None and spec.method == "ngram" else None,
            kv_transfer_config=kv_transfer, disk_tier=disk_tier,
            transactional=True)   # every step undone exactly if it raises (ARCHITECTURE.md, "The journal")
        self.block_size = cfg.block_size
        self.last_step: StepInfo | None = None
        # The engine's own records, journaled with the scheduler's state (undo.py): a step,
        # an add and an abort change them in the scheduler's transaction, all or nothing.
        journal = self.scheduler.journal
        self._requests: dict[int, _Request] = journal.adopt({})   # every request not yet handed out
        self._ready: list[int] = journal.adopt([])                # requests whose every completion finished
        self._outbox: dict[int, RequestOutput] = journal.adopt({})   # outputs built, not yet returned
        self._open_step: int | None = None                        # see _finish_interrupted_step
        self._lock = threading.RLock()
        self.prometheus = PrometheusMetrics(Path(model).name if model is not None else "course-tiny",
                                            num_speculative_tokens=spec.num_speculative_tokens if spec else 0,
                                            offload=cfg.kv_transfer_config is not None)
        self.prometheus.update(self.get_metrics())

    @property
    def metrics_registry(self):
        """The ``prometheus_client.CollectorRegistry`` with this engine's metrics (vLLM's names)."""
        return self.prometheus.registry

    @property
    def num_steps(self) -> int:
        """Steps run so far (the scheduler's count of committed steps)."""
        return self.scheduler.num_steps

    @contextmanager
    def _exclusive(self):
        """Hold the engine for this thread; another thread gets a RuntimeError at once. Every
        call that holds it starts and, if it raises, ends by finishing what a fault left open
        (``_finish_interrupted_step``): a transaction cut short on any line is never left open."""
        locked = False
        try:   # (acquired inside the try: an interrupt right after it still releases the lock)
            locked = self._lock.acquire(blocking=False)
            if not locked:
                raise RuntimeError("this engine is in use by another thread (step, generate, add_request or "
                                   "abort_request are running there); an engine serves one thread at a time")
            self._finish_interrupted_step()
            yield
        except BaseException:
            if locked:
                self._finish_interrupted_step()
            raise
        finally:
            if locked:
                self._lock.release()

    def close(self) -> None:
        """Release what outlives a Python reference: the tensor-parallel worker processes."""
        close = getattr(self.model_runner, "close", None)
        if close is not None:
            close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---------------------------------------------------------------- requests

    @property
    def block_manager(self):
        return self.scheduler.block_manager

    def make_sequence(self, prompt: PromptType, sampling_params: SamplingParams | None = None) -> Sequence:
        """A Sequence for ``prompt`` (text, token ids, or vLLM's ``{"prompt": ...}`` /
        ``{"prompt_token_ids": ...}`` with an optional ``"cache_salt"``), checked; queues nothing.

        Raises ``ValueError`` naming the problem: an empty prompt, a token id outside the
        vocabulary (also for text, whose tokenizer may know more tokens than the model), a bad
        prompt dict or salt.
        ``Scheduler.add`` checks the rest (a prompt of ``max_model_len`` tokens or more, a
        request that can never fit in the KV cache); ``SamplingParams`` check their own fields.
        """
        if sampling_params is None:
            sampling_params = SamplingParams()
        if not isinstance(sampling_params, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams, got {type(sampling_params).__name__}")
        prompt, cache_salt = parse_prompt(prompt)
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this checkpoint has no tokenizer: pass prompts as token ids")
            token_ids = self.tokenizer.encode(prompt, add_special_tokens=False)
            if not token_ids:
                raise ValueError(f"prompt {prompt!r} is empty: it encodes to no tokens")
            check_token_ids(f"the token ids of prompt {prompt!r}", token_ids, self.config.vocab_size)
        elif isinstance(prompt, SequenceABC) and not isinstance(prompt, (bytes, bytearray)):
            token_ids = list(prompt)
            if not token_ids:
                raise ValueError("prompt is empty: a request needs at least one token")
            check_token_ids("prompt", token_ids, self.config.vocab_size)
        else:
            raise TypeError(f"a prompt is a str, a list of token ids (ints) or a prompt dict, got "
                            f"{type(prompt).__name__}"
                            + (": decode bytes to a str first" if isinstance(prompt, (bytes, bytearray)) else ""))
        return Sequence(token_ids, sampling_params, block_size=self.block_size, cache_salt=cache_salt)

    def add_request(self, prompt: PromptType, sampling_params: SamplingParams | None = None) -> int:
        """Queue one request; returns its id. Raises (and queues nothing) if it is invalid."""
        with self._exclusive():
            return self._add_all([self.make_sequence(prompt, sampling_params)], [prompt])[0]

    def _add_all(self, seqs: list[Sequence], prompts: list) -> list[int]:
        records = self._records(seqs, prompts)
        with deferred_interrupts():
            # Checks every one first; queues all or none, and the engine's records with them.
            self.scheduler.add_all(seqs, then=lambda: self._requests.update(records))
        self.prometheus.update(self.get_metrics())
        return [seq.seq_id for seq in seqs]

    def add_beam_search(self, prompt: PromptType, params: BeamSearchParams) -> int:
        """Queue a beam search for ``prompt`` (chapter 08); returns its request id. It runs alone
        (``Scheduler.add_beam_search``); the request's output, once ``step()`` hands it out,
        holds the ``beam_width`` best hypotheses, best first, as its completions."""
        self._check_beam_search_params(params)
        with self._exclusive():
            seq = self.make_sequence(prompt, beam_root_params(params))
            self._add_beam_search(seq, params, prompt)
            return seq.request_id

    def _add_beam_search(self, seq: Sequence, params: BeamSearchParams, prompt: PromptType) -> None:
        [(request_id, record)] = self._records([seq], [prompt])

        def note(search):
            record.beam_search = search
            self._requests[request_id] = record

        with deferred_interrupts():
            self.scheduler.add_beam_search(seq, params, then=note)
        self.prometheus.update(self.get_metrics())

    def _check_beam_search_params(self, params: BeamSearchParams) -> None:
        if not isinstance(params, BeamSearchParams):
            raise TypeError(f"params must be a BeamSearchParams, got {type(params).__name__}")
        if params.beam_width > self.config.vocab_size:
            raise ValueError(f"beam_width={params.beam_width} is more than the vocabulary's "
                             f"{self.config.vocab_size} tokens: a step could not fill the beams")

    def _records(self, seqs: list[Sequence], prompts: list) -> list[tuple[int, "_Request"]]:
        """The engine's records of new requests (not yet in its table)."""
        self.model_runner.check_usable()
        now = time.perf_counter()
        return [(seq.seq_id, _Request(seq, text if isinstance(text, str) else None,
                                      RequestMetrics(arrival_time=now, arrival_step=self.num_steps)))
                for seq, text in zip(seqs, (parse_prompt(p)[0] for p in prompts))]

    def abort_request(self, request_id: int) -> RequestOutput:
        """Stop a request now, free its blocks, and return its output (``finish_reason="abort"``).

        A request that has already finished, but whose output no ``step()`` handed out yet,
        is returned as it finished. Raises ``KeyError`` for an unknown or handed-out request.
        """
        if not is_int(request_id):
            raise TypeError(f"a request id is an int, got {type(request_id).__name__} {request_id!r}")
        with self._exclusive():
            with deferred_interrupts():
                if request_id not in self._outbox:   # (else: finished, built, not yet returned by a step)
                    if request_id not in self._requests:
                        raise KeyError(f"no unfinished request with id {request_id}")
                    for seq in self._completions(request_id):
                        if self.scheduler.holds(seq):
                            self.scheduler.abort(seq, then=partial(self._mark_ready, [seq]))
                    self._mark_ready(self._completions(request_id))
                    self._hand_out_ready([request_id])   # if the tokenizer raises, a second call returns it
                    self._observe_finished([self._outbox[request_id]])
        out = self._outbox[request_id]   # (after the lock's release, as in _step)
        try:   # (as in _take_outbox: a fault before the return is complete puts it back)
            del self._outbox[request_id]
            return out
        except BaseException:
            self._outbox[request_id] = out
            raise

    def _completions(self, request_id: int) -> list[Sequence]:
        """The sequences of a request: its own, then its forks (completions 1 .. n-1); for a beam
        search, its live beams (none once it has ended)."""
        req = self._requests[request_id]
        if req.beam_search is not None:
            return list(req.beam_search.beams)
        return [req.seq] + req.seq.children

    def get_sequence(self, request_id: int) -> Sequence:
        """The live Sequence of an unfinished request (to watch its block table)."""
        if request_id not in self._requests:
            raise KeyError(f"no unfinished request with id {request_id}")
        return self._requests[request_id].seq

    def flush_kv_transfer(self) -> None:
        """Make the copies into the tier that the last step decided (chapter 15: a step's blocks are
        stored by the next one), with steps that run no sequence, so that a disk tier holds every
        block computed so far -- before the engine stops, or another one reads the directory. Only
        when no request is unfinished (else the next step makes them anyway)."""
        offload = self.scheduler.offload
        while offload is not None and (offload.stores or offload.writes) and not self.has_unfinished_requests():
            self.step()

    def has_unfinished_requests(self) -> bool:
        """True while some request's output has not been handed out by ``step()``."""
        return bool(self._requests) or bool(self._outbox)

    def is_finished(self) -> bool:
        return not self.has_unfinished_requests()

    # ---------------------------------------------------------------- one step

    def step(self) -> list[RequestOutput]:
        """Run one step, a transaction; return the requests that finished in it."""
        return self._step(deltas=False)[1]

    def step_core(self) -> tuple[list[EngineCoreOutput], list[RequestOutput]]:
        """``step``, plus what it brought every request it touched (``EngineCoreOutput``: new
        tokens and their log-probabilities per completion, finish reasons) -- what a caller that
        streams (``AsyncLLM``) passes on, with nothing to diff."""
        return self._step(deltas=True)

    def _step(self, deltas: bool) -> tuple[list[EngineCoreOutput], list[RequestOutput]]:
        with self._exclusive():
            # A Ctrl-C waits until the step has committed or been undone, and its outputs are
            # in the outbox; raised at the end of this block, it leaves them there for the next call.
            with deferred_interrupts():
                core = self._run_step(deltas)
                handed = self._hand_out_ready()
            self._observe_finished(handed)   # (if the metrics fail, the outputs wait in the outbox)
            for o in self._outbox.values():   # handed out now: finished (its last tokens may be older)
                c = core.get(o.request_id)
                core[o.request_id] = replace(c, finished=True, metrics=o.metrics) if c is not None else \
                    EngineCoreOutput(o.request_id, {}, {}, {x.index: x.finish_reason for x in o.outputs},
                                     o.num_cached_tokens, o.metrics, finished=True)
        # Taken after the lock's release (the exit of the block above): a fault there would drop
        # outputs already taken out of the outbox; here they stay in it until the return.
        return self._take_outbox(list(core.values()))

    def _run_step(self, deltas: bool) -> dict[int, EngineCoreOutput]:
        """Schedule, execute and record one step -- the scheduler's transaction, with the
        requests that finished in it marked ready inside it -- then the engine's notes on it."""
        sched, runner = self.scheduler, self.model_runner
        self._open_step = sched.num_steps   # the step about to run (see _finish_interrupted_step)
        try:
            out = sched.schedule()   # opens the transaction
            runner.begin_step(out.seqs)
            result = runner.execute_model(out)
            finished = sched.update_from_output(out, result, commit=False)
            ready = self._mark_ready(finished)
            sched.commit_step()      # the commit point
            runner.end_step()
        except BaseException:
            self._finish_interrupted_step()
            raise
        # The step stands. What follows is the engine's record of it (metrics, the printable
        # StepInfo, the streamed deltas): an exception here loses none of the step's work.
        self._note_step(out, result, time.perf_counter())
        self.last_step = StepInfo(
            step=out.step, is_prefill=out.is_prefill,
            scheduled=tuple(zip((s.seq_id for s in out.seqs), out.num_computed_tokens, out.num_scheduled_tokens)),
            sampled=tuple((s.seq_id, t[0] if len(t) == 1 else list(t))
                          for s, t in zip(out.seqs, result.sampled_token_ids) if t),
            preempted=tuple(s.seq_id for s in out.preempted), finished=tuple(ready),
            copies=out.blocks_to_copy, swap_out=out.blocks_to_swap_out, swap_in=out.blocks_to_swap_in,
            store=out.blocks_to_store, load=out.blocks_to_load)
        return self._core_outputs(out, result, finished) if deltas else {}

    def _finish_interrupted_step(self) -> None:
        """Bring a step that a fault cut short to an end: undone if it had not committed, else
        closed. Every part may be cut short too and run again: the engine calls this before
        and after any call that raises (``_exclusive``), and whenever a step raises."""
        sched, runner = self.scheduler, self.model_runner
        if sched.journal.recording or (runner.step_is_open and sched.num_steps == self._open_step):
            # Not committed (or its rollback was cut short). The K/V slots it wrote stay noted in
            # the runner until the scheduler has dealt with them; then the generators go back.
            sched.unschedule(overwritten=runner.written_slots())
            runner.abort_step()
        else:
            runner.end_step()   # committed (or nothing was open)

    def _core_outputs(self, out: SchedulerOutput, result: ModelRunnerOutput,
                      finished: list[Sequence]) -> dict[int, EngineCoreOutput]:
        """Per request, what the step ``out`` appended (read off the step's own values)."""
        lookahead = out.num_lookahead_tokens or (0,) * len(out.seqs)
        new: dict[int, tuple[dict, dict, dict]] = {}
        for i, seq in enumerate(out.seqs):
            tokens = result.sampled_token_ids[i]
            if not tokens or self._requests[seq.request_id].beam_search is not None:
                continue   # (a beam search has no deltas: its hypotheses come with its output)
            start = out.num_computed_tokens[i] + out.num_scheduled_tokens[i] - lookahead[i]   # its length before
            ids, lps, _ = new.setdefault(seq.request_id, ({}, {}, {}))
            if out.num_samples[i] > 1:   # it forked now: completion j got token j
                for s, lp in zip([seq] + seq.children, result.logprobs[i]):
                    ids[s.index], lps[s.index] = s.token_ids[start:], [lp]
            else:   # (a speculative step may append fewer than it sampled: it finished part-way)
                ids[seq.index] = seq.token_ids[start:]
                lps[seq.index] = list(result.logprobs[i][:len(ids[seq.index])])
        for seq in finished:
            if self._requests[seq.request_id].beam_search is None:
                new.setdefault(seq.request_id, ({}, {}, {}))[2][seq.index] = seq.finish_reason
        core = {}
        for rid, (ids, lps, reasons) in new.items():
            req = self._requests[rid]
            metrics = replace(req.metrics, inter_token_latencies=list(req.metrics.inter_token_latencies),
                              token_steps=list(req.metrics.token_steps))
            core[rid] = EngineCoreOutput(rid, ids, lps, reasons, req.num_cached_tokens, metrics)
        return core

    def _note_step(self, out: SchedulerOutput, result: ModelRunnerOutput, now: float) -> None:
        """Per request: preemptions, the first schedule (and the prefix-cache hit then), token times."""
        for seq in out.preempted:
            self._requests[seq.request_id].metrics.num_preemptions += 1
        sampled_requests = set()   # a request's completions sample together: one token time per step
        for seq, computed, tokens in zip(out.seqs, out.num_computed_tokens, result.sampled_token_ids):
            req = self._requests[seq.request_id]
            if req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = now
                req.num_cached_tokens = computed   # the prefix-cache hit at admission
            if not tokens or seq.request_id in sampled_requests:
                continue
            sampled_requests.add(seq.request_id)
            first = req.metrics.first_token_time is None
            req.metrics.record_token(now, out.step)
            self.prometheus.observe_token(req.metrics.time_to_first_token if first else None,
                                          None if first else req.metrics.inter_token_latencies[-1])

    def _mark_ready(self, finished: list[Sequence]) -> list[int]:
        """Note the requests whose every completion has finished; returns their ids."""
        ready = []
        for seq in finished:
            rid = seq.request_id
            if rid not in self._ready and all(s.is_finished for s in self._completions(rid)):
                self._ready.append(rid)
                ready.append(rid)
        return ready

    def _hand_out_ready(self, request_ids: list[int] | None = None) -> list[RequestOutput]:
        """Build the outputs of the ready requests (or of ``request_ids`` among them) and move
        them to the outbox; returns the outputs moved.

        Every output is built before anything changes: if the tokenizer raises, they all stay
        ready and the next call moves them. The move is a transaction: the outbox gains them
        and the request table loses them together. Once the scheduler holds nothing, every
        request left is finished and is marked ready here.
        """
        if self.scheduler.is_finished() and len(self._ready) < len(self._requests):
            self._mark_ready([s for rid in self._requests for s in self._completions(rid)])
        ids = list(self._ready) if request_ids is None else [rid for rid in request_ids if rid in self._ready]
        if not ids:
            return []
        built = {rid: self._make_output(rid) for rid in ids}
        with transaction(self._requests, self._ready, self._outbox):
            self._outbox.update(built)
            for rid in ids:
                del self._requests[rid]
                self._ready.remove(rid)
        return list(built.values())

    def _take_outbox(self, core: list[EngineCoreOutput]):
        """``(core, outputs)``, emptying the outbox: what ``step_core`` returns. A fault before the
        return is complete puts the outputs back (the next call returns them)."""
        outputs = list(self._outbox.values())
        try:
            self._outbox.clear()
            return core, outputs
        except BaseException:
            self._outbox.update((o.request_id, o) for o in outputs)
            raise

    def _observe_finished(self, outputs: list[RequestOutput]) -> None:
        """Metrics of outputs handed out (after the hand-out: if they fail, no output is lost)."""
        for out in outputs:
            self.prometheus.observe_finished(out.metrics.e2e_latency, out.metrics.queue_time)
        self.prometheus.update(self.get_metrics())

    def _make_output(self, request_id: int) -> RequestOutput:
        req = self._requests[request_id]
        if req.metrics.finished_time is None:
            req.metrics.finished_time = time.perf_counter()
        if req.beam_search is not None:   # the hypotheses, best first (those found so far, if aborted)
            n = req.seq.num_prompt_tokens
            completions = [(i, h.tokens[n:], h.cum_logprob, h.finish_reason)
                           for i, h in enumerate(req.beam_search.finished)]
        else:
            completions = [(seq.index, seq.completion_token_ids, seq.cumulative_logprob, seq.finish_reason or "abort")
                           for seq in self._completions(request_id)]
        outputs = []
        for index, tokens, cumulative_logprob, finish_reason in completions:
            text = None if self.tokenizer is None else self.tokenizer.decode(tokens, skip_special_tokens=True)
            outputs.append(CompletionOutput(index=index, text=text, token_ids=tokens,
                                            cumulative_logprob=cumulative_logprob, finish_reason=finish_reason))
        return RequestOutput(request_id=request_id, prompt=req.prompt, prompt_token_ids=req.seq.prompt_token_ids,
                             outputs=outputs, num_cached_tokens=req.num_cached_tokens, metrics=req.metrics)

    # ---------------------------------------------------------------- metrics

    def get_metrics(self) -> EngineMetrics:
        sched, bm = self.scheduler, self.scheduler.block_manager
        stats, cache, spec = sched.stats, bm.prefix_cache_stats, sched.spec_decoding_stats
        tier = {}
        if sched.offload is not None:
            moved, block_bytes = sched.offload.manager.stats, self.model_runner.block_bytes
            tier = dict(external_prefix_cache_queries=sched.offload.stats.queries,
                        external_prefix_cache_hits=sched.offload.stats.hits, kv_offload_blocks_stored=moved.stored,
                        kv_offload_blocks_loaded=moved.loaded, kv_offload_blocks_evicted=moved.evicted,
                        kv_offload_bytes_stored=moved.stored * block_bytes,
                        kv_offload_bytes_loaded=moved.loaded * block_bytes)
            if sched.offload.disk_manager is not None:
                disk = sched.offload.disk_manager.stats
                tier.update(kv_offload_disk_blocks_stored=disk.stored, kv_offload_disk_blocks_loaded=disk.loaded)
        return EngineMetrics(
            num_requests_running=len(sched.running), num_requests_waiting=len(sched.waiting),
            num_kvcache_blocks=bm.num_blocks, kv_cache_usage_perc=bm.kv_cache_usage,
            prefix_cache_queries=cache.queries, prefix_cache_hits=cache.hits,
            prefix_cache_hit_rate=cache.hit_rate, num_preemptions=stats.num_preemptions,
            prompt_tokens=stats.prompt_tokens, generation_tokens=stats.generation_tokens,
            prefill_kv_computed_tokens=stats.prefill_kv_computed_tokens,
            num_prefill_steps=stats.num_prefill_steps, num_decode_steps=stats.num_decode_steps,
            num_mixed_steps=stats.num_mixed_steps, num_swapped_out=stats.num_swapped_out,
            num_swapped_in=stats.num_swapped_in, num_swap_fallbacks=stats.num_swap_fallbacks,
            cpu_kv_cache_usage_perc=sched.cpu_pool.usage if sched.cpu_pool is not None else 0.0,
            spec_decode_num_drafts=spec.num_drafts, spec_decode_num_draft_tokens=spec.num_draft_tokens,
            spec_decode_num_accepted_tokens=spec.num_accepted_tokens,
            spec_decode_num_accepted_tokens_per_pos=tuple(spec.num_accepted_tokens_per_pos), **tier)


def beam_root_params(params: BeamSearchParams) -> SamplingParams:
    """The sampling parameters of a beam search's root sequence: greedy, one token a step, to
    ``max_tokens`` (the search, not ``ignore_eos``, decides when it ends)."""
    return SamplingParams(temperature=0.0, max_tokens=params.max_tokens, ignore_eos=True)


def make_proposer(spec):
    """The proposer a ``SpeculativeConfig`` names (chapter 14)."""
    from course_pkg.engine.spec_decode import EarlyExitProposer, NgramProposer

    if spec.method == "ngram":
        return NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
    return EarlyExitProposer(spec.num_draft_layers)


def _as_ids(value) -> list[int]:
    if value is None:
        return []
    return [value] if isinstance(value, int) else list(value)


def stop_token_ids(model_path, config, tokenizer) -> list[int]:
    """End-of-sequence ids: the config's, the checkpoint's ``generation_config.json``'s (chat
    models such as Qwen3 list several there), else the tokenizer's."""
    from course_pkg.models import default_model_path

    ids = _as_ids(config.eos_token_id)
    gen_file = Path(default_model_path() if model_path is None else model_path) / "generation_config.json"
    if gen_file.is_file():
        ids += _as_ids(json.loads(gen_file.read_text()).get("eos_token_id"))
    if not ids and tokenizer is not None:
        ids = _as_ids(tokenizer.eos_token_id)
    return sorted(set(ids))


@dataclass
class _Request:
    seq: Sequence
    prompt: str | None
    metrics: RequestMetrics
    num_cached_tokens: int = field(default=0)
    beam_search: BeamSearch | None = None   # (chapter 08) set for a beam search's request


def open_disk_tier(path, model, config, block_size: int, dtype):
    """The disk tier's directory for this model (chapter 15), refused if written for another model,
    block size, dtype or layout (``offload.disk.DiskTier``)."""
    from course_pkg.models import default_model_path
    from course_pkg.offload.disk import DiskTier, model_identity

    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    layout = {"model": model_identity(default_model_path() if model is None else model), "block_size": block_size,
              "dtype": str(dtype).removeprefix("torch."), "num_layers": config.num_hidden_layers,
              "num_kv_heads": config.num_key_value_heads, "head_dim": head_dim}
    return DiskTier(path, layout, kv_block_bytes(config, block_size, dtype))


def make_block_manager(num_blocks: int, cfg: EngineConfig, kv_cache_config: KVCacheConfig) -> BlockManager:
    """The BlockManager of chapters 02-04, or for a hybrid model its groups' (chapter 16)."""
    if kv_cache_config.is_hybrid:
        return HybridBlockManager(num_blocks, cfg.block_size, kv_cache_config.sliding_windows,
                                  cfg.enable_prefix_caching, free_queue=cfg.free_queue)
    return BlockManager(num_blocks, cfg.block_size, cfg.enable_prefix_caching, free_queue=cfg.free_queue)


def check_hybrid_options(cfg: EngineConfig, spec) -> None:
    """What the hybrid manager does not do yet, refused by name before anything is built."""
    refused = []
    if cfg.tensor_parallel_size > 1:
        refused.append("tensor_parallel_size > 1")
    if cfg.kv_transfer_config is not None:
        refused.append("kv_transfer_config")
    if spec is not None and spec.method != "ngram":
        refused.append(f"speculative method {spec.method!r} (its draft layers would need every group's tables)")
    if refused:
        raise ValueError("this model has sliding-window layers, and its KV cache groups do not support "
                         + ", ".join(refused) + " yet; pass disable_hybrid_kv_cache_manager=True to keep every "
                         "layer's cache in one group")
