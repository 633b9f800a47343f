"""A radix tree of cached KV blocks with SGLang's eviction: least recently used leaves first (ch. 11).

vLLM finds a cached prefix through a hash index (chapter 04); SGLang's RadixAttention keeps the
cached prefixes as a tree instead. A path from the root spells a prefix, one node per block;
a node's ``key`` names its block's content (Mooncake's hash id, or a tuple of token ids). Two
requests that share a prefix share the nodes of that path.

Eviction removes *leaves only*: a node with children is the prefix of what they hold, and
without it they could never be reached again. Among the evictable leaves -- no children, no
holder (``ref_count == 0``) -- the one used longest ago goes first. Removing a leaf can make its
parent a leaf, which then competes by its own last use.

A holder references every node of its path (``lock``), so a referenced node's ancestors are
referenced too, and every unreferenced node can be evicted by removing leaves one after the
other: ``evictable`` counts them.

SGLang compresses a run of nodes with one child into a single edge of many tokens; here one
node holds one block. That changes the tree's size, not which blocks are cached.
"""
from __future__ import annotations

import heapq
from collections.abc import Hashable, Sequence

from course_pkg.validation import check_positive_int


class RadixNode:
    """One cached block: its key, its place in the tree, its holders and its last use."""

    __slots__ = ("key", "parent", "children", "ref_count", "last_access", "depth")

    def __init__(self, key: Hashable, parent: "RadixNode | None", depth: int):
        self.key = key
        self.parent = parent
        self.children: dict[Hashable, RadixNode] = {}
        self.ref_count = 0
        self.last_access = 0
        self.depth = depth

    def __repr__(self) -> str:
        return (f"RadixNode(key={self.key!r}, depth={self.depth}, ref_count={self.ref_count}, "
                f"last_access={self.last_access}, children={len(self.children)})")


class RadixCache:
    """At most ``num_blocks`` cached blocks as a tree of prefixes, evicting LRU leaves.

    Calls: ``match_prefix(keys)`` (the longest cached path; marks it used), ``insert(keys)``
    (adds the missing tail of the path, evicting first if the pool is full), ``lock`` /
    ``unlock`` (a holder's reference on each node of its path), ``evict(n)``.
    Time is a counter: ``tick()`` advances it; every node a call touches gets the current time.
    Invariants: ``num_cached <= num_blocks``; a node's ``ref_count`` is at most its parent's;
    ``evictable`` is the number of nodes with ``ref_count == 0``.
    """

    def __init__(self, num_blocks: int):
        check_positive_int("num_blocks", num_blocks)
        self.num_blocks = num_blocks
        self.root = RadixNode(None, None, 0)
        self.num_cached = 0
        self.evictable = 0
        self.clock = 0
        self._order = 0            # breaks ties between equal eviction keys: first pushed, first out
        self._heap: list = []      # (eviction key, order, node): candidates, checked when popped

    # ------------------------------------------------------------- the policy, in one line

    def eviction_key(self, node: RadixNode):
        """Smallest first: the leaf used longest ago. A foil or another policy overrides this line."""
        return node.last_access

    # ------------------------------------------------------------- calls

    def tick(self) -> int:
        self.clock += 1
        return self.clock

    @property
    def num_free(self) -> int:
        return self.num_blocks - self.num_cached

    def match_prefix(self, keys: Sequence[Hashable], *, touch: bool = True) -> list[RadixNode]:
        """The nodes of the longest cached prefix of ``keys``, root's child first.

        ``touch`` marks each of them used now (SGLang updates ``last_access_time`` on the path a
        lookup walks); ``touch=False`` only looks.
        """
        nodes: list[RadixNode] = []
        node = self.root
        for key in keys:
            node = node.children.get(key)
            if node is None:
                break
            if touch:
                node.last_access = self.clock
            nodes.append(node)
        if touch and nodes:
            self._push_if_evictable(nodes[-1])   # only the last node can be a leaf
        return nodes

    def insert(self, keys: Sequence[Hashable]) -> list[RadixNode]:
        """Cache the whole path ``keys``; returns its nodes, all marked used now. Evicts LRU leaves
        when the pool is full, never a node of this path; ``MemoryError`` (nothing changed) if
        that is not enough."""
        path = self.match_prefix(keys, touch=False)
        missing = len(keys) - len(path)
        if missing > self.num_free:
            unheld_on_path = sum(1 for node in path if node.ref_count == 0)
            if missing > self.num_free + self.evictable - unheld_on_path:
                raise MemoryError(f"{missing} new blocks do not fit: {self.num_free} free, "
                                  f"{self.evictable - unheld_on_path} evictable, the rest held or on this path")
            self.lock(path)        # the path's own unheld nodes must survive the eviction
            try:
                self.evict(missing - self.num_free)
            finally:
                self.unlock(path)
        path = self.match_prefix(keys)   # now mark the cached part used
        node = path[-1] if path else self.root
        for key in keys[len(path):]:
            child = RadixNode(key, node, node.depth + 1)
            child.last_access = self.clock
            node.children[key] = child
            self.num_cached += 1
            self.evictable += 1
            path.append(child)
            node = child
        if path:
            self._push_if_evictable(path[-1])
        return path

    def lock(self, nodes: Sequence[RadixNode]) -> None:
        """One more holder on each node (a request that holds this path)."""
        for node in nodes:
            if node.ref_count == 0:
                self.evictable -= 1
            node.ref_count += 1

    def unlock(self, nodes: Sequence[RadixNode]) -> None:
        """One holder fewer on each node; a node left unheld can be evicted (leaves first)."""
        for node in nodes:
            if node.ref_count <= 0:
                raise ValueError(f"unlock of a node nobody holds: {node!r}")
            node.ref_count -= 1
            if node.ref_count == 0:
                self.evictable += 1
                self._push_if_evictable(node)

    def evict(self, num: int) -> int:
        """Remove up to ``num`` unheld blocks, leaves first, smallest ``eviction_key`` first; how many went."""
        evicted = 0
        while evicted < num and self._heap:
            key, _, node = heapq.heappop(self._heap)
            if not self._is_evictable_leaf(node):
                continue           # held or given children since it was pushed
            if key != self.eviction_key(node):
                self._push_if_evictable(node)   # used since it was pushed: queue it again
                continue
            parent = node.parent
            del parent.children[node.key]
            node.parent = None
            self.num_cached -= 1
            self.evictable -= 1
            evicted += 1
            if parent is not self.root:
                self._push_if_evictable(parent)
        return evicted

    def nodes(self) -> list[RadixNode]:
        """Every cached node, depth first, children in insertion order."""
        out, stack = [], list(reversed(self.root.children.values()))
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(reversed(node.children.values()))
        return out

    # ------------------------------------------------------------- internals

    def _is_evictable_leaf(self, node: RadixNode) -> bool:
        return node.parent is not None and node.ref_count == 0 and not node.children

    def _push_if_evictable(self, node: RadixNode) -> None:
        if self._is_evictable_leaf(node):
            self._order += 1
            heapq.heappush(self._heap, (self.eviction_key(node), self._order, node))
