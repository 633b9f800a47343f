"""The tier in the engine: ``kv_transfer_config`` and the scheduler's side of the offloading
connector (chapter 15).

``LLM(kv_transfer_config={...})`` takes vLLM's keys::

    {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
     "kv_connector_extra_config": {"num_cpu_blocks": 1024, "eviction_policy": "lru"}}

``KVTransferConfig`` checks them (an unknown key is refused by name). ``OffloadingConnector`` is
what the Scheduler calls; the ModelRunner moves the bytes. A block's life with a tier:

1. **store** -- a step registers the blocks it completed (``BlockManager.hash_blocks``); at the
   end of that step the connector asks the tier for room (``prepare_store``: it may evict) and
   notes the copies, device block -> tier slot. The *next* step makes them first of all, before
   its forward pass writes anything (a finished request's blocks may be handed out again by
   then, but their K/V are still there), and records them done (``complete_store``). vLLM's
   connector, too, stores a block once it is full and computed: *store on compute*, so the tier
   holds copies of blocks the device pool may still hold.
2. **lookup and load** -- a request admitted with ``d`` leading hits in the device pool asks
   the tier for the blocks after them (``lookup``). Each block it finds is *confirmed* as the
   device pool confirms a hit: the same tokens, right after the same exact prefix (the parent's
   prefix id), and for a first block the same ``cache_salt`` -- the hash only finds a
   candidate, so a hash collision loads nothing wrong. The confirmed run is protected
   (``prepare_load``) and copied, tier slot -> the request's fresh device blocks, before the
   step's forward pass; the request's computed tokens grow by those blocks, and the step
   registers them in the device pool like any block it computed. ``complete_load`` ends the
   protection when the step is recorded.
3. **evict** -- only the tier's policy (LRU, ARC, the reuse gate) decides what leaves it.

Every change here is part of the step's transaction: the connector and the tier's bookkeeping
are journaled with the Scheduler, so a step that fails is undone with its stores and loads
decided. The bytes a failed step copied are dealt with as the device's are: a load wrote fresh
device blocks (the runner notes them, ``forget_overwritten`` drops their cache entries); a
store wrote only tier slots still being stored, which the retry writes again -- unless its
source block was overwritten, and then that store fails (``forget_overwritten`` here).
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from course_pkg.block_manager import BlockManager, PrefixCacheStats
from course_pkg.offload.disk import DiskTier, prefix_digests
from course_pkg.offload.manager import (ARCOffloadingManager, FilterReusedOffloadingManager, LRUOffloadingManager,
                                        OffloadingManager, SLRUOffloadingManager)
from course_pkg.sequence import Sequence
from course_pkg.validation import check_choice, check_int, check_positive_int

EVICTION_POLICIES = {"lru": LRUOffloadingManager, "arc": ARCOffloadingManager,
                     "slru": SLRUOffloadingManager}   # (the last is the course's, not vLLM's)
#: vLLM's ``KVTransferConfig`` fields that the course's tier does not have (refused by name).
_NOT_HERE = {"kv_buffer_device", "kv_buffer_size", "kv_rank", "kv_parallel_size", "kv_ip", "kv_port", "engine_id",
             "kv_connector_module_path", "kv_load_failure_policy"}


@dataclass(frozen=True)
class KVTransferConfig:
    """``kv_transfer_config``, checked: vLLM's keys, for vLLM's ``OffloadingConnector`` with a CPU
    tier. ``kv_connector_extra_config`` takes the tier's size -- ``num_cpu_blocks`` (vLLM 0.11's key)
    or ``cpu_bytes_to_use`` (later versions'; the engine turns it into blocks, ``in_blocks``) --
    and, for a disk tier behind it (the course's keys: vLLM's later ``TieringOffloadingSpec`` takes
    ``secondary_tiers`` instead), ``disk_path``, ``num_disk_blocks`` and ``disk_eviction_policy``;
    ``eviction_policy``
    ("lru" or "arc", vLLM's; or the course's "slru"), ``store_threshold`` (store a block only once ``lookup`` has been asked for
    it that many times; below 2: no gate) with ``max_tracker_size``, and ``block_size`` (only the
    device's: the course's tier stores whole device blocks)."""

    kv_connector: str = "OffloadingConnector"
    kv_role: str = "kv_both"
    num_cpu_blocks: int = 0
    cpu_bytes_to_use: int | None = None
    eviction_policy: str = "lru"
    store_threshold: int = 0
    max_tracker_size: int = 64_000
    block_size: int | None = None
    disk_path: str | None = None
    num_disk_blocks: int | None = None
    disk_eviction_policy: str = "lru"

    @classmethod
    def from_dict(cls, config) -> "KVTransferConfig":
        if isinstance(config, KVTransferConfig):
            return config
        if not isinstance(config, Mapping):
            raise TypeError(f"kv_transfer_config must be a dict, got {type(config).__name__}")
        for key in config:
            if key in _NOT_HERE:
                raise ValueError(f"kv_transfer_config key {key!r} is vLLM's but configures a transfer between "
                                 "engines; the course's OffloadingConnector has no such part")
            if key not in ("kv_connector", "kv_role", "kv_connector_extra_config"):
                raise ValueError(f"unknown kv_transfer_config key {key!r}; known: 'kv_connector', 'kv_role', "
                                 "'kv_connector_extra_config'")
        extra = config.get("kv_connector_extra_config", {})
        if not isinstance(extra, Mapping):
            raise TypeError(f"kv_connector_extra_config must be a dict, got {type(extra).__name__}")
        known = ("num_cpu_blocks", "cpu_bytes_to_use", "eviction_policy", "store_threshold", "max_tracker_size",
                 "block_size", "disk_path", "num_disk_blocks", "disk_eviction_policy")
        for key in extra:
            if key not in known:
                raise ValueError(f"unknown kv_connector_extra_config key {key!r}; known: "
                                 f"{', '.join(repr(k) for k in known)}")
        if ("num_cpu_blocks" in extra) == ("cpu_bytes_to_use" in extra):
            raise ValueError("kv_connector_extra_config needs the tier's size once: 'num_cpu_blocks' (in blocks) "
                             "or 'cpu_bytes_to_use' (in bytes)")
        return cls(kv_connector=config.get("kv_connector", "OffloadingConnector"),
                   kv_role=config.get("kv_role", "kv_both"),
                   **{key: extra[key] for key in known if key in extra})

    def __post_init__(self):
        check_choice("kv_connector", self.kv_connector, ("OffloadingConnector",))
        check_choice("kv_role", self.kv_role, ("kv_both",))   # the tier both stores and loads
        if self.cpu_bytes_to_use is None:
            check_positive_int("num_cpu_blocks", self.num_cpu_blocks)
        else:
            check_positive_int("cpu_bytes_to_use", self.cpu_bytes_to_use)
        check_choice("eviction_policy", self.eviction_policy, tuple(EVICTION_POLICIES))
        check_int("store_threshold", self.store_threshold, minimum=0)
        check_positive_int("max_tracker_size", self.max_tracker_size)
        if self.block_size is not None:
            check_positive_int("block_size", self.block_size)
        if (self.disk_path is None) != (self.num_disk_blocks is None):
            raise ValueError("a disk tier needs both disk_path and num_disk_blocks in kv_connector_extra_config")
        if self.disk_path is not None:
            if not isinstance(self.disk_path, (str, os.PathLike)):
                raise TypeError(f"disk_path must be a directory path, got {type(self.disk_path).__name__}")
            object.__setattr__(self, "disk_path", os.fspath(self.disk_path))
            check_positive_int("num_disk_blocks", self.num_disk_blocks)
        check_choice("disk_eviction_policy", self.disk_eviction_policy, tuple(EVICTION_POLICIES))

    def in_blocks(self, block_bytes: int) -> "KVTransferConfig":
        """This config with the tier's size in blocks of ``block_bytes`` (K and V, every layer)."""
        if self.cpu_bytes_to_use is None:
            return self
        num_blocks = self.cpu_bytes_to_use // block_bytes
        if num_blocks < 1:
            raise ValueError(f"cpu_bytes_to_use={self.cpu_bytes_to_use} leaves room for no block of {block_bytes} bytes")
        return replace(self, num_cpu_blocks=num_blocks, cpu_bytes_to_use=None)

    def check_pool(self, block_size: int, enable_prefix_caching: bool) -> None:
        """The rules between the tier and the device pool (the Scheduler checks them, and
        ``EngineConfig`` through here before the model loads)."""
        if self.block_size is not None and self.block_size != block_size:
            raise ValueError(f"kv_connector_extra_config block_size={self.block_size} but the engine's block_size is "
                             f"{block_size}; the course's tier stores whole device blocks (leave it out)")
        if not enable_prefix_caching:
            raise ValueError("kv_transfer_config needs prefix caching: the tier stores and finds blocks by the "
                             "hash they are registered under, and enable_prefix_caching is False")

    def make_connector(self, block_manager: BlockManager, disk: DiskTier | None = None) -> "OffloadingConnector":
        """The Scheduler's side of this tier over ``block_manager``; ``disk``: the directory of the
        disk tier, when this config names one (the engine opens it: it knows the model)."""
        if self.cpu_bytes_to_use is not None:
            raise ValueError("the tier is sized in bytes (cpu_bytes_to_use): turn it into blocks first (in_blocks)")
        if (disk is None) != (self.disk_path is None):
            raise ValueError("kv_connector_extra_config's disk_path needs the DiskTier opened on it (and only then)")
        manager = EVICTION_POLICIES[self.eviction_policy](self.num_cpu_blocks)
        if self.store_threshold >= 2:
            manager = FilterReusedOffloadingManager(manager, self.store_threshold, self.max_tracker_size)
        disk_manager = EVICTION_POLICIES[self.disk_eviction_policy](self.num_disk_blocks, "DISK") if disk else None
        return OffloadingConnector(manager, block_manager, disk_manager, disk)


@dataclass
class OffloadingConnector:
    """The Scheduler's side of the tier: what to load for an admitted request, what to store
    after a step, and the bookkeeping between the two (see the module docstring).

    ``names`` maps each hash the CPU tier holds to the *digest* of the block stored under it --
    the SHA-256 of its whole prefix, salt and tokens (``disk.prefix_digests``) -- so that a load is
    confirmed exactly: a hash only finds a candidate. ``stores`` are the copies decided at the end
    of the last step (device block, tier slot), made at the start of the next one; ``storing`` and
    ``loading`` the hashes of the copies the open step makes. With a disk tier behind the CPU tier
    (``disk``, its own ``disk_manager`` and policy, ``disk_names``), every block stored in the CPU
    tier is written to disk too (``writes``, made by the next step), and a request reads from disk
    the blocks after those the CPU tier had. ``stats`` counts, per first admission, the tokens
    asked for and the tokens the tiers provided (vLLM's ``external_prefix_cache_queries`` and
    ``_hits``)."""

    manager: OffloadingManager | FilterReusedOffloadingManager
    block_manager: BlockManager
    disk_manager: OffloadingManager | None = None
    disk: DiskTier | None = None
    names: dict[int, bytes] = field(default_factory=dict)
    stores: list[tuple[int, int]] = field(default_factory=list)
    storing: dict[int, int] = field(default_factory=dict)   # tier slot -> hash, for the open step's stores
    loading: list[int] = field(default_factory=list)
    disk_names: dict[int, bytes] = field(default_factory=dict)
    writes: list[tuple[int, int, bytes]] = field(default_factory=list)   # (device block, hash, digest)
    deletes: list[int] = field(default_factory=list)   # files of blocks the disk tier gave up
    # seq_id -> (blocks digested, the last one's digest): a running sequence's digests go on from
    # there, so each block is hashed once (dropped when the sequence finishes)
    chains: dict[int, tuple[int, bytes]] = field(default_factory=dict)
    disk_loading: list[int] = field(default_factory=list)
    stats: PrefixCacheStats = field(default_factory=PrefixCacheStats)

    def __post_init__(self):
        if self.disk is not None:   # a directory an earlier engine wrote: its blocks, oldest first
            for block_hash, digest in self.disk.scan():
                out = self.disk_manager.prepare_store([block_hash])
                for h in out.block_hashes_evicted:   # more files than the tier holds: the oldest go
                    del self.disk_names[h]
                    self.disk.delete(h)
                self.disk_manager.complete_store([block_hash])
                self.disk_names[block_hash] = digest

    # ---------------------------------------------------------------- admission: lookup and load

    def load(self, seq: Sequence) -> tuple[list[tuple[int, int]], list[tuple[bytes, int]]]:
        """``seq`` was just allocated with its device hits: find the blocks after them in the CPU
        tier, then the disk tier, confirm them, and protect them; returns the copies to make,
        ``(tier slot, device block)`` and ``(bytes read from disk, device block)``, and counts them
        as computed (``seq.num_cached_tokens``)."""
        bs = self.block_manager.block_size
        first = seq.num_cached_tokens // bs            # the device pool's hits
        last = (seq.num_tokens - 1) // bs              # never the block of the prompt's last token
        hashes = self._hashes(seq, first, last)
        digests = prefix_digests(seq.token_ids, bs, last, seq.cache_salt)[first:]
        found = self.manager.lookup(hashes)
        cpu = 0   # (a hash found under another prefix's digest is a collision, not a hit)
        while cpu < found and self.names[hashes[cpu]] == digests[cpu]:
            cpu += 1
        payloads = []
        if self.disk is not None:
            on_disk = self.disk_manager.lookup(hashes[cpu:])
            for h, digest in zip(hashes[cpu:cpu + on_disk], digests[cpu:]):
                payload = self.disk.read(h, digest) if self.disk_names[h] == digest else None
                if payload is None:   # another prefix's (a collision), or a file missing, truncated, corrupt
                    if self.disk_names[h] == digest and self.disk_manager.remove(h):
                        self._forget_on_disk([h])   # a bad file: the tier forgets it (a miss, never used)
                    break
                payloads.append(payload)
        hit = cpu + len(payloads)
        self.stats.record(seq.num_tokens, hit * bs, preempted=seq.num_preemptions > 0)
        copies, reads = [], []
        if cpu:
            spec = self.manager.prepare_load(hashes[:cpu])
            self.loading += hashes[:cpu]
            copies = list(zip(spec.block_ids, seq.block_table[first:first + cpu]))
        if payloads:
            self.disk_manager.prepare_load(hashes[cpu:hit])
            self.disk_loading += hashes[cpu:hit]
            reads = list(zip(payloads, seq.block_table[first + cpu:first + hit]))
        seq.num_cached_tokens += hit * bs
        self.manager.touch(seq.block_hashes[:first] + hashes)   # the request used all its full blocks
        if self.disk is not None:
            self.disk_manager.touch(seq.block_hashes[:first] + hashes)
        return copies, reads

    def _hashes(self, seq: Sequence, first: int, last: int) -> list[int]:
        """The chained hashes of ``seq``'s blocks ``first .. last - 1`` (the device pool's own)."""
        bm = self.block_manager
        h = seq.block_hashes[first - 1] if first else bm.salt_hash(seq.cache_salt)
        hashes = []
        for i in range(first, last):
            h = bm.compute_hash(seq.block(i), h)
            hashes.append(h)
        return hashes

    # ---------------------------------------------------------------- the step

    def begin_step(self) -> tuple[list[tuple[int, int]], list[tuple[int, int, bytes]]]:
        """The copies this step makes first: into the CPU tier ``(device block, tier slot)``, and
        onto disk ``(device block, hash, digest)``. The files of the blocks the disk tier gave up
        in the last step go now, once that step stands: a step undone gives a block back to the
        tier's lists, and its file must still be there. (Deleting twice is harmless.)"""
        for h in self.deletes:
            self.disk.delete(h)
        self.deletes.clear()
        stores, self.stores = self.stores, []
        writes, self.writes = self.writes, []
        return stores, writes

    def end_step(self, out) -> None:
        """The step ``out`` (its ``SchedulerOutput``) ran: its loads and its stores are done; then
        room is made for the blocks it registered -- each sequence's blocks from its computed
        tokens when scheduled to those registered now -- whose copies the next step makes. (Called
        before the step's finished sequences release their blocks.)"""
        self.manager.complete_load(self.loading)
        self.loading.clear()
        self.manager.complete_store([self.storing.pop(slot) for _, slot in out.blocks_to_store])
        if self.disk is not None:
            self.disk_manager.complete_load(self.disk_loading)
            self.disk_loading.clear()
            self.disk_manager.complete_store([h for _, h, _ in out.blocks_to_store_on_disk])
        bs = self.block_manager.block_size
        blocks: dict[int, tuple[int, bytes]] = {}   # hash -> (device block, digest), each once
        for seq, computed, scheduled in zip(out.seqs, out.num_computed_tokens, out.num_scheduled_tokens):
            new = range(computed // bs, min((computed + scheduled) // bs, len(seq.block_hashes)))
            if new:
                digests = self._digests(seq, new)
                for i, digest in zip(new, digests):
                    blocks.setdefault(seq.block_hashes[i], (seq.block_table[i], digest))
            if seq.is_finished:
                self.chains.pop(seq.seq_id, None)
        stored = self.manager.prepare_store(list(blocks))
        if stored is not None:   # (None: every block the tier could give up is being loaded or stored)
            for h in stored.block_hashes_evicted:
                del self.names[h]
            for h, slot in zip(stored.block_hashes_to_store, stored.store_spec.block_ids):
                self.names[h] = blocks[h][1]
                self.stores.append((blocks[h][0], slot))
                self.storing[slot] = h
        if self.disk is not None:
            written = self.disk_manager.prepare_store(list(blocks))
            if written is not None:
                self._forget_on_disk(written.block_hashes_evicted)
                for h in written.block_hashes_to_store:
                    self.disk_names[h] = blocks[h][1]
                    self.writes.append((blocks[h][0], h, blocks[h][1]))

    def _digests(self, seq: Sequence, blocks: range) -> list[bytes]:
        """The prefix digests of ``seq``'s blocks ``blocks``, going on from the last block this
        sequence had digested (its tokens only grow) or from its first block."""
        done, last = self.chains.get(seq.seq_id, (0, None))
        if done > blocks.start or done == 0:
            done, last = 0, None
        digests = prefix_digests(seq.token_ids, self.block_manager.block_size, blocks.stop, seq.cache_salt,
                                 start=done, previous=last)
        if len(self.chains) > 4096:   # (sequences aborted mid-run leave theirs behind: start afresh)
            self.chains.clear()
        self.chains[seq.seq_id] = (blocks.stop, digests[-1])
        return digests[blocks.start - done:]

    def _forget_on_disk(self, block_hashes) -> None:
        for h in block_hashes:
            del self.disk_names[h]
            self.deletes.append(h)

    def forget_overwritten(self, written: dict[int, int]) -> None:
        """A failed step overwrote device blocks (``{block id: first offset}``): a store decided
        from one of them would copy what is no longer its block's K/V, so it fails instead."""
        failed = [(block_id, slot) for block_id, slot in self.stores if block_id in written]
        if failed:
            hashes = [self.storing.pop(slot) for _, slot in failed]
            self.manager.complete_store(hashes, success=False)
            for h in hashes:
                del self.names[h]
            self.stores = [pair for pair in self.stores if pair[0] not in written]
        lost = [h for block_id, h, _ in self.writes if block_id in written]
        if lost:
            self.disk_manager.complete_store(lost, success=False)
            for h in lost:
                del self.disk_names[h]
            self.writes = [w for w in self.writes if w[0] not in written]
