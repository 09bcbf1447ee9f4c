"""What a training peer records and reports: rounds, joins, phases, the CE curve, bytes, time.

Rules:
- Rounds: the last ``REPORT_ROUNDS`` in full; older ones are dropped except anomalies (members
  departed or rejected, candidates left outside the round), which are always kept. A round with a
  part left out for its norm (``far``) is not kept for it: one key holder could make most rounds so.
- Losses: every 10th global step (and the first 10).
- The busy fraction is training compute over wall time without the curve's evaluations; a figure
  that contention inflates (the report says nothing of the machine's load).
- CE per GB: (start CE - end CE) over the bytes this peer moved, both directions, on the wire.
- Cut off (``ended_cut_off``): a run whose last applied rounds were trained alone after it had
  trained in a larger group, or whose final block had most of its rounds in a group smaller than
  ``min_group``, ends with its parameters its own, not the swarm's: the report says so (field
  ``cut_off``), the log says so, and the run ends with ``CutOff`` (bt-peer exits 1) unless
  ``swarm.cut_off_ok`` is set. A member the others excluded is reported as such
  (``excluded_by``), not as cut off.
"""

from __future__ import annotations

import enum
import resource
from dataclasses import asdict, dataclass, field

# Rounds kept in full in the report (the others are summed up); anomalies are always kept.
REPORT_ROUNDS = 200


class RunState(str, enum.Enum):
    """Where a training peer's run loop is (bt-peer status, the report)."""
    STARTING = "starting"
    WAITING_FOR_MEMBERS = "waiting for members"
    WAITING_FOR_LOWER = "waiting for lower blocks"
    JOINING = "joining"
    TRAINING = "training"
    DRAFT_PHASE = "draft phase"
    DONE = "done"


@dataclass
class Stats:
    rounds: list = field(default_factory=list)  # the last REPORT_ROUNDS rounds, and every anomaly
    applied: int = 0
    failed: list = field(default_factory=list)
    coverage_min: float = 1.0
    averaging_s: float = 0.0
    bytes_sent: int = 0
    losses: list = field(default_factory=list)  # (global step, loss), every 10th step
    joins: list = field(default_factory=list)  # joining the group: how, from which round, bytes
    lower: list = field(default_factory=list)  # parallel: lower-block refreshes
    phases: list = field(default_factory=list)  # relay: which block when
    curve: list = field(default_factory=list)  # (global step, seconds since training began, head CEs)
    draft_curve: list = field(default_factory=list)  # (draft step, KL per drafted byte): the last block's draft phase
    largest_group: int = 1  # the most members an applied round had (cut_off)
    alone_tail: int = 0  # applied rounds trained alone since the last one in a group
    alone_since: int | None = None  # the global step the alone tail's first round ended at (None: no tail)
    block_sizes: dict = field(default_factory=dict)  # block -> [applied rounds, of them with fewer than min_group]
    sync_choices: list = field(default_factory=list)  # sync=auto: each block's pick, with the sponsor's figures

    def record_round(self, entry: dict, rep, gstep: int, loss: float, size: int = 1, min_group: int = 1) -> None:
        """An applied round: its entry (``rep``: the averaging's report, None if alone), ``size``: the
        members of its group (us included)."""
        self.largest_group = max(self.largest_group, size)
        if size > 1:
            self.alone_tail, self.alone_since = 0, None
        else:
            self.alone_tail += 1
            if self.alone_since is None:
                self.alone_since = gstep
        tally = self.block_sizes.setdefault(entry["block"], [0, 0])
        tally[0] += 1
        tally[1] += size < min_group
        self.applied += 1
        if rep:
            self.coverage_min = min(self.coverage_min, rep.coverage)
            self.averaging_s += rep.seconds
            self.bytes_sent += rep.bytes_sent
        self.rounds.append(entry)
        if len(self.rounds) > REPORT_ROUNDS:  # keep the anomalies and the last REPORT_ROUNDS
            drop = next((i for i, r in enumerate(self.rounds[:-REPORT_ROUNDS])
                         if not (r["departed"] or r["rejected"] or r["candidates_outside"])), None)
            if drop is not None:
                self.rounds.pop(drop)
        if gstep % 10 == 0 or gstep < 10:
            self.losses.append((gstep, round(loss, 5)))


def ended_cut_off(s: Stats, block: int, min_group: int) -> dict | None:
    """Why a run that ends in ``block`` was cut off (None: it was not; see the rules above)."""
    rounds, below = s.block_sizes.get(block, (0, 0))
    out = {"block": block, "rounds_alone_at_end": s.alone_tail, "alone_since_step": s.alone_since,
           "largest_group": s.largest_group, "block_rounds": rounds, "rounds_below_min_group": below,
           "min_group": min_group}
    if s.alone_tail and s.largest_group > 1:
        return {**out, "why": f"trained its last {s.alone_tail} round(s) alone (the first ending at step "
                              f"{s.alone_since}) after training in a group of {s.largest_group}"}
    if min_group > 1 and 2 * below > rounds:
        return {**out, "why": f"{below} of block {block}'s {rounds} rounds were in a group smaller than "
                              f"min_group {min_group}"}
    return None


def round_entry(rnd: int, block: int, gstep: int, loss: float, rep, me: str, members: list, candidates: set,
                seconds: float) -> dict:
    return {"round": rnd, "block": block, "step": gstep, "loss": round(loss, 5),
            "members": rep.members if rep else [me],
            "coverage": rep.coverage if rep else 1.0, "departed": rep.departed if rep else [],
            "rejected": rep.rejected if rep else [], "seconds": round(seconds, 4),
            "bytes_sent": rep.bytes_sent if rep else 0, "robust": rep.robust if rep else False,
            "suspects": rep.suspects if rep else {}, "far": rep.far if rep else {},
            "candidates_outside": sorted(candidates - set(members)),
            **({"why": rep.why} if rep else {})}


def training_report(t) -> dict:
    """``t``: a SwarmTrainer (trainer.py)."""
    s = t.stats
    traffic = t.peer.traffic_totals()
    moved = traffic["sent"]["wire_bytes"] + traffic["received"]["wire_bytes"]
    wall = t.wall_seconds()
    out = {"block": t.k, "state": t.state.value, "schedule": t.scfg.schedule, "sync": t.scfg.sync,
           "sync_mode": t.rounds.mode_line(), "sync_choices": s.sync_choices, "steps_per_round": t.H,
           "step": t.gstep, "steps": t.total_steps,
           "block_in_work": t.block, "round": t.group.round, "group": t.group.members(),
           "config": {"swarm": asdict(t.scfg), "train": t.tcfg.to_dict(), "model": t.mcfg.to_dict(),
                      "device": str(t.device), "precision": t.precision, "job": t.job},
           "other_jobs": dict(t.membership.other_jobs),
           "rounds": s.rounds, "rounds_applied": s.applied, "failed_rounds": s.failed,
           "coverage_min": s.coverage_min, "averaging_seconds": round(s.averaging_s, 3),
           "update_bytes_sent": s.bytes_sent, "losses": s.losses, "joins": s.joins, "lower_refreshes": s.lower,
           "phases": s.phases, "curve": s.curve, "group_events": t.group.events,
           "draft_phase": {"curve": s.draft_curve, "seconds": t.draft_seconds},
           "rejected_updates": [e for e in t.averager.events if e["event"] == "rejected update"],
           "averaging_events": t.averager.events, "excluded_peers": dict(t.averager.banned),
           "excluded_by": dict(t.averager.shunned), "refused_lower_holders": dict(t.feed.bad if t.feed else {}),
           "busy": {"train_s": round(t.rounds.busy_s, 3), "wall_s": round(wall, 3),
                    "fraction": round(t.rounds.busy_s / wall, 4) if wall else None},
           "memory": {"peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
                      **t.memory},
           "ce_start": t.ce.get("start"), "ce_start_step": t.ce.get("start_step"), "ce_end": t.ce.get("end"),
           "head_ce": t.ce.get("heads"), "bytes_moved": moved, "cut_off": t.cut_off}
    if "start" in t.ce and "end" in t.ce and moved:
        out["ce_improvement_per_gb"] = (t.ce["start"] - t.ce["end"]) / (moved / 1e9)
    return out


def work_status(t) -> dict:
    """What this peer works on now (bt-peer status, the report)."""
    return {"holds": t.k, "training_block": t.block if t.state is RunState.TRAINING else None,
            "state": t.state.value, "schedule": t.scfg.schedule, "sync": t.rounds.mode_line(), "step": t.gstep,
            "steps": t.total_steps, "round": t.group.round, "group": t.group.members(),
            "rounds_applied": t.stats.applied, "coverage_min": t.stats.coverage_min,
            "curve": t.stats.curve[-20:]}


def progress_line(t, spent: float) -> str:
    s = t.stats
    done = t.gstep - s.phases[0]["start_step"] if s.phases else t.gstep
    rate = done / spent if spent > 0 else 0.0
    left = f", {(t.total_steps - t.gstep) / rate:.0f} s left" if rate > 0 else ""
    return (f"step {t.gstep}/{t.total_steps} (block {t.block}), {rate:.2f} step/s{left}, "
            f"loss {t.rounds.last_loss:.4f}, group of {len(t.group.members())}")
