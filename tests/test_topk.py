"""The topk update codec: round trip, error feedback, every bad index, count and scale
from a peer refused (the sender rejected), and sparse rounds that end with the same bytes everywhere."""

import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from blocktrain.p2p.averaging import AveragingRound, Bounds, RoundSpec, validate_part
from blocktrain.p2p.tensors import decode_topk, encode_topk, topk_count
from blocktrain.protocol import TOPK_CHUNK_ELEMS, BlockUpdate, LocalProtocolError, pack_tensor

from conftest import run_rounds

C = TOPK_CHUNK_ELEMS


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 3 * C + 5), st.floats(0.001, 1.0), st.integers(0, 2**31))
def test_round_trip_keeps_the_largest_values_of_each_chunk_within_half_a_step(n, density, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g)
    dec = torch.empty(n)
    wires = encode_topk(x, topk_count(density), dec)
    got = decode_topk(BlockUpdate(block=0, round=1, codec="topk", tensors=wires).tensors, n)
    assert torch.equal(got, dec)  # the far end decodes what the sender says it sent
    for a in range(0, n, C):
        chunk, kept = x[a:a + C], dec[a:a + C] != 0
        k = min(topk_count(density), chunk.numel())
        assert int(kept.sum()) <= k
        if kept.any() and not kept.all():  # nothing dropped is larger than anything kept
            assert chunk.abs()[kept].min() >= chunk.abs()[~kept].max() - 1e-6
        step = float(chunk.abs().max()) / 127
        err = (dec[a:a + C] - chunk)[kept].abs()
        assert not err.numel() or float(err.max()) <= step / 2 + 1e-6


def test_error_feedback_carries_what_was_not_sent():
    """Rounds of a topk codec: what a member did not send (or rounded) goes into its next round,
    so the sum of what was sent plus the last residual is the sum of its inputs."""
    torch.manual_seed(0)
    xs = [torch.randn(3 * C) for _ in range(6)]
    residual, sent = None, torch.zeros(3 * C)
    for i, x in enumerate(xs):
        r = AveragingRound("a", 0, i + 1, ["a", "b"], x, RoundSpec(codec="topk", density=0.02), residual=residual)
        sent += r.sent
        residual = r.residual.clone()
    assert torch.allclose(sent + residual, torch.stack(xs).sum(0), atol=1e-4)
    chunks = sum(-(-(b - a) // C) for a, b in r.spans())  # each piece is cut into chunks of its own
    assert int((r.sent != 0).sum()) <= chunks * topk_count(0.02)


def _part(idx, val, scale, n_chunks=1, k=2):
    return BlockUpdate(block=0, round=1, codec="topk", meta={"phase": "reduce", "part": 0, "group": "g"}, tensors=(
        pack_tensor("idx", "int16", (n_chunks, k), struct.pack(f"<{n_chunks * k}h", *idx)),
        pack_tensor("val", "int8", (n_chunks, k), struct.pack(f"<{n_chunks * k}b", *val)),
        pack_tensor("scale", "float32", (n_chunks,), struct.pack(f"<{n_chunks}f", *scale))))


@pytest.mark.parametrize("idx,val,scale,why", [
    ((1, 1), (1, 1), (0.5,), "increase"),  # a repeated index
    ((3, 1), (1, 1), (0.5,), "increase"),
    ((1, 100), (1, 1), (0.5,), "outside"),  # a value past this part's 100 elements
    ((1, 4096), (1, 0), (0.5,), "outside"),  # past the chunk
    ((-1, 2), (1, 1), (0.5,), "outside"),
    ((1, 2), (-128, 1), (0.5,), "-128"),
    ((1, 2), (1, 1), (float("nan"),), "scale"),
    ((1, 2), (1, 1), (-1.0,), "scale"),
])
def test_bad_indices_values_and_scales_from_a_peer_are_named(idx, val, scale, why):
    with pytest.raises(ValueError, match=why):
        validate_part(_part(idx, val, scale), 100, Bounds(), compact="topk")


def test_positions_in_the_last_chunks_padding_may_carry_zero_only():
    got = validate_part(_part((1, 100), (2, 0), (0.5,)), 100, Bounds(), compact="topk")
    assert float(got[1]) == 1.0 and int((got != 0).sum()) == 1


def test_wrong_counts_shapes_and_codecs_are_refused():
    with pytest.raises(ValueError, match="do not fit"):  # two chunks' worth for a part of one
        validate_part(_part((1, 2, 1, 2), (1, 1, 1, 1), (0.5, 0.5), n_chunks=2), 100, Bounds(), compact="topk")
    with pytest.raises(ValueError, match="dense round"):
        validate_part(_part((1, 2), (1, 1), (0.5,)), 100, Bounds(), compact=None)
    with pytest.raises(LocalProtocolError, match="raw tensors"):  # the protocol's structural check
        BlockUpdate(block=0, round=1, codec="topk", tensors=(pack_tensor("part", "float32", (1,), bytes(4)),))
    with pytest.raises(LocalProtocolError, match="shapes"):
        BlockUpdate(block=0, round=1, codec="topk", tensors=(
            pack_tensor("idx", "int16", (1, 2), bytes(4)), pack_tensor("val", "int8", (1, 1), bytes(1)),
            pack_tensor("scale", "float32", (1,), bytes(4))))


@pytest.mark.parametrize("ids", [["a", "b"], ["a", "b", "c", "d"]])
def test_sparse_rounds_end_with_the_same_bytes_everywhere_and_send_few(ids):
    """A mean round (2 members) and a robust one (4): every member ends with the same bytes, the
    mean of what the members' parts decode to, for ~1/100 of the dense bytes at 1% density."""
    torch.manual_seed(1)
    n = 5 * C
    xs = [torch.randn(n) for _ in ids]
    spec = RoundSpec(codec="topk", density=0.01, aggregate="robust")
    rs = {p: AveragingRound(p, 0, 1, ids, x, spec) for p, x in zip(ids, xs)}
    sent = run_rounds(rs)
    outs = [r.result()[0] for r in rs.values()]
    assert all(torch.equal(outs[0], o) for o in outs)
    decoded = torch.stack([r.sent for r in rs.values()]).mean(0)
    assert torch.allclose(outs[0], decoded, atol=1e-5 if len(ids) > 2 else 0.05 * float(decoded.abs().max()))
    dense = len(ids) * (len(ids) - 1) * n * 4 if len(ids) > 2 else 2 * n * 4
    assert sent < dense / 50


@pytest.mark.parametrize("codec,every", [("topk", 2), ("sign", 1)])
async def test_a_compact_params_swarm_ends_in_step_with_every_block_identical(tmp_path, codec, every):
    """The low-communication modes in the swarm (sync params, topk parts every 2 steps or sign
    parts every step, the relay schedule): three peers end with byte-identical blocks, and their
    rounds sent a small fraction of what dense rounds of the same vectors would."""
    import asyncio

    from blocktrain.blocks.data import as_tensor, read_split
    from blocktrain.blocks.model import Block, ModelConfig
    from blocktrain.blocks.train import TrainConfig
    from blocktrain.p2p.swarm import PeerJob, SwarmConfig, SwarmTrainer, TrainerSpec
    from blocktrain.p2p.transport import Timeouts

    from conftest import mesh
    fast = Timeouts(connect_s=5, handshake_s=3, heartbeat_s=0.2, dead_after_s=30, close_s=1)
    mc = ModelConfig(d_model=32, n_head=2, n_layer=3, n_blocks=3, max_seq_len=64)
    tc = TrainConfig(steps=8, batch_size=4, seq_len=32, warmup=2)
    sc = SwarmConfig(round_timeout_s=20, join_timeout_s=3, eval_windows=2, min_group=3, sync="params", every=every,
                     codec=codec, density=0.02, outer_lr=1.7 if codec == "sign" else 1.0)
    data = as_tensor(read_split("valid"))
    peers = await mesh(3, fast, blocks=[(0,), (1,), (2,)])
    try:
        sps = [SwarmTrainer(p, TrainerSpec(i, PeerJob(mc, tc, sc), tmp_path / f"w{i}"), data, data)
               for i, p in enumerate(peers)]
        reps = await asyncio.wait_for(asyncio.gather(*(sp.run() for sp in sps)), 120)
        finals = [[sp.finals[j] for j in range(3)] for sp in sps]
        for j in range(3):
            for other in finals[1:]:
                assert all(torch.equal(finals[0][j][n], other[j][n]) for n in finals[0][j])
        assert all(r["state"] == "done" and r["rounds_applied"] == 3 * 8 // every for r in reps)
        floats = sum(sum(p.numel() for p in Block(mc, j).parameters()) for j in range(3))
        dense = 2 * 4 * floats * 8 // every  # every round, each member's whole vector to the two others
        sent = peers[0].traffic_totals()["sent"]["wire_bytes"]
        assert sent < dense / (5 if codec == "topk" else 10)  # parts, control and heartbeats together
    finally:
        for p in peers:
            await p.stop()
