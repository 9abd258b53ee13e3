"""Routing policies (kvpool.routing): choices, the load bound, the per-instance memory."""

from __future__ import annotations

import random

import pytest

from kvpool.routing import POLICIES, REASONS, Router, id_chain, text_chain, token_chain


def test_chains_share_exactly_their_common_leading_blocks():
    a = token_chain(list(range(40)), block_size=8)
    b = token_chain(list(range(24)) + [999] * 16, block_size=8)
    assert len(a) == len(b) == 5
    assert a[:3] == b[:3] and a[3] != b[3] and a[4] != b[4]
    # A block equal in content but after a different prefix is a different link.
    c = token_chain([999] * 8 + list(range(8, 16)), block_size=8)
    assert c[1] != a[1]
    assert token_chain(list(range(15)), block_size=8) == a[:1]  # partial block: not counted
    assert len(token_chain(list(range(1000)), block_size=8, max_blocks=4)) == 4
    assert text_chain("ab" * 10, block_chars=4) == text_chain("ab" * 10 + "zz", block_chars=4)
    assert id_chain([1, 2, 3])[:2] == id_chain([1, 2, 9])[:2]


def test_round_robin_and_least_loaded():
    rr = Router("round_robin")
    assert [rr.choose(["a", "b", "c"], [0, 0, 0]).instance for _ in range(6)] == list("abcabc")
    ll = Router("least_loaded")
    assert ll.choose(["a", "b"], [3, 1]).instance == "b"
    # Equal loads rotate.
    assert [ll.choose(["a", "b"], [0, 0]).instance for _ in range(4)] in (list("abab"), list("baba"))


def test_prefix_aware_follows_the_prefix_and_falls_back_to_least_loaded():
    r = Router("prefix_aware")
    conv = id_chain([1, 2, 3])
    first = r.choose(["a", "b"], [0, 0], conv)
    assert first.reason == "least_loaded" and first.matched_blocks == 0
    # The next turn of the conversation (a longer chain) goes where its prefix went.
    again = r.choose(["a", "b"], [0, 0], id_chain([1, 2, 3, 4]))
    assert again.instance == first.instance and again.reason == "prefix_match" and again.matched_blocks == 3
    other = r.choose(["a", "b"], [0, 0], id_chain([7, 8]))
    assert other.reason == "least_loaded"


def test_a_short_shared_prefix_does_not_pin_new_conversations():
    # Every request starts with the same system block: new conversations must still spread.
    r = Router("prefix_aware")
    homes = [r.choose(["a", "b"], [0, 0], id_chain([0, 100 + c, 200 + c, 300 + c])).instance for c in range(4)]
    assert sorted(homes) == ["a", "a", "b", "b"]
    # A conversation's next turn matches most of its chain and goes home.
    d = r.choose(["a", "b"], [0, 0], id_chain([0, 101, 201, 301, 401]))
    assert (d.instance, d.reason, d.matched_blocks) == (homes[1], "prefix_match", 4)
    # So does one with a long answer and question after it: it extends a request served there.
    d = r.choose(["a", "b"], [0, 0], id_chain([0, 102, 202, 302] + list(range(500, 520))))
    assert (d.instance, d.reason, d.matched_blocks) == (homes[2], "prefix_match", 4)
    # With min_match 0 any match counts, the shared block included.
    r0 = Router("prefix_aware", min_match=0)
    first = r0.choose(["a", "b"], [0, 0], id_chain([0, 1])).instance
    assert r0.choose(["a", "b"], [0, 0], id_chain([0, 7, 8, 9])).instance == first


def test_longest_match_wins():
    r = Router("prefix_aware")
    r.choose(["a"], [0], id_chain([1, 2]))
    r.choose(["b"], [0], id_chain([1, 2, 3, 4]))
    d = r.choose(["a", "b"], [0, 0], id_chain([1, 2, 3, 4, 5]))
    assert (d.instance, d.matched_blocks) == ("b", 4)


def test_load_bound_keeps_a_hot_prefix_from_pinning_one_instance():
    r = Router("prefix_aware", load_factor=1.25)
    hot = id_chain([42, 43])
    loads = {"a": 0, "b": 0}
    chosen = []
    for _ in range(40):  # requests arrive and none finish: loads only grow
        names = list(loads)
        d = r.choose(names, [loads[n] for n in names], hot)
        loads[d.instance] += 1
        chosen.append(d.reason)
    assert abs(loads["a"] - loads["b"]) <= 0.25 * 40 / 2 + 1
    assert "load_bound" in chosen and "prefix_match" in chosen


def test_memory_per_instance_is_bounded_lru():
    r = Router("prefix_aware", capacity_blocks=4)
    r.choose(["a"], [0], id_chain([1, 2, 3]))
    r.choose(["a"], [0], id_chain([9, 8, 7]))  # pushes out the oldest links of the first chain
    assert r.matched("a", id_chain([1, 2, 3])) == 0
    assert r.matched("a", id_chain([9, 8, 7])) == 3
    r.forget("a")
    assert r.matched("a", id_chain([9, 8, 7])) == 0


@pytest.mark.parametrize("policy", POLICIES)
def test_choice_is_always_an_offered_candidate(policy):
    rng = random.Random(5)
    r = Router(policy, capacity_blocks=50)
    names = ["a", "b", "c", "d"]
    for _ in range(500):
        cands = rng.sample(names, rng.randint(1, 4))
        loads = [rng.randint(0, 5) for _ in cands]
        d = r.choose(cands, loads, id_chain([rng.randint(0, 6) for _ in range(rng.randint(0, 5))]))
        assert d.instance in cands and d.reason in REASONS
        if len(cands) == 1:
            assert d.instance == cands[0]


@pytest.mark.parametrize("kwargs", [{"policy": "random"}, {"policy": "prefix_aware", "capacity_blocks": 0},
                                    {"policy": "prefix_aware", "load_factor": 0.5},
                                    {"policy": "prefix_aware", "min_match": 1.5}])
def test_bad_settings_are_refused_by_name(kwargs):
    with pytest.raises(ValueError, match=next(k for k in kwargs if k != "policy") if len(kwargs) > 1 else "policy"):
        Router(**kwargs)
