"""Chapter 07 graders: KV bytes per block and internal fragmentation, on hand-computed cases
and against what the package really allocates (a ModelRunner's KV tensor, a BlockManager's
block tables)."""
from __future__ import annotations

from course_pkg.block_manager import BlockManager
from course_pkg.labs.lab import Grading
from course_pkg.sequence import Sequence


def grade_kv_block_bytes(fn, g: Grading) -> None:
    cases = [  # (block_size, layers, kv heads, head_dim, dtype bytes) -> bytes, by hand
        ("the smallest block: 1 token, 1 layer, 1 head of 1 float32", (1, 1, 1, 1, 4), 8),
        ("Qwen3-0.6B in bfloat16, block size 16: 2 x 28 x 16 x 8 x 128 x 2", (16, 28, 8, 128, 2), 1_835_008),
        ("Llama-3-8B in float16, block size 16: 2 x 32 x 16 x 8 x 128 x 2", (16, 32, 8, 128, 2), 2_097_152),
        ("block size 7, 3 layers, 2 heads of 5, float32: 2 x 3 x 7 x 2 x 5 x 4", (7, 3, 2, 5, 4), 1_680),
    ]
    for name, args, expected in cases:
        with g.scenario(name):
            got = fn(*args)
            g.equal(got, expected, f"kv_block_bytes{args}")
            g.check(type(got) is int, f"kv_block_bytes{args} returned {got!r}, a {type(got).__name__}: a number "
                                      "of bytes is an int (torch.empty and a byte budget need one)")
    with g.scenario("what the ModelRunner allocates per block (3 layers, 2 KV heads of 8, float32, block size 5)"):
        actual = _model_runner_block_bytes(num_layers=3, num_kv_heads=2, head_dim=8, block_size=5)
        g.equal(fn(5, 3, 2, 8, 4), actual, "kv_block_bytes(5, 3, 2, 8, 4) vs bytes of one block of the KV tensor")


def _model_runner_block_bytes(*, num_layers: int, num_kv_heads: int, head_dim: int, block_size: int) -> int:
    """Bytes of block 0 in a real ModelRunner's KV tensor (a one-parameter stand-in model)."""
    from types import SimpleNamespace

    import torch

    from course_pkg.engine.model_runner import ModelRunner

    config = SimpleNamespace(num_hidden_layers=num_layers, num_key_value_heads=num_kv_heads, head_dim=head_dim,
                             hidden_size=num_kv_heads * head_dim, num_attention_heads=num_kv_heads, vocab_size=8)
    runner = ModelRunner(torch.nn.Linear(1, 1), config, block_size=block_size, num_kvcache_blocks=3,
                         attention_backend="torch", seed=0)
    block0 = runner.kv_cache[:, :, 0]                  # [K/V, layer, block_size, kv heads, head_dim]
    return block0.numel() * block0.element_size()


def grade_internal_fragmentation(fn, g: Grading) -> None:
    cases = [  # (token counts, block size) -> empty slots, by hand
        ("one token in a block of 16", ([1], 16), 15),
        ("a full block", ([16], 16), 0),
        ("one token past a full block", ([17], 16), 15),
        ("three sequences, block size 4: 3 + 0 + 3", ([5, 8, 9], 4), 6),
        ("block size 7: 0 + 0 + 6", ([7, 14, 15], 7), 6),
        ("block size 1 never wastes a slot", ([3, 1, 10], 1), 0),
        ("no sequences", ([], 16), 0),
        ("a sequence with no tokens yet holds no block: 0 + 3", ([0, 5], 4), 3),
    ]
    for name, (tokens, bs), expected in cases:
        with g.scenario(name):
            g.equal(fn(list(tokens), bs), expected, f"internal_fragmentation({tokens}, {bs})")
    with g.scenario("the slots a BlockManager really leaves empty (block size 6, 5 sequences)"):
        lengths, bs = [1, 6, 7, 11, 30], 6
        bm = BlockManager(64, bs)
        seqs = [Sequence(list(range(n)), block_size=bs) for n in lengths]
        for seq in seqs:
            bm.allocate(seq, 0)
        empty = sum(len(s.block_table) * bs - s.num_tokens for s in seqs)
        g.equal(fn(lengths, bs), empty, f"internal_fragmentation({lengths}, {bs}) vs the allocated block tables")
