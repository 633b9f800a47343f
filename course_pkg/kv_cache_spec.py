"""What each layer's KV cache needs, by attention type: the specs of a hybrid model (chapter 16).

vLLM v1 describes every layer's cache by a *spec* and groups the layers with equal specs into KV
cache groups; one manager per group hands out blocks from a single shared pool. The course keeps
vLLM's names for the two types its Qwen3 has:

* ``FullAttentionSpec`` -- a layer attends to every earlier token, so a sequence holds a block for
  every ``block_size`` tokens it has;
* ``SlidingWindowSpec(sliding_window=w)`` -- a layer attends to the last ``w`` positions only, so a
  sequence needs only the blocks that cover them: while it decodes, positions ``n - w + 1 .. n``
  for its newest token ``n``, which span at most ``cdiv(w - 1, block_size) + 1`` blocks (vLLM's
  bound); the blocks before them can be given back.

A spec's ``page_size_bytes`` is one block of one layer (K and V). ``kv_cache_groups`` groups a
model's layers by spec (from Hugging Face's ``layer_types`` and ``sliding_window``), and
``bytes_per_request`` / ``max_num_requests`` turn a sequence length and a memory budget into what
a hybrid model holds and how many requests fit, against the same model with every layer full --
the figure a hybrid manager exists for.

``get_kv_cache_config`` lays the cache out as vLLM's hybrid allocator does: every group has the
same number of layers (``group_size``), so one block id is one page in each of ``group_size``
tensors, and the j-th layer of every group shares the j-th tensor. A block id then belongs to
one group at a time, and the pool's blocks serve all groups (``HybridBlockManager`` hands them
out; ``ModelRunner`` builds the tensors).
"""
from __future__ import annotations

from dataclasses import dataclass

from course_pkg.validation import check_positive_int


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class FullAttentionSpec:
    """A full-attention layer's cache: ``block_size`` tokens of K and V per block."""

    block_size: int
    num_kv_heads: int
    head_size: int
    dtype_bytes: int

    def __post_init__(self):
        for name in ("block_size", "num_kv_heads", "head_size", "dtype_bytes"):
            check_positive_int(name, getattr(self, name))

    @property
    def page_size_bytes(self) -> int:
        """One block of one layer: K and V, ``block_size`` tokens."""
        return 2 * self.block_size * self.num_kv_heads * self.head_size * self.dtype_bytes

    def blocks_held(self, num_tokens: int) -> int:
        """Blocks one layer of this type needs for a sequence of ``num_tokens``, in the step that
        computes its newest token (position ``num_tokens - 1``): every position up to it."""
        return cdiv(num_tokens, self.block_size)


@dataclass(frozen=True)
class SlidingWindowSpec(FullAttentionSpec):
    """A local layer's cache: only the blocks covering the last ``sliding_window`` positions."""

    sliding_window: int = 1

    def __post_init__(self):
        super().__post_init__()
        check_positive_int("sliding_window", self.sliding_window)

    def blocks_held(self, num_tokens: int) -> int:
        """Blocks covering what the step that computes the newest token (position ``n - 1``) needs:
        its own slot and the ``w - 1`` positions before it -- at most ``cdiv(w - 1, block_size) + 1``
        (vLLM's bound), never more than a full layer's."""
        if num_tokens <= 0:
            return 0
        first = max(0, num_tokens - self.sliding_window)
        return (num_tokens - 1) // self.block_size - first // self.block_size + 1

    @property
    def max_blocks_held(self) -> int:
        return cdiv(self.sliding_window - 1, self.block_size) + 1


def kv_cache_groups(config, block_size: int, dtype_bytes: int) -> list[tuple[FullAttentionSpec, tuple[int, ...]]]:
    """The model's layers grouped by spec, in order of first appearance: ``[(spec, layer indices)]``
    (``config``: a Hugging Face config with ``layer_types`` and ``sliding_window``, or none: all full)."""
    head_size = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    layer_types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    groups: dict[FullAttentionSpec, list[int]] = {}
    for i, kind in enumerate(layer_types):
        if kind == "full_attention":
            spec = FullAttentionSpec(block_size, config.num_key_value_heads, head_size, dtype_bytes)
        elif kind == "sliding_attention":
            spec = SlidingWindowSpec(block_size, config.num_key_value_heads, head_size, dtype_bytes,
                                     sliding_window=config.sliding_window)
        else:
            raise ValueError(f"layer {i} has layer type {kind!r}; known: 'full_attention', 'sliding_attention'")
        groups.setdefault(spec, []).append(i)
    return [(spec, tuple(layers)) for spec, layers in groups.items()]


def bytes_per_request(groups, num_tokens: int, *, all_full: bool = False) -> int:
    """K/V bytes one sequence holds at most while it grows to ``num_tokens``, over every layer of
    every group (a local layer: its window's bound, ``max_blocks_held``, or fewer for a short
    sequence); ``all_full``: as if every layer were full attention (a hybrid manager disabled)."""
    total = 0
    for spec, layers in groups:
        blocks = cdiv(num_tokens, spec.block_size)
        if isinstance(spec, SlidingWindowSpec) and not all_full:
            blocks = min(blocks, spec.max_blocks_held)
        total += len(layers) * blocks * spec.page_size_bytes
    return total


def max_num_requests(groups, num_tokens: int, memory_bytes: int, *, all_full: bool = False) -> int:
    """Sequences of ``num_tokens`` that fit in ``memory_bytes`` of KV cache, all at once."""
    return memory_bytes // bytes_per_request(groups, num_tokens, all_full=all_full)


@dataclass(frozen=True)
class KVCacheGroupSpec:
    """One KV cache group (vLLM's name): layers of one spec that share a block table."""

    layer_ids: tuple[int, ...]
    kv_cache_spec: FullAttentionSpec

    @property
    def sliding_window(self) -> int | None:
        return getattr(self.kv_cache_spec, "sliding_window", None)


@dataclass(frozen=True)
class KVCacheConfig:
    """How the cache is laid out: the groups (the first one full attention, whose table is
    ``Sequence.block_table``) and ``group_size``, the layers per group -- the tensors a block id
    indexes. A group with fewer layers than ``group_size`` leaves the rest of its pages unused
    (vLLM's padding)."""

    kv_cache_groups: tuple[KVCacheGroupSpec, ...]
    group_size: int

    @property
    def is_hybrid(self) -> bool:
        return len(self.kv_cache_groups) > 1

    @property
    def sliding_windows(self) -> tuple[int | None, ...]:
        """The window of every group after the first (None: a full-attention group)."""
        return tuple(g.sliding_window for g in self.kv_cache_groups[1:])

    def group_and_slot(self, layer: int) -> tuple[int, int]:
        """Layer ``layer``'s group, and which of the ``group_size`` tensors holds its pages."""
        for g, group in enumerate(self.kv_cache_groups):
            if layer in group.layer_ids:
                return g, group.layer_ids.index(layer)
        raise ValueError(f"layer {layer} is in no KV cache group")

    @property
    def padding_layers(self) -> int:
        """Padding layers, summed over the groups: a group of ``k < group_size`` layers leaves
        ``group_size - k`` of each of its block ids' pages unused."""
        return sum(self.group_size - len(g.layer_ids) for g in self.kv_cache_groups)


def get_kv_cache_config(config, block_size: int, dtype_bytes: int, *,
                        disable_hybrid_kv_cache_manager: bool = False) -> KVCacheConfig:
    """The groups of a model's cache and their size, by vLLM's rule.

    ``group_size`` is the smallest layer count among the specs -- or the largest, when it is
    less than 1.5 times the smallest (fewer groups for a little padding); each spec's layers are
    dealt out, by stride, into groups of at most ``group_size``. Full attention comes first:
    the course keeps group 0 a full-attention group (the table every chapter so far used), so a
    model of sliding layers only is refused unless the hybrid manager is disabled.
    ``disable_hybrid_kv_cache_manager`` (vLLM's flag): one group of every layer, each treated as
    full attention for memory -- a sliding layer still attends to its window only.
    """
    by_spec = kv_cache_groups(config, block_size, dtype_bytes)
    if not disable_hybrid_kv_cache_manager and all(isinstance(spec, SlidingWindowSpec) for spec, _ in by_spec):
        raise ValueError("every layer of this model is a sliding_attention layer; the course's hybrid manager "
                         "keeps the first KV cache group full attention -- pass "
                         "disable_hybrid_kv_cache_manager=True to keep every layer's cache whole")
    if disable_hybrid_kv_cache_manager or len(by_spec) == 1:
        layers = tuple(range(config.num_hidden_layers))
        full = by_spec[0][0]
        full = FullAttentionSpec(full.block_size, full.num_kv_heads, full.head_size, full.dtype_bytes)
        return KVCacheConfig((KVCacheGroupSpec(layers, full),), len(layers))
    by_spec.sort(key=lambda group: isinstance(group[0], SlidingWindowSpec))   # full attention first
    counts = [len(layers) for _, layers in by_spec]
    group_size = min(counts)
    if max(counts) < 1.5 * min(counts):
        group_size = max(counts)
    groups = []
    for spec, layers in by_spec:
        num_groups = cdiv(len(layers), group_size)
        for j in range(num_groups):
            groups.append(KVCacheGroupSpec(layers[j::num_groups], spec))
    return KVCacheConfig(tuple(groups), group_size)


#: The fields this module reads, from the published ``config.json`` of two hybrid models:
#: Gemma 3 27B (five local layers of window 1,024 to one global: layer ``i`` is global when
#: ``(i + 1) % 6 == 0``) and gpt-oss-120b (local and global layers alternate, window 128).
PUBLISHED_CONFIGS = {
    "gemma-3-27b": dict(num_hidden_layers=62, num_attention_heads=32, num_key_value_heads=16, head_dim=128,
                        hidden_size=5376, sliding_window=1024,
                        layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(62)]),
    "gpt-oss-120b": dict(num_hidden_layers=36, num_attention_heads=64, num_key_value_heads=8, head_dim=64,
                         hidden_size=2880, sliding_window=128,
                         layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(36)]),
}


def published_config(name: str):
    """A config object with the published fields of ``name`` (a key of ``PUBLISHED_CONFIGS``)."""
    from types import SimpleNamespace

    if name not in PUBLISHED_CONFIGS:
        raise ValueError(f"unknown model {name!r}; known: {sorted(PUBLISHED_CONFIGS)}")
    return SimpleNamespace(**PUBLISHED_CONFIGS[name])


def bytes_per_request_in_layout(kv_cache_config: KVCacheConfig, num_tokens: int) -> int:
    """What a request holds at most in an engine laid out by ``kv_cache_config``: every group's
    blocks times a block id's bytes -- ``group_size`` pages, padding included (the cost of vLLM's
    equal-sized groups that ``bytes_per_request`` leaves out)."""
    total = 0
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        blocks = cdiv(num_tokens, spec.block_size)
        if isinstance(spec, SlidingWindowSpec):
            blocks = min(blocks, spec.max_blocks_held)
        total += blocks * kv_cache_config.group_size * spec.page_size_bytes
    return total
