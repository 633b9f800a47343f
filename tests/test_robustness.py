"""The engine survives faults, misuse and bad input (issue 9).

* Fault injection: an exception, or a KeyboardInterrupt, raised once at each point of a step
  in turn -- the model's forward pass, the sampler, ``update_from_output``, ``hash_blocks``,
  ``deallocate``, the tokenizer's ``decode``. ``generate`` must re-raise it, and afterwards
  the engine must be as good as new: every block free, the next ``generate`` giving the
  tokens of an engine that never saw a fault, and a request someone else queued finishing
  exactly once, with no more than its ``max_tokens``.
* Abort, ownership, concurrency, type-strict settings and sampled tokens.

The reference tokens come from an engine that never saw a fault; that engine is checked
against Hugging Face in test_engine.py.
"""
from __future__ import annotations

import copy
import random
import threading

import pytest
import torch

from course_pkg import LLM, BlockManager, NoFreeBlocksError, SamplingParams, Sequence
from course_pkg.engine.sampler import Sampler
from course_pkg.models import default_model_path
from course_pkg.sampling_params import BeamSearchParams
from course_pkg.scheduler import Scheduler
from course_pkg.sequence import SequenceStatus
from tests.helpers import Fault, check_invariants, state, results

MODEL = default_model_path()
CPU = dict(device="cpu", dtype=torch.float32, attention_backend="torch")
# A pool small enough that the batch below preempts, and a budget that chunks prompts.
ENGINE = dict(block_size=4, num_kvcache_blocks=24, max_num_batched_tokens=24, **CPU)


@pytest.fixture(scope="module", autouse=True)
def one_thread(one_torch_thread):
    """One torch thread for this module (see conftest)."""


def make_prompts(n=5, seed=7):
    rng = random.Random(seed)
    shared = [rng.randrange(3, 1000) for _ in range(9)]
    return [shared + [rng.randrange(3, 1000) for _ in range(k)] for k in range(2, 2 + 3 * n, 3)]


PROMPTS = make_prompts()
OTHER = [11, 12, 13, 14, 15, 16]            # a request queued by "someone else"
PARAMS = SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True)
OTHER_PARAMS = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)


@pytest.fixture(scope="module")
def reference():
    llm = LLM(MODEL, **ENGINE)
    outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    [other] = llm.generate([OTHER], OTHER_PARAMS, use_tqdm=False)
    assert llm.get_metrics().num_preemptions > 0, "the reference run should preempt"
    return [o.token_ids for o in outs], other.token_ids


def inject(llm, point, exc, at, monkeypatch):
    targets = {
        "forward": (llm.model, "forward"),
        "update_from_output": (llm.scheduler, "update_from_output"),
        "hash_blocks": (llm.block_manager, "hash_blocks"),
        "deallocate": (llm.block_manager, "deallocate"),
        "decode": (llm.tokenizer, "decode"),
    }
    if point == "sampler":
        fault = Fault(llm.model_runner.sampler.sample, exc, at)
        monkeypatch.setattr(llm.model_runner.sampler, "sample", fault)
        return fault
    obj, name = targets[point]
    fault = Fault(getattr(obj, name), exc, at)
    monkeypatch.setattr(obj, name, fault)
    return fault


POINTS = ["forward", "sampler", "update_from_output", "hash_blocks", "deallocate", "decode"]


@pytest.mark.parametrize("exc", [RuntimeError, KeyboardInterrupt], ids=["exception", "interrupt"])
@pytest.mark.parametrize("point", POINTS)
@pytest.mark.parametrize("at", [1, 4])
def test_a_fault_anywhere_in_a_step_leaves_the_engine_as_good_as_new(reference, point, exc, at, monkeypatch):
    expected, expected_other = reference
    llm = LLM(MODEL, **ENGINE)
    other_id = llm.add_request(OTHER, OTHER_PARAMS)
    fault = inject(llm, point, exc, at, monkeypatch)
    with pytest.raises(exc, match="injected fault"):
        llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert fault.fired
    monkeypatch.undo()
    # The faulty generate's requests are aborted; only the other request is left.
    live = list(llm.scheduler.waiting) + list(llm.scheduler.running)
    assert all(s.seq_id == other_id for s in live)
    check_invariants(llm.block_manager, [s for s in live if s.block_table])
    outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert [o.token_ids for o in outs] == expected
    assert all(o.finish_reason == "length" for o in outs)
    # The other request finished exactly once, whole, in one of the two generates.
    if other_id in llm.unclaimed_outputs:
        other = llm.unclaimed_outputs.pop(other_id)
        assert other.token_ids == expected_other and other.finish_reason == "length"
    assert not llm.unclaimed_outputs and llm.is_finished()
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks
    check_invariants(llm.block_manager, [])


def test_a_request_that_always_fails_does_not_wedge_the_engine(reference, monkeypatch):
    """A request whose every step raises (here: the sampler refuses it) makes generate raise;
    the next generate, without that request, gives the right tokens."""
    expected, _ = reference
    llm = LLM(MODEL, **ENGINE)
    real = Sampler.sample
    poison = [999, 998, 997]

    def sampler(self, logits, seqs, *args):
        if any(s.prompt_token_ids == poison for s in seqs):
            raise ValueError("this request cannot be sampled")
        return real(self, logits, seqs, *args)

    monkeypatch.setattr(Sampler, "sample", sampler)
    for _ in range(2):
        with pytest.raises(ValueError, match="cannot be sampled"):
            llm.generate(PROMPTS[:2] + [poison], PARAMS, use_tqdm=False)
        assert llm.is_finished() and llm.block_manager.num_free_blocks == 24
    outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert [o.token_ids for o in outs] == expected


def test_a_failed_step_is_undone_and_redone(reference, monkeypatch):
    """step() called directly: the forward pass raises once; nothing is recorded, and the
    steps after it give the same tokens as if it never happened."""
    expected, _ = reference
    llm = LLM(MODEL, **ENGINE)
    ids = [llm.add_request(p, PARAMS) for p in PROMPTS]
    llm.step()
    llm.step()
    inject(llm, "forward", RuntimeError, 1, monkeypatch)
    before = [(s.seq_id, s.num_tokens, s.num_cached_tokens, s.status) for s in llm.scheduler.running]
    with pytest.raises(RuntimeError):
        llm.step()
    after = [(s.seq_id, s.num_tokens, s.num_cached_tokens) for s in
             list(llm.scheduler.running) + list(llm.scheduler.waiting)]
    assert {b[:3] for b in before} <= set(after)
    assert all(s.num_scheduled_tokens == 0 for s in after and llm.scheduler.running)
    outs = {}
    while llm.has_unfinished_requests():
        outs.update({o.request_id: o.token_ids for o in llm.step()})
    assert [outs[i] for i in ids] == expected


# ---------------------------------------------------------------- abort

def test_abort_frees_blocks_and_reports_abort(reference):
    expected, _ = reference
    llm = LLM(MODEL, **ENGINE)
    ids = [llm.add_request(p, PARAMS) for p in PROMPTS[:3]]
    for _ in range(4):
        llm.step()
    out = llm.abort_request(ids[1])
    assert out.finish_reason == "abort" and out.request_id == ids[1]
    assert out.token_ids == expected[1][:len(out.token_ids)] and len(out.token_ids) < PARAMS.max_tokens
    with pytest.raises(KeyError, match="no unfinished request"):
        llm.abort_request(ids[1])
    waiting = llm.add_request(PROMPTS[4], PARAMS)       # never scheduled
    assert llm.abort_request(waiting).token_ids == []
    outs = {}
    while llm.has_unfinished_requests():
        outs.update({o.request_id: o for o in llm.step()})
    assert sorted(outs) == [ids[0], ids[2]]
    assert [outs[ids[0]].token_ids, outs[ids[2]].token_ids] == [expected[0], expected[2]]
    assert llm.block_manager.num_free_blocks == 24


def test_scheduler_abort_from_every_queue():
    sched = Scheduler(8, 2, max_num_batched_tokens=3)
    short = SamplingParams(max_tokens=2)
    a, b = Sequence([1, 2, 3, 4, 5], short, block_size=2), Sequence([6, 7], short, block_size=2)
    sched.add_all([a, b])
    out = sched.schedule()                  # a is chunked: it holds blocks in waiting
    seqs, _ = list(out.seqs), out.is_prefill
    assert seqs == [a] and a.block_table and list(sched.waiting) == [a, b]
    with pytest.raises(RuntimeError, match="a step is open"):
        sched.abort(a)                      # not in the middle of a step
    sched.update_from_output(out, [[]])     # the chunk computed, nothing sampled
    sched.abort(a)
    sched.abort(b)
    assert a.status == b.status == SequenceStatus.FINISHED_ABORTED and a.finish_reason == "abort"
    assert sched.is_finished() and sched.block_manager.num_free_blocks == 8
    with pytest.raises(ValueError, match="not held by this scheduler"):
        sched.abort(a)


# ---------------------------------------------------------------- the scheduler decides

def test_finish_reasons_are_decided_by_the_scheduler():
    sched = Scheduler(8, 2, eos_token_id=[9], max_model_len=6)
    stop, cap, model_len = (Sequence([1, 2], SamplingParams(max_tokens=3), block_size=2),
                            Sequence([1, 3], SamplingParams(max_tokens=1), block_size=2),
                            Sequence([1, 2, 3, 4, 5], SamplingParams(max_tokens=4), block_size=2))
    sched.add_all([stop, cap, model_len])
    out = sched.schedule()
    seqs, is_prefill = list(out.seqs), out.is_prefill
    assert is_prefill and seqs == [stop, cap, model_len]
    finished = sched.update_from_output(out, results(out, [9, 4, 4]))
    assert finished == [stop, cap, model_len]
    assert [s.status for s in finished] == [SequenceStatus.FINISHED_STOPPED, SequenceStatus.FINISHED_LENGTH_CAPPED,
                                            SequenceStatus.FINISHED_LENGTH_CAPPED]
    assert [s.finish_reason for s in finished] == ["stop", "length", "length"]


def test_schedule_admits_in_the_same_step_when_the_last_runner_preempted_itself(monkeypatch):
    """With check() admitting only requests that fit the pool, the first running sequence
    always gets its block once the others are preempted. A decode step that preempts every
    runner anyway (forced here: can_append says no once) must still not return an empty
    batch while requests wait: schedule() goes on to admission in the same call."""
    sched = Scheduler(4, 2)
    a = Sequence([1, 2, 3], SamplingParams(max_tokens=3), block_size=2)
    sched.add(a)
    out = sched.schedule()
    seqs, _ = list(out.seqs), out.is_prefill
    sched.update_from_output(out, results(out, [9]))
    real, calls = sched.block_manager.can_append, []

    def can_append_but_not_the_first_time(seq):
        calls.append(seq)
        return len(calls) > 1 and real(seq)

    monkeypatch.setattr(sched.block_manager, "can_append", can_append_but_not_the_first_time)
    out = sched.schedule()
    seqs, is_prefill = list(out.seqs), out.is_prefill
    assert list(out.preempted) == [a] and a.num_preemptions == 1
    # recomputed: its first block is a prefix-cache hit, the other 2 tokens run again
    assert seqs == [a] and is_prefill and (a.num_cached_tokens, a.num_scheduled_tokens) == (2, 2)


@pytest.mark.parametrize("seed", range(5))
def test_schedule_never_returns_an_empty_batch_while_work_remains(seed):
    rng = random.Random(seed)
    sched = Scheduler(10, 2, max_num_seqs=4, max_num_batched_tokens=7)
    seqs = [Sequence([rng.randrange(1, 5) for _ in range(rng.randint(1, 8))],
                     SamplingParams(max_tokens=rng.randint(1, 9), ignore_eos=True), block_size=2)
            for _ in range(12)]
    sched.add_all(seqs)
    for _ in range(500):
        if sched.is_finished():
            break
        out = sched.schedule()
        batch, _ = list(out.seqs), out.is_prefill
        assert batch, "an empty batch although requests wait or run"
        done = [s.num_cached_tokens + s.num_scheduled_tokens == s.num_tokens for s in batch]
        sched.update_from_output(out, results(out, [rng.randrange(1, 5) if d else None for d in done]))
    assert sched.is_finished() and sched.block_manager.num_free_blocks == 10
    assert all(s.num_completion_tokens == s.max_tokens for s in seqs)


# ---------------------------------------------------------------- bad sampled tokens

@pytest.mark.parametrize("token", ["x", 1.5, -1, True, None])
def test_update_from_output_refuses_tokens_that_are_not_token_ids_and_changes_nothing(token):
    sched = Scheduler(8, 2)
    short = SamplingParams(max_tokens=2)
    a, b = Sequence([1, 2, 3], short, block_size=2), Sequence([4, 5], short, block_size=2)
    sched.add_all([a, b])
    before = (state(sched.block_manager, [a, b]), [s.status for s in (a, b)], list(sched.waiting))
    out = sched.schedule()
    with pytest.raises(ValueError, match="token"):
        sched.update_from_output(out, results(out, [7, token]))
    # The refused results undo the whole step: the scheduler is as before schedule().
    assert (state(sched.block_manager, [a, b]), [s.status for s in (a, b)], list(sched.waiting)) == before
    assert not sched.journal.recording and not sched.running


# ---------------------------------------------------------------- ownership

def test_deallocate_refuses_a_stale_copy_and_another_managers_sequence():
    bm, other = BlockManager(6, 2), BlockManager(6, 2)
    a = Sequence([1, 2, 3], block_size=2)
    bm.allocate(a, bm.can_allocate(a))
    stale = copy.deepcopy(a)
    bm.deallocate(a)
    b = Sequence([4, 5, 6], block_size=2)
    bm.allocate(b, bm.can_allocate(b))          # takes a's old blocks? no: fresh ones first
    c = Sequence([7, 8, 9, 10, 11], block_size=2)
    other.allocate(c, other.can_allocate(c))
    for seq, msg in [(stale, "not allocated by this BlockManager"), (c, "not allocated by this BlockManager")]:
        before = state(bm, [b])
        with pytest.raises(ValueError, match=msg):
            bm.deallocate(seq)
        assert state(bm, [b]) == before
    live_copy = copy.deepcopy(b)
    with pytest.raises(ValueError, match="a copy of a sequence is not the sequence"):
        bm.deallocate(live_copy)
    with pytest.raises(ValueError, match="not allocated by this BlockManager"):
        bm.may_append(c)
    check_invariants(bm, [b])


def test_a_sequence_is_queued_in_one_scheduler_only():
    s1, s2 = Scheduler(8, 2), Scheduler(8, 2)
    seq = Sequence([1, 2, 3], SamplingParams(max_tokens=2), block_size=2)
    s1.add(seq)
    with pytest.raises(ValueError, match="already added"):
        s2.add(seq)
    with pytest.raises(ValueError, match="twice"):
        s2.add_all([Sequence([1], SamplingParams(max_tokens=2), block_size=2)] * 2)
    assert not s2.waiting


def test_allocate_with_minus_one_says_the_pool_is_full():
    bm = BlockManager(2, 2)
    seq = Sequence([1, 2, 3, 4, 5], block_size=2)
    assert bm.can_allocate(seq) == -1
    with pytest.raises(NoFreeBlocksError, match="does not fit.*2 of 2 are free"):
        bm.allocate(seq, bm.can_allocate(seq))
    assert not seq.block_table and bm.num_free_blocks == 2


# ---------------------------------------------------------------- type-strict settings

@pytest.mark.parametrize("kwargs, message", [
    (dict(ignore_eos="no"), "ignore_eos must be True or False"),
    (dict(ignore_eos=1), "ignore_eos must be True or False"),
    (dict(seed="abc"), "seed must be an integer"),
    (dict(seed=1.0), "seed must be an integer"),
    (dict(seed=True), "seed must be an integer"),
    (dict(seed=2**63), "seed must be an integer"),
    (dict(seed=2**32), "seed must be an integer"),           # torch keeps 32 bits: it would draw as seed 0
    (dict(seed=-1), "seed must be an integer"),              # ... and -1 as 2**32 - 1
    (dict(seed=2**32 - 2, n=4), "seed must be an integer"),  # completions 2, 3 would be seeds 0, 1
    (dict(max_tokens=True), "max_tokens"),
    (dict(temperature=True), "temperature"),
    (dict(temperature="0"), "temperature"),
    (dict(temperature=float("inf")), "temperature"),
    (dict(top_p=float("nan")), "top_p"),
    (dict(top_p=0), "top_p"),
])
def test_sampling_params_are_type_strict(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_sampling_params_accept_the_edges():
    SamplingParams(seed=2**32 - 1)
    SamplingParams(seed=2**32 - 4, n=4)
    SamplingParams(seed=0, temperature=0, top_p=1)


@pytest.mark.parametrize("make", [
    lambda: BlockManager(4, 2, enable_prefix_caching="no"),
    lambda: BlockManager(4, 2, free_queue=1),
    lambda: Scheduler(4, 2, enable_prefix_caching=0),
    lambda: Scheduler(4, 2, eos_token_id=[1, "2"]),
    lambda: LLM(MODEL, enable_prefix_caching="no", **CPU),
    lambda: LLM(MODEL, seed="1", **CPU),
])
def test_flags_are_bools_and_numbers_are_numbers(make):
    with pytest.raises(ValueError):
        make()


def test_text_prompts_are_checked_against_the_vocabulary_after_tokenization(monkeypatch):
    llm = LLM(MODEL, **ENGINE)
    monkeypatch.setattr(llm.tokenizer, "encode", lambda text, add_special_tokens=False: [5, 4096])
    with pytest.raises(ValueError, match="prompt 0: .*4096.*vocabulary"):
        llm.generate(["hello"], PARAMS, use_tqdm=False)
    assert llm.is_finished() and not llm.scheduler.waiting


def test_scheduler_check_runs_once_per_request(monkeypatch):
    llm = LLM(MODEL, **ENGINE)
    calls = []
    real = Scheduler.check
    monkeypatch.setattr(Scheduler, "check", lambda self, seq: (calls.append(seq.seq_id), real(self, seq)))
    llm.generate(PROMPTS[:3], SamplingParams(max_tokens=1), use_tqdm=False)
    llm.add_request(PROMPTS[3], SamplingParams(max_tokens=1))
    assert len(calls) == len(set(calls)) == 4


def test_the_engine_uses_the_linked_free_queue_by_default():
    from course_pkg.free_block_queue import FreeBlockQueue
    assert isinstance(LLM(MODEL, **ENGINE).block_manager.free_block_ids, FreeBlockQueue)
    assert isinstance(BlockManager(4, 2).free_block_ids, type(BlockManager(4, 2, free_queue="deque").free_block_ids))


# ---------------------------------------------------------------- threads

def test_a_second_thread_gets_a_clear_error_never_wrong_tokens(reference, monkeypatch):
    expected, _ = reference
    llm = LLM(MODEL, **ENGINE)
    inside, release = threading.Event(), threading.Event()
    real_step = llm.step
    calls = 0

    def slow_step():
        nonlocal calls
        calls += 1
        if calls == 2:          # hold the engine in the middle of the first generate
            inside.set()
            release.wait(10)
        return real_step()

    monkeypatch.setattr(llm, "step", slow_step)
    for trial in range(3):
        calls = 0
        inside.clear()
        release.clear()
        results, errors = {}, []
        first = threading.Thread(target=lambda: results.update(
            first=llm.generate(PROMPTS, PARAMS, use_tqdm=False)))
        first.start()
        assert inside.wait(10)
        for call in (lambda: llm.generate(PROMPTS[:1], PARAMS, use_tqdm=False),
                     lambda: llm.add_request(PROMPTS[0], PARAMS), lambda: real_step()):
            try:
                call()
            except RuntimeError as e:
                errors.append(str(e))
        release.set()
        first.join(30)
        assert len(errors) == 3 and all("another thread" in e for e in errors)
        assert [o.token_ids for o in results["first"]] == expected
        assert llm.is_finished() and not llm.unclaimed_outputs


# ---------------------------------------------------------------- exact prefix hits

def test_a_forced_hash_collision_never_changes_the_tokens(monkeypatch):
    """Every block gets the same hash: every lookup finds *some* block. The tokens must be the
    uncached run's; with Nano-vLLM's check (the block's own tokens only) they are not."""
    # Blocks of 4 real tokens (from the tiny model's tokenizer: the model reacts to them).
    a, b, c = [306, 273, 417, 337], [78, 355, 693, 311], [33, 429, 367, 268]
    prompts = [a + b + [14], b + c + [14], c + a + [14]]
    # Three new tokens: no decoded block fills up, so the index's one entry is the last
    # prompt block registered -- which the next prompt's first block matches by its tokens.
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    uncached = LLM(MODEL, **dict(ENGINE, enable_prefix_caching=False))
    expected = [[o.token_ids for o in uncached.generate([p], params, use_tqdm=False)][0] for p in prompts]

    def run(confirm=None):
        llm = LLM(MODEL, **ENGINE)
        monkeypatch.setattr(llm.block_manager, "compute_hash", lambda token_ids, prefix=-1: 42)
        if confirm is not None:
            monkeypatch.setattr(llm.block_manager, "_confirms_hit", confirm)
        return [llm.generate([p], params, use_tqdm=False)[0].token_ids for p in prompts], llm

    got, llm = run()
    assert got == expected
    assert llm.get_metrics().prefix_cache_hits == 0
    wrong, llm = run(confirm=lambda block, token_ids, parent, salt=None: block.token_ids == token_ids)
    assert llm.get_metrics().prefix_cache_hits > 0 and wrong != expected


# ---------------------------------------------------------------- issue 17's list of bad input

@pytest.fixture(scope="module")
def small_llm():
    return LLM(MODEL, **ENGINE)


def _engine_state(llm):
    return (state(llm.block_manager), len(llm.scheduler.waiting), len(llm.scheduler.running),
            dict(llm.get_metrics().as_dict()), sorted(llm._requests))


@pytest.mark.parametrize("call, error, words", [
    (lambda llm: llm.generate(b"hello"), TypeError, "bytes"),
    (lambda llm: llm.generate([True]), TypeError, "prompt 0: a prompt is a str"),
    (lambda llm: llm.generate([None]), TypeError, "prompt 0: a prompt is a str"),
    (lambda llm: llm.generate([PROMPTS[0], 5]), TypeError, "prompt 1: a prompt is a str"),
    (lambda llm: llm.abort_request(1.0), TypeError, "request id is an int"),
    (lambda llm: llm.abort_request([1]), TypeError, "request id is an int"),
    (lambda llm: llm.generate([PROMPTS[0]], SamplingParams(n=300, max_tokens=1), use_tqdm=False), ValueError,
     "n=300 completions, but max_num_seqs=256"),
    (lambda llm: llm.beam_search([PROMPTS[0]], BeamSearchParams(beam_width=300, max_tokens=2)), ValueError,
     "max_num_seqs"),
    (lambda llm: llm.beam_search([PROMPTS[0]], BeamSearchParams(beam_width=5, max_tokens=10**6)), ValueError,
     "max_model_len|never fit"),
], ids=["bytes", "bool-prompt", "none-prompt", "int-prompt", "float-id", "list-id", "n-above-max_num_seqs",
        "beam-above-max_num_seqs", "beam-past-max_model_len"])
def test_bad_input_is_refused_by_name_and_changes_nothing(small_llm, call, error, words):
    before = _engine_state(small_llm)
    with pytest.raises(error, match=words):
        call(small_llm)
    assert _engine_state(small_llm) == before


def test_beam_width_above_the_vocabulary_is_refused():
    llm = LLM(MODEL, **CPU, block_size=4, num_kvcache_blocks=64, max_num_seqs=4096)
    with pytest.raises(ValueError, match="beam_width=2000 is more than the vocabulary"):
        llm.beam_search([PROMPTS[0]], BeamSearchParams(beam_width=2000, max_tokens=2))


@pytest.mark.parametrize("kwargs, words", [
    (dict(same_step_prefix_hits=True, enable_prefix_caching=False), "same_step_prefix_hits=True needs prefix"),
    (dict(num_cpu_blocks=8), "num_cpu_blocks=8 sizes the CPU pool of preemption_mode='swap'"),
    (dict(gpu_memory_utilization=5.0), "gpu_memory_utilization"),
    (dict(kv_cache_memory_bytes=2.0**20), "kv_cache_memory_bytes"),
    (dict(kv_cache_memory_bytes="1MB"), "kv_cache_memory_bytes"),
    (dict(dtype="float32"), "dtype must be one of"),
    (dict(free_queue="list"), "free_queue"),
    (dict(preemption_mode="swap", num_cpu_blocks=4, tensor_parallel_size=2), "not supported with tensor_parallel"),
    (dict(device="gpu0"), "device='gpu0' is not a torch device"),
], ids=["same-step-without-caching", "cpu-blocks-with-recompute", "utilization", "float-bytes", "string-bytes",
        "string-dtype", "free-queue", "swap-with-tp", "device"])
def test_engine_config_refuses_bad_settings_by_name(kwargs, words):
    with pytest.raises(ValueError, match=words):
        LLM(MODEL, **{**CPU, "dtype": torch.float32, **kwargs})


def test_a_model_path_that_is_a_file_is_refused(tmp_path):
    path = tmp_path / "model.safetensors"
    path.write_bytes(b"")
    with pytest.raises(ValueError, match="is a file; pass the checkpoint folder"):
        LLM(path, **CPU)


@pytest.mark.parametrize("kwargs, words", [
    (dict(temperature=10**400), "temperature must be a finite number"),
    (dict(top_p=0.0), "top_p"),
])
def test_sampling_params_refuse_by_name(kwargs, words):
    with pytest.raises(ValueError, match=words):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("length_penalty", [1e308, -1e308, 11.0])
def test_length_penalty_beyond_ten_is_refused(length_penalty):
    with pytest.raises(ValueError, match="length_penalty"):
        BeamSearchParams(beam_width=2, max_tokens=4, length_penalty=length_penalty)


def test_tiny_temperature_and_top_p_are_served_as_greedy(small_llm, reference):
    """float32 cannot divide logits by 1e-300 (inf) nor hold top_p=1e-50 (0.0): both used to emit
    token 0 at once. Below 1e-5 a temperature is greedy (vLLM's rule); the most likely token is
    always in the nucleus."""
    greedy = small_llm.generate(PROMPTS[:2], PARAMS, use_tqdm=False)
    for sp in (SamplingParams(temperature=1e-300, max_tokens=7, ignore_eos=True),
               SamplingParams(temperature=1e-39, max_tokens=7, ignore_eos=True),
               SamplingParams(temperature=1.0, top_p=1e-50, max_tokens=7, ignore_eos=True, seed=3)):
        outs = small_llm.generate(PROMPTS[:2], sp, use_tqdm=False)
        assert [o.token_ids for o in outs] == [o.token_ids for o in greedy]


def test_hash_blocks_and_append_token_refuse_impossible_values():
    bm = BlockManager(8, 2)
    seq = Sequence([1, 2, 3, 4, 5], block_size=2)
    bm.allocate(seq, bm.can_allocate(seq))
    before = state(bm, [seq])
    for bad in (-5, 6, 2.0):
        with pytest.raises(ValueError, match="num_computed_tokens"):
            bm.hash_blocks(seq, bad)
    seq.num_cached_tokens = 99    # set beyond the sequence: its partial last block must not register
    with pytest.raises(ValueError, match="seq.num_cached_tokens=99"):
        bm.hash_blocks(seq)
    seq.num_cached_tokens = 0
    for bad in (-1, "x", 1.5, True):
        with pytest.raises(ValueError, match="cannot append"):
            seq.append_token(bad)
    assert state(bm, [seq]) == before
