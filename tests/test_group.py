"""Group membership, sans-IO: every ordering of joins, admissions, departures and merges, no sockets."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from blocktrain.p2p.group import MAX_EARLY, MAX_FORWARDS, MAX_PENDING, Group, Phase, State


class Net:
    """Groups that talk by delivering each other's Sends, in an order the test chooses."""

    def __init__(self, ids, margin=2):
        self.g = {p: Group(p, margin=margin) for p in ids}
        self.queue = []  # (src, Send)

    def post(self, src, sends):
        self.queue += [(src, s) for s in sends]

    def deliver(self, i=0):
        src, s = self.queue.pop(i)
        g = self.g[s.peer]
        phase = Phase(s.meta["phase"])
        if phase is Phase.JOIN:
            self.post(s.peer, g.on_join(src, s.meta))
        elif phase in (Phase.WELCOME, Phase.REDIRECT, Phase.STARTING, Phase.ABSENT):
            g.on_reply(src, phase, s.meta)
        elif phase is Phase.ADMIT:
            self.post(s.peer, g.on_admit(src, s.meta))
        elif phase is Phase.STATUS:
            leave = g.on_status(src, s.meta)
            if leave is not None:
                self.post(s.peer, leave)
        elif phase is Phase.LEAVE:
            g.on_leave(src, s.round, s.meta.get("why", ""))

    def drain(self, order=None):
        while self.queue:
            self.deliver(order.pop(0) % len(self.queue) if order else 0)


def start(net, p, rnd=1, step=0, digest="d0", candidates=None):
    others = [q for q in net.g if q != p] if candidates is None else candidates
    net.post(p, net.g[p].start_join(others, step, digest, rnd))


def test_peers_starting_together_from_one_state_form_one_group():
    net = Net(["a", "b", "c"])
    for p in "abc":
        start(net, p)
    net.drain()
    decisions = {p: net.g[p].decide() for p in "abc"}
    assert all(d.action == "train" for d in decisions.values())
    assert all(net.g[p].members(1) == ["a", "b", "c"] for p in "abc")


def test_min_group_waits_until_enough_start_together():
    net = Net(["a", "b", "c"])
    start(net, "a", candidates=["b", "c"])
    net.drain()  # b and c are idle: absent
    assert net.g["a"].decide(min_group=3).action == "retry"
    for p in "abc":
        start(net, p)
    net.drain()
    assert all(net.g[p].decide(min_group=3).action == "train" for p in "abc")


def test_a_join_that_arrives_before_the_other_side_starts_still_ends_in_one_group():
    """The join race: b's JOIN reaches a while a is not yet training (answered absent)."""
    net = Net(["a", "b"])
    start(net, "b")
    net.drain()  # a is idle: absent
    d = net.g["b"].decide()
    assert d.action == "train" and net.g["b"].members() == ["b"]  # b trains alone, sponsoring
    start(net, "a")
    net.drain()
    d = net.g["a"].decide()
    assert d.action == "fetch" and d.sponsor == "b" and d.at == 1 + 2  # the state after round at
    net.g["a"].joined_group(d.at, d.members)
    for r in range(1, 10):
        assert net.g["a"].members(r) == net.g["b"].members(r) or r <= d.at
    assert net.g["b"].ready_due(d.at) == ["a"]


def test_the_sponsor_admits_and_every_member_learns_before_the_joiners_first_round():
    net = Net(["a", "b", "c", "j"])
    for p in "abc":
        start(net, p, candidates=["a", "b", "c"])
    net.drain()
    for p in "abc":
        net.g[p].decide()
        net.g[p].begin_round(5, "s5", 0)  # the group is at round 5
    start(net, "j", rnd=1, step=0, digest="fresh")
    net.drain()
    d = net.g["j"].decide()
    assert d.action == "fetch" and d.sponsor == "a" and d.at == 7
    assert all(net.g[p].members(8) == ["a", "b", "c", "j"] for p in "abc")
    assert all(net.g[p].members(7) == ["a", "b", "c"] for p in "abc")
    assert all(net.g[p].ready_due(7) == ["j"] for p in "abc")  # every member writes the state


def test_a_member_that_is_not_the_sponsor_redirects():
    g = Group("b")
    g.state, g.round, g.joined = State.TRAINING, 1, {"a": 1}
    (s,) = g.on_join("z", {"step": 0, "digest": "x"})
    assert s.meta == {"phase": "redirect", "sponsor": "a"}


def test_departure_and_rejoin():
    g = Group("a")
    g.state, g.round, g.joined = State.TRAINING, 10, {"b": 1, "c": 3}
    assert g.depart("c", "dead") and g.members() == ["a", "b"]
    assert not g.depart("c", "dead")  # once
    sends = g.on_join("c", {"step": 0, "digest": "x"})  # it comes back: admitted like any joiner
    assert {s.meta["phase"] for s in sends} == {"admit", "welcome"} and g.members(13) == ["a", "b", "c"]


def test_split_groups_merge_into_the_larger():
    net = Net(["a", "b", "c"])
    for p in "ab":
        start(net, p, candidates=["a", "b"])
    start(net, "c", candidates=[])
    net.drain()
    for p in "abc":
        net.g[p].decide()
    assert net.g["c"].members() == ["c"] and net.g["a"].members() == ["a", "b"]
    net.post("a", [net.g["a"].status_for("c")])
    net.post("c", [net.g["c"].status_for("a")])
    net.drain()
    assert net.g["c"].state is State.IDLE  # c yields: it joins again, taking the group's state
    assert net.g["a"].members() == ["a", "b"]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 1000), min_size=0, max_size=40), st.permutations(["a", "b", "c", "d"]))
def test_any_delivery_order_at_start_gives_agreeing_views(order, starters):
    """Peers start one after another; messages arrive in any order. Whatever each decides, the
    members of every group agree on who is in it, so no round ever mixes two views."""
    net = Net(list(starters))
    for p in starters:
        start(net, p)
    net.drain(list(order))
    for p in starters:
        d = net.g[p].decide()
        if d.action == "fetch":
            net.g[p].joined_group(d.at, d.members)
    views = {p: net.g[p].members(50) for p in starters if net.g[p].state is State.TRAINING}
    for p, v in views.items():
        for q in v:
            if q in views:
                assert views[q] == v, (p, q, views)


def test_group_rank_orders_larger_then_smaller_sponsor():
    a, b = Group("a"), Group("b")
    a.state = b.state = State.TRAINING
    b.joined = {"c": 1}
    assert b.rank() > a.rank()  # larger wins
    c = Group("c")
    c.state = State.TRAINING
    assert a.rank() > c.rank()  # equal size: the smaller sponsor id wins


def test_a_starter_counted_in_by_others_is_welcomed_as_it_stands():
    """b heard a's JOIN while starting and started together with it; a had decided to ask again
    (b had answered absent before). a's retry is welcomed into round 1 with its own state."""
    net = Net(["a", "b"])
    start(net, "a")
    net.drain()  # b idle: absent
    assert net.g["a"].decide(min_group=2).action == "retry"
    net.g["a"].state = State.STARTING  # a waits before asking again; b starts now
    start(net, "b")
    net.drain()
    assert net.g["b"].decide(min_group=2).action == "train" and net.g["b"].members(1) == ["a", "b"]
    net.g["b"].begin_round(1, "d0", 0)
    start(net, "a")
    net.drain()
    d = net.g["a"].decide(min_group=2)
    assert d.action == "train" and d.at == 0 and net.g["a"].members(1) == ["a", "b"]


def _b_and_c_training_at_round_5():
    """b and c start together and train, at round 5; a1 and j2 are not in yet."""
    net = Net(["b", "c", "a1", "j2"])
    for p in "bc":
        start(net, p, candidates=["b", "c"])
    net.drain()
    for p in "bc":
        net.g[p].decide()
        net.g[p].begin_round(5, "s5", 0)
    return net


def test_a_joiner_admitted_before_a_new_sponsor_still_hears_ready():
    """Seen with live peers: a1 (a smaller id than the sponsor b) is admitted first, from round 8;
    j2 next, from round 9, by b. From round 8 a1 is the sponsor and knows nothing of j2 from b's
    welcome. The state j2 takes is written at the end of round 8: every member that wrote it tells
    j2 READY (once, nobody did: j2 waited for its timeout and the group's round 9 failed for want
    of it; then only the admitting member did, and a member lying about the round silenced it)."""
    net = _b_and_c_training_at_round_5()
    start(net, "a1", rnd=1, digest="fresh")
    net.drain()
    d1 = net.g["a1"].decide()
    assert d1.action == "fetch" and d1.sponsor == "b" and d1.at == 7  # in from round 8
    for p in "bc":
        net.g[p].begin_round(6, "s6", 0)
    start(net, "j2", rnd=1, digest="fresh")
    net.drain()
    d2 = net.g["j2"].decide()
    assert d2.action == "fetch" and d2.sponsor == "b" and d2.at == 8
    for p in "bc":
        net.g[p].begin_round(8, "s8", 0)
        assert net.g[p].sponsor() == "a1"  # a1 (smaller id) is in from round 8: the sponsor now
    due = {p: net.g[p].ready_due(8) for p in "bc"}
    assert due == {"b": ["j2"], "c": ["j2"]}  # every member writes the state
    told = {p: net.g[p].ready(8, due[p], "block0.r8") for p in "bc"}
    assert all([s.peer for s in told[p]] == ["j2"] for p in "bc")
    assert told["b"][0].meta == {"phase": "ready", "at": 8, "name": "block0.r8"}


def test_an_admit_from_outside_the_next_round_is_ignored_and_ready_outlives_the_admitter():
    g = Group("a")
    g.state, g.round, g.joined = State.TRAINING, 5, {"b": 1, "y": 7}
    g.on_admit("x", {"peer": "j", "at": 6})  # not a member
    g.on_admit("y", {"peer": "j", "at": 6})  # a member from round 7 only: it sponsors nothing yet
    assert g.ready_due(6) == [] and g.members(7) == ["a", "b", "y"]  # neither ADMIT is taken
    g2 = Group("c")
    g2.state, g2.round, g2.joined = State.TRAINING, 5, {"b": 1}
    g2.on_admit("b", {"peer": "j", "at": 6})
    g2.depart("b", "dead")
    g2.begin_round(6, "s6", 0)
    (s,) = g2.ready(6, g2.ready_due(6), "x")  # b admitted j and left: c still tells it
    assert s.peer == "j"


def _group_with_a_new_smaller_member():
    """b and c train from round 5; a1 (an id below b's) is admitted by b from round 8."""
    net = _b_and_c_training_at_round_5()
    start(net, "a1", rnd=1, digest="fresh", candidates=["b", "c"])
    net.drain()
    d = net.g["a1"].decide()
    assert d.action == "fetch" and d.at == 7
    net.g["a1"].joined_group(d.at, d.members)
    return net


def _join_during(net, rounds, order=None):
    """j2 joins while the members stand at ``rounds`` (member -> round in progress); messages are
    delivered in ``order``; it takes the state it is welcomed to; every member's view of j2 and
    who tells it READY."""
    for p, r in rounds.items():
        net.g[p].begin_round(r, f"s{r}", 0)
    start(net, "j2", rnd=1, digest="fresh", candidates=["a1", "b", "c"])
    net.drain(order)
    d = net.g["j2"].decide()
    assert d.action == "fetch", d
    net.g["j2"].joined_group(d.at, d.members)
    first = {p: net.g[p].joined.get("j2") for p in ("a1", "b", "c")}
    told = []
    for p in ("a1", "b", "c"):
        net.g[p].begin_round(d.at, f"s{d.at}", 0)
        told += [s.peer for s in net.g[p].ready(d.at, net.g[p].ready_due(d.at), "x")]
    return d, first, told


@settings(max_examples=60, deadline=None)
@given(st.sampled_from([{"a1": 8, "b": 8, "c": 7}, {"a1": 8, "b": 7, "c": 8}, {"a1": 8, "b": 7, "c": 7},
                        {"a1": 8, "b": 8, "c": 8}]), st.lists(st.integers(0, 1000), max_size=20))
def test_a_joiner_at_a_sponsor_change_is_counted_in_from_one_round_by_every_member(rounds, order):
    """Seen with live peers (a restarted peer and a late joiner at once): a1 is in from round 8
    and, with the smallest id, sponsors from then on; members still in round 7 take b for the
    sponsor. A joiner then may be welcomed by b (for b's round 7) and by a1 (for round 8).
    Before, a member ignored an ADMIT from the sponsor of the round next to its own, and the two
    admissions named different rounds: members disagreed on j2's first round and the group split.
    Now every member counts j2 in from the earliest admission's round, j2 takes that one, and
    every member tells it READY."""
    net = _group_with_a_new_smaller_member()
    d, first, told = _join_during(net, rounds, list(order))
    assert set(first.values()) == {d.at + 1}, (d, first)
    assert net.g["j2"].members(d.at + 1) == ["a1", "b", "c", "j2"]
    assert told == ["j2"] * 3


def test_a_joiner_admitted_and_not_yet_in_is_welcomed_again_to_the_same_round():
    """A pending joiner that asks again (its welcome was late) gets the admission the members
    keep; one that was averaging already and is admitted again came back unseen: the new one."""
    g = Group("a")
    g.state, g.round, g.joined = State.TRAINING, 5, {"b": 1}
    g.on_join("j", {"step": 0, "digest": "x"})
    assert g.joined["j"] == 8
    g.begin_round(6, "s6", 0)
    sends = g.on_join("j", {"step": 0, "digest": "x"})
    assert {s.meta["at"] for s in sends} == {7} and g.joined["j"] == 8
    g.on_admit("b", {"peer": "j", "at": 9})  # a later admission of a pending joiner: the earlier kept
    assert g.joined["j"] == 8 and g.ready_due(7) == ["j"] and g.ready_due(9) == []
    g.begin_round(10, "s10", 0)
    g.on_join("j", {"step": 0, "digest": "x"})  # it averaged from round 8 and asks again: it came back
    assert g.joined["j"] == 13 and g.ready_due(12) == ["j"]


def test_what_a_member_that_is_not_the_sponsor_can_admit_is_bounded():
    """The relaxed ADMIT (any member of this round or the next, rule 2) does not let a member
    that is not the sponsor eject one that averages, nor name rounds far from ours, nor pile up
    pending joiners without end."""
    g = Group("a")
    g.state, g.round, g.joined = State.TRAINING, 5, {"b": 1, "c": 1}
    g.on_admit("c", {"peer": "b", "at": 10**9})  # "b came back": from c, not the sponsor (a)
    g.on_admit("c", {"peer": "j", "at": 10**9})  # a round far ahead
    g.on_admit("c", {"peer": "k", "at": 2})  # a round past
    assert g.joined == {"b": 1, "c": 1} and g.members(6) == ["a", "b", "c"]
    g2 = Group("b")
    g2.state, g2.round, g2.joined = State.TRAINING, 5, {"a": 1, "c": 1}
    g2.on_admit("a", {"peer": "c", "at": 7})  # the sponsor's word: c came back unseen
    assert g2.joined["c"] == 8
    for i in range(av_max := MAX_PENDING + 10):
        g2.on_admit("a", {"peer": f"p{i:04d}", "at": 7})
    assert sum(f > g2.round for f in g2.joined.values()) == MAX_PENDING and av_max > MAX_PENDING


def _two_joiners_during(rounds, order):
    """j2 and j3 join while the members of ``_group_with_a_new_smaller_member`` stand at ``rounds``
    (member -> round in progress), messages delivered in ``order``."""
    net = _group_with_a_new_smaller_member()
    net.g["j3"] = Group("j3")
    for p, r in rounds.items():
        net.g[p].begin_round(r, f"s{r}", 0)
    for j in ("j2", "j3"):
        start(net, j, rnd=1, digest="fresh", candidates=["a1", "b", "c"])
    net.drain(list(order))
    return net


@settings(max_examples=200, deadline=None)
@given(st.sampled_from([{"a1": 8, "b": 8, "c": 7}, {"a1": 8, "b": 7, "c": 8}, {"a1": 8, "b": 7, "c": 7},
                        {"a1": 8, "b": 8, "c": 8}]), st.lists(st.integers(0, 1000), max_size=40))
def test_two_joiners_at_a_sponsor_change_are_counted_in_alike_by_everyone(rounds, order):
    """Two joiners during one sponsor change (b sponsors for members still in round 7, a1 for
    those in round 8) may each be admitted by a different sponsor, each welcome listing the
    members its sender knew then: neither joiner heard of the other, and the group split (a
    reviewer's simulation: 566 of 3,000 delivery orders). Every peer in at a round must see the
    same members in it."""
    net = _two_joiners_during(rounds, order)
    first = {"a1": 8, "b": 1, "c": 1}
    for j in ("j2", "j3"):
        d = net.g[j].decide()
        assert d.action == "fetch", d
        first[j] = d.at + 1
        net.g[j].joined_group(d.at, d.members)
    net.drain()
    for r in range(8, max(first.values()) + 2):
        views = {p: tuple(net.g[p].members(r)) for p, f in first.items() if f <= r}
        assert len(set(views.values())) == 1, (r, first, views)


def test_a_new_admission_is_passed_on_to_the_joiners_pending():
    """A member that takes an admission it did not know tells that joiner of every joiner pending,
    and them of it; one it knew already changes nothing and is not passed on."""
    g = Group("c")
    g.state, g.round, g.joined = State.TRAINING, 7, {"a1": 8, "b": 1, "j2": 10}
    sends = g.on_admit("a1", {"peer": "j3", "at": 10})
    got = sorted((s.peer, s.meta["peer"], s.meta["at"]) for s in sends)
    assert got == [("j2", "j3", 10), ("j3", "a1", 7), ("j3", "j2", 9)]  # a1 (pending too) sent it
    assert g.on_admit("b", {"peer": "j3", "at": 10}) == []
    j = Group("j3")
    j.start_join(["a1", "b", "c"], 0, "fresh", 1)
    for s in sends:
        if s.peer == "j3":
            j.on_admit("c", s.meta)
    j.joined_group(10, ["a1", "b", "c"])  # a welcome that did not name j2 (admitted by the other sponsor)
    assert j.members(11) == ["a1", "b", "c", "j2", "j3"]


def test_a_join_reaching_the_sponsor_in_its_first_round_keeps_its_admission():
    """A fresh-eyes review's simulation: a joiner's JOIN that reaches the sponsor after the
    joiner's first round began there was taken for a comeback and admitted again, later; the
    joiner, still waiting, took the earlier welcome: the group split (3 of 3,000 orders)."""
    g = Group("a")
    g.state, g.round, g.joined = State.TRAINING, 5, {"b": 1}
    g.on_join("j", {"step": 0, "digest": "x"})
    g.begin_round(8, "s8", 0)  # j's first round
    assert {s.meta["at"] for s in g.on_join("j", {"step": 0, "digest": "x"})} == {7} and g.joined["j"] == 8


def test_what_a_member_can_make_us_hold_or_send_is_bounded():
    """A review: a new peer admitted into the round in progress escaped the pending bound (10,000
    ADMITs: 10,002 members), ids had no length bound, and every taken ADMIT is passed on to the
    pending joiners (up to 2 x 256 sends each)."""
    g = Group("a")
    g.state, g.round, g.joined = State.TRAINING, 5, {"b": 1}
    for i in range(1000):
        g.on_admit("b", {"peer": f"n{i:04d}", "at": 4})  # in from the round in progress: never new
    g.on_admit("b", {"peer": "x" * 129, "at": 7})
    assert g.joined == {"b": 1}
    sent = sum(len(g.on_admit("b", {"peer": f"p{i:04d}", "at": 7})) for i in range(MAX_PENDING))
    assert len(g.joined) == MAX_PENDING + 1 and sent == MAX_FORWARDS  # (255 x 256 sends asked for)
    g.begin_round(6, "s6", 0)
    assert len(g.on_admit("b", {"peer": "p0000", "at": 6})) == 2 * (MAX_PENDING - 1)  # a new round's budget


def test_a_joiner_counts_in_what_it_was_told_whatever_the_order_and_per_sender():
    """A review: a joiner kept one early admission per peer, so an earlier one from another
    group's member displaced its own group's (the joiner then missed that peer); and it counted
    in an admission passed on by a joiner admitted before it only if that joiner came first in
    its table (dict order)."""
    def told(admits):
        j = Group("j3")
        j.start_join(["a1", "b", "c"], 0, "fresh", 1)
        for sender, peer, at in admits:
            j.on_admit(sender, {"peer": peer, "at": at})
        j.joined_group(8, ["a1", "b", "c"])  # in from round 9; a welcome that names neither j2 nor k
        return {r: j.members(r) for r in (9, 10)}

    passed_on = [("j2", "k", 9), ("b", "j2", 8)]  # j2 (in from round 9, not named) passed k on
    want = {9: ["a1", "b", "c", "j2", "j3"], 10: ["a1", "b", "c", "j2", "j3", "k"]}
    assert told(passed_on) == told(passed_on[::-1]) == want
    other_group = [("x", "j2", 4), ("b", "j2", 8)]  # x: not of our group; its word is earlier
    assert told(other_group)[9] == ["a1", "b", "c", "j2", "j3"]


@settings(max_examples=100, deadline=None)
@given(st.sampled_from([{"a1": 8, "b": 8, "c": 7}, {"a1": 8, "b": 7, "c": 8}, {"a1": 8, "b": 7, "c": 7},
                        {"a1": 8, "b": 8, "c": 8}]), st.lists(st.integers(0, 1000), max_size=40))
def test_a_joiner_that_gives_up_is_counted_in_by_nobody(rounds, order):
    """A review: a pending joiner whose state did not come told only the members its welcome named
    that it leaves; a fellow joiner that counted it in (from the ADMITs members passed on) waited
    for its parts until its round failed."""
    net = _two_joiners_during(rounds, order)
    d3 = net.g["j3"].decide()
    assert d3.action == "fetch", d3
    net.post("j3", net.g["j3"].give_up(d3.at, d3.members, "no state"))
    net.drain(list(order))
    d2 = net.g["j2"].decide()
    net.g["j2"].joined_group(d2.at, d2.members)
    first = {"a1": 8, "b": 1, "c": 1, "j2": d2.at + 1}
    for r in range(8, d2.at + 4):
        views = {p: tuple(net.g[p].members(r)) for p, f in first.items() if f <= r}
        assert len(set(views.values())) == 1 and "j3" not in views["b"], (r, views)


def test_a_group_left_or_entered_has_no_joiners_to_tell_ready():
    g = Group("a")
    g.state, g.round, g.joined = State.TRAINING, 5, {"b": 1}
    g.on_join("j", {"step": 0, "digest": "x"})  # admitted at 7
    g.leave("yielding")
    assert g.ready_due(7) == []
    g.on_join("j", {"step": 0, "digest": "x"})  # (idle: answered absent)
    g.start_join(["b"], 0, "x", 6)
    g._admits_due = {7: {"j"}}  # an entry that outlived a group we left
    g.joined_group(6, ["b"])
    assert g.ready_due(7) == []


def test_a_peer_that_left_before_we_are_in_is_not_counted_in_unless_admitted_again():
    """A review: a LEAVE and the ADMIT of a new admission can come in either order (the LEAVE
    from the peer, the ADMIT from a member), an admission from before the LEAVE must not count
    again, a lost connection is no LEAVE, and a second join attempt starts afresh."""
    def view(events, attempts=1):
        j = Group("j3")
        for n in range(attempts):
            j.start_join(["b", "c"], 0, "fresh", 1)
            for ev in events if n == 0 else ():
                if ev[0] == "leave":
                    j.on_leave(ev[1], ev[2], "left")
                elif ev[0] == "lost":
                    j.depart(ev[1], "connection lost")
                else:
                    j.on_admit(ev[0], {"peer": ev[1], "at": ev[2]})
            if n + 1 < attempts:
                j.give_up(8, ["b", "c", "k"], "no state")
        j.joined_group(8, ["b", "c", "k"])  # the welcome's snapshot names k
        return {r: j.members(r) for r in (9, 12)}

    everyone, without_k = ["b", "c", "j3", "k"], ["b", "c", "j3"]
    assert view([]) == {9: everyone, 12: everyone}
    assert view([("leave", "k", 7)]) == {9: without_k, 12: without_k}
    assert view([("lost", "k")]) == {9: everyone, 12: everyone}  # a lost connection: no LEAVE
    assert view([("leave", "k", 7)], attempts=2) == {9: everyone, 12: everyone}  # a new attempt, a new welcome
    back = {9: without_k, 12: everyone}  # admitted again, from round 11
    assert view([("leave", "k", 7), ("b", "k", 10)]) == view([("b", "k", 10), ("leave", "k", 7)]) == back
    assert view([("b", "k", 5), ("leave", "k", 7)]) == {9: without_k, 12: without_k}  # admitted before it left
    assert view([("b", "k", 5), ("b", "k", 10), ("leave", "k", 7)]) == back  # and again, before its LEAVE came
    assert view([("leave", "k", 7), ("c", "k", 6)]) == {9: without_k, 12: without_k}  # passed on before it left


def test_what_a_member_can_make_a_joiner_count_in_is_bounded():
    """A review: a member our welcome names could delay another member's first round without end
    (an ADMIT of it for round 10^9), and one sender could fill the joiner's table of admissions."""
    j = Group("j3")
    j.start_join(["b", "c"], 0, "fresh", 1)
    j.on_admit("c", {"peer": "b", "at": 10**9})  # b is named by the welcome; c is not the sponsor
    j.on_admit("c", {"peer": "x", "at": 10**9})  # a round far past ours
    for i in range(MAX_EARLY):
        j.on_admit("f", {"peer": f"p{i:04d}", "at": 9})
    j.on_admit("c", {"peer": "j2", "at": 8})
    assert len(j._early) == MAX_PENDING + 3  # f's are bounded, c's still kept
    j.joined_group(8, ["b", "c"])
    assert j.members(9) == ["b", "c", "j2", "j3"] and "x" not in j.joined


def test_a_joiner_giving_up_names_the_last_round_it_was_admitted_to_and_members_drop_stale_admits():
    """Both sponsors of a sponsor change may admit a joiner (rule 2); its LEAVE covers both rounds,
    so an ADMIT of the later admission passed on after the LEAVE does not count it in again."""
    j = Group("j")
    j.start_join(["a1", "b"], 0, "fresh", 1)
    j.on_reply("b", Phase.WELCOME, {"at": 7, "members": ["a1", "b", "j"], "block": 0})
    j.on_reply("a1", Phase.WELCOME, {"at": 8, "members": ["a1", "b", "j"], "block": 0})
    d = j.decide()
    assert d.at == 7
    leaves = j.give_up(d.at, d.members, "no state")
    assert sorted((s.peer, s.round) for s in leaves) == [("a1", 8), ("b", 8)]
    c = Group("c")
    c.state, c.round, c.joined = State.TRAINING, 7, {"a1": 7, "b": 1, "j": 8}
    assert c.on_leave("j", 8, "no state") and "j" not in c.joined
    assert c.on_admit("a1", {"peer": "j", "at": 8}) == [] and "j" not in c.joined  # stale
    c.on_admit("a1", {"peer": "j", "at": 10})  # admitted again: counted
    assert c.joined["j"] == 11


def _agree(net, peers, rnd):
    views = {p: tuple(net.g[p].members(rnd)) for p in peers}
    assert len(set(views.values())) == 1, (rnd, views)


def _trained_by(ids, rnd):
    """The first two of ``ids`` start together and are in round ``rnd``; the others wait."""
    net = Net(ids)
    for p in ids[:2]:
        start(net, p, candidates=ids[:2])
    net.drain()
    for p in ids[:2]:
        net.g[p].decide()
        net.g[p].begin_round(rnd, f"s{rnd}", 0)
    return net


def test_a_joiner_that_gives_up_early_and_asks_again_is_admitted_after_its_leave():
    """A second review: a joiner giving up before its round (its sponsor died) and asking again at
    once was admitted by the new sponsor for the same round its LEAVE named, which every other
    member then dropped as stale."""
    net = Net(["a", "b", "c", "j3"])
    for p in "abc":
        start(net, p, candidates=list("abc"))
    net.drain()
    for p in "abc":
        net.g[p].decide()
        net.g[p].begin_round(5, "s5", 0)
    start(net, "j3", candidates=list("abc"))
    net.drain()
    d = net.g["j3"].decide()
    assert d.at == 7 and d.sponsor == "a"
    for p in "bc":
        net.g[p].depart("a", "dead")
    net.post("j3", net.g["j3"].give_up(d.at, d.members, "no state"))
    net.drain()
    start(net, "j3", candidates=["b", "c"])
    net.drain()
    d = net.g["j3"].decide()
    assert d.at == 8  # after its LEAVE's round 7, though b is in round 5
    net.g["j3"].joined_group(d.at, d.members)
    _agree(net, ["b", "c", "j3"], d.at + 1)


def test_leave_rounds_of_a_group_we_left_do_not_apply_in_the_next():
    """A second review: rounds are a group's own. k and m yield to a group 90 rounds behind theirs;
    m kept k's LEAVE of round 100 and ignored every admission of k in the new group."""
    net = Net(["a", "b", "k", "m"])
    for pair in (["a", "b"], ["k", "m"]):
        for p in pair:
            start(net, p, candidates=pair)
    net.drain()
    for p, r in (("a", 10), ("b", 10), ("k", 100), ("m", 100)):
        net.g[p].decide()
        net.g[p].begin_round(r, f"s{r}", 0)
    for p in "km":  # both yield (rule 6): LEAVE(100) to each other
        net.post(p, net.g[p].on_status("a", {"size": 2, "sponsor": "a"}))
        net.drain()
    for p in "mk":
        start(net, p, candidates=["a", "b"])
        net.drain()
    for p in "mk":
        d = net.g[p].decide()
        net.g[p].joined_group(d.at, d.members)
    for p in "ab":
        net.g[p].begin_round(13, "s13", 0)
    _agree(net, "abkm", 13)
    assert net.g["m"].members(13) == ["a", "b", "k", "m"]


def test_a_readmission_that_overtakes_the_leave_counts_at_every_member():
    """A second review: j3 gives up and is admitted again at once; the new ADMIT reaches b before
    j3's LEAVE (another link). b kept the older admission (the earliest) and the LEAVE then
    removed j3 altogether. The ADMIT now says which LEAVE it follows (``after``)."""
    net = _trained_by(["a", "b", "j3"], 5)
    start(net, "j3", candidates=["a", "b"])
    net.drain()
    d = net.g["j3"].decide()
    for p in "ab":
        net.g[p].begin_round(8, "s8", 0)
    leaves = net.g["j3"].give_up(d.at, d.members, "state fetch failed")
    net.post("j3", [s for s in leaves if s.peer == "a"])
    net.drain()
    start(net, "j3", candidates=["a"])  # a admits it again; the ADMIT reaches b first
    net.drain()
    assert net.g["b"].joined["j3"] == net.g["a"].joined["j3"] > 9
    net.post("j3", [s for s in leaves if s.peer == "b"])  # the LEAVE, late
    net.drain()
    d = net.g["j3"].decide()
    net.g["j3"].joined_group(d.at, d.members)
    _agree(net, ["a", "b", "j3"], d.at + 1)
    assert "j3" in net.g["b"].members(d.at + 1)


def test_only_the_sponsor_can_say_a_pending_joiners_admission_predates_its_leave():
    """A pending joiner's admission is kept (the earliest, rule 2); an ADMIT saying it follows the
    joiner's LEAVE replaces it, on the sponsor's word only: any member could otherwise delay one."""
    g = Group("c")
    g.state, g.round, g.joined = State.TRAINING, 7, {"a": 1, "b": 1, "j": 9}
    g.on_admit("b", {"peer": "j", "at": 12, "after": 9})  # b is no sponsor
    assert g.joined["j"] == 9
    g.on_admit("a", {"peer": "j", "at": 12, "after": 9})
    assert g.joined["j"] == 13 and g.ready_due(12) == ["j"]


def test_block_updates_are_told_apart_in_one_place():
    """Group control and averaging rounds share BLOCK_UPDATE; group.is_control is the one place
    that tells them apart (the membership driver takes control, the averager the rest)."""
    from blocktrain.p2p.group import CONTROL_PHASES, is_control
    for phase in CONTROL_PHASES - {"excluded"}:
        assert is_control({"phase": phase})
    assert not is_control({"phase": "excluded", "reason": "x"})  # the averager's: it rejected an update
    assert not is_control({"phase": "absent", "round_group": "g"})  # answers a round's part
    assert not is_control({"phase": "reduce", "part": 0}) and not is_control({})
    with pytest.raises(ValueError, match="must be a string"):
        is_control({"phase": ["join"]})
