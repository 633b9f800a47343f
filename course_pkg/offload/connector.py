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

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from course_pkg.block_manager import BlockManager, PrefixCacheStats
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
                 "block_size")
        for key in extra:
            if key in ("disk_path", "num_disk_blocks"):
                raise ValueError(f"kv_connector_extra_config key {key!r}: the disk tier is not built yet; "
                                 "only the CPU tier (num_cpu_blocks) is")
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

    def make_manager(self) -> OffloadingManager | FilterReusedOffloadingManager:
        if self.cpu_bytes_to_use is not None:
            raise ValueError("the tier is sized in bytes (cpu_bytes_to_use): turn it into blocks first (in_blocks)")
        manager = EVICTION_POLICIES[self.eviction_policy](self.num_cpu_blocks)
        if self.store_threshold >= 2:
            return FilterReusedOffloadingManager(manager, self.store_threshold, self.max_tracker_size)
        return manager


@dataclass
class OffloadingConnector:
    """The Scheduler's side of the tier: what to load for an admitted request, what to store
    after a step, and the bookkeeping between the two (see the module docstring).

    ``names`` maps each hash the tier holds to the exact name of the block stored under it --
    ``(prefix id, parent prefix id, tokens, salt)``, read off the device block when it was
    stored -- so that a load is confirmed exactly. ``stores`` are the copies decided at the end
    of the last step (device block, tier slot), made at the start of the next one; ``storing``
    and ``loading`` the hashes of the copies the open step makes. ``stats`` counts, per first
    admission, the tokens asked for and the tokens the tier provided (vLLM's
    ``external_prefix_cache_queries`` and ``_hits``)."""

    manager: OffloadingManager | FilterReusedOffloadingManager
    block_manager: BlockManager
    names: dict[int, tuple] = field(default_factory=dict)
    stores: list[tuple[int, int]] = field(default_factory=list)
    storing: dict[int, int] = field(default_factory=dict)   # tier slot -> hash, for the open step's stores
    loading: list[int] = field(default_factory=list)
    stats: PrefixCacheStats = field(default_factory=PrefixCacheStats)

    # ---------------------------------------------------------------- admission: lookup and load

    def load(self, seq: Sequence) -> list[tuple[int, int]]:
        """``seq`` was just allocated with its device hits: find the blocks after them in the
        tier, confirm them, and protect them; returns the copies to make, ``(tier slot, device
        block)``, and counts them as computed (``seq.num_cached_tokens``)."""
        bm = self.block_manager
        bs = bm.block_size
        first = seq.num_cached_tokens // bs            # the device pool's hits
        last = (seq.num_tokens - 1) // bs              # never the block of the prompt's last token
        hashes = self._hashes(seq, first, last)
        found = self.manager.lookup(hashes)
        parent_prefix_id = bm.blocks[seq.block_table[first - 1]].prefix_id if first else -1
        confirmed = 0
        for i, h in enumerate(hashes[:found]):
            prefix_id, parent, tokens, salt = self.names[h]
            if (tokens, parent, salt) != (tuple(seq.block(first + i)), parent_prefix_id,
                                          seq.cache_salt if first + i == 0 else None):
                break   # the hash names another prefix here: a collision, not a hit
            parent_prefix_id = prefix_id
            confirmed += 1
        self.stats.record(seq.num_tokens, confirmed * bs, preempted=seq.num_preemptions > 0)
        copies = []
        if confirmed:
            spec = self.manager.prepare_load(hashes[:confirmed])
            self.loading += hashes[:confirmed]
            seq.num_cached_tokens += confirmed * bs
            copies = list(zip(spec.block_ids, seq.block_table[first:first + confirmed]))
        self.manager.touch(seq.block_hashes[:first] + hashes)   # the request used all its full blocks
        return copies

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

    def begin_step(self) -> list[tuple[int, int]]:
        """The copies into the tier that this step makes first, ``(device block, tier slot)``."""
        stores, self.stores = self.stores, []
        return stores

    def end_step(self, stored: list[tuple[int, int]], registered: list[int]) -> None:
        """The step ran: its loads and its stores (``stored``, the step's ``blocks_to_store``)
        are done; then room is made for the blocks it registered (``registered``, device block
        ids), whose copies the next step makes."""
        self.manager.complete_load(self.loading)
        self.loading.clear()
        self.manager.complete_store([self.storing.pop(slot) for _, slot in stored])
        bm = self.block_manager
        blocks = {}
        for block_id in registered:
            block = bm.blocks[block_id]
            blocks.setdefault(block.hash, block)   # (a block shared with a fork is registered once)
        out = self.manager.prepare_store(list(blocks))
        if out is None:   # every block the tier could give up is being loaded or stored: skip these
            return
        for h in out.block_hashes_evicted:
            del self.names[h]
        for h, slot in zip(out.block_hashes_to_store, out.store_spec.block_ids):
            block = blocks[h]
            self.names[h] = (block.prefix_id, block.parent_prefix_id, tuple(block.token_ids), block.cache_salt)
            self.stores.append((block.block_id, slot))
            self.storing[slot] = h

    def forget_overwritten(self, written: dict[int, int]) -> None:
        """A failed step overwrote device blocks (``{block id: first offset}``): a store decided
        from one of them would copy what is no longer its block's K/V, so it fails instead."""
        failed = [(block_id, slot) for block_id, slot in self.stores if block_id in written]
        if not failed:
            return
        hashes = [self.storing.pop(slot) for _, slot in failed]
        self.manager.complete_store(hashes, success=False)
        for h in hashes:
            del self.names[h]
        self.stores = [pair for pair in self.stores if pair[0] not in written]
