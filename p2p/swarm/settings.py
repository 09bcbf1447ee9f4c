"""A training peer's configuration: ``PeerJob``, ``bt-peer``'s job: the job (``Job``: the model,
``ModelConfig``, and its training, ``TrainConfig``, at home in blocks/config.py, the same root as
``bt-train``'s ``JobConfig``) and the swarm's rules (``SwarmConfig``: schedule, averaging, rounds,
timeouts).

Defaults are the dataclasses' own; ``--set section.key=value`` overrides any of them (the loader
in blocks/config.py). Every peer of a swarm must use the same values (less each peer's own:
``LOCAL_TRAIN``, and the swarm fields not in ``SHARED_SWARM``).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from blocktrain.blocks.config import Job

from ..averaging import UPDATE_CODECS, OuterOptimizer
from ..averaging.gossip import MAX_GOSSIP_SIZE, MIN_GOSSIP_SIZE, check_gossip_codec
from .schedule import EVAL_POINTS

SCHEDULES = ("relay", "parallel")
SYNCS = ("grads", "params", "auto")


@dataclass
class SwarmConfig:
    schedule: str = "relay"  # relay | parallel (schedule.py's rules)
    sync: str = "grads"  # grads: average gradients every step; params: DiLoCo every `every` steps;
    #                      auto: each block picks one of them from what its members measure (auto.py)
    every: int = 0  # local steps per round; 0 = the sync's default (grads 1, params 25)
    codec: str = "raw"  # averaging codec: raw, fp16, bf16, int8, topk, sign (lossy ones with error feedback)
    density: float = 0.01  # topk: the fraction of each chunk of 4096 values sent per round
    aggregate: str = "robust"  # robust: every member computes every piece, centred clipping (averaging/robust.py, rule 6);
    #                           mean: reduce-scatter, each piece's owner trusted (fewer bytes with many members)
    outer: str = "sgd"  # params only: sgd | nesterov
    outer_lr: float = 1.0  # with sgd and momentum 0: the plain average of the workers' parameters
    outer_momentum: float = 0.0
    overlap: bool = False  # params only: a round is on the wire during the next round's local steps (rounds.py, Rounds._overlapped)
    min_coverage: float = 1.0
    max_norm: float = 1e4  # bound on an incoming part's L2 norm
    round_timeout_s: float = 120.0
    join_timeout_s: float = 10.0  # waiting for the answers to a JOIN
    ready_timeout_s: float = 300.0  # waiting for the group's state after our admission
    lower_timeout_s: float = 3600.0  # parallel: waiting for the lower blocks' checkpoints
    eval_windows: int = 16  # valid windows for the CE at start and end (CE per GB)
    eval_every: int = -1  # steps between valid-CE points of the chain in work (the curve, time to a CE; 0: none;
    # -1: about EVAL_POINTS over the run, so the live page draws a curve for a run of any length)
    min_group: int = 1  # start only once this many peers (us included) start together or a group exists
    cut_off_ok: bool = False  # a run cut off from its group at the end (report.py cut_off) ends with CutOff
    #                           (bt-peer exits 1) unless this is set; either way its report and log say so
    margin: int = 2  # rounds between a joiner's admission and its first round
    comm_share: float = 0.1  # auto: the share of wall time communication may take (the sponsor's pick, auto.py)
    gossip: int = 0  # params only: from 2 x gossip members on, average in small groups of gossip..2 x gossip - 1
    #                  that change every round (averaging/gossip.py, rule 10); 0: always all-to-all

    def __post_init__(self):
        if self.schedule not in SCHEDULES:
            raise ValueError(f"swarm schedule {self.schedule!r}: expected one of {SCHEDULES}")
        if self.sync not in SYNCS:
            raise ValueError(f"swarm sync {self.sync!r}: expected one of {SYNCS}")
        if self.outer not in ("sgd", "nesterov"):
            raise ValueError(f"outer optimizer {self.outer!r}: expected sgd or nesterov")
        if self.every < 0:
            raise ValueError("every must be >= 1 local step (0: the default)")
        if self.eval_every < -1:
            raise ValueError(f"eval_every {self.eval_every}: steps between CE points (0: none, -1: about "
                             f"{EVAL_POINTS} points over the run)")
        if self.sync == "auto":
            self._check_auto()
        if not 0 < self.comm_share < 1:
            raise ValueError(f"comm_share {self.comm_share}: a share of wall time in (0, 1)")
        if self.sync == "grads" and self.every not in (0, 1):
            raise ValueError("sync=grads averages every step: every must be 1")
        if self.overlap and self.sync != "params":
            raise ValueError("overlap needs sync=params: a gradient is needed before the step it makes")
        if self.codec not in UPDATE_CODECS:
            raise ValueError(f"averaging codec {self.codec!r}: expected one of {UPDATE_CODECS}")
        if not 0 < self.density <= 1:
            raise ValueError(f"density {self.density}: expected a fraction in (0, 1]")
        if self.aggregate not in ("robust", "mean"):
            raise ValueError(f"aggregate {self.aggregate!r}: expected robust or mean")
        if self.margin < 2 or self.min_group < 1:  # margin: group.py rule 2
            raise ValueError("margin must be >= 2 and min_group >= 1")
        if not 0 <= self.min_coverage <= 1:
            raise ValueError("min_coverage must be in [0, 1]")
        if self.gossip:
            self._check_gossip()

    def _check_auto(self) -> None:
        """auto picks the rounds' arithmetic itself (auto.py): nothing of it may be set beside."""
        picked = {"every": (self.every, 0), "codec": (self.codec, "raw"), "outer": (self.outer, "sgd"),
                  "outer_lr": (self.outer_lr, 1.0), "outer_momentum": (self.outer_momentum, 0.0),
                  "overlap": (self.overlap, False), "gossip": (self.gossip, 0)}
        set_ = [k for k, (v, default) in picked.items() if v != default]
        if set_:
            raise ValueError(f"sync=auto picks the rounds' steps, codec and outer step itself: leave "
                             f"{', '.join(set_)} unset (or give sync grads or params)")

    def _check_gossip(self) -> None:
        """Gossip averages the members' parameters (rule 10): it needs parameter rounds, a dense
        codec, and the plain average as the outer step; overlap's agreed point does not exist."""
        if not MIN_GOSSIP_SIZE <= self.gossip <= MAX_GOSSIP_SIZE:
            raise ValueError(f"gossip {self.gossip}: small groups of {MIN_GOSSIP_SIZE}..{MAX_GOSSIP_SIZE} "
                             "(0: all-to-all)")
        if self.sync != "params" or self.overlap:
            raise ValueError("gossip needs sync=params without overlap: members average their parameters, "
                             "and no point is agreed by the whole group")
        check_gossip_codec(self.codec)
        if (self.outer, self.outer_lr, self.outer_momentum) != ("sgd", 1.0, 0.0):
            raise ValueError("gossip's outer step is the plain average of the small group's parameters: "
                             "outer sgd, outer_lr 1, outer_momentum 0")

    @property
    def steps_per_round(self) -> int:
        return self.every or (25 if self.sync == "params" else 1)  # auto: its probe rounds (auto.py)

    def outer_optimizer(self) -> OuterOptimizer:
        return OuterOptimizer(self.outer_lr, self.outer_momentum, self.outer == "nesterov")


@dataclass
class PeerJob(Job):
    """``bt-peer``'s job: the ``Job`` (``model``, ``train``) and the swarm's rules of its run; its
    digest (``job_digest``) is what peers compare at join."""
    swarm: SwarmConfig = field(default_factory=SwarmConfig)


@dataclass(frozen=True)
class TrainerSpec:
    """What one training peer runs (``SwarmTrainer``): the block it holds, the job, where it keeps
    its checkpoints, which data it reads and where the block trains."""
    block: int  # the block this peer holds, serves and reports (relay: it trains every block in turn)
    job: PeerJob
    work_dir: str | Path  # its checkpoints: served, its own, the group's state for joiners (store.py)
    shard: tuple[int, int] | None = None  # (shard, shards) of the data; None: random windows over all of it
    device: str = "cpu"  # where the block trains (blocks/device.py)
    precision: str = "fp32"  # fp32 or bf16 (autocast)
    corpus: str = ""  # blocks/data.corpus_digest of the data (compared at join; "": not compared)


# What the peers of one swarm must share, beside the corpus: the model, how a block trains (not the
# evaluation's sampling or how a step's batch is sliced: micro_batches gives the same gradient), and
# the rounds' arithmetic (not timeouts, bounds or group sizes, each peer's own).
LOCAL_TRAIN = ("eval_every", "eval_windows", "micro_batches")
SHARED_SWARM = ("schedule", "sync", "every", "codec", "density", "aggregate", "outer", "outer_lr",
                "outer_momentum", "overlap", "gossip")


def job_digest(job: PeerJob, corpus: str) -> str:
    """``CONFIG.CORPUS``: 16 hex digits of the settings every peer must share (canonical JSON of
    the model, the train settings less LOCAL_TRAIN, the swarm settings in SHARED_SWARM), then the
    corpus digest (blocks/data.corpus_digest). Group control carries it (membership.py)."""
    train = {k: v for k, v in job.train.to_dict().items() if k not in LOCAL_TRAIN}
    swarm = {k: v for k, v in asdict(job.swarm).items() if k in SHARED_SWARM}
    swarm["every"] = job.swarm.steps_per_round
    blob = json.dumps({"model": job.model.to_dict(), "train": train, "swarm": swarm}, sort_keys=True)
    return f"{hashlib.sha256(blob.encode()).hexdigest()[:16]}.{corpus}"


def job_difference(ours: str, theirs: str) -> str:
    """What differs between two job digests, in words."""
    (oc, _, od), (tc, _, td) = ours.partition("."), theirs.partition(".")
    if theirs == "malformed" or not td:
        return "a malformed job (not CONFIG.CORPUS, PROTOCOL.md 7.2)"
    parts = []
    if od != td:
        parts.append(f"another corpus (digest {td[:16]}, ours {od[:16]}: every peer must train on the same "
                     "data; `bt-data info DIR` prints a prepared corpus's digest)")
    if oc != tc:
        parts.append(f"other settings (config digest {tc[:16]}, ours {oc[:16]}: the model, train and round "
                     "settings must match)")
    return " and ".join(parts)
