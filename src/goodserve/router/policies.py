"""Which healthy replica takes a request: round-robin (the baseline), least-load, prefix-aware."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from goodserve.router.backend import Backend
from goodserve.router.prefix_tree import PrefixTree

POLICIES = ("prefix", "least-load", "round-robin")


@dataclass(frozen=True)
class Choice:
    backend: Backend
    reason: str  # counted in goodserve:router_decisions_total


class RoundRobin:
    def __init__(self):
        self._turn = itertools.count()

    def choose(self, candidates: list[Backend], prompt: str) -> Choice:
        return Choice(candidates[next(self._turn) % len(candidates)], "round_robin")


class LeastLoad:
    """Fewest requests on the replica, then fewest prompt characters in flight; ties rotate, so idle
    replicas share the work instead of the first one taking it all."""

    def __init__(self):
        self._turn = itertools.count()

    def choose(self, candidates: list[Backend], prompt: str) -> Choice:
        return Choice(self.least_loaded(candidates), "least_load")

    def least_loaded(self, candidates: list[Backend]) -> Backend:
        start = next(self._turn) % len(candidates)
        rotated = candidates[start:] + candidates[:start]
        return min(rotated, key=lambda b: (b.load, b.in_flight_chars))


class PrefixAware:
    """SGLang's cache-aware routing: a request goes where the longest part of its prompt was served
    before (that replica's prefix cache likely still holds it), unless the replicas' loads are too
    far apart or too little of the prompt matched; then least-load decides."""

    def __init__(self, tree: PrefixTree, match_threshold: float = 0.3, balance_abs_threshold: float = 32,
                 balance_rel_threshold: float = 1.5):
        self.tree = tree
        self.match_threshold = match_threshold  # matched share of the prompt that counts as a hit
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.least_load = LeastLoad()

    def imbalanced(self, candidates: list[Backend]) -> bool:
        loads = [b.load for b in candidates]
        most, least = max(loads), min(loads)
        return most - least > self.balance_abs_threshold and most > least * self.balance_rel_threshold

    def choose(self, candidates: list[Backend], prompt: str) -> Choice:
        choice = self._decide(candidates, prompt)
        self.tree.insert(prompt, choice.backend.url)
        return choice

    def _decide(self, candidates: list[Backend], prompt: str) -> Choice:
        if self.imbalanced(candidates):
            return Choice(self.least_load.least_loaded(candidates), "imbalance")
        by_url = {b.url: b for b in candidates}
        match = self.tree.match(prompt, set(by_url))
        if match.backends and match.matched_chars >= self.match_threshold * len(prompt):
            # Of the replicas holding the prefix, the least loaded (ties: the most recent).
            holders = [by_url[url] for url in reversed(match.backends)]
            return Choice(min(holders, key=lambda b: b.load), "prefix_hit")
        return Choice(self.least_load.least_loaded(candidates), "prefix_miss")


def make_policy(name: str, tree: PrefixTree, **thresholds: float):
    if name == "round-robin":
        return RoundRobin()
    if name == "least-load":
        return LeastLoad()
    if name == "prefix":
        return PrefixAware(tree, **thresholds)
    raise ValueError(f"unknown policy {name!r}; choose from {', '.join(POLICIES)}")
