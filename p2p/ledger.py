"""The traffic ledger: bytes and frames moved per remote peer, message type, kind and direction
(counts add up in traffic.py), bounded. Sans-IO: the driver hands in a connection's counter
snapshot when the connection ends, and the live connections when a report is made.

Rules:
- A connection's counts join its peer's row when the connection ends; a report adds the live
  connections' counts as they stand, so totals are exact at any time.
- A row keeps the address its peer had when the row was opened ("" for a client). In a report a
  row is a client's when no member holds that id and a client does, or when it has no address.
- Identities are free, so rows are bounded: past MAX_TRAFFIC_ROWS the oldest rows of peers no
  longer connected fold into one row, DEPARTED_ROW, which counts the peers folded into it
  (``departed_peers``). Totals stay exact.
"""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING, Callable, Mapping

from .traffic import PeerTraffic, merge_counts, traffic_totals

if TYPE_CHECKING:
    from .members import Member
    from .transport import PeerConnection

MAX_TRAFFIC_ROWS = 256  # per-peer traffic rows; departed peers past it fold into DEPARTED_ROW
# The traffic row that holds the counts of departed peers folded together.
DEPARTED_ROW = "departed"


class TrafficLedger:
    """Per-peer rows of the counts of closed connections, in the order they were opened."""

    def __init__(self, max_rows: int = MAX_TRAFFIC_ROWS):
        self.max_rows = max_rows
        self.rows: collections.OrderedDict[str, PeerTraffic] = collections.OrderedDict()
        self.departed_peers = 0  # peers whose rows were folded into DEPARTED_ROW

    def add(self, pid: str, snapshot: dict, addr: str, connected: Callable[[str], bool]) -> None:
        """A connection of ``pid`` (listening at ``addr``, "" for a client) ended with these counts;
        ``connected(pid)`` says whose rows may not fold yet."""
        t = self.rows.get(pid)
        if t is None:
            self.rows[pid] = t = PeerTraffic(addr=addr)
        t.add(snapshot)
        self.fold(connected)

    def fold(self, connected: Callable[[str], bool]) -> None:
        """Past the bound, the oldest rows of peers no longer connected fold into one."""
        excess = len(self.rows) - self.max_rows
        if excess <= 0:
            return
        folded = self.rows.get(DEPARTED_ROW) or PeerTraffic()
        for pid in [p for p in self.rows if p != DEPARTED_ROW and not connected(p)]:
            folded.add(self.rows.pop(pid).closed)
            self.departed_peers += 1
            excess -= 1
            if excess < 0:  # the folded row itself takes one
                break
        self.rows[DEPARTED_ROW] = folded

    def report(self, members: Mapping[str, Member], clients: Mapping[str, PeerConnection]) -> dict:
        """Every row, member and client with its counts so far, and the totals over them."""
        peers = {}
        for pid in set(self.rows) | set(members) | set(clients):
            m = members.get(pid)
            pc = m.conn if m is not None else clients.get(pid)
            row = self.rows.get(pid) or PeerTraffic()
            t = merge_counts(row.closed, pc.conn.counter.snapshot() if pc is not None and not pc.accounted else None)
            t["addr"] = m.info.addr if m else row.addr
            t["client"] = (m is None and pid in clients) or t["addr"] == ""
            if pid == DEPARTED_ROW:
                t.update(client=False, departed_peers=self.departed_peers)
            peers[pid] = t
        return {"peers": peers, **traffic_totals(peers.values())}
