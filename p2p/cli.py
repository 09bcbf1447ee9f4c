"""``bt-peer``: start or join a BlockTrain swarm, see it, read its transfer reports."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import sys
import time
from pathlib import Path

import click

from .identity import KeyError_, load_or_create_identity, load_swarm_key, new_swarm_key, peer_id
from .link import LinkSpec, load_topology
from .node import Peer, query_status
from .transport import Timeouts, install_uvloop

DEFAULT_IDENTITY = Path.home() / ".blocktrain" / "identity"


def _addr(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise click.BadParameter(f"expected HOST:PORT, got {text!r}")
    return host, int(port)


def _setup_logging(verbose: int):
    level = logging.WARNING if verbose == 0 else logging.INFO if verbose == 1 else logging.DEBUG
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(message)s", stream=sys.stderr)


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main():
    """BlockTrain peers: each trains or serves one block; peers find each other by gossip.

    Every peer has an identity (an X25519 key, created on first start, mode 0600) and the
    swarm's key (--swarm-key FILE or BT_SWARM_KEY; make one with `bt-peer keygen`). Connections
    are mutually authenticated (Noise XXpsk3) and every frame is sealed with AES-256-GCM.
    """


def _peer_options(f):
    opts = [
        click.option("--block", "blocks", type=click.IntRange(0, 65535), multiple=True,
                     help="Block index this peer trains or serves (repeatable)."),
        click.option("--role", type=click.Choice(["train", "serve", "bootstrap"]), default="train", show_default=True),
        click.option("--listen", default="127.0.0.1:0", show_default=True, help="HOST:PORT to listen on (port 0: any)."),
        click.option("--advertise", default=None, help="HOST:PORT others should dial (default: the listen address)."),
        click.option("--swarm-key", type=click.Path(dir_okay=False), default=None,
                     help="File with the swarm key (default: the BT_SWARM_KEY variable)."),
        click.option("--identity", type=click.Path(dir_okay=False), default=str(DEFAULT_IDENTITY), show_default=True,
                     help="This peer's key file; created if missing. Give each peer on a machine its own."),
        click.option("--allow", multiple=True, help="Accept only these peer ids (repeatable; default: any key holder)."),
        click.option("--report", "report_path", type=click.Path(dir_okay=False), default=None,
                     help="Write the transfer-volume report (JSON) here, every --report-every seconds and at exit."),
        click.option("--report-every", type=click.FloatRange(0.5), default=10.0, show_default=True),
        click.option("--links", type=click.Path(dir_okay=False, exists=True), default=None,
                     help="Topology JSON: per-peer link delay/jitter/rate/loss (see PROTOCOL.md and README)."),
        click.option("--link", "link_default", default=None,
                     help="Shape every outgoing link, e.g. delay=25,jitter=2,rate=100,loss=0."),
        click.option("--dead-after", type=click.FloatRange(0.5), default=6.0, show_default=True,
                     help="Seconds of silence after which a peer is declared dead."),
        click.option("--heartbeat", type=click.FloatRange(0.05), default=1.0, show_default=True),
        click.option("--insecure-no-seal", is_flag=True,
                     help="Trusted networks only: skip frame sealing after the authenticated handshake."),
        click.option("-v", "--verbose", count=True, help="-v: log joins and leaves; -vv: debug."),
    ]
    for o in reversed(opts):
        f = o(f)
    return f


def _train_options(f):
    opts = [
        click.option("--work-dir", type=click.Path(file_okay=False), default=None,
                     help="Where this peer keeps and serves its checkpoints (default: ~/.blocktrain/work/PEER_ID). "
                          "A restart with the same directory resumes from its checkpoint."),
        click.option("--steps", type=click.IntRange(1), default=None,
                     help="Local training steps of this peer (default: the config's train.steps, 300)."),
        click.option("--every", type=click.IntRange(1), default=25, show_default=True,
                     help="Local steps per averaging round (DiLoCo's H)."),
        click.option("--codec", type=click.Choice(["raw", "fp16", "bf16", "int8"]), default="raw", show_default=True,
                     help="Codec of the averaged updates (lossy ones keep error feedback)."),
        click.option("--outer", type=click.Choice(["sgd", "nesterov"]), default="sgd", show_default=True,
                     help="Outer optimizer applied to the averaged pseudo-gradient."),
        click.option("--outer-lr", type=click.FloatRange(0, min_open=True), default=1.0, show_default=True),
        click.option("--outer-momentum", type=click.FloatRange(0, 1, max_open=True), default=0.0, show_default=True),
        click.option("--min-coverage", type=click.FloatRange(0, 1), default=1.0, show_default=True,
                     help="A round averaging less of the parameters over every live member fails (nothing applied)."),
        click.option("--round-timeout", type=click.FloatRange(1), default=120.0, show_default=True,
                     help="Seconds a round waits for the group's parts."),
        click.option("--schedule", type=click.Choice(["staggered", "parallel", "sequential"]), default="parallel",
                     show_default=True,
                     help="When lower blocks are pulled: every round (staggered, parallel) or only final (sequential)."),
        click.option("--min-group", type=click.IntRange(1), default=1, show_default=True,
                     help="Start training only once this many peers (this one included) train the block."),
        click.option("--shard", default=None, metavar="I/N",
                     help="Train on shard I of N of the data (default: this peer's own random windows)."),
        click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
                     help="Model/training config, as for bt-train (model.d_model=128, steps=300, ...). "
                          "Every peer of a swarm must use the same model config."),
        click.option("--data", type=click.Path(file_okay=False, exists=True), default=None,
                     help="Directory of the standard WikiText files (default: the embedded WikiText-2)."),
        click.option("--threads", type=click.IntRange(1), default=1, show_default=True, help="torch threads."),
        click.option("--no-train", is_flag=True, help="Join as a member only (no training), e.g. a bootstrap peer."),
        click.option("--exit-when-done", is_flag=True,
                     help="Leave once training is done (default: stay and serve the checkpoint until stopped)."),
    ]
    for o in reversed(opts):
        f = o(f)
    return f


def _make_trainer(o: dict):
    """A callback building the SwarmPeer once the Peer is up, or None when this peer does not train."""
    if o["no_train"] or o["role"] != "train" or not o["blocks"]:
        return None
    if len(o["blocks"]) != 1:
        raise click.ClickException("a training peer trains exactly one block: give --block once (or --no-train)")
    import torch

    from blocktrain.blocks.cli import JobConfig, apply_overrides
    from blocktrain.blocks.data import DataError, as_tensor, read_split

    from .swarm import SwarmConfig, SwarmPeer

    try:
        job = apply_overrides(JobConfig(), dict(_kv(s) for s in o["overrides"]))
        if o["steps"]:
            job = apply_overrides(job, {"steps": o["steps"]})
        scfg = SwarmConfig(every=o["every"], codec=o["codec"], outer=o["outer"], outer_lr=o["outer_lr"],
                           outer_momentum=o["outer_momentum"], min_coverage=o["min_coverage"],
                           round_timeout_s=o["round_timeout"], schedule=o["schedule"],
                           min_group=o["min_group"])
        train, valid = as_tensor(read_split("train", o["data"])), as_tensor(read_split("valid", o["data"]))
    except (ValueError, DataError) as e:
        raise click.ClickException(str(e))
    k = o["blocks"][0]
    if k >= job.model.n_blocks:
        raise click.ClickException(f"--block {k}: the model has blocks 0..{job.model.n_blocks - 1}")
    shard = None
    if o["shard"]:
        i, sep, n = o["shard"].partition("/")
        if not sep or not i.isdigit() or not n.isdigit() or not 0 <= int(i) < int(n):
            raise click.BadParameter(f"expected I/N with 0 <= I < N, got {o['shard']!r}", param_hint="--shard")
        shard = (int(i), int(n))
    torch.set_num_threads(o["threads"])

    def build(peer: Peer):
        work = Path(o["work_dir"]) if o["work_dir"] else Path.home() / ".blocktrain" / "work" / peer.id[:16]
        return SwarmPeer(peer, k, job.model, job.train, scfg, work, train, valid, shard,
                         progress=lambda s: click.echo(f"[{time.strftime('%H:%M:%S')}] {s}", err=True))
    return build


def _kv(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise click.BadParameter(f"expected KEY=VALUE, got {text!r}", param_hint="--set")
    return key.strip(), value.strip()


def _build_peer(o: dict) -> Peer:
    _setup_logging(o["verbose"])
    try:
        key = load_swarm_key(o["swarm_key"])
        ident = load_or_create_identity(o["identity"])
    except KeyError_ as e:
        raise click.ClickException(str(e))
    links = {"default": LinkSpec(), "links": {}}
    try:
        if o["links"]:
            links = load_topology(o["links"])
        if o["link_default"]:
            links["default"] = LinkSpec.parse(o["link_default"])
    except ValueError as e:
        raise click.ClickException(str(e))
    if o["insecure_no_seal"]:
        click.echo("WARNING: --insecure-no-seal: frames after the handshake are NOT encrypted or authenticated. "
                   "Use only on a network you trust.", err=True)
    host, port = _addr(o["listen"])
    return Peer(ident, key, host, port, o["blocks"], o["role"], allowlist=set(o["allow"]) or None,
                timeouts=Timeouts(heartbeat_s=o["heartbeat"], dead_after_s=o["dead_after"]), links=links,
                seal=not o["insecure_no_seal"], report_path=o["report_path"], report_every_s=o["report_every"],
                advertise=o["advertise"])


async def _run(peer: Peer, bootstrap: tuple[str, int] | None, quiet: bool, key_hint: str, trainer=None,
               exit_when_done: bool = False):
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await peer.start()
    if bootstrap:
        await peer.join(*bootstrap)
    click.echo(f"peer {peer.id[:16]} listening on {peer.addr}; others join with:\n"
               f"  bt-peer join {peer.addr} --block K {key_hint} --identity OTHER_KEY_FILE", err=True)
    training = None
    if trainer is not None:
        sp = trainer(peer)
        training = asyncio.ensure_future(sp.run())
        click.echo(f"training block {sp.k} in {sp.dir} (checkpoint: {sp.own_path})", err=True)
    failed = None
    last = 0.0
    while not stop.is_set():
        try:
            await asyncio.wait_for(stop.wait(), 1.0)
        except asyncio.TimeoutError:
            pass
        if training is not None and training.done():
            if training.exception() is not None:
                failed = training.exception()
                click.echo(f"training failed: {type(failed).__name__}: {failed}", err=True)
                break
            r = training.result()
            training = None
            click.echo(f"training done: block {r['block']} step {r['step']}, valid CE {r['ce_start']:.4f} -> "
                       f"{r['ce_end']:.4f}, {len(r['rounds'])} rounds applied, {len(r['failed_rounds'])} failed"
                       + ("" if exit_when_done else "; serving the checkpoint until stopped"), err=True)
            if exit_when_done:
                break
        if not quiet and time.monotonic() - last >= 5:
            last = time.monotonic()
            t = peer.traffic_report()["totals"]
            alive = sum(1 for m in peer.members.values() if m.state == "alive")
            click.echo(f"[{time.strftime('%H:%M:%S')}] {alive} peers alive, sent {_fmt_bytes(t['sent']['wire_bytes'])}, "
                       f"received {_fmt_bytes(t['received']['wire_bytes'])}", err=True)
    if training is not None and not training.done():
        training.cancel()
        await asyncio.gather(training, return_exceptions=True)
    click.echo("stopping: goodbye to peers, writing report", err=True)
    await peer.stop("peer shutting down")
    if failed is not None:
        raise click.ClickException(f"training failed: {failed}")


def _key_hint(o: dict) -> str:
    return f"--swarm-key {o['swarm_key']}" if o["swarm_key"] else "(with BT_SWARM_KEY set)"


@main.command()
@_peer_options
@_train_options
@click.option("--quiet", is_flag=True, help="No periodic status line.")
def start(quiet, **o):
    """Start a new swarm (or a first member) and print the command others use to join.

    With --block K (role train) the peer trains block K, as for `join`."""
    install_uvloop()
    trainer = _make_trainer(o)
    asyncio.run(_run(_build_peer(o), None, quiet, _key_hint(o), trainer, o["exit_when_done"]))


@main.command()
@click.argument("bootstrap")
@_peer_options
@_train_options
@click.option("--quiet", is_flag=True, help="No periodic status line.")
def join(bootstrap, quiet, **o):
    """Join the swarm through any member at BOOTSTRAP (HOST:PORT) and train --block K.

    The peer pulls the block's latest checkpoint from the group (if the group has one), agrees
    with the group on the round it joins, pulls the lower blocks' parameters (the input
    handoff), and averages with the group every --every steps. Its transfer report (--report)
    holds bytes by peer, kind and direction, every round's coverage, rejected updates and the
    CE improvement per GB moved. Ctrl-C (or SIGTERM) stops it cleanly; a restart with the same
    --work-dir resumes from its checkpoint."""
    install_uvloop()
    boot = _addr(bootstrap)
    trainer = _make_trainer(o)
    try:
        asyncio.run(_run(_build_peer(o), boot, quiet, _key_hint(o), trainer, o["exit_when_done"]))
    except ConnectionError as e:
        raise click.ClickException(str(e))


def _load_served(checkpoints: str | None, reference: str | None, blocks):
    from blocktrain.blocks import checkpoint as ckpt
    from blocktrain.blocks.model import Block, ModelConfig

    from .pipeline import ServedBlocks

    served = ServedBlocks()
    for directory, target, with_head in ((checkpoints, served.blocktrain, True), (reference, served.autoregressive, None)):
        if not directory:
            continue
        for k in blocks:
            path = Path(directory) / f"block{k}.safetensors"
            try:
                c = ckpt.load(path)
            except ckpt.CheckpointError as e:
                raise click.ClickException(str(e))
            cfg = ModelConfig.from_dict(c.config)
            b = Block(cfg, k, with_head=with_head if with_head is not None else k == cfg.n_blocks - 1)
            b.load_state_dict(c.tensors)
            b.eval()
            target[k] = b
    if not served.blocktrain and not served.autoregressive:
        raise click.ClickException("serve needs --checkpoints DIR (BlockTrain blocks) and/or --reference DIR")
    return served


@main.command()
@click.argument("bootstrap", required=False)
@_peer_options
@click.option("--checkpoints", type=click.Path(file_okay=False, exists=True), default=None,
              help="Directory of BlockTrain block checkpoints (bt-train's OUT/checkpoints).")
@click.option("--reference", type=click.Path(file_okay=False, exists=True), default=None,
              help="Directory of the end-to-end model's blocks (bt-train's OUT/reference), for autoregressive serving.")
@click.option("--quiet", is_flag=True, help="No periodic status line.")
def serve(bootstrap, checkpoints, reference, quiet, **o):
    """Serve --block K of a trained model: start a swarm, or join one through BOOTSTRAP."""
    from .pipeline import PipelineServer

    install_uvloop()
    if not o["blocks"]:
        raise click.ClickException("serve needs --block K")
    served = _load_served(checkpoints, reference, o["blocks"])
    o["role"] = "serve"
    peer = _build_peer(o)
    PipelineServer(peer, served)
    try:
        asyncio.run(_run(peer, _addr(bootstrap) if bootstrap else None, quiet, _key_hint(o)))
    except ConnectionError as e:
        raise click.ClickException(str(e))


def _holders(st: dict, role: str, bad: set = frozenset()) -> dict[int, list[str]]:
    """Block -> addresses of the live peers with ``role`` holding it, from a status reply (the
    answering peer included), avoiding ``bad``."""
    holders: dict[int, list[str]] = {}
    for m in [{"addr": st["addr"], "blocks": st["blocks"], "state": "alive", "role": st["role"]}] + st["members"]:
        if m["state"] == "alive" and m["role"] == role and m["addr"] not in bad:
            for b in m["blocks"]:
                holders.setdefault(b, []).append(m["addr"])
    return holders


def _chain(st: dict, bad: set) -> list[str]:
    """One live serving peer per block 0..K-1 from a status reply, avoiding ``bad``."""
    holders = _holders(st, "serve", bad)
    if not holders:
        raise click.ClickException("no live serving peers known")
    missing = [b + 1 for b in range(max(holders) + 1) if b not in holders]
    if missing:
        raise click.ClickException(f"no live peer serves block(s) {missing}" + (f" (excluded: {sorted(bad)})" if bad else ""))
    return [holders[b][0] for b in range(max(holders) + 1)]


async def _generate(host, port, ident, key, prompt: bytes, n: int, mode: str, timeout: float,
                    attempts: int = 3) -> tuple[bytes, dict]:
    """Pick a chain from the swarm view, run the request; when a hop fails, retry through another
    peer holding that block (a hop that names the failed block is excluded; after a timeout the
    swarm view, which drops silent peers, is asked again)."""
    from .pipeline import PipelineClient, PipelineError

    tmo = Timeouts(connect_s=timeout, handshake_s=timeout)
    bad: set[str] = set()
    last = None
    for attempt in range(attempts):
        route = _chain(await query_status(host, port, ident, key, tmo), bad)
        client = PipelineClient(ident, key, route, list(range(len(route))), timeout_s=timeout)
        try:
            await client.connect()
            gen = client.generate_blocktrain if mode == "blocktrain" else client.generate_autoregressive
            out, stats = await gen(prompt, n)
            stats["route"] = route
            return out, stats
        except (PipelineError, ConnectionError) as e:
            last = e
            click.echo(f"attempt {attempt + 1} through {route} failed: {e}", err=True)
            named = [route[b] for b in range(len(route)) if f"block {b + 1} " in str(e) or f"block {b + 1}:" in str(e)]
            if named:
                bad.add(named[0])
            else:  # no answer: let the swarm notice the silent peer before asking again
                await asyncio.sleep(tmo.dead_after_s)
        finally:
            await client.close()
    raise click.ClickException(f"gave up after {attempts} attempts: {last}")


@main.command()
@click.argument("address")
@click.option("--prompt", required=True, help="Prompt text (UTF-8).")
@click.option("--bytes", "n_bytes", default=64, show_default=True, type=click.IntRange(1, 4096))
@click.option("--mode", type=click.Choice(["blocktrain", "autoregressive"]), default="blocktrain", show_default=True)
@click.option("--swarm-key", type=click.Path(dir_okay=False), default=None)
@click.option("--identity", type=click.Path(dir_okay=False), default=str(DEFAULT_IDENTITY), show_default=True)
@click.option("--timeout", type=click.FloatRange(0.5), default=30.0, show_default=True)
def generate(address, prompt, n_bytes, mode, swarm_key, identity, timeout):
    """Continue --prompt by N bytes through a chain of serving peers found via ADDRESS."""
    install_uvloop()
    host, port = _addr(address)
    try:
        key, ident = load_swarm_key(swarm_key), load_or_create_identity(identity)
    except KeyError_ as e:
        raise click.ClickException(str(e))
    out, st = asyncio.run(_generate(host, port, ident, key, prompt.encode(), n_bytes, mode, timeout))
    click.echo(out.decode("utf-8", "replace"))
    click.echo(f"[{mode}: {st['traversals']} traversal(s), {st['seconds']:.3f} s, route {st['route']}]", err=True)


async def assemble_from_swarm(host: str, port: int, ident, key, out: Path, timeout: float = 30.0,
                              log=lambda s: None) -> dict:
    """Fetch the newest checkpoint of every block from its training peers, verified, into ``out``;
    returns {block: {"step", "from", "bytes", "sha256"}} and the model config."""
    from blocktrain.blocks import checkpoint as ckpt

    from .checkpoints import CheckpointFetcher, FetchError

    tmo = Timeouts(connect_s=timeout, handshake_s=timeout)
    st = await query_status(host, port, ident, key, tmo)
    holders = _holders(st, "train")
    if not holders:
        raise click.ClickException(f"{host}:{port} knows no live training peers")
    client = Peer(ident, key, "127.0.0.1", 0, role="client", timeouts=tmo)
    fetcher = CheckpointFetcher(client, chunk_timeout_s=timeout)
    got, config = {}, None
    try:
        for k in sorted(holders):
            best, why = None, []
            for addr in holders[k]:  # every holder: a peer that fell behind must not win
                try:
                    blob = await fetcher.fetch([addr], "checkpoint", f"block{k}")
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
                raise click.ClickException(f"no holder of block {k} delivered a valid checkpoint: {'; '.join(why)}")
            c, blob, addr = best
            if config is None:
                config = c.config
            elif c.config != config:
                raise click.ClickException(f"block {k} from {addr} has another model config than block 0")
            out.mkdir(parents=True, exist_ok=True)
            ckpt.save(c, out / f"block{k}.safetensors")
            got[k] = {"step": c.step, "from": addr, "bytes": len(blob), "sha256": c.sha256,
                      "final": bool(c.extra.get("final"))}
            log(f"block {k}: step {c.step} from {addr} ({_fmt_bytes(len(blob))}), verified")
    finally:
        await client.stop("done")
    n = (config or {}).get("n_blocks", 0)
    missing = [k for k in range(n) if k not in got]
    if missing:
        raise click.ClickException(f"no live training peer holds block(s) {missing} of {n}")
    return {"blocks": got, "config": config}


def evaluate_assembled(directory: Path, data: str | None, windows: int) -> dict:
    """Test CE of the assembled blocks in ``directory`` (each block's head along the chain)."""
    from blocktrain.blocks import checkpoint as ckpt
    from blocktrain.blocks.data import as_tensor, read_split
    from blocktrain.blocks.model import Block, ModelConfig
    from blocktrain.blocks.train import eval_chain

    blocks, seq_len = [], None
    for path in sorted(directory.glob("block*.safetensors"), key=lambda p: int(p.stem[5:])):
        c = ckpt.load(path)
        cfg = ModelConfig.from_dict(c.config)
        b = Block(cfg, c.block)
        b.load_state_dict(c.tensors)
        blocks.append(b)
        seq_len = c.extra.get("train", {}).get("seq_len", seq_len)
    test = as_tensor(read_split("test", data))
    heads = eval_chain(blocks, test, seq_len or 128, windows or None)
    return {"test_ce": heads[-1], "head_ce": heads, "test_windows": windows, "seq_len": seq_len,
            "data": data or "embedded WikiText-2"}


@main.command()
@click.argument("address")
@click.option("--out", type=click.Path(file_okay=False), required=True,
              help="Directory for the verified block checkpoints (usable by `bt-peer serve --checkpoints`).")
@click.option("--swarm-key", type=click.Path(dir_okay=False), default=None)
@click.option("--identity", type=click.Path(dir_okay=False), default=str(DEFAULT_IDENTITY), show_default=True)
@click.option("--data", type=click.Path(file_okay=False, exists=True), default=None,
              help="Directory of the standard WikiText files for the test CE (default: the embedded WikiText-2).")
@click.option("--test-windows", type=click.IntRange(0), default=300, show_default=True,
              help="Test windows to evaluate (0: the whole test split).")
@click.option("--no-eval", is_flag=True, help="Only fetch and verify.")
@click.option("--timeout", type=click.FloatRange(0.5), default=30.0, show_default=True)
def assemble(address, out, swarm_key, identity, data, test_windows, no_eval, timeout):
    """Fetch every block's newest checkpoint from the swarm via ADDRESS, verify it, evaluate test CE.

    Writes OUT/block{k}.safetensors and OUT/assembled.json (where each block came from, its
    step and sha256, and the test CE of every block's head along the chain)."""
    install_uvloop()
    host, port = _addr(address)
    try:
        key, ident = load_swarm_key(swarm_key), load_or_create_identity(identity)
        res = asyncio.run(assemble_from_swarm(host, port, ident, key, Path(out), timeout,
                                              log=lambda s: click.echo(s, err=True)))
    except (KeyError_, ConnectionError, OSError) as e:
        raise click.ClickException(f"assemble via {address}: {e}")
    if not no_eval:
        click.echo(f"evaluating test CE on {test_windows or 'all'} windows...", err=True)
        res["eval"] = evaluate_assembled(Path(out), data, test_windows)
        click.echo(f"assembled model: test CE {res['eval']['test_ce']:.4f} nats/byte (heads along the chain: "
                   + ", ".join(f"{c:.4f}" for c in res["eval"]["head_ce"]) + ")")
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
@click.option("--swarm-key", type=click.Path(dir_okay=False), default=None)
@click.option("--identity", type=click.Path(dir_okay=False), default=str(DEFAULT_IDENTITY), show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print the raw status JSON.")
@click.option("--timeout", type=click.FloatRange(0.5), default=10.0, show_default=True)
def status(address, swarm_key, identity, as_json, timeout):
    """Show a peer's view of the swarm: members, blocks, liveness, bytes moved."""
    host, port = _addr(address)
    try:
        key, ident = load_swarm_key(swarm_key), load_or_create_identity(identity)
        st = asyncio.run(query_status(host, port, ident, key, Timeouts(connect_s=timeout, handshake_s=timeout)))
    except (KeyError_, ConnectionError, OSError) as e:
        raise click.ClickException(f"status of {address}: {e}")
    except Exception as e:  # protocol errors: wrong key, not a BlockTrain peer
        raise click.ClickException(f"status of {address}: {type(e).__name__}: {e}")
    if as_json:
        click.echo(json.dumps(st, indent=1))
        return
    click.echo(f"peer {st['peer_id'][:16]} at {st['addr']} (blocks {st['blocks']}, role {st['role']})")
    click.echo(f"{'peer':<18} {'address':<22} {'blocks':<10} {'role':<10} {'state':<8} {'last heard':>10}")
    for m in st["members"]:
        click.echo(f"{m['peer_id'][:16]:<18} {m['addr']:<22} {str(m['blocks']):<10} {m['role']:<10} "
                   f"{m['state']:<8} {m['last_heard_s']:>9.1f}s")
    t = st["traffic"]
    click.echo(f"bytes moved by this peer: sent {_fmt_bytes(t['sent']['wire_bytes'])}, "
               f"received {_fmt_bytes(t['received']['wire_bytes'])}")


@main.command()
@click.argument("files", nargs=-1, required=True, type=click.Path(dir_okay=False, exists=True))
@click.option("--json", "as_json", is_flag=True, help="Print the aggregate as JSON instead of tables.")
def report(files, as_json):
    """Print transfer-volume reports (one peer's, or a whole swarm's): bytes by kind, by remote
    peer and message type, and direction; training rounds; CE improvement per GB moved."""
    rows, kinds = [], {d: {} for d in ("sent", "received")}
    peers_out = []
    for f in files:
        try:
            r = json.loads(Path(f).read_text())
        except ValueError as e:
            raise click.ClickException(f"{f}: not JSON: {e}")
        if not isinstance(r, dict) or r.get("kind") != "blocktrain-transfer-report":
            raise click.ClickException(f"{f}: not a BlockTrain transfer report")
        for pid, t in sorted(r["peers"].items()):
            for d in ("sent", "received"):
                for typ, c in sorted(t[d]["by_type"].items()):
                    rows.append((r["peer_id"][:12], d, pid[:12], typ, c["frames"], c["payload_bytes"], c["wire_bytes"]))
        for d in ("sent", "received"):
            for k, c in r.get("by_kind", {}).get(d, {}).items():
                acc = kinds[d].setdefault(k, {"frames": 0, "payload_bytes": 0, "wire_bytes": 0})
                for x in acc:
                    acc[x] += c[x]
        tr = r.get("training") or {}
        moved = r["totals"]["sent"]["wire_bytes"] + r["totals"]["received"]["wire_bytes"]
        peers_out.append({"file": f, "peer_id": r["peer_id"], "addr": r["addr"], "blocks": r["blocks"],
                          "seconds": r["end_time"] - r["start_time"], "wire_bytes_moved": moved,
                          "by_kind": r.get("by_kind", {}), "training": {k: tr.get(k) for k in (
                              "block", "state", "step", "ce_start", "ce_end", "ce_improvement_per_gb")} if tr else None,
                          "rounds": len(tr.get("rounds", [])), "failed_rounds": len(tr.get("failed_rounds", [])),
                          "rejected_updates": tr.get("rejected_updates", []), "excluded_by": tr.get("excluded_by", {}),
                          "membership_events": len(r.get("events", []))})
    total_moved = sum(kinds["sent"][k]["wire_bytes"] for k in kinds["sent"])
    agg = {"peers": peers_out, "by_kind": kinds, "wire_bytes_sent": total_moved}
    if as_json:
        click.echo(json.dumps(agg, indent=1))
        return
    for p in peers_out:
        click.echo(f"{p['file']}: peer {p['peer_id'][:12]} {p['addr']} blocks {p['blocks']}, {p['seconds']:.0f} s, "
                   f"moved {_fmt_bytes(p['wire_bytes_moved'])}, {p['membership_events']} membership events")
        t = p["training"]
        if t:
            ce = (f"valid CE {t['ce_start']:.4f} -> {t['ce_end']:.4f}" if t["ce_end"] is not None
                  else f"valid CE at start {t['ce_start']}" if t["ce_start"] is not None else "no CE yet")
            per_gb = f", {t['ce_improvement_per_gb']:.3g} CE per GB" if t.get("ce_improvement_per_gb") else ""
            click.echo(f"  training block {t['block']}: {t['state']} at step {t['step']}, {p['rounds']} rounds applied, "
                       f"{p['failed_rounds']} failed; {ce}{per_gb}")
        for ev in p["rejected_updates"]:
            click.echo(f"  REJECTED update from {ev['peer'][:12]} in round {ev['round']}: {ev['reason']} (excluded since)")
        for pid, why in p["excluded_by"].items():
            click.echo(f"  EXCLUDED by {pid[:12]}, which rejected this peer's update: {why}")
    click.echo(f"\n{'peer':<13} {'dir':<9} {'remote':<13} {'type':<17} {'frames':>8} {'payload':>11} {'wire':>11}")
    for p, d, remote, typ, fr, pb, wb in rows:
        click.echo(f"{p:<13} {d:<9} {remote:<13} {typ:<17} {fr:>8} {_fmt_bytes(pb):>11} {_fmt_bytes(wb):>11}")
    click.echo(f"\n{'kind':<17} {'sent payload':>13} {'sent wire':>11} {'recv payload':>13} {'recv wire':>11}")
    for k in sorted(set(kinds["sent"]) | set(kinds["received"])):
        s, rcv = kinds["sent"].get(k, {}), kinds["received"].get(k, {})
        click.echo(f"{k:<17} {_fmt_bytes(s.get('payload_bytes', 0)):>13} {_fmt_bytes(s.get('wire_bytes', 0)):>11} "
                   f"{_fmt_bytes(rcv.get('payload_bytes', 0)):>13} {_fmt_bytes(rcv.get('wire_bytes', 0)):>11}")
    click.echo(f"total wire bytes sent by these peers: {_fmt_bytes(total_moved)}")


if __name__ == "__main__":
    main()
