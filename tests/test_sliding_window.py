"""Local (sliding-window) attention layers (chapter 16, first part): the model and the kernels.

A query at position ``i`` of a ``sliding_attention`` layer sees positions ``i - w + 1 .. i`` --
Hugging Face's bound (``kv_idx > q_idx - sliding_window``). Checked three ways: the float64
reference against dense attention written out here; the torch path and the Triton kernel (under
the interpreter: it skips the blocks before a tile's window) against the reference, for decode,
whole prompts and chunks over a cached prefix; and the engine's greedy tokens on an unseen random
*hybrid* Qwen3 (local and global layers interleaved, a window shorter than the prompts and decodes
that cross it) against Hugging Face's, on its KV cache groups (one full-attention group and three
local ones that give back the blocks leaving their window; ``HybridBlockManager``), with prefix
caching, chunked prefill, preemption by recompute and by swap, mixed steps with same-step hits, n-gram speculation, ``n = 2``
forks, block size 1, the reference backend -- and with the hybrid manager disabled (every layer's
cache kept whole), as vLLM runs when its hybrid manager is off.
"""
from __future__ import annotations

import pytest
import torch

from course_pkg import LLM, SamplingParams
from course_pkg.kernels.reference import gather_kv, paged_attention_ref
from course_pkg.models.attention import AttentionMetadata, paged_attention_torch
from course_pkg.models.checkpoint import build_random_checkpoint
from tests.test_kernels import make_case

WINDOWS = [1, 3, 4, 7, 40]


def dense(args, window):
    """Attention written out position by position: every (query, key) pair the window allows."""
    q, kc, vc, bt = args["q"].double(), args["k_cache"], args["v_cache"], args["block_tables"]
    cu, ctxs = args["cu_seqlens_q"].tolist(), args["context_lens"].tolist()
    group = q.shape[1] // kc.shape[2]
    out = torch.zeros_like(q)
    for s, ctx in enumerate(ctxs):
        k, v = gather_kv(kc, bt[s], ctx).double(), gather_kv(vc, bt[s], ctx).double()
        q_len = cu[s + 1] - cu[s]
        for r in range(q_len):
            pos = ctx - q_len + r
            keys = [j for j in range(ctx) if j <= pos and (window is None or j > pos - window)]
            for h in range(q.shape[1]):
                kh, vh = k[keys, h // group], v[keys, h // group]
                w = torch.softmax(kh @ q[cu[s] + r, h] * args["scale"], dim=0)
                out[cu[s] + r, h] = w @ vh
    return out


def case(seed=0, dtype=torch.float32):
    # decode, a whole prompt, a chunk over a cached prefix; contexts across block boundaries
    return make_case(seed, dtype=dtype, block_size=4, context_lens=[19, 9, 23], q_lens=[1, 9, 6])


@pytest.mark.parametrize("window", WINDOWS + [None])
def test_the_reference_is_dense_attention_within_the_window(window):
    args = case()
    got = paged_attention_ref(**args, sliding_window=window).double()
    torch.testing.assert_close(got, dense(args, window), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", WINDOWS)
def test_the_torch_path_equals_the_reference(window):
    args = case(1)
    attn = AttentionMetadata(slot_mapping=torch.zeros(0, dtype=torch.long), block_tables=args["block_tables"],
                             context_lens=args["context_lens"], cu_seqlens_q=args["cu_seqlens_q"],
                             max_q_len=9, max_context_len=23)
    got = paged_attention_torch(args["q"], args["k_cache"], args["v_cache"], attn, args["scale"],
                                sliding_window=window)
    torch.testing.assert_close(got, paged_attention_ref(**args, sliding_window=window), rtol=1e-4, atol=1e-4)
    if window < 19:   # the window really hides something: the full answer differs
        assert not torch.allclose(got, paged_attention_ref(**args), atol=1e-3)


@pytest.mark.parametrize("window, num_splits", [(3, 1), (7, 2), (1, 3)])
def test_the_triton_kernel_equals_the_reference(window, num_splits):
    from course_pkg.kernels.triton_kernels import launch_paged_attention

    args = case(2)
    out = torch.full_like(args["q"], float("nan"))
    launch_paged_attention(out, args["q"], args["k_cache"], args["v_cache"], args["block_tables"],
                           args["context_lens"], args["cu_seqlens_q"], args["scale"], max_q_len=9,
                           num_splits=num_splits, sliding_window=window)
    torch.testing.assert_close(out, paged_attention_ref(**args, sliding_window=window), rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------- the engine against Hugging Face

LAYERS = ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"]


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    """An unseen random hybrid Qwen3: three local layers of window 8 and one global one."""
    path = build_random_checkpoint(tmp_path_factory.mktemp("hybrid"), seed=16, copy_tokenizer=False,
                                   vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                   max_position_embeddings=256, use_sliding_window=True, sliding_window=8,
                                   max_window_layers=0, layer_types=LAYERS)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, attn_implementation="eager").eval()
    assert model.config.layer_types == LAYERS and model.config.sliding_window == 8
    return path, model


@pytest.fixture(scope="module")
def prompts_and_expected(hybrid):
    _, model = hybrid
    gen = torch.Generator().manual_seed(3)
    shared = torch.randint(3, 512, (13,), generator=gen).tolist()
    prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (5, 9, 17, 30)]
    prompts += [shared + torch.randint(3, 512, (n,), generator=gen).tolist() for n in (2, 11)]
    phrase = torch.randint(3, 512, (3,), generator=gen).tolist()
    prompts += [phrase * 5, [7, 8] + phrase * 4]   # a repeated phrase: n-gram drafts have something to match
    return prompts, hf_greedy(model, prompts, 14)


def hf_greedy(model, prompts, max_new_tokens):
    """Hugging Face's greedy continuation of each prompt, one at a time."""
    expected = []
    for p in prompts:
        ids = torch.tensor([p])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=max_new_tokens, pad_token_id=0)
        expected.append(out[0, len(p):].tolist())
    return expected


NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
CONFIGS = {
    "prefix-caching": dict(block_size=4, num_kvcache_blocks=64, max_num_seqs=3),
    "chunked-prefill": dict(block_size=4, num_kvcache_blocks=64, max_num_batched_tokens=7),
    "preemption": dict(block_size=4, num_kvcache_blocks=44, max_num_seqs=6),
    "swap-preemption": dict(block_size=4, num_kvcache_blocks=44, max_num_seqs=6, preemption_mode="swap",
                            num_cpu_blocks=40),
    "block-size-1": dict(block_size=1, num_kvcache_blocks=2000),
    "mixed-same-step-hits": dict(block_size=4, num_kvcache_blocks=64, scheduling="mixed", max_num_batched_tokens=9,
                                 same_step_prefix_hits=True),
    "ngram-speculation": dict(block_size=4, num_kvcache_blocks=48, max_num_seqs=4, speculative_config=NGRAM),
    "n=2-forks": dict(block_size=4, num_kvcache_blocks=64, max_num_seqs=6),
    "reference-backend": dict(block_size=4, num_kvcache_blocks=64, max_num_seqs=3, attention_backend="reference"),
    "hybrid-manager-disabled": dict(block_size=4, num_kvcache_blocks=64, disable_hybrid_kv_cache_manager=True),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_tokens_on_a_hybrid_model_equal_huggingface(hybrid, prompts_and_expected, name):
    path, _ = hybrid
    prompts, expected = prompts_and_expected
    llm = LLM(path, device="cpu", dtype=torch.float32, **{"attention_backend": "torch", **CONFIGS[name]})
    assert [layer.self_attn.sliding_window for layer in llm.model.model.layers] == [8, None, 8, 8]
    groups = llm.kv_cache_config.kv_cache_groups
    if name == "hybrid-manager-disabled":
        assert len(groups) == 1 and type(llm.block_manager).__name__ == "BlockManager"
    else:   # one full-attention group and three local ones of one layer each
        assert [g.sliding_window for g in groups] == [None, 8, 8, 8] and llm.kv_cache_config.group_size == 1
    n = 2 if name == "n=2-forks" else 1
    params = SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True, n=n)
    for _ in range(2):   # the second pass hits the prefix cache
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert [[c.token_ids for c in o.outputs] for o in outputs] == [[e] * n for e in expected]
    metrics = llm.get_metrics()
    assert metrics.prefix_cache_hits > 0 or not llm.engine_config.enable_prefix_caching
    if name in ("preemption", "swap-preemption"):
        assert metrics.num_preemptions > 0
    if name == "swap-preemption":
        assert llm.scheduler.stats.num_swapped_in > 0
    if name == "ngram-speculation":
        assert metrics.spec_decode_num_draft_tokens > 0
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks   # every block given back


def test_accepted_drafts_on_a_hybrid_model_keep_the_tokens_of_huggingface(hybrid, prompts_and_expected):
    """Longer outputs, so that some n-gram drafts are accepted (a random model rarely repeats
    itself in 14 tokens): the lookahead slots of every group keep the accepted drafts' K/V."""
    path, model = hybrid
    prompts, _ = prompts_and_expected
    expected = hf_greedy(model, prompts, 40)
    llm = LLM(path, device="cpu", dtype=torch.float32, attention_backend="torch", block_size=4,
              num_kvcache_blocks=96, max_num_seqs=4, speculative_config=NGRAM)
    outputs = llm.generate(prompts, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert llm.get_metrics().spec_decode_num_accepted_tokens > 0


def test_an_unknown_layer_type_is_refused_by_name(tmp_path):
    import json

    path = build_random_checkpoint(tmp_path / "m", seed=0, copy_tokenizer=False, vocab_size=64, hidden_size=32,
                                   intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                   num_key_value_heads=1, head_dim=16)
    config = json.loads((path / "config.json").read_text())
    config["layer_types"] = ["full_attention", "chunked_attention"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="chunked_attention"):
        LLM(path, device="cpu", dtype=torch.float32, num_kvcache_blocks=8)


def given_back(args, window):
    """``args`` as a hybrid model's local group leaves them: each sequence's blocks wholly before its
    first query's window are -1 in its table, and their memory holds NaN (another group's, or no
    one's): any read of them poisons the output."""
    from course_pkg.kernels.reference import window_first_block

    args = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in args.items()}
    block_size = args["k_cache"].shape[1]
    cu, ctxs = args["cu_seqlens_q"].tolist(), args["context_lens"].tolist()
    gone = 0
    for s, ctx in enumerate(ctxs):
        first = window_first_block(ctx - (cu[s + 1] - cu[s]), window, block_size)
        for j in range(first):
            block = int(args["block_tables"][s, j])
            args["k_cache"][block] = float("nan")
            args["v_cache"][block] = float("nan")
            args["block_tables"][s, j] = -1
            gone += 1
    assert gone > 0, "test setup: the window should leave blocks behind"
    return args


@pytest.mark.parametrize("window", [3, 7])
def test_blocks_given_back_before_the_window_are_never_read(window):
    """The three paths on a table with -1 (and NaN memory) before each window give what the
    reference gives on the whole table: the Triton kernel, the torch path, the reference itself."""
    from course_pkg.kernels.triton_kernels import launch_paged_attention

    args = case(3)
    want = paged_attention_ref(**args, sliding_window=window)
    gone = given_back(args, window)
    torch.testing.assert_close(paged_attention_ref(**gone, sliding_window=window), want, rtol=1e-5, atol=1e-5)
    attn = AttentionMetadata(slot_mapping=torch.zeros(0, dtype=torch.long), block_tables=gone["block_tables"],
                             context_lens=gone["context_lens"], cu_seqlens_q=gone["cu_seqlens_q"],
                             max_q_len=9, max_context_len=23)
    torch.testing.assert_close(paged_attention_torch(gone["q"], gone["k_cache"], gone["v_cache"], attn, gone["scale"],
                                                     sliding_window=window), want, rtol=1e-4, atol=1e-4)
    out = torch.full_like(gone["q"], float("nan"))
    launch_paged_attention(out, gone["q"], gone["k_cache"], gone["v_cache"], gone["block_tables"],
                           gone["context_lens"], gone["cu_seqlens_q"], gone["scale"], max_q_len=9, num_splits=2,
                           sliding_window=window)
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)


def test_beam_search_on_the_hybrid_groups_equals_the_whole_cache(hybrid):
    """Beams fork and drop every step: on the KV cache groups they rank the same hypotheses as on
    one group of every layer (the hybrid manager disabled: the cache that equals HF elsewhere)."""
    from course_pkg.sampling_params import BeamSearchParams

    path, _ = hybrid
    prompt = torch.randint(3, 512, (11,), generator=torch.Generator().manual_seed(8)).tolist()
    params = BeamSearchParams(beam_width=3, max_tokens=16)
    results = []
    for disable in (False, True):
        llm = LLM(path, device="cpu", dtype=torch.float32, attention_backend="torch", block_size=4,
                  num_kvcache_blocks=120, disable_hybrid_kv_cache_manager=disable)
        out = llm.beam_search([prompt], params)[0]
        results.append([(s.tokens, round(s.cum_logprob, 4)) for s in out.sequences])
        assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks
    assert results[0] == results[1] and len(results[0]) == 3
