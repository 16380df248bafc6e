"""The waiting sequences, in admission order, with removal in O(1).

A deque sorted every step cost a step O(n log n) host time however few it admitted, and each removal
O(n): aborting 6,400 queued sequences took 12.3 s. Here a heap keeps the order (add O(log n)); a
removed sequence leaves its heap entry behind, dropped when it reaches the top or, once stale entries
outnumber the members, all at once (amortized O(1) a removal).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterator

from goodserve.engine.core.sequence import Sequence

# Rebuild the heap once it holds this many entries beyond twice the members.
_COMPACT_SLACK = 64


class WaitingQueue:
    """Sequences ordered by key(seq), smallest first. The key is read once, at add: a waiting
    sequence does not change (it computes and generates nothing). Iteration gives the members in the
    order they were added."""

    def __init__(self, key: Callable[[Sequence], tuple | int]) -> None:
        self._key = key
        self._heap: list[tuple] = []  # (key, ticket, seq); a ticket no member holds marks a removed entry
        self._members: dict[str, tuple[int, Sequence]] = {}  # seq_id -> (ticket, seq)
        self._tickets = itertools.count()

    def __len__(self) -> int:
        return len(self._members)

    def __bool__(self) -> bool:
        return bool(self._members)

    def __iter__(self) -> Iterator[Sequence]:
        return (seq for _, seq in self._members.values())

    def __contains__(self, seq: Sequence) -> bool:
        member = self._members.get(seq.seq_id)
        return member is not None and member[1] is seq

    def add(self, seq: Sequence) -> None:
        assert seq.seq_id not in self._members, f"{seq.seq_id} is already waiting"
        ticket = next(self._tickets)
        self._members[seq.seq_id] = (ticket, seq)
        heapq.heappush(self._heap, (self._key(seq), ticket, seq))

    def remove(self, seq: Sequence) -> bool:
        """Take seq out if it is waiting; whether it was."""
        if seq not in self:
            return False
        del self._members[seq.seq_id]
        if len(self._heap) > 2 * len(self._members) + _COMPACT_SLACK:
            self._heap = [entry for entry in self._heap if self._holds(entry)]
            heapq.heapify(self._heap)
        return True

    def peek(self) -> Sequence | None:
        """The first sequence in order, or None."""
        while self._heap and not self._holds(self._heap[0]):
            heapq.heappop(self._heap)
        return self._heap[0][2] if self._heap else None

    def in_order(self) -> Iterator[Sequence]:
        """The members, smallest key first, lazily: the first k cost O(k log k), not the queue.
        The queue must not change while this runs."""
        frontier = [(self._heap[0], 0)] if self._heap else []
        while frontier:
            entry, i = heapq.heappop(frontier)
            if self._holds(entry):
                yield entry[2]
            for child in (2 * i + 1, 2 * i + 2):
                if child < len(self._heap):
                    heapq.heappush(frontier, (self._heap[child], child))

    def leading(self, keeps: Callable) -> Iterator[Sequence]:
        """The members whose key `keeps` accepts, where keeps(key) implies keeps(every smaller key):
        a walk down the heap from its top that stops at the first refused key of each path, so it
        costs the members it yields (and as many removed entries at most, amortized), not the queue."""
        stack = [0]
        while stack:
            i = stack.pop()
            if i < len(self._heap) and keeps(self._heap[i][0]):
                if self._holds(self._heap[i]):
                    yield self._heap[i][2]
                stack += (2 * i + 1, 2 * i + 2)

    def _holds(self, entry: tuple) -> bool:
        member = self._members.get(entry[2].seq_id)
        return member is not None and member[0] == entry[1]
