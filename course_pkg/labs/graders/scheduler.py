"""Chapter 06 grader: the Scheduler's ``schedule`` and ``preempt``, lockstep with the package's.

A fake model answers each step with the request's next output token (None for a chunk of a
prompt), as ``course_pkg.workloads.WorkloadRun`` does, so no model runs and a grade takes a
fraction of a second. Requests arrive at given steps. After every ``schedule`` the two
schedulers must agree on the batch (which sequences, how many tokens each, prefill or decode),
on who was preempted, on the order of ``waiting`` and ``running``, and on every block table;
after every ``update_from_output`` on who finished. Hand-computed expectations from the chapter's
rules (prefill first, chunking within the token budget, the most recently admitted sequence
preempted first, back at the head of ``waiting``) are checked at the steps where they apply.

One scenario runs the real engine with the tiny model shipped with the package, the student's
scheduler swapped in, and compares the generated tokens with Hugging Face ``generate``
(greedy): whatever the scheduler decides, the tokens must be the model's.
"""
from __future__ import annotations

import functools
import random
from collections.abc import Callable

from course_pkg.labs.lab import Grading
from course_pkg.sampling_params import SamplingParams
from course_pkg.scheduler import Scheduler
from course_pkg.sequence import Sequence
from course_pkg.workloads import random_workload


class _Side:
    """One scheduler and its sequences, named "A", "B", ... in arrival order."""

    def __init__(self, scheduler: Scheduler, requests):
        self.scheduler = scheduler
        self.seqs = {name: Sequence(list(prompt), SamplingParams(max_tokens=len(outputs), ignore_eos=True),
                                    block_size=scheduler.block_size)
                     for name, (prompt, outputs, _) in requests.items()}
        self.outputs = {name: outputs for name, (_, outputs, _) in requests.items()}
        self.names = {id(seq): name for name, seq in self.seqs.items()}

    def name(self, seq) -> str:
        return self.names.get(id(seq), "<a sequence that was never added>")

    def view(self, out) -> dict[str, object]:
        s = self.scheduler
        return {
            "batch": [self.name(q) for q in out.seqs],
            "scheduled tokens": list(out.num_scheduled_tokens),
            "preempted": [self.name(q) for q in out.preempted],
            "waiting": [self.name(q) for q in s.waiting],
            "running": [self.name(q) for q in s.running],
            "block tables": {n: tuple(q.block_table) for n, q in self.seqs.items()},
            "statuses": {n: q.status.name for n, q in self.seqs.items()},
            "preemptions counted (stats.num_preemptions)": s.stats.num_preemptions,
        }

    def tokens(self, out) -> list[list[int]]:
        return [[self.outputs[self.name(q)][q.num_completion_tokens]] * n for q, n in zip(out.seqs, out.num_samples)]


def _drive(g: Grading, impl, requests: dict[str, tuple], *, num_blocks: int, block_size: int,
           max_num_seqs: int = 8, max_num_batched_tokens: int = 64, scheduling: str = "prefill_first",
           same_step_prefix_hits: bool = False, expect: Callable[[int, dict], None] | None = None,
           max_steps: int = 400) -> None:
    """Serve ``requests`` (name -> (prompt, outputs, arrival step)) on both schedulers in lockstep."""
    kwargs = dict(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens)
    if scheduling != "prefill_first":
        kwargs["scheduling"] = scheduling
    if same_step_prefix_hits:
        kwargs["same_step_prefix_hits"] = True
    ref = _Side(Scheduler(num_blocks, block_size, **kwargs), requests)
    mine = _Side(impl(num_blocks, block_size, **kwargs), requests)
    last_arrival = max(arrival for _, _, arrival in requests.values())
    for step in range(max_steps):
        for name, (_, _, arrival) in requests.items():
            if arrival == step:
                ref.scheduler.add(ref.seqs[name])
                mine.scheduler.add(mine.seqs[name])
        if step > last_arrival and ref.scheduler.is_finished():
            g.check(mine.scheduler.is_finished(), f"after step {step - 1} every request is done, "
                                                  f"but your scheduler still holds some")
            return
        ref_out, my_out = ref.scheduler.schedule(), mine.scheduler.schedule()
        expected, got = ref.view(ref_out), mine.view(my_out)
        expected["prefill step"], got["prefill step"] = ref_out.is_prefill, my_out.is_prefill
        if expect is not None:
            expect(step, got)
        for key, value in expected.items():
            if got[key] != value:
                g.fail(f"step {step}: {key}: expected {value!r}, got {got[key]!r}\n"
                       f"    queues (package): waiting {expected['waiting']}, running {expected['running']}\n"
                       f"    queues (yours):   waiting {got['waiting']}, running {got['running']}\n"
                       f"    the rule: {RULES[key]}")
        ref_done = ref.scheduler.update_from_output(ref_out, ref.tokens(ref_out))
        my_done = mine.scheduler.update_from_output(my_out, mine.tokens(my_out))
        g.equal([mine.name(q) for q in my_done], [ref.name(q) for q in ref_done],
                f"step {step}: finished (the rule: {RULES['finished']})")
    g.fail(f"not finished after {max_steps} steps")


#: What a lockstep difference in each field usually means: the rule of the chapter involved.
RULES = {
    "batch": "prefill_first schedules prompts whenever one can be admitted, else decodes; mixed decodes "
             "first; prompts first come first served, a partly prefilled one first, no overtaking",
    "scheduled tokens": "a decode computes 1 token; prompts share max_num_batched_tokens, and one that does "
                        "not fit computes a chunk and continues next step",
    "preempted": "when a decode needs a block, the most recently admitted running sequence gives way "
                 "(_choose_victim), as often as needed, the needy one last",
    "waiting": "a preempted sequence goes back to the head of waiting; a prompt leaves waiting when its "
               "last chunk is scheduled",
    "running": "a prompt joins running when its last chunk is scheduled; a preempted or finished one leaves",
    "block tables": "admission allocates blocks for the whole prompt (prefix hits first); a decode whose "
                    "token starts a block gets one (may_append); preemption frees them all",
    "statuses": "RUNNING once admitted (a chunked prompt too), PREEMPTED when preempted, FINISHED_* when done",
    "prefill step": "a step is a prefill step when it holds prompt tokens",
    "preemptions counted (stats.num_preemptions)": "preempt adds one to stats.num_preemptions per preemption "
                                                   "(the engine's metrics and chapter 03's sweeps read it)",
    "finished": "a sequence finishes at its max_tokens (or EOS), and releases its blocks",
}


def _at(g: Grading, step: int, wanted: dict[str, object], why: str):
    """An ``expect`` hook: at ``step``, the fields in ``wanted`` (hand-computed) must match."""
    def check(s: int, got: dict) -> None:
        if s == step:
            for key, value in wanted.items():
                g.equal(got[key], value, f"step {s}: {key} ({why})")
    return check


def _all(*hooks):
    def check(s: int, got: dict) -> None:
        for hook in hooks:
            hook(s, got)
    return check


ENGINE = dict(block_size=4, num_kvcache_blocks=12, max_num_seqs=4, max_num_batched_tokens=16)
MAX_TOKENS = 8


def _tiny_engine():
    """A fresh engine over the tiny model (CPU, float32); a few tenths of a second after the first."""
    import torch

    from course_pkg.engine.llm_engine import LLMEngine

    return LLMEngine(None, device="cpu", dtype=torch.float32, attention_backend="torch", **ENGINE)


@functools.cache
def _prompts() -> tuple[tuple[int, ...], ...]:
    """Four random prompts and one sharing the first's two leading blocks."""
    vocab = _tiny_engine().config.vocab_size
    rng = random.Random(0)
    prompts = [[rng.randrange(1, vocab) for _ in range(n)] for n in (9, 14, 5, 11)]
    prompts.append(prompts[0][:8] + [rng.randrange(1, vocab) for _ in range(3)])
    return tuple(map(tuple, prompts))


@functools.cache
def _hf_greedy_tokens() -> tuple[tuple[int, ...], ...]:
    """Hugging Face's greedy tokens for the prompts (EOS ignored, as the requests ignore it)."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from course_pkg.models import default_model_path

    prompts = _prompts()
    hf_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(str(default_model_path()), dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    tokens = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=MAX_TOKENS, pad_token_id=0)
        tokens.append(tuple(out[0, len(prompt):].tolist()))
    return tuple(tokens)


def _generate_with(impl, g: Grading, max_steps: int = 500) -> list[tuple[int, ...]]:
    from course_pkg.sampling_params import SamplingParams

    engine, prompts = _tiny_engine(), _prompts()
    engine.scheduler = impl(ENGINE["num_kvcache_blocks"], ENGINE["block_size"], max_num_seqs=ENGINE["max_num_seqs"],
                            max_num_batched_tokens=ENGINE["max_num_batched_tokens"],
                            max_model_len=engine.max_model_len, eos_token_id=sorted(engine.scheduler.eos_token_ids))
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    ids = [engine.add_request(list(p), params) for p in prompts]
    outputs = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            outputs[out.request_id] = tuple(out.token_ids)
    else:
        g.fail(f"the engine has not finished after {max_steps} steps")
    return [outputs.get(i, ()) for i in ids]


def grade_scheduler(impl, g: Grading) -> None:
    with g.scenario("continuous batching: a request joins while others decode"):
        requests = {"A": (range(1, 6), (101, 102, 103, 104), 0), "B": (range(11, 14), (111, 112, 113, 114), 0),
                    "C": (range(21, 27), (121, 122), 2)}
        _drive(g, impl, requests, num_blocks=32, block_size=4, expect=_all(
            _at(g, 0, {"batch": ["A", "B"], "scheduled tokens": [5, 3], "prefill step": True},
                "both prompts in one prefill step"),
            _at(g, 1, {"batch": ["A", "B"], "scheduled tokens": [1, 1], "prefill step": False}, "one token each"),
            _at(g, 2, {"batch": ["C"], "scheduled tokens": [6], "prefill step": True},
                "a new request is prefilled as soon as it arrives: prefill has priority"),
            _at(g, 3, {"batch": ["A", "B", "C"], "prefill step": False}, "C has joined the decode batch")))
    with g.scenario("chunked prefill within the token budget (8 tokens)"):
        requests = {"A": (range(1, 6), (101, 102), 0), "B": (range(11, 18), (111, 112), 0)}
        _drive(g, impl, requests, num_blocks=16, block_size=4, max_num_batched_tokens=8, expect=_all(
            _at(g, 0, {"batch": ["A", "B"], "scheduled tokens": [5, 3], "waiting": ["B"]},
                "B's 7 tokens do not fit in the 3 left: a chunk of 3, B stays first in line"),
            _at(g, 1, {"batch": ["B"], "scheduled tokens": [4], "prefill step": True}, "the rest of B's prompt"),
            _at(g, 2, {"batch": ["A", "B"], "prefill step": False}, "both decode")))
    with g.scenario("preemption: the most recently admitted gives way, first in line (block size 2, pool 6)"):
        outputs = tuple(range(200, 206))
        requests = {"A": ((1, 2, 3), outputs, 0), "B": ((4, 5, 6), outputs, 0), "C": ((7, 8, 9), outputs, 0),
                    "D": ((10, 11, 12), outputs, 2)}
        _drive(g, impl, requests, num_blocks=6, block_size=2, expect=_all(
            _at(g, 0, {"batch": ["A", "B", "C"]}, "three prompts take all 6 blocks"),
            _at(g, 2, {"batch": ["A", "B"], "preempted": ["C"], "waiting": ["C", "D"]},
                "A's 5th token needs a block: C, admitted last, is preempted and goes back before D")))
    with g.scenario("max_num_seqs caps the running batch (2)"):
        requests = {"A": ((1, 2, 3), (101, 102), 0), "B": ((4, 5, 6), (111, 112, 113), 0),
                    "C": ((7, 8, 9), (121,), 0)}
        _drive(g, impl, requests, num_blocks=16, block_size=4, max_num_seqs=2, expect=_all(
            _at(g, 0, {"batch": ["A", "B"], "waiting": ["C"]}, "only 2 sequences may run"),
            _at(g, 2, {"batch": ["C"], "prefill step": True}, "A finished at step 1, C takes its place")))
    with g.scenario("a prefix-cache hit: only the uncached tokens are scheduled (block size 4)"):
        requests = {"A": (range(1, 11), (101, 102, 103), 0), "B": (list(range(1, 9)) + [91, 92, 93], (111,), 2)}
        _drive(g, impl, requests, num_blocks=16, block_size=4, expect=_at(
            g, 2, {"batch": ["B"], "scheduled tokens": [3]}, "B's first 8 tokens are A's two cached blocks"))
    with g.scenario("a long run under memory pressure: 16 requests, 12 blocks of 4, budget 16"):
        workload = random_workload(16, prompt_len=(3, 18), output_len=(2, 10), seed=4)
        requests = {f"R{i}": (r.prompt_token_ids, r.output_token_ids, i // 2) for i, r in enumerate(workload)}
        _drive(g, impl, requests, num_blocks=12, block_size=4, max_num_seqs=4, max_num_batched_tokens=16)
    with g.scenario("a real generation (the tiny model, 12 blocks of 4): Hugging Face's greedy tokens"):
        expected = _hf_greedy_tokens()
        got = _generate_with(impl, g)
        for i, (mine, want) in enumerate(zip(got, expected)):
            g.equal(mine, want, f"tokens of request {i} (prompt of {len(_prompts()[i])} tokens)")


def grade_mixed(impl, g: Grading) -> None:
    """Chapter 09: the mixed policy, lockstep with the package's ``Scheduler(scheduling="mixed")``."""
    with g.scenario("a decode and a prompt chunk share a step (budget 4, block size 4)"):
        requests = {"A": (range(1, 6), (101, 102, 103, 104), 0), "B": (range(11, 17), (111, 112), 2)}
        _drive(g, impl, requests, num_blocks=16, block_size=4, max_num_batched_tokens=4, scheduling="mixed",
               expect=_all(
                   _at(g, 0, {"batch": ["A"], "scheduled tokens": [4]}, "A's 5-token prompt: a chunk of 4"),
                   _at(g, 1, {"batch": ["A"], "scheduled tokens": [1]}, "the rest of A's prompt"),
                   _at(g, 2, {"batch": ["A", "B"], "scheduled tokens": [1, 3], "prefill step": True},
                       "A decodes first; B's prompt gets the 3 tokens left"),
                   _at(g, 3, {"batch": ["A", "B"], "scheduled tokens": [1, 3]},
                       "A decodes again while B's prompt finishes: no stall"),
                   _at(g, 4, {"batch": ["A", "B"], "scheduled tokens": [1, 1], "prefill step": False},
                       "both decode")))
    with g.scenario("a prompt longer than the budget is chunked while others decode (budget 8)"):
        requests = {"A": ((1, 2, 3), (101, 102, 103, 104, 105, 106), 0),
                    "B": (tuple(range(10, 30)), (111, 112), 1)}
        _drive(g, impl, requests, num_blocks=32, block_size=4, max_num_batched_tokens=8, scheduling="mixed",
               expect=_at(g, 1, {"batch": ["A", "B"], "scheduled tokens": [1, 7]},
                          "A's decode token, then 7 of B's 20 prompt tokens"))
    with g.scenario("same-step prefix hits: a prompt hits the blocks another prompt fills in the same step "
                    "(block size 4, budget 64)"):
        shared = tuple(range(1, 13))                    # 12 tokens: three full blocks of 4
        requests = {"A": (shared + (20, 21), (101, 102), 0), "B": (shared + (30,), (111, 112), 0)}
        _drive(g, impl, requests, num_blocks=16, block_size=4, scheduling="mixed", same_step_prefix_hits=True,
               expect=_at(g, 0, {"batch": ["A", "B"], "scheduled tokens": [14, 1]},
                          "A's whole prompt; B hits A's three blocks registered in this step and computes "
                          "its 13th token only"))
    with g.scenario("preemption under the mixed policy (block size 2, pool 6)"):
        outputs = tuple(range(200, 206))
        requests = {"A": ((1, 2, 3), outputs, 0), "B": ((4, 5, 6), outputs, 0), "C": ((7, 8, 9), outputs, 0),
                    "D": ((10, 11, 12), outputs, 2)}
        _drive(g, impl, requests, num_blocks=6, block_size=2, scheduling="mixed")
    with g.scenario("a long run under memory pressure: 16 requests, 12 blocks of 4, budget 16"):
        workload = random_workload(16, prompt_len=(3, 18), output_len=(2, 10), seed=5)
        requests = {f"R{i}": (r.prompt_token_ids, r.output_token_ids, i // 2) for i, r in enumerate(workload)}
        _drive(g, impl, requests, num_blocks=12, block_size=4, max_num_seqs=4, max_num_batched_tokens=16,
               scheduling="mixed")
