"""Configuration: one dataclass tree per job, defaults stated once, typed overrides.

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
from dataclasses import dataclass, field
from pathlib import Path

from .model import ModelConfig
from .train import TrainConfig


class ConfigError(ValueError):
    """A configuration key or value is unknown or invalid."""


@dataclass
class JobConfig:
    """``bt-train``: a BlockTrain model and the end-to-end reference, under the same budget."""
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    schedule: str = "relay"  # when each block trains, see blocktrain.blocks.schedule
    processes: bool = False  # one OS process per block, exchanging checkpoint files (not for relay)
    reference: bool = True  # also train the end-to-end reference under the same budget
    test_windows: int = 300  # test windows of train.seq_len bytes for the final CE; 0 = the whole split
    threads: int = 2  # torch threads
    data: str | None = None  # directory of standard WikiText files; None = embedded WikiText-2
    out: str | None = None  # output directory; None = runs/train-<time>

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


def load(cfg, config_file: str | Path | None = None, sets=(), **options):
    """``cfg`` with a config file, then ``--set`` items, then explicit options (None: not given)."""
    overrides = read_config_file(config_file) if config_file else {}
    overrides.update(parse_set(sets))
    overrides.update({k: v for k, v in options.items() if v is not None})
    return apply_overrides(cfg, overrides)
