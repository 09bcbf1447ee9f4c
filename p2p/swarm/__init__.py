"""Swarm training: peers train the model's blocks together, averaging over the protocol.

The training peer is a few rooms, each with its rules in its docstring:

- ``schedule.py``: which block, which round, what falls due at each global step (pure; the relay
  schedule in one place), and ``Position``, where the run is.
- ``settings.py``: ``SwarmConfig``, the swarm's rules of a run, and ``PeerJob``, ``bt-peer``'s job:
  the ``Job`` of blocks/config.py (model, training) and the swarm's rules.
- ``rounds.py``: the round step (local steps, averaging, the update; overlap).
- ``membership.py``: the driver of ``Group`` (group.py): control messages, joining, outsiders.
- ``store.py``: checkpoints saved, published for joiners and lower blocks, found after a restart.
- ``checks.py``: what a peer accepts from others (the group's state, lower blocks).
- ``lower.py``: the parallel schedule's input handoff (lower blocks from their holders).
- ``report.py``: statistics, the training report, ``RunState``.
- ``draft.py``: the last block's draft phase (after the schedule, local).
- ``trainer.py``: ``SwarmTrainer``, the run loop that puts them together.
"""

from .lower import CutOff, SwarmError
from .membership import refuse_joins
from .rounds import digest
from .settings import SCHEDULES, SYNCS, PeerJob, SwarmConfig, TrainerSpec
from .trainer import SwarmTrainer

__all__ = ["SCHEDULES", "SYNCS", "CutOff", "PeerJob", "SwarmConfig", "SwarmError", "SwarmTrainer", "TrainerSpec",
           "digest", "refuse_joins"]
