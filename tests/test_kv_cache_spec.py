"""The KV cache specs of a hybrid model (chapter 16): pages, groups, blocks held, requests that fit."""
from __future__ import annotations

import types

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from course_pkg.kv_cache_spec import (FullAttentionSpec, SlidingWindowSpec, bytes_per_request, bytes_per_request_in_layout,
                                      cdiv, get_kv_cache_config, kv_cache_groups, published_config,
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


def test_the_layout_follows_vllms_grouping_rule_on_published_configs():
    """Gemma 3 27B: 10 global layers and 52 local ones -> groups of 10 (the smaller count), the
    local layers dealt by stride into 6 groups with 8 pages of padding; gpt-oss-120b: 18 and 18
    -> two groups of 18. Every layer is in exactly one group, at one slot."""
    gemma = get_kv_cache_config(published_config("gemma-3-27b"), 16, 2)
    assert gemma.group_size == 10 and len(gemma.kv_cache_groups) == 7 and gemma.padding_layers == 8
    assert gemma.kv_cache_groups[0].layer_ids == tuple(range(5, 62, 6)) and gemma.sliding_windows == (1024,) * 6
    oss = get_kv_cache_config(published_config("gpt-oss-120b"), 16, 2)
    assert oss.group_size == 18 and [g.layer_ids for g in oss.kv_cache_groups] == [tuple(range(1, 36, 2)),
                                                                                  tuple(range(0, 36, 2))]
    for layout, layers in ((gemma, 62), (oss, 36)):
        places = [layout.group_and_slot(i) for i in range(layers)]
        assert len(set(places)) == layers and all(slot < layout.group_size for _, slot in places)
    # 4 full layers and 3 local ones: close counts (4 < 1.5 * 3) -> one size of 4, one padded page
    close = types.SimpleNamespace(num_hidden_layers=7, num_key_value_heads=2, head_dim=16, sliding_window=8,
                                  layer_types=["full_attention"] * 4 + ["sliding_attention"] * 3)
    layout = get_kv_cache_config(close, 4, 2)
    assert layout.group_size == 4 and layout.padding_layers == 1 and len(layout.kv_cache_groups) == 2
    # 3 and 2 are not close (3 = 1.5 * 2): groups of 2, the full layers split in two, one padded
    apart = types.SimpleNamespace(**{**vars(close), "num_hidden_layers": 5,
                                     "layer_types": ["full_attention"] * 3 + ["sliding_attention"] * 2})
    layout = get_kv_cache_config(apart, 4, 2)
    assert layout.group_size == 2 and [g.layer_ids for g in layout.kv_cache_groups] == [(0, 2), (1,), (3, 4)]
    assert layout.sliding_windows == (None, 8)
    assert len(get_kv_cache_config(close, 4, 2, disable_hybrid_kv_cache_manager=True).kv_cache_groups) == 1


def test_padding_costs_what_the_layout_says_and_a_window_as_long_as_the_sequence_saves_nothing():
    gemma = published_config("gemma-3-27b")
    groups, layout = kv_cache_groups(gemma, 16, 2), get_kv_cache_config(gemma, 16, 2)
    page = groups[0][0].page_size_bytes
    for n in (100, 1024, 8192):
        assert bytes_per_request_in_layout(layout, n) - bytes_per_request(groups, n) == \
            8 * min(cdiv(n, 16), groups[0][0].max_blocks_held) * page
    assert bytes_per_request(groups, 1024) == bytes_per_request(groups, 1024, all_full=True)   # 1,024 <= window
    with pytest.raises(ValueError, match="sliding_attention layer"):
        get_kv_cache_config(types.SimpleNamespace(num_hidden_layers=2, num_key_value_heads=1, head_dim=8,
                                                  sliding_window=4, layer_types=["sliding_attention"] * 2), 4, 2)
