"""Same-block averaging among peers: exact mean, coverage failures, poisoned updates."""

import asyncio

import pytest
import torch

from blocktrain.p2p.averaging import Averager, GroupMismatch, OuterOptimizer, RoundFailed
from blocktrain.p2p.averaging.round import group_digest
from blocktrain.p2p.transport import Timeouts

from conftest import crash, mesh

FAST = Timeouts(connect_s=5, handshake_s=3, heartbeat_s=0.3, dead_after_s=5, close_s=1)


async def group(n, block=1, **kw):
    peers = await mesh(n, FAST, blocks=(block,))
    avgs = [Averager(p, block, **kw) for p in peers]
    members = {p.id: p.addr for p in peers}
    return peers, avgs, members


async def test_fp32_average_equals_the_true_mean():
    peers, avgs, members = await group(3, timeout_s=10)
    try:
        torch.manual_seed(0)
        xs = [torch.randn(100_003) for _ in peers]  # not divisible by 3: uneven parts
        outs = await asyncio.gather(*(a.average(1, x, members) for a, x in zip(avgs, xs)))
        mean = torch.stack(xs).mean(0)
        for out, rep in outs:
            assert torch.allclose(out, mean, atol=1e-6)
            assert rep.coverage == 1.0 and all(len(p["contributors"]) == 3 for p in rep.parts)
    finally:
        for p in peers:
            await p.stop()


async def test_large_vector_travels_in_pieces(monkeypatch):
    from blocktrain.p2p.averaging import round as round_
    monkeypatch.setattr(round_, "PIECE_FLOATS", 1000)  # many pieces per member, as for a large block
    peers, avgs, members = await group(2, timeout_s=10)
    try:
        xs = [torch.randn(10_001) for _ in peers]
        outs = await asyncio.gather(*(a.average(1, x, members) for a, x in zip(avgs, xs)))
        for out, rep in outs:
            assert torch.allclose(out, (xs[0] + xs[1]) / 2, atol=1e-6)
            assert len(rep.parts) == 11 and rep.coverage == 1.0
    finally:
        for p in peers:
            await p.stop()


@pytest.mark.parametrize("floats", [0, 600_000])
async def test_a_member_a_round_ahead_loses_nothing_of_a_large_vector(monkeypatch, floats):
    """A member that finishes round 1 first sends its round-2 parts before the other began round 2:
    more than the fixed early buffer holds (here 1 MiB for 2.4 MB parts) when the vector is large.
    They are held (the cap grows to what one round of the group sends us), so round 2 completes:
    before, they were dropped and round 2 waited for its timeout and failed. ``floats`` given up
    front covers the first round too; without it, the first round's size is learnt from it."""
    from blocktrain.p2p.averaging import early
    from blocktrain.p2p.averaging import round as round_
    monkeypatch.setattr(early, "MAX_EARLY_BYTES", 1 << 20)
    monkeypatch.setattr(round_, "PIECE_FLOATS", 1 << 16)
    peers, avgs, members = await group(2, timeout_s=5, **({"floats": floats} if floats else {}))
    try:
        xs = [torch.randn(600_000) for _ in peers]

        async def rounds(i, delay):
            outs = []
            for r in (1, 2):
                if r == 2 or floats:  # the late member begins the round after the other's parts came
                    await asyncio.sleep(delay)
                outs.append(await avgs[i].average(r, xs[i] + r, members))
            return outs

        done = await asyncio.wait_for(asyncio.gather(rounds(0, 0.0), rounds(1, 0.3)), 30)
        for outs in done:
            for r, (out, rep) in zip((1, 2), outs):
                assert rep.coverage == 1.0 and torch.allclose(out, (xs[0] + xs[1]) / 2 + r, atol=1e-5)
    finally:
        for p in peers:
            await p.stop()


async def test_lossy_codec_within_its_bound():
    peers, avgs, members = await group(2, codec="int8", timeout_s=10)
    try:
        xs = [torch.randn(5000) for _ in peers]
        outs = await asyncio.gather(*(a.average(1, x, members) for a, x in zip(avgs, xs)))
        mean = torch.stack(xs).mean(0)
        step = max(float(x.abs().max()) for x in xs) / 127
        for out, _ in outs:
            assert (out - mean).abs().max() <= 2 * step  # int8 on the way in and on the way out
    finally:
        for p in peers:
            await p.stop()


async def test_members_with_different_views_fail_two_rounds_then_finish_apart_and_say_so():
    """Peer 1 missed peer 2: its round's group differs from the others'. Nobody mixes in parts of
    another group, nobody waits for the timeout, nobody is banned. Two rounds in a row fail for every
    member that saw the other view (rule 9: a change of members may reach them a round or two apart);
    the third finishes apart, and every report names who departed."""
    peers, avgs, members = await group(3, timeout_s=20, min_coverage=0.99)
    try:
        xs = [torch.randn(300) for _ in peers]
        partial = {pid: a for pid, a in members.items() if pid != peers[2].id}
        views = [members, partial, members]
        for rnd in (1, 2):
            r = await asyncio.wait_for(asyncio.gather(*(a.average(rnd, x, v) for a, x, v in zip(avgs, xs, views)),
                                                      return_exceptions=True), 10)
            assert all(isinstance(e, GroupMismatch) and "nothing applied" in str(e) for e in r), r
            assert [e.mismatched for e in r] == [(peers[1].id,), (peers[0].id,), (peers[1].id,)]
        r = await asyncio.wait_for(asyncio.gather(*(a.average(3, x, v) for a, x, v in zip(avgs, xs, views))), 10)
        (o0, r0), (o1, r1), (o2, r2) = r
        assert r0.departed == [peers[1].id] and r2.departed == [peers[1].id]
        assert torch.allclose(o0, (xs[0] + xs[2]) / 2, atol=1e-6) and torch.equal(o0, o2)
        assert r1.departed == [peers[0].id] and torch.equal(o1, xs[1])  # alone: its own vector, said so
        assert "another group" in r0.why[peers[1].id]
        assert not any(a.banned for a in avgs)
        assert any(e["event"] == "group mismatch" for a in avgs for e in a.events)
    finally:
        for p in peers:
            await p.stop()


async def test_a_member_of_another_view_hears_absent_after_the_others_ended_that_round():
    """Peers 1 and 2 end round 1 between themselves; peer 0, which still counts all three, begins it
    afterwards. Their round is over, and peer 0 is not in it: they answer its parts ``absent``, so it
    does not wait for them until its deadline (the parts were dropped: it waited the whole
    ``timeout_s``)."""
    peers, avgs, members = await group(3, timeout_s=30)
    try:
        xs = [torch.randn(3001) for _ in peers]
        two = {pid: a for pid, a in members.items() if pid != peers[0].id}
        await asyncio.wait_for(asyncio.gather(avgs[1].average(1, xs[1], two), avgs[2].average(1, xs[2], two)), 10)
        with pytest.raises(GroupMismatch) as e:
            await asyncio.wait_for(avgs[0].average(1, xs[0], members), 10)
        assert set(e.value.mismatched) == {peers[1].id, peers[2].id}
    finally:
        for p in peers:
            await p.stop()


async def test_a_gossip_round_goes_on_without_a_member_of_another_view():
    """A gossip round (rule 10): peer 0 still counts peer 3, which peers 1 and 2 dropped, so its
    small group (all four) is not theirs (1, 2). They depart each other from the round and it goes
    on: 1 and 2 average, 0 keeps its own vector; nothing fails (r6.14: rule 9 failed all three,
    though a member departed from a small group's round stays in the group)."""
    from blocktrain.p2p.averaging.gossip import gossip_start
    peers, avgs, members = await group(3, timeout_s=20, aggregate="robust")
    try:
        xs = [torch.randn(3001) for _ in peers]
        ghost = "ab" * 32
        mine = [*members, ghost]
        theirs = [peers[1].id, peers[2].id]
        (o0, r0), (o1, r1), (o2, r2) = await asyncio.wait_for(asyncio.gather(
            avgs[0].average(1, xs[0], mine, start=gossip_start("t"), group=mine),
            avgs[1].average(1, xs[1], theirs, start=gossip_start("t"), group=[*members]),
            avgs[2].average(1, xs[2], theirs, start=gossip_start("t"), group=[*members])), 10)
        assert torch.equal(o1, o2) and torch.allclose(o1, (xs[1] + xs[2]) / 2, atol=1e-6)
        assert torch.equal(o0, xs[0]) and set(r0.departed) >= set(theirs)
        assert not any(a.banned for a in avgs)
    finally:
        for p in peers:
            await p.stop()


async def test_a_departure_seen_a_round_apart_fails_that_round_and_the_group_stays_whole():
    """Peer 2 is gone; peer 0 begins round 1 still counting it, peer 1 without it. Departing each
    other there would split the group (rule 9): round 1 fails for both, nothing applied, and round 2,
    begun with the same members, averages the two byte-identically."""
    peers, avgs, members = await group(3, timeout_s=20)
    try:
        crash(peers[2])
        assert await peers[0].wait_for(lambda: peers[0].member(peers[2].id) is None, 60)
        assert await peers[1].wait_for(lambda: peers[1].member(peers[2].id) is None, 60)
        xs = [torch.randn(3001) for _ in peers[:2]]
        two = {pid: a for pid, a in members.items() if pid != peers[2].id}
        r = await asyncio.wait_for(asyncio.gather(avgs[0].average(1, xs[0], members), avgs[1].average(1, xs[1], two),
                                                  return_exceptions=True), 10)
        assert [type(e) for e in r] == [GroupMismatch, GroupMismatch]
        (o0, r0), (o1, r1) = await asyncio.wait_for(asyncio.gather(
            avgs[0].average(2, xs[0], two), avgs[1].average(2, xs[1], two)), 10)
        assert torch.equal(o0, o1) and torch.allclose(o0, (xs[0] + xs[1]) / 2, atol=1e-6)
        assert r0.departed == r1.departed == [] and r0.coverage == 1.0
    finally:
        for p in peers:
            await p.stop()


async def test_silent_member_fails_the_round_loudly():
    peers, avgs, members = await group(3, timeout_s=1.0, min_coverage=0.99)
    try:
        xs = [torch.randn(999) for _ in peers]
        results = await asyncio.gather(avgs[0].average(1, xs[0], members), avgs[1].average(1, xs[1], members),
                                       return_exceptions=True)  # the third never shows up
        for r in results:
            assert isinstance(r, RoundFailed) and "nothing applied" in str(r)
    finally:
        for p in peers:
            await p.stop()


async def test_member_leaving_mid_round_lets_the_others_finish():
    peers, avgs, members = await group(3, timeout_s=20)
    try:
        xs = [torch.randn(3001) for _ in peers]
        rounds = [asyncio.ensure_future(a.average(1, x, members)) for a, x in zip(avgs[:2], xs)]
        await asyncio.sleep(0.5)  # the survivors have sent their parts; the third never will
        assert not any(r.done() for r in rounds)
        crash(peers[2])  # dies without a goodbye: its connections just drop
        for out, rep in await asyncio.gather(*rounds):
            assert rep.departed == [peers[2].id] and rep.coverage == 1.0
            assert all(set(p["contributors"]) == {peers[0].id, peers[1].id} for p in rep.parts)
            assert torch.allclose(out, (xs[0] + xs[1]) / 2, atol=1e-6)  # the survivors' mean, everywhere
    finally:
        for p in peers:
            await p.stop()


@pytest.mark.parametrize("poison", ["nan", "norm", "shape"])
async def test_poisoned_update_is_rejected_and_its_sender_excluded(poison):
    peers, avgs, members = await group(3, timeout_s=1.5, max_norm=1e3)
    try:
        xs = [torch.randn(600) for _ in peers]
        if poison == "shape":  # a hand-made update: parts of the wrong shape, straight onto the wire
            from blocktrain.p2p.tensors import to_wire
            from blocktrain.protocol import BlockUpdate

            async def poisoner():
                ids = sorted(members)
                for j, pid in enumerate(ids):
                    if pid != peers[2].id:
                        pc = await peers[2].connection(pid)
                        gid = group_digest(ids, 1, "|mean")  # no start digest given; a mean round
                        pc.send_nowait(BlockUpdate(block=1, round=1, tensors=(to_wire("part", torch.randn(7)),),
                                                   meta={"phase": "reduce", "part": j, "group": gid}))
            third = poisoner()
        else:
            bad = {"nan": torch.full((600,), float("nan")), "norm": torch.full((600,), 1e6)}[poison]
            third = avgs[2].average(1, bad, members)
        r1 = await asyncio.gather(avgs[0].average(1, xs[0], members), avgs[1].average(1, xs[1], members),
                                  third, return_exceptions=True)
        for r in r1[:2]:  # the poisoner's parts never enter: the round fails, or finishes without it
            if not isinstance(r, RoundFailed):
                out, rep = r
                assert torch.allclose(out, (xs[0] + xs[1]) / 2, atol=1e-6)
                assert rep.rejected and all(peers[2].id not in p["contributors"] for p in rep.parts)
        for a in avgs[:2]:
            assert peers[2].id in a.banned and a.events[0]["event"] == "rejected update"
        # the next round goes on without the poisoner, at full coverage
        r2 = await asyncio.gather(avgs[0].average(2, xs[0], members), avgs[1].average(2, xs[1], members))
        for out, rep in r2:
            assert rep.coverage == 1.0 and len(rep.members) == 2
            assert torch.allclose(out, (xs[0] + xs[1]) / 2, atol=1e-6)
    finally:
        for p in peers:
            await p.stop()


def test_outer_nesterov_step():
    opt = OuterOptimizer(lr=1.0, momentum=0.0)
    start = torch.ones(3)
    assert torch.equal(opt.step(start, torch.full((3,), 0.25)), torch.full((3,), 0.75))


def test_bench_average_reports_every_run_and_the_worst_against_the_targets(tmp_path):
    """bt-bench average with --repeats: every run is in the JSON with its peers' rounds, and the
    summary's worst ratio and every-run verdict come from those runs."""
    import json
    import subprocess
    import sys

    from blocktrain.bench.average import gloo_target, summarize
    out = tmp_path / "avg.json"
    r = subprocess.run([sys.executable, "-m", "blocktrain.bench.cli", "average", "--peers", "2", "--floats", "20000",
                        "--rounds", "2", "--repeats", "2", "--against", "gloo", "--json", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    d = json.loads(out.read_text())
    assert [x["repeat"] for x in d["runs"]] == [1, 2] and all(x["coverage"] == 1.0 for x in d["runs"])
    for x in d["runs"]:
        assert x["vs_gloo"] == pytest.approx(x["blocktrain_s"] / x["gloo_s"])
        assert len(x["blocktrain_rounds_s"]) == 2 and x["gloo_target"] == gloo_target(2) == 1.5
    s = d["summary"]["2"]
    assert s["worst_vs_gloo"] == max(x["vs_gloo"] for x in d["runs"])
    assert s["every_run_within_gloo_target"] == all(x["vs_gloo"] <= 1.5 for x in d["runs"])
    assert "run 2/2: 2 peers" in r.stdout
    from blocktrain.bench.provenance import code_hash
    assert d["code_version"]["code_hash"] == code_hash() and d["command"].startswith("bt-bench average --peers 2")
    fake = [{"peers": 4, "blocktrain_s": 1.0, "vs_gloo": v, "within_gloo_target": v <= 2, "repeat": i}
            for i, v in enumerate((1.5, 2.5, 1.8))]
    assert summarize(fake)["4"]["every_run_within_gloo_target"] is False  # one run over: not met


@pytest.mark.parametrize("seal,shaped", [(True, False), (False, False), (True, True)])
async def test_messages_released_from_a_queue_no_longer_view_the_senders_buffer(seal, shaped):
    """Rule 8's release: parts still queued when a round ends are copied, so the buffers they
    viewed may be written by the next round at once; unsealed frames are copied as the writer takes
    them; on a shaped link the next message waits for the link in its queue, not in the writer's
    hands. The receiver gets the bytes as they were when sent."""
    import os

    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

    from blocktrain.p2p.link import LinkSpec
    from blocktrain.p2p.node import Peer
    from blocktrain.p2p.tensors import to_wire
    from blocktrain.protocol import BlockUpdate
    psk = os.urandom(32)
    links = {"default": LinkSpec(rate_mbit=20), "links": {}} if shaped else None  # 256 KiB: about 0.1 s each
    a, b = [await Peer(X25519PrivateKey.generate(), psk, "127.0.0.1", 0, timeouts=FAST, seal=seal,
                       links=links if i else None).start() for i in range(2)]
    try:
        await b.join("127.0.0.1", a.port)
        got = []
        a.on(BlockUpdate, lambda m, pc, pid: (got.append(from_wire_copy(m)), a.notify()), inline=True)
        pc = await b.connection(a.id)
        buf = torch.arange(3 * 65536, dtype=torch.float32)
        parts = [to_wire("part", buf[i * 65536:(i + 1) * 65536], "raw", "never") for i in range(3)]
        msgs = [BlockUpdate(block=0, round=1, tensors=(w,), meta={"phase": "reduce", "part": i, "group": "g"})
                for i, w in enumerate(parts)]
        for m in msgs:
            pc.send_nowait(m, bulk=True)  # queued: the writer has not run yet
        if shaped:
            await asyncio.sleep(0.03)  # the writer took the first (on a busy machine maybe not yet)
            assert pc.release_queued(msgs) in (2, 3)  # the link is busy: the others wait in the queue
        else:
            assert pc.release_queued(msgs) == 3
        buf.fill_(-1.0)  # the next round writes the buffer
        assert await a.wait_for(lambda: len(got) == 3, 10)
        assert torch.equal(torch.cat(got), torch.arange(3 * 65536, dtype=torch.float32))
    finally:
        await a.stop()
        await b.stop()


def from_wire_copy(m):
    from blocktrain.p2p.tensors import from_wire
    return from_wire(m.tensors[0]).clone()


async def test_a_round_cancelled_in_the_turn_its_wait_ends_stops():
    """A round whose wait for parts ends (a member departs, the round goes on) in the same turn of
    the loop as its task is cancelled stops there: the cancel is not lost (driver.py waits with
    asyncio.timeout; asyncio.wait_for in Python 3.11 drops such a cancel and the round, and a
    trainer stopped while in it, went on)."""
    from fakes import FakeNet
    net = FakeNet()
    a, b, c = (net.peer(i + 1, blocks=(1,)) for i in range(3))
    avg = Averager(a, 1, timeout_s=20)
    task = asyncio.ensure_future(avg.average(1, torch.randn(64), [a.id, b.id, c.id]))
    for _ in range(5):  # A's parts are out; B and C never send theirs
        await asyncio.sleep(0)
    assert not task.done()
    net.leave(c)  # C departs A's round (it wakes and goes on waiting for B) ...
    task.cancel()  # ... in the same turn as the cancel
    done, _ = await asyncio.wait({task}, timeout=5)
    try:
        assert task in done and task.cancelled()
    finally:
        task.cancel()


@pytest.mark.parametrize("told", [True, False])
async def test_a_member_that_left_the_group_before_the_round_began_departs_it(told):
    """A member of the round's members left the group while our local steps ran and came back at
    once (a restart with its identity: a member of the swarm again, in no round of ours). Told
    (``gone``), the round departs it as it begins and finishes without it, whatever it answers.
    Not told, it answers that it is not in the round: a mismatch, and the round fails for us
    alone (a member that heard of its departure first would have finished: their points part)."""
    from fakes import FakeNet
    net = FakeNet()
    a, b, c = (net.peer(i + 1, blocks=(1,)) for i in range(3))
    avgs = [Averager(p, 1, timeout_s=20) for p in (a, b, c)]
    avgs[2].expect(5)  # c's next life, resumed at a later round: it answers ABSENT to parts of round 1
    xs = [torch.randn(64) for _ in range(2)]
    gone = {c.id: "left the group"} if told else None
    rounds = [asyncio.ensure_future(avg.average(1, x, [a.id, b.id, c.id], gone=gone)) for avg, x in zip(avgs, xs)]
    done, _ = await asyncio.wait(rounds, timeout=10)
    assert len(done) == 2
    if told:
        for out, rep in (r.result() for r in rounds):
            assert rep.departed == [c.id] and rep.coverage == 1.0
            assert torch.allclose(out, (xs[0] + xs[1]) / 2, atol=1e-6)
    else:
        assert all(isinstance(r.exception(), GroupMismatch) for r in rounds)


async def test_a_member_training_alone_answers_absent_to_a_round_that_still_counts_it_in():
    """r6.22: b was split off alone (it averages with nobody, so its averager's round stayed
    behind) while a still counts it in: a's parts of round 1 were held at b without an answer, and
    a waited for b until its round's deadline. b training round 1 alone tells a it is not in it."""
    from fakes import FakeNet
    net = FakeNet()
    a, b = (net.peer(i + 1, blocks=(1,)) for i in range(2))
    avg_a, avg_b = Averager(a, 1, timeout_s=60), Averager(b, 1, timeout_s=60)
    task = asyncio.ensure_future(avg_a.average(1, torch.randn(64), [a.id, b.id]))
    await asyncio.sleep(0.2)
    assert not task.done()  # held at b, unanswered
    avg_b.alone(1)
    done, _ = await asyncio.wait({task}, timeout=10)
    assert task in done and isinstance(task.exception(), GroupMismatch)
    avg_b.alone(0)  # never back
    assert avg_b.current == 1


@pytest.mark.parametrize("codec", ["raw", "sign"])
async def test_a_member_stopped_while_it_sends_its_parts_hands_them_all_out(codec):
    """A member cancelled between two sends of its parts (its peer stops, or the round is not ours
    any more) queues the rest at once: every member gets its part, or none does. A member that
    departs mid-round counts in what it sent before leaving, so members that had its part and
    members that never got it would end the round at different points."""
    from blocktrain.p2p.averaging import AveragingRound, RoundSpec
    from fakes import FakeConnection, FakeNet
    net = FakeNet()
    a, b, c = (net.peer(i + 1, blocks=(1,)) for i in range(3))
    ids, x = [a.id, b.id, c.id], torch.randn(3000)
    owed = {(p.peer, p.msg.meta["part"])
            for p in AveragingRound(a.id, 1, 1, ids, x.clone(), RoundSpec(codec=codec)).start()}
    assert len(owed) >= 2  # more than one send: the cancel lands between two
    sent = []
    send_nowait = FakeConnection.send_nowait

    def logged(self, msg, bulk=False):
        sent.append((self.dst.id, msg.meta["part"]))
        return send_nowait(self, msg, bulk)
    avg = Averager(a, 1, codec=codec, timeout_s=20)
    FakeConnection.send_nowait = logged
    try:
        task = asyncio.ensure_future(avg.average(1, x, ids))
        await asyncio.sleep(0)  # A sent its first part and waits (FakeConnection.send yields once)
        assert len(sent) == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    finally:
        FakeConnection.send_nowait = send_nowait
    assert sorted(sent) == sorted(owed)


async def test_a_member_stopped_mid_send_hands_out_whole_pieces_only_within_its_bound(monkeypatch):
    """The hand-out is bounded (outbox.HAND_OUT_BYTES); past the bound it stops at a piece's
    boundary: a piece reaches every member or, beyond the bound, no more of them do."""
    from blocktrain.p2p.averaging import AveragingRound, RoundSpec, outbox
    from fakes import FakeConnection, FakeNet
    net = FakeNet()
    a, b, c = (net.peer(i + 1, blocks=(1,)) for i in range(3))
    ids, x = [a.id, b.id, c.id], torch.randn(3000)
    owed = {(p.peer, p.msg.meta["part"]): p.stored_bytes
            for p in AveragingRound(a.id, 1, 1, ids, x.clone(), RoundSpec(codec="sign")).start()}
    assert sorted({j for _, j in owed}) == [0, 1, 2]  # 3 pieces, each to b and c
    sent = []
    send_nowait = FakeConnection.send_nowait

    def logged(self, msg, bulk=False):
        sent.append((self.dst.id, msg.meta["part"]))
        return send_nowait(self, msg, bulk)
    monkeypatch.setattr(FakeConnection, "send_nowait", logged)
    avg = Averager(a, 1, codec="sign", timeout_s=20)
    task = asyncio.ensure_future(avg.average(1, x, ids))
    await asyncio.sleep(0)
    assert sent == [(b.id, 0)]
    # room for piece 0's rest and half of piece 1: piece 1 is not begun
    monkeypatch.setattr(outbox, "HAND_OUT_BYTES", owed[(c.id, 0)] + owed[(b.id, 1)])
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert sorted(sent) == sorted([(b.id, 0), (c.id, 0)])
