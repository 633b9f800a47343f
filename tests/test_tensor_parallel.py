"""Tensor parallelism (chapter 10) against Hugging Face, against the formulas, and for leaks.

One 2-rank LLM serves the module (start-up costs seconds): its greedy tokens must equal
``transformers``' with prefix caching on and a pool small enough to preempt; each rank must
hold its share of the weights and half of the KV cache; the bytes it all-reduced must be what
the Megatron layout predicts, step by step and on every rank. Fresh interpreters check that
no worker outlives its LLM, however the LLM ends.
"""
from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from course_pkg import LLM, SamplingParams
from course_pkg.models import default_model_path, load_config
from tests.test_engine import hf_greedy, make_prompts, max_tokens_for

MODEL = default_model_path()
CPU = dict(device="cpu", dtype=torch.float32, attention_backend="torch")
GREEDY = dict(temperature=0.0, ignore_eos=True)
CHILD = Path(__file__).with_name("tp_child.py")
# 12 blocks of 8 tokens for prompts of up to 70 tokens: sequences preempt each other, and
# the prompts' shared 20- and 37-token prefixes hit the cache.
POOL = dict(block_size=8, num_kvcache_blocks=12, max_num_seqs=8)


@pytest.fixture(scope="module", autouse=True)
def one_thread(one_torch_thread):
    """One torch thread for this module (see conftest)."""


@pytest.fixture(scope="module")
def tp_llm(one_thread):
    with LLM(MODEL, **CPU, **POOL, tensor_parallel_size=2) as llm:
        yield llm


@pytest.fixture(scope="module")
def prompts():
    return make_prompts(load_config(MODEL).vocab_size)


def test_the_ranks_slices_put_together_are_the_checkpoint():
    """Loading needs no process group: each rank's slices, concatenated along the split
    dimension, must be the whole model's tensors (read by the single-device loader)."""
    from course_pkg.distributed import TensorParallelGroup, load_shard_model
    from course_pkg.models import load_model
    whole, config, _ = load_model(MODEL)
    shards = [dict(load_shard_model(MODEL, config, TensorParallelGroup(r, 2, "cpu"), torch.float32,
                                    "cpu").named_parameters()) for r in range(2)]
    for name, full in whole.named_parameters():
        parts = [s[name] for s in shards]
        if parts[0].shape == full.shape:
            assert all(torch.equal(p, full) for p in parts), name          # replicated
        else:
            dim = 0 if parts[0].shape[0] != full.shape[0] else 1
            assert torch.equal(torch.cat(parts, dim=dim), full), name
    split = {n for n, p in whole.named_parameters() if shards[0][n].shape != p.shape}
    assert {n.rsplit(".", 2)[-2] for n in split} == {"embed_tokens", "q_proj", "k_proj", "v_proj", "o_proj",
                                                      "gate_proj", "up_proj", "down_proj"}


def test_greedy_tokens_equal_huggingface_with_prefix_caching_and_preemption(tp_llm, hf_model, prompts):
    params = [SamplingParams(max_tokens=max_tokens_for(i), **GREEDY) for i in range(len(prompts))]
    outputs = tp_llm.generate(prompts, params, use_tqdm=False)
    for i, (prompt, out) in enumerate(zip(prompts, outputs)):
        assert out.token_ids == hf_greedy(hf_model, prompt, max_tokens_for(i)), f"prompt {i} differs from HF"
    m = tp_llm.get_metrics()
    assert m.num_preemptions > 0 and m.prefix_cache_hits > 0
    assert m.num_requests_running == m.num_requests_waiting == 0 and m.kv_cache_usage_perc == 0


def test_copy_on_write_of_a_forked_block_happens_on_every_rank(tp_llm, hf_model, prompts, monkeypatch):
    """Two greedy completions of one prompt share its partial last block; the first append
    copies it. Were the copy made on rank 0 only, rank 1 would attend over a block it never
    wrote and the tokens would leave Hugging Face's."""
    runner, copied = tp_llm.model_runner, []
    copy_blocks = runner.copy_blocks
    monkeypatch.setattr(runner, "copy_blocks", lambda pairs: (copied.extend(pairs), copy_blocks(pairs)))
    prompt = prompts[3]                                   # 9 tokens: a partial last block of 8
    out = tp_llm.generate([prompt], SamplingParams(n=2, max_tokens=6, **GREEDY), use_tqdm=False)[0]
    assert copied, "no block was copied on write"
    assert [c.token_ids for c in out.outputs] == [hf_greedy(hf_model, prompt, 6)] * 2


def test_beam_search_equals_hugging_face(tp_llm, prompts):
    """Beam search asks the runner for log-probabilities of every beam and copies blocks on
    write as beams fork: both go through the tensor-parallel runner."""
    from course_pkg.sampling_params import BeamSearchParams
    from tests.test_forks import hf_beams
    prompt = prompts[3]
    [out] = tp_llm.beam_search([prompt], BeamSearchParams(beam_width=2, max_tokens=6, ignore_eos=True))
    hf_seqs, hf_scores = hf_beams(MODEL, prompt, 2, 6, None)
    assert [s.tokens[len(prompt):] for s in out.sequences] == hf_seqs
    assert [s.score for s in out.sequences] == pytest.approx(hf_scores, abs=1e-4)


def test_each_rank_holds_its_share_of_weights_and_half_the_kv_cache(tp_llm):
    config = load_config(MODEL)
    replicated = whole = 0                      # counted from the checkpoint file itself
    with safe_open(str(MODEL / "model.safetensors"), framework="pt") as f:
        for name in f.keys():
            n = f.get_slice(name).get_shape()
            size = 4 * torch.Size(n).numel()    # float32
            whole += size
            replicated += size if "norm" in name else 0
    kv_whole = (2 * config.num_hidden_layers * POOL["num_kvcache_blocks"] * POOL["block_size"]
                * config.num_key_value_heads * config.head_dim * 4)
    reports = tp_llm.model_runner.report()
    assert [r.rank for r in reports] == [0, 1]
    for r in reports:
        assert r.weight_bytes == replicated + (whole - replicated) // 2
        assert r.kv_cache_bytes == kv_whole // 2
    assert [r.kv_heads for r in reports] == [(0, 1), (1, 2)]
    assert [r.vocab for r in reports] == [(0, 512), (512, 1024)]


def test_bytes_all_reduced_match_the_formula_on_every_rank(tp_llm, prompts):
    tp_llm.generate(prompts[:3], SamplingParams(max_tokens=3, **GREEDY), use_tqdm=False)
    config = load_config(MODEL)
    per_token = (2 * config.num_hidden_layers + 1) * config.hidden_size * 4   # 2 per layer + embedding
    log = tp_llm.model_runner.step_log
    assert log and all(counted == tokens * per_token for tokens, counted in log)
    total = sum(counted for _, counted in log)
    calls = (2 * config.num_hidden_layers + 1) * len(log)
    assert [(r.all_reduce_bytes, r.all_reduce_calls) for r in tp_llm.model_runner.report()] == [(total, calls)] * 2


def test_one_step_traced_on_both_ranks_has_the_same_block_tables(tp_llm):
    runner = tp_llm.model_runner
    runner.trace_next_step()
    tp_llm.generate([[3, 700, 9, 1000, 4]], SamplingParams(max_tokens=1, **GREEDY), use_tqdm=False)
    rank0, rank1 = (r.trace for r in runner.report())
    assert rank0[0] == rank1[0] and rank0[0].startswith("step of 5 token(s): block_tables [[")
    assert "KV heads [0, 1)" in rank0[1] and "KV heads [1, 2)" in rank1[1]
    assert "3 of 5 tokens" in rank0[2] and "2 of 5 tokens" in rank1[2]
    reduces = [line for line in rank0 if "all_reduce" in line]
    assert len(reduces) == 2 * load_config(MODEL).num_hidden_layers + 1
    assert reduces == [line for line in rank1 if "all_reduce" in line]
    assert rank0[-1].startswith("sampled [") and not any("sampled" in line for line in rank1)


@pytest.mark.parametrize("size, message", [
    (0, "integer >= 1"), (-2, "integer >= 1"), (2.0, "integer >= 1"), ("2", "integer >= 1"), (True, "integer >= 1"),
    (3, "does not divide the model's num_attention_heads=4"),
])
def test_bad_tensor_parallel_sizes_raise_and_start_nothing(monkeypatch, size, message):
    monkeypatch.setattr(os, "cpu_count", lambda: 8)        # the device limit is not what fails here
    before = {p.pid for p in multiprocessing.active_children()}
    with pytest.raises(ValueError, match=message):
        LLM(MODEL, **CPU, num_kvcache_blocks=8, tensor_parallel_size=size)
    assert {p.pid for p in multiprocessing.active_children()} == before


def test_a_broken_checkpoint_is_refused_before_any_process_starts(tmp_path):
    (tmp_path / "config.json").write_bytes((MODEL / "config.json").read_bytes())    # no weights
    before = {p.pid for p in multiprocessing.active_children()}
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        LLM(tmp_path, **CPU, num_kvcache_blocks=8, tensor_parallel_size=2)
    assert {p.pid for p in multiprocessing.active_children()} == before


def test_more_ranks_than_cpu_cores_is_refused(monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 1)
    with pytest.raises(ValueError, match=r"more than this machine's 1 CPU core"):
        LLM(MODEL, **CPU, num_kvcache_blocks=8, tensor_parallel_size=2)


def run_child(mode: str) -> tuple[int, list[list[str]], str]:
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    done = subprocess.run([sys.executable, str(CHILD), mode], capture_output=True, text=True, timeout=120, env=env)
    return done.returncode, [line.split() for line in done.stdout.splitlines()], done.stderr


def is_running(pid: int) -> bool:
    """A zombie (exited, not yet reaped by its new parent) counts as gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_no_worker_outlives_its_llm():
    """Closed by ``with``; interrupted mid-step then closed; left open at interpreter exit."""
    code, lines, stderr = run_child("lifecycle")
    assert code == 0, stderr
    pids = [int(p) for line in lines if line[0] == "PIDS" for p in line[1:]]
    assert len(pids) == 3
    assert ["ALIVE", "after", "with", "False"] in lines and ["EXITCODES", "0"] in lines   # a clean exit
    assert ["INTERRUPTED"] in lines and ["ALIVE", "after", "close", "False"] in lines
    error = next(" ".join(line) for line in lines if line[0] == "ERROR")
    assert "interrupted half-way" in error and "close()" in error
    closed = next(" ".join(line) for line in lines if line[0] == "CLOSED")
    assert "this LLM is closed" in closed and closed.endswith("free True queued 0")
    tokens = [line for line in lines if line[0] == "TOKENS"]
    assert len(tokens) == 2 and tokens[0] == tokens[1]      # the third group works like the first
    assert not any(is_running(p) for p in pids)


def test_workers_end_when_rank_0_is_killed():
    code, lines, _ = run_child("kill")
    assert code == -9
    pids = [int(p) for line in lines if line[0] == "PIDS" for p in line[1:]]
    assert len(pids) == 1
    deadline = time.monotonic() + 10
    while any(is_running(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(is_running(p) for p in pids)
