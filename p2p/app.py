"""A peer process as a library: build the peer and its services from options, run it until it is
told to stop (or, optionally, until its training is done), report.

Rules:
- Everything ``bt-peer start/join/serve`` does lives here; the CLI only parses and prints.
- Failures are domain errors: ``JoinError`` (bootstrap unreachable), ``AddressInUse``,
  ``SwarmError`` (training cannot go on), ``TrainingFailed`` (wrapping what the trainer raised).
- Every peer answers every request type: a peer that does not train refuses checkpoint streams
  and a peer that does not serve refuses pipeline requests, at once, so nobody waits on it.
- Stopping: the trainer is cancelled (its last checkpoint is on disk), every connection gets a
  Goodbye, the report is written.
"""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import logging
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from .checkpoints import refuse_streams
from .link import LinkSpec
from .identity import peer_id
from .node import JoinError, Peer
from .serving.server import PipelineServer, ServedBlocks, refuse_requests
from .swarm import PeerJob, SwarmError, SwarmTrainer, TrainerSpec, refuse_joins
from .transport import Timeouts

if TYPE_CHECKING:
    import torch

log = logging.getLogger("blocktrain.p2p")

__all__ = ["AddressInUse", "JoinError", "PeerOptions", "SwarmError", "TrainerSetup", "TrainingFailed", "build_peer",
           "run_peer", "run_until_signalled", "with_work_dir"]


class AddressInUse(OSError):
    """The listen address is taken."""


class TrainingFailed(Exception):
    """The trainer stopped with an error (its last checkpoint is kept)."""


@dataclass
class PeerOptions:
    identity: X25519PrivateKey
    swarm_key: bytes
    host: str = "127.0.0.1"
    port: int = 0
    advertise: str | None = None
    blocks: tuple = ()
    role: str = "train"  # train | serve | bootstrap
    allowlist: set | None = None
    timeouts: Timeouts = field(default_factory=Timeouts)
    links: dict | None = None
    seal: bool = True
    report_path: str | None = None
    report_every_s: float = 10.0
    http: tuple[str, int] | None = None  # the live swarm page (page.py), None: off


@dataclass
class TrainerSetup:
    """What a training peer's ``SwarmTrainer`` is set up from: its ``TrainerSpec`` (the job, the
    block, where it keeps its checkpoints and where it trains) and the data, which the spec does
    not hold. Built by ``bt-peer start/join`` from its options (p2p/cli.py)."""
    job: PeerJob
    block: int
    work_dir: Path | None  # None: bt-peer's default (with_work_dir names one after the identity before running)
    train_data: torch.Tensor  # uint8 tensor
    valid_data: torch.Tensor
    shard: tuple[int, int] | None = None
    device: str = "cpu"  # where the block trains (blocks/device.py: a device checked to be present)
    precision: str = "fp32"  # fp32 or bf16 (autocast)
    corpus: str = ""  # blocks/data.corpus_digest of the data (compared at join; "": not compared)


def with_work_dir(training: TrainerSetup, identity: X25519PrivateKey) -> TrainerSetup:
    """``training`` with a work directory: the default, ~/.blocktrain/work/PEER_ID, if it has none."""
    if training.work_dir is not None:
        return training
    return dataclasses.replace(training, work_dir=Path.home() / ".blocktrain" / "work" / peer_id(identity)[:16])


def build_peer(o: PeerOptions) -> Peer:
    return Peer(o.identity, o.swarm_key, o.host, o.port, o.blocks, o.role, allowlist=o.allowlist,
                timeouts=o.timeouts, links=o.links or {"default": LinkSpec(), "links": {}}, seal=o.seal,
                report_path=o.report_path, report_every_s=o.report_every_s, advertise=o.advertise)


async def start_peer(peer: Peer, bootstrap: tuple[str, int] | None, join_timeout_s: float = 30.0,
                     on_line=lambda s: None):
    """Listen, then join through ``bootstrap``: if the first try fails (it may still be starting),
    say so and keep trying; the whole join attempt ends within ``join_timeout_s``."""
    try:
        await peer.start()
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            raise AddressInUse(e.errno, f"{peer.host}:{peer.port} is already in use: pick another --listen port "
                                        f"(or :0 for any free one)") from None
        raise
    if bootstrap:
        def retrying(why: str):
            on_line(f"bootstrap {bootstrap[0]}:{bootstrap[1]} not reachable yet; trying again for up to "
                    f"{join_timeout_s:.0f} s in all (--join-timeout)")
        try:  # every try, and a dial still in progress, within join_timeout_s
            await peer.join(*bootstrap, timeout_s=join_timeout_s, on_retry=retrying)
        except JoinError:
            await peer.stop("could not join")
            raise


async def _start_page(peer: Peer, http: tuple[str, int], on_line):
    from .page import SwarmPage
    try:
        page = await SwarmPage(peer, *http).start()
    except OSError as e:
        await peer.stop("the swarm page could not start")
        if e.errno == errno.EADDRINUSE:
            raise AddressInUse(e.errno, f"{http[0]}:{http[1]} is already in use: pick another --http port "
                                        f"(or :0 for any free one)") from None
        raise AddressInUse(e.errno, f"cannot serve the swarm page on {http[0]}:{http[1]}: {e.strerror}") from None
    on_line(f"swarm page: http://{page.host}:{page.port}/ (and /status.json)")
    return page


async def run_peer(peer: Peer, bootstrap: tuple[str, int] | None, *, stop: asyncio.Event,
                   training: TrainerSetup | None = None, served: ServedBlocks | None = None,
                   exit_when_done: bool = False, on_line=lambda s: None, status_every_s: float = 5.0,
                   join_timeout_s: float = 30.0, http: tuple[str, int] | None = None, on_step=None,
                   on_ready=lambda peer: None) -> dict | None:
    """Run a peer until ``stop`` is set (or its training is done, with ``exit_when_done``). Returns the
    training report, if it trained. ``on_ready(peer)`` once it listens and, given a bootstrap, is in
    the swarm through it (a training peer prepares before it listens): nothing tells others how to
    join a peer that never got in."""
    trainer = None
    if training is not None:
        trainer = await _prepared_trainer(peer, training, on_line, on_step)
        if stop.is_set():  # told to stop meanwhile: nothing has started yet
            return None
    await start_peer(peer, bootstrap, join_timeout_s, on_line)
    page = await _start_page(peer, http, on_line) if http is not None else None
    _answer_requests(peer, served, trainer is not None)
    if not stop.is_set():
        on_ready(peer)
    task = asyncio.ensure_future(trainer.run()) if trainer is not None else None
    try:
        result, failed = await _supervise(peer, stop, task, exit_when_done, on_line, status_every_s)
    finally:
        await _stop_trainer(task)
        if page is not None:
            await page.stop()
        await peer.stop("peer shutting down")
    if failed is not None:
        if isinstance(failed, SwarmError):
            raise failed
        raise TrainingFailed(f"{type(failed).__name__}: {failed}") from failed
    return result


async def _prepared_trainer(peer: Peer, training: TrainerSetup, on_line, on_step) -> SwarmTrainer:
    assert training.work_dir is not None  # a default is chosen before any peer runs (with_work_dir)
    spec = TrainerSpec(training.block, training.job, training.work_dir, training.shard, training.device,
                       training.precision, training.corpus)
    trainer = SwarmTrainer(peer, spec, training.train_data, training.valid_data, progress=on_line, on_step=on_step)
    try:  # before listening: seconds of CPU that would keep the event loop from answering anyone
        await asyncio.to_thread(trainer.prepare)
    except Exception as e:  # e.g. a damaged own checkpoint: the operator must see it
        raise TrainingFailed(f"{type(e).__name__}: {e}") from e
    return trainer


def _answer_requests(peer: Peer, served: ServedBlocks | None, trains: bool):
    """Every request type is answered: served, or refused at once."""
    if served is not None:
        PipelineServer(peer, served)
    else:
        refuse_requests(peer)
    if not trains:
        refuse_streams(peer)
        refuse_joins(peer)


async def _supervise(peer: Peer, stop: asyncio.Event, task: asyncio.Future | None, exit_when_done: bool, on_line,
                     status_every_s: float) -> tuple[dict | None, BaseException | None]:
    """Wait for ``stop`` (or the training's end, with ``exit_when_done``), saying how the peer does
    every ``status_every_s`` (0: never). Returns (the training report, what the trainer raised)."""
    stopping = asyncio.ensure_future(stop.wait())
    result, failed = None, None
    last = time.monotonic()
    try:
        while not stop.is_set():
            waits = {stopping} | ({task} if task is not None and not task.done() else set())
            await asyncio.wait(waits, timeout=status_every_s or None, return_when=asyncio.FIRST_COMPLETED)
            if task is not None and task.done() and result is None and failed is None:
                if task.exception() is not None:
                    failed = task.exception()
                    break
                result = task.result()
                on_line(_done_line(result, exit_when_done))
                if exit_when_done:
                    break
            if status_every_s and time.monotonic() - last >= status_every_s:
                last = time.monotonic()
                t = peer.traffic_totals()
                on_line(f"{len(peer.members())} peers alive, sent {_mib(t['sent']['wire_bytes'])}, "
                        f"received {_mib(t['received']['wire_bytes'])}")
    finally:
        stopping.cancel()
    return result, failed


def _done_line(result: dict, exit_when_done: bool) -> str:
    return (f"training done: block {result['block']} at step {result['step']}, "
            f"valid CE {_f(result['ce_start'])} (at step {result.get('ce_start_step')}) -> "
            f"{_f(result['ce_end'])}, "
            f"{result['rounds_applied']} rounds applied, {len(result['failed_rounds'])} failed"
            + ("" if exit_when_done else "; serving the checkpoint until stopped"))


async def _stop_trainer(task: asyncio.Future | None):
    if task is not None and not task.done():
        t0 = time.monotonic()
        # Python 3.11's wait_for can swallow a cancellation that lands as the awaited thing
        # completes (gh-86296; the package waits with asyncio.timeout, waiters.py, but not every
        # library it awaits does): cancel again until the trainer has really stopped.
        while not task.done():
            task.cancel()
            await asyncio.wait({task}, timeout=0.5)
        log.info("trainer stopped in %.2f s", time.monotonic() - t0)


async def run_until_signalled(peer: Peer, bootstrap: tuple[str, int] | None, **kw) -> dict | None:
    """``run_peer`` until SIGINT or SIGTERM (or its training is done, with ``exit_when_done``)."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    return await run_peer(peer, bootstrap, stop=stop, **kw)


def _f(x) -> str:
    return f"{x:.4f}" if isinstance(x, float) else "n/a"


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"
