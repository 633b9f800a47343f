"""A correct solution of lab `arc_tier`, written differently from the package: lists built whole,
a counter loop for the lookup.

Grade it like a student's file: ``python -m course_pkg.labs arc_tier tests/lab_solutions/arc_tier.py``.
"""
from course_pkg.offload.manager import ARCOffloadingManager


class StudentARCOffloadingManager(ARCOffloadingManager):
    def lookup(self, block_hashes):
        block_hashes = list(block_hashes)
        n = 0
        while n < len(block_hashes) and self._find(block_hashes[n]) is not None and self._find(block_hashes[n]).is_ready:
            n += 1
        self.stats.queried += len(block_hashes)
        self.stats.hits += n
        return n

    def touch(self, block_hashes):
        for h in list(block_hashes)[::-1]:
            if h in self.t1 and self.t1[h].is_ready:
                block = self.t1.pop(h)
                self.t2[h] = block
            elif h in self.t1:
                self.t1.move_to_end(h)
            elif h in self.t2:
                self.t2.move_to_end(h)
            elif h in self.b1:
                step = max(1, len(self.b2) // len(self.b1))
                self.p = min(self.num_blocks, self.p + step)
                self.b1.move_to_end(h)
            elif h in self.b2:
                step = max(1, len(self.b1) // len(self.b2))
                self.p = max(0, self.p - step)
                self.b2.move_to_end(h)

    def _eviction_order(self, n, incoming):
        if n <= 0:
            return []
        first = [h for h, b in self.t1.items() if b.ref_cnt == 0]
        second = [h for h, b in self.t2.items() if b.ref_cnt == 0]
        left_in_t1 = len(self.t1)
        victims = []
        while len(victims) < n:
            if first and (left_in_t1 > self.p or not second):
                victims.append(first.pop(0))
                left_in_t1 -= 1
            elif second:
                victims.append(second.pop(0))
            else:
                return None
        return victims
