"""Tensor payloads through the torch adapter: exact lossless round trips, lossy error bounds."""

import pytest
import torch

from blocktrain.p2p.tensors import from_wire, to_wire
from blocktrain.protocol import Codec, LocalProtocolError, pack_tensor
from blocktrain.protocol.events import MessageReader, frame_message
from blocktrain.protocol import BlockUpdate


def roundtrip(wire):
    """Through a real frame: encode, parse, rebuild."""
    r = MessageReader()
    r.feed(frame_message(BlockUpdate(block=0, round=0, codec=wire.codec.value, tensors=[wire])))
    return r.next_message().tensors[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64,
                                   torch.int32, torch.int8, torch.uint8, torch.bool])
def test_raw_round_trip_is_exact(dtype):
    t = (torch.randn(7, 33) * 50).to(dtype)
    back = from_wire(roundtrip(to_wire("t", t)))
    assert back.dtype == dtype and torch.equal(back, t)


@pytest.mark.parametrize("codec,bound", [("fp16", 1e-3), ("bf16", 8e-3)])
def test_half_codecs_relative_error(codec, bound):
    t = torch.randn(10_000)
    back = from_wire(roundtrip(to_wire("t", t, codec)))
    assert back.dtype == torch.float32
    rel = ((back - t).abs() / t.abs().clamp_min(1e-3)).max().item()
    assert rel <= bound


def test_int8_error_within_half_a_step_per_segment():
    t = torch.randn(5000) * torch.linspace(0.1, 10, 5000)
    w = to_wire("t", t, "int8", segment_elems=1000)
    assert len(w.scales) == 5
    back = from_wire(roundtrip(w))
    for i in range(5):
        seg = slice(i * 1000, (i + 1) * 1000)
        scale = t[seg].abs().max().item() / 127
        assert (back[seg] - t[seg]).abs().max().item() <= scale / 2 + 1e-6


def test_empty_tensor():
    t = torch.empty(0, 4)
    w = to_wire("e", t)
    assert len(w.segments) == 0
    back = from_wire(roundtrip(w))
    assert back.shape == (0, 4)


def test_segment_count_and_lz4_only_where_it_pays():
    noise = torch.randn(3000)
    w = to_wire("n", noise, segment_elems=1000, compress="always")
    assert len(w.segments) == 3 and not any(w.lz4)  # fp32 noise does not shrink
    zeros = torch.zeros(3000)
    w = to_wire("z", zeros, segment_elems=1000, compress="always")
    assert all(w.lz4) and w.stored_bytes < 12000 / 10
    assert torch.equal(from_wire(roundtrip(w)), zeros)
    bf = torch.randn(100_000).to(torch.bfloat16).float()  # bf16-rounded fp32: low mantissa bytes are zero
    w = to_wire("b", bf, compress="auto")
    assert w.lz4[0] and w.stored_bytes < 0.8 * w.raw_bytes
    assert torch.equal(from_wire(roundtrip(w)), bf)


def test_raw_send_is_zero_copy():
    t = torch.arange(16, dtype=torch.float32)
    w = to_wire("t", t, compress="never")
    t[0] = 99.0  # the segment is a view of the tensor's memory
    assert from_wire(w)[0].item() == 99.0


def test_decode_into_caller_buffer():
    t = torch.randn(4, 5)
    out = torch.empty(4, 5)
    ptr = out.data_ptr()
    got = from_wire(roundtrip(to_wire("t", t)), out=out)
    assert got.data_ptr() == ptr and torch.equal(out, t)
    with pytest.raises(ValueError):
        from_wire(to_wire("t", t), out=torch.empty(5, 4))


def test_int8_refuses_non_finite():
    with pytest.raises(ValueError):
        to_wire("t", torch.tensor([1.0, float("nan")]), "int8")


def test_pack_checks_lengths():
    with pytest.raises(LocalProtocolError):
        pack_tensor("t", "float32", (3,), bytes(8))
    with pytest.raises(LocalProtocolError):
        pack_tensor("t", "int64", (1,), bytes(2), Codec.FP16)
