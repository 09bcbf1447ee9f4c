"""``bt-peer``: start or join a BlockTrain swarm, serve, generate, assemble, read reports.

This module parses the command line and prints; everything it runs lives in p2p/app.py,
client.py, assemble.py and reports.py, which raise domain errors that become one-line messages.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
import time
from pathlib import Path

import click

from blocktrain.blocks.config import SIZES, NoSuchBlock

from .identity import KeyError_, load_or_create_identity, load_swarm_key, new_swarm_key, peer_id
from .link import LinkSpec, load_topology
from .serving.api import COMPUTE_SLOTS, VERIFY_TOL
from .transport import Timeouts, install_uvloop

DEFAULT_IDENTITY = Path.home() / ".blocktrain" / "identity"


# The clients' one rule (status, generate, assemble): view.status_when_listening.
WAIT_HELP = ("Seconds to ask again, with one line saying so, while nothing listens at ADDRESS (a peer still "
             "starting: a training peer listens once its model is built)")


def _addr(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise click.BadParameter(f"expected HOST:PORT, got {text!r}")
    return host, int(port)


def _http_addr(text: str) -> tuple[str, int]:
    """--http: PORT (on loopback) or HOST:PORT."""
    return ("127.0.0.1", _addr(f"127.0.0.1:{text}")[1]) if text.isdigit() else _addr(text)


def _echo(s: str):
    click.echo(f"[{time.strftime('%H:%M:%S')}] {s}", err=True)


def _setup_logging(verbose: int):
    level = logging.WARNING if verbose == 0 else logging.INFO if verbose == 1 else logging.DEBUG
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(message)s", stream=sys.stderr)


def _keys(swarm_key: str | None, identity: str):
    """The swarm key and this peer's identity (said so when the identity is created)."""
    try:
        key = load_swarm_key(swarm_key)
        created = not Path(identity).exists()
        ident = load_or_create_identity(identity)
    except KeyError_ as e:
        raise click.ClickException(str(e))
    if created:
        click.echo(f"created identity {identity} (peer id {peer_id(ident)[:16]})", err=True)
    return key, ident


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main():
    """BlockTrain peers: each trains or serves blocks of one model; peers find each other by gossip.

    Every peer has an identity (an X25519 key file, --identity, created on first use, mode 0600)
    and the swarm's key (--swarm-key FILE or BT_SWARM_KEY; make one with `bt-peer keygen`).
    Connections are mutually authenticated (Noise XXpsk3) and every frame is sealed with
    AES-256-GCM. A swarm in a minute: `bt-peer keygen --out swarm.key`, then `bt-peer start
    --block 0 --swarm-key swarm.key --identity id0 --listen 127.0.0.1:7000`, and on other
    machines `bt-peer join 127.0.0.1:7000 --block 1 --swarm-key swarm.key --identity id1`.
    """


def _key_options(f):
    f = click.option("--identity", type=click.Path(dir_okay=False), default=str(DEFAULT_IDENTITY),
                     show_default=True, help="This peer's key file; created if missing. Give each peer its own.")(f)
    return click.option("--swarm-key", type=click.Path(dir_okay=False), default=None,
                        help="File with the swarm key (default: the BT_SWARM_KEY variable).")(f)


def _peer_options(f):
    opts = [
        click.option("--block", "blocks", type=click.IntRange(0, 65535), multiple=True,
                     help="Block this peer holds: trains (start/join) or serves (serve). Repeatable for serve."),
        click.option("--listen", default="0.0.0.0:0", show_default=True,
                     help="HOST:PORT to listen on (port 0: any). The default, every interface, lets peers on other "
                          "machines reach this one (only swarm key holders get past the handshake); the peer "
                          "advertises the address a member dialled it back at, once one has (docs/usage.md, "
                          "Reachability). 127.0.0.1:PORT keeps it to this machine."),
        click.option("--advertise", default=None,
                     help="HOST:PORT others should dial (default: the listen address; on 0.0.0.0, the address a "
                          "member dialled this peer back at)."),
        click.option("--allow", multiple=True, help="Accept only these peer ids (repeatable; default: any key holder)."),
        click.option("--report", "report_path", type=click.Path(dir_okay=False), default=None,
                     help="Write the transfer-volume report (JSON) here, every --report-every seconds and at exit."),
        click.option("--report-every", type=click.FloatRange(0.5), default=10.0, show_default=True,
                     help="Seconds between writes of the --report file while the peer runs (one more at exit)."),
        click.option("--links", type=click.Path(dir_okay=False, exists=True), default=None,
                     help="Topology JSON: per-peer link delay/jitter/rate/loss (see README)."),
        click.option("--link", "link_default", default=None,
                     help="Shape every outgoing link, e.g. delay=25,jitter=2,rate=100,loss=0 (ms, ms, Mbit/s, p)."),
        click.option("--dead-after", type=click.FloatRange(0.5), default=None,
                     help=f"Seconds of silence after which a peer is declared dead (default {Timeouts.dead_after_s})."),
        click.option("--heartbeat", type=click.FloatRange(0.05), default=None,
                     help=f"Seconds between pings (default {Timeouts.heartbeat_s})."),
        click.option("--join-timeout", type=click.FloatRange(0), default=30.0, show_default=True,
                     help="Seconds the join through BOOTSTRAP may take, every try included (it may still be "
                          "starting); counted once this peer is ready (a training peer loads its model and data "
                          "first, and says so). 0: one try."),
        click.option("--insecure-no-seal", is_flag=True,
                     help="Trusted networks only: skip frame sealing after the authenticated handshake."),
        click.option("--http", default=None, metavar="[HOST:]PORT",
                     help="Serve a live page of the swarm as this peer sees it (and /status.json), read-only. "
                          "A bare PORT binds loopback (127.0.0.1); give a HOST only if you mean to show it."),
        click.option("--quiet", is_flag=True, help="No periodic status line."),
        click.option("-v", "--verbose", count=True, help="-v: log joins and leaves; -vv: debug."),
    ]
    return _key_options(_apply(f, opts))


def _apply(f, opts: list):
    """``f`` with ``opts``, which --help lists in this order."""
    for o in reversed(opts):
        f = o(f)
    return f


def _train_options(f):
    """What a training peer trains (start, join): its job, its rounds (_round_options), its data."""
    f = _apply(f, [
        click.option("--shard", default=None, metavar="I/N",
                     help="Train on shard I of N of the data (default: this peer's own random windows)."),
        click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
                     help="Any setting: model.d_model=128, train.steps=300, swarm.round_timeout_s=60, ... "
                          "Every peer of a swarm must use the same model and train settings."),
        click.option("--size", type=click.Choice(list(SIZES)), default=None,
                     help="A named model size, as bt-train's (--set overrides it; `bt-train --size S --dry-run` "
                          "prints what it costs)."),
        click.option("--data", type=click.Path(exists=True), default=None,
                     help="A text file or a folder of .txt files (prepared once into a cache, as `bt-data prepare` "
                          "does), a corpus `bt-data prepare` wrote (memory-mapped), or a directory of the standard "
                          "WikiText files (default: the embedded WikiText-2). Every peer of a swarm must train on "
                          "the same corpus: a peer refuses to group with one whose corpus digest differs."),
        click.option("--threads", type=click.IntRange(1), default=1, show_default=True, help="torch threads."),
        click.option("--device", default="auto", show_default=True, metavar="auto|cpu|cuda[:N]|mps",
                     help="Where the block trains (auto: cuda, else mps, else cpu). Checkpoints and the wire "
                          "stay device-independent."),
        click.option("--precision", type=click.Choice(["auto", "fp32", "bf16"]), default="auto", show_default=True,
                     help="bf16: forward passes under bfloat16 autocast (auto: bf16 on a CUDA device that "
                          "supports it, else fp32)."),
        click.option("--no-train", is_flag=True, help="Join as a plain member (no training), e.g. a bootstrap peer."),
        click.option("--exit-when-done", is_flag=True,
                     help="Leave once training is done (default: stay and serve the checkpoint until stopped)."),
    ])
    return _apply(_round_options(f), [
        click.option("--work-dir", type=click.Path(file_okay=False), default=None,
                     help="Where this peer keeps and serves its checkpoints (default: ~/.blocktrain/work/PEER_ID). "
                          "A restart with the same directory resumes from its checkpoint."),
        click.option("--steps", type=click.IntRange(1), default=None,
                     help="Steps per block (train.steps; relay trains every block this long, in turn)."),
        click.option("--schedule", type=click.Choice(["relay", "parallel"]), default=None,
                     help="relay (default): every peer trains block 0 together, then block 1 on the final block 0, "
                          "...; each peer ends holding its --block. parallel: each peer trains its own --block from "
                          "the start, on the newest lower blocks."),
    ])


def _round_options(f):
    """How the training peers average (the swarm.* settings of their rounds)."""
    return _apply(f, [
        click.option("--sync", type=click.Choice(["grads", "params", "auto"]), default=None,
                     help="grads (default): average gradients every step; params: DiLoCo, average the parameter "
                          "change every --every steps (far fewer bytes on slow links); auto: each block probes its "
                          "links with sign rounds of one step, then the group's sponsor picks gradients every step "
                          "or sign rounds of as many steps as keep communication within 10% of the time "
                          "(--set swarm.comm_share=0.1); every member takes its pick (docs/sync-auto.md)."),
        click.option("--every", type=click.IntRange(1), default=None, help="Local steps per round (params; default 25)."),
        click.option("--codec", type=click.Choice(["raw", "fp16", "bf16", "int8", "topk", "sign"]), default=None,
                     help="Codec of the averaged updates (lossy ones keep error feedback; default raw). sign: "
                          "one bit per value and a scale per 4096 (32x fewer bytes than raw); with --sync params "
                          "--every 1 --outer-lr 1.7, the low-communication mode that kept the CE. topk: each "
                          "chunk's largest values only (--density)."),
        click.option("--density", type=click.FloatRange(0.0, 1.0, min_open=True), default=None,
                     help="topk: the fraction of each chunk of 4096 values sent per round (default 0.01)."),
        click.option("--outer", type=click.Choice(["sgd", "nesterov"]), default=None,
                     help="sync params: the outer optimizer (default sgd)."),
        click.option("--outer-lr", type=click.FloatRange(0.0, min_open=True), default=None,
                     help="sync params: the outer step's rate (default 1: with sgd and no momentum, the average)."),
        click.option("--outer-momentum", type=click.FloatRange(0.0, 1.0, max_open=True), default=None,
                     help="sync params: the outer optimizer's momentum (default 0)."),
        click.option("--overlap/--no-overlap", default=None,
                     help="sync params: each round travels while the next round's local steps compute (its "
                          "average is applied one round late; the first, last and joiners' rounds are waited for). "
                          "Default: off."),
        click.option("--min-coverage", type=click.FloatRange(0.0, 1.0), default=None,
                     help="A round that averaged less of the vector than this fraction fails and changes "
                          "nothing (default 1.0)."),
        click.option("--min-group", type=click.IntRange(1), default=None,
                     help="Start only once this many peers (this one included) start together, or join a group."),
        click.option("--gossip", type=click.IntRange(0, 16), default=None, metavar="K",
                     help="Many peers on one block: from 2K members on, each round averages the parameters in "
                          "small groups of about K+1 (3..2K+1) that change every round (no barrier across the "
                          "group; K 3..16, 0: all-to-all, the default). Needs parameter rounds (--sync params) without overlap, "
                          "a dense codec and the plain average (outer sgd, rate 1)."),
    ])


def _training(o: dict):
    """The TrainerSetup for this peer, or None when it does not train; every argument checked before
    anything is written (the work directory defaults to one named after the identity: app.with_work_dir)."""
    if o["no_train"] or not o["blocks"]:
        return None
    if len(o["blocks"]) != 1:
        raise click.UsageError("a training peer holds exactly one block: give --block once (or --no-train)")
    import torch

    from blocktrain.blocks.config import ConfigError, load
    from blocktrain.blocks.data import DataError, corpus_digest, load_split, resolve_data
    from blocktrain.blocks.device import DeviceError, pick_device, pick_precision

    from .app import TrainerSetup
    from .swarm.settings import PeerJob

    try:
        job = load(PeerJob(), None, o["overrides"], o["size"], **{
            "train.steps": o["steps"], "swarm.schedule": o["schedule"],
            "swarm.sync": o["sync"] or ("params" if o["overlap"] or o["gossip"] else None),  # they mean parameter rounds
            "swarm.every": o["every"], "swarm.codec": o["codec"], "swarm.min_group": o["min_group"],
            "swarm.density": o["density"], "swarm.outer": o["outer"], "swarm.outer_lr": o["outer_lr"],
            "swarm.outer_momentum": o["outer_momentum"], "swarm.min_coverage": o["min_coverage"],
            "swarm.overlap": o["overlap"], "swarm.gossip": o["gossip"]})
    except ConfigError as e:
        raise click.BadParameter(str(e), param_hint="--set")
    if o["every"] and not o["sync"] and job.swarm.sync == "grads":
        job = load(job, None, (), **{"swarm.sync": "params"})  # --every means DiLoCo rounds
    k = o["blocks"][0]
    try:
        job.model.check_block(k)
    except NoSuchBlock as e:
        raise click.BadParameter(str(e), param_hint="--block") from None
    shard = None
    if o["shard"]:
        i, sep, n = o["shard"].partition("/")
        if not sep or not i.isdigit() or not n.isdigit() or not 0 <= int(i) < int(n):
            raise click.BadParameter(f"expected I/N with 0 <= I < N, got {o['shard']!r}", param_hint="--shard")
        shard = (int(i), int(n))
    try:
        device = pick_device(o["device"])
        precision = pick_precision(o["precision"], device)
    except DeviceError as e:
        raise click.BadParameter(str(e), param_hint="--device/--precision")
    try:
        data = resolve_data(o["data"], lambda s: click.echo(s, err=True))
        train, valid = load_split("train", data), load_split("valid", data)
        corpus = corpus_digest(data)
    except DataError as e:
        raise click.ClickException(str(e))
    torch.set_num_threads(o["threads"])
    return TrainerSetup(job, k, Path(o["work_dir"]) if o["work_dir"] else None, train, valid, shard,
                        str(device), precision, corpus)


def _options(o: dict, role: str):
    from .app import PeerOptions

    _setup_logging(o["verbose"])
    key, ident = _keys(o["swarm_key"], o["identity"])
    links = {"default": LinkSpec(), "links": {}}
    try:
        if o["links"]:
            links = load_topology(o["links"])
        if o["link_default"]:
            links["default"] = LinkSpec.parse(o["link_default"])
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--link/--links")
    if o["insecure_no_seal"]:
        click.echo("WARNING: --insecure-no-seal: frames after the handshake are NOT encrypted or authenticated. "
                   "Use only on a network you trust.", err=True)
    host, port = _addr(o["listen"])
    tmo = {k: v for k, v in (("heartbeat_s", o["heartbeat"]), ("dead_after_s", o["dead_after"])) if v is not None}
    return PeerOptions(ident, key, host, port, o["advertise"], tuple(o["blocks"]), role,
                       set(o["allow"]) or None, Timeouts(**tmo), links, not o["insecure_no_seal"], o["report_path"],
                       o["report_every"]), ident


def _run(o: dict, bootstrap: str | None, role: str, training=None, served=None):
    from .app import AddressInUse, JoinError, SwarmError, TrainingFailed, build_peer, run_until_signalled, with_work_dir

    install_uvloop()
    training = training() if callable(training) else training  # arguments checked before an identity is made
    opts, ident = _options(o, role)
    if training is not None:
        training = with_work_dir(training, ident)
    boot = _addr(bootstrap) if bootstrap else None
    peer = build_peer(opts)

    step_bar = _StepBar() if training is not None and sys.stderr.isatty() else None
    try:
        asyncio.run(run_until_signalled(
            peer, boot, on_ready=lambda p: _announce(p, role, o, training, bootstrap), training=training, served=served,
            exit_when_done=o.get("exit_when_done", False), on_line=_echo,
            status_every_s=0 if o["quiet"] else 5.0 if sys.stderr.isatty() else 30.0,
            join_timeout_s=o["join_timeout"], http=_http_addr(o["http"]) if o["http"] else None, on_step=step_bar))
    except (AddressInUse, JoinError, SwarmError, TrainingFailed) as e:
        raise click.ClickException(str(e))
    finally:
        if step_bar is not None:
            step_bar.close()
    click.echo("stopped: said goodbye to the peers" + (f", report in {o['report_path']}" if o["report_path"] else ""),
               err=True)
    _exit_now()


def _exit_now():
    """Everything is written and closed (reports, checkpoints, goodbyes; asyncio.run waited for the
    worker threads). Skip the interpreter's teardown of torch and its thread pools, which takes
    seconds: a whole swarm stopped at once should be gone at once."""
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(0)


class _StepBar:
    """A training peer's progress bar (on a terminal; otherwise the trainer prints lines)."""

    def __init__(self):
        self.bar = None

    def __call__(self, step: int, total: int, loss: float, group: int):
        if self.bar is None:
            from blocktrain.blocks.progress import bar
            self.bar = bar("training", total)
            self.bar.update(step - 1)
        self.bar.update(1)
        self.bar.set_postfix_str(f"loss {loss:.3f}, group of {group}")

    def close(self):
        if self.bar is not None:
            self.bar.close()


def _starting(o: dict, bootstrap: str | None, role: str):
    """Said at once: a training peer loads torch, its model and its data before it listens or
    joins (seconds, minutes on a busy machine), a serving peer its checkpoints."""
    trains = role != "serve" and not o["no_train"] and len(o["blocks"]) == 1
    what = (f"loading block {o['blocks'][0]}'s model and data, then " if trains
            else f"loading block(s) {list(o['blocks'])}, then " if role == "serve" else "")
    then = (f"joining through {bootstrap} within {o['join_timeout']:g} s of being ready (--join-timeout)" if bootstrap
            else f"opening {o['listen']}")
    _echo(f"starting: {what}{then}")


def _announce(peer, role: str, o: dict, training, bootstrap: str | None):
    """Once listening and in the swarm: where we are and how others join (for the role that they
    would take)."""
    key = f"--swarm-key {o['swarm_key']}" if o["swarm_key"] else "(with BT_SWARM_KEY set)"
    what = (f"training block {training.block} ({training.job.swarm.schedule}) in {training.work_dir}" if training
            else f"serving block(s) {list(o['blocks'])}" if role == "serve" else "a plain member (no training)")
    how = ("bt-peer serve " if role == "serve" else "bt-peer join ")
    join = f" --block K {key} --identity THEIR_KEY_FILE"
    listen = f"{peer.host}:{peer.port}"
    if peer.addr:
        click.echo(f"peer {peer.id[:16]} listening on {listen}, advertising {peer.addr}: {what}\n"
                   f"others join with: {how}{peer.addr}{join}", err=True)
    else:  # 0.0.0.0, or loopback in a swarm elsewhere (reach.py): the address others dial is not known yet
        click.echo(f"peer {peer.id[:16]} listening on {listen}, no address to advertise yet (it learns one once a "
                   f"member dials it back): {what}", err=True)
        if not bootstrap:
            click.echo(f"others join with: {how}THIS_HOST:{peer.port}{join} (THIS_HOST: the address they reach this "
                       "host at)", err=True)

    told: list[bool | None] = []

    def said(r):  # the dial-back's verdict (reach.py), said when it changes
        if (told and told[-1] == r.reachable) or (r.reachable is None and not r.why):
            return
        told.append(r.reachable)
        if r.reachable and peer.addr and not shown:
            click.echo(f"reachable at {peer.addr} ({r.why})\nothers join with: {how}{peer.addr}{join}", err=True)
        elif not r.reachable or not peer.addr:
            click.echo(r.line() + (f"\nothers join through a reachable member, e.g.: {how}{bootstrap}{join}"
                                   if bootstrap and r.reachable is False else ""), err=True)
    shown = bool(peer.addr)
    peer.reach.on_change(said)
    said(peer.reach)  # decided already, during the join


@main.command()
@_peer_options
@_train_options
def start(**o):
    """Start a new swarm (as its first member) and print how others join.

    With --block K the peer trains (as `join` does); --no-train makes a plain member."""
    _starting(o, None, "start")
    _run(o, None, "bootstrap" if o["no_train"] or not o["blocks"] else "train", lambda: _training(o))


@main.command()
@click.argument("bootstrap")
@_peer_options
@_train_options
def join(bootstrap, **o):
    """Join the swarm through any member at BOOTSTRAP (HOST:PORT) and train, holding --block K.

    Under the default relay schedule every training peer trains block 0 together (gradients
    averaged every step), then block 1 on the final block 0, and so on; the peer ends holding
    and serving its --block. A joiner takes the group's state (parameters, optimizer, step) from
    the group, verified; a restart with the same --work-dir resumes from its checkpoint. The
    report (--report) holds bytes by peer, kind and direction, every round's coverage, rejected
    updates, busy time, peak memory and the CE improvement per GB moved. Ctrl-C (or SIGTERM)
    stops it cleanly."""
    _starting(o, bootstrap, "join")
    _run(o, bootstrap, "bootstrap" if o["no_train"] or not o["blocks"] else "train", lambda: _training(o))


@main.command()
@click.argument("bootstrap", required=False)
@_peer_options
@click.option("--checkpoints", type=click.Path(file_okay=False, exists=True), default=None,
              help="Directory of BlockTrain block checkpoints (bt-train's OUT/checkpoints, or bt-peer assemble's "
                   "OUT): serves the exact, autoregressive and blocktrain modes. Default: the small trained model "
                   "the package ships (without --reference).")
@click.option("--reference", type=click.Path(file_okay=False, exists=True), default=None,
              help="Directory of the end-to-end model's blocks (bt-train's OUT/reference): the reference mode.")
@click.option("--batch", type=click.IntRange(1, 64), default=COMPUTE_SLOTS, show_default=True,
              help="Traversals whose chunks (16 tokens) this hop computes together, one forward over their rows "
                   "(continuous batching; the places go to clients by fair queuing). Exact and autoregressive "
                   "outputs are what they are alone (their rows are batch-invariant); blocktrain mode's only up to "
                   "rounding. 1: one chunk at a time. On CPU a batch costs about what its chunks cost one by one "
                   "(the exact attention is per session): 8 clients got about the same throughput at 8, and a "
                   "flooded client waited for whole batches (7.3x slower than alone, against 2.8x at 1).")
def serve(bootstrap, checkpoints, reference, batch, **o):
    """Serve --block K of a trained model: start a swarm, or join one through BOOTSTRAP."""
    from .serving.server import ServeError, load_served

    if not o["blocks"]:
        raise click.UsageError("serve needs --block K (repeatable)")
    _starting(o, bootstrap, "serve")
    import torch
    torch.set_num_threads(1)  # exact rows are batch invariant at one thread (blocks/model.py's rules)
    try:
        served = load_served(o["blocks"], checkpoints, reference)
    except NoSuchBlock as e:  # as start and join say it
        raise click.BadParameter(str(e), param_hint="--block") from None
    except ServeError as e:
        raise click.ClickException(str(e))
    for b, check in served.rows.items():
        kind = "reference" if b in served.reference.values() else "blocktrain"
        click.echo(f"block {check.block} ({kind}): {check.describe()}", err=True)
    served.batch = batch
    _run(o, bootstrap, "serve", served=served)


@main.command()
@click.argument("address")
@_key_options
@click.option("--prompt", required=True, help="Prompt text, at least one byte (sent as the bytes given: UTF-8 or not).")
@click.option("--bytes", "n_bytes", default=64, show_default=True, type=click.IntRange(1, 4096),
              help="Bytes to generate: at most what the served model's context leaves after the prompt "
                   "(max_seq_len, e.g. 512 with the shipped model; asked of the chain, refused with the limit).")
@click.option("--mode", type=click.Choice(["exact", "autoregressive", "blocktrain", "reference"]), default="exact",
              show_default=True,
              help="exact: the model's own output (as autoregressive, byte for byte when greedy) in a few traversals, "
                   "each verifying the last one's draft; autoregressive: one traversal per byte; blocktrain: all "
                   "bytes from one traversal (fast, lower quality); reference: the end-to-end model, per byte.")
@click.option("--temperature", type=click.FloatRange(0.0), default=0.0, show_default=True,
              help="0: greedy. Otherwise sample (exact mode by speculative sampling: distributed as autoregressive "
                   "sampling).")
@click.option("--top-k", type=click.IntRange(0, 256), default=0, show_default=True,
              help="Sample among the K most likely bytes (0: all).")
@click.option("--seed", type=int, default=0, show_default=True, help="Sampling seed (same seed, same output).")
@click.option("--draft-len", type=click.IntRange(0, 32), default=None,
              help="exact mode: bytes drafted per traversal (default: 16 greedy, 8 sampled, where 4 chains are "
                   "drafted per node, one per likely next byte).")
@click.option("--wait", "wait_s", type=click.FloatRange(0), default=30.0, show_default=True,
              help=WAIT_HELP + ", or no chain of serving peers is there yet.")
@click.option("--timeout", type=click.FloatRange(0.5), default=30.0, show_default=True,
              help="Seconds for a connection, and for each traversal's answer.")
@click.option("--whole", is_flag=True,
              help="Print the output all at once at the end (for scripts); default: as the chain accepts it.")
@click.option("--verify", is_flag=True,
              help="Check the output before printing it: one more traversal recomputes it on other holders of each "
                   "block; a hop whose answers differ is named and avoided, and the output made again. Blocks with "
                   "one serving peer stay unchecked (said so); nothing prints if it cannot be checked at all.")
@click.option("--verify-tol", type=click.FloatRange(0.0, 1.0), default=VERIFY_TOL, show_default=True,
              help="--verify: the largest total-variation distance between two holders' next-byte distributions "
                   "that still counts as the same answer. Measured: two holders of each block of the shipped model "
                   "on one machine gave 0 on 15 outputs (greedy and sampled, 3 at once); code before exact rows "
                   "were batch invariant gave up to 1.8e-4; across hardware it was not measured.")
def generate(address, swarm_key, identity, prompt, n_bytes, mode, temperature, top_k, seed, draft_len, wait_s,
             timeout, verify, verify_tol, whole):
    """Continue --prompt by N bytes through a chain of serving peers found via ADDRESS.

    The output prints as the chain accepts it, traversal by traversal (--whole: all at once, at
    the end, as with --verify); the stats line on stderr gives the time to its first byte."""
    from blocktrain.blocks.decode import Sampling

    from .serving.client import generate as run_generate
    from .serving.api import PipelineError
    from .serving.output import OutputPrinter, StdoutClosed

    install_uvloop()
    host, port = _addr(address)
    key, ident = _keys(swarm_key, identity)
    sampling = Sampling(temperature=temperature, top_k=top_k, seed=seed)
    stream = None if whole or verify else OutputPrinter(lambda text, nl: click.echo(text, nl=nl),
                                                         lambda line: click.echo(line, err=True))
    try:
        out, st = asyncio.run(run_generate(host, port, ident, key, os.fsencode(prompt), n_bytes, mode, timeout,
                                           log=lambda s: click.echo(s, err=True), sampling=sampling,
                                           draft_len=draft_len, wait_s=wait_s, verify=verify,
                                           verify_tol=verify_tol, on_bytes=stream))
    except StdoutClosed:  # nobody reads the output any more: stop quietly, as a pipe's writer does
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return
    except (PipelineError, ConnectionError, OSError) as e:
        if stream is not None and stream.printed:
            click.echo("", err=True)
        raise click.ClickException(f"generate via {address}: {e}")
    if stream is not None:
        stream(out, st["seconds"], final=True)
    else:
        click.echo(out.decode("utf-8", "replace"))
    first = st.get("first_byte_s")
    click.echo(f"[{mode}: {len(out)} bytes in {st['traversals']} traversal(s) "
               f"({len(out) / max(1, st['traversals']):.1f} bytes each), {st['seconds']:.3f} s"
               + (f", first byte at {first:.3f} s" if first is not None else "") + f", route {st['route']}]",
               err=True)
    if "verify" in st:
        v = st["verify"]
        click.echo(f"[verified against {v['second_route']}: largest distance {v['gap']:.2g} (tolerance {verify_tol:g})"
                   + (f"; blocks {v['unchecked_blocks']} have one serving peer: unchecked" if v["unchecked_blocks"] else "")
                   + (f"; named {v['named']}" if v["named"] else "") + "]", err=True)


@main.command()
@click.argument("address")
@_key_options
@click.option("--out", type=click.Path(file_okay=False), required=True,
              help="Directory for the verified block checkpoints (usable by `bt-peer serve --checkpoints`).")
@click.option("--data", type=click.Path(exists=True), default=None,
              help="The test split's corpus: one `bt-data prepare` wrote, or a directory of the standard WikiText "
                   "files (default: the embedded WikiText-2).")
@click.option("--test-windows", type=click.IntRange(0), default=300, show_default=True,
              help="Test windows to evaluate (0: the whole test split).")
@click.option("--no-eval", is_flag=True, help="Only fetch and verify.")
@click.option("--wait", "wait_s", type=click.FloatRange(0), default=0.0, show_default=True,
              help=WAIT_HELP + "; then until the swarm has finished training (showing its progress).")
@click.option("--timeout", type=click.FloatRange(0.5), default=30.0, show_default=True,
              help="Seconds for a connection and its handshake, and for each chunk of a checkpoint: a holder "
                   "silent for longer is left, and the fetch continues from another holder of that block.")
def assemble(address, swarm_key, identity, out, data, test_windows, no_eval, wait_s, timeout):
    """Fetch every block's newest checkpoint from the swarm via ADDRESS, verify it, evaluate test CE.

    Writes OUT/block{k}.safetensors and OUT/assembled.json (where each block came from, its
    step and sha256, and the test CE of every block's head along the chain)."""
    from blocktrain.blocks.checkpoint import CheckpointError
    from blocktrain.blocks.evaluate import evaluate

    from .assemble import AssembleError, assemble_from_swarm, wait_until_trained

    install_uvloop()
    host, port = _addr(address)
    key, ident = _keys(swarm_key, identity)
    try:
        if wait_s:
            asyncio.run(wait_until_trained(host, port, ident, key, wait_s, log=_echo))
        res = asyncio.run(assemble_from_swarm(host, port, ident, key, Path(out), timeout, log=_echo))
    except (AssembleError, ConnectionError, OSError) as e:
        raise click.ClickException(f"assemble via {address}: {e}")
    if not no_eval:
        click.echo(f"evaluating test CE on {test_windows or 'all'} windows...", err=True)
        try:
            res["eval"] = evaluate(Path(out), data, test_windows)
        except CheckpointError as e:
            raise click.ClickException(str(e))
        ev = res["eval"]
        click.echo(f"assembled model: test CE {ev['test_ce']:.4f} nats/byte; heads along the chain: "
                   + " / ".join(f"{c:.4f}" for c in ev["head_ce"]))
        for v in ev["verdicts"]:
            click.echo(f"  {v}")
    res["blocks"] = {str(k): v for k, v in res["blocks"].items()}
    (Path(out) / "assembled.json").write_text(json.dumps(res, indent=1))
    click.echo(f"wrote {out}/assembled.json")


@main.command()
@click.option("--out", type=click.Path(dir_okay=False), required=True, help="Where to write the new swarm key.")
def keygen(out):
    """Make a new random swarm key (32 bytes, hex, mode 0600)."""
    try:
        new_swarm_key(out)
    except KeyError_ as e:
        raise click.ClickException(str(e))
    click.echo(f"wrote swarm key to {out}; give it to every peer (--swarm-key {out})")


@main.command(name="id")
@click.option("--identity", type=click.Path(dir_okay=False), default=str(DEFAULT_IDENTITY), show_default=True)
def show_id(identity):
    """Print this peer's id (for allowlists); creates the identity if missing."""
    try:
        click.echo(peer_id(load_or_create_identity(identity)))
    except KeyError_ as e:
        raise click.ClickException(str(e))


@main.command()
@click.argument("address")
@_key_options
@click.option("--json", "as_json", is_flag=True, help="Print the raw status JSON.")
@click.option("--wait", "wait_s", type=click.FloatRange(0), default=60.0, show_default=True, help=WAIT_HELP + ".")
@click.option("--timeout", type=click.FloatRange(0.5), default=10.0, show_default=True,
              help="Seconds for the connection and the answer.")
def status(address, swarm_key, identity, as_json, wait_s, timeout):
    """Show a peer's view of the swarm: members, blocks, liveness, what it works on, bytes moved."""
    from blocktrain.protocol import ProtocolError

    from .reports import status_lines
    from .view import status_when_listening

    host, port = _addr(address)
    key, ident = _keys(swarm_key, identity)

    try:
        st = asyncio.run(status_when_listening(host, port, ident, key, Timeouts(connect_s=timeout, handshake_s=timeout),
                                               wait_s, _echo))
    except (ConnectionError, OSError, ProtocolError) as e:
        raise click.ClickException(f"status of {address}: {e or type(e).__name__}")
    if as_json:
        click.echo(json.dumps(st, indent=1))
        return
    for line in status_lines(st):
        click.echo(line)


@main.command()
@click.argument("files", nargs=-1, required=True, type=click.Path(dir_okay=False, exists=True))
@click.option("--json", "as_json", is_flag=True, help="Print the aggregate as JSON.")
@click.option("--details", is_flag=True, help="Also every (peer, direction, remote peer, message type) row.")
def report(files, as_json, details):
    """Summarise transfer-volume reports (one peer's, or a whole swarm's): per peer its block,
    rounds, rejected updates, CE start -> end and bytes by kind; the swarm's bytes by kind; the
    CE of each head along the chain. --details adds bytes by remote peer and message type."""
    from .reports import ReportError, detail_lines, summarise, summary_lines

    try:
        agg = summarise(files)
    except ReportError as e:
        raise click.ClickException(str(e))
    if as_json:
        click.echo(json.dumps(agg, indent=1))
        return
    for line in summary_lines(agg):
        click.echo(line)
    if details:
        click.echo("")
        for line in detail_lines(agg):
            click.echo(line)


if __name__ == "__main__":
    main()
