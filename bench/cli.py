"""``bt-bench``: BlockTrain's benchmarks. Each prints a table and can write JSON (--json PATH)."""

from __future__ import annotations

import contextlib
import functools
import sys
from pathlib import Path

import click

from blocktrain.p2p.serving.api import COMPUTE_SLOTS

from .options import BadOption, OptionError
from .provenance import write_result


def _emit(result: dict, json_path: str | None, rows: list[tuple]):
    width = max(len(r[0]) for r in rows)
    for name, value in rows:
        click.echo(f"  {name:<{width}}  {value}")
    _write(json_path, result)


def _echo(lines: list[str]) -> None:
    for line in lines:
        click.echo(line)


def _write(json_path: str | None, result: dict) -> None:
    """The result as JSON at ``json_path`` (if given), said on stdout."""
    if json_path:
        write_result(json_path, result)
        click.echo(f"wrote {json_path}")


@contextlib.contextmanager
def _usage_errors():
    """A bench module's option error as click's usage error, with its message."""
    try:
        yield
    except BadOption as e:
        raise click.BadParameter(str(e), param_hint=e.param_hint) from None
    except OptionError as e:
        raise click.UsageError(str(e)) from None


def _moves(bar):
    """``progress(done, total)`` that moves a click progress ``bar`` to ``done``."""
    last = [0]

    def progress(done, total):
        bar.update(done - last[0])
        last[0] = done
    return progress


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main():
    """BlockTrain benchmarks. Figures are medians of repeated runs; every ratio compares two
    figures measured side by side in the same run (this machine is shared and noisy)."""


@main.command()
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Write the full result as JSON here.")
@click.option("--repeats", default=7, show_default=True, type=click.IntRange(3, 101),
              help="Timed repetitions; medians are reported.")
@click.option("--chunk-mib", default=4, show_default=True, type=click.IntRange(1, 15),
              help="Size of the large payload, MiB.")
@click.option("--small-frames", default=20000, show_default=True, type=click.IntRange(1000, 10**7),
              help="Small frames per timed batch.")
def codec(json_path, repeats, chunk_mib, small_frames):
    """In-process encode+decode throughput of the wire protocol.

    Large payloads: one StreamChunk of --chunk-mib random bytes through two in-process
    Connections, plaintext and sealed (AES-256-GCM), against a memcpy of the same bytes and raw
    AES-256-GCM encrypt+decrypt of them, measured interleaved. Small frames: Ping messages
    encoded and decoded per second. Targets: plaintext >= 50% of memcpy, sealed >= 60% of raw
    AES-GCM, >= 100,000 small frames/s.
    """
    from . import codec as bench_codec

    with click.progressbar(length=repeats, label="codec", file=sys.stderr) as bar:
        r = bench_codec.run(chunk_mib * 1024 * 1024, repeats, small_frames=small_frames, progress=_moves(bar))
    _emit(r, json_path, bench_codec.rows(r))


@main.command()
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Write the full result as JSON here.")
@click.option("--mib", default=1024, show_default=True, type=click.IntRange(4, 1 << 20),
              help="Bytes per transfer, MiB (1024 = the 1 GiB of the target).")
@click.option("--repeats", default=3, show_default=True, type=click.IntRange(1, 51))
@click.option("--pings", default=2000, show_default=True, type=click.IntRange(10, 10**6))
def transport(json_path, mib, repeats, pings):
    """Two processes on loopback: bulk stream and round trips, against raw sockets.

    One payload of --mib MiB streamed from this process to a receiver process as 4 MiB
    StreamChunk frames, unsealed and sealed, beside a raw blocking-socket transfer of the same
    bytes; the peers' sealed Ping/Pong round trip beside a raw asyncio (uvloop) echo. All
    measured in one run, interleaved. Targets: unsealed >= 60% and sealed >= 40% of the raw
    socket; Ping/Pong <= 2x the raw ping-pong.
    """
    from . import transport as bench_transport

    with click.progressbar(length=repeats, label="transport", file=sys.stderr) as bar:
        r = bench_transport.run(mib << 20, repeats, pings, _moves(bar))
    _emit(r, json_path, bench_transport.rows(r))


@main.command()
@click.option("--checkpoints", type=click.Path(file_okay=False, exists=True), default=None,
              help="A trained model's block checkpoints (bt-train's OUT/checkpoints, bt-peer assemble's OUT). "
                   "Default: the small trained model the package ships.")
@click.option("--rtt-ms", default=50.0, show_default=True, type=click.FloatRange(0), help="Round trip of every link.")
@click.option("--rate-mbit", default=100.0, show_default=True, type=click.FloatRange(0), help="Link rate; 0 = unlimited.")
@click.option("--bytes", "n_bytes", default=256, show_default=True, type=click.IntRange(2, 4096),
              help="Output sequence length N (after a 64-byte prompt).")
@click.option("--prompts", default=3, show_default=True, type=click.IntRange(1, 1000),
              help="WikiText-2 prompts (64 bytes each, from --split); medians over prompts x repeats.")
@click.option("--repeats", default=1, show_default=True, type=click.IntRange(1, 21))
@click.option("--mode", "modes", multiple=True, metavar="MODE[,MODE]",
              help="Run only these modes: blocktrain, exact, autoregressive (a comma list, or repeated; default: all "
                   "three). The speedup and the identity check need exact and autoregressive.")
@click.option("--split", type=click.Choice(["test", "valid"]), default="test", show_default=True,
              help="Where the prompts come from: valid keeps the test split for final figures.")
@click.option("--temperature", default=0.0, show_default=True, type=click.FloatRange(0, 10),
              help="0: greedy (exact's output is checked to be autoregressive's); > 0: exact and autoregressive "
                   "sample (prompt i with seed i), each distributed as autoregressive sampling, not the same bytes.")
@click.option("--clients", default=1, show_default=True, type=click.IntRange(1, 64),
              help="After the modes ran one prompt at a time, this many clients at once (client j on prompt j, "
                   "each its own identity), exact and autoregressive: each client's time against its time alone, "
                   "the aggregate bytes per second against one client's. Needs --prompts >= --clients.")
@click.option("--batch", "batches", default=str(COMPUTE_SLOTS), show_default=True, metavar="N[,N]",
              help="With --clients: the hops' bt-peer serve --batch (traversals whose chunks a hop computes "
                   "together); a comma list runs the clients once per size, side by side in one run (the first "
                   "size's run is the one the targets judge).")
@click.option("--sweep", is_flag=True, help="N in 16..256 x RTT in 0..200 ms (autoregressive timed on 32 bytes and "
                                            "scaled, labelled); writes a table and a PNG.")
@click.option("--kernel", is_flag=True,
              help="Peers as processes in network namespaces: veth, tc HTB rate, delay by tc netem or, where the "
                   "kernel lacks it, a userspace relay (needs root; blocktrain and autoregressive modes).")
@click.option("--out", default="runs/bench-wan", show_default=True, type=click.Path(file_okay=False))
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Write the results as JSON here.")
def wan(checkpoints, rtt_ms, rate_mbit, n_bytes, prompts, repeats, modes, split, temperature, clients, batches, sweep,
        kernel, out, json_path):
    """One output sequence across a chain of serving peers on WAN-like links, three modes side by side
    (or those --mode names).

    exact: every traversal verifies the last one's draft and proposes the next; its greedy output
    is checked in the run to equal the autoregressive output. autoregressive: one traversal per
    byte, KV cache per hop. blocktrain: one traversal for all N bytes, with the CE of its output
    per offset beside its time (it is not the same output). Per mode: time per sequence,
    traversals, bytes moved, and the physical bound (one-way delays of the links crossed +
    serialization at the link rate + measured compute). Links: the in-process link shaper (this
    kernel has no netem). Targets: exact >= 3x faster than autoregressive at identical
    output; every mode within 1.25x of its bound.
    """
    from . import wan as bench_wan

    log = lambda s: click.echo(s, err=True)  # noqa: E731
    with _usage_errors():
        modes, sizes = bench_wan.check_options(modes, kernel, sweep, split, temperature, clients, prompts, batches)
    if kernel:
        result = _wan_kernel(n_bytes, rtt_ms, rate_mbit, repeats, log)
    elif sweep:
        result = bench_wan.sweep(checkpoints, rate_mbit, prompts, split, out, log=log)
    else:
        from blocktrain.blocks.progress import bar as progress_bar

        together = len([m for m in modes if m != "blocktrain"]) * repeats * len(sizes) if clients > 1 else 0
        with progress_bar("bt-bench wan", len(modes) * prompts * repeats + together, unit="request",
                          threads=0) as pbar:  # it mostly waits on the emulated links
            def progress(what):
                pbar.set_postfix_str(what)
                pbar.update(1)

            result = {"benchmark": "wan", **bench_wan.compare(
                checkpoints, n_bytes, rtt_ms, rate_mbit, prompts, repeats, log=log, progress=progress, modes=modes,
                split=split, temperature=temperature, clients=clients, batches=sizes)}
        _echo(bench_wan.report(result, modes, temperature, clients))
    _write(json_path, result)


def _wan_kernel(n_bytes: int, rtt_ms: float, rate_mbit: float, repeats: int, log) -> dict:
    """``bt-bench wan --kernel``: peers as processes in network namespaces; refused where the
    kernel or the user cannot make them."""
    from .netns import available
    from .wan_kernel import report, run_kernel

    why = available()
    if why:
        raise click.ClickException(f"--kernel: {why}")
    result = run_kernel(n_bytes, rtt_ms, rate_mbit, 3, 192, 2, repeats, None, log=log)
    _echo(report(result))
    return result


@main.command()
@click.option("--measured", "measured_path", required=True, type=click.Path(dir_okay=False, exists=True),
              help="A `bt-bench wan --json` result: each mode's traversals, positions and bytes per output.")
@click.option("--params", default=75.80e9, show_default=True, type=click.FloatRange(min=1, min_open=False),
              help="The logical model's parameters (the paper's abstract: 75.80B), split evenly over the hops.")
@click.option("--hidden", default=8192, show_default=True, type=click.IntRange(1, 1 << 20),
              help="Its hidden width: the values per position sent between hops (not in the paper's abstract: "
                   "assumed).")
@click.option("--hops", default=3, show_default=True, type=click.IntRange(1, 64),
              help="Hops of the chain: the measured run's (its links between hops are what is widened).")
@click.option("--rtt-ms", type=click.FloatRange(0), default=None,
              help="Round trip of every link (default: the measured run's).")
@click.option("--rate-mbit", type=click.FloatRange(0), default=None,
              help="Link rate, 0 = unlimited (default: the measured run's).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Write the projection as JSON here.")
def shape(measured_path, params, hidden, hops, rtt_ms, rate_mbit, json_path):
    """A projection, not a run: the serving modes of a measured `bt-bench wan` run at a logical
    model shape (by default the paper's 75.80B parameters in fp16 over 3 hops, on H200s).

    Traversals, positions and bytes per output come from the measured run (exact mode's
    traversals are what drafts earned on the project's model); the hidden states between hops
    grow to --hidden values a position; link time is one-way delays plus serialization at the
    rate; compute is each hop's pass at the H200's spec-sheet peak (weights read from memory, or
    FLOPs, whichever is longer: a lower bound). bench/shape.py says what is not counted.
    """
    from .shape import Device, Shape, load_measured, project, report

    try:
        result = project(load_measured(measured_path), Shape(params=params, hidden=hidden, hops=hops), Device(),
                         rtt_ms, rate_mbit, source=str(measured_path))
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    _echo(report(result))
    _write(json_path, result)


@main.command()
@click.option("--workers", default="3,6", show_default=True,
              help="Comma-separated worker counts (bt-peer processes; worker i holds block i mod K).")
@click.option("--steps", default=1000, show_default=True, type=click.IntRange(2, 10**6),
              help="Steps per block of each worker (equal-steps); equal-total shares steps x K among the workers.")
@click.option("--seeds", default="0", show_default=True, help="Comma-separated seeds (train.seed); 3 for mean and spread.")
@click.option("--compare", default="equal-steps,equal-total", show_default=True,
              help="equal-steps: every worker the same steps (more workers, more data); equal-total: the same total "
                   "local steps per block, shared by the workers; sync: every-step averaging beside the mode that "
                   "--sync/--every/--codec/--density/--outer-lr choose, on the same settings, data and seeds "
                   "(bytes_ratio and ce_gap in the JSON's sync_comparison).")
@click.option("--equal-total-lr", type=click.Choice(["sqrt", "same", "linear"]), default="sqrt", show_default=True,
              help="Equal-total runs have W/K times the batch for K/W the steps: sqrt: learning rate x sqrt(W/K), "
                   "the configured warmup (the square-root rule for Adam); same: the configured learning rate and "
                   "warmup; linear: learning rate x W/K and warmup x K/W steps (the linear scaling rule).")
@click.option("--reference/--no-reference", default=True, show_default=True,
              help="Also train the in-process sequential run of the same model and steps per block, with the data "
                   "per step of the one-worker-per-block run (a batch K times a worker's).")
@click.option("--target-ce", type=float, default=None,
              help="Report each run's training time and step at which the top head's valid CE reached this "
                   "(needs --eval-every).")
@click.option("--eval-every", default=0, show_default=True, type=click.IntRange(0),
              help="Steps between valid-CE points on every worker (0: none).")
@click.option("--schedule", type=click.Choice(["relay", "parallel"]), default=None, help="Default: relay.")
@click.option("--sync", type=click.Choice(["grads", "params", "auto"]), default=None,
              help="Default: grads. auto: each block's sponsor picks from what it measures (docs/sync-auto.md).")
@click.option("--every", type=click.IntRange(1), default=None, help="Steps per round (params).")
@click.option("--codec", type=click.Choice(["raw", "fp16", "bf16", "int8", "topk", "sign"]), default=None,
              help="Averaging codec, lossy ones with error feedback. sign: one bit per value (with --sync "
                   "params --every 1 --outer-lr 1.7: the low-communication mode); topk: each chunk's largest "
                   "values (--density).")
@click.option("--density", type=click.FloatRange(0.0, 1.0, min_open=True), default=None,
              help="topk: the fraction of each chunk of 4096 values sent per round (default 0.01).")
@click.option("--outer-lr", type=click.FloatRange(0.0, min_open=True), default=None,
              help="sync params: the outer step's rate (default 1: the members' average).")
@click.option("--overlap", is_flag=True, default=None,
              help="sync params: each round travels while the next round's local steps compute.")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="Model/training/swarm config, as for bt-peer (model.d_model=128, ...).")
@click.option("--wan", is_flag=True, help="Shape every link (--link) and report the communication's share.")
@click.option("--link", default="delay=25,rate=100", show_default=True,
              help="Link for --wan: one-way delay ms, rate Mbit/s (in-process link shaper).")
@click.option("--test-windows", default=300, show_default=True, type=click.IntRange(0, 10**6))
@click.option("--out", default="runs/bench-swarm", show_default=True, type=click.Path(file_okay=False))
@click.option("--resume", is_flag=True, help="Resume runs from their work directories (default: fresh ones).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Write the results as JSON here.")
def swarm(workers, steps, seeds, compare, equal_total_lr, reference, target_ce, eval_every, schedule, sync, every,
          codec, density, outer_lr, overlap, overrides, wan, link, test_windows, out, resume, json_path):
    """Train a model with real bt-peer processes on loopback, assemble it from the swarm, test it.

    For every seed and worker count: equal steps per worker (does adding workers, and data, help?)
    and equal total steps per block (the same work shared), each head's test CE along the chain,
    every worker's busy fraction, bytes by kind, wall time (and to --target-ce); beside the
    in-process sequential run of the same model. Targets: the K-worker relay within
    0.02 of the in-process sequential CE, every upper block >= 0.02 better than the one below,
    every worker busy >= 80%; more workers better at equal steps, within 0.03 at equal total.
    """
    from blocktrain.blocks.config import ConfigError, parse_set
    from blocktrain.blocks.progress import bar as progress_bar

    from . import swarm as bench_swarm

    sw = bench_swarm.swarm_settings(schedule, sync, every, codec, density, outer_lr, overlap)
    try:
        bench = bench_swarm.Bench(
            workers=[int(w) for w in workers.split(",")], steps=steps, seeds=[int(x) for x in seeds.split(",")],
            compare=[c.strip() for c in compare.split(",") if c.strip()], overrides=parse_set(overrides),
            out=Path(out), swarm=sw, test_windows=test_windows, link=link if wan else None, eval_every=eval_every,
            resume=resume, target_ce=target_ce, reference=reference, equal_total_lr=equal_total_lr)
    except (ConfigError, ValueError) as e:
        raise click.BadParameter(str(e), param_hint="--set/--workers/--seeds/--compare")
    save = (lambda r: write_result(json_path, r)) if json_path else None
    try:
        result = bench.execute(save=save, bar=functools.partial(progress_bar, threads=0),  # the work runs in bt-peer processes
                               log=lambda s: click.echo(s, err=True))
    except bench_swarm.BenchError as e:
        raise click.ClickException(str(e))
    result = bench_swarm.with_plot(bench, result, save)
    _echo(bench_swarm.table(result, bench.K))
    if "plot" in result:
        click.echo(f"wrote {result['plot']}")
    if json_path:
        click.echo(f"wrote {json_path}")


@main.command()
@click.option("--members", default="8,64,256", show_default=True, metavar="W[,W]",
              help="Members of the one block, per simulated size (comma-separated, each 4..1024).")
@click.option("--all-to-all", "all_sizes", default="8,64", show_default=True, metavar="W[,W]",
              help="Sizes at which the all-to-all round runs beside gossip ('' for none); robust up to "
                   "16 members, the plain mean above (a robust round of W members costs W^2 parts here).")
@click.option("--size", default=4, show_default=True, type=click.IntRange(3, 16),
              help="Gossip size k: small groups of about k+1 (3 to 2k+1) members, a new partition every round.")
@click.option("--rounds", default=40, show_default=True, type=click.IntRange(1, 10_000))
@click.option("--local-steps", default=8, show_default=True, type=click.IntRange(1, 1000),
              help="Local steps between rounds (H).")
@click.option("--lr", default=1e-2, show_default=True, type=click.FloatRange(0, 1, min_open=True),
              help="Adam learning rate of the members' local steps.")
@click.option("--codec", type=click.Choice(["raw", "fp16", "bf16", "int8"]), default="raw", show_default=True,
              help="Part codec (topk and sign need a point every partner holds: gossip has none).")
@click.option("--aggregate", type=click.Choice(["robust", "mean"]), default="robust", show_default=True)
@click.option("--churn", default=0.0, show_default=True, type=click.FloatRange(0, 10),
              help="Fraction of the members that leave per minute of virtual time (as many join).")
@click.option("--timeout-s", default=5.0, show_default=True, type=click.FloatRange(0.01, 600),
              help="A silent partner is departed this long after a member began its round.")
@click.option("--views", type=click.Choice(["own", "shared"]), default="own", show_default=True,
              help="own: each member learns of a join or departure at its own moment, as real peers do; "
                   "shared: all at once (the optimistic bound).")
@click.option("--heartbeat-s", default=1.0, show_default=True, type=click.FloatRange(0, 60),
              help="With --views own: members learn of a departure --timeout-s after it plus up to this, "
                   "of a join up to twice this after it.")
@click.option("--step-ms", default=200.0, show_default=True, type=click.FloatRange(0.1, 1e6),
              help="Virtual compute per local step (median; each member's speed varies).")
@click.option("--rtt-ms", default="10,200", show_default=True, metavar="LO,HI",
              help="Range of a member's round trip (log-uniform).")
@click.option("--rate-mbit", default="10,1000", show_default=True, metavar="LO,HI",
              help="Range of a member's uplink rate (log-uniform).")
@click.option("--attackers", default=0, show_default=True, type=click.IntRange(0, 1023),
              help="Malicious members (the honest run is simulated beside).")
@click.option("--attack", type=click.Choice(["flip", "x8"]), default="flip", show_default=True,
              help="flip: the attacker's update sent reversed; x8: sent 8 times as large.")
@click.option("--target-loss", type=float, default=None,
              help="Rounds and time to this validation CE (default: all-to-all's final CE + 0.02, where it runs).")
@click.option("--eval-every", default=5, show_default=True, type=click.IntRange(1, 10_000))
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--png", "png_path", type=click.Path(dir_okay=False),
              help="Plot consensus distance and loss against rounds here.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Write the results as JSON here.")
def gossip(members, all_sizes, size, rounds, local_steps, lr, codec, aggregate, churn, timeout_s, views, heartbeat_s,
           step_ms, rtt_ms, rate_mbit, attackers, attack, target_loss, eval_every, seed, png_path, json_path):
    """Simulate one block's group of hundreds of members, gossip against all-to-all.

    One process, virtual time: each member's round is the real sans-IO AveragingRound, its small
    group the real partition (rule 10 of the averaging package); links, compute and churn are
    virtual (bench/gossip.py says how). Reports per size the bytes a member sends per round,
    the consensus distance (spread of the members' parameters), the validation CE of the members'
    own models, rounds and virtual time to a target CE, the longest a silent partner held a round.
    """
    from blocktrain.bench import gossip as sim

    from .options import ints, lo_hi

    with _usage_errors():
        sizes, alls = ints(members, "--members"), ints(all_sizes, "--all-to-all")
        sim.check_sizes(sizes, members)
        rtt, rate = lo_hi(rtt_ms, "--rtt-ms"), lo_hi(rate_mbit, "--rate-mbit")
        sim.check_attackers(attackers, sizes)
    base = sim.SimConfig(size=size, rounds=rounds, local_steps=local_steps, lr=lr, codec=codec, aggregate=aggregate,
                         churn=churn, timeout_s=timeout_s, views=views, heartbeat_s=heartbeat_s, step_ms=step_ms,
                         rtt_ms=rtt, rate_mbit=rate, attackers=attackers, attack=attack, eval_every=eval_every,
                         seed=seed)

    def progress(w, name, st):
        if st.loss is not None:
            click.echo(f"  {w:>4} {name:<10} round {st.round:>4}  CE {st.loss:.4f}  consensus {st.consensus_rel:.4f}  "
                       f"{st.bytes_per_member / 1e3:,.0f} kB/member  t {st.time_s:,.1f} s", err=True)

    result = sim.bench(sizes, alls, base, target_loss, progress)
    _echo(sim.report(result))
    if png_path:
        sim.plot(result, png_path)
        click.echo(f"wrote {png_path}")
    _write(json_path, result)


@main.command()
@click.option("--peers", default="2,4", show_default=True, help="Comma-separated group sizes to measure.")
@click.option("--floats", default=50_000_000, show_default=True, type=click.IntRange(1000, 10**10))
@click.option("--rounds", default=4, show_default=True, type=click.IntRange(2, 100))
@click.option("--repeats", default=1, show_default=True, type=click.IntRange(1, 50),
              help="Runs of the whole comparison, one after the other; each is reported.")
@click.option("--codec", type=click.Choice(["raw", "fp16", "bf16", "int8"]), default="raw", show_default=True)
@click.option("--against", default="gloo", show_default=True,
              help="Baselines measured in the same run: gloo, hivemind, gloo,hivemind or none.")
@click.option("--hivemind-python", default=sys.executable, show_default="this Python",
              help="A Python with hivemind 1.1.12 (the compare extra), for --against hivemind.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Write the results as JSON here.")
def average(peers, floats, rounds, repeats, codec, against, hivemind_python, json_path):
    """Same-block averaging: F float32 among N peer processes on loopback, beside gloo all_reduce.

    Each peer process joins the group, connects to every member, then runs --rounds averaging
    rounds (reduce-scatter + all-gather over the sealed protocol, with --codec); the figure is the
    median of the rounds after the first, each taken as its slowest peer's time. gloo: the same
    number of processes and floats through torch.distributed's fp32 all_reduce. hivemind:
    DecentralizedAverager peers on 127.0.0.1, their all-reduce timed after matchmaking. Each of
    --repeats runs measures every group size and baseline again and is reported on its own.
    Targets: at most 1.5x gloo for 2 peers and 2x for more, in every run; at least 5x faster than
    hivemind.
    """
    from . import average as bench_average

    with _usage_errors():
        chosen = bench_average.baselines(against)
    if "hivemind" in chosen:
        why = bench_average.hivemind_missing(hivemind_python)
        if why:
            raise click.ClickException(why)
    with _usage_errors():
        sizes = bench_average.group_sizes(peers)
    try:
        results = bench_average.run_repeats(sizes, floats, rounds, chosen, codec, hivemind_python, repeats,
                                            on_run=lambda r: click.echo(bench_average.run_line(r, repeats)))
    except RuntimeError as e:
        raise click.ClickException(str(e))
    summary = bench_average.summarize(results)
    if repeats > 1:
        _echo(bench_average.summary_lines(summary))
    _write(json_path, bench_average.result(results, summary, sys.argv[1:]))


@main.command()
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Write the summary as JSON here.")
@click.option("--steps", default=1000, show_default=True, type=click.IntRange(10, 10**6),
              help="Optimizer steps per block and for the end-to-end reference (the headline budget).")
@click.option("--d-model", default=192, show_default=True, type=click.IntRange(16, 4096))
@click.option("--n-head", default=6, show_default=True, type=click.IntRange(1, 64))
@click.option("--variants", default=None, help="Comma-separated subset of the variants (default: all).")
@click.option("--jobs", default=2, show_default=True, type=click.IntRange(1, 64),
              help="Variants trained at once, one process and one torch thread each.")
@click.option("--results-dir", default="runs/bench-train", show_default=True, type=click.Path(file_okay=False),
              help="Per-variant JSON and logs; finished variants with the same settings are reused.")
@click.option("--test-windows", default=0, show_default=True, type=click.IntRange(0, 10**6),
              help="Test windows of 128 bytes for CE; 0 = the whole test split.")
@click.option("--quick", is_flag=True, help="A minutes-long check: 60 steps, d_model 64, 50 test windows.")
def train(json_path, steps, d_model, n_head, variants, jobs, results_dir, test_windows, quick):
    """BlockTrain's assembled model against the end-to-end reference, same data and budget.

    Headline: every block gets --steps optimizer steps on as many bytes as the end-to-end
    reference (each worker trains one block), total training FLOPs reported beside it; a second
    figure trains the reference for equal total FLOPs. Also: each head's CE along the chain,
    schedule variants, peak RSS and gradient+optimizer bytes of one block trainer vs the
    reference trainer, and N-byte continuations in one traversal vs byte-by-byte decoding.
    At the default budget this takes tens of minutes per variant: run it in the background.
    """
    from blocktrain.blocks.progress import bar as progress_bar

    from . import train as bench_train

    log = lambda s: click.echo(s, err=True)  # noqa: E731
    steps, base_model, base_train, test_windows = bench_train.settings(steps, d_model, n_head, test_windows, quick)
    with _usage_errors():
        vs = bench_train.select(bench_train.default_variants(base_model), variants)
    out = Path(results_dir)
    with progress_bar("bt-bench train", len(vs), unit="variant", threads=0) as pbar:  # variants run in child processes
        def progress(done, total, running):
            pbar.update(done - pbar.n)
            pbar.set_postfix_str(", ".join(f"{name} {at} steps" for name, at in running.items()))

        results = bench_train.run_variants(vs, steps, base_train, out, jobs, test_windows or None, log=log,
                                           progress=progress)
    summary = bench_train.finish(results, base_model, base_train, steps, vs, out, log=log)
    click.echo(bench_train.table(summary))
    _write(json_path, summary)


@main.command()
@click.option("--sizes", default="tiny,small", show_default=True, metavar="SIZE[,SIZE]",
              help="Named model sizes (as bt-train names them: tiny, small, base), comma-separated.")
@click.option("--device", default="cpu", show_default=True, help="auto, cpu, cuda, cuda:N or mps.")
@click.option("--precision", default="auto", show_default=True,
              help="auto, fp32 or bf16 (auto: bf16 on a CUDA device that supports it, else fp32).")
@click.option("--batch", type=click.IntRange(1), default=None,
              help="Sequences per step (default: the training config's, 16).")
@click.option("--seq", type=click.IntRange(2), default=None,
              help="Bytes per sequence (default: the training config's, 128).")
@click.option("--steps", default=5, show_default=True, type=click.IntRange(1, 1000),
              help="Timed steps per arm (medians are reported), after one counted and 2 warmup steps. "
                   "The default run (tiny and small, 2 idle CPU cores) takes about 2.5 minutes; "
                   "longer when the machine is busy.")
@click.option("--threads", default=2, show_default=True, type=click.IntRange(1, 1024), help="torch threads.")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="Model/training config overrides applied to every size (model.n_layer=6, "
                   "train.slot_branches=0, ...).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Write the results as JSON here.")
def step(sizes, device, precision, batch, seq, steps, threads, overrides, json_path):
    """One block worker's training step against a plain PyTorch loop training the same model end
    to end, on the same device, side by side in one run.

    Per size: the plain loop (EndToEnd, next-byte CE, AdamW, clip) and the block worker of every
    block (BlockTrainer.train_step: frozen blocks below, placeholder branches of its objective),
    their FLOPs per step counted (torch's FLOP counter), median seconds per step with the arms'
    steps interleaved, FLOP/s and training bytes/s; ratio = block worker's FLOP/s / plain loop's.
    Also each block's gradient + optimizer bytes against the end-to-end model's / K plus its
    head's. Targets (on CPU): ratio >= 0.95 at both sizes; memory within that budget.
    """
    from blocktrain.blocks.config import ConfigError
    from blocktrain.blocks.device import DeviceError, pick_device, pick_precision

    from .step import configs, report, run

    try:
        dev = pick_device(device)
        prec = pick_precision(precision, dev)
    except DeviceError as e:
        raise click.BadParameter(str(e), param_hint="--device/--precision")
    try:
        plan = configs([s.strip() for s in sizes.split(",") if s.strip()], overrides, batch, seq)
    except ConfigError as e:
        raise click.BadParameter(str(e), param_hint="--sizes/--set")
    result = run(plan, dev, prec, steps, threads, log=lambda s: click.echo(s, err=True))
    _echo(report(result))
    _write(json_path, result)


@main.command()
@click.option("--fault", "faults", default="partition,one-way,link-down,flap,pause", show_default=True,
              metavar="F[,F]", help="Faults to run, each in a run of its own beside one without faults: "
              "partition, one-way, link-down, flap, pause, loss.")
@click.option("--peers", default=4, show_default=True, type=click.IntRange(2, 16), help="bt-peer processes, one per host.")
@click.option("--steps", default=1500, show_default=True, type=click.IntRange(20, 10**6),
              help="Steps of the block: enough that a side of a partition does not finish it apart.")
@click.option("--hold", "hold_s", default=20.0, show_default=True, type=click.FloatRange(1, 600),
              help="Seconds a partition or a flapping link lasts.")
@click.option("--dead-after", "dead_after_s", default=2.0, show_default=True, type=click.FloatRange(0.5, 120),
              help="The peers' --dead-after (their heartbeat interval is a tenth of it).")
@click.option("--rtt-ms", default=0.0, show_default=True, type=click.FloatRange(0, 2000),
              help="Round trip of every link (the lab's delay relay).")
@click.option("--bound", "bound_s", default=300.0, show_default=True, type=click.FloatRange(30, 7200),
              help="Seconds one run may take; what still runs then is stopped and said so.")
@click.option("--out", default="runs/bench-faults", show_default=True, type=click.Path(file_okay=False))
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Write the results as JSON here.")
def faults(faults, peers, steps, hold_s, dead_after_s, rtt_ms, bound_s, out, json_path):
    """A swarm in network namespaces under the silent faults of a real network (needs root).

    One block trained by --peers bt-peer processes, one per network namespace on one switch; per
    fault a run from fresh processes, beside a run without faults: a partition of the hosts in
    two halves, a one-way partition (the second half's packets to the first vanish), the last
    host's link down for good (no FIN), its link flapping (2 s down, 2 s up), its process paused
    past --dead-after, and (loss, not in the default list) every link shaped to 25 ms and 2% of
    frames lost once, by the peers' own shaper (this kernel has no netem). For each: when the group first shrank, when it was one group again after
    the fault, failed rounds, rounds longer than --dead-after, state fetched again, whether the
    final group's parameters are identical, and each peer's CE beside the run without faults.
    """
    from . import faults as bench_faults

    chosen = [f.strip() for f in faults.split(",") if f.strip()]
    bad = [f for f in chosen if f not in bench_faults.FAULTS]
    if bad or not chosen:
        raise click.BadParameter(f"{', '.join(bad) or 'nothing'}: expected some of {', '.join(bench_faults.FAULTS)}",
                                 param_hint="--fault")
    spec = bench_faults.RunSpec("none", peers, steps, hold_s, dead_after_s, dead_after_s / 10, rtt_ms, bound_s)
    try:
        result = bench_faults.run(chosen, spec, Path(out), log=lambda s: click.echo(s, err=True))
    except RuntimeError as e:
        raise click.ClickException(str(e))
    _echo(bench_faults.report(result["results"]))
    _write(json_path, result)


if __name__ == "__main__":
    main()
