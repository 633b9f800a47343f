"""The tier in the engine (chapter 15): ``LLM(kv_transfer_config={...})``.

Greedy tokens with a tier behind a small device pool equal Hugging Face's and the tier-less
run's under every engine option -- prefix caching, chunked prefill, both preemption modes,
same-step hits with mixed batches, ARC and the reuse gate, cache salts, n-gram speculation --
and the tier really serves: the second pass over the prompts loads blocks from it. Seeded
forks (``n = 2``) give the tier-less run's samples. A forced hash collision (every block
hashes alike) loads nothing wrong. A case counted by hand pins the metrics, and bad configs are
refused by name. Faults at every call of the tier's side of a step, and after a load or a store
wrote its bytes, are in ``test_step_transaction.py``.
"""
from __future__ import annotations

import pytest
import torch

from course_pkg import LLM, SamplingParams
from course_pkg.block_manager import BlockManager
from course_pkg.models import default_model_path
from tests.helpers import check_invariants, check_tier
from tests.test_engine import hf_greedy, make_prompts, max_tokens_for

MODEL = default_model_path()
CPU = dict(device="cpu", dtype=torch.float32, attention_backend="torch")
GREEDY = dict(temperature=0.0, ignore_eos=True)


def tier(num_cpu_blocks: int, **extra) -> dict:
    return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"num_cpu_blocks": num_cpu_blocks, **extra}}


@pytest.fixture(scope="module", autouse=True)
def one_thread(one_torch_thread):
    """One torch thread for this module (see conftest)."""


@pytest.fixture(scope="module")
def prompts(hf_model):
    return make_prompts(hf_model.config.vocab_size)


@pytest.fixture(scope="module")
def expected(hf_model, prompts):
    return [hf_greedy(hf_model, p, max_tokens_for(i)) for i, p in enumerate(prompts)]


def generate(llm, prompts, salts=None):
    params = [SamplingParams(max_tokens=max_tokens_for(i), **GREEDY) for i in range(len(prompts))]
    if salts is None:
        return [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    inputs = [{"prompt_token_ids": p, "cache_salt": s} for p, s in zip(prompts, salts)]
    return [o.token_ids for o in llm.generate(inputs, params, use_tqdm=False)]


# Device pools too small to keep the prompts from one pass to the next: the second pass finds
# its prefixes in the tier.
CONFIGS = {
    "bs4-lru": dict(block_size=4, num_kvcache_blocks=40, max_num_seqs=4, kv_transfer_config=tier(400)),
    "bs4-arc-small-tier": dict(block_size=4, num_kvcache_blocks=40, max_num_seqs=4,
                               kv_transfer_config=tier(60, eviction_policy="arc")),
    "bs4-reuse-gate": dict(block_size=4, num_kvcache_blocks=40, max_num_seqs=4,
                           kv_transfer_config=tier(400, store_threshold=2)),
    "bs3-chunked-prefill": dict(block_size=3, num_kvcache_blocks=60, max_num_batched_tokens=13,
                                kv_transfer_config=tier(500)),
    "bs8-preemption-recompute": dict(block_size=8, num_kvcache_blocks=12, max_num_seqs=8,
                                     kv_transfer_config=tier(200)),
    "bs4-preemption-swap": dict(block_size=4, num_kvcache_blocks=30, max_num_seqs=8, preemption_mode="swap",
                                num_cpu_blocks=20, kv_transfer_config=tier(300)),
    "bs4-mixed-same-step-hits": dict(block_size=4, num_kvcache_blocks=40, scheduling="mixed",
                                     max_num_batched_tokens=24, same_step_prefix_hits=True,
                                     kv_transfer_config=tier(300, eviction_policy="arc")),
    "bs4-ngram-speculation": dict(block_size=4, num_kvcache_blocks=40, max_num_seqs=4, kv_transfer_config=tier(400),
                                  speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                      "prompt_lookup_max": 3}),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_tokens_with_the_tier_equal_huggingface_and_the_tierless_run(name, prompts, expected):
    config = CONFIGS[name]
    llm = LLM(MODEL, **CPU, **config)
    without = LLM(MODEL, **CPU, **{k: v for k, v in config.items() if k != "kv_transfer_config"})
    for _ in range(2):   # the second pass finds what the device pool forgot in the tier
        got = generate(llm, prompts)
        assert got == expected
        assert generate(without, prompts) == expected
    m, m0 = llm.get_metrics(), without.get_metrics()
    assert m.external_prefix_cache_hits > 0 and m.kv_offload_blocks_loaded > 0
    assert m.prefill_kv_computed_tokens < m0.prefill_kv_computed_tokens   # the tier saved prefill
    assert m.prefix_cache_hits + m.external_prefix_cache_hits > m0.prefix_cache_hits
    if "preemption" in name:
        assert m.num_preemptions > 0
    check_invariants(llm.block_manager, [])
    check_tier(llm.scheduler.offload)
    assert tier_copies_equal_the_device_blocks(llm) > 0


def tier_copies_equal_the_device_blocks(llm) -> int:
    """Every block the tier holds ready whose prefix the device pool still holds: the two copies'
    K/V are equal -- to float32 rounding, since the device may have computed the prefix again in
    another batch. Returns how many were compared."""
    off, bm, runner = llm.scheduler.offload, llm.block_manager, llm.model_runner
    held = off.manager.backing if hasattr(off.manager, "backing") else off.manager
    blocks = {**held.blocks} if hasattr(held, "blocks") else {**held.t1, **held.t2}
    compared = 0
    for h, tier_block in blocks.items():
        device_id = bm.hash_to_block_id.get(h)
        if not tier_block.is_ready or device_id is None:   # (no collision is forced here: one hash, one prefix)
            continue
        torch.testing.assert_close(runner.offload_kv_cache[:, :, tier_block.block_id], runner.kv_cache[:, :, device_id],
                                   rtol=1e-4, atol=1e-4)
        compared += 1
    return compared


def test_cache_salts_keep_their_prefixes_apart_in_the_tier(prompts, expected):
    """A prompt hits the tier only under its own salt: the prompts once with one salt, then each
    under a salt of its own (no hit at all, though the tier holds all of them), then again with
    those salts (hits); the tokens stay HF's throughout."""
    llm = LLM(MODEL, **CPU, block_size=4, num_kvcache_blocks=40, max_num_seqs=4, kv_transfer_config=tier(800))
    assert generate(llm, prompts, ["alice"] * len(prompts)) == expected
    before = llm.get_metrics()
    assert before.external_prefix_cache_hits > 0   # (the prompts share prefixes among themselves)
    own = [f"salt-{i}" for i in range(len(prompts))]
    assert generate(llm, prompts, own) == expected
    m = llm.get_metrics()
    assert (m.prefix_cache_hits, m.external_prefix_cache_hits) == (before.prefix_cache_hits,
                                                                   before.external_prefix_cache_hits)
    assert generate(llm, prompts, own) == expected
    assert llm.get_metrics().external_prefix_cache_hits > m.external_prefix_cache_hits


def test_seeded_forks_sample_the_same_with_and_without_the_tier(prompts):
    params = [SamplingParams(n=2, temperature=1.0, seed=i, max_tokens=8, ignore_eos=True) for i in range(len(prompts))]
    runs = []
    for kv_transfer_config in (tier(400), None):
        llm = LLM(MODEL, **CPU, block_size=4, num_kvcache_blocks=48, max_num_seqs=6,
                  kv_transfer_config=kv_transfer_config)
        runs.append([[[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params, use_tqdm=False)]
                     for _ in range(2)])
        if kv_transfer_config is not None:
            assert llm.get_metrics().external_prefix_cache_hits > 0
    assert runs[0] == runs[1]


def test_a_forced_hash_collision_loads_nothing_wrong(monkeypatch, prompts, expected):
    """Every block hashes to the same value: the tier holds one hash, and a lookup finds it for
    every prefix -- the exact check (tokens, parent prefix id) turns all but the right one away."""
    monkeypatch.setattr(BlockManager, "compute_hash", staticmethod(lambda token_ids, prefix=-1: 12345))
    llm = LLM(MODEL, **CPU, block_size=4, num_kvcache_blocks=40, max_num_seqs=4, kv_transfer_config=tier(400))
    for _ in range(2):
        assert generate(llm, prompts) == expected
    off = llm.scheduler.offload
    found, confirmed = off.manager.stats.hits, off.stats.hits + off.stats.preempted_hits
    assert found * 4 > confirmed, "no lookup found a colliding hash: the test did not force a collision"
    check_tier(off)


def test_a_request_the_device_pool_forgot_is_served_from_the_tier_counted_by_hand(hf_model):
    """Pool of 8 blocks of 4 tokens. A (13 tokens, 4 blocks), then B and C (4 blocks each): C
    takes the blocks A freed. A again: no device hit; the tier holds A's 3 full blocks (never the
    block of the prompt's last token), so 12 tokens are loaded, not computed."""
    llm = LLM(MODEL, **CPU, block_size=4, num_kvcache_blocks=8, max_num_seqs=1, kv_transfer_config=tier(16))
    a, b, c = ([t + k for t in range(3, 16)] for k in (0, 100, 200))
    one = SamplingParams(max_tokens=1, **GREEDY)
    for p in (a, b, c):
        llm.generate([p], one, use_tqdm=False)
    m = llm.get_metrics()
    assert (m.prefix_cache_hits, m.external_prefix_cache_hits) == (0, 0)
    assert m.external_prefix_cache_queries == 3 * 13
    # 3 full blocks each of A, B and C: a step's blocks are copied by the next step, and generate()
    # ends with a step that runs nothing but C's copies (flush_kv_transfer).
    assert m.kv_offload_blocks_stored == 9 and not llm.scheduler.offload.stores
    out = llm.generate([a], SamplingParams(max_tokens=3, **GREEDY), use_tqdm=False)[0]
    assert out.token_ids == hf_greedy(hf_model, a, 3)
    assert out.num_cached_tokens == 12   # as vLLM counts it: the local and the external hit
    m = llm.get_metrics()
    assert (m.prefix_cache_hits, m.external_prefix_cache_hits) == (0, 12)
    assert m.kv_offload_blocks_loaded == 3 and m.kv_offload_blocks_stored == 9
    assert m.kv_offload_bytes_loaded == 3 * llm.model_runner.block_bytes
    assert m.prefill_kv_computed_tokens == 3 * 13 + 1
    text = __import__("prometheus_client").generate_latest(llm.metrics_registry).decode()
    assert 'vllm:external_prefix_cache_hits_total{engine="0",model_name=' in text
    line = next(x for x in text.splitlines() if x.startswith("vllm:external_prefix_cache_hits_total"))
    assert float(line.split()[-1]) == 12.0


@pytest.mark.parametrize("config, message", [
    ({"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both", "kv_connector_extra_config": {"num_cpu_blocks": 4}},
     "kv_connector"),
    ({"kv_role": "kv_producer", "kv_connector_extra_config": {"num_cpu_blocks": 4}}, "kv_role"),
    ({"kv_connector_extra_config": {"num_cpu_blocks": 4}, "kv_ip": "10.0.0.1"}, "'kv_ip' is vLLM's"),
    ({"kv_connector_extra_config": {"num_cpu_blocks": 4}, "kv_conector": "x"}, "unknown kv_transfer_config key 'kv_conector'"),
    ({"kv_connector_extra_config": {"num_cpu_blocks": 4, "evicton_policy": "lru"}},
     "unknown kv_connector_extra_config key 'evicton_policy'"),
    ({"kv_connector_extra_config": {"num_cpu_blocks": 4, "disk_path": "some/dir"}}, "needs both disk_path and num_disk_blocks"),
    ({"kv_connector_extra_config": {}}, "the tier.s size once"),
    ({"kv_connector_extra_config": {"num_cpu_blocks": 0}}, "num_cpu_blocks"),
    ({"kv_connector_extra_config": {"num_cpu_blocks": 4, "eviction_policy": "lfu"}}, "eviction_policy"),
    ({"kv_connector_extra_config": {"num_cpu_blocks": 4, "block_size": 32}}, "block_size=32"),
    ("OffloadingConnector", "must be a dict"),
])
def test_a_bad_kv_transfer_config_is_refused_by_name(config, message):
    with pytest.raises((ValueError, TypeError), match=message):
        LLM(MODEL, **CPU, block_size=16, num_kvcache_blocks=8, kv_transfer_config=config)


@pytest.mark.parametrize("kwargs, message", [
    (dict(enable_prefix_caching=False), "needs prefix caching"),
    (dict(tensor_parallel_size=2), "tensor_parallel_size"),
])
def test_the_tier_refuses_what_it_cannot_serve(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LLM(MODEL, **CPU, num_kvcache_blocks=8, kv_transfer_config=tier(4), **kwargs)


def test_prompts_from_a_trace_share_tokens_exactly_where_the_requests_share_blocks():
    from course_pkg.workloads.trace_engine import prompts_from_trace
    from course_pkg.workloads.traces import MOONCAKE_CONVERSATION_TRACE, load_trace

    trace = load_trace(MOONCAKE_CONVERSATION_TRACE, limit=120)
    prompts = prompts_from_trace(trace, 4, 1000)
    assert prompts == prompts_from_trace(trace, 4, 1000)   # the same draw every time
    for r, p in zip(trace, prompts):
        last = r.input_length - 512 * (len(r.hash_ids) - 1)
        assert len(p) == 4 * (len(r.hash_ids) - 1) + max(1, min(4, round(last / 128)))
        assert all(3 <= t < 1000 for t in p)
    for a in range(0, 120, 7):
        for b in range(a + 1, 120, 5):
            ids_a, ids_b = trace[a].hash_ids, trace[b].hash_ids
            common = next((i for i, (x, y) in enumerate(zip(ids_a, ids_b)) if x != y), min(len(ids_a), len(ids_b)))
            tokens = next((i for i, (x, y) in enumerate(zip(prompts[a], prompts[b])) if x != y),
                          min(len(prompts[a]), len(prompts[b])))
            full = min(common, len(ids_a) - 1, len(ids_b) - 1)   # leading blocks both have in full
            assert tokens >= 4 * full
            if common < min(len(ids_a), len(ids_b)):   # a differing id: different tokens at once
                assert tokens < 4 * (common + 1)


def test_serving_a_trace_slice_with_the_tier_computes_less_and_gives_the_same_tokens():
    from course_pkg.workloads.trace_engine import prompts_from_trace, serve_trace
    from course_pkg.workloads.traces import MOONCAKE_CONVERSATION_TRACE, load_trace

    trace = load_trace(MOONCAKE_CONVERSATION_TRACE, limit=150)
    runs = []
    for kv_transfer_config in (None, tier(4096)):   # (the first 150 requests store about 2,000 blocks)
        llm = LLM(MODEL, **CPU, block_size=4, num_kvcache_blocks=300, max_num_seqs=8,
                  kv_transfer_config=kv_transfer_config)
        served, _ = serve_trace(llm, prompts_from_trace(trace, 4, llm.config.vocab_size), 2, 8)
        runs.append((served, llm.get_metrics()))
    (plain, m0), (tiered, m1) = runs
    assert [s.prompt_tokens for s in plain] == [s.prompt_tokens for s in tiered]
    assert all(s.cached_tokens >= 0 and s.ttft > 0 for s in plain + tiered)
    assert m1.generation_tokens == m0.generation_tokens
    assert [s.token_ids for s in plain] == [s.token_ids for s in tiered] and all(s.token_ids for s in plain)
    # per request, the tokens found at its first admission: the device's hits and the tier's
    assert sum(s.cached_tokens for s in tiered) == m1.prefix_cache_hits + m1.external_prefix_cache_hits
    assert m1.external_prefix_cache_hits > 0
    assert m1.prefill_kv_computed_tokens < m0.prefill_kv_computed_tokens


def test_the_tier_sized_in_bytes_gets_the_blocks_that_fit():
    """``cpu_bytes_to_use`` (later vLLM's key) becomes whole blocks of this model's size."""
    probe = LLM(MODEL, **CPU, block_size=4, num_kvcache_blocks=8)
    block_bytes = probe.model_runner.block_bytes
    llm = LLM(MODEL, **CPU, block_size=4, num_kvcache_blocks=8,
              kv_transfer_config={"kv_connector_extra_config": {"cpu_bytes_to_use": 10 * block_bytes + block_bytes // 2}})
    assert llm.scheduler.offload.manager.num_blocks == 10
    assert llm.model_runner.offload_kv_cache.shape[2] == 10
    with pytest.raises(ValueError, match="once"):
        LLM(MODEL, **CPU, block_size=4, num_kvcache_blocks=8,
            kv_transfer_config={"kv_connector_extra_config": {"cpu_bytes_to_use": 10**6, "num_cpu_blocks": 4}})
    with pytest.raises(ValueError, match="room for no block"):
        LLM(MODEL, **CPU, block_size=4, num_kvcache_blocks=8,
            kv_transfer_config={"kv_connector_extra_config": {"cpu_bytes_to_use": block_bytes - 1}})
