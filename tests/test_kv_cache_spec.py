"""The KV cache specs of a hybrid model (chapter 16): pages, groups, blocks held, requests that fit."""
from __future__ import annotations

import types

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from course_pkg.kv_cache_spec import (FullAttentionSpec, SlidingWindowSpec, bytes_per_request, cdiv, kv_cache_groups,
                                      max_num_requests)


@settings(max_examples=300, deadline=None)
@given(block_size=st.integers(1, 32), window=st.integers(1, 300), n=st.integers(1, 2000))
def test_a_window_holds_exactly_the_blocks_its_positions_span(block_size, window, n):
    """Counted against the positions themselves: the step computing position n - 1 reads
    positions n - window .. n - 1 (the newest and the window - 1 before it)."""
    spec = SlidingWindowSpec(block_size, 2, 16, 2, sliding_window=window)
    needed = {p // block_size for p in range(max(0, n - window), n)}
    assert spec.blocks_held(n) == len(needed)
    assert spec.blocks_held(n) <= spec.max_blocks_held == cdiv(window - 1, block_size) + 1
    assert spec.blocks_held(n) <= FullAttentionSpec(block_size, 2, 16, 2).blocks_held(n) == cdiv(n, block_size)


def test_4096_tokens_in_a_window_of_128_hold_at_most_ceil_128_over_block_size_plus_one():
    for block_size in (1, 16, 32, 100, 128):
        spec = SlidingWindowSpec(block_size, 8, 128, 2, sliding_window=128)
        assert max(spec.blocks_held(n) for n in range(1, 4097)) <= cdiv(128, block_size) + 1


def test_groups_follow_the_layer_types_and_the_page_is_one_layer_of_k_and_v():
    config = types.SimpleNamespace(num_hidden_layers=6, num_key_value_heads=4, head_dim=64, sliding_window=512,
                                   layer_types=["sliding_attention"] * 5 + ["full_attention"])
    groups = kv_cache_groups(config, 16, 2)
    assert [(type(s).__name__, layers) for s, layers in groups] == [("SlidingWindowSpec", (0, 1, 2, 3, 4)),
                                                                    ("FullAttentionSpec", (5,))]
    assert groups[0][0].page_size_bytes == groups[1][0].page_size_bytes == 2 * 16 * 4 * 64 * 2
    # 8,192 tokens: 5 local layers hold 33 blocks each (cdiv(511, 16) + 1), the global one 512
    per = 2 * 16 * 4 * 64 * 2
    assert bytes_per_request(groups, 8192) == (5 * 33 + 512) * per
    assert bytes_per_request(groups, 8192, all_full=True) == 6 * 512 * per
    budget = 100 * 6 * 512 * per
    assert max_num_requests(groups, 8192, budget, all_full=True) == 100
    assert max_num_requests(groups, 8192, budget) == budget // ((5 * 33 + 512) * per) == 453
    with pytest.raises(ValueError, match="chunked_attention"):
        kv_cache_groups(types.SimpleNamespace(**{**vars(config), "layer_types": ["chunked_attention"] * 6}), 16, 2)
