"""A step is a transaction (issue 17): a fault anywhere in it leaves the engine as it was.

The property, for every mutation primitive and every entry point of a step -- scheduling,
admission, preemption, the block copies and swaps, the forward pass, the sampler, the
bookkeeping, forks -- under both admission policies, both preemption modes, same-step hits,
``n > 1`` seeded sampling and beam search: an exception or a KeyboardInterrupt raised at the
k-th call of that function makes ``step()`` re-raise, and afterwards

* the engine's whole state (queues, statuses, tokens, block tables, ref counts, free queue,
  prefix index, CPU pool, counters, the random generators' states) equals the state before the
  step -- except for what no undo log can give back once the step wrote K/V: the cache entries
  of the blocks the step overwrote, and a victim whose freed blocks were overwritten (it is
  preempted by recompute); those cases are checked against the invariants instead;
* the run, continued, gives exactly the tokens of a run that never saw a fault, seeded
  samples and every one of ``n`` completions included.

The reference tokens come from an engine that never saw a fault; that engine is checked
against Hugging Face and against seed + j single requests elsewhere (test_engine.py,
test_forks.py, test_scheduling.py).
"""
from __future__ import annotations

import gc
import json
import random
import shutil
import tempfile
from dataclasses import astuple
from pathlib import Path

import pytest
import torch

from course_pkg import LLM, SamplingParams, undo
from course_pkg.models import default_model_path, hybrid_model_path
from course_pkg.sampling_params import BeamSearchParams
from course_pkg.sequence import SequenceStatus
from tests.helpers import Fault, check_invariants, check_tier, state, tier_state

MODEL = default_model_path()
CPU = dict(device="cpu", dtype=torch.float32, attention_backend="torch")

CONFIGS = {
    "prefill_first-recompute": dict(block_size=4, num_kvcache_blocks=14, max_num_batched_tokens=20),
    "mixed-swap-same_step": dict(block_size=4, num_kvcache_blocks=14, max_num_batched_tokens=12,
                                 scheduling="mixed", preemption_mode="swap", num_cpu_blocks=12,
                                 same_step_prefix_hits=True),
    "prefill_first-swap": dict(block_size=3, num_kvcache_blocks=18, max_num_batched_tokens=16,
                               preemption_mode="swap", num_cpu_blocks=6),
    "mixed-recompute-same_step": dict(block_size=4, num_kvcache_blocks=14, max_num_batched_tokens=10,
                                      scheduling="mixed", same_step_prefix_hits=True),
    # a tier behind the pool (chapter 15), small enough to evict, with loads on readmission
    "prefill_first-recompute-tier_lru": dict(block_size=4, num_kvcache_blocks=14, max_num_batched_tokens=20,
                                             kv_transfer_config={"kv_connector_extra_config": {"num_cpu_blocks": 6}}),
    # ... and a disk tier behind a CPU tier of 4 (its own directory per test process)
    "prefill_first-recompute-tier_disk": dict(
        block_size=4, num_kvcache_blocks=14, max_num_batched_tokens=20,
        kv_transfer_config={"kv_connector_extra_config": {
            "num_cpu_blocks": 4, "disk_path": tempfile.mkdtemp(prefix="course-disk-tier-"), "num_disk_blocks": 12}}),
    "mixed-recompute-same_step-tier_arc": dict(
        block_size=4, num_kvcache_blocks=14, max_num_batched_tokens=10, scheduling="mixed", same_step_prefix_hits=True,
        kv_transfer_config={"kv_connector_extra_config": {"num_cpu_blocks": 8, "eviction_policy": "arc"}}),
}



def _hybrid_model_with_a_small_window(window: int = 6) -> Path:
    """The hybrid tiny model with a window of ``window`` instead of 32, so that these short
    requests' local groups give blocks back (its tokens are compared with its own fault-free
    run, not with a reference model)."""
    folder = Path(tempfile.mkdtemp(prefix="course-hybrid-window-"))
    for f in hybrid_model_path().iterdir():
        shutil.copy(f, folder)
    config = json.loads((folder / "config.json").read_text())
    config["sliding_window"] = window
    (folder / "config.json").write_text(json.dumps(config))
    return folder


# a hybrid model (chapter 16): one full-attention group and one local group of window 6
CONFIGS["hybrid-mixed-recompute-same_step"] = dict(
    model=_hybrid_model_with_a_small_window(), block_size=4, num_kvcache_blocks=26, max_num_batched_tokens=10,
    scheduling="mixed", same_step_prefix_hits=True)
CONFIGS["hybrid-prefill_first-swap"] = dict(
    model=CONFIGS["hybrid-mixed-recompute-same_step"]["model"], block_size=4, num_kvcache_blocks=26,
    max_num_batched_tokens=16, preemption_mode="swap", num_cpu_blocks=16)

_rng = random.Random(17)
_SHARED = [_rng.randrange(3, 1000) for _ in range(9)]
PROMPTS = [_SHARED + [_rng.randrange(3, 1000) for _ in range(n)] for n in (2, 5, 8, 3)]
PARAMS = [SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
          SamplingParams(temperature=2.0, max_tokens=6, ignore_eos=True, seed=11),            # seeded
          SamplingParams(temperature=2.0, max_tokens=5, ignore_eos=True, seed=5, n=3),        # forks
          SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True)]

# (what holds the function, its name): every mutation primitive and entry point of a step.
POINTS = [("scheduler", n) for n in ("schedule", "_schedule_prompts", "_schedule_decodes", "preempt",
                                     "_admit", "_schedule_tokens", "_fork", "update_from_output", "_record")] + \
         [("block_manager", n) for n in ("can_allocate", "allocate", "_allocate_block", "_revive_block",
                                         "_deallocate_block", "deallocate", "can_append", "may_append", "fork",
                                         "hash_blocks", "allocate_for_swap_in", "_record_admission",
                                         "_match_prefix", "_maybe_evict_cached_block")] + \
         [("cpu_pool", n) for n in ("swap_out", "release")] + \
         [("model_runner", n) for n in ("execute_model", "swap_out", "copy_blocks", "swap_in", "_forward",
                                        "store_to_tier", "load_from_tier")] + \
         [("offload", n) for n in ("load", "begin_step", "end_step", "_hashes")] + \
         [("tier", n) for n in ("lookup", "prepare_load", "complete_load", "touch", "prepare_store", "complete_store",
                                "_add", "_drop")] + \
         [("sampler", n) for n in ("sample", "_draw")]
AT = [(1, RuntimeError), (2, KeyboardInterrupt), (4, RuntimeError), (7, KeyboardInterrupt)]


@pytest.fixture(scope="module", autouse=True)
def one_thread(one_torch_thread):
    """One torch thread for this module (see conftest)."""


def holder(llm, where):
    offload = llm.scheduler.offload
    return {"scheduler": llm.scheduler, "block_manager": llm.block_manager, "cpu_pool": llm.scheduler.cpu_pool,
            "model_runner": llm.model_runner, "sampler": llm.model_runner.sampler, "offload": offload,
            "tier": offload.manager if offload is not None else None}[where]


def snapshot(llm) -> dict:
    """Everything a step may change, by value."""
    sched, bm, sampler = llm.scheduler, llm.block_manager, llm.model_runner.sampler
    live = list(sched.waiting) + list(sched.running)
    seqs = {}
    for s in live:
        for q in [s] + s.children:
            seqs[q.seq_id] = (tuple(q.token_ids), q.num_tokens, q.num_cached_tokens, q.num_scheduled_tokens,
                              q.status, tuple(q.block_table), tuple(q.block_hashes), q.num_preemptions,
                              round(q.cumulative_logprob, 9), tuple(c.seq_id for c in q.children),
                              tuple(map(tuple, q.group_block_tables)))
    stats = bm.prefix_cache_stats
    pool = sched.cpu_pool
    generators = {("shared",): bytes(sampler.generator.get_state().numpy())}
    for seq in {s.parent or s for s in live}:   # (finished requests' generators wait for the GC)
        for index, gen in sampler._seq_generators.get(seq, {}).items():
            generators[(seq.seq_id, index)] = bytes(gen.get_state().numpy())
    return {
        "queues": ([(s.seq_id, s.status) for s in sched.waiting], [(s.seq_id, s.status) for s in sched.running]),
        "seqs": seqs,
        "manager": state(bm),
        "cache stats": (stats.requests, stats.queries, stats.hits, stats.preempted_requests,
                        stats.preempted_queries, stats.preempted_hits, tuple(stats.recent)),
        "prefix ids": (dict(bm._prefix_ids), bm._next_prefix_id),
        "holders": sorted(bm._holders),
        "scheduler": (astuple(sched.stats), sched.num_steps, sched.journal.recording),
        "cpu pool": None if pool is None else (sorted(pool.swapped.items()), list(pool.free_block_ids)),
        "generators": generators,
        "engine": (llm.num_steps, sorted(llm._requests), list(llm._ready)),
        "tier": None if sched.offload is None else tier_state(sched.offload),
        "groups": [dict(g.chains) for g in getattr(bm, "groups", ())],   # a hybrid model's other groups
    }


def without_dropped_entries(snap: dict, blocks: set[int]) -> dict:
    """``snap`` with the registration of ``blocks`` (and the exact prefix ids) left out."""
    snap = dict(snap)
    m = snap["manager"]
    snap["manager"] = m._replace(
        blocks=tuple((b, r, -1, ()) if b in blocks else (b, r, h, t) for b, r, h, t in m.blocks),
        hash_index=tuple((h, b) for h, b in m.hash_index if b not in blocks))
    snap["prefix ids"] = None
    snap["tier"] = None   # (a store whose source block was overwritten failed: see check_tier)
    return snap


def run(llm, fault=None, checks=None):
    """Serve PROMPTS step by step; at an injected fault check the state and go on."""
    ids = [llm.add_request(p, sp) for p, sp in zip(PROMPTS, PARAMS)]
    outputs = {}
    kv_written = []
    real_execute = llm.model_runner.execute_model

    def execute(*args, **kwargs):       # the step has started writing K/V
        kv_written.append(True)
        return real_execute(*args, **kwargs)

    runner = llm.model_runner
    patched = vars(runner).get("execute_model")
    runner.execute_model = execute
    try:
        for _ in range(200):
            if not llm.has_unfinished_requests():
                break
            before = snapshot(llm)
            kv_written.clear()
            try:
                finished = llm.step()
            except (RuntimeError, KeyboardInterrupt) as e:
                if "injected fault" not in str(e):
                    raise
                checks.append(compare(llm, before, snapshot(llm), bool(kv_written)))
                continue
            for out in finished:
                outputs[out.request_id] = [c.token_ids for c in out.outputs]
    finally:
        if patched is None:
            del runner.execute_model
        else:
            runner.execute_model = patched
    assert not llm.has_unfinished_requests(), "the engine did not finish"
    return [outputs[i] for i in ids]


def compare(llm, before: dict, after: dict, kv_written: bool) -> str:
    """The state after an undone step against the state before it; returns which rule held."""
    if llm.scheduler.offload is not None:
        check_tier(llm.scheduler.offload)
    if after == before:
        return "exact"
    assert kv_written, "a step undone before it wrote any K/V must leave the engine exactly as it was"
    # Once K/V were written: cache entries of the blocks it overwrote are dropped (free blocks
    # registered before, unregistered now), and a victim holding such a block is recomputed.
    old = {b: (r, h) for b, r, h, _ in before["manager"].blocks}
    new = {b: (r, h) for b, r, h, _ in after["manager"].blocks}
    dropped = {b for b in old if old[b][1] != -1 and new[b][1] == -1}
    recomputed = [sid for sid, s in after["seqs"].items()
                  if s[4] == SequenceStatus.PREEMPTED and sid in before["seqs"]
                  and before["seqs"][sid][4] != SequenceStatus.PREEMPTED]
    live = [s for s in list(llm.scheduler.waiting) + list(llm.scheduler.running) if s.block_table]
    assert all(len(s.block_table) >= s.num_blocks - 1 for s in live)
    if recomputed:
        assert all(not after["seqs"][sid][5] for sid in recomputed), "a recomputed victim holds no blocks"
        return "victim recomputed"
    assert all(new[b][0] == 0 for b in dropped), "only free blocks lose their cache entry"
    assert without_dropped_entries(after, dropped) == without_dropped_entries(before, dropped)
    return "exact but overwritten cache entries"


@pytest.fixture(scope="module")
def references():
    return {name: run(make_llm(cfg)) for name, cfg in CONFIGS.items()}


def make_llm(cfg: dict):
    cfg = dict(cfg)
    return LLM(cfg.pop("model", MODEL), **CPU, **cfg)


@pytest.mark.parametrize("config", list(CONFIGS))
def test_a_fault_at_any_call_of_a_step_undoes_the_step_and_changes_no_token(references, config):
    llm = make_llm(CONFIGS[config])
    expected = references[config]
    ref_metrics = None
    outcomes: dict[str, int] = {}
    fired_points = set()
    for where, name in POINTS:
        obj = holder(llm, where)
        if obj is None or not hasattr(obj, name):
            continue            # e.g. no CPU pool with recompute
        for at, exc in AT:
            fault = Fault(getattr(obj, name), exc, at)
            setattr(obj, name, fault)
            checks: list[str] = []
            try:
                got = run(llm, fault, checks)
            finally:
                delattr(obj, name)
            assert got == expected, f"{where}.{name} failing at call {at}: other tokens than a fault-free run"
            assert fault.fired == bool(checks)
            if fault.fired:
                fired_points.add((where, name))
            for c in checks:
                outcomes[c] = outcomes.get(c, 0) + 1
            check_invariants(llm.block_manager, [])
            assert not llm.scheduler.journal.recording and llm.scheduler.is_finished()
            if llm.scheduler.cpu_pool is not None:
                assert llm.scheduler.cpu_pool.num_free_blocks == llm.scheduler.cpu_pool.num_blocks
            if llm.scheduler.offload is not None:
                check_tier(llm.scheduler.offload)
        ref_metrics = llm.get_metrics()
    # Every entry point this configuration uses was hit by a fault, and most undos are exact.
    must_fire = {("scheduler", "schedule"), ("scheduler", "update_from_output"), ("scheduler", "_fork"),
                 ("block_manager", "allocate"), ("block_manager", "_allocate_block"), ("block_manager", "fork"),
                 ("block_manager", "deallocate"), ("block_manager", "hash_blocks"), ("model_runner", "_forward"),
                 ("sampler", "_draw"), ("scheduler", "preempt")}
    if "swap" in config:
        must_fire |= {("cpu_pool", "swap_out"), ("model_runner", "swap_in"), ("block_manager", "allocate_for_swap_in")}
    if "tier" in config:
        must_fire |= {("model_runner", "store_to_tier"), ("model_runner", "load_from_tier"), ("offload", "load"),
                      ("offload", "end_step"), ("tier", "prepare_store"), ("tier", "_drop")}
    assert must_fire <= fired_points, f"never hit: {sorted(must_fire - fired_points)}"
    assert outcomes.get("exact", 0) > sum(outcomes.values()) / 2, outcomes
    assert ref_metrics.num_preemptions > 0


def test_seeded_tokens_do_not_change_after_an_undone_step():
    """The generators are part of the step: a seeded request whose step failed after sampling
    continues with the fault-free tokens, and each of n completions equals its seed + j request."""
    llm = LLM(MODEL, **CPU, **CONFIGS["prefill_first-recompute"])
    params = SamplingParams(temperature=2.0, max_tokens=6, ignore_eos=True, seed=11, n=3)
    [clean] = llm.generate([PROMPTS[1]], params, use_tqdm=False)
    singles = [llm.generate([PROMPTS[1]], SamplingParams(temperature=2.0, max_tokens=6, ignore_eos=True,
                                                         seed=11 + j), use_tqdm=False)[0].token_ids for j in range(3)]
    assert [c.token_ids for c in clean.outputs] == singles
    for name in ("update_from_output", "_record"):
        for at in (1, 2, 3):
            real = getattr(llm.scheduler, name)
            setattr(llm.scheduler, name, Fault(real, RuntimeError, at))
            rid = llm.add_request(PROMPTS[1], params)
            outs = []
            while llm.has_unfinished_requests():
                try:
                    outs += llm.step()
                except RuntimeError:
                    delattr(llm.scheduler, name)
            if name in vars(llm.scheduler):
                delattr(llm.scheduler, name)
            assert [c.token_ids for c in outs[0].outputs] == singles and outs[0].request_id == rid


def test_beam_search_survives_a_fault_in_any_of_its_block_calls():
    llm = LLM(MODEL, **CPU, block_size=4, num_kvcache_blocks=40)
    params = BeamSearchParams(beam_width=3, max_tokens=6)
    want = [h.tokens for h in llm.beam_search([PROMPTS[2]], params)[0].sequences]
    for where, name in [("model_runner", "copy_blocks"), ("model_runner", "run_with_logprobs"),
                        ("block_manager", "fork"), ("block_manager", "may_append"),
                        ("block_manager", "deallocate"), ("block_manager", "_allocate_block")]:
        for at in (1, 2, 5):
            obj = holder(llm, where)
            fault = Fault(getattr(obj, name), RuntimeError, at)
            setattr(obj, name, fault)
            try:
                with pytest.raises(RuntimeError, match="injected fault"):
                    llm.beam_search([PROMPTS[2]], params)
            except pytest.fail.Exception:
                assert not fault.fired   # fewer than `at` calls: nothing to check
            finally:
                delattr(obj, name)
            check_invariants(llm.block_manager, [])   # every beam released, no block held
            assert [h.tokens for h in llm.beam_search([PROMPTS[2]], params)[0].sequences] == want


def test_a_finished_request_is_handed_out_although_the_engine_was_interrupted_after_the_commit():
    """Between the commit of a step and the engine's record of it, an interrupt must not lose a
    finished request: the engine hands it out once the scheduler holds nothing."""
    llm = LLM(MODEL, **CPU, **CONFIGS["prefill_first-recompute"])
    rid = llm.add_request(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    real = llm._note_step
    llm._note_step = Fault(real, KeyboardInterrupt, 1)
    with pytest.raises(KeyboardInterrupt):
        llm.step()                       # the request finished in this step, then the interrupt
    del llm._note_step
    outs = llm.step()
    assert [o.request_id for o in outs] == [rid] and not llm.has_unfinished_requests()


def test_an_undone_fork_gives_its_sequence_ids_back():
    """(When the step is the only transaction open on its thread: steps that earlier tests left
    open count until they are garbage-collected. With two open, no id is given back -- so one
    is never handed out twice.)"""
    gc.collect()
    assert not list(undo._open_journals())
    llm = LLM(MODEL, **CPU, **CONFIGS["prefill_first-recompute"])
    params = SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True, seed=1, n=3)
    rid = llm.add_request(PROMPTS[0], params)
    real = llm.block_manager.fork
    llm.block_manager.fork = Fault(real, RuntimeError, 2)   # the second child's fork fails
    with pytest.raises(RuntimeError, match="injected fault"):
        llm.step()
    del llm.block_manager.fork
    llm.step()
    assert [c.seq_id for c in llm.get_sequence(rid).children] == [rid + 1, rid + 2]


class _AfterTheCopy:
    """Let a tier copy write its bytes, then raise -- once, at the first copy that moves a block."""

    def __init__(self, fn, exc):
        self.fn, self.exc, self.fired = fn, exc, False

    def __call__(self, pairs):
        self.fn(pairs)
        if pairs and not self.fired:
            self.fired = True
            raise self.exc("injected fault")


@pytest.mark.parametrize("copy", ["load_from_tier", "store_to_tier"])
@pytest.mark.parametrize("exc", [RuntimeError, KeyboardInterrupt])
def test_a_fault_after_a_tier_copy_wrote_its_bytes_is_undone(references, copy, exc):
    """The bytes are in the tier or in fresh device blocks when the step fails: no half-loaded
    block is registered, the tier keeps its invariants, and the tokens are those of a run that
    never failed."""
    config = "prefill_first-recompute-tier_lru"
    llm = LLM(MODEL, **CPU, **CONFIGS[config])
    runner = llm.model_runner
    fault = _AfterTheCopy(getattr(runner, copy), exc)
    setattr(runner, copy, fault)
    checks: list[str] = []
    try:
        got = run(llm, fault, checks)
    finally:
        delattr(runner, copy)
    assert fault.fired and len(checks) == 1
    assert got == references[config]
    check_invariants(llm.block_manager, [])
    check_tier(llm.scheduler.offload)
