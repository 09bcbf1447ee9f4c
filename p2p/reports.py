"""Transfer-volume reports people read: one peer's, or a swarm's, summed and summarised.

Rules:
- A report file is what ``Peer.report()`` writes (kind "blocktrain-transfer-report"); anything
  else is a ``ReportError`` naming the file.
- ``summarise`` gives one row per peer (block, rounds, rejected, CE start -> end, bytes by kind, CE
  per GB) and the swarm's bytes by kind; ``details`` gives every (peer, direction, remote, type) row.
- A report is its peer's claim (a holder of the swarm key may write any): rows are
  attributed to the peer whose report says them, and where two reports see one link, what one
  says it sent is checked against what the other says it received (``disagreements``: more than
  ``LINK_SLACK_BYTES`` and ``LINK_SLACK_FRAC`` apart, in a direction the two reports' times
  allow; ``link_disagreements``; of two files of one peer, the later named is compared).
"""

from __future__ import annotations

import json
from pathlib import Path

from .ledger import DEPARTED_ROW  # the row of folded departed peers (no link of its own)
from .traffic import DIRECTIONS, add_counts

REPORT_KIND = "blocktrain-transfer-report"


class ReportError(Exception):
    """A file is not a readable BlockTrain transfer report."""


def read_report(path: str | Path) -> dict:
    try:
        r = json.loads(Path(path).read_text())
    except OSError as e:
        raise ReportError(f"{path}: {e}") from None
    except ValueError as e:
        raise ReportError(f"{path}: not JSON: {e}") from None
    if not isinstance(r, dict) or r.get("kind") != REPORT_KIND:
        raise ReportError(f"{path}: not a BlockTrain transfer report")
    _check_structure(r, path)
    return r


LINK_SLACK_BYTES = 64 * 1024
LINK_SLACK_FRAC = 0.01


def _link_bytes(r: dict, remote: str, d: str) -> int | None:
    """Wire bytes ``r``'s peer counts in direction ``d`` with ``remote``; None where its report has
    no row for it and may have folded it into DEPARTED_ROW (then nothing can be compared)."""
    t = r["peers"].get(remote)
    if t is None:
        return None if DEPARTED_ROW in r["peers"] else 0
    return sum(c["wire_bytes"] for c in t[d]["by_type"].values())


def _covers(outer: dict, inner: dict) -> bool:
    """``outer``'s report counted everything ``inner``'s did: it began no later and ended no earlier."""
    return outer["start_time"] <= inner["start_time"] and outer["end_time"] >= inner["end_time"]


def link_disagreements(reports: list[dict], counted: dict | None = None) -> list[dict]:
    """Links both of whose ends are among ``reports`` where the bytes one end says it sent and the
    other says it received differ by more than the slack (both ``LINK_SLACK_BYTES`` and
    ``LINK_SLACK_FRAC``), in the direction the two reports' times allow: a receiver whose report
    covers the sender's time cannot have received less than was sent (beyond a frame lost with a
    dying connection), nor a sender covering the receiver's time have sent less than was received.
    Reports written at other moments (a peer resumed under its identity, a snapshot of a running
    swarm), a row folded into DEPARTED_ROW, are not compared. ``counted`` (when given) gets how
    many directions of links both reports see were compared and how many were not: the times a
    report gives are its writer's word too, and a comparison left out is no agreement."""
    by_id = {r["peer_id"]: r for r in reports}
    out = []
    n = {"compared": 0, "not_compared": 0}
    for a, ra in by_id.items():
        for b, rb in by_id.items():
            if b == a or b not in ra["peers"]:
                continue
            sent, got = _link_bytes(ra, b, "sent"), _link_bytes(rb, a, "received")
            if sent is None or got is None or not (_covers(rb, ra) or _covers(ra, rb)):
                n["not_compared"] += 1
                continue
            n["compared"] += 1
            slack = max(LINK_SLACK_BYTES, LINK_SLACK_FRAC * max(sent, got))
            if (sent > got + slack and _covers(rb, ra)) or (got > sent + slack and _covers(ra, rb)):
                out.append({"from": a, "to": b, "sent_says": sent, "received_says": got})
    if counted is not None:
        counted.update(n)
    return out


def _check_structure(r: dict, path) -> None:
    """What the summary reads of a report, checked: a file that is no report of this form is a
    ReportError naming it, not a KeyError later."""
    def counts(t) -> bool:
        return isinstance(t, dict) and all(isinstance(t.get(d), dict) and isinstance(t[d].get("by_type"), dict)
                                           and all(isinstance(c, dict) and all(type(c.get(k)) is int for k in
                                                   ("frames", "payload_bytes", "wire_bytes"))
                                                   for c in t[d]["by_type"].values()) for d in DIRECTIONS)
    ok = (isinstance(r.get("peer_id"), str) and isinstance(r.get("peers"), dict)
          and all(isinstance(k, str) and counts(v) for k, v in r["peers"].items())
          and all(isinstance(r.get(k), (int, float)) and not isinstance(r.get(k), bool) for k in ("start_time", "end_time"))
          and isinstance(r.get("totals"), dict)
          and all(isinstance(r["totals"].get(d), dict) and type(r["totals"][d].get("wire_bytes")) is int
                  for d in DIRECTIONS)
          and all(k in r for k in ("addr", "blocks", "role")))
    if not ok:
        raise ReportError(f"{path}: not a BlockTrain transfer report of this version (peer_id, peers, times, totals)")


def summarise(files) -> dict:
    """The aggregate of several reports (JSON-able)."""
    kinds: dict[str, dict] = {d: {} for d in DIRECTIONS}
    peers, reports = [], []
    for f in files:
        r = read_report(f)
        reports.append(r)
        for d in DIRECTIONS:
            add_counts(kinds[d], r.get("by_kind", {}).get(d, {}))
        tr = r.get("training") or {}
        moved = r["totals"]["sent"]["wire_bytes"] + r["totals"]["received"]["wire_bytes"]
        by_kind = {k: c["wire_bytes"] for d in DIRECTIONS for k, c in r.get("by_kind", {}).get(d, {}).items()}
        peers.append({
            "file": str(f), "peer_id": r["peer_id"], "addr": r["addr"], "blocks": r["blocks"], "role": r["role"],
            "seconds": r["end_time"] - r["start_time"], "wire_bytes_moved": moved, "wire_bytes_by_kind": by_kind,
            "training": {k: tr.get(k) for k in ("block", "state", "step", "steps", "schedule", "block_in_work",
                                                 "ce_start", "ce_end", "head_ce", "ce_improvement_per_gb", "busy",
                                                 "memory", "rounds_applied")} if tr else None,
            "failed_rounds": len(tr.get("failed_rounds", [])),
            "rejected_updates": tr.get("rejected_updates", []), "excluded_by": tr.get("excluded_by", {}),
            "membership_events": len(r.get("events", [])), "details": _detail_rows(r),
        })
    sent = sum(c["wire_bytes"] for c in kinds["sent"].values())
    counted: dict = {}
    disagreements = link_disagreements(reports, counted)
    return {"peers": peers, "by_kind": kinds, "wire_bytes_sent": sent, "disagreements": disagreements,
            "links_compared": counted}


def _detail_rows(r: dict) -> list:
    rows = []
    for pid, t in sorted(r["peers"].items()):
        for d in DIRECTIONS:
            for typ, c in sorted(t[d]["by_type"].items()):
                rows.append([r["peer_id"][:12], d, pid[:12], typ, c["frames"], c["payload_bytes"], c["wire_bytes"]])
    return rows


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def summary_lines(agg: dict) -> list[str]:
    """The short table: one row per peer, then bytes by kind."""
    kinds = sorted({k for p in agg["peers"] for k in p["wire_bytes_by_kind"]})
    head = f"{'peer':<13} {'block':>5} {'state':<9} {'rounds':>6} {'failed':>6} {'rejected':>8} {'CE start -> end':<17} " \
           f"{'CE/GB':>7} " + " ".join(f"{k:>16}" for k in kinds)
    lines = [head]
    for p in agg["peers"]:
        t = p["training"] or {}
        ce = (f"{t['ce_start']:.3f} -> {t['ce_end']:.3f}" if isinstance(t.get("ce_end"), float)
              else f"{t['ce_start']:.3f} -> ..." if isinstance(t.get("ce_start"), float) else "-")
        per_gb = f"{t['ce_improvement_per_gb']:.3g}" if isinstance(t.get("ce_improvement_per_gb"), float) else "-"
        lines.append(f"{p['peer_id'][:12]:<13} {str(t.get('block', '-')):>5} {str(t.get('state', p['role']))[:9]:<9} "
                     f"{str(t.get('rounds_applied', '-')):>6} {p['failed_rounds']:>6} {len(p['rejected_updates']):>8} "
                     f"{ce:<17} {per_gb:>7} " + " ".join(f"{fmt_bytes(p['wire_bytes_by_kind'].get(k, 0)):>16}"
                                                         for k in kinds))
    lines.append("")
    lines.append(f"{'kind':<17} {'sent wire':>11} {'recv wire':>11}")
    for k in sorted(set(agg["by_kind"]["sent"]) | set(agg["by_kind"]["received"])):
        s, rcv = agg["by_kind"]["sent"].get(k, {}), agg["by_kind"]["received"].get(k, {})
        lines.append(f"{k:<17} {fmt_bytes(s.get('wire_bytes', 0)):>11} {fmt_bytes(rcv.get('wire_bytes', 0)):>11}")
    lines.append(f"total wire bytes sent by these peers: {fmt_bytes(agg['wire_bytes_sent'])}")
    for p in agg["peers"]:
        t = p["training"] or {}
        heads = t.get("head_ce")
        if heads:
            from blocktrain.blocks.evaluate import verdicts
            lines.append(f"{p['peer_id'][:12]}: valid CE of the heads along its chain " +
                         " / ".join(f"{c:.3f}" for c in heads))
            lines += [f"  {v}" for v in verdicts(heads)]
        for ev in p["rejected_updates"]:
            lines.append(f"{p['peer_id'][:12]}: REJECTED update from {ev['peer'][:12]} in round {ev['round']}: "
                         f"{ev['reason']} (excluded since)")
        for pid, why in p["excluded_by"].items():
            lines.append(f"{p['peer_id'][:12]}: EXCLUDED by {pid[:12]}, which rejected this peer's update: {why}")
    for x in agg.get("disagreements", []):
        lines.append(f"DISAGREE: {x['from'][:12]} says it sent {fmt_bytes(x['sent_says'])} to {x['to'][:12]}, "
                     f"which says it received {fmt_bytes(x['received_says'])} from it")
    n = agg.get("links_compared") or {}
    lines.append("Each row is what that peer's own report says (a member with the swarm key may write any); "
                 "where two reports see one link, their bytes are compared (DISAGREE lines): "
                 f"{n.get('compared', 0)} link direction(s) compared, {n.get('not_compared', 0)} not "
                 "(reports of other moments, or a row folded into 'departed').")
    return lines


def detail_lines(agg: dict) -> list[str]:
    lines = [f"{'peer':<13} {'dir':<9} {'remote':<13} {'type':<17} {'frames':>8} {'payload':>11} {'wire':>11}"]
    for p in agg["peers"]:
        for peer, d, remote, typ, fr, pb, wb in p["details"]:
            lines.append(f"{peer:<13} {d:<9} {remote:<13} {typ:<17} {fr:>8} {fmt_bytes(pb):>11} {fmt_bytes(wb):>11}")
    return lines


def plain(text: str) -> str:
    """``text`` with every character that is not printable (escape sequences, newlines) as ``?``."""
    return "".join(c if c.isprintable() else "?" for c in text)


def status_lines(st: dict) -> list[str]:
    """``bt-peer status``'s lines for a peer's STATUS answer ``st`` (a claim, not a fact): what
    the asked peer says of itself, then its members. A member's blocks and role are what it
    announced (marked ``*``: a swarm key holder may claim any), its state and when it was last heard
    are what the asked peer saw itself."""
    lines = [f"peer {st['peer_id'][:16]} at {st['addr'] or '(no address)'} (blocks {st['blocks']}, role "
             f"{st['role']}; as it says)"]
    r = st.get("reach")
    if isinstance(r, dict):  # reach.py, as the peer says
        verdict = ("reachable" if r.get("reachable") is True else "not reachable (behind NAT or a firewall)"
                   if r.get("reachable") is False else "reachability not known")
        lines.append(f"  {verdict}; listening on {r.get('listen')}" +
                     (f", seen by members from {r['observed']}" if r.get("observed") else "") +
                     (f": {r['why']}" if r.get("why") else ""))
    w = st.get("work")
    if w:
        lines.append(f"  {w['state']}: holds block {w['holds']}" + (
            f", training block {w['training_block']}" if w.get("training_block") is not None else "")
            + f", step {w['step']}/{w['steps']}, round {w['round']}, group of {len(w['group'])}"
            + (f"; rounds: {w['sync'][:80]}" if isinstance(w.get("sync"), str) else ""))
    for block, how in sorted(((st.get("serving") or {}).get("exact") or {}).items()):
        lines.append(f"  serving block {block}: {how}")
    lines.append(f"{'peer':<18} {'address':<22} {'blocks*':<10} {'role*':<10} {'state':<8} {'last heard':>10}")
    for m in st["members"]:
        lines.append(f"{m['peer_id'][:16]:<18} {m['addr'] or '-':<22} {str(m['blocks']):<10} {m['role']:<10} "
                     f"{m['state']:<8} {m['last_heard_s']:>9.1f}s")
    lines.append("* claimed: as each member announced it (a member with the swarm key may claim any block or "
                 "role); state and last heard: what this peer saw")
    t = st["traffic"]
    lines.append(f"bytes moved by this peer: sent {fmt_bytes(t['sent']['wire_bytes'])}, "
                 f"received {fmt_bytes(t['received']['wire_bytes'])}")
    return [plain(line) for line in lines]  # what peers said, as text: no control characters reach a terminal
