"""The engine against Hugging Face transformers, the oracle (as minGPT tests against GPT-2).

Greedy ``LLM.generate`` must produce exactly the tokens of
``AutoModelForCausalLM.generate(do_sample=False)`` for every prompt, whatever the engine does
with them: prefix caching on or off, prompts chunked under a small token budget, sequences
preempted and recomputed in a small pool, block sizes 1, 3 and 16, the Triton kernels under
the interpreter. The metrics are checked against cases counted by hand.
"""
from __future__ import annotations

import random

import pytest
import torch

from course_pkg import LLM, SamplingParams
from course_pkg.engine import ModelRunner, Sampler
from course_pkg.engine.sampler import top_p_filter
from course_pkg.models import default_model_path
from course_pkg.sequence import Sequence

MODEL = default_model_path()
# Every engine here runs where the oracle does: float32 on the CPU (a GPU machine would
# otherwise default to CUDA and bfloat16). Only the Triton case uses CUDA when present.
CPU = dict(device="cpu", dtype=torch.float32)
GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module", autouse=True)
def one_thread(one_torch_thread):
    """One torch thread for this module (see conftest)."""


def make_prompts(vocab_size: int) -> list[list[int]]:
    """18 prompts of 1 to 70 tokens; groups share 20- and 37-token prefixes."""
    rng = random.Random(1234)

    def tokens(n):
        return [rng.randrange(3, vocab_size) for _ in range(n)]

    shared_a, shared_b = tokens(20), tokens(37)
    prompts = [tokens(n) for n in (1, 2, 5, 9, 16, 17, 31, 48, 70)]
    prompts += [shared_a + tokens(n) for n in (1, 7, 15)]
    prompts += [shared_b + tokens(n) for n in (3, 11, 29)]
    prompts += [shared_a[:16], shared_b[:32], shared_b + shared_b[:5]]
    return prompts


def max_tokens_for(i: int) -> int:
    return 4 + (i * 7) % 17     # 4 .. 20, varied


@pytest.fixture(scope="module")
def prompts(hf_model):
    return make_prompts(hf_model.config.vocab_size)


def hf_greedy(hf_model, prompt: list[int], max_new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                max_new_tokens=max_new_tokens, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def expected(hf_model, prompts):
    return [hf_greedy(hf_model, p, max_tokens_for(i)) for i, p in enumerate(prompts)]


def generate(llm, prompts):
    params = [SamplingParams(max_tokens=max_tokens_for(i), **GREEDY) for i in range(len(prompts))]
    return llm.generate(prompts, params, use_tqdm=False)


# ---------------------------------------------------------------- equality with Hugging Face

CONFIGS = {
    "bs16-prefix-caching": dict(block_size=16, num_kvcache_blocks=64, max_num_seqs=4),
    "bs16-no-prefix-caching": dict(block_size=16, num_kvcache_blocks=64, max_num_seqs=4,
                                   enable_prefix_caching=False),
    "bs3-chunked-prefill": dict(block_size=3, num_kvcache_blocks=200, max_num_batched_tokens=13),
    "bs1-all-at-once": dict(block_size=1, num_kvcache_blocks=1200, max_num_seqs=32),
    # 12 blocks of 8 tokens: the running sequences outgrow the pool and preempt each other
    "bs8-preemption": dict(block_size=8, num_kvcache_blocks=12, max_num_seqs=8),
    "bs3-chunked-preemption-no-caching": dict(block_size=3, num_kvcache_blocks=33, max_num_batched_tokens=20,
                                              enable_prefix_caching=False),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_generate_equals_huggingface(name, prompts, expected):
    config = CONFIGS[name]
    llm = LLM(MODEL, **CPU, attention_backend="torch", **config)
    outputs = generate(llm, prompts)
    for i, out in enumerate(outputs):
        assert out.prompt_token_ids == prompts[i]
        assert out.token_ids == expected[i], f"prompt {i} ({len(prompts[i])} tokens) differs from HF"
        assert out.finish_reason == "length"
    m = llm.get_metrics()
    assert m.generation_tokens == sum(len(e) for e in expected)
    assert m.num_requests_running == m.num_requests_waiting == 0 and m.kv_cache_usage_perc == 0
    if "preemption" in name:
        assert m.num_preemptions > 0
    else:
        assert m.num_preemptions == 0
    if "chunked" in name:
        assert max(len(p) for p in prompts) > config["max_num_batched_tokens"]
    if name == "bs1-all-at-once" or not config.get("enable_prefix_caching", True):
        # admitted in one step, no prompt may hit blocks whose K/V are not computed yet
        assert m.prefix_cache_hits == 0
    else:
        assert m.prefix_cache_hits > 0            # later prompts reuse the shared prefixes


def test_second_pass_is_served_from_the_prefix_cache(prompts, expected):
    """The same prompts again: every full block but the one with the last token is a hit."""
    llm = LLM(MODEL, **CPU, block_size=4, num_kvcache_blocks=600, attention_backend="torch")
    generate(llm, prompts)
    again = generate(llm, prompts)
    for i, out in enumerate(again):
        assert out.token_ids == expected[i]
        assert out.num_cached_tokens == (len(prompts[i]) - 1) // 4 * 4


def test_triton_backend_under_the_interpreter_equals_huggingface(hf_model, prompts):
    short = [prompts[2], prompts[9][:6]]                 # 5 and 6 tokens, 3 new tokens each
    expected = [hf_greedy(hf_model, p, 3) for p in short]
    # Under Triton's interpreter on a CPU; with the real kernels where CUDA is present.
    device = "cuda" if torch.cuda.is_available() else "cpu"
    llm = LLM(MODEL, device=device, dtype=torch.float32, block_size=4, num_kvcache_blocks=8,
              attention_backend="triton")
    assert llm.model_runner.attention_backend == "triton"
    outputs = llm.generate(short, SamplingParams(max_tokens=3, **GREEDY), use_tqdm=False)
    assert [o.token_ids for o in outputs] == expected


def test_one_forward_logits_match_huggingface(hf_model, prompts):
    """Logits at every position of a prompt computed through the paged cache, vs HF's."""
    llm = LLM(MODEL, **CPU, block_size=4, num_kvcache_blocks=32, attention_backend="torch")
    runner = llm.model_runner
    prompt = prompts[7]
    seq = Sequence(prompt, SamplingParams(**GREEDY), block_size=4)
    seq.block_table = list(range(31, 31 - seq.num_blocks, -1))    # scattered, descending blocks
    seq.num_scheduled_tokens = len(prompt)
    input_ids, positions, attn, _, _ = runner.prepare([seq])
    with torch.inference_mode():
        logits = llm.model.compute_logits(llm.model(input_ids, positions, attn, runner.kv_caches))
        ref = hf_model(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(logits, ref, atol=2e-4, rtol=1e-4)


def test_default_model_generates_text(capsys):
    llm = LLM(num_kvcache_blocks=64, attention_backend="torch", **CPU)
    out = llm.generate(["Once upon a time", "The"], SamplingParams(temperature=0.0, max_tokens=12))
    assert "Generating" in capsys.readouterr().err          # the progress bar, on by default
    assert all(isinstance(o.text, str) and o.token_ids for o in out)
    assert out[0].text == llm.tokenizer.decode(out[0].token_ids, skip_special_tokens=True)


# ---------------------------------------------------------------- metrics counted by hand

def test_metrics_prefix_hits_counted_by_hand(prompts, expected):
    llm = LLM(MODEL, **CPU, block_size=4, num_kvcache_blocks=16, attention_backend="torch")
    a = prompts[10][:10]
    b = prompts[10][:8] + [5, 6, 7]                  # shares a's first 8 tokens = 2 blocks
    out_a = llm.generate(a, SamplingParams(max_tokens=3, **GREEDY), use_tqdm=False)[0]
    out_b = llm.generate(b, SamplingParams(max_tokens=3, **GREEDY), use_tqdm=False)[0]
    assert (out_a.num_cached_tokens, out_b.num_cached_tokens) == (0, 8)
    m = llm.get_metrics()
    assert (m.prefix_cache_queries, m.prefix_cache_hits) == (10 + 11, 8)
    assert m.prefix_cache_hit_rate == pytest.approx(8 / 21)
    assert m.prompt_tokens == 21 and m.generation_tokens == 6
    assert m.prefill_kv_computed_tokens == 10 + 3
    assert (m.num_prefill_steps, m.num_decode_steps, m.num_preemptions) == (2, 4, 0)
    # KV usage while b is running: 11 tokens + 1 being decoded = 3 blocks of 16
    llm.add_request(b, SamplingParams(max_tokens=3, **GREEDY))
    llm.step()
    assert llm.get_metrics().kv_cache_usage_perc == pytest.approx(3 / 16)
    ttft = out_b.metrics.time_to_first_token
    assert ttft is not None and 0 < ttft <= out_b.metrics.finished_time - out_b.metrics.arrival_time


def test_metrics_preemption_counted_by_hand(hf_model, prompts):
    """4 blocks of 4 tokens, two 8-token prompts: b is preempted once, and on its return
    finds only its first block, because a's third block overwrote b's second."""
    a, b = prompts[7][:8], prompts[8][:8]
    llm = LLM(MODEL, **CPU, block_size=4, num_kvcache_blocks=4, attention_backend="torch")
    outs = llm.generate([a, b], SamplingParams(max_tokens=3, **GREEDY), use_tqdm=False)
    assert [o.token_ids for o in outs] == [hf_greedy(hf_model, a, 3), hf_greedy(hf_model, b, 3)]
    m = llm.get_metrics()
    assert m.num_preemptions == 1
    # b's return (9 tokens, 4 found) is counted apart, as vLLM v1 counts a preempted re-lookup
    assert (m.prefix_cache_queries, m.prefix_cache_hits) == (8 + 8, 0)
    stats = llm.block_manager.prefix_cache_stats
    assert (stats.preempted_requests, stats.preempted_queries, stats.preempted_hits) == (1, 9, 4)
    assert m.prefill_kv_computed_tokens == 16 + 5
    assert outs[1].metrics.num_preemptions == 1 and outs[0].metrics.num_preemptions == 0
    assert outs[1].num_cached_tokens == 0          # the hit at its first admission


def test_step_info_describes_each_step():
    llm = LLM(MODEL, **CPU, block_size=4, num_kvcache_blocks=16, max_num_batched_tokens=6, attention_backend="torch")
    rid = llm.add_request(list(range(3, 13)), SamplingParams(max_tokens=2, **GREEDY))
    seq = llm.get_sequence(rid)
    llm.step()
    assert seq.num_cached_tokens == 6 and len(seq.block_table) == 3
    assert llm.last_step.describe({rid: "A"}) == "step 0 prefill (6 tokens): A[0:6]"
    llm.step()
    assert llm.last_step.describe({rid: "A"}) == "step 1 prefill (4 tokens): A[6:10]"
    finished = llm.step()
    assert llm.last_step.describe({rid: "A"}) == "step 2 decode (1 token): A[10:11]; finished A"
    assert [o.request_id for o in finished] == [rid] and not llm.has_unfinished_requests()
    with pytest.raises(KeyError, match="no unfinished request"):
        llm.get_sequence(rid)


def test_generate_keeps_outputs_of_requests_it_did_not_submit(hf_model, prompts):
    """generate() steps the whole engine: a request queued with add_request may finish inside
    it. Its output must wait in unclaimed_outputs."""
    a, b = prompts[2], prompts[3]
    llm = LLM(MODEL, **CPU, block_size=4, num_kvcache_blocks=32, attention_backend="torch")
    rid_a = llm.add_request(a, SamplingParams(max_tokens=2, **GREEDY))
    [out_b] = llm.generate([b], SamplingParams(max_tokens=4, **GREEDY), use_tqdm=False)
    assert out_b.token_ids == hf_greedy(hf_model, b, 4)
    assert list(llm.unclaimed_outputs) == [rid_a]              # a finished during generate
    assert llm.unclaimed_outputs.pop(rid_a).token_ids == hf_greedy(hf_model, a, 2)
    assert llm.is_finished()


def test_an_interrupted_generate_aborts_its_requests_and_keeps_the_others(hf_model, prompts, monkeypatch):
    """KeyboardInterrupt after a step: the requests generate submitted are aborted (blocks
    freed), a request queued by someone else stays and finishes in a later generate."""
    b, c, d = prompts[3], prompts[4], prompts[1]
    llm = LLM(MODEL, **CPU, block_size=4, num_kvcache_blocks=32, attention_backend="torch")
    rid_d = llm.add_request(d, SamplingParams(max_tokens=3, **GREEDY))
    real_step = llm.step

    def step_then_interrupt():
        real_step()
        raise KeyboardInterrupt

    monkeypatch.setattr(llm, "step", step_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        llm.generate([c], SamplingParams(max_tokens=2, **GREEDY), use_tqdm=False)
    monkeypatch.undo()
    assert list(llm.scheduler.waiting) + list(llm.scheduler.running) == [llm.get_sequence(rid_d)]
    [out_b] = llm.generate([b], SamplingParams(max_tokens=4, **GREEDY), use_tqdm=False)
    assert out_b.token_ids == hf_greedy(hf_model, b, 4)
    [(rid, out_d)] = llm.unclaimed_outputs.items()
    assert rid == rid_d and out_d.token_ids == hf_greedy(hf_model, d, 3)
    assert llm.is_finished() and llm.block_manager.num_free_blocks == 32


# ---------------------------------------------------------------- clear errors, nothing queued

@pytest.fixture(scope="module")
def small_llm():
    return LLM(MODEL, **CPU, block_size=4, num_kvcache_blocks=8, max_model_len=64, attention_backend="torch")


@pytest.mark.parametrize("prompt, message", [
    ([], "prompt is empty"),
    ("", "empty"),
    (list(range(3, 70)), "max_model_len"),
    ([5, 10**9], "vocabulary"),
    ([5, -1], "vocabulary"),
    ([5, 2.0], "vocabulary"),
    (list(range(3, 40)), "can never fit in the KV cache"),       # 37 tokens > 8 blocks x 4
])
def test_bad_prompts_raise_and_queue_nothing(small_llm, prompt, message):
    good = [7, 8, 9]
    with pytest.raises(ValueError, match=message):
        small_llm.generate([good, prompt], SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(ValueError, match=message):
        small_llm.add_request(prompt, SamplingParams(max_tokens=2))
    assert small_llm.is_finished() and not small_llm.scheduler.waiting
    assert small_llm.get_metrics().prompt_tokens == 0


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_tokens=0), "max_tokens"),
    (dict(temperature=-0.5), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
])
def test_bad_sampling_params_raise(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_bad_engine_settings_raise():
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(MODEL, **CPU, max_model_len=10**7, num_kvcache_blocks=8)
    with pytest.raises(ValueError, match="attention_backend"):
        LLM(MODEL, **CPU, attention_backend="cuda-magic", num_kvcache_blocks=8)
    with pytest.raises(ValueError, match="leaves room for no KV block"):
        LLM(MODEL, **CPU, kv_cache_memory_bytes=100)
    with pytest.raises(ValueError, match="block_size"):
        LLM(MODEL, **CPU, block_size=0, num_kvcache_blocks=8)
    with pytest.raises(ValueError, match="num_kvcache_blocks"):
        LLM(MODEL, **CPU, num_kvcache_blocks=0)
    llm = LLM(MODEL, **CPU, num_kvcache_blocks=8)
    with pytest.raises(TypeError, match="SamplingParams or a list of them, got dict"):
        llm.generate([5, 6], {"temperature": 0.0}, use_tqdm=False)
    with pytest.raises(ValueError, match="2 prompts but 1 sampling params"):
        llm.generate([[5, 6], [7]], [SamplingParams()], use_tqdm=False)
    assert llm.is_finished()


# ---------------------------------------------------------------- the model runner

def test_kv_cache_sized_from_a_byte_budget():
    llm = LLM(MODEL, **CPU, block_size=16, kv_cache_memory_bytes=3 * 2**20, attention_backend="torch")
    c, runner = llm.config, llm.model_runner
    block_bytes = 2 * c.num_hidden_layers * 16 * c.num_key_value_heads * c.head_dim * 4
    assert runner.block_bytes == block_bytes
    assert runner.num_kvcache_blocks == 3 * 2**20 // block_bytes == llm.block_manager.num_blocks
    assert runner.kv_cache.shape == (2, c.num_hidden_layers, runner.num_kvcache_blocks, 16,
                                     c.num_key_value_heads, c.head_dim)
    assert runner.kv_caches[1][0].data_ptr() == runner.kv_cache[0, 1].data_ptr()   # views, no copies


def test_prepare_builds_slots_block_tables_and_logit_rows():
    llm = LLM(MODEL, **CPU, block_size=4, num_kvcache_blocks=8, attention_backend="torch")
    chunk = Sequence(list(range(3, 13)), block_size=4)           # 10 tokens, blocks [5, 2, 7]
    chunk.block_table, chunk.num_cached_tokens, chunk.num_scheduled_tokens = [5, 2, 7], 3, 3
    decode = Sequence(list(range(3, 9)), block_size=4)          # 6 tokens, newest at position 5
    decode.block_table, decode.num_cached_tokens, decode.num_scheduled_tokens = [1, 6], 5, 1
    input_ids, positions, attn, logits_rows, sample_seqs = llm.model_runner.prepare([chunk, decode])
    assert input_ids.tolist() == [6, 7, 8, 8] and positions.tolist() == [3, 4, 5, 5]
    assert attn.slot_mapping.tolist() == [5 * 4 + 3, 2 * 4 + 0, 2 * 4 + 1, 6 * 4 + 1]
    assert attn.block_tables.tolist() == [[5, 2, 7], [1, 6, -1]]
    assert attn.context_lens.tolist() == [6, 6] and attn.cu_seqlens_q.tolist() == [0, 3, 4]
    assert (attn.max_q_len, attn.max_context_len) == (3, 6)
    assert logits_rows.tolist() == [3] and sample_seqs == [decode]   # the chunk samples nothing


# ---------------------------------------------------------------- the sampler

def test_sampler_greedy_temperature_and_top_p():
    sampler = Sampler(seed=0)
    logits = torch.tensor([[0.0, 2.0, 1.0, 2.0, -1.0]])
    greedy = Sequence([1], SamplingParams(temperature=0.0), block_size=16)
    assert sampler(logits, [greedy]) == [1]                       # ties go to the lowest id
    n = 4000
    hot = Sequence([1], SamplingParams(temperature=0.7), block_size=16)
    counts = torch.bincount(torch.tensor(sampler(logits.repeat(n, 1), [hot] * n)), minlength=5).float()
    probs = torch.softmax(logits[0] / 0.7, dim=0)
    assert torch.all((counts / n - probs).abs() < 4 * torch.sqrt(probs * (1 - probs) / n) + 1e-3)
    nucleus = Sequence([1], SamplingParams(temperature=1.0, top_p=0.6), block_size=16)
    tokens = set(sampler(logits.repeat(n, 1), [nucleus] * n))
    assert tokens == {1, 3}       # 1 and 3 hold 2 * 0.387 >= 0.6 of the mass; the rest never drawn
    kept = top_p_filter(torch.tensor([[0.5, 0.3, 0.2]]), torch.tensor([0.5]))
    assert kept.tolist() == [[0.5, 0.0, 0.0]]


def test_sampler_is_seeded_and_per_request_seeds_ignore_the_batch():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(3))
    seqs = [Sequence([1], SamplingParams(temperature=1.0), block_size=16) for _ in range(6)]
    assert Sampler(seed=7)(logits, seqs) == Sampler(seed=7)(logits, seqs)
    own = Sequence([1], SamplingParams(temperature=1.0, seed=42), block_size=16)
    alone = Sampler(seed=1)(logits[:1], [own])
    own2 = Sequence([1], SamplingParams(temperature=1.0, seed=42), block_size=16)
    in_batch = Sampler(seed=2)(logits[[1, 2, 0]], seqs[:2] + [own2])
    assert in_batch[2] == alone[0]


def test_seeded_generate_is_reproducible():
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=8, seed=5)
    first = LLM(MODEL, **CPU, num_kvcache_blocks=16).generate(["The"], params, use_tqdm=False)[0].token_ids
    second = LLM(MODEL, **CPU, num_kvcache_blocks=16).generate(["The"], params, use_tqdm=False)[0].token_ids
    assert first == second


def test_auto_backend_is_triton_on_cuda_and_torch_elsewhere():
    from course_pkg.engine.model_runner import resolve_backend
    assert resolve_backend("auto", torch.device("cpu")) == "torch"
    assert resolve_backend("auto", torch.device("cuda")) == "triton"
    assert resolve_backend("torch", torch.device("cuda")) == "torch"
    with pytest.raises(ValueError, match="attention_backend"):
        resolve_backend("flash", torch.device("cpu"))


def test_stop_tokens_come_from_config_and_generation_config(tmp_path):
    """A stop id listed only in generation_config.json ends generation, with reason "stop"."""
    import json
    from course_pkg.models import copy_default_model
    prompt = [5, 6, 7, 8]
    ref = LLM(MODEL, **CPU, num_kvcache_blocks=16).generate(prompt, SamplingParams(max_tokens=12, **GREEDY),
                                                            use_tqdm=False)[0].token_ids
    stop = next(i for i in range(2, 12) if ref[i] not in ref[:i] and 0 not in ref[:i + 1])
    path = copy_default_model(tmp_path / "model")
    gen = json.loads((path / "generation_config.json").read_text())
    gen["eos_token_id"] = [ref[stop], 0]
    (path / "generation_config.json").write_text(json.dumps(gen))
    llm = LLM(path, **CPU, num_kvcache_blocks=16)
    assert llm.scheduler.eos_token_ids == {0, ref[stop]}
    out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False)[0]
    assert out.token_ids == ref[:stop + 1] and out.finish_reason == "stop"
