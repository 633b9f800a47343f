"""The Qwen3 model on the paged cache against Hugging Face transformers (the oracle).

A small paged "runner" here hands out blocks from a shuffled pool, so block tables are never
contiguous; the model's logits through it must equal ``Qwen3ForCausalLM``'s on the same
checkpoint folder, for prefill, chunked prefill over a cached prefix, mixed steps and decode.
"""
from __future__ import annotations

import json
import random
import re

import pytest
import torch
from hypothesis import given, settings, strategies as st
from safetensors.torch import load_file, save_file

from course_pkg.kernels.reference import paged_attention_ref, store_kvcache_ref
from course_pkg.models import (AttentionMetadata, build_random_checkpoint, copy_default_model,
                               default_model_path, load_model)
from course_pkg.models.qwen3 import Qwen3ForCausalLM
from course_pkg.models.attention import paged_attention_torch, store_kvcache_torch

ATOL = 2e-4   # float32 logits of magnitude ~10-20 after a few layers; observed error ~1e-5

SMALL = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512)


@pytest.fixture(scope="module", autouse=True)
def one_thread(one_torch_thread):
    """One torch thread for this module (see conftest)."""


@pytest.fixture(scope="module")
def hf_logging_quiet():
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()


@pytest.fixture(scope="module", params=["tiny-default", "random-tied", "random-untied-bias"])
def checkpoint(request, tmp_path_factory, hf_logging_quiet):
    """(our model, config, HF model) for one checkpoint folder."""
    from transformers import AutoModelForCausalLM
    if request.param == "tiny-default":
        path = default_model_path()
    elif request.param == "random-tied":
        path = build_random_checkpoint(tmp_path_factory.mktemp("tied"), seed=1, **SMALL)
    else:
        path = build_random_checkpoint(tmp_path_factory.mktemp("untied"), seed=2,
                                       tie_word_embeddings=False, attention_bias=True, **SMALL)
    model, config, _ = load_model(path)
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    return model, config, hf


class PagedRun:
    """A minimal model runner: a shuffled block pool, block tables, slot mappings."""

    def __init__(self, model, config, block_size, num_blocks=256, seed=0, backend="torch"):
        self.model, self.block_size, self.backend = model, block_size, backend
        shape = (num_blocks, block_size, config.num_key_value_heads, config.head_dim)
        self.kv_caches = [(torch.full(shape, float("nan")), torch.full(shape, float("nan")))
                          for _ in range(config.num_hidden_layers)]  # NaN: reading junk shows
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)
        self.tables: dict[int, list[int]] = {}
        self.lengths: dict[int, int] = {}

    def step(self, chunks: dict[int, list[int]]) -> torch.Tensor:
        """Run the new tokens of each sequence in one flat batch; logits ``[N, vocab]``."""
        ids, positions, slots, tables, ctx, cu = [], [], [], [], [], [0]
        for seq, tokens in chunks.items():
            table = self.tables.setdefault(seq, [])
            start = self.lengths.get(seq, 0)
            for pos in range(start, start + len(tokens)):
                if pos // self.block_size == len(table):
                    table.append(self.free.pop())
                slots.append(table[pos // self.block_size] * self.block_size + pos % self.block_size)
                positions.append(pos)
            ids += tokens
            self.lengths[seq] = start + len(tokens)
            tables.append(table)
            ctx.append(self.lengths[seq])
            cu.append(cu[-1] + len(tokens))
        width = max(len(t) for t in tables)
        attn = AttentionMetadata(
            slot_mapping=torch.tensor(slots), context_lens=torch.tensor(ctx, dtype=torch.int32),
            block_tables=torch.tensor([t + [-1] * (width - len(t)) for t in tables], dtype=torch.int32),
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32),
            max_q_len=max(len(t) for t in chunks.values()), max_context_len=max(ctx),
            backend=self.backend)
        hidden = self.model(torch.tensor(ids, dtype=torch.long), torch.tensor(positions), attn,
                            self.kv_caches)
        return self.model.compute_logits(hidden)


def hf_logits(hf, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0]


def random_prompts(vocab, lengths, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("backend", ["torch", "reference"])
def test_prefill_logits_match_hf(checkpoint, backend):
    model, config, hf = checkpoint
    prompts = random_prompts(config.vocab_size, [1, 7, 16, 33, 70], seed=0)
    run = PagedRun(model, config, block_size=4, backend=backend)
    logits = run.step(dict(enumerate(prompts)))
    expected = torch.cat([hf_logits(hf, p) for p in prompts])
    torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("block_size", [1, 3, 16])
def test_chunked_prefill_then_decode_match_hf_at_every_position(checkpoint, block_size):
    """Prefill in chunks (the later ones attend to a cached prefix), mixed with decodes of
    other sequences, then batched token-by-token decode: every row equals HF's logits for
    the same position of the full sequence."""
    model, config, hf = checkpoint
    seqs = random_prompts(config.vocab_size, [16, 30, 45], seed=block_size)
    full = {i: hf_logits(hf, s) for i, s in enumerate(seqs)}
    run = PagedRun(model, config, block_size, seed=block_size)
    done = {0: 0, 1: 0, 2: 0}
    schedule = [{0: 5, 1: 10}, {0: 4, 1: 12, 2: 1}, {0: 1, 1: 8, 2: 20}]   # mixed steps
    schedule += [{0: 1, 1: 0, 2: 1}] * 2 + [{0: 1, 2: 22}] + [{0: 1}]   # seq 1 done, 2 done
    for plan in schedule:
        chunks = {i: seqs[i][done[i]:done[i] + n] for i, n in plan.items() if n}
        logits = run.step(chunks)
        rows = 0
        for i, tokens in chunks.items():
            expected = full[i][done[i]:done[i] + len(tokens)]
            torch.testing.assert_close(logits[rows:rows + len(tokens)], expected, atol=ATOL, rtol=0)
            rows += len(tokens)
            done[i] += len(tokens)
    # decode the remaining tokens of every sequence, all in one batch per step
    while any(done[i] < len(s) for i, s in enumerate(seqs)):
        chunks = {i: [seqs[i][done[i]]] for i in done if done[i] < len(seqs[i])}
        logits = run.step(chunks)
        for row, i in enumerate(chunks):
            torch.testing.assert_close(logits[row], full[i][done[i]], atol=ATOL, rtol=0)
            done[i] += 1


def test_greedy_decode_through_the_cache_equals_hf_generate(checkpoint):
    model, config, hf = checkpoint
    prompts = random_prompts(config.vocab_size, [3, 11, 20], seed=7)
    run = PagedRun(model, config, block_size=4)
    logits = run.step(dict(enumerate(prompts)))
    last = logits[torch.tensor([len(p) for p in prompts]).cumsum(0) - 1]
    outputs = {i: [] for i in range(len(prompts))}
    for _ in range(12):
        for i, token in enumerate(last.argmax(-1).tolist()):
            outputs[i].append(token)
        last = run.step({i: out[-1:] for i, out in outputs.items()})
    for i, prompt in enumerate(prompts):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                              eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        assert outputs[i] == ref


def test_triton_backend_matches_hf_under_the_interpreter():
    """The chapter-05 kernels as the model's attention (Triton's CPU interpreter here, the
    GPU elsewhere): a short prefill with a cached prefix, then two decode steps."""
    model, config, _ = load_model()
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(str(default_model_path()), dtype=torch.float32).eval()
    seqs = random_prompts(config.vocab_size, [9, 6], seed=11)
    full = {i: hf_logits(hf, s) for i, s in enumerate(seqs)}
    run = PagedRun(model, config, block_size=4, num_blocks=16, backend="triton")
    for plan in [{0: (0, 5), 1: (0, 4)}, {0: (5, 8), 1: (4, 5)}, {0: (8, 9), 1: (5, 6)}]:
        logits = run.step({i: seqs[i][a:b] for i, (a, b) in plan.items()})
        expected = torch.cat([full[i][a:b] for i, (a, b) in plan.items()])
        torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0)


def test_without_cache_equals_with_cache(checkpoint):
    model, config, _ = checkpoint
    prompts = random_prompts(config.vocab_size, [5, 9], seed=3)
    run = PagedRun(model, config, block_size=4)
    with_cache = run.step(dict(enumerate(prompts)))
    attn = AttentionMetadata(torch.full((14,), -1), torch.full((2, 1), -1, dtype=torch.int32),
                             torch.tensor([5, 9]), torch.tensor([0, 5, 14]), 9, 9)
    positions = torch.tensor(list(range(5)) + list(range(9)))
    no_cache = model.compute_logits(model(torch.tensor(prompts[0] + prompts[1]), positions, attn, None))
    torch.testing.assert_close(no_cache, with_cache, atol=1e-5, rtol=0)


# --- the vectorized torch path against the reference, on random layouts ---------------------

@settings(max_examples=40, deadline=None)
@given(data=st.data(), block_size=st.sampled_from([1, 2, 3, 4, 16]), group=st.sampled_from([1, 2, 4]),
       num_seqs=st.integers(1, 5), dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_torch_paged_attention_equals_reference(data, block_size, group, num_seqs, dtype):
    kv_heads, dim = 2, 8
    ctx = [data.draw(st.integers(1, 40)) for _ in range(num_seqs)]
    q_lens = [data.draw(st.integers(0, c)) for c in ctx]   # 0 = sequence not in this step
    num_blocks = sum((c + block_size - 1) // block_size for c in ctx) + 3
    perm = data.draw(st.permutations(range(num_blocks)))
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    tables, pos = [], 0
    for c in ctx:
        n = (c + block_size - 1) // block_size
        tables.append(list(perm[pos:pos + n]))
        pos += n
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [-1] * (width - len(t)) for t in tables], dtype=torch.int32)
    total = sum(q_lens)
    slots = [t[p // block_size] * block_size + p % block_size
             for t, c, q in zip(tables, ctx, q_lens) for p in range(c - q, c)]
    slot_mapping = torch.tensor(slots, dtype=torch.long).reshape(-1)
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    k_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=g).to(dtype)
    q = torch.randn(total, kv_heads * group, dim, generator=g).to(dtype)
    key = torch.randn(total, kv_heads, dim, generator=g).to(dtype)
    value = torch.randn(total, kv_heads, dim, generator=g).to(dtype)
    attn = AttentionMetadata(slot_mapping, block_tables, torch.tensor(ctx, dtype=torch.int32), cu,
                             max(q_lens), max(ctx))
    caches = [(k_cache.clone(), v_cache.clone()) for _ in range(2)]
    store_kvcache_ref(key, value, *caches[0], slot_mapping)
    store_kvcache_torch(key, value, *caches[1], slot_mapping)
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])
    expected = paged_attention_ref(q, *caches[0], block_tables, attn.context_lens, cu, dim ** -0.5)
    got = paged_attention_torch(q, *caches[1], attn, dim ** -0.5, key, value)
    tol = 1e-5 if dtype == torch.float32 else 3e-2     # bf16 keeps ~3 significant digits
    assert got.dtype == dtype
    torch.testing.assert_close(got, expected, atol=tol, rtol=tol)


def test_store_skips_padding_slots():
    k_cache, v_cache = torch.zeros(2, 2, 1, 1), torch.zeros(2, 2, 1, 1)
    key = torch.tensor([1.0, 2.0, 3.0]).view(3, 1, 1)
    store_kvcache_torch(key, -key, k_cache, v_cache, torch.tensor([3, -1, 0]))
    assert k_cache.flatten().tolist() == [3.0, 0.0, 0.0, 1.0]
    assert v_cache.flatten().tolist() == [-3.0, 0.0, 0.0, -1.0]


# --- the shipped default model ---------------------------------------------------------------

def test_default_model_is_a_plain_hf_folder(hf_logging_quiet):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    path = default_model_path()
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == "qwen3" and config["tie_word_embeddings"] is True
    assert "rope_parameters" in config
    weights = load_file(str(path / "model.safetensors"))
    assert "lm_head.weight" not in weights
    assert sum(f.stat().st_size for f in path.iterdir()) < 8 * 2**20
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    assert tokenizer.eos_token_id == config["eos_token_id"] == tokenizer.pad_token_id
    text = "Each request keeps a block table."
    assert tokenizer.decode(tokenizer.encode(text)) == text
    model = AutoModelForCausalLM.from_pretrained(str(path))
    assert model.config.num_key_value_heads < model.config.num_attention_heads   # GQA


def test_default_model_greedy_output_is_varied_text():
    model, config, tokenizer = load_model()
    prompt = tokenizer.encode("The block manager")
    run = PagedRun(model, config, block_size=16)
    logits, out = run.step({0: prompt}), []
    for _ in range(24):
        token = int(logits[-1].argmax())
        if token == config.eos_token_id:
            break
        out.append(token)
        logits = run.step({0: [token]})
    assert len(set(out)) >= 8, tokenizer.decode(out)         # not one token repeated
    words = tokenizer.decode(out).split()
    assert sum(w.strip(".,:").isalpha() for w in words) >= 0.8 * len(words)


# --- the loader refuses what it cannot read safely --------------------------------------------

def test_loader_rejects_a_folder_without_safetensors(tmp_path):
    folder = copy_default_model(tmp_path / "m")
    (folder / "model.safetensors").unlink()
    (folder / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors.*pytorch_model.bin.*pickle"):
        load_model(folder)


def test_loader_rejects_other_architectures_and_missing_folders(tmp_path):
    folder = copy_default_model(tmp_path / "m")
    config = json.loads((folder / "config.json").read_text())
    config["model_type"] = "llama"
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="model_type is 'llama'"):
        load_model(folder)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(tmp_path / "nowhere")


def test_loader_names_missing_and_misshapen_weights(tmp_path):
    folder = copy_default_model(tmp_path / "m")
    weights = load_file(str(folder / "model.safetensors"))
    name = "model.layers.0.mlp.up_proj.weight"
    save_file({k: v for k, v in weights.items() if k != name}, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match=f"missing \\['{name}'\\]"):
        load_model(folder)
    weights[name] = weights[name][:, :-1].contiguous()
    save_file(weights, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match=f"{name} has shape"):
        load_model(folder)


def _edit_config(folder, **changes):
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))


@pytest.fixture
def no_allocation(monkeypatch):
    """Make materialising a model fail loudly: a refusal must come before any memory is spent."""
    def to_empty(self, *args, **kwargs):
        raise AssertionError("the model was allocated before the checkpoint was checked")
    monkeypatch.setattr(Qwen3ForCausalLM, "to_empty", to_empty)


def test_a_checkpoint_split_over_two_files_loads_the_same_weights(tmp_path):
    folder = copy_default_model(tmp_path / "m")
    weights = load_file(str(folder / "model.safetensors"))
    names = sorted(weights)
    (folder / "model.safetensors").unlink()
    save_file({k: weights[k] for k in names[::2]}, str(folder / "model-00001-of-00002.safetensors"))
    save_file({k: weights[k] for k in names[1::2]}, str(folder / "model-00002-of-00002.safetensors"))
    model, _, _ = load_model(folder)
    params = dict(model.named_parameters())
    assert sorted(params) == names
    assert all(torch.equal(params[k], weights[k]) for k in names)


def test_loader_refuses_a_tensor_stored_in_two_files_naming_both(tmp_path, no_allocation):
    folder = copy_default_model(tmp_path / "m")
    name = "model.norm.weight"
    save_file({name: torch.zeros(128)}, str(folder / "extra.safetensors"))  # a stray second file
    with pytest.raises(ValueError, match=f"'{name}' is in both .*extra.safetensors and .*model.safetensors"):
        load_model(folder)


@pytest.mark.parametrize("dtype,name", [(torch.int64, "I64"), (torch.int32, "I32"), (torch.bool, "BOOL")])
def test_loader_refuses_a_non_float_tensor_for_a_float_parameter(tmp_path, no_allocation, dtype, name):
    folder = copy_default_model(tmp_path / "m")
    weights = load_file(str(folder / "model.safetensors"))
    weights["model.norm.weight"] = torch.ones(128, dtype=dtype)    # the right shape, the wrong kind
    save_file(weights, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match=f"model.safetensors: model.norm.weight has dtype {name}"):
        load_model(folder)


@pytest.mark.parametrize("changes,tensor", [
    ({"vocab_size": 10**12}, "model.embed_tokens.weight"),   # 512 TB if it were allocated
    ({"intermediate_size": 512}, "model.layers.0.mlp.gate_proj.weight"),
    ({"num_hidden_layers": 5, "layer_types": ["full_attention"] * 5}, None),
])
def test_loader_checks_shapes_against_config_before_allocating(tmp_path, no_allocation, changes, tensor):
    folder = copy_default_model(tmp_path / "m")
    _edit_config(folder, **changes)
    match = f"{tensor} has shape" if tensor else r"missing \['model.layers.4."
    with pytest.raises(ValueError, match=match):
        load_model(folder)


def test_loader_refuses_query_heads_not_a_multiple_of_kv_heads(tmp_path, hf_logging_quiet, no_allocation):
    # A self-consistent checkpoint (transformers writes it happily): only the head ratio is wrong.
    path = build_random_checkpoint(tmp_path / "gqa", **{**SMALL, "num_key_value_heads": 3})
    with pytest.raises(ValueError, match=r"config.json: num_attention_heads \(4\) is not a multiple "
                                         r"of num_key_value_heads \(3\)"):
        load_model(path)


@pytest.mark.parametrize("field", ["num_key_value_heads", "head_dim", "vocab_size"])
def test_loader_refuses_sizes_below_one(tmp_path, no_allocation, field):
    folder = copy_default_model(tmp_path / "m")
    _edit_config(folder, **{field: 0})
    with pytest.raises(ValueError, match=f"config.json: {field} must be an integer >= 1, got 0"):
        load_model(folder)


@pytest.mark.parametrize("text,problem", [
    ("[1, 2, 3]", "holds a JSON list"),
    ('"qwen3"', "holds a JSON str"),
    ('{"model_type": "qwen3",', "is not valid JSON"),
    ("", "is not valid JSON"),
])
def test_loader_refuses_a_config_that_is_not_a_json_object_naming_the_file(tmp_path, text, problem):
    folder = copy_default_model(tmp_path / "m")
    (folder / "config.json").write_text(text)
    with pytest.raises(ValueError, match=re.escape(str(folder / "config.json")) + " " + problem):
        load_model(folder)


def test_loader_refuses_a_file_that_is_not_safetensors_naming_it(tmp_path, no_allocation):
    folder = copy_default_model(tmp_path / "m")
    (folder / "notes.safetensors").write_bytes(b"these are not tensors")
    with pytest.raises(ValueError, match="notes.safetensors is not a readable safetensors file"):
        load_model(folder)


def test_tied_and_untied_heads(tmp_path, hf_logging_quiet):
    tied, _, _ = load_model(default_model_path())
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    path = build_random_checkpoint(tmp_path / "u", tie_word_embeddings=False, **SMALL)
    assert "lm_head.weight" in load_file(str(path / "model.safetensors"))
    untied, _, _ = load_model(path)
    assert untied.lm_head.weight is not untied.model.embed_tokens.weight
    assert not torch.equal(untied.lm_head.weight, untied.model.embed_tokens.weight)


def test_load_model_dtype_and_bad_input():
    model, config, _ = load_model(dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    with pytest.raises(ValueError, match="attention backend"):
        AttentionMetadata(torch.zeros(1), torch.zeros(1, 1), torch.ones(1), torch.tensor([0, 1]),
                          1, 1, backend="cuda")
    with pytest.raises(ValueError, match="cu_seqlens_q has 3 entries"):
        AttentionMetadata(torch.zeros(1), torch.zeros(1, 1), torch.ones(1), torch.tensor([0, 1, 2]), 1, 1)
    too_many_queries = AttentionMetadata(torch.tensor([0, 1]), torch.zeros(1, 1, dtype=torch.int32),
                                         torch.tensor([1]), torch.tensor([0, 2]), 2, 1)
    shape = (2, 4, config.num_key_value_heads, config.head_dim)
    caches = [(torch.zeros(shape, dtype=torch.bfloat16), torch.zeros(shape, dtype=torch.bfloat16))
              for _ in range(config.num_hidden_layers)]
    with pytest.raises(ValueError, match="2 query tokens but context_len 1"):
        model(torch.tensor([1, 2]), torch.tensor([0, 1]), too_many_queries, caches)
    assert all(not k.any() and not v.any() for k, v in caches)      # nothing was written
    with pytest.raises(ValueError, match="kv_caches has 1 entries for 4 layers"):
        model(torch.tensor([1, 2]), torch.tensor([0, 1]), too_many_queries, caches[:1])


def test_random_checkpoint_is_seeded_and_its_greedy_output_varied(tmp_path, hf_logging_quiet):
    """The benchmark's model: same seed, same bytes; and at initializer_range 0.4 its greedy
    continuation does not collapse onto one token (at 0.02 it does)."""
    from transformers import AutoModelForCausalLM
    a = build_random_checkpoint(tmp_path / "a", seed=5, **SMALL)
    b = build_random_checkpoint(tmp_path / "b", seed=5, **SMALL)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    # the tiny tokenizer (1024 ids) does not fit a 320-token vocabulary: none is copied
    assert not (a / "tokenizer.json").exists() and load_model(a)[2] is None
    assert (build_random_checkpoint(tmp_path / "c", **{**SMALL, "vocab_size": 1024}) / "tokenizer.json").is_file()
    hf = AutoModelForCausalLM.from_pretrained(str(a), dtype=torch.float32).eval()
    prompt = torch.tensor([random_prompts(SMALL["vocab_size"], [8], seed=0)[0]])
    with torch.no_grad():
        out = hf.generate(prompt, max_new_tokens=24, do_sample=False, eos_token_id=None)[0, 8:]
    assert len(set(out.tolist())) >= 8


@pytest.mark.parametrize("change,message", [
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                          "original_max_position_embeddings": 64}}, "rope_type 'yarn'"),
    ({"use_sliding_window": True, "sliding_window": 0, "max_window_layers": 0, "layer_types": None}, "sliding_window=0"),
])
def test_unsupported_config_features_are_refused_by_name(tmp_path, change, message):
    from course_pkg.models import load_model
    folder = copy_default_model(tmp_path / "m")
    config = json.loads((folder / "config.json").read_text())
    config.update(change)
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        load_model(folder)
