"""A partition that heals: four trainers on block 0 on in-memory peers (tests/fakes.py),
the links between two sides dropped silently (no close, no departure: a switch's filter) and then
restored. Every member must end in one group with identical parameters; a member that yields to
the other side is admitted or trains on and asks again, never waiting at the start barrier; a
member cut off for its block's last rounds says so."""

import asyncio
import time

import pytest
import torch

from blocktrain.blocks.data import as_tensor, read_split
from blocktrain.blocks.model import ModelConfig
from blocktrain.blocks.train import TrainConfig
from blocktrain.p2p.averaging import flatten
from blocktrain.p2p.swarm import PeerJob, SwarmConfig, SwarmTrainer, TrainerSpec
from blocktrain.p2p.services import Change
from blocktrain.p2p.swarm import membership as membership_module

from fakes import FakeNet, FakePeer

MC = ModelConfig(d_model=32, n_head=2, n_layer=2, n_blocks=2, max_seq_len=64)
DATA = as_tensor(read_split("valid"))
STEP_S = 0.02  # every local step takes this much longer, so a side cut off alone does not race to its block's end


class CutPeer(FakePeer):
    def deliver(self, src: str, frame: bytes) -> None:
        if self.net.cut_between(src, self.id) or (src, self.id) in self.net.dropped:
            return  # dropped on the way: nothing closes
        super().deliver(src, frame)

    def members(self, *, block=None, role=None, alive: bool = True):
        return [m for m in super().members(block=block, role=role, alive=alive)
                if not (alive and self.net.cut_between(self.id, m.peer_id))]  # declared dead across the cut


class CutNet(FakeNet):
    """A FakeNet whose switch can drop everything between sides (``cut``) until ``heal``."""

    def __init__(self):
        super().__init__()
        self.sides: list[set] | None = None
        self.dropped: set = set()  # (src, dst) pairs dropped one way (``one_way``)

    def peer(self, n: int, blocks=(), role: str = "train") -> CutPeer:
        p = CutPeer(self, f"{n:02x}" * 32, blocks, role)
        for other in self.peers.values():
            other.emit(Change.JOINED, p)
        self.peers[p.id] = p
        return p

    def one_way(self, src: set, dst: set) -> None:
        """From now on only what ``src`` sends ``dst`` is dropped; every peer sees every other alive."""
        crossed = self._crossing()
        self.sides, self.dropped = None, {(a, b) for a in src for b in dst}
        self._tell(Change.BACK, crossed)

    def cut(self, *sides) -> None:
        """Everything between ``sides`` is dropped; each peer declares the other side dead, as the
        swarm's heartbeats do after dead_after_s (the connections stay open, as TCP's do)."""
        self.sides = [set(s) for s in sides]
        self._tell(Change.DEAD)

    def heal(self) -> None:
        crossed = self._crossing()
        self.sides, self.dropped = None, set()
        self._tell(Change.BACK, crossed)

    def _crossing(self):
        return [(a, b) for a in self.peers.values() for b in self.peers.values()
                if a is not b and self.cut_between(a.id, b.id)]

    def _tell(self, change, pairs=None) -> None:
        for a, b in pairs if pairs is not None else self._crossing():
            a.emit(change, b)

    def cut_between(self, a: str, b: str) -> bool:
        return self.sides is not None and not any(a in s and b in s for s in self.sides)


def slowed(sp: SwarmTrainer) -> SwarmTrainer:
    orig = sp._new_trainer

    def new_trainer(b):
        orig(b)
        fn = sp.trainer.compute_grads

        def slow(*a):
            time.sleep(STEP_S)
            return fn(*a)
        sp.trainer.compute_grads = slow
    sp._new_trainer = new_trainer
    return sp


async def until(cond, what: str, seconds: float, tasks=()):
    deadline = time.monotonic() + seconds
    while not cond():
        for t in tasks:
            if t.done():
                raise AssertionError(f"a peer finished while waiting for {what}: {t.result()}")
        assert time.monotonic() < deadline, f"no {what} in {seconds} s"
        await asyncio.sleep(0.02)


def one_group(sps) -> bool:
    ids = {sp.peer.id for sp in sps}
    return all(set(sp.group.members()) == ids for sp in sps)


async def _partition_and_heal(tmp_path, monkeypatch, sides: list[list[int]], steps: int = 120):
    """Four trainers (``min_group`` 4) train as one group, are cut into ``sides`` until each side
    trained a few rounds apart, then healed. Returns (reports, trainers, seconds from heal to one group)."""
    monkeypatch.setattr(membership_module, "STATUS_EVERY_S", 1.0)
    net = CutNet()
    peers = [net.peer(i + 1, blocks=(0,)) for i in range(4)]
    sc = SwarmConfig(schedule="parallel", round_timeout_s=60, join_timeout_s=1, ready_timeout_s=10, eval_windows=2,
                     min_group=4)
    tc = TrainConfig(steps=steps, batch_size=2, seq_len=16, warmup=1, draft_frac=0)
    sps = [slowed(SwarmTrainer(p, TrainerSpec(0, PeerJob(MC, tc, sc), tmp_path / f"w{i}"), DATA, DATA))
           for i, p in enumerate(peers)]
    tasks = [asyncio.ensure_future(sp.run()) for sp in sps]
    try:
        await until(lambda: one_group(sps) and all(sp.stats.applied >= 3 for sp in sps), "group of 4", 30, tasks)
        net.cut(*({peers[i].id for i in side} for side in sides))
        applied = [sp.stats.applied for sp in sps]
        await until(lambda: all(sp.stats.applied >= a + 10 for sp, a in zip(sps, applied)), "rounds apart", 30, tasks)
        net.heal()
        t_heal = time.monotonic()
        await until(lambda: one_group(sps), "one group after the heal", 30, tasks)
        healed_s = time.monotonic() - t_heal
        reps = await asyncio.wait_for(asyncio.gather(*tasks), 120)
        return reps, sps, healed_s
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for p in peers:
            await p.stop()


@pytest.mark.parametrize("sides", [[[0, 1], [2, 3]], [[0, 1, 2], [3]], [[0], [1, 2, 3]]],
                         ids=["2-2", "3-1", "1-3-sponsor-alone"])
async def test_a_healed_partition_ends_in_one_group_with_identical_parameters(tmp_path, monkeypatch, sides):
    """The healed partition's acceptance test, on in-memory peers: peer 0 has the smallest id (the group's sponsor, as
    the bootstrap is the first peer): on the side that stays (2|2, 3|1) or alone on the side that
    yields (1|3). Every member finishes its block with the same parameters; none is cut off."""
    reps, sps, healed_s = await _partition_and_heal(tmp_path, monkeypatch, sides)
    print(f"heal to one group: {healed_s:.2f} s ({sides})")
    for r in reps:
        assert r["state"] == "done" and r["step"] == r["steps"] and r["cut_off"] is None
    # the side that yielded took the other's state and says what of its own it dropped: the steps
    # it trained apart (a merge's cost)
    dropped = [j["dropped"] for r in reps for j in r["joins"] if "dropped" in j]
    assert dropped and all(d["steps"] > 0 and d["group_step"] >= 0 for d in dropped), [r["joins"] for r in reps]
    ends = [flatten(sp.params()) for sp in sps]
    assert all(torch.equal(ends[0], e) for e in ends[1:])


# --- the incident's parts, each driven on its own ---------------------------------------------------

A, B, C, D = ("a" * 64, "b" * 64, "c" * 64, "d" * 64)


def _yielded(me: str, ours: dict, larger: dict, rnd: int = 37):
    """``me``, training in a group with ``ours`` (member -> first round), hears a larger group's STATUS
    and yields (rule 6): what it sent, and the Group."""
    from blocktrain.p2p.group import Group, Phase, State
    g = Group(me)
    g.state, g.round, g.joined = State.TRAINING, rnd, dict(ours)
    leave = g.on_status(larger["sponsor"], {"phase": Phase.STATUS.value, **larger})
    assert leave is not None and g.state is State.IDLE
    return g


def test_a_member_that_yielded_and_is_not_welcomed_trains_on_alone_never_at_the_start_barrier():
    """The yield defect (group.py rule 7): d yields to the group of a and b, which finished (its
    JOIN is answered ABSENT); c, its old group's other member, is joining too (STARTING, same
    state). With min_group 4 a starting peer waits for 4 starters; d is past the start: it trains
    on alone from its own state. A first start still waits."""
    from blocktrain.p2p.group import Phase, State
    for replies in ({A: Phase.ABSENT, B: Phase.ABSENT, C: Phase.STARTING},
                    {A: Phase.REDIRECT, C: Phase.STARTING},  # the sponsor did not answer in time
                    {}):  # nobody answered
        g = _yielded(D, {C: 1}, {"size": 2, "sponsor": A})
        sends = g.start_join([A, B, C], 120, "d1", 38)
        assert {s.peer for s in sends} == {A, B, C}
        for p, phase in replies.items():
            g.on_reply(p, phase, {"step": 120, "digest": "d1"} if phase is Phase.STARTING else {})
        d = g.decide(4, begun=True)
        assert d.action == "train" and d.members == (D,) and "not admitted" in d.why
        assert g.state is State.TRAINING and g.members() == [D] and g.round == 38
    first = _yielded(D, {C: 1}, {"size": 2, "sponsor": A})
    first.start_join([A, B, C], 0, "d0", 1)
    first.on_reply(C, Phase.STARTING, {"step": 0, "digest": "d0"})
    assert first.decide(4).action == "retry"  # the start barrier: 2 of 4 ready


def test_a_joiner_stops_waiting_for_a_state_once_every_member_of_its_welcome_left():
    """Rule 7: a welcome's members that all said LEAVE (they finished) will not tell READY."""
    from blocktrain.p2p.group import Group, Phase
    g = Group(D)
    g.start_join([A, B], 120, "d1", 38)
    g.on_reply(A, Phase.WELCOME, {"at": 40, "members": [A, B], "block": 0})
    g.on_reply(B, Phase.REDIRECT, {"sponsor": A})
    d = g.decide(4, begun=True)
    assert d.action == "fetch" and not g.all_left(d.members)
    g.on_leave(A, 39, "done training")
    assert not g.all_left(d.members)
    g.on_leave(B, 39, "done training")
    assert g.all_left(d.members)


async def test_a_member_that_yields_mid_round_leaves_that_round_at_once(tmp_path):
    """The partition incident's peer 1: d yields while its round with c is in progress; c yielded
    too and will never send its part. d's round ends at once without c (round timeout 60 s), so d
    asks the larger group before it finishes. A round begun after the yield departs c as it begins."""
    from blocktrain.p2p.group import State
    from blocktrain.protocol import BlockUpdate
    net = CutNet()
    peers = [net.peer(i + 1, blocks=(0,)) for i in range(4)]
    sc = SwarmConfig(schedule="parallel", round_timeout_s=60, eval_windows=2)
    tc = TrainConfig(steps=8, batch_size=2, seq_len=16, warmup=1, draft_frac=0)
    sp = SwarmTrainer(peers[3], TrainerSpec(0, PeerJob(MC, tc, sc), tmp_path / "d"), DATA, DATA)
    sp.prepare()
    me, c = peers[3].id, peers[2].id
    sp.group.state, sp.group.round, sp.group.joined = State.TRAINING, 5, {c: 1}
    net.cut({c}, {peers[0].id, peers[1].id, me})  # c never sends its part
    vec = flatten(sp.params()).clone()
    task = asyncio.ensure_future(sp.averager.average(5, vec, [me, c], start="x"))
    try:
        await asyncio.sleep(0.1)
        assert not task.done()
        status = {"phase": "status", "scope": sp.scope, "size": 2, "sponsor": peers[0].id}
        sp.membership.on_control(BlockUpdate(block=0, round=5, meta=status), None, peers[0].id)
        assert sp.membership.rejoin and sp.group.state is State.IDLE
        avg, rep = await asyncio.wait_for(task, 10)  # bounded far below the round's timeout
        assert rep.departed == [c] and "yielding" in rep.why[c] and torch.equal(avg, vec)
        assert sp.rounds._gone(6, [me, c]) == {c: "we left the group (yielding)"}
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        for p in peers:
            await p.stop()


@pytest.mark.parametrize("ok", [False, True], ids=["cut-off-fails", "cut-off-ok"])
async def test_a_member_that_yields_to_a_group_that_never_admits_it_trains_on_and_says_it_was_cut_off(
        tmp_path, monkeypatch, ok):
    """Both partition defects, on trainers (min_group 2): a is cut off from b and c, then hears them
    again but its own messages do not reach them (its JOINs are lost) until they finished. a yields
    to their group every time it hears their STATUS and is never admitted: it trains on alone (never
    'ready to start together' once the block began), ends its block, says it was cut off and ends
    with CutOff (bt-peer: exit 1), or, with swarm.cut_off_ok, returns its report, which says so.
    Before r6.24 it waited at the start barrier for good."""
    monkeypatch.setattr(membership_module, "STATUS_EVERY_S", 0.5)
    net = CutNet()
    peers = [net.peer(i + 1, blocks=(0,)) for i in range(3)]
    sc = SwarmConfig(schedule="parallel", round_timeout_s=60, join_timeout_s=0.5, eval_windows=2, min_group=2,
                     cut_off_ok=ok)
    tc = TrainConfig(steps=90, batch_size=2, seq_len=16, warmup=1, draft_frac=0)
    lines: list[str] = []
    sps = [slowed(SwarmTrainer(p, TrainerSpec(0, PeerJob(MC, tc, sc), tmp_path / f"w{i}"), DATA, DATA,
                               progress=lines.append if i == 0 else None)) for i, p in enumerate(peers)]
    tasks = [asyncio.ensure_future(sp.run()) for sp in sps]
    a, others = peers[0].id, {peers[1].id, peers[2].id}
    try:
        # a round applied in the group of 3 (a start race can fail the first rounds and leave them in 2s)
        await until(lambda: one_group(sps) and all(sp.stats.applied >= 3 and sp.stats.largest_group == 3 for sp in sps),
                    "group of 3", 30, tasks)
        net.cut({a}, others)
        await until(lambda: sps[1].group.members() == sorted(others) and sps[0].group.members() == [a],
                    "the split", 30, tasks)
        started = len(lines)
        net.one_way({a}, others)  # a hears them; they do not hear a
        await until(lambda: any("another group is larger" in x for x in lines[started:]), "a yield", 30, tasks)
        await asyncio.wait_for(asyncio.gather(*tasks[1:]), 60)
        net.heal()
        await asyncio.wait({tasks[0]}, timeout=60)
        assert tasks[0].done(), f"a never finished: {lines[started:][-3:]}"
        assert not [x for x in lines[started:] if "ready to start together" in x]
        assert any(x.startswith("not admitted") for x in lines[started:]) and any("cut off" in x for x in lines)
        from blocktrain.p2p.swarm import CutOff
        e = tasks[0].exception()
        if ok:
            assert e is None
            rep = tasks[0].result()
        else:
            assert isinstance(e, CutOff) and e.block == 0
            rep = e.report
        assert rep["cut_off"]["largest_group"] == 3 and rep["cut_off"]["block"] == 0
        assert rep["step"] == rep["steps"] and rep["state"] == "done"
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for p in peers:
            await p.stop()


def test_a_run_is_cut_off_when_its_last_rounds_were_alone_after_a_group_or_mostly_below_min_group():
    from blocktrain.p2p.swarm.report import Stats, ended_cut_off

    def run(sizes, min_group=1, block=0):
        s = Stats()
        for i, n in enumerate(sizes):
            s.record_round({"block": block, "step": i + 1, "members": [], "departed": [], "rejected": [],
                            "candidates_outside": []}, None, i + 1, 1.0, n, min_group)
        return ended_cut_off(s, block, min_group)
    assert run([1, 1, 1]) is None  # alone from the start (min_group 1): nothing was lost
    assert run([4, 4, 1, 4]) is None  # alone a round, then in a group again at the end
    c = run([4, 4, 4, 1, 1])
    assert c["rounds_alone_at_end"] == 2 and c["alone_since_step"] == 4 and c["largest_group"] == 4
    assert "alone" in c["why"]
    assert run([4, 2, 2, 2], min_group=4)["rounds_below_min_group"] == 3  # most rounds below min_group
    assert run([4, 4, 2, 2], min_group=4) is None  # half: not most
