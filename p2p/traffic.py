"""BlockTrain's kinds of traffic: the classifier the peer hands every Connection it makes.

The protocol core counts bytes by whatever kind this returns (``Connection(kind_of=...)``) and
gives the chunks, end and reset of a stream the kind of its STREAM_REQUEST/STREAM_OPEN; the
words themselves are the application's (PROTOCOL.md section 10):

- ``update``: a BLOCK_UPDATE carrying tensors (an averaging round's parts);
- ``pipeline``: PIPELINE_FORWARD and PIPELINE_RESULT (serving);
- a stream's kind for STREAM_* frames: ``checkpoint``, ``lower-checkpoint`` or ``update``; any
  other kind a peer names is ``stream-other``, so a peer cannot grow the table;
- ``control`` for the rest: handshake, membership, heartbeats, status, and the tensorless
  BLOCK_UPDATEs of the averaging group (join, welcome, late, absent, excluded).
"""

from __future__ import annotations

from blocktrain.protocol import (BlockUpdate, Message, PipelineForward, PipelineResult, StreamChunk, StreamEnd,
                                 StreamOpen, StreamRequest, StreamReset)

# Stream kinds counted under their own name (PROTOCOL.md section 7).
STREAM_KINDS = frozenset({"checkpoint", "lower-checkpoint", "update"})
# Kinds that depend on the message type alone (one dict lookup per frame: this runs for each).
_BY_TYPE = {PipelineForward: "pipeline", PipelineResult: "pipeline",
            StreamChunk: "stream-other", StreamEnd: "stream-other", StreamReset: "stream-other"}


def kind_of(msg: Message) -> str:
    """The kind of traffic ``msg`` counts under (``Connection(kind_of=kind_of)``). The core asks
    it for a STREAM_CHUNK, STREAM_END or STREAM_RESET only when it did not see the stream begin."""
    t = type(msg)
    if t is BlockUpdate:
        return "update" if msg.tensors else "control"  # without tensors: the group's join handshake
    if t is StreamOpen or t is StreamRequest:
        return msg.kind if msg.kind in STREAM_KINDS else "stream-other"
    return _BY_TYPE.get(t, "control")
