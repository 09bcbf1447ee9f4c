"""The sign update codec: round trip, error feedback, every bad shape, padding bit and
scale from a peer refused (the sender rejected), and sign rounds that end with the same bytes
everywhere for about 1/32 of the bytes of raw parts."""

import struct

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from blocktrain.p2p.averaging import AveragingRound, Bounds, Part, RoundSpec, validate_part
from blocktrain.p2p.tensors import decode_sign, encode_sign
from blocktrain.protocol import SIGN_BYTES, TOPK_CHUNK_ELEMS, BlockUpdate, LocalProtocolError, pack_tensor

from conftest import run_rounds

C = TOPK_CHUNK_ELEMS


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 3 * C + 5), st.integers(0, 2**31))
@example(C, 0)  # whole chunks: no padding
@example(C + 1, 0)  # a last chunk of one element
def test_round_trip_keeps_each_sign_and_each_chunks_mean_magnitude(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g)
    x[::7] = 0.0  # a zero decodes as +scale, -0.0 too
    x[3::7] = -0.0
    dec = torch.empty(n)
    wires = encode_sign(x, dec)
    got = decode_sign(BlockUpdate(block=0, round=1, codec="sign", tensors=wires).tensors, n)
    assert torch.equal(got, dec)  # the far end decodes what the sender says it sent
    assert torch.equal(got >= 0, x >= 0) and bool((got != 0).all() or (x == 0).all())
    for a in range(0, n, C):
        chunk = x[a:a + C]
        assert torch.allclose(got[a:a + C].abs(), chunk.abs().mean().expand(chunk.numel()), rtol=1e-5)
    assert wires[0].stored_bytes + wires[1].stored_bytes == -(-n // C) * (SIGN_BYTES + 4)


def test_error_feedback_carries_what_was_not_sent():
    """Rounds of the sign codec: the sum of what a member sent plus its last residual is the sum of
    its inputs, and what it sent follows the inputs' direction."""
    torch.manual_seed(0)
    xs = [torch.randn(3 * C) + 0.5 for _ in range(8)]
    residual, sent = None, torch.zeros(3 * C)
    for i, x in enumerate(xs):
        r = AveragingRound("a", 0, i + 1, ["a", "b"], x, RoundSpec(codec="sign"), residual=residual)
        sent += r.sent
        residual = r.residual.clone()
    total = torch.stack(xs).sum(0)
    assert torch.allclose(sent + residual, total, atol=1e-4)
    assert float(torch.nn.functional.cosine_similarity(sent, total, dim=0)) > 0.8


def _part(bits: bytes, scales, n_chunks=1, width=SIGN_BYTES):
    return BlockUpdate(block=0, round=1, codec="sign", meta={"phase": "reduce", "part": 0, "group": "g"}, tensors=(
        pack_tensor("bits", "uint8", (n_chunks, width), bits),
        pack_tensor("scale", "float32", (n_chunks,), struct.pack(f"<{n_chunks}f", *scales))))


@pytest.mark.parametrize("bits,scales,n_chunks,why", [
    (bytes([1]) + bytes(SIGN_BYTES - 1), (float("nan"),), 1, "scale"),
    (bytes(SIGN_BYTES), (-0.5,), 1, "scale"),
    (bytes(SIGN_BYTES), (float("inf"),), 1, "scale"),
    (bytes(12) + bytes([0x10]) + bytes(SIGN_BYTES - 13), (0.5,), 1, "padding"),  # bit 100 of a 100-element part
    (bytes(12) + bytes([0x20]) + bytes(SIGN_BYTES - 13), (0.5,), 1, "padding"),  # bit 101
    (bytes(SIGN_BYTES - 1) + bytes([0x80]), (0.5,), 1, "padding"),  # the chunk's last bit
    (bytes(2 * SIGN_BYTES), (0.5, 0.5), 2, "do not fit"),  # two chunks for a part of one
])
def test_bad_shapes_padding_and_scales_from_a_peer_are_named(bits, scales, n_chunks, why):
    with pytest.raises(ValueError, match=why):
        validate_part(_part(bits, scales, n_chunks), 100, Bounds(), compact="sign")


def test_a_part_of_another_codec_and_malformed_frames_are_refused():
    with pytest.raises(ValueError, match="dense round"):
        validate_part(_part(bytes(SIGN_BYTES), (0.5,)), 100, Bounds(), compact=None)
    with pytest.raises(ValueError, match="in a sign round"):
        validate_part(BlockUpdate(block=0, round=1, codec="raw", tensors=(
            pack_tensor("part", "float32", (100,), bytes(400)),)), 100, Bounds(), compact="sign")
    with pytest.raises(LocalProtocolError, match="raw tensors"):  # the protocol's structural check
        BlockUpdate(block=0, round=1, codec="sign", tensors=(pack_tensor("part", "float32", (1,), bytes(4)),))
    with pytest.raises(LocalProtocolError, match="shapes"):
        _part(bytes(SIGN_BYTES - 1), (0.5,), width=SIGN_BYTES - 1)
    ok = validate_part(_part(bytes([0b101]) + bytes(SIGN_BYTES - 1), (0.25,)), 3, Bounds(), compact="sign")
    assert ok.tolist() == [0.25, -0.25, 0.25]  # PROTOCOL.md's vector block_update_sign
    last = validate_part(_part(bytes(12) + bytes([0x08]) + bytes(SIGN_BYTES - 13), (0.5,)), 100, Bounds(), compact="sign")
    assert float(last[99]) == 0.5 and float(last[98]) == -0.5  # bit 99: the part's last element, inside
    assert validate_part(_part(bytes(SIGN_BYTES), (-0.0,)), 100, Bounds(), compact="sign").abs().max() == 0


@pytest.mark.parametrize("ids,aggregate", [(["a", "b"], "robust"), (["a", "b", "c"], "robust"),
                                           (["a", "b", "c", "d"], "mean")])
def test_sign_rounds_end_with_the_same_bytes_everywhere_for_a_32nd_of_the_bytes(ids, aggregate):
    """Every member computes every piece from everyone's parts: they end with the same bytes, the
    (plain or robust) mean of what the parts decode to, having sent (R - 1) parts of ~1 bit a value."""
    torch.manual_seed(1)
    n = 12 * C  # whole chunks in every piece, for 2, 3 or 4 members
    xs = [torch.randn(n) for _ in ids]
    rs = {p: AveragingRound(p, 0, 1, ids, x, RoundSpec(codec="sign", aggregate=aggregate)) for p, x in zip(ids, xs)}
    sent = run_rounds(rs)
    outs = [r.result()[0] for r in rs.values()]
    assert all(torch.equal(outs[0], o) for o in outs)
    decoded = torch.stack([r.sent for r in rs.values()]).mean(0)
    assert torch.allclose(outs[0], decoded, atol=1e-5)
    R = len(ids)
    raw_robust = R * (R - 1) * n * 4  # every member's raw part of every piece to every other
    assert sent <= raw_robust / 30
    assert all(p["owner"] == "everyone" for p in rs["a"].result()[1].parts)


def test_a_gather_in_a_sign_round_rejects_its_sender():
    """Nobody's average is taken in a sign round: a member that sends one is rejected."""
    ids = ["a", "b", "c"]
    torch.manual_seed(2)
    rs = {p: AveragingRound(p, 0, 1, ids, torch.randn(300), RoundSpec(codec="sign", aggregate="mean")) for p in ids}
    part = next(m for m in rs["b"].start() if m.peer == "a")
    forged = BlockUpdate(block=0, round=1, codec="sign", tensors=part.msg.tensors,
                         meta={**part.msg.meta, "phase": "gather", "contributors": ids})
    rs["a"].receive("b", forged)
    assert [r["peer"] for r in rs["a"].rejected] == ["b"]


@pytest.mark.parametrize("forge", ["nan scale", "padding bit", "raw part"])
def test_a_bad_sign_part_rejects_its_sender_and_the_others_finish(forge):
    """In a round of 3, member c's part is malformed: the honest members reject c (naming why) and
    end with the same bytes, the mean of their own two parts."""
    ids = ["a", "b", "c"]
    torch.manual_seed(3)
    n = 3 * 100  # three pieces of 100
    rs = {p: AveragingRound(p, 0, 1, ids, torch.randn(n), RoundSpec(codec="sign", aggregate="robust")) for p in ids}
    bad = {"nan scale": _part(bytes(SIGN_BYTES), (float("nan"),)),
           "padding bit": _part(bytes(SIGN_BYTES - 1) + bytes([1]), (0.5,)),
           "raw part": BlockUpdate(block=0, round=1, codec="raw", tensors=(
               pack_tensor("part", "float32", (100,), bytes(400)),))}[forge]
    queue = [(p, part) for p in ("a", "b") for part in rs[p].start()]
    for j in range(3):  # c's part of every piece, to a and b
        m = BlockUpdate(block=0, round=1, codec=bad.codec, tensors=bad.tensors,
                        meta={"phase": "reduce", "part": j, "group": rs["a"].group})
        queue += [("c", Part(p, m, 0)) for p in ("a", "b")]
    while queue:
        src, part = queue.pop(0)
        if part.peer != "c":
            queue += [(part.peer, q) for q in rs[part.peer].receive(src, part.msg)]
    (ra, rep_a), (rb, _) = rs["a"].result(), rs["b"].result()
    assert torch.equal(ra, rb) and [r["peer"] for r in rep_a.rejected] == ["c"]
    assert torch.allclose(ra, (rs["a"].sent + rs["b"].sent) / 2)


@pytest.mark.parametrize("aggregate", ["mean", "robust"])
def test_a_departure_seen_by_one_member_leaves_the_parts_it_sent_counted_everywhere(aggregate):
    """c sends its parts to a and b, then a (only) sees c depart before b's parts reach it: a keeps
    c's parts, as b does, so both end with the same bytes."""
    ids = ["a", "b", "c"]
    torch.manual_seed(4)
    spec = RoundSpec(codec="sign", aggregate=aggregate)
    rs = {p: AveragingRound(p, 0, 1, ids, torch.randn(3 * C), spec) for p in ids}
    starts = {p: rs[p].start() for p in ids}
    for part in starts["c"]:
        rs[part.peer].receive("c", part.msg)
    for part in starts["a"]:
        if part.peer == "b":
            rs["b"].receive("a", part.msg)
    rs["a"].depart("c", "connection closed")
    for part in starts["b"]:
        if part.peer == "a":
            rs["a"].receive("b", part.msg)
    (ra, rep), (rb, _) = rs["a"].result(), rs["b"].result()
    assert torch.equal(ra, rb) and rep.departed == ["c"] and rep.coverage == 1.0
