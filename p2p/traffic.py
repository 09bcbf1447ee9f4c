"""Byte accounting of the application: what each kind of traffic is, and how counts add up.

Rules:
- The protocol core counts frames and bytes per message type and per kind; what a kind IS is the
  application's word, given here by ``kind_of``: ``update`` (BLOCK_UPDATE with tensors),
  ``pipeline`` (PIPELINE_*), a stream's own kind for STREAM_* frames (``checkpoint``,
  ``lower-checkpoint``; any other is ``stream-other``, so a peer cannot grow the table),
  ``control`` for everything else (membership, heartbeats, the group's join handshake).
- Counts are ``{"frames", "payload_bytes", "wire_bytes"}`` dicts; they add up in one place
  (``add_counts``), for a peer's closed connections, its report, and a swarm's reports.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from blocktrain.protocol import MessageType

STREAM_KINDS = frozenset({"checkpoint", "lower-checkpoint"})
COUNT_FIELDS = ("frames", "payload_bytes", "wire_bytes")
BREAKDOWNS = ("by_type", "by_kind")
DIRECTIONS = ("sent", "received")
_PIPELINE = frozenset({MessageType.PIPELINE_FORWARD, MessageType.PIPELINE_RESULT})


def kind_of(msg) -> str:
    """The kind of traffic a message belongs to (for STREAM_REQUEST/STREAM_OPEN: the stream's)."""
    t = msg.TYPE
    if t is MessageType.BLOCK_UPDATE:
        return "update" if msg.tensors else "control"
    if t in _PIPELINE:
        return "pipeline"
    kind = getattr(msg, "kind", None)
    if kind is not None:
        return kind if kind in STREAM_KINDS else "stream-other"
    return "control"


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
    """Bytes exchanged with one remote peer over its closed connections."""
    closed: dict = field(default_factory=_empty_traffic)

    def add(self, snapshot: dict):
        for d in DIRECTIONS:
            for b in BREAKDOWNS:
                add_counts(self.closed[d][b], snapshot[d].get(b, {}))


def merge_counts(closed: dict, live: dict | None) -> dict:
    """Closed-connection counts plus a live connection's snapshot, with totals per direction."""
    out = {}
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
