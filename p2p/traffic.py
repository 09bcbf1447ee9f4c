"""BlockTrain's kinds of traffic (the classifier the peer hands every Connection it makes), and
how counts add up.

The protocol core counts bytes by whatever kind this returns (``Connection(kind_of=...)``) and
gives the chunks, end and reset of a stream the kind of its STREAM_REQUEST/STREAM_OPEN; the
words themselves are the application's (PROTOCOL.md section 10):

- ``update``: a BLOCK_UPDATE carrying tensors (an averaging round's parts);
- ``pipeline``: PIPELINE_FORWARD and PIPELINE_RESULT (serving);
- a stream's kind for STREAM_* frames: ``checkpoint``, ``lower-checkpoint`` or ``update``; any
  other kind a peer names is ``stream-other``, so a peer cannot grow the table;
- ``control`` for the rest: handshake, membership, heartbeats, status, and the tensorless
  BLOCK_UPDATEs of the averaging group (join, welcome, admit, ready, absent, excluded, ...).

Counts are ``{"frames", "payload_bytes", "wire_bytes"}`` dicts; they add up in one place
(``add_counts``), for a peer's closed connections, its report, and a swarm's reports.
"""

from __future__ import annotations

from dataclasses import dataclass, field

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
    if type(msg) is BlockUpdate:  # type(msg) each time: mypy narrows on it, not on a name for it
        return "update" if msg.tensors else "control"  # without tensors: the group's join handshake
    if type(msg) is StreamOpen or type(msg) is StreamRequest:
        return msg.kind if msg.kind in STREAM_KINDS else "stream-other"
    return _BY_TYPE.get(type(msg), "control")


COUNT_FIELDS = ("frames", "payload_bytes", "wire_bytes")
BREAKDOWNS = ("by_type", "by_kind")
DIRECTIONS = ("sent", "received")


def empty_counts() -> dict:
    return {k: 0 for k in COUNT_FIELDS}


def add_counts(into: dict, counts: dict) -> dict:
    """Add ``{name: counts}`` into ``into`` (in place), name by name."""
    for name, c in counts.items():
        acc = into.setdefault(name, empty_counts())
        for k in COUNT_FIELDS:
            acc[k] += c.get(k, 0)
    return into


def _empty_traffic() -> dict:
    return {d: {b: {} for b in BREAKDOWNS} for d in DIRECTIONS}


@dataclass
class PeerTraffic:
    """Bytes exchanged with one remote peer over its closed connections (and its address then)."""
    closed: dict = field(default_factory=_empty_traffic)
    addr: str = ""

    def add(self, snapshot: dict):
        for d in DIRECTIONS:
            for b in BREAKDOWNS:
                add_counts(self.closed[d][b], snapshot[d].get(b, {}))


def merge_counts(closed: dict, live: dict | None) -> dict:
    """Closed-connection counts plus a live connection's snapshot, with totals per direction."""
    out: dict = {}
    for d in DIRECTIONS:
        out[d] = {}
        for b in BREAKDOWNS:
            by: dict = {}
            add_counts(by, closed[d][b])
            if live is not None:
                add_counts(by, live[d].get(b, {}))
            out[d][b] = dict(sorted(by.items()))
        out[d]["total"] = {k: sum(c[k] for c in out[d]["by_type"].values()) for k in COUNT_FIELDS}
    return out


def traffic_totals(peers) -> dict:
    """Totals and bytes by kind over per-peer traffic dicts (``merge_counts`` results)."""
    totals = {d: empty_counts() for d in DIRECTIONS}
    by_kind: dict = {d: {} for d in DIRECTIONS}
    for t in peers:
        for d in DIRECTIONS:
            for k in COUNT_FIELDS:
                totals[d][k] += t[d]["total"][k]
            add_counts(by_kind[d], t[d]["by_kind"])
    return {"totals": totals, "by_kind": by_kind}
