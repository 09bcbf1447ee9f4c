"""A training peer's configuration: the model, its training and the swarm's rules, one tree.

Defaults are the dataclasses' own (blocks/model.py, blocks/train.py, p2p/swarm/settings.py); ``--set
section.key=value`` overrides any of them (blocks/config.py). Every peer of a swarm must use the
same model and training config.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from blocktrain.blocks.model import ModelConfig
from blocktrain.blocks.train import TrainConfig

from .swarm.settings import SwarmConfig


@dataclass
class PeerJob:
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    swarm: SwarmConfig = field(default_factory=SwarmConfig)
