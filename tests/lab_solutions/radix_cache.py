"""A correct solution of lab `radix_cache`, written differently from the package: no heap,
eviction scans every node for the least recently used unheld leaf.

Grade it like a student's file: ``python -m course_pkg.labs radix_cache tests/lab_solutions/radix_cache.py``.
"""
from course_pkg.radix_tree import RadixCache


class StudentRadixCache(RadixCache):
    """A correct radix cache written differently: no heap, eviction scans every node."""

    def match_prefix(self, keys, *, touch=True):
        nodes, node = [], self.root
        for key in keys:
            if key not in node.children:
                break
            node = node.children[key]
            nodes.append(node)
        if touch:
            for n in nodes:
                n.last_access = self.clock
        return nodes

    def insert(self, keys):
        path = self.match_prefix(keys, touch=False)
        new = len(keys) - len(path)
        spare = self.num_blocks - self.num_cached
        if new > spare:
            evictable_elsewhere = self.evictable - sum(1 for n in path if n.ref_count == 0)
            if new > spare + evictable_elsewhere:
                raise MemoryError("no room")
            self.lock(path)
            self.evict(new - spare)
            self.unlock(path)
        path = self.match_prefix(keys)
        parent = path[-1] if path else self.root
        for key in keys[len(path):]:
            child = type(self.root)(key, parent, parent.depth + 1)
            child.last_access = self.clock
            parent.children[key] = child
            self.num_cached += 1
            self.evictable += 1
            path.append(child)
            parent = child
        return path

    def evict(self, num):
        done = 0
        leaves = {n for n in self.nodes() if n.ref_count == 0 and not n.children} if num > 0 else set()
        while done < num and leaves:
            victim = min(leaves, key=lambda n: n.last_access)
            leaves.remove(victim)
            parent = victim.parent
            del parent.children[victim.key]
            victim.parent = None
            self.num_cached -= 1
            self.evictable -= 1
            done += 1
            if parent is not self.root and parent.ref_count == 0 and not parent.children:
                leaves.add(parent)
        return done
