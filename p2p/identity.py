"""Persistent peer identity and the swarm key, as files.

Rules:
- An identity file holds one X25519 private key as 64 hex chars; it is created on first use
  with mode 0600 and refused if others can read it.
- A swarm key is 32 random bytes as 64 hex chars, from a file or the BT_SWARM_KEY variable.
"""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from blocktrain.protocol.handshake import public_bytes, peer_id_of, private_bytes

SWARM_KEY_ENV = "BT_SWARM_KEY"


class KeyError_(Exception):
    """An identity or swarm key is missing, malformed or unsafe."""


def _write_secret(path: Path, text: str):
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text + "\n")


def _read_hex32(path: Path, what: str) -> bytes:
    try:
        mode = path.stat().st_mode
        text = path.read_text().strip()
    except OSError as e:
        raise KeyError_(f"{what} {path}: {e}") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise KeyError_(f"{what} {path} is readable by others (mode {oct(mode & 0o777)}); chmod 600 it")
    try:
        raw = bytes.fromhex(text)
    except ValueError:
        raw = b""
    if len(raw) != 32:
        raise KeyError_(f"{what} {path}: expected 64 hex characters")
    return raw


def load_or_create_identity(path: str | Path) -> X25519PrivateKey:
    path = Path(path)
    if not path.exists():
        _write_secret(path, private_bytes(X25519PrivateKey.generate()).hex())
    return X25519PrivateKey.from_private_bytes(_read_hex32(path, "identity"))


def write_identity(path: str | Path, raw: bytes) -> X25519PrivateKey:
    """A new identity file holding the private key ``raw`` (32 bytes), for runs that must repeat
    (a benchmark's seeded workers); a peer's own identity is random (``load_or_create_identity``)."""
    path = Path(path)
    if len(raw) != 32:
        raise KeyError_("an identity is 32 bytes")
    if path.exists():
        raise KeyError_(f"{path} exists; refusing to overwrite an identity")
    _write_secret(path, raw.hex())
    return X25519PrivateKey.from_private_bytes(raw)


def peer_id(key: X25519PrivateKey) -> str:
    return peer_id_of(public_bytes(key))


def new_swarm_key(path: str | Path) -> bytes:
    path = Path(path)
    if path.exists():
        raise KeyError_(f"{path} exists; refusing to overwrite a swarm key")
    key = secrets.token_bytes(32)
    _write_secret(path, key.hex())
    return key


def load_swarm_key(path: str | Path | None) -> bytes:
    if path:
        return _read_hex32(Path(path), "swarm key")
    env = os.environ.get(SWARM_KEY_ENV)
    if not env:
        raise KeyError_(f"no swarm key: pass --swarm-key FILE or set {SWARM_KEY_ENV} (make one with bt-peer keygen)")
    try:
        raw = bytes.fromhex(env.strip())
    except ValueError:
        raw = b""
    if len(raw) != 32:
        raise KeyError_(f"{SWARM_KEY_ENV} must be 64 hex characters")
    return raw
