"""Same-block averaging among peers: exact mean, coverage failures, poisoned updates."""

import asyncio

import pytest
import torch

from blocktrain.p2p.averaging import Averager, OuterOptimizer, RoundFailed
from blocktrain.p2p.transport import Timeouts

from conftest import mesh

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
    import blocktrain.p2p.averaging as av
    monkeypatch.setattr(av, "PIECE_FLOATS", 1000)  # many pieces per member, as for a large block
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


async def test_members_with_different_views_do_not_ban_each_other():
    peers, avgs, members = await group(3, timeout_s=1.0, min_coverage=0.99)
    try:
        xs = [torch.randn(300) for _ in peers]
        partial = {pid: a for pid, a in members.items() if pid != peers[2].id}  # peer 1 missed peer 2
        r = await asyncio.gather(avgs[0].average(1, xs[0], members), avgs[1].average(1, xs[1], partial),
                                 avgs[2].average(1, xs[2], members), return_exceptions=True)
        assert all(isinstance(x, RoundFailed) for x in r)  # loud, not silent
        assert not any(a.banned for a in avgs)
        assert any(e["event"] == "group mismatch" for a in avgs for e in a.events)
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
        for m in peers[2].members.values():  # dies without a goodbye: its connections just drop
            m.conn.abort("killed")
        await peers[2].stop()
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
                        pc = await peers[2].connection_to(members[pid])
                        import hashlib
                        gid = hashlib.sha256("".join(ids).encode()).hexdigest()[:16]
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


async def test_two_peers_train_one_block_and_agree_after_every_round():
    from blocktrain.blocks.data import as_tensor, read_split
    from blocktrain.blocks.model import ModelConfig
    from blocktrain.blocks.train import BlockTrainer, TrainConfig
    from blocktrain.p2p.averaging import flatten
    from blocktrain.p2p.swarm import SwarmBlockTrainer

    peers, avgs, members = await group(2, block=0, timeout_s=20)
    data = as_tensor(read_split("valid"))
    mc = ModelConfig(d_model=32, n_head=2, n_layer=3, n_blocks=3, max_seq_len=64)
    tc = TrainConfig(steps=12, batch_size=4, seq_len=32, warmup=2)
    try:
        trainers = [BlockTrainer(mc, tc, 0, data, shard=i, num_shards=2) for i in range(2)]
        swarm = [SwarmBlockTrainer(p, t, a, every=4) for p, t, a in zip(peers, trainers, avgs)]
        late = await asyncio.gather(*(s.join_group(1) for s in swarm))  # both agree to average from round 1
        assert late == [[], []] and all(s.joined == {o.peer.id: 1} for s, o in zip(swarm, swarm[::-1]))
        reports = await asyncio.gather(*(s.run(12) for s in swarm))
        for r in reports:
            assert [x["round"] for x in r.rounds] == [1, 2, 3] and all(x["coverage"] == 1.0 for x in r.rounds)
            assert not r.failed
        a, b = (flatten(list(t.block.parameters())) for t in trainers)
        assert torch.allclose(a, b, atol=1e-6)  # the same parameters after the last round
    finally:
        for p in peers:
            await p.stop()
