"""A hybrid model on the engine (chapter 16): the blocks a window gives back, measured.

* the shipped hybrid tiny model (local layers 0 and 2, window 32) equals Hugging Face's greedy
  tokens, and its KV cache groups are what vLLM's rule makes of it;
* a sequence of 4,096 tokens in a window-128 group holds at most ``ceil(128 / block_size) + 1``
  blocks of that group at every step, while its full-attention group holds them all;
* at a fixed KV cache budget the largest batch that runs without a preemption -- measured on the
  engine, hybrid against the same model with the hybrid manager disabled -- is within 10% of what
  ``kv_cache_spec.max_num_requests`` predicts from the model's config alone.
"""
from __future__ import annotations

import math

import pytest
import torch

from course_pkg import LLM, SamplingParams
from course_pkg.hybrid_block_manager import NULL_BLOCK
from course_pkg.kv_cache_spec import kv_cache_groups, max_num_requests
from course_pkg.models import hybrid_model_path
from course_pkg.models.checkpoint import build_random_checkpoint

CPU = dict(device="cpu", dtype=torch.float32, attention_backend="torch")


def test_the_shipped_hybrid_model_equals_huggingface():
    from transformers import AutoModelForCausalLM

    path = hybrid_model_path()
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    assert hf.config.layer_types == ["sliding_attention", "full_attention"] * 2 and hf.config.sliding_window == 32
    llm = LLM(path, **CPU, block_size=8, num_kvcache_blocks=256)
    config = llm.kv_cache_config
    assert config.group_size == 2 and [g.layer_ids for g in config.kv_cache_groups] == [(1, 3), (0, 2)]
    assert config.sliding_windows == (32,) and config.padding_layers == 0
    prompts = [llm.tokenizer.encode(t) for t in ("The scheduler decides", "Prefix caching lets the second request",
                                                   "A block is")]
    outs = llm.generate(prompts, SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(prompts, outs):   # 48 new tokens: the window of 32 slides over each output
        ids = torch.tensor([prompt])
        with torch.no_grad():
            want = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=48,
                               eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()   # (no stop: ignore_eos)
        assert out.outputs[0].token_ids == want


@pytest.mark.parametrize("block_size", [16, 32])
def test_a_4096_token_sequence_holds_only_its_window_in_a_local_group(tmp_path, block_size):
    path = build_random_checkpoint(tmp_path / "m", seed=5, copy_tokenizer=False, vocab_size=256, hidden_size=32,
                                   intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                   num_key_value_heads=1, head_dim=16, max_position_embeddings=4608,
                                   use_sliding_window=True, sliding_window=128, max_window_layers=0,
                                   layer_types=["sliding_attention", "full_attention"])
    llm = LLM(path, **CPU, block_size=block_size, num_kvcache_blocks=2 * 4096 // block_size + 8)
    prompt = torch.randint(3, 256, (3968,), generator=torch.Generator().manual_seed(0)).tolist()
    request = llm.add_request(prompt, SamplingParams(max_tokens=129, temperature=0.0, ignore_eos=True))
    bound = -(-128 // block_size) + 1
    held_local, held_full, lengths = [], [], []
    while llm.has_unfinished_requests():
        llm.step()   # (between steps: every block a computed token is in, and the newest token's)
        if request in llm._requests:
            seq = llm.get_sequence(request)
            held_local.append(sum(1 for b in seq.group_block_tables[0] if b != NULL_BLOCK))
            held_full.append(len(seq.block_table))
            lengths.append(seq.num_tokens)
    assert lengths[-1] == 4096 and held_full[-1] == 4096 // block_size   # the full group: every block
    assert max(held_local) <= bound and held_local[-1] in (bound - 1, bound)
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks


def runs_without_preemption(path, budget: int, num_tokens: int, disable: bool, n: int) -> bool:
    """Do ``n`` requests of ``num_tokens`` (16 prompt tokens, the rest decoded) run side by side
    to the end without a preemption, in a cache of ``budget`` bytes? (One engine run.)"""
    llm = LLM(path, **CPU, block_size=16, kv_cache_memory_bytes=budget, max_num_seqs=n,
              disable_hybrid_kv_cache_manager=disable)
    prompts = [[5 + i % 100] * 16 for i in range(n)]
    llm.generate(prompts, SamplingParams(max_tokens=num_tokens - 16, temperature=0.0, ignore_eos=True),
                 use_tqdm=False)
    return llm.get_metrics().num_preemptions == 0


def test_the_largest_batch_at_fixed_memory_matches_the_formula():
    """The largest batch lies within 10% of the formula's, hybrid and all-full alike (so their
    ratio does too): 90% of the predicted batch runs without a preemption, 110% (and one) does not.
    (benchmarks/hybrid_kv.py bisects for the exact figure.)"""
    path = hybrid_model_path()
    llm = LLM(path, **CPU, num_kvcache_blocks=8)
    groups = kv_cache_groups(llm.config, 16, 4)
    num_tokens, budget = 160, 200 * 16 * 4 * 2 * 2 * 32 * 4   # 200 blocks of the all-full layout
    stored = num_tokens - 1   # the last sampled token is never fed back: its K/V are never stored
    predicted = {disable: max_num_requests(groups, stored, budget, all_full=disable) for disable in (False, True)}
    assert predicted[False] / predicted[True] > 1.4   # the hybrid layout's gain at this length
    for disable in (False, True):
        p = predicted[disable]
        assert runs_without_preemption(path, budget, num_tokens, disable, math.ceil(0.9 * p))
        assert not runs_without_preemption(path, budget, num_tokens, disable, math.floor(1.1 * p) + 1)


def test_a_layout_with_two_full_groups_equals_huggingface(tmp_path):
    """3 global and 2 local layers: vLLM's rule makes groups of 2, so the global layers fill two
    groups -- the second kept by a SlidingWindowManager without a window -- and one local group."""
    from transformers import AutoModelForCausalLM

    types = ["full_attention", "sliding_attention", "full_attention", "sliding_attention", "full_attention"]
    path = build_random_checkpoint(tmp_path / "m", seed=9, copy_tokenizer=False, vocab_size=300, hidden_size=32,
                                   intermediate_size=64, num_hidden_layers=5, num_attention_heads=2,
                                   num_key_value_heads=1, head_dim=16, max_position_embeddings=128,
                                   use_sliding_window=True, sliding_window=6, max_window_layers=0, layer_types=types)
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, attn_implementation="eager").eval()
    gen = torch.Generator().manual_seed(1)
    shared = torch.randint(3, 290, (10,), generator=gen).tolist()
    prompts = [shared + torch.randint(3, 290, (n,), generator=gen).tolist() for n in (3, 9, 14)]
    expected = []
    for p in prompts:
        ids = torch.tensor([p])
        with torch.no_grad():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=12,
                              eos_token_id=None, pad_token_id=0)
        expected.append(out[0, len(p):].tolist())
    llm = LLM(path, **CPU, block_size=4, num_kvcache_blocks=44, max_num_seqs=3)
    layout = llm.kv_cache_config
    assert [g.layer_ids for g in layout.kv_cache_groups] == [(0, 4), (2,), (1, 3)]
    assert layout.sliding_windows == (None, 6)
    for _ in range(2):
        outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == expected
    assert llm.get_metrics().prefix_cache_hits > 0
