"""Immutable snapshots of the BlockManager's state, and their deterministic text form.

A snapshot copies everything the reader needs to see after a call -- per block its id, ref
count, hash and tokens; the free queue in order; the used set; the hash index; each live
sequence's block table -- so later calls cannot change a picture already taken.

A block's tokens are known two ways. A *registered* block carries them itself
(``Block.token_ids``, set by ``hash_blocks``). Any other held block -- a partly filled last
block, a prompt block not computed yet, the shared partial block that copy-on-write acts on --
carries none, so the snapshot takes them from the sequences that hold it (their block tables,
the manager's holders and the named sequences): ``BlockState.held_tokens``. The text shows the
first as ``[1 2 3]`` and the second as ``(5 6)``.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import cached_property

from course_pkg.block_manager import BlockManager
from course_pkg.sequence import Sequence


@dataclass(frozen=True)
class BlockState:
    block_id: int
    ref_count: int
    hash: int
    token_ids: tuple[int, ...]                   # registered content (empty: not registered)
    held_tokens: tuple[int, ...] = ()            # the tokens its holders keep in it (see above)


@dataclass(frozen=True)
class Snapshot:
    label: str
    block_size: int
    blocks: tuple[BlockState, ...]
    free_queue: tuple[int, ...]                  # head (reused next) first
    used: tuple[int, ...]                        # sorted
    hash_index: tuple[tuple[int, int], ...]      # (hash, block_id), sorted by block id
    block_tables: tuple[tuple[str, tuple[int, ...]], ...]  # (sequence name, table)

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    def is_cached(self, block_id: int) -> bool:
        """Is the block reachable through the hash index (a possible prefix hit)?"""
        b = self.blocks[block_id]
        return b.hash != -1 and self._index.get(b.hash) == block_id

    @cached_property
    def _index(self) -> dict[int, int]:
        return dict(self.hash_index)

    def state(self, block_id: int) -> str:
        """'free', 'cached' (free but still in the index), 'exclusive' or 'shared'."""
        ref = self.blocks[block_id].ref_count
        if ref == 0:
            return "cached" if self.is_cached(block_id) else "free"
        return "exclusive" if ref == 1 else "shared"


def _named(seqs) -> list[tuple[str, Sequence]]:
    if isinstance(seqs, Mapping):
        return [(str(name), seq) for name, seq in seqs.items()]
    return [(f"seq {seq.seq_id}", seq) for seq in seqs]


def take_snapshot(block_manager: BlockManager,
                  seqs: Iterable[Sequence] | Mapping[str, Sequence] = (),
                  label: str = "") -> Snapshot:
    """Copy the state of ``block_manager`` and the block tables of ``seqs``.

    ``seqs`` is a list of sequences (named "seq <id>") or a mapping name -> sequence.
    Sequences that hold no blocks are left out of the block tables.
    """
    bm = block_manager
    named = _named(seqs)
    held = _held_tokens(bm, [seq for _, seq in named])
    return Snapshot(
        label=label,
        block_size=bm.block_size,
        blocks=tuple(BlockState(b.block_id, b.ref_count, b.hash, tuple(b.token_ids),
                                held.get(b.block_id, ()) if b.ref_count else ())
                     for b in bm.blocks),
        free_queue=tuple(bm.free_block_ids),
        used=tuple(sorted(bm.used_block_ids)),
        hash_index=tuple(sorted(((h, b) for h, b in bm.hash_to_block_id.items()), key=lambda x: (x[1], x[0]))),
        block_tables=tuple((name, tuple(seq.block_table)) for name, seq in named if seq.block_table),
    )


def _held_tokens(bm: BlockManager, named: list[Sequence]) -> dict[int, tuple[int, ...]]:
    """block id -> the tokens its holders keep in it: logical block ``i`` of a sequence is
    ``token_ids[i * block_size:(i + 1) * block_size]``. Holders that disagree (a sequence that
    has appended a token to a shared block and not yet called ``may_append``) share the
    common prefix, which is what the block holds for all of them."""
    holders = {id(seq): seq for seq in [*getattr(bm, "_holders", {}).values(), *named]}
    held: dict[int, tuple[int, ...]] = {}
    bs = bm.block_size
    for seq in holders.values():
        for i, block_id in enumerate(seq.block_table):
            tokens = tuple(seq.token_ids[i * bs:(i + 1) * bs])
            if block_id in held:
                common = held[block_id]
                n = next((k for k, (a, b) in enumerate(zip(common, tokens)) if a != b), min(len(common), len(tokens)))
                tokens = common[:n]
            held[block_id] = tokens
    return held


def short_hash(h: int) -> str:
    """A 4-hex-digit tag for a 64-bit hash, enough to tell a handful of blocks apart."""
    return "-" if h == -1 else f"{h & 0xFFFF:04x}"


def _tokens(b: BlockState, limit: int = 8) -> str:
    """``[..]``: the registered tokens; ``(..)``: the tokens the block's holders keep in it."""
    token_ids, (left, right) = (b.token_ids, "[]") if b.token_ids else (b.held_tokens, "()")
    if not token_ids:
        return "-"
    shown = " ".join(map(str, token_ids[:limit]))
    return f"{left}{shown}{' ...' if len(token_ids) > limit else ''}{right}"


def render_text(snap: Snapshot, max_rows: int = 64) -> str:
    """Deterministic text form of a snapshot: the same state prints the same characters."""
    lines = []
    if snap.label:
        lines.append(f"== {snap.label}")
    lines.append("block  ref  state      hash  tokens ([..] registered, (..) held, not registered)")
    rows = [b for b in snap.blocks if b.ref_count or b.hash != -1]
    for b in rows[:max_rows]:
        lines.append(f"{b.block_id:5d}  {b.ref_count:3d}  {snap.state(b.block_id):9s}  "
                     f"{short_hash(b.hash):>4s}  {_tokens(b)}")
    if len(rows) > max_rows:
        lines.append(f"  ... {len(rows) - max_rows} more")
    untouched = snap.num_blocks - len(rows)
    if untouched:
        lines.append(f"  ({untouched} {'block' if untouched == 1 else 'blocks'} free and never registered)")
    free = " ".join(f"{b}*" if snap.is_cached(b) else str(b) for b in snap.free_queue)
    lines.append(f"free queue (head -> tail, * = still cached): {free or '(empty)'}")
    lines.append(f"used: {{{', '.join(map(str, snap.used))}}}")
    index = "  ".join(f"{short_hash(h)}->{b}" for h, b in snap.hash_index)
    lines.append(f"hash index: {index or '(empty)'}")
    for name, table in snap.block_tables:
        lines.append(f"block table {name}: {list(table)}")
    return "\n".join(lines)
