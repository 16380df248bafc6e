"""The router's prefix tree and policies against replica state alone (no HTTP)."""

from __future__ import annotations

from goodserve.router.backend import Backend
from goodserve.router.policies import LeastLoad, PrefixAware, RoundRobin
from goodserve.router.prefix_tree import PrefixTree

SYSTEM_A = "You are a pirate. " * 20  # 360 characters: 5 chunks of 64
SYSTEM_B = "You answer in French. " * 20


def replicas(n: int = 2) -> list[Backend]:
    return [Backend(f"http://r{i}:8000") for i in range(n)]


def test_tree_matches_the_longest_whole_chunk_prefix_a_candidate_served():
    tree = PrefixTree(chunk_chars=8)
    tree.insert("abcdefgh" + "ijklmnop" + "qr", "A")
    tree.insert("abcdefgh" + "XXXXXXXX", "B")
    assert tree.match("abcdefgh" + "ijklmnop" + "zzzz", {"A", "B"}).matched_chars == 16
    assert tree.match("abcdefgh" + "ijklmnop", {"A", "B"}).backends == ("A",)
    assert tree.match("abcdefgh" + "ijklmnop", {"B"}).backends == ("B",)  # A is not a candidate: B's 8 chars
    assert tree.match("abcdefgh" + "ijklmnop", {"B"}).matched_chars == 8
    assert tree.match("abcdefgh", {"A", "B"}).backends == ("A", "B")  # most recent last
    assert tree.match("zzzzzzzz", {"A", "B"}).matched_chars == 0


def test_tree_forgets_least_recently_used_chunks_and_downed_replicas():
    tree = PrefixTree(chunk_chars=4, max_nodes=3)
    tree.insert("aaaabbbb", "A")  # 2 nodes
    tree.insert("ccccdddd", "B")  # 2 more: the oldest (aaaa) goes
    assert tree.match("aaaabbbb", {"A"}).matched_chars == 0
    assert tree.match("ccccdddd", {"B"}).matched_chars == 8
    tree.forget("B")
    assert tree.match("ccccdddd", {"B"}).matched_chars == 0
    assert not tree.nodes or all(tree.nodes.values())


def test_round_robin_takes_turns():
    backends = replicas(3)
    policy = RoundRobin()
    assert [policy.choose(backends, "x").backend.url for _ in range(6)] == [b.url for b in backends] * 2


def test_least_load_takes_the_idlest_and_rotates_ties():
    a, b = replicas()
    policy = LeastLoad()
    a.started(10)
    assert {policy.choose([a, b], "x").backend.url for _ in range(4)} == {b.url}
    b.started(10)
    assert {policy.choose([a, b], "x").backend.url for _ in range(4)} == {a.url, b.url}  # a tie: both
    b.started(1)
    b.finished(1)
    a.scraped_requests = 5  # the replica's own queue: traffic from elsewhere
    assert policy.choose([a, b], "x").backend is b


def test_prefix_aware_keeps_a_prefix_on_its_replica_and_spreads_new_ones():
    backends = replicas()
    policy = PrefixAware(PrefixTree(chunk_chars=64))
    first_a = policy.choose(backends, SYSTEM_A + "question 0")
    first_a.backend.started(1)  # in flight: the next new prefix goes to the other replica
    first_b = policy.choose(backends, SYSTEM_B + "question 0")
    assert (first_a.reason, first_b.reason) == ("prefix_miss", "prefix_miss")
    assert first_a.backend is not first_b.backend
    for i in range(1, 6):
        again = policy.choose(backends, SYSTEM_A + f"question {i}")
        assert (again.backend, again.reason) == (first_a.backend, "prefix_hit")
    # A prompt that shares too little of itself (one chunk of a long prompt) is no hit.
    assert policy.choose(backends, SYSTEM_A[:64] + "z" * 1000).reason == "prefix_miss"


def test_prefix_aware_yields_to_least_load_when_replicas_are_far_apart():
    a, b = replicas()
    policy = PrefixAware(PrefixTree(chunk_chars=64), balance_abs_threshold=4, balance_rel_threshold=1.5)
    assert policy.choose([a, b], SYSTEM_A + "q").backend is a  # a tie on an empty tree: the rotation's first
    for _ in range(5):
        a.started(100)
    choice = policy.choose([a, b], SYSTEM_A + "q2")
    assert (choice.backend, choice.reason) == (b, "imbalance")
    b.started(100)
    b.started(100)  # 5 vs 2: within the absolute threshold, the prefix decides again
    assert policy.choose([a, b], SYSTEM_A + "q3").reason == "prefix_hit"
