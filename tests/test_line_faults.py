"""A fault at any *line* of a step (issue 28): no half-open step, no lost output, the same tokens.

``test_step_transaction.py`` raises at the k-th *call* of the functions a step runs. A
KeyboardInterrupt in Jupyter ("interrupt the kernel") lands on any line instead -- also on the
lines that open and commit the transaction and on the engine's record of a finished step. This
sweep does that: ``sys.settrace`` counts the line events of a whole run inside the package
(and ``contextlib``, whose ``__exit__`` closes every transaction), and each faulted run raises
at the k-th of them, for a sample of k spread over the run, either

* an exception raised at that line (``RuntimeError``, ``MemoryError``), or
* a real SIGINT (``signal.raise_signal``), which the engine holds while a step opens, commits
  or hands out its outputs (``undo.deferred_interrupts``, whose own lines are the only ones
  not faulted), and which Python raises as a KeyboardInterrupt at that line anywhere else.

After every fault: no step is open (journal and model runner), the pool's invariants hold,
every request is somewhere (unfinished, or its output waiting, or returned) and none twice;
then the run goes on, and its tokens -- greedy, seeded, and every one of ``n`` seeded
completions -- equal those of the run that saw no fault.
"""
from __future__ import annotations

import contextlib
import signal
import sys
from pathlib import Path

import pytest

import course_pkg
from course_pkg import LLM
from tests.helpers import check_invariants, check_tier
from tests.test_step_transaction import CONFIGS, CPU, MODEL, PARAMS, PROMPTS, make_llm

TRACED = (str(Path(course_pkg.__file__).parent), contextlib.__file__)
# Not faulted: the deferral's own lines. The one fault that can come from outside there is the
# SIGINT it holds; an exception injected into its clean-up could only leave the process's
# Ctrl-C handler half restored, which no real fault can do.
UNTRACED = {"deferred_interrupts", "_pass_on"}
SWEEP = {"prefill_first-recompute": 12, "mixed-swap-same_step": 12,   # faulted runs per fault kind
         "mixed-recompute-same_step-tier_arc": 8, "hybrid-mixed-recompute-same_step": 8}
KINDS = ("RuntimeError", "MemoryError", "SIGINT")


@pytest.fixture(scope="module", autouse=True)
def one_thread(one_torch_thread):
    """One torch thread for this module (see conftest)."""


class LineFault:
    """A trace function that counts line events in ``TRACED`` files and, at the ``at``-th, faults."""

    def __init__(self, at: int | None = None, kind: str = "RuntimeError"):
        self.at, self.kind, self.lines, self.fired = at, kind, 0, False

    def __call__(self, frame, event, arg):
        code = frame.f_code
        if not code.co_filename.startswith(TRACED) or code.co_name in UNTRACED or code.co_qualname.startswith("_Held"):
            return None
        return self.line

    def line(self, frame, event, arg):
        if event != "line" or self.fired:
            return self.line
        self.lines += 1
        if self.lines == self.at:
            self.fired = True
            self.where = f"{Path(frame.f_code.co_filename).name}:{frame.f_lineno} ({frame.f_code.co_name})"
            if self.kind == "SIGINT":
                signal.raise_signal(signal.SIGINT)   # handled at the next bytecode: held, or raised here
            else:
                raise {"RuntimeError": RuntimeError, "MemoryError": MemoryError}[self.kind]("injected fault")
        return self.line


def serve(llm, tracer: LineFault | None = None):
    """Serve PROMPTS with PARAMS step by step (the tracer on while ``step()`` runs); after a
    fault, check the engine and go on. Returns the completions' tokens per request."""
    ids = [llm.add_request(p, sp) for p, sp in zip(PROMPTS, PARAMS)]
    returned = {}
    for _ in range(300):
        if not llm.has_unfinished_requests():
            break
        sys.settrace(tracer)
        try:
            finished = llm.step()
        except (RuntimeError, MemoryError, KeyboardInterrupt) as e:
            sys.settrace(None)
            if tracer is None or not tracer.fired or isinstance(e, RuntimeError) and "injected" not in str(e):
                raise
            check_after_fault(llm, ids, returned, tracer)
            continue
        finally:
            sys.settrace(None)
        for out in finished:
            assert out.request_id not in returned, f"request {out.request_id} returned twice"
            returned[out.request_id] = [c.token_ids for c in out.outputs]
    assert not llm.has_unfinished_requests(), "the engine did not finish"
    return [returned[i] for i in ids]


def check_after_fault(llm, ids, returned, tracer) -> None:
    where = f"fault ({tracer.kind}) at line event {tracer.at}, {tracer.where}"
    sched = llm.scheduler
    assert not sched.journal.recording, f"a step is still open after a {where}"
    assert not llm.model_runner.step_is_open, f"the runner's part of a step is still open after a {where}"
    live = list({id(q): q for s in list(sched.waiting) + list(sched.running)
                 for q in [s] + s.children if q.block_table}.values())
    try:
        check_invariants(llm.block_manager, live, between_steps=True)
    except AssertionError as e:
        raise AssertionError(f"{e} after a {where}") from None
    if sched.offload is not None:
        try:
            check_tier(sched.offload)
        except AssertionError as e:
            raise AssertionError(f"{e} after a {where}") from None
    waiting = set(llm._requests) | set(llm._outbox)
    assert not waiting & set(returned), f"a returned request is still held after a {where}"
    assert set(ids) == waiting | set(returned), f"lost request(s) {set(ids) - waiting - set(returned)} after a {where}"
    assert set(llm._ready) <= set(llm._requests), f"a ready id names no request after a {where}"


@pytest.fixture(scope="module")
def counted():
    """Per configuration: the fault-free tokens and the number of traced line events of a run."""
    result = {}
    for name in SWEEP:
        tracer = LineFault()
        tokens = serve(make_llm(CONFIGS[name]), tracer)
        result[name] = tokens, tracer.lines
    return result


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("config", list(SWEEP))
def test_a_fault_at_any_line_of_a_step_leaves_no_half_open_step_and_loses_no_output(counted, config, kind):
    expected, lines = counted[config]
    runs = SWEEP[config]
    # Spread over the run, with an offset per kind, so the kinds meet different lines.
    offset = KINDS.index(kind) * lines // (3 * runs)
    for i in range(runs):
        at = 1 + offset + i * lines // runs
        tracer = LineFault(at, kind)
        got = serve(make_llm(CONFIGS[config]), tracer)
        assert tracer.fired, f"line event {at} of {lines} was never reached"
        assert got == expected, f"other tokens than a fault-free run after a fault at {tracer.where}"


def test_a_sigint_at_each_of_the_last_lines_of_a_run_loses_no_output(counted):
    """The last step hands out the last outputs and then leaves: the lock's release and the
    context manager's exit run after the outbox is emptied for the return (a SIGINT there once
    dropped the outputs: tools/line_fault_sweep.py found it). A SIGINT at each of the last 16
    line events of a run."""
    expected, _ = counted["prefill_first-recompute"]
    clean = LineFault()                       # counted again: a first run traces one-time set-up too
    assert serve(make_llm(CONFIGS["prefill_first-recompute"]), clean) == expected
    for at in range(clean.lines - 15, clean.lines + 1):
        tracer = LineFault(at, "SIGINT")
        got = serve(make_llm(CONFIGS["prefill_first-recompute"]), tracer)
        assert tracer.fired and got == expected, f"other tokens after a SIGINT at {tracer.where}"


# The plumbing: the lines that open, commit, undo and finish a step and hand out its outputs.
PLUMBING = {"begin", "commit", "rollback", "_end", "_unsave", "_transaction", "transaction", "commit_step",
            "unschedule", "_forget_overwritten", "add_all", "abort", "_step", "_run_step",
            "_finish_interrupted_step", "_mark_ready", "_hand_out_ready", "_take_outbox", "begin_step",
            "end_step", "abort_step", "written_slots", "_exclusive", "__enter__", "__exit__"}


class AtLine(LineFault):
    """Faults at the ``at``-th time ``line`` (a ``(file, line number)`` pair) runs; without
    ``line``, counts how often each line of the plumbing runs (``self.seen``)."""

    def __init__(self, line=None, at=None, kind="RuntimeError"):
        super().__init__(at, kind)
        self.target, self.seen = line, {}

    def __call__(self, frame, event, arg):
        code = frame.f_code
        if code.co_name in PLUMBING and code.co_filename.startswith(TRACED):
            return self.line
        return None

    def line(self, frame, event, arg):
        if event != "line" or self.fired:
            return self.line
        key = (frame.f_code.co_filename, frame.f_lineno)
        self.seen[key] = self.seen.get(key, 0) + 1
        if key == self.target and self.seen[key] == self.at:
            self.fired = True
            self.where = f"{Path(key[0]).name}:{key[1]} ({frame.f_code.co_name})"
            if self.kind == "SIGINT":
                signal.raise_signal(signal.SIGINT)
            else:
                raise RuntimeError("injected fault")
        return self.line


@pytest.mark.slow
@pytest.mark.parametrize("kind", ("RuntimeError", "SIGINT"))
def test_a_fault_at_every_line_of_the_plumbing_leaves_no_half_open_step(kind):
    """Every line of the step's plumbing, once each (the middle one of its runs), with an
    exception there (or a SIGINT at every third line): the sampled sweep above can miss a
    one-line window."""
    config = CONFIGS["mixed-swap-same_step"]
    counter = AtLine()
    expected = serve(LLM(MODEL, **CPU, **config), counter)
    assert len(counter.seen) > 100
    lines = sorted(counter.seen.items())
    for line, count in lines if kind == "RuntimeError" else lines[::3]:   # (a SIGINT: every third line)
        tracer = AtLine(line, max(1, count // 2), kind)
        got = serve(LLM(MODEL, **CPU, **config), tracer)
        assert tracer.fired, f"{line} never ran {max(1, count // 2)} times (it ran {tracer.seen.get(line)})"
        assert got == expected, f"other tokens than a fault-free run after a fault at {tracer.where}"


def test_a_sigint_at_every_line_of_the_commit_and_the_hand_out_loses_nothing():
    """A real SIGINT raised at every line of the commit, the ready marks and the hand-out, on
    every other step: each such step raises KeyboardInterrupt with its work standing and its
    outputs safe, and the run ends with the fault-free tokens."""
    llm = make_llm(CONFIGS["prefill_first-recompute"])
    expected = serve(make_llm(CONFIGS["prefill_first-recompute"]))
    ids = [llm.add_request(p, sp) for p, sp in zip(PROMPTS, PARAMS)]
    returned, interrupted, step = {}, 0, 0
    names = {"commit", "_end", "commit_step", "_hand_out_ready", "_take_outbox", "_mark_ready"}

    def trace(frame, event, arg):
        if frame.f_code.co_name in names and frame.f_code.co_filename.startswith(TRACED):
            return local
        return None

    def local(frame, event, arg):
        if event == "line":
            signal.raise_signal(signal.SIGINT)
        return local

    while llm.has_unfinished_requests():
        step += 1
        sys.settrace(trace if step % 2 else None)   # every other step (an interrupted one returns nothing)
        try:
            finished = llm.step()
        except KeyboardInterrupt:
            interrupted += 1
            assert not llm.scheduler.journal.recording and not llm.model_runner.step_is_open
            continue
        finally:
            sys.settrace(None)
        for out in finished:
            returned[out.request_id] = [c.token_ids for c in out.outputs]
    assert interrupted > 0
    assert [returned[i] for i in ids] == expected


def test_a_fault_at_any_line_of_a_beam_search_leaves_every_block_free():
    """Beam search (chapter 08) at every 60th line of its run, an exception there: afterwards no
    block is held and no request is left (the search is a request of the step loop, aborted when
    anything raises), and the next search finds the same hypotheses."""
    from course_pkg.sampling_params import BeamSearchParams

    llm = LLM(MODEL, **CPU, block_size=4, num_kvcache_blocks=40)
    params = BeamSearchParams(beam_width=3, max_tokens=5)
    want = [h.tokens for h in llm.beam_search([PROMPTS[2]], params)[0].sequences]
    counter = LineFault()   # (counted on a second search: the first one also makes classes)
    sys.settrace(counter)
    try:
        llm.beam_search([PROMPTS[2]], params)
    finally:
        sys.settrace(None)
    for at in range(1, counter.lines, 60):
        tracer = LineFault(at)
        sys.settrace(tracer)
        try:
            llm.beam_search([PROMPTS[2]], params)
        except RuntimeError as e:
            assert "injected" in str(e)
        finally:
            sys.settrace(None)
        assert tracer.fired
        check_invariants(llm.block_manager, [])
        assert not llm.has_unfinished_requests() and not llm.scheduler.beam_searches, tracer.where
        assert not llm.scheduler.journal.recording and not llm.model_runner.step_is_open, tracer.where
    assert [h.tokens for h in llm.beam_search([PROMPTS[2]], params)[0].sequences] == want
