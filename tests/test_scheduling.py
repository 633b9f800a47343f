"""Chapter 09's scheduling options against Hugging Face, and their bookkeeping (issue 11).

* ``scheduling="mixed"``, ``preemption_mode="swap"`` and ``same_step_prefix_hits=True``, alone
  and together, give the greedy tokens of ``transformers`` ``generate`` under every setting of
  test_engine.py (chunked prefill and preemption forced among them).
* What each option promises, observed from outside: under ``mixed`` a running sequence gets a
  token in every step; a swapped sequence is never recomputed; a same-step hit happens in the
  step that computes the shared prefix; a failed step withdraws the blocks it registered and
  turns its swaps into recomputations; abort frees a swapped sequence's CPU blocks.
* The latency metrics and the Prometheus registry, scraped over HTTP and parsed.
"""
from __future__ import annotations

import random
import socket
import urllib.request

import pytest
from dataclasses import astuple
import torch

from course_pkg import LLM, SamplingParams, Sequence
from course_pkg.engine.model_runner import ModelRunner
from course_pkg.models import default_model_path, load_model
from course_pkg.scheduler import Scheduler
from course_pkg.sequence import SequenceStatus
from course_pkg.swap import CpuBlockPool
from tests.helpers import check_invariants, results, state
from tests.test_engine import CONFIGS, expected, generate, hf_greedy, one_thread, prompts  # noqa: F401

MODEL = default_model_path()
CPU = dict(device="cpu", dtype=torch.float32, attention_backend="torch")
GREEDY = dict(temperature=0.0, ignore_eos=True)

OPTIONS = {
    "mixed": dict(scheduling="mixed"),
    "swap": dict(preemption_mode="swap", num_cpu_blocks=8),
    "mixed-swap": dict(scheduling="mixed", preemption_mode="swap", num_cpu_blocks=8),
    "same-step": dict(same_step_prefix_hits=True),
    "mixed-same-step-swap": dict(scheduling="mixed", same_step_prefix_hits=True, preemption_mode="swap",
                                 num_cpu_blocks=8),
}


# ---------------------------------------------------------------- equality with Hugging Face

@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_generate_equals_huggingface(name, option, prompts, expected):
    settings = {**CONFIGS[name], **OPTIONS[option]}
    if settings.get("same_step_prefix_hits") and settings.get("enable_prefix_caching") is False:
        with pytest.raises(ValueError, match="same_step_prefix_hits=True needs prefix caching"):
            LLM(MODEL, **CPU, **settings)   # refused: without caching there is nothing to hit
        return
    llm = LLM(MODEL, **CPU, **settings)
    outputs = generate(llm, prompts)
    for i, out in enumerate(outputs):
        assert out.token_ids == expected[i], f"prompt {i} ({len(prompts[i])} tokens) differs from HF"
    m = llm.get_metrics()
    assert m.num_requests_running == m.num_requests_waiting == 0 and m.kv_cache_usage_perc == 0
    assert m.cpu_kv_cache_usage_perc == 0
    if "preemption" in name:
        assert m.num_preemptions > 0
        if "swap" in option:
            assert m.num_swapped_out > 0 and m.num_swapped_in == m.num_swapped_out
            assert m.num_swapped_out + m.num_swap_fallbacks == m.num_preemptions
    if "mixed" in option and name != "bs1-all-at-once":
        assert m.num_mixed_steps > 0    # decodes and prompt chunks shared forward passes


def test_triton_backend_runs_mixed_batches_and_equals_huggingface(hf_model, prompts):
    """One step holds decodes (q_len 1) and prompt chunks (q_len > 1); the Triton kernels
    (under the interpreter on a CPU) take per-sequence q_len like the torch path."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    chosen = [prompts[i] for i in (2, 7, 10)]            # 5, 48 and 21 tokens
    want = [hf_greedy(hf_model, p, 3) for p in chosen]
    llm = LLM(MODEL, device=device, dtype=torch.float32, attention_backend="triton", block_size=16,
              num_kvcache_blocks=16, max_num_batched_tokens=16, scheduling="mixed")
    outs = llm.generate(chosen, SamplingParams(max_tokens=3, **GREEDY), use_tqdm=False)
    assert [o.token_ids for o in outs] == want
    assert llm.get_metrics().num_mixed_steps > 0


# ---------------------------------------------------------------- the mixed policy

def trace(llm, prompts, max_tokens):
    """Run to the end; per request the engine steps that sampled its tokens."""
    ids = [llm.add_request(p, SamplingParams(max_tokens=max_tokens, **GREEDY)) for p in prompts]
    steps = {rid: [] for rid in ids}
    while llm.has_unfinished_requests():
        llm.step()
        for rid, _ in llm.last_step.sampled:
            steps[rid].append(llm.last_step.step)
    return steps


def staggered_prompts(n=6, seed=3):
    rng = random.Random(seed)
    return [[rng.randrange(3, 1000) for _ in range(rng.randrange(20, 60))] for _ in range(n)]


def test_mixed_gives_every_running_sequence_a_token_every_step():
    """Without preemption, a sequence's tokens come in consecutive steps under ``mixed``; under
    ``prefill_first`` the prompts admitted later stall the early ones (a gap > 1 step)."""
    engine = dict(**CPU, block_size=8, num_kvcache_blocks=200, max_num_batched_tokens=32)
    prompts = staggered_prompts()
    mixed = LLM(MODEL, **engine, scheduling="mixed")
    steps = trace(mixed, prompts, 12)
    assert mixed.get_metrics().num_preemptions == 0
    for s in steps.values():
        assert s == list(range(s[0], s[0] + 12)), s
    first = trace(LLM(MODEL, **engine), prompts, 12)
    assert max(b - a for s in first.values() for a, b in zip(s, s[1:])) > 1


def test_mixed_step_puts_decodes_first_and_fills_the_budget_with_prompt_chunks():
    sched = Scheduler(100, 4, max_num_batched_tokens=10, scheduling="mixed")
    a, b, c = (Sequence(list(range(start, start + n)), SamplingParams(max_tokens=20), block_size=4)
               for start, n in ((10, 6), (100, 7), (200, 9)))
    sched.add_all([a, b, c])
    out = sched.schedule()             # a whole (6) + 4 tokens of b
    seqs, is_prefill = list(out.seqs), out.is_prefill
    assert [(s.seq_id, s.num_scheduled_tokens) for s in seqs] == [(a.seq_id, 6), (b.seq_id, 4)]
    sched.update_from_output(out, results(out, [1, None]))
    out = sched.schedule()                       # a decodes, b finishes its prompt (3), c chunk (6)
    seqs, _ = list(out.seqs), out.is_prefill
    assert [(s.seq_id, s.num_scheduled_tokens) for s in seqs] == [(a.seq_id, 1), (b.seq_id, 3), (c.seq_id, 6)]
    assert sum(s.num_scheduled_tokens for s in seqs) == 10
    assert sched.stats.num_mixed_steps == 1


# ---------------------------------------------------------------- swap

SWAP_ENGINE = dict(**CPU, block_size=8, num_kvcache_blocks=12, max_num_seqs=8)


def test_a_swapped_sequence_is_not_recomputed(prompts, expected):
    """With room in the CPU pool every preemption swaps, and prefill computes each prompt once."""
    recompute = LLM(MODEL, **SWAP_ENGINE)
    generate(recompute, prompts)
    swap = LLM(MODEL, **SWAP_ENGINE, preemption_mode="swap", num_cpu_blocks=64)
    outs = generate(swap, prompts)
    assert [o.token_ids for o in outs] == expected
    m, r = swap.get_metrics(), recompute.get_metrics()
    assert m.num_preemptions > 0 and m.num_swapped_out == m.num_preemptions and m.num_swap_fallbacks == 0
    # recomputation costs prefill tokens; swapping costs none: each prompt is prefilled once,
    # and a swapped-in sequence computes only its decode token (counted once per swap-in)
    assert m.prefill_kv_computed_tokens == sum(len(p) for p in prompts) - m.prefix_cache_hits + m.num_swapped_in
    assert r.prefill_kv_computed_tokens > m.prefill_kv_computed_tokens


def test_a_full_cpu_pool_falls_back_to_recompute_and_counts_it(prompts, expected):
    llm = LLM(MODEL, **SWAP_ENGINE, preemption_mode="swap", num_cpu_blocks=1)
    outs = generate(llm, prompts)
    assert [o.token_ids for o in outs] == expected
    m = llm.get_metrics()
    assert m.num_swap_fallbacks > 0 and m.num_swapped_out + m.num_swap_fallbacks == m.num_preemptions


@pytest.mark.parametrize("kwargs", [dict(preemption_mode="swap"), dict(preemption_mode="swap", num_cpu_blocks=0)])
def test_swap_without_a_cpu_pool_is_a_clear_error(kwargs):
    with pytest.raises(ValueError, match="num_cpu_blocks"):
        LLM(MODEL, **CPU, **kwargs)
    with pytest.raises(ValueError, match="num_cpu_blocks"):
        Scheduler(10, 4, **kwargs)


@pytest.mark.parametrize("kwargs, message", [
    (dict(preemption_mode="swapp", num_cpu_blocks=4), "preemption_mode"),
    (dict(scheduling="fifo"), "scheduling"),
    (dict(num_cpu_blocks=-1), "num_cpu_blocks"),
    (dict(preemption_mode="swap", num_cpu_blocks=True), "num_cpu_blocks"),
    (dict(same_step_prefix_hits=1), "same_step_prefix_hits"),
])
def test_bad_policy_settings_raise(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LLM(MODEL, **CPU, **kwargs)


def test_model_runner_swap_round_trip_restores_the_blocks():
    model, config, _ = load_model(MODEL, dtype=torch.float32, device="cpu")
    runner = ModelRunner(model, config, block_size=4, attention_backend="torch", seed=0, num_kvcache_blocks=6,
                         num_cpu_blocks=3)
    torch.manual_seed(0)
    runner.kv_cache.normal_()
    saved = runner.kv_cache[:, :, [4, 1]].clone()
    runner.swap_out([(4, 2), (1, 0)])
    runner.kv_cache.zero_()
    runner.swap_in([(2, 5), (0, 3)])                # back into other device blocks
    assert torch.equal(runner.kv_cache[:, :, [5, 3]], saved)
    assert runner.kv_cache[:, :, [0, 1, 2, 4]].abs().sum() == 0


def swapping_scheduler():
    """A scheduler whose second sequence gets swapped out at the first decode step that needs a
    block; returns it with that step open, and the state before the step."""
    sched = Scheduler(4, 4, preemption_mode="swap", num_cpu_blocks=4)
    a = Sequence([1, 2, 3, 4, 5, 6, 7, 8], SamplingParams(max_tokens=9), block_size=4)   # 2 blocks
    b = Sequence([9, 10, 11, 12, 13, 14, 15, 16], SamplingParams(max_tokens=9), block_size=4)
    sched.add_all([a, b])
    out = sched.schedule()
    sched.update_from_output(out, [[20], [21]])   # both 9 tokens: the 9th needs a 3rd block
    before = pool_state(sched, [a, b])
    out = sched.schedule()
    return sched, a, b, out, before


def pool_state(sched, seqs):
    pool = sched.cpu_pool
    return (state(sched.block_manager, seqs), [s.status for s in seqs], list(sched.waiting), list(sched.running),
            sorted(pool.swapped.items()), list(pool.free_block_ids), astuple(sched.stats))


def test_swap_out_lists_the_copies_and_frees_the_device_blocks():
    sched, a, b, out, _ = swapping_scheduler()
    assert list(out.seqs) == [a] and list(out.preempted) == [b]
    assert b.seq_id in sched.cpu_pool and not b.block_table and b.status == SequenceStatus.SWAPPED
    assert [cpu for _, cpu in out.blocks_to_swap_out] == sched.cpu_pool.block_table(b.seq_id)
    assert len(out.blocks_to_swap_out) == 2 and sched.cpu_pool.num_computed_tokens(b.seq_id) == 8
    check_invariants(sched.block_manager, [a])


def test_abort_frees_a_swapped_sequence_and_its_cpu_blocks():
    sched, a, b, out, _ = swapping_scheduler()
    sched.update_from_output(out, [[22]])
    sched.abort(b)
    assert b.status == SequenceStatus.FINISHED_ABORTED
    assert b.seq_id not in sched.cpu_pool and sched.cpu_pool.num_free_blocks == 4
    assert list(sched.waiting) == []
    check_invariants(sched.block_manager, [a])


def test_a_failed_step_undoes_its_swap_out_exactly():
    sched, a, b, out, before = swapping_scheduler()
    sched.unschedule(out)          # nothing was copied or written: the victim simply runs again
    assert pool_state(sched, [a, b]) == before
    assert b.status == SequenceStatus.RUNNING and b.block_table and b.seq_id not in sched.cpu_pool


def test_a_swap_out_undone_after_its_blocks_were_overwritten_is_recomputed():
    """Once the step wrote K/V into the victim's freed blocks, undoing the step cannot give the
    victim its K/V back: it is preempted by recompute, and its blocks are no cache entries."""
    sched, a, b, out, before = swapping_scheduler()
    overwritten = set(a.block_table) & {d for d, _ in out.blocks_to_swap_out}
    assert overwritten                      # a took a block of b's, and the step began writing into it
    sched.unschedule(out, overwritten={block: 0 for block in overwritten})
    assert b.status == SequenceStatus.PREEMPTED and not b.block_table and list(sched.waiting) == [b]
    assert b.seq_id not in sched.cpu_pool and sched.cpu_pool.num_free_blocks == 4
    assert not overwritten & set(sched.block_manager.hash_to_block_id.values())
    assert a.status == SequenceStatus.RUNNING and len(a.block_table) == 2   # as before the step
    assert sched.block_manager.num_free_blocks == 2


def test_a_failed_swap_in_goes_back_to_the_cpu_pool():
    sched, a, b, out, _ = swapping_scheduler()
    sched.update_from_output(out, [[22]])
    sched.abort(a)                                   # room for b again
    out = sched.schedule()
    assert list(out.seqs) == [b] and out.blocks_to_swap_in
    sched.unschedule(out)
    assert b.seq_id in sched.cpu_pool and list(sched.waiting) == [b] and not b.block_table
    assert b.status == SequenceStatus.SWAPPED
    check_invariants(sched.block_manager, [])
    again = sched.schedule()                          # swapped in again, same copies
    assert again.blocks_to_swap_in == out.blocks_to_swap_in
    assert list(again.seqs) == [b] and b.num_cached_tokens == 8 and b.num_scheduled_tokens == 1
    sched.update_from_output(again, [[23]])
    assert b.seq_id not in sched.cpu_pool and sched.cpu_pool.num_free_blocks == 4


def test_cpu_block_pool_refuses_misuse():
    pool = CpuBlockPool(3)
    assert pool.swap_out(7, 2, 5) == [0, 1] and pool.usage == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="already swapped out"):
        pool.swap_out(7, 1, 1)
    with pytest.raises(ValueError, match="needs 2 CPU blocks, 1 are free"):
        pool.swap_out(8, 2, 5)
    pool.release(7)
    assert list(pool.free_block_ids) == [2, 0, 1]
    with pytest.raises(ValueError, match="num_cpu_blocks"):
        CpuBlockPool(0)


# ---------------------------------------------------------------- same-step prefix hits

def test_a_same_step_hit_gives_the_huggingface_tokens(hf_model):
    """Two prompts sharing 32 tokens, admitted in one step: with the option, the second reads
    the shared blocks the first writes in that very forward pass."""
    rng = random.Random(5)
    shared = [rng.randrange(3, 1000) for _ in range(32)]
    two = [shared + [rng.randrange(3, 1000) for _ in range(n)] for n in (5, 9)]
    want = [hf_greedy(hf_model, p, 6) for p in two]
    for option, hits in ((False, 0), (True, 32)):
        llm = LLM(MODEL, **CPU, block_size=8, num_kvcache_blocks=40, same_step_prefix_hits=option)
        outs = llm.generate(two, SamplingParams(max_tokens=6, **GREEDY), use_tqdm=False)
        assert [o.token_ids for o in outs] == want
        assert [o.num_cached_tokens for o in outs] == [0, hits]
        assert llm.get_metrics().num_prefill_steps == 1     # both prompts in the first step


@pytest.mark.parametrize("seed", range(4))
def test_registering_when_scheduled_names_blocks_as_hash_blocks_does(seed):
    """Where no same-step hit is possible (one admission per step), registering at schedule time
    must leave exactly the index, hashes and prefix ids that registering after the step leaves."""
    rng = random.Random(seed)
    shared = [rng.randrange(1, 50) for _ in range(8)]
    prompts = [shared[:rng.randrange(0, 9)] + [rng.randrange(1, 50) for _ in range(rng.randrange(1, 12))]
               for _ in range(6)]

    def run(option):
        sched = Scheduler(40, 4, max_num_seqs=1, max_num_batched_tokens=5, same_step_prefix_hits=option)
        seqs = [Sequence(list(p), SamplingParams(max_tokens=4), block_size=4) for p in prompts]
        sched.add_all(seqs)
        states, tokens = [], iter(range(1000, 2000))
        while not sched.is_finished():
            out = sched.schedule()
            batch, _ = list(out.seqs), out.is_prefill
            sampled = [next(tokens) if s.num_cached_tokens + s.num_scheduled_tokens == s.num_tokens else None
                       for s in batch]
            sched.update_from_output(out, results(out, sampled))
            bm = sched.block_manager
            states.append((dict(bm.hash_to_block_id),
                           [(b.hash, b.prefix_id, b.parent_prefix_id, tuple(b.token_ids)) for b in bm.blocks],
                           [s.num_cached_tokens for s in seqs]))
        return states

    assert run(True) == run(False)


def test_a_failed_step_withdraws_the_blocks_it_registered_when_scheduled():
    sched = Scheduler(20, 4, same_step_prefix_hits=True)
    shared = [1, 2, 3, 4, 5, 6, 7, 8]
    a = Sequence(shared + [9, 10], SamplingParams(max_tokens=3), block_size=4)
    b = Sequence(shared + [11], SamplingParams(max_tokens=3), block_size=4)
    sched.add_all([a, b])
    out = sched.schedule()
    seqs, _ = list(out.seqs), out.is_prefill
    assert b.num_cached_tokens == 8 and b.block_table[:2] == a.block_table[:2]   # a same-step hit
    bm = sched.block_manager
    registered = set(bm.hash_to_block_id.values())
    assert registered == set(a.block_table[:2])
    sched.unschedule(out)                           # the step failed: those K/V were never written
    assert bm.hash_to_block_id == {} and all(bm.blocks[i].hash == -1 for i in registered)
    assert not b.block_table and b.status == SequenceStatus.WAITING    # its hit is undone
    assert not a.block_table and a.block_hashes == [] and a.num_cached_tokens == 0   # and a's admission
    assert list(sched.waiting) == [a, b]
    check_invariants(bm, [])
    out = sched.schedule()                       # redone: the same hit, registered again
    seqs, _ = list(out.seqs), out.is_prefill
    assert seqs == [a, b] and b.num_cached_tokens == 8


def test_a_fault_in_a_same_step_hit_step_never_changes_the_tokens(hf_model, monkeypatch):
    rng = random.Random(6)
    shared = [rng.randrange(3, 1000) for _ in range(24)]
    three = [shared + [rng.randrange(3, 1000) for _ in range(n)] for n in (3, 6, 10)]
    want = [hf_greedy(hf_model, p, 5) for p in three]
    llm = LLM(MODEL, **CPU, block_size=8, num_kvcache_blocks=40, same_step_prefix_hits=True)
    real = llm.model.forward
    calls = []

    def forward_fails_once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected fault")
        return real(*args, **kwargs)

    monkeypatch.setattr(llm.model, "forward", forward_fails_once)
    ids = [llm.add_request(p, SamplingParams(max_tokens=5, **GREEDY)) for p in three]
    with pytest.raises(RuntimeError, match="injected fault"):
        llm.step()
    assert llm.block_manager.hash_to_block_id == {}
    outs = {}
    while llm.has_unfinished_requests():
        for out in llm.step():
            outs[out.request_id] = out.token_ids
    assert [outs[i] for i in ids] == want


# ---------------------------------------------------------------- faults with swapped sequences

# 10 blocks of 4 tokens for 6 requests: each run swaps 6 times, in 11 of its ~60 steps.
FAULT_ENGINE = dict(**CPU, block_size=4, num_kvcache_blocks=10, max_num_batched_tokens=24,
                    preemption_mode="swap", num_cpu_blocks=32)
FAULT_PROMPTS = [[(7 * i + j) % 900 + 3 for j in range(5 + 2 * i)] for i in range(6)]
FAULT_PARAMS = SamplingParams(max_tokens=16, **GREEDY)


@pytest.fixture(scope="module")
def swap_reference():
    out = {}
    for scheduling in ("prefill_first", "mixed"):
        llm = LLM(MODEL, **FAULT_ENGINE, scheduling=scheduling)
        out[scheduling] = [o.token_ids for o in llm.generate(FAULT_PROMPTS, FAULT_PARAMS, use_tqdm=False)]
        assert llm.get_metrics().num_swapped_out > 0, "the reference run should swap"
    return out


@pytest.mark.parametrize("scheduling", ["prefill_first", "mixed"])
@pytest.mark.parametrize("point", ["swap_out", "swap_in", "forward", "update_from_output", "deallocate"])
@pytest.mark.parametrize("at", [1, 3, 5])
def test_a_fault_while_sequences_are_swapped_leaves_the_engine_as_good_as_new(swap_reference, scheduling,
                                                                                point, at, monkeypatch):
    llm = LLM(MODEL, **FAULT_ENGINE, scheduling=scheduling)
    obj = {"swap_out": llm.model_runner, "swap_in": llm.model_runner, "forward": llm.model,
           "update_from_output": llm.scheduler, "deallocate": llm.block_manager}[point]
    real, calls = getattr(obj, point), []

    def fails_once(*args, **kwargs):
        if point.startswith("swap") and not args[0]:   # count only the steps that copy blocks
            return real(*args, **kwargs)
        calls.append(1)
        if len(calls) == at:
            raise RuntimeError("injected fault")
        return real(*args, **kwargs)

    monkeypatch.setattr(obj, point, fails_once)
    with pytest.raises(RuntimeError, match="injected fault"):
        llm.generate(FAULT_PROMPTS, FAULT_PARAMS, use_tqdm=False)
    monkeypatch.undo()
    sched = llm.scheduler
    assert sched.is_finished() and sched.cpu_pool.num_free_blocks == sched.cpu_pool.num_blocks
    check_invariants(llm.block_manager, [])
    outs = llm.generate(FAULT_PROMPTS, FAULT_PARAMS, use_tqdm=False)
    assert [o.token_ids for o in outs] == swap_reference[scheduling]


# ---------------------------------------------------------------- latency metrics and Prometheus

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_request_latencies_are_ordered_and_counted(prompts):
    llm = LLM(MODEL, **CPU, block_size=8, num_kvcache_blocks=60, max_num_batched_tokens=40, scheduling="mixed")
    outs = generate(llm, prompts[:8])
    for out in outs:
        m = out.metrics
        assert 0 <= m.queue_time <= m.time_to_first_token <= m.e2e_latency
        assert len(m.inter_token_latencies) == len(out.token_ids) - 1 == len(m.token_steps) - 1
        assert all(t >= 0 for t in m.inter_token_latencies)
        assert m.first_token_time + sum(m.inter_token_latencies) == pytest.approx(m.last_token_time)
        assert m.token_steps == sorted(set(m.token_steps)) and m.token_steps[0] >= m.arrival_step


def test_prometheus_metrics_served_over_http_agree_with_get_metrics(prompts):
    from prometheus_client import start_http_server
    from prometheus_client.parser import text_string_to_metric_families

    llm = LLM(MODEL, **CPU, block_size=8, num_kvcache_blocks=12, max_num_seqs=8, preemption_mode="swap",
              num_cpu_blocks=2)
    outs = generate(llm, prompts[:12])
    waiting_id = llm.add_request(prompts[0], SamplingParams(max_tokens=3, **GREEDY))   # one left waiting
    port = free_port()
    server, thread = start_http_server(port, addr="127.0.0.1", registry=llm.metrics_registry)
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            assert s.labels.get("model_name") == "tiny" and s.labels.get("engine") == "0"
            samples[(s.name, s.labels.get("le"))] = s.value
    m = llm.get_metrics()
    assert m.num_preemptions > 0 and m.num_swap_fallbacks > 0
    for name, want in [("vllm:num_requests_running", m.num_requests_running),
                       ("vllm:num_requests_waiting", 1),
                       ("vllm:kv_cache_usage_perc", m.kv_cache_usage_perc),
                       ("vllm:prompt_tokens_total", sum(len(p) for p in prompts[:12]) + len(prompts[0])),
                       ("vllm:generation_tokens_total", sum(len(o.token_ids) for o in outs)),
                       ("vllm:num_preemptions_total", m.num_preemptions),
                       ("vllm:prefix_cache_queries_total", m.prefix_cache_queries),
                       ("vllm:prefix_cache_hits_total", m.prefix_cache_hits),
                       ("course:num_swap_fallbacks_total", m.num_swap_fallbacks),
                       ("course:num_swapped_out_total", m.num_swapped_out)]:
        assert samples[(name, None)] == pytest.approx(want), name
    n = len(outs)
    ttft = [o.metrics.time_to_first_token for o in outs]
    assert samples[("vllm:time_to_first_token_seconds_count", None)] == n
    assert samples[("vllm:time_to_first_token_seconds_sum", None)] == pytest.approx(sum(ttft))
    assert samples[("vllm:time_to_first_token_seconds_bucket", "+Inf")] == n
    assert samples[("vllm:time_to_first_token_seconds_bucket", "0.001")] == sum(t <= 0.001 for t in ttft)
    itl = [x for o in outs for x in o.metrics.inter_token_latencies]
    assert samples[("vllm:inter_token_latency_seconds_count", None)] == len(itl)
    assert samples[("vllm:inter_token_latency_seconds_sum", None)] == pytest.approx(sum(itl))
    assert samples[("vllm:e2e_request_latency_seconds_count", None)] == n
    assert samples[("vllm:e2e_request_latency_seconds_sum", None)] == pytest.approx(
        sum(o.metrics.e2e_latency for o in outs))
    assert samples[("vllm:request_queue_time_seconds_count", None)] == n
    assert samples[("vllm:request_queue_time_seconds_sum", None)] == pytest.approx(
        sum(o.metrics.queue_time for o in outs))
    llm.abort_request(waiting_id)                    # an abort updates the gauges too
    assert llm.metrics_registry.get_sample_value(
        "vllm:num_requests_waiting", {"model_name": "tiny", "engine": "0"}) == 0


# ---------------------------------------------------------------- with forks (chapter 08)

@pytest.mark.parametrize("option", ["mixed", "swap", "mixed-swap"])
def test_parallel_sampling_under_the_options_equals_single_requests(option):
    """Chapter 08's check under chapter 09's options: two requests of 4 seeded completions in a
    pool too small for both (forks share blocks, copy on write, and are preempted -- swapped
    with "swap"); completion j equals the single request seeded s + j."""
    from tests.test_forks import PROMPT, PROMPT2, seeded

    llm = LLM(MODEL, **CPU, block_size=4, num_kvcache_blocks=12, **OPTIONS[option])
    outs = llm.generate([PROMPT, PROMPT2], [seeded(100, n=4), seeded(200, n=4)], use_tqdm=False)
    single = LLM(MODEL, **CPU, block_size=4, num_kvcache_blocks=64)
    for out, prompt, seed in zip(outs, [PROMPT, PROMPT2], [100, 200]):
        singles = [single.generate([prompt], seeded(seed + j), use_tqdm=False)[0] for j in range(4)]
        assert [c.token_ids for c in out.outputs] == [s.token_ids for s in singles]
    m = llm.get_metrics()
    assert m.num_preemptions > 0 and llm.block_manager.num_free_blocks == 12
    if "swap" in option:
        assert m.num_swapped_out > 0 and llm.scheduler.cpu_pool.num_free_blocks == llm.scheduler.cpu_pool.num_blocks


# ---------------------------------------------------------------- arrivals and their drawings

def test_poisson_trace_is_seeded_and_has_the_asked_rate():
    from course_pkg.workloads.arrivals import poisson_trace

    a = poisson_trace(2000, 4.0, seed=3, prompt_len=(5, 9), output_len=(2, 3))
    assert a == poisson_trace(2000, 4.0, seed=3, prompt_len=(5, 9), output_len=(2, 3))
    gaps = [y.arrival - x.arrival for x, y in zip(a, a[1:])]
    assert sum(gaps) / len(gaps) == pytest.approx(1 / 4.0, rel=0.08)
    assert all(5 <= len(r.prompt) <= 9 and 2 <= r.max_tokens <= 3 for r in a)
    steps = poisson_trace(50, 0.5, seed=3, integer_arrivals=True)
    assert all(r.arrival == int(r.arrival) for r in steps)


def test_serve_on_the_step_clock_counts_steps_from_arrival():
    """One request of 10 tokens arriving at step 3, a budget of 4 tokens: 3 prefill steps, then
    one token per step. The clock jumps over the idle steps before it arrives."""
    from course_pkg.workloads.arrivals import TimedRequest, serve
    from course_pkg.viz.timeline import render_timeline

    llm = LLM(MODEL, **CPU, block_size=4, num_kvcache_blocks=16, max_num_batched_tokens=4)
    result = serve(llm, [TimedRequest(list(range(10, 20)), 4, 3.0)], clock="steps")
    [req] = result.requests
    assert req.ttft == 3 and req.inter_token == [1, 1, 1] and len(result.steps) == 6
    assert result.step_clock == [3, 4, 5, 6, 7, 8]
    assert render_timeline(result, {req.request_id: "A"}).splitlines()[1] == "   A |PPPddd|"


def test_pools_name_the_owner_of_every_device_and_cpu_block():
    from course_pkg.viz.pools import pool_owners, render_pools

    sched, a, b, _, _ = swapping_scheduler()
    device, cpu = pool_owners(sched.block_manager, sched.cpu_pool, {"a": a, "b": b})
    assert sorted(i for i, o in enumerate(device) if o == "a") == sorted(a.block_table)
    assert [i for i, o in enumerate(cpu) if o == "b"] == sched.cpu_pool.block_table(b.seq_id)
    assert render_pools(device, cpu).splitlines()[1].startswith("cpu    |b|b|")
