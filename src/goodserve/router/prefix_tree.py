"""Which replica served which prompt prefix: an approximate prefix tree, as SGLang's cache-aware router keeps.

A prompt's text is cut into chunks of `chunk_chars` characters (about a KV block of tokens); node i
is identified by the chained hash of chunks 0..i, so two prompts share the nodes of their common
whole-chunk prefix, and a lookup walks the chain until a node is missing. Each node remembers the
replicas that served it (most recent last); nodes live in one LRU of at most `max_nodes`, since a
replica's own prefix cache forgets its least recently used blocks too.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class PrefixMatch:
    backends: tuple[str, ...]  # replicas that served the longest matched prefix, most recent last
    matched_chars: int


def _chain(text: str, chunk_chars: int) -> Iterator[int]:
    """The node ids of text's whole chunks, root first."""
    node = 0
    for start in range(0, len(text) - chunk_chars + 1, chunk_chars):
        node = hash((node, text[start:start + chunk_chars]))
        yield node


class PrefixTree:
    def __init__(self, chunk_chars: int = 64, max_nodes: int = 100_000):
        self.chunk_chars = chunk_chars
        self.max_nodes = max_nodes
        self.nodes: OrderedDict[int, dict[str, None]] = OrderedDict()  # node -> backends, an ordered set

    def match(self, text: str, among: set[str]) -> PrefixMatch:
        """The longest prefix of text that one of `among` served."""
        best = PrefixMatch((), 0)
        for depth, node in enumerate(_chain(text, self.chunk_chars), start=1):
            served = self.nodes.get(node)
            if served is None:
                break
            candidates = tuple(url for url in served if url in among)
            if candidates:
                best = PrefixMatch(candidates, depth * self.chunk_chars)
        return best

    def insert(self, text: str, backend: str) -> None:
        for node in _chain(text, self.chunk_chars):
            served = self.nodes.setdefault(node, {})
            served.pop(backend, None)
            served[backend] = None
            self.nodes.move_to_end(node)
        while len(self.nodes) > self.max_nodes:
            self.nodes.popitem(last=False)

    def forget(self, backend: str) -> None:
        """A replica that went down comes back with an empty cache."""
        for node in list(self.nodes):
            served = self.nodes[node]
            served.pop(backend, None)
            if not served:
                del self.nodes[node]
