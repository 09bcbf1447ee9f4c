"""Configuration, in one home: the model (``ModelConfig``), a block's training (``TrainConfig``),
the job (``Job``: the two together, the root of both commands' settings), ``bt-train``'s job
(``JobConfig``, a ``Job`` and how one machine runs it), and the loader of overrides. The swarm's
rules (``SwarmConfig``) and ``bt-peer``'s job (``PeerJob``, a ``Job`` and the swarm's rules) are
p2p/swarm/settings.py (they name the network's codecs).

Rules:
- Defaults live in the dataclasses themselves (ModelConfig, TrainConfig, and the job's own
  fields); nothing restates them (CLI options take None to mean "the config's").
- Overrides are ``{"section.field": value}`` (a string is converted to the field's type) from a
  JSON file (``--config``) and ``--set KEY=VALUE``; a bare field name is allowed when exactly one
  section has it. Unknown keys, values of the wrong type and invalid combinations raise
  ``ConfigError`` with the key named: never a silent default, never an assert.
"""

from __future__ import annotations

import dataclasses
import json
import typing
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path



class NoSuchBlock(ValueError):
    """A block number the model does not have (every command's --block: one check, one message)."""

    def __init__(self, block: int, n_blocks: int):
        super().__init__(f"the model has blocks 0..{n_blocks - 1}, no block {block}")
        self.block, self.n_blocks = block, n_blocks


@dataclass(frozen=True)
class ModelConfig:
    d_model: int = 128  # residual width (the default model trains in minutes on 2 cores)
    n_head: int = 4  # attention heads; d_model % n_head == 0
    n_layer: int = 6  # layers of the whole model (end-to-end reference = assembled model)
    n_blocks: int = 3  # K: blocks the layers are cut into, n_layer % n_blocks == 0
    max_seq_len: int = 512  # positions the embedding knows (prompt + placeholders)
    mlp_ratio: int = 4  # MLP hidden = mlp_ratio * d_model
    head_layers: int = 1  # extra Transformer layers in the local heads of blocks 0..K-2
    identity_init: bool = True  # blocks 1..K-1 start as the identity (zeroed output projections)
    draft_layers: int = 1  # layers of the last block's draft model (exact-mode drafts, ``Drafter``); 0: none
    slot_offsets: int = 16  # learned embeddings of a placeholder's offset after the last byte (clamped); 0: none

    def __post_init__(self):
        if min(self.d_model, self.n_head, self.n_layer, self.n_blocks, self.max_seq_len, self.mlp_ratio) < 1:
            raise ValueError("d_model, n_head, n_layer, n_blocks, max_seq_len and mlp_ratio must be >= 1")
        if self.d_model % self.n_head:
            raise ValueError(f"d_model {self.d_model} is not a multiple of n_head {self.n_head}")
        if self.n_layer % self.n_blocks:
            raise ValueError(f"n_layer {self.n_layer} does not split into {self.n_blocks} blocks")
        if self.head_layers < 0:
            raise ValueError("head_layers must be >= 0")
        if self.identity_init and self.n_blocks > 1 and self.head_layers > self.n_layer // self.n_blocks:
            raise ValueError(f"head_layers {self.head_layers} is more than a block's {self.n_layer // self.n_blocks} "
                             "layers: the top block could not start from the head below (identity_init)")
        if self.draft_layers < 0 or self.slot_offsets < 0:
            raise ValueError("draft_layers and slot_offsets must be >= 0")

    def check_block(self, k: int) -> None:
        """Raises NoSuchBlock unless the model has a block ``k`` (numbered from 0)."""
        if not 0 <= k < self.n_blocks:
            raise NoSuchBlock(k, self.n_blocks)

    @property
    def layers_per_block(self) -> int:
        return self.n_layer // self.n_blocks

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        """Missing keys take their defaults, except in a complete config saved before a field
        existed, which takes the value that reproduces the model it describes (``LEGACY``)."""
        older = {f.name for f in fields(cls)} - set(LEGACY)
        if older <= set(d):
            d = {**{k: v for k, v in LEGACY.items() if k not in d}, **d}
        return config_from_dict(cls, d)


# Fields added after the first checkpoints, with the value a config saved before them means.
LEGACY = {"draft_layers": 0, "slot_offsets": 0}


def config_from_dict(cls, d: dict):
    """Build config dataclass ``cls`` from a dict; unknown keys are errors, never ignored."""
    unknown = set(d) - {f.name for f in fields(cls)}
    if unknown:
        raise ValueError(f"unknown {cls.__name__} keys: {sorted(unknown)}")
    return cls(**d)


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 300  # optimizer steps per block, and for the end-to-end reference
    batch_size: int = 16  # sequences per step
    seq_len: int = 128  # bytes per sequence
    lr: float = 2e-3  # peak AdamW learning rate
    weight_decay: float = 0.1
    warmup: int = 30  # linear warmup steps
    decay_frac: float = 0.3  # WSD: fraction of a block's steps spent in the final decay
    lr_floor: float = 0.05  # LR after the decay, as a fraction of peak
    slot_branches: int = 4  # per row: branches of placeholders after random bytes (tree attention); 0: masked tails
    slot_len: int = 15  # placeholders per branch: one traversal predicts slot_len + 1 bytes
    slot_weight: float = 0.2  # weight of the placeholders' mean CE beside the next-byte mean CE
    mask_frac: float = 0.25  # slot_branches == 0 only: fraction of rows whose tail is placeholders
    position_shift: bool = False  # each row at a random absolute offset, so positions past seq_len train too
    refresh_every: int = 25  # wall steps between refreshes of the lower-block checkpoints
    seed: int = 0
    eval_every: int = 50  # steps between curve points (valid CE on eval_windows windows)
    eval_windows: int = 32
    grad_clip: float = 1.0
    draft_frac: float = 0.6  # draft phase of the last block's draft model, in ``steps`` (0: none), on top of them
    draft_unroll: int = 3  # drafting steps unrolled in training (the draft model reads its own predictions)
    micro_batches: int = 1  # gradient accumulation: a step's batch is computed in this many slices, one after
    #                         another (same gradient, 1/micro_batches of the activation memory); not compared between peers

    @property
    def draft_steps(self) -> int:
        return round(self.draft_frac * self.steps)

    def __post_init__(self):
        if min(self.steps, self.batch_size, self.seq_len, self.eval_every, self.eval_windows, self.refresh_every) < 1:
            raise ValueError("steps, batch_size, seq_len, eval_every, eval_windows and refresh_every must be >= 1")
        if self.lr <= 0 or self.warmup < 0 or not 0 <= self.decay_frac <= 1 or not 0 <= self.mask_frac <= 1:
            raise ValueError("lr must be > 0, warmup >= 0, decay_frac and mask_frac in [0, 1]")
        if not 1 <= self.micro_batches <= self.batch_size:
            raise ValueError(f"micro_batches {self.micro_batches}: expected 1..batch_size ({self.batch_size})")

    @classmethod
    def from_dict(cls, d: dict) -> "TrainConfig":
        return config_from_dict(cls, d)

    def to_dict(self) -> dict:
        return asdict(self)


class ConfigError(ValueError):
    """A configuration key or value is unknown or invalid."""


# Named model sizes (``--size``): overrides applied before --config and --set, which may change any
# of them. tiny is the default model; parameter counts, memory and FLOPs: ``bt-train --dry-run``.
SIZES = {
    "tiny": {"model.d_model": 128, "model.n_head": 4, "model.n_layer": 6},
    "small": {"model.d_model": 512, "model.n_head": 8, "model.n_layer": 12},
    "base": {"model.d_model": 1024, "model.n_head": 16, "model.n_layer": 24},
}


@dataclass
class Job:
    """The job: what the model is and how each block trains. The root of both commands' settings:
    ``bt-train`` runs a ``JobConfig``, ``bt-peer`` a ``PeerJob`` (p2p/swarm/settings.py), each this
    job and the settings of the way it runs, so a model trained either way carries the same
    ``model`` and ``train`` in its checkpoints."""
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)


@dataclass
class JobConfig(Job):
    """``bt-train``'s job: a ``Job``, trained as a BlockTrain model and as the end-to-end reference
    under the same budget, on one machine."""
    schedule: str = "relay"  # when each block trains, see blocktrain.blocks.schedule
    processes: bool = False  # one OS process per block, exchanging checkpoint files (not for relay)
    reference: bool = True  # also train the end-to-end reference under the same budget
    test_windows: int = 300  # test windows of train.seq_len bytes for the final CE; 0 = the whole split
    threads: int = 2  # torch threads
    data: str | None = None  # a text file or folder (prepared once), a prepared corpus or a WikiText directory; None = embedded WikiText-2
    device: str = "auto"  # auto | cpu | cuda[:N] | mps (blocks/device.py)
    precision: str = "auto"  # auto | fp32 | bf16 (auto: bf16 on a CUDA device that supports it)
    out: str | None = None  # output directory; None = runs/train-<time>
    init: str | None = None  # every block starts from the checkpoints in this directory ("shipped": the shipped model)

    def __post_init__(self):
        from .schedule import SCHEDULES
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"schedule {self.schedule!r}: expected one of {', '.join(SCHEDULES)}")
        if self.test_windows < 0 or self.threads < 1:
            raise ConfigError("test_windows must be >= 0 and threads >= 1")


def parse_set(items) -> dict:
    """``["a.b=1", ...]`` -> ``{"a.b": "1"}``; raises ConfigError on a malformed item."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set wants KEY=VALUE, got {item!r}")
        out[key.strip()] = value.strip()
    return out


def read_config_file(path: str | Path) -> dict:
    try:
        raw = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"--config {path}: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"--config {path}: expected a JSON object of KEY: VALUE")
    return _flatten(raw)


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _sections(cfg) -> dict[str, type]:
    return {f.name: f for f in dataclasses.fields(cfg) if dataclasses.is_dataclass(getattr(cfg, f.name))}


def _coerce(key: str, value, typ):
    """``value`` (a string from the command line, or a JSON value) as field type ``typ``."""
    origin = typing.get_origin(typ)
    args = typing.get_args(typ)
    optional = type(None) in args
    if optional:
        typ = next(a for a in args if a is not type(None))
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null", "")):
            return None
    elif origin is not None:
        typ = origin
    try:
        if typ is bool:
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.lower() in ("1", "true", "yes", "on"):
                return True
            if isinstance(value, str) and value.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError("not a boolean")
        if typ is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError("not an integer")
            return int(value)
        if typ is float:
            if isinstance(value, bool):
                raise ValueError("not a number")
            return float(value)
        if typ is str:
            return str(value)
        return typ(value)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{key}={value!r}: {e} (expected {getattr(typ, '__name__', typ)})") from None


def apply_overrides(cfg, overrides: dict):
    """A new config with ``overrides`` applied (see the module's rules)."""
    hints = typing.get_type_hints(type(cfg))
    sections = {name: hints[name] for name in _sections(cfg)}
    fields_of = {name: typing.get_type_hints(cls) for name, cls in sections.items()}
    values = {name: dataclasses.asdict(getattr(cfg, name)) for name in sections}
    top = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name not in sections}
    for key, value in overrides.items():
        section, _, name = key.rpartition(".")
        if not section and name not in top:
            owners = [s for s, f in fields_of.items() if name in f]
            if len(owners) > 1:
                raise ConfigError(f"config key {key!r} is ambiguous: say {' or '.join(o + '.' + name for o in owners)}")
            if not owners:
                raise ConfigError(f"unknown config key {key!r}")
            section = owners[0]
        if not section:
            top[name] = _coerce(key, value, hints[name])
            continue
        if section not in sections:
            raise ConfigError(f"unknown config section {section!r} in {key!r} (sections: {', '.join(sections)})")
        if name not in fields_of[section]:
            raise ConfigError(f"unknown config key {key!r} (known in {section}: {', '.join(sorted(fields_of[section]))})")
        values[section][name] = _coerce(key, value, fields_of[section][name])
    built = {}
    for s, cls in sections.items():
        try:
            built[s] = cls(**values[s])
        except (ValueError, TypeError, AssertionError) as e:
            raise ConfigError(f"{s}: {e}") from None
    try:
        return type(cfg)(**built, **top)
    except (ValueError, TypeError, AssertionError) as e:
        raise ConfigError(str(e)) from None


def load(cfg, config_file: str | Path | None = None, sets=(), size: str | None = None, **options):
    """``cfg`` with a named size (SIZES), then a config file, then ``--set`` items, then explicit
    options (None: not given)."""
    if size is not None and size not in SIZES:
        raise ConfigError(f"size {size!r}: expected one of {', '.join(SIZES)}")
    overrides = dict(SIZES[size]) if size else {}
    overrides.update(read_config_file(config_file) if config_file else {})
    overrides.update(parse_set(sets))
    overrides.update({k: v for k, v in options.items() if v is not None})
    return apply_overrides(cfg, overrides)
