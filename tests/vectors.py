"""The PROTOCOL.md test vectors: messages by name, and a parser for PROTOCOL.md's tables.

PROTOCOL.md is the source of the hex; this file holds the messages the hex must equal, and the
recipes (fixed keys, payloads) that reproduce the handshake-dependent vectors.
"""

from __future__ import annotations

import hashlib
import re
import struct
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from blocktrain.protocol import (Announce, BlockUpdate, Connection, Error, ErrorCode, Goodbye, Handshake, PeerInfo,
                                 PeerList, PipelineForward, PipelineResult, Ping, Pong, Role, Status, StreamChunk,
                                 StreamEnd, StreamOpen, StreamRequest, StreamReset, pack_tensor)
from blocktrain.protocol.connection import PROLOGUE
from blocktrain.protocol.events import frame_message
from blocktrain.protocol.handshake import NoiseHandshake

PROTOCOL_MD = Path(__file__).resolve().parent.parent / "PROTOCOL.md"

P1 = PeerInfo("ab" * 32, "127.0.0.1:4000", (0,), "train", 0)
P2 = PeerInfo("cd" * 32, "127.0.0.1:4001", (1, 2), "serve", 1500)

VALID = {
    "ping": Ping(nonce=7),
    "pong": Pong(nonce=2**64 - 1),
    "error": Error(code=0x0101, reason="wrong swarm key"),
    "goodbye": Goodbye(reason="shutdown"),
    "handshake": Handshake(data=bytes(range(8))),
    "announce": Announce(peer=P1),
    "peer_list": PeerList(peers=(P1, P2)),
    "status": Status(status={"peers": 2}),
    "block_update_raw": BlockUpdate(block=2, round=5, codec="raw", tensors=(
        pack_tensor("w", "float32", (2,), struct.pack("<2f", 1.0, -2.0)),)),
    "block_update_int8": BlockUpdate(block=0, round=1, codec="int8", tensors=(
        pack_tensor("w", "float32", (3,), struct.pack("<3b", 127, -64, 0), "int8", (0.5,)),)),
    "block_update_lz4": BlockUpdate(block=1, round=0, codec="raw", tensors=(
        pack_tensor("z", "float32", (64,), bytes(256), compress="always"),)),
    "block_update_reduce": BlockUpdate(block=1, round=7, codec="raw", tensors=(
        pack_tensor("part", "float32", (1,), struct.pack("<f", 0.5)),),
        meta={"phase": "reduce", "part": 0, "group": "0123456789abcdef"}),
    "block_update_gossip": BlockUpdate(block=0, round=1, codec="raw", tensors=(  # the first "Gossip partition" row's
        pack_tensor("part", "float32", (1,), struct.pack("<f", 0.5)),),               # small group 0
        meta={"phase": "reduce", "part": 0, "group": "6d327a344ff882c5"}),
    "block_update_topk": BlockUpdate(block=1, round=3, codec="topk", tensors=(
        pack_tensor("idx", "int16", (1, 2), struct.pack("<2h", 1, 4)),
        pack_tensor("val", "int8", (1, 2), struct.pack("<2b", 127, -64)),
        pack_tensor("scale", "float32", (1,), struct.pack("<f", 0.5))),
        meta={"phase": "reduce", "part": 0, "group": "0123456789abcdef"}),
    "block_update_sign": BlockUpdate(block=1, round=4, codec="sign", tensors=(  # a 3-element piece: +, -, +
        pack_tensor("bits", "uint8", (1, 512), bytes([0b101]) + bytes(511)),
        pack_tensor("scale", "float32", (1,), struct.pack("<f", 0.25))),
        meta={"phase": "reduce", "part": 0, "group": "0123456789abcdef"}),
    "block_update_sign_auto": BlockUpdate(block=1, round=2, codec="sign", tensors=(  # r9: a sponsor's probe part
        pack_tensor("bits", "uint8", (1, 512), bytes([0b101]) + bytes(511)),       # (the "Sync mode" rows)
        pack_tensor("scale", "float32", (1,), struct.pack("<f", 0.25))),
        meta={"phase": "reduce", "part": 0, "group": "0123456789abcdef", "mode": "params/1/sign/1.7",
              "choice": {"mode": "params/32/sign/1", "step_s": 0.25, "probe_wire_s": 0.9, "grads_share": 0.99}}),
    "block_update_join": BlockUpdate(block=1, round=8, codec="raw",
                                     meta={"phase": "join", "step": 7, "digest": "0a1b2c3d", "scope": "relay"}),
    "block_update_join_job": BlockUpdate(block=1, round=8, codec="raw",  # the first "Job digest" row's job
                                         meta={"phase": "join", "step": 7, "digest": "0a1b2c3d", "scope": "relay",
                                               "job": "65d86729021fe986.00bcecbceb487a88"}),
    "block_update_admit": BlockUpdate(block=1, round=8, codec="raw",
                                      meta={"phase": "admit", "peer": "ab" * 32, "at": 10, "scope": "relay"}),
    "block_update_admit_after": BlockUpdate(block=1, round=8, codec="raw",
                                            meta={"phase": "admit", "peer": "ab" * 32, "at": 10, "after": 7,
                                                  "scope": "relay"}),
    "stream_open": StreamOpen(kind="checkpoint", name="block-1", total_size=5, sha256=bytes(range(32)),
                              offset=0, meta={}, stream_id=3),
    "stream_chunk": StreamChunk(offset=0, data=b"hello", stream_id=3),
    "stream_chunk_lz4": StreamChunk(offset=4096, data=b"a" * 100, stream_id=3),
    "stream_end": StreamEnd(stream_id=3),
    "stream_request": StreamRequest(kind="checkpoint", name="block1", offset=1024, stream_id=3),
    "pipeline_forward": PipelineForward(request_id=9, route=("127.0.0.1:4001", "127.0.0.1:4002"), hop=1, tensors=(
        pack_tensor("h", "float32", (1, 2), struct.pack("<2H", 0x3F80, 0xC000), "bf16"),), meta={"n": 4}),
    "pipeline_forward_exact": PipelineForward(request_id=10, route=("127.0.0.1:4001", "127.0.0.1:4002"), hop=0, meta={
        "mode": "exact", "session": 3, "blocks": [0, 1], "reply_to": "ab" * 32, "codec": "bf16", "end": False,
        "spec": {"base": 2, "keep": [0, 1], "start": 4, "ids": [104, 105, 33], "positions": [4, 5, 6],
                 "parents": [-1, 0, 1], "logits": [0, 1, 2], "slots": [], "draft": 2, "invariant": True}}),
    "pipeline_forward_wide": PipelineForward(request_id=11, route=("127.0.0.1:4001", "127.0.0.1:4002"), hop=0, meta={
        "mode": "exact", "session": 3, "blocks": [0, 1], "reply_to": "ab" * 32, "codec": "bf16", "end": False,
        "spec": {"base": 2, "keep": [0, 1], "start": 4, "ids": [104, 105, 33], "positions": [4, 5, 6],
                 "parents": [-1, 0, 1], "logits": [0, 1, 2], "slots": [], "draft": 2, "invariant": True,
                 "width": 4}}),
    "pipeline_forward_drawn": PipelineForward(request_id=12, route=("127.0.0.1:4001", "127.0.0.1:4002"), hop=0, meta={
        "mode": "exact", "session": 3, "blocks": [0, 1], "reply_to": "ab" * 32, "codec": "bf16", "end": False,
        "spec": {"base": 2, "keep": [0, 1], "start": 4, "ids": [104, 105, 33], "positions": [4, 5, 6],
                 "parents": [-1, 0, 1], "logits": [0, 1, 2], "slots": [], "draft": 2, "invariant": True,
                 "width": 4, "sample": [12345, 800, 8]}}),
    "pipeline_forward_relayed": PipelineForward(request_id=14, route=("127.0.0.1:4001", "127.0.0.1:4002"), hop=1, meta={
        "mode": "exact", "session": 3, "blocks": [0, 1], "reply_to": "ab" * 32, "codec": "bf16", "end": False,
        "spec": {"base": 2, "keep": [0, 1], "start": 4, "ids": [104, 105, 33], "positions": [4, 5, 6],
                 "parents": [-1, 0, 1], "logits": [0, 1, 2], "slots": [], "draft": 2, "invariant": True},
        "client_addr": "127.0.0.2"}),
    "pipeline_result": PipelineResult(request_id=9, tensors=(
        pack_tensor("bytes", "uint8", (3,), b"abc"),), meta={}),
    "pipeline_result_busy": PipelineResult(request_id=13, tensors=(), meta={
        "error": "block 2 at 127.0.0.1:4002: 64 requests already wait here", "hop": 2, "block": 2, "fault": "busy"}),
    "stream_reset": StreamReset(code=int(ErrorCode.STREAM_INTEGRITY), reason="sha256 mismatch", stream_id=3),
    "error_timeout": Error(code=int(ErrorCode.TIMEOUT), reason="handshake timed out"),
}


# --- the handshake-dependent vectors: fixed keys, as in PROTOCOL.md's Handshake table -------------

def _key(text: str) -> X25519PrivateKey:
    return X25519PrivateKey.from_private_bytes(hashlib.sha256(text.encode()).digest())


PSK = hashlib.sha256(b"swarm key").digest()


def fixed_connection(role: Role) -> Connection:
    """A Connection with the fixed static and ephemeral keys of the Handshake vectors, empty info."""
    who = "initiator" if role is Role.INITIATOR else "responder"
    return Connection(role, _key(f"{who} static"), PSK, ephemeral=_key(f"{who} ephemeral"))


def session_transcript() -> dict[str, bytes]:
    """The frames of a sealed session between the two fixed Connections, in order."""
    i, r = fixed_connection(Role.INITIATOR), fixed_connection(Role.RESPONDER)
    out = {"message 1": i.initiate()}
    r.receive_data(out["message 1"])
    r.next_event()
    out["message 2"] = r.data_to_send()
    i.receive_data(out["message 2"])
    i.next_event()
    out["message 3"] = i.data_to_send()
    r.receive_data(out["message 3"])
    r.next_event()
    out["confirmation"] = r.data_to_send()
    i.receive_data(out["confirmation"])
    i.next_event()
    out["initiator ping"] = i.send(Ping(nonce=7))
    out["responder pong"] = r.send(Pong(nonce=7))
    return out


def message3_with_hello(hello: bytes) -> bytes:
    """Handshake message 3 (framed) of the fixed initiator, after the fixed message 2, carrying
    ``hello`` as its payload: how the Invalid hellos vectors are made."""
    t = session_transcript()
    n = NoiseHandshake(True, _key("initiator static"), PSK, PROLOGUE, _key("initiator ephemeral"))
    n.write_message(b"")
    n.read_message(t["message 2"][18:])
    return frame_message(Handshake(data=n.write_message(hello)))


# name -> the hello message 3 carries (the code each is rejected with is PROTOCOL.md's)
INVALID_HELLOS = {
    "v is true": b"\x83\xa1v\xc3\xa4seal\xc3\xa4info\x80",
    "v is 1.0": b"\x83\xa1v\xcb\x3f\xf0\x00\x00\x00\x00\x00\x00\xa4seal\xc3\xa4info\x80",
    "v is 2": b"\x83\xa1v\x02\xa4seal\xc3\xa4info\x80",
    "v in a longer form": b"\x83\xa1v\xcc\x01\xa4seal\xc3\xa4info\x80",
    "seal is 1": b"\x83\xa1v\x01\xa4seal\x01\xa4info\x80",
    "seal differs": b"\x83\xa1v\x01\xa4seal\xc2\xa4info\x80",
    "extra key": b"\x84\xa1v\x01\xa4seal\xc3\xa4info\x80\xa1x\x00",
    "duplicate key": b"\x84\xa1v\x01\xa4seal\xc3\xa4info\x80\xa1v\x01",
    "unknown role": b"\x83\xa1v\x01\xa4seal\xc3\xa4info\x81\xa4role\xa3cat",
    # canonical msgpack (the tests check): refused by the range check, not as a longer form (r6.22)
    "block not a u16": b"\x83\xa1v\x01\xa4seal\xc3\xa4info\x81\xa6blocks\x91\xff",
    "block past a u16": b"\x83\xa1v\x01\xa4seal\xc3\xa4info\x81\xa6blocks\x91\xce\x00\x01\x00\x00",
    # r8, reachability: a port in 1..65535, an address a string (canonical: only the values are wrong)
    "dial_back is 0": b"\x83\xa1v\x01\xa4seal\xc3\xa4info\x81\xa9dial_back\x00",
    "dial_back past a u16": b"\x83\xa1v\x01\xa4seal\xc3\xa4info\x81\xa9dial_back\xce\x00\x01\x00\x00",
    "seen not a string": b"\x83\xa1v\x01\xa4seal\xc3\xa4info\x81\xa4seen\x07",
}
# r8: a hello with the reachability keys (section 4), which a responder takes (its info as here)
REACH_HELLO = {"v": 1, "seal": True, "info": {"dial_back": 7001, "dialed": "203.0.113.7:7001",
                                              "seen": "203.0.113.9:41000"}}
RANGE_HELLOS = ("block not a u16", "block past a u16")  # canonical: only their values are wrong


def tables(section: str) -> list[list[str]]:
    """Rows (cells) of the markdown tables under the heading ``section`` of PROTOCOL.md."""
    text = PROTOCOL_MD.read_text()
    m = re.search(r"^#+ " + re.escape(section) + r"\s*$(.*?)(?=^#+ |\Z)", text, re.M | re.S)
    assert m, f"PROTOCOL.md has no section {section!r}"
    rows = []
    for line in m.group(1).splitlines():
        if line.startswith("|") and not set(line) <= set("|- "):
            cells = [c.strip().strip("`") for c in line.strip().strip("|").split("|")]
            rows.append(cells)
    return rows[1:]  # drop the header row


# --- recipes of the invalid frames added in r4 (PROTOCOL.md's hex must equal them) ---------------

def raw_header(mtype: int, flags: int, stream_id: int, length: int) -> bytes:
    """A header with a valid crc and any field values, for invalid vectors."""
    import zlib
    head = struct.pack(">2sBBBBII", b"BT", 1, mtype, flags, 0, stream_id, length)
    return head + struct.pack(">I", zlib.crc32(head))


def raw_frame(mtype: int, meta: bytes, body: bytes = b"", stream_id: int = 0, flags: int = 0) -> bytes:
    """A map-payload frame from raw msgpack bytes (which may be non-canonical on purpose)."""
    payload = struct.pack(">I", len(meta)) + meta + body
    return raw_header(mtype, flags, stream_id, len(payload)) + payload


def _pk(obj) -> bytes:
    import msgpack
    return msgpack.packb(obj, use_bin_type=True)


def _result_with(**desc) -> bytes:
    d = {"n": "b", "d": "uint8", "s": [3], "c": "raw", "g": 1 << 20, "L": [3], "z": [False], **desc}
    return raw_frame(0x41, _pk({"request_id": 1, "tensors": [d], "meta": {}}), b"abc")


def _int8_update(codec: str, **desc) -> bytes:
    d = {"n": "w", "d": "float32", "s": [3], "c": "int8", "g": 1 << 20, "L": [3], "z": [False], **desc}
    return raw_frame(0x20, _pk({"block": 0, "round": 1, "codec": codec, "tensors": [d], "meta": {}}), b"\x7f\xc0\x00")


INVALID_R4 = {  # name in PROTOCOL.md's Invalid frames -> the frame
    "integer in a longer form": raw_frame(0x04, b"\x81\xa5nonce\xcc\x07"),
    "duplicate map key": raw_frame(0x04, b"\x82\xa5nonce\x07\xa5nonce\x07"),
    "float 32 in metadata": raw_frame(0x12, b"\x81\xa6status\x81\xa1x\xca\x3f\x80\x00\x00"),
    "ext type in metadata": raw_frame(0x12, b"\x81\xa6status\x81\xa1x\xd4\x05\x00"),
    "map key not a string": raw_frame(0x12, b"\x81\xa6status\x81\x01\x02"),
    "ping on a stream": raw_frame(0x04, _pk({"nonce": 7}), stream_id=5),
    "stream request on stream 0": raw_frame(0x33, _pk({"kind": "checkpoint", "name": "block1", "offset": 0})),
    "stream reset on stream 0": raw_frame(0x34, _pk({"code": 12, "reason": ""})),
    "unsealed frame one byte over the limit": raw_header(0x31, 0, 1, 16 * 1024 * 1024 + 1),
    "tensor shape holds a boolean": _result_with(s=[True]),
    "tensor codec not a string": _result_with(c=1),
    "unknown tensor codec": _result_with(c="zz"),
    "int8 tensor without scales": _int8_update("int8"),
    "scales on a raw tensor": _result_with(k=[1.0]),
    "update codec differs from its tensor": _int8_update("raw", k=[0.5]),
    "topk update without its three tensors": raw_frame(0x20, _pk({"block": 0, "round": 1, "codec": "topk", "tensors": [
        {"n": "idx", "d": "int16", "s": [1, 1], "c": "raw", "g": 1 << 20, "L": [2], "z": [False]}], "meta": {}}),
        b"\x01\x00"),
    "sign update with a chunk of 511 bytes": raw_frame(0x20, _pk({"block": 0, "round": 1, "codec": "sign", "tensors": [
        {"n": "bits", "d": "uint8", "s": [1, 511], "c": "raw", "g": 1 << 20, "L": [511], "z": [False]},
        {"n": "scale", "d": "float32", "s": [1], "c": "raw", "g": 1 << 20, "L": [4], "z": [False]}], "meta": {}}),
        bytes(511) + b"\x00\x00\x80\x3e"),
    # r6.22: the answers of r6.1 to the spec-gap review, as vectors
    "tensor name of 257 characters": _result_with(n="b" * 257),
    "unknown update codec": raw_frame(0x20, _pk({"block": 0, "round": 1, "codec": "zz", "tensors": [
        {"n": "w", "d": "float32", "s": [1], "c": "raw", "g": 1 << 20, "L": [4], "z": [False]}], "meta": {}}),
        bytes(4)),
    "stream open offset past its total size": raw_frame(0x30, _pk({
        "kind": "checkpoint", "meta": {}, "name": "b", "offset": 10, "total_size": 5, "sha256": bytes(32)}), stream_id=3),
    "stream chunk whose lz4 does not decompress": raw_header(0x31, 0x01, 3, 32) + struct.pack(">QI", 0, 100) + b"\xff" * 20,
    "error code not a u16": raw_frame(0x02, _pk({"code": 65536, "reason": "x"})),
}


def _first_frames() -> dict[str, bytes]:
    m1 = session_transcript()["message 1"][18:]
    return {  # name in PROTOCOL.md's Invalid first frames -> the bytes a responder in START gets
        "handshake announcing 16 MiB": raw_header(0x01, 0, 0, 16 * 1024 * 1024),
        "handshake one byte over the limit": raw_header(0x01, 0, 0, 65536),
        "sealed message 1": raw_header(0x01, 0x02, 0, 48) + m1,
        "compressed message 1": raw_header(0x01, 0x01, 0, 48) + m1,
        "message 1 on a stream": raw_header(0x01, 0, 5, 48) + m1,
        "message 1 one byte too long": raw_header(0x01, 0, 0, 49) + m1 + b"\0",
        "ping before the handshake": frame_message(Ping(nonce=7)),
        "goodbye before the handshake": frame_message(Goodbye(reason="bye")),
    }


INVALID_FIRST = _first_frames()
