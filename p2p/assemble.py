"""Assembling a model from a swarm: the newest verified checkpoint of every block, from its holders.

Rules:
- Every training holder of a block is asked (a holder that fell behind must not win); the
  checkpoint with the highest step is kept. A checkpoint is used only if it verifies (sha256),
  holds the block it is named for, and has the same model config as the other blocks.
- The result is ``OUT/block{k}.safetensors`` for every block (servable with ``bt-peer serve
  --checkpoints OUT``), or ``AssembleError`` naming the blocks that no holder delivered.
"""

from __future__ import annotations

from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from blocktrain.blocks import checkpoint as ckpt

from .checkpoints import CHECKPOINT, CheckpointFetcher, FetchError
from .node import Peer
from .view import query_status, status_when_listening
from .transport import Timeouts
from .view import holders, status_members


class AssembleError(Exception):
    """The swarm could not deliver a complete, consistent model."""


async def wait_until_trained(host: str, port: int, ident: X25519PrivateKey, key: bytes, timeout: float,
                             every_s: float = 5.0, log=lambda s: None) -> dict:
    """Ask HOST:PORT until its training is done (its work section says so), then every live
    training member it knows until each is (the last block's draft phase runs after the others
    are done: a model fetched before it ends has no draft model); HOST:PORT's last status."""
    import asyncio
    import time
    deadline = time.monotonic() + timeout
    last = None
    while True:
        st = await status_when_listening(host, port, ident, key, Timeouts(), max(0.0, deadline - time.monotonic()), log)
        w = st.get("work") or {}
        if w.get("state") == "done" or not w:
            break
        if w.get("step") != last:
            last = w.get("step")
            log(f"training: step {w.get('step')}/{w.get('steps')}, block {w.get('training_block')}, "
                f"group of {len(w.get('group') or [])}")
        if time.monotonic() > deadline:
            raise AssembleError(f"{host}:{port} has not finished training within {timeout:.0f} s")
        await asyncio.sleep(every_s)  # polling a remote peer's status: its cadence is the behaviour
    trainers = [m["addr"] for m in status_members(st) if m["role"] == "train" and m["state"] == "alive" and m["addr"]]
    for addr in trainers:
        said = False
        while True:
            h, _, p = addr.rpartition(":")
            try:
                w = (await query_status(h, int(p), ident, key, Timeouts())).get("work") or {}
            except (OSError, ConnectionError, ValueError):
                break  # gone: assembling fetches from whoever holds the blocks
            if w.get("state") == "done" or not w:
                break
            if not said:
                said = True
                log(f"waiting for {addr} ({w.get('state')}) to finish")
            if time.monotonic() > deadline:
                raise AssembleError(f"{addr} has not finished ({w.get('state')}) within {timeout:.0f} s")
            await asyncio.sleep(every_s)  # polling a remote peer's status: its cadence is the behaviour
    return st


async def assemble_from_swarm(host: str, port: int, ident: X25519PrivateKey, key: bytes, out: Path,
                              timeout: float = 30.0, log=lambda s: None) -> dict:
    """Fetch, verify and write every block; returns {"blocks": {k: {step, from, bytes, sha256, final}},
    "config": model config}."""
    tmo = Timeouts(connect_s=timeout, handshake_s=timeout)
    st = await status_when_listening(host, port, ident, key, tmo)  # assemble --wait waited already
    members = status_members(st)
    blocks = sorted({b for m in members if m["role"] == "train" and m["state"] == "alive" for b in m["blocks"]})
    if not blocks:
        raise AssembleError(f"{host}:{port} knows no live training peers")
    client = Peer(ident, key, "127.0.0.1", 0, role="client", timeouts=tmo)
    fetcher = CheckpointFetcher(client, chunk_timeout_s=timeout)
    got, config = {}, None
    try:
        for k in blocks:
            best, why = None, []
            for addr in holders(members, k):
                try:
                    blob = await fetcher.fetch([addr], CHECKPOINT, ckpt.block_name(k))
                    c = ckpt.decode(blob, f"block {k} from {addr}")
                except (FetchError, ckpt.CheckpointError) as e:
                    why.append(str(e))
                    log(f"block {k}: {addr}: {e}")
                    continue
                if c.block != k:
                    log(f"block {k}: {addr} sent block {c.block}'s checkpoint; ignored")
                    continue
                if best is None or c.step > best[0].step:
                    best = (c, blob, addr)
            if best is None:
                raise AssembleError(f"no holder of block {k} delivered a valid checkpoint: {'; '.join(why)}")
            c, blob, addr = best
            if config is None:
                config = c.config
            elif c.config != config:
                raise AssembleError(f"block {k} from {addr} has another model config than block {blocks[0]}")
            out.mkdir(parents=True, exist_ok=True)
            ckpt.save(c, ckpt.block_path(out, k))
            got[k] = {"step": c.step, "from": addr, "bytes": len(blob), "sha256": c.sha256,
                      "final": bool(c.extra.get("final"))}
            log(f"block {k}: step {c.step} from {addr} ({len(blob) / 2**20:.1f} MiB), verified")
    finally:
        await client.stop("done")
    n = (config or {}).get("n_blocks", 0)
    missing = [k for k in range(n) if k not in got]
    if missing:
        raise AssembleError(f"no live training peer holds block(s) {missing} of {n}")
    return {"blocks": got, "config": config}
