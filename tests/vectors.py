"""The PROTOCOL.md test vectors: messages by name, and a parser for PROTOCOL.md's tables.

PROTOCOL.md is the source of the hex; this file holds the messages the hex must equal.
"""

from __future__ import annotations

import re
import struct
from pathlib import Path

from blocktrain.protocol import (Announce, BlockUpdate, Error, Goodbye, Handshake, PeerInfo, PeerList,
                                 PipelineForward, PipelineResult, Ping, Pong, Status, StreamChunk, StreamEnd, StreamOpen, StreamRequest,
                                 pack_tensor)

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
    "block_update_join": BlockUpdate(block=1, round=8, codec="raw", meta={"phase": "join"}),
    "stream_open": StreamOpen(kind="checkpoint", name="block-1", total_size=5, sha256=bytes(range(32)),
                              offset=0, meta={}, stream_id=3),
    "stream_chunk": StreamChunk(offset=0, data=b"hello", stream_id=3),
    "stream_chunk_lz4": StreamChunk(offset=4096, data=b"a" * 100, stream_id=3),
    "stream_end": StreamEnd(stream_id=3),
    "stream_request": StreamRequest(kind="checkpoint", name="block1", offset=1024, stream_id=3),
    "pipeline_forward": PipelineForward(request_id=9, route=("127.0.0.1:4001", "127.0.0.1:4002"), hop=1, tensors=(
        pack_tensor("h", "float32", (1, 2), struct.pack("<2H", 0x3F80, 0xC000), "bf16"),), meta={"n": 4}),
    "pipeline_result": PipelineResult(request_id=9, tensors=(
        pack_tensor("bytes", "uint8", (3,), b"abc"),), meta={}),
}


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
