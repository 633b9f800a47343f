"""The Triton kernels against the pure-torch references (chapter 05).

Without a GPU the kernels run under Triton's interpreter (~0.1-1 s per launch), so the cases
are small but chosen to hit every edge: contexts of 1, block_size - 1, block_size,
block_size + 1 and a long one that loops over many key tiles; GQA ratios 1, 2 and 4; block
tables in shuffled physical order; a block size that is not a power of two. Every byte of
the cache that no sequence owns -- unused blocks and the unused tail of each last block --
holds NaN, so a read outside the context shows up in the output; outputs start as NaN, so a
row the kernel forgets to write shows up too. The random inputs come from one seed, fixed by
default so that every run sees the same cases; it is printed with each test's output and is in
every failure message. ``COURSE_TEST_SEED=N`` replays a failure seen with seed N, or tries
other inputs.
"""
from __future__ import annotations

import math
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from course_pkg.kernels import paged_attention_ref, store_kvcache_ref
from course_pkg.kernels import triton_kernels as tk
from course_pkg.kernels.triton_kernels import launch_paged_attention, paged_attention, store_kvcache

DEVICE = "cpu" if tk.INTERPRET else "cuda"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOLERANCE = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}


DEFAULT_SEED = 20261201


@pytest.fixture
def seed() -> int:
    """The seed of a test's random inputs: ``COURSE_TEST_SEED`` if set, else ``DEFAULT_SEED``."""
    value = os.environ.get("COURSE_TEST_SEED", str(DEFAULT_SEED))
    try:
        seed = int(value)
    except ValueError:
        raise pytest.UsageError(f"COURSE_TEST_SEED must be an integer, got {value!r}") from None
    print(f"random inputs from seed {seed} (replay with COURSE_TEST_SEED={seed})")
    return seed


def make_case(seed: int, *, dtype, block_size: int, context_lens: list[int], q_lens: list[int],
              num_kv_heads: int = 2, group: int = 2, head_dim: int = 32, extra_blocks: int = 3):
    """Random q and a paged cache holding ``context_lens`` tokens per sequence.

    Physical blocks are handed out in a random order; everything the sequences do not own
    is NaN. Returns a dict of the attention arguments (scale included).
    """
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [math.ceil(c / block_size) for c in context_lens]
    num_blocks = sum(blocks_per_seq) + extra_blocks
    physical = torch.randperm(num_blocks, generator=gen).tolist()
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    block_tables = torch.full((len(context_lens), max(blocks_per_seq) + 1), -1, dtype=torch.int32)
    for i, (ctx, n) in enumerate(zip(context_lens, blocks_per_seq)):
        table, physical = physical[:n], physical[n:]
        block_tables[i, :n] = torch.tensor(table, dtype=torch.int32)
        slots = torch.tensor([table[t // block_size] * block_size + t % block_size for t in range(ctx)])
        kv = torch.randn(2, ctx, num_kv_heads, head_dim, generator=gen)
        store_kvcache_ref(kv[0], kv[1], k_cache, v_cache, slots)
    total_q = sum(q_lens)
    q = torch.randn(total_q, num_kv_heads * group, head_dim, generator=gen).to(dtype)
    cu = torch.tensor([0] + [sum(q_lens[:i + 1]) for i in range(len(q_lens))], dtype=torch.int32)
    args = dict(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables,
                context_lens=torch.tensor(context_lens, dtype=torch.int32), cu_seqlens_q=cu,
                scale=head_dim ** -0.5)
    return {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in args.items()}


def reference64(args) -> torch.Tensor:
    """The reference computed in float64 from the very same (rounded) inputs."""
    a = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    for k in ("q", "k_cache", "v_cache"):
        a[k] = a[k].double()
    return paged_attention_ref(**a)


def run_poisoned(args, **launch) -> torch.Tensor:
    """Launch into an output full of NaN: every element must be overwritten."""
    out = torch.full_like(args["q"], float("nan"))
    q_lens = (args["cu_seqlens_q"][1:] - args["cu_seqlens_q"][:-1]).tolist()
    launch_paged_attention(out, **args, max_q_len=max(q_lens), **launch)
    return out


def assert_close(out, args, seed, what=""):
    assert not out.isnan().any(), f"{what}: {int(out.isnan().sum())} outputs not written or NaN read (seed {seed})"
    ref = reference64(args)
    err = ((out.cpu().double() - ref).abs().max() / ref.abs().max()).item()
    assert err < TOLERANCE[out.dtype], f"{what}: relative error {err:.2e} for {out.dtype} (seed {seed})"


def edge_contexts(block_size: int, long: int) -> list[int]:
    return [1, block_size - 1, block_size, block_size + 1, long]


# ------------------------------------------------------------------------------- store_kvcache

@pytest.mark.parametrize("dtype", DTYPES)
def test_store_kvcache_matches_reference_and_skips_minus_one(dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    num_blocks, block_size, kv_heads, head_dim = 6, 5, 2, 24      # 24: not a power of two
    n = 9
    garbage = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    slot_mapping = torch.randperm(num_blocks * block_size, generator=gen)[:n]
    slot_mapping[torch.randperm(n, generator=gen)[:3]] = -1
    # key/value as strided slices of one fused projection, in float32 (converted on store)
    fused = torch.randn(n, 3, kv_heads, head_dim, generator=gen)
    key, value = fused[:, 1], fused[:, 2]
    k_ref, v_ref = garbage.clone(), garbage.clone().neg()
    store_kvcache_ref(key, value, k_ref, v_ref, slot_mapping)
    k_cache, v_cache = garbage.clone().to(DEVICE), garbage.clone().neg().to(DEVICE)
    store_kvcache(key.to(DEVICE), value.to(DEVICE), k_cache, v_cache, slot_mapping.to(DEVICE))
    assert torch.equal(k_cache.cpu(), k_ref), f"seed {seed}"
    assert torch.equal(v_cache.cpu(), v_ref), f"seed {seed}"
    written = set(slot_mapping[slot_mapping >= 0].tolist())
    untouched = [s for s in range(num_blocks * block_size) if s not in written]
    flat = k_cache.cpu().view(-1, kv_heads, head_dim)
    assert torch.equal(flat[untouched], garbage.view(-1, kv_heads, head_dim)[untouched])


def test_layers_are_views_into_one_preallocated_tensor(seed):
    """The engine allocates one [2, num_layers, ...] tensor; each layer's caches are views.
    Writing and reading layer 1 must leave layer 0 alone."""
    gen = torch.Generator().manual_seed(seed)
    kv_cache = torch.full((2, 2, 4, 3, 2, 16), float("nan"), device=DEVICE)
    k1, v1 = kv_cache[0, 1], kv_cache[1, 1]
    key, value = torch.randn(2, 7, 2, 16, generator=gen).to(DEVICE)
    slots = torch.tensor([9, 10, 11, 3, 4, 5, 6], device=DEVICE)        # blocks 3, 1, 2 of 3 slots
    store_kvcache(key, value, k1, v1, slots)
    assert kv_cache[:, 0].isnan().all(), "layer 0 was written"
    assert torch.equal(k1.reshape(-1, 2, 16)[slots], key) and torch.equal(v1.reshape(-1, 2, 16)[slots], value)
    args = dict(q=torch.randn(2, 4, 16, generator=gen).to(DEVICE), k_cache=k1, v_cache=v1,
                block_tables=torch.tensor([[3, 1, 2]], dtype=torch.int32, device=DEVICE),
                context_lens=torch.tensor([7], dtype=torch.int32, device=DEVICE),
                cu_seqlens_q=torch.tensor([0, 2], dtype=torch.int32, device=DEVICE), scale=0.25)
    assert_close(run_poisoned(args), args, seed, "layer view")


def test_store_kvcache_all_padding_changes_nothing(seed):
    gen = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(3, 4, 2, 16, generator=gen).to(DEVICE)
    v_cache = torch.randn(3, 4, 2, 16, generator=gen).to(DEVICE)
    before = (k_cache.clone(), v_cache.clone())
    kv = torch.randn(5, 2, 16, generator=gen).to(DEVICE)
    store_kvcache(kv, kv, k_cache, v_cache, torch.full((5,), -1, dtype=torch.int64, device=DEVICE))
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])


def test_store_kvcache_bad_input_raises_and_changes_nothing():
    k_cache = torch.zeros(2, 4, 2, 16, device=DEVICE)
    v_cache = torch.zeros(2, 4, 2, 16, device=DEVICE)
    kv = torch.ones(3, 2, 16, device=DEVICE)
    slots = torch.tensor([0, 1, 2], device=DEVICE)
    with pytest.raises(ValueError, match="key must be"):
        store_kvcache(torch.ones(3, 4, 16, device=DEVICE), kv, k_cache, v_cache, slots)
    with pytest.raises(ValueError, match="slot_mapping"):
        store_kvcache(kv, kv, k_cache, v_cache, slots[:2])
    with pytest.raises(TypeError, match="slot_mapping"):
        store_kvcache(kv, kv, k_cache, v_cache, slots.float())
    with pytest.raises(ValueError, match="v_cache"):
        store_kvcache(kv, kv, k_cache, v_cache.half(), slots)
    assert not k_cache.any() and not v_cache.any()


# ----------------------------------------------------------------------------- paged_attention

@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_matches_float64_reference(dtype, group, seed):
    block_size = 7                                        # not a power of two
    contexts = edge_contexts(block_size, long=61)         # 61 keys: four 16-key tiles
    args = make_case(seed, dtype=dtype, block_size=block_size, context_lens=contexts,
                     q_lens=[1] * len(contexts), group=group)
    assert_close(run_poisoned(args), args, seed, f"decode group={group}")


@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_over_cached_prefix_matches_float64_reference(dtype, group, seed):
    block_size = 16
    contexts = edge_contexts(block_size, long=70) + [9, 5]
    # full prompts, a cached prefix with several new tokens, decode rows, and a sequence
    # with no query this step; 20 * group rows exceed one 64-row tile when group = 4
    q_lens = [1, 15, 3, 17, 20, 1, 0]
    args = make_case(seed, dtype=dtype, block_size=block_size, context_lens=contexts,
                     q_lens=q_lens, group=group)
    out = run_poisoned(args)
    # a sequence without queries has no rows, so nothing may be NaN anywhere
    assert_close(out, args, seed, f"prefill group={group}")


@pytest.mark.parametrize("block_size", [1, 3])
def test_tiny_block_sizes(block_size, seed):
    contexts = [1, 2, 4, 23]
    args = make_case(seed, dtype=torch.float32, block_size=block_size, context_lens=contexts,
                     q_lens=[1, 2, 1, 6], group=2)
    assert_close(run_poisoned(args), args, seed, f"block_size={block_size}")


@pytest.mark.parametrize("num_splits", [2, 5])
def test_split_kv_merges_exactly(num_splits, seed):
    # 5 splits of 41 keys leave some splits empty for the first rows of the prefill
    args = make_case(seed, dtype=torch.bfloat16, block_size=6, context_lens=[1, 41, 13],
                     q_lens=[1, 1, 4], group=4)
    assert_close(run_poisoned(args, num_splits=num_splits), args, seed, f"num_splits={num_splits}")


def test_strided_q_and_large_scores(seed):
    """q as a slice of a fused QKV projection; logits of ~1e3 would overflow a naive exp."""
    args = make_case(seed, dtype=torch.float32, block_size=8, context_lens=[5, 30],
                     q_lens=[2, 30], group=2)
    q = args["q"]
    fused = torch.zeros(q.shape[0], q.shape[1] + 4, q.shape[2] * 2, device=DEVICE)
    fused[:, 2:2 + q.shape[1], 1::2] = q * 30.0
    args["q"] = fused[:, 2:2 + q.shape[1], 1::2]
    assert not args["q"].is_contiguous()
    assert_close(run_poisoned(args), args, seed, "strided q")


def test_public_wrapper_equals_launch_and_reference(seed):
    args = make_case(seed, dtype=torch.float16, block_size=5, context_lens=[3, 12],
                     q_lens=[3, 1], group=2)
    out = paged_attention(**args)
    assert out.is_contiguous() and out.dtype == torch.float16 and out.shape == args["q"].shape
    assert torch.equal(out, run_poisoned(args))
    assert_close(out, args, seed, "paged_attention")


@settings(max_examples=6, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_shapes_match_reference(data):
    """Random block sizes, head dims (some not powers of two), GQA ratios and lengths."""
    block_size = data.draw(st.integers(1, 9), label="block_size")
    head_dim = data.draw(st.sampled_from([16, 24, 32]), label="head_dim")
    group = data.draw(st.sampled_from([1, 2, 4]), label="group")
    contexts = data.draw(st.lists(st.integers(1, 40), min_size=1, max_size=3), label="contexts")
    q_lens = [data.draw(st.integers(0 if i else 1, c), label=f"q_len{i}") for i, c in enumerate(contexts)]
    seed = data.draw(st.integers(0, 2**31 - 1), label="seed")
    args = make_case(seed, dtype=torch.float32, block_size=block_size, context_lens=contexts,
                     q_lens=q_lens, num_kv_heads=1, group=group, head_dim=head_dim, extra_blocks=1)
    assert_close(run_poisoned(args), args, seed, "random shapes")


def test_attention_bad_input_raises():
    args = make_case(0, dtype=torch.float32, block_size=4, context_lens=[3], q_lens=[2])
    with pytest.raises(ValueError, match="not a multiple"):
        paged_attention(**{**args, "q": torch.zeros(2, 3, 32, device=DEVICE)})
    with pytest.raises(TypeError, match="cast one of them"):
        paged_attention(**{**args, "q": args["q"].half()})
    with pytest.raises(ValueError, match="q_len <= context_len"):
        paged_attention(**{**args, "context_lens": torch.tensor([1], dtype=torch.int32, device=DEVICE)})
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        paged_attention(**{**args, "cu_seqlens_q": torch.tensor([0, 1, 2], dtype=torch.int32, device=DEVICE)})
    with pytest.raises(ValueError, match="columns"):
        paged_attention(**{**args, "context_lens": torch.tensor([9], dtype=torch.int32, device=DEVICE)})
    with pytest.raises(ValueError, match="out must match"):
        launch_paged_attention(torch.empty(1, 4, 32, device=DEVICE), **args, max_q_len=2)
    if tk.INTERPRET:   # checked only where it costs no device-to-host copy
        with pytest.raises(ValueError, match="max_q_len=1"):
            launch_paged_attention(torch.empty_like(args["q"]), **args, max_q_len=1)


def test_references_import_without_triton():
    """The engine's CPU path imports course_pkg.kernels; that must not pull in triton."""
    import subprocess
    import sys

    script = ("import sys, course_pkg.kernels, course_pkg.kernels.reference\n"
              "assert 'triton' not in sys.modules, 'triton was imported'\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]


def test_importing_triton_before_the_interpreter_switch_fails_clearly():
    """Set the switch after triton.language was imported: the import must say what to do."""
    import subprocess
    import sys

    script = ("import os, triton.language\n"
              "os.environ['TRITON_INTERPRET'] = '1'\n"
              "from course_pkg.kernels import triton_kernels\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env,
                            timeout=120)
    assert result.returncode != 0
    assert "ImportError: triton was imported before TRITON_INTERPRET=1 was set" in result.stderr


def test_interpreter_is_chosen_exactly_when_cuda_is_missing():
    if not torch.cuda.is_available():
        assert tk.INTERPRET and os.environ["TRITON_INTERPRET"] == "1"
    else:
        assert tk.INTERPRET == (os.environ.get("TRITON_INTERPRET") == "1")


# ------------------------------------------------------------------------- viz.slots (the picture)

@given(block_size=st.integers(1, 6), num_tokens=st.integers(0, 30), seed=st.integers(0, 2**31 - 1))
@settings(max_examples=40, deadline=None, database=None)
def test_token_slots_agree_with_the_reference_gather(block_size, num_tokens, seed):
    """The drawing's arithmetic is the cache's: gathering a cache whose rows hold their own
    slot number returns exactly ``token_slots``."""
    from course_pkg.kernels import gather_kv
    from course_pkg.viz.slots import token_slots

    num_blocks = -(-num_tokens // block_size) + 2
    table = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    cache = torch.arange(num_blocks * block_size, dtype=torch.float64).view(num_blocks, block_size, 1, 1)
    gathered = gather_kv(cache, torch.tensor(table), num_tokens).flatten().long().tolist()
    assert token_slots(table, block_size, num_tokens) == gathered


def test_draw_slots_draws_every_slot_and_rejects_short_tables():
    from course_pkg.viz.slots import draw_slots, render_slots_text, token_slots

    fig = draw_slots({"A": [2, 0], "B": [1]}, {"A": 5, "B": 2}, num_blocks=4, block_size=3, highlight=[7])
    labels = {t.get_text() for t in fig.axes[0].texts}
    assert {str(s) for s in range(12)} <= labels and {"A:0", "A:4", "B:1"} <= labels
    assert "A:5" not in labels
    assert render_slots_text({"A": [2, 0]}, {"A": 5}, 3).splitlines()[-1].split() == ["A", "4", "1", "1", "0", "1"]
    with pytest.raises(ValueError, match="need 2 blocks"):
        token_slots([4], 3, 5)


# ------------------------------------------------------------------- the GPU compile path, no GPU

GPU_COMPILE_SCRIPT = r'''
import os
import re
os.environ["TRITON_INTERPRET"] = "0"            # decorate for a GPU, even on a CPU-only machine
import torch
import triton
from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import BaseBackend, GPUTarget
from triton.compiler import ASTSource
from course_pkg.kernels import triton_kernels as tk

# Call the real wrappers with CPU tensors standing in for CUDA ones (only dtypes, strides and
# alignment matter), capture each launch, and compile it the way Triton's launcher would:
# ints equal to 1 become constants, pointers and ints divisible by 16 are marked so.
tk._check_devices = lambda **tensors: None
launches = []
for kernel in (tk._paged_attention_kernel, tk._merge_splits_kernel, tk._store_kvcache_kernel):
    kernel.run = lambda *args, grid, warmup, kernel=kernel, **kw: launches.append((kernel, args, kw))

def compile_like_launch(kernel, args, kwargs, capability=90):
    kwargs = dict(kwargs)
    options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages") if k in kwargs}
    bound = kernel.signature.bind(*args, **kwargs)
    sig, consts, attrs = {}, {}, {}
    for i, (name, value) in enumerate(bound.arguments.items()):
        if kernel.params[i].is_constexpr:
            sig[name], consts[(i,)] = "constexpr", value
            continue
        ty, spec = native_specialize_impl(BaseBackend, value, False, True, True)
        sig[name] = ty
        if ty == "constexpr":
            consts[(i,)] = spec
        elif spec == "D":
            attrs[(i,)] = [["tt.divisibility", 16]]
    return triton.compile(ASTSource(kernel, sig, consts, attrs),
                          target=GPUTarget("cuda", capability, 32), options=options).asm["ptx"]

def wide_loads(ptx):
    """16-byte global loads: vectorised (ld.global.v4) or asynchronous copies of 16 bytes."""
    return len(re.findall(r"ld\.global(?:\.[a-z]+)*\.v4\.b32|cp\.async\.cg\.shared\.global", ptx))

# decode, bf16, Llama-3-8B-like heads: the benchmark's kernel
q = torch.empty(64, 32, 128, dtype=torch.bfloat16)
k_cache = torch.empty(64 * 8, 16, 8, 128, dtype=torch.bfloat16)
tables = torch.zeros(64, 8, dtype=torch.int32)
lens = torch.full((64,), 128, dtype=torch.int32)
tk.launch_paged_attention(torch.empty_like(q), q, k_cache, k_cache, tables, lens,
                          torch.arange(65, dtype=torch.int32), 0.1, max_q_len=1)
decode = compile_like_launch(*launches.pop())
assert wide_loads(decode) >= 8, "decode: K/V rows are not read with 16-byte loads"

# prefill over a cached prefix, fp32, split into 3 chunks: the kernel and the merge
q = torch.empty(40, 4, 64)
k_cache = torch.empty(12, 16, 2, 64)
tk.launch_paged_attention(torch.empty_like(q), q, k_cache, k_cache, torch.zeros(2, 6, dtype=torch.int32),
                          torch.tensor([50, 30], dtype=torch.int32), torch.tensor([0, 20, 40], dtype=torch.int32),
                          0.1, max_q_len=20, num_splits=3)
merge = compile_like_launch(*launches.pop())
prefill = compile_like_launch(*launches.pop())

# store, fp16
kv = torch.empty(5, 8, 128, dtype=torch.float16)
cache = torch.empty(4, 16, 8, 128, dtype=torch.float16)
tk.store_kvcache(kv, kv, cache, cache, torch.arange(5))
store = compile_like_launch(*launches.pop())
assert wide_loads(store) >= 2, "store: rows are not copied with 16-byte loads"
print("compiled 4 kernels")
'''


def test_kernels_compile_for_nvidia_gpus(tmp_path):
    """The interpreter never runs Triton's GPU compiler; this does, ahead of time, for sm_90
    (Triton ships ptxas), so a kernel that only the interpreter accepts -- a tl.dot tile
    under 16, mismatched dot dtypes, a non-constexpr shape -- fails here too. It also checks
    that K/V rows are read with 16-byte loads: the first thing to lose when an address
    computation hides the contiguity of head_dim."""
    import subprocess
    import sys

    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path), "TRITON_DEFAULT_FP_FUSION": "1"}
    result = subprocess.run([sys.executable, "-c", GPU_COMPILE_SCRIPT], capture_output=True,
                            text=True, env=env, timeout=300)
    assert result.returncode == 0 and "compiled 4 kernels" in result.stdout, result.stderr[-3000:]
