"""Immutable snapshots of the BlockManager's state, and their deterministic text form.

A snapshot copies everything the reader needs to see after a call -- per block its id, ref
count, hash and tokens; the free queue in order; the used set; the hash index; each live
sequence's block table -- so later calls cannot change a picture already taken.
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
    token_ids: tuple[int, ...]


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
    return Snapshot(
        label=label,
        block_size=bm.block_size,
        blocks=tuple(BlockState(b.block_id, b.ref_count, b.hash, tuple(b.token_ids)) for b in bm.blocks),
        free_queue=tuple(bm.free_block_ids),
        used=tuple(sorted(bm.used_block_ids)),
        hash_index=tuple(sorted(((h, b) for h, b in bm.hash_to_block_id.items()), key=lambda x: (x[1], x[0]))),
        block_tables=tuple((name, tuple(seq.block_table)) for name, seq in _named(seqs) if seq.block_table),
    )


def short_hash(h: int) -> str:
    """A 4-hex-digit tag for a 64-bit hash, enough to tell a handful of blocks apart."""
    return "-" if h == -1 else f"{h & 0xFFFF:04x}"


def _tokens(token_ids: tuple[int, ...], limit: int = 8) -> str:
    if not token_ids:
        return "-"
    shown = " ".join(map(str, token_ids[:limit]))
    return f"[{shown}{' ...' if len(token_ids) > limit else ''}]"


def render_text(snap: Snapshot, max_rows: int = 64) -> str:
    """Deterministic text form of a snapshot: the same state prints the same characters."""
    lines = []
    if snap.label:
        lines.append(f"== {snap.label}")
    lines.append("block  ref  state      hash  tokens")
    rows = [b for b in snap.blocks if b.ref_count or b.hash != -1]
    for b in rows[:max_rows]:
        lines.append(f"{b.block_id:5d}  {b.ref_count:3d}  {snap.state(b.block_id):9s}  "
                     f"{short_hash(b.hash):>4s}  {_tokens(b.token_ids)}")
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
