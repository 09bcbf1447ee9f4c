"""``bt-bench``: BlockTrain's benchmarks. Each prints a table and can write JSON (--json PATH)."""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import click

from blocktrain.p2p.serving.api import COMPUTE_SLOTS

from .provenance import write_result


def _emit(result: dict, json_path: str | None, rows: list[tuple]):
    width = max(len(r[0]) for r in rows)
    for name, value in rows:
        click.echo(f"  {name:<{width}}  {value}")
    if json_path:
        write_result(json_path, result)
        click.echo(f"wrote {json_path}")


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
    from .codec import run

    with click.progressbar(length=repeats, label="codec", file=sys.stderr) as bar:
        last = [0]

        def progress(done, total):
            bar.update(done - last[0])
            last[0] = done

        r = run(chunk_mib * 1024 * 1024, repeats, small_frames=small_frames, progress=progress)
    g, q, s, met = r["throughput_gbps"], r["ratios"], r["small_frames_per_s"], r["met"]
    ok = lambda b: "met" if b else "MISSED"  # noqa: E731
    _emit(r, json_path, [
        ("memcpy", f"{g['memcpy']:.2f} GB/s"),
        ("plaintext encode+decode", f"{g['plain']:.2f} GB/s  ({q['plain_vs_memcpy']:.0%} of memcpy, target 50%: "
                                    f"{ok(met['plain_vs_memcpy'])})"),
        ("raw AES-256-GCM enc+dec", f"{g['raw_aes']:.2f} GB/s"),
        ("sealed encode+decode", f"{g['sealed']:.2f} GB/s  ({q['sealed_vs_raw_aes_gcm']:.0%} of raw AES-GCM, "
                                 f"target 60%: {ok(met['sealed_vs_raw_aes_gcm'])})"),
        ("small frames, plaintext", f"{s['plain']:,.0f} /s  (target 100,000: {ok(met['small_frames_plain'])})"),
        ("small frames, sealed", f"{s['sealed']:,.0f} /s  (target 100,000: {ok(met['small_frames_sealed'])})"),
    ])


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
    from .transport import run

    with click.progressbar(length=repeats, label="transport", file=sys.stderr) as bar:
        last = [0]

        def progress(done, total):
            bar.update(done - last[0])
            last[0] = done

        r = run(mib << 20, repeats, pings, progress)
    g, q, m, met = r["throughput_gbps"], r["ratios"], r["median"], r["met"]
    ok = lambda b: "met" if b else "MISSED"  # noqa: E731
    _emit(r, json_path, [
        ("raw socket", f"{g['raw']:.2f} GB/s"),
        ("peers, unsealed", f"{g['plain']:.2f} GB/s ({q['plain_vs_raw']:.0%} of raw, target 60%: {ok(met['plain_vs_raw'])})"),
        ("peers, sealed", f"{g['sealed']:.2f} GB/s ({q['sealed_vs_raw']:.0%} of raw, target 40%: {ok(met['sealed_vs_raw'])})"),
        ("raw asyncio ping-pong", f"{m['raw_pingpong_us']:.0f} us"),
        ("peers' Ping/Pong", f"{m['peer_ping_us']:.0f} us ({q['peer_ping_vs_raw_pingpong']:.1f}x raw, target <= 2x: "
                             f"{ok(met['peer_ping'])})"),
    ])


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
    from pathlib import Path

    from .wan import MODES, compare

    log = lambda s: click.echo(s, err=True)  # noqa: E731
    given = bool(modes)
    modes = tuple(m.strip() for v in modes for m in v.split(",") if m.strip())
    if given and not modes:
        raise click.BadParameter("name at least one mode: blocktrain, exact or autoregressive", param_hint="--mode")
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise click.BadParameter(f"{', '.join(unknown)}: expected blocktrain, exact or autoregressive", param_hint="--mode")
    if (kernel or sweep) and modes:
        raise click.UsageError("--mode selects the modes of a plain run, not of --kernel (blocktrain and "
                               "autoregressive) or --sweep (all three)")
    modes = tuple(m for m in MODES if m in modes) or MODES  # the order of MODES, whatever the order given
    if kernel and split != "test":
        raise click.UsageError("--split applies to the plain run and --sweep; --kernel has prompts of its own")
    if (kernel or sweep) and temperature:
        raise click.UsageError("--temperature applies to the plain run only")
    if (kernel or sweep) and clients > 1:
        raise click.UsageError("--clients applies to the plain run only")
    if clients > 1 and set(modes) <= {"blocktrain"}:
        raise click.UsageError("--clients runs exact and autoregressive at once: name one of them with --mode")
    if clients > prompts:
        raise click.BadParameter(f"{clients} clients need --prompts {clients} or more: each client's time alone is "
                                 "measured on its own prompt first", param_hint="--clients")
    try:
        sizes = tuple(int(b) for b in batches.split(","))
    except ValueError:
        raise click.BadParameter(f"{batches!r}: expected sizes such as 8 or 8,1", param_hint="--batch") from None
    if not all(1 <= b <= 64 for b in sizes) or len(set(sizes)) != len(sizes):
        raise click.BadParameter(f"{batches!r}: distinct sizes in 1..64", param_hint="--batch")
    if batches != str(COMPUTE_SLOTS) and clients < 2:
        raise click.UsageError("--batch applies to --clients (one client's traversals are a batch of one)")
    if kernel:
        from .netns import available
        from .wan_kernel import run_kernel
        why = available()
        if why:
            raise click.ClickException(f"--kernel: {why}")
        result = run_kernel(n_bytes, rtt_ms, rate_mbit, 3, 192, 2, repeats, None, log=log)
        for m in ("blocktrain", "autoregressive"):
            r = result[m]
            click.echo(f"{m + ':':<16}{r['seconds']:.3f} s, {r['traversals']:.0f} traversal(s), bound {r['bound_s']:.3f} s "
                       f"({r['vs_bound']:.2f}x){' (extrapolated)' if r['extrapolated'] else ''}")
    elif sweep:
        rows = []
        for rtt in (0.0, 50.0, 200.0):
            for n in (16, 64, 256):
                r = compare(checkpoints, n, rtt, rate_mbit, prompts, 1, ar_bytes=32, split=split)
                rows.append(r)
                log(f"N {n:4d} RTT {rtt:4.0f} ms: exact {r['exact']['seconds']:.2f} s "
                    f"({r['exact']['bytes_per_traversal']:.1f} B/traversal), autoregressive "
                    f"{r['autoregressive']['seconds']:.2f} s{' (extrapolated)' if r['autoregressive']['extrapolated'] else ''}, "
                    f"exact speedup {r['speedup_exact_vs_autoregressive']:.1f}x")
        Path(out).mkdir(parents=True, exist_ok=True)
        _plot_sweep(rows, Path(out) / "sweep.png")
        result = {"benchmark": "wan-sweep", "rate_mbit": rate_mbit, "rows": rows, "plot": str(Path(out) / "sweep.png")}
    else:
        from blocktrain.blocks.progress import bar as progress_bar

        together = len([m for m in modes if m != "blocktrain"]) * repeats * len(sizes) if clients > 1 else 0
        with progress_bar("bt-bench wan", len(modes) * prompts * repeats + together, unit="request",
                          threads=0) as pbar:  # it mostly waits on the emulated links
            def progress(what):
                pbar.set_postfix_str(what)
                pbar.update(1)

            result = {"benchmark": "wan", **compare(checkpoints, n_bytes, rtt_ms, rate_mbit, prompts, repeats,
                                                    log=log, progress=progress, modes=modes, split=split,
                                                    temperature=temperature, clients=clients, batches=sizes)}
        for m in (m for m in ("exact", "autoregressive", "blocktrain") if m in modes):
            r = result[m]
            extra = ""
            if m == "exact":
                extra = f", {r['bytes_per_traversal']:.1f} bytes/traversal" + (
                    f", identical to autoregressive: {r['identical_prompts']}" if "identical_prompts" in r else "")
            if m == "blocktrain":
                q = r["quality"]["ce_per_offset"]
                extra = ("; NOT the same output: CE of the true text per offset "
                         + ", ".join(f"{o}: {v:.2f}" for o, v in q.items()) + " nats/byte")
            click.echo(f"{m + ':':<16}{r['seconds']:.3f} s, {r['traversals']:.0f} traversal(s), "
                       f"{r['bytes_moved']:,.0f} B, bound {r['bound_s']:.3f} s ({r['vs_bound']:.2f}x){extra}")
        if "speedup_exact_vs_autoregressive" in result:
            per = result["speedup_per_prompt"]
            spread = f" (per prompt: median {per['median']:.1f}x, {per['min']:.1f}x-{per['max']:.1f}x)"
            if temperature == 0:
                click.echo(f"exact vs autoregressive at identical output: {result['speedup_exact_vs_autoregressive']:.1f}x"
                           f"{spread} (target >= 3: "
                           f"{'met' if result['targets']['speedup_exact_vs_autoregressive >= 3'] else 'MISSED'})")
            else:
                met = result["targets"]["speedup_exact_vs_autoregressive >= 2 (sampled)"]
                click.echo(f"exact vs autoregressive, both sampled at T {temperature}: "
                           f"{result['speedup_exact_vs_autoregressive']:.1f}x{spread} (target >= 2: "
                           f"{'met' if met else 'MISSED'})")
            click.echo("continuations repeating a 16-gram: " + ", ".join(
                f"{m} {result[m]['continuations_repeating_a_16gram']}" for m in modes if m != "blocktrain"))
        if "speedup_blocktrain_vs_autoregressive" in result:
            click.echo(f"blocktrain vs autoregressive (not the same output): "
                       f"{result['speedup_blocktrain_vs_autoregressive']:.1f}x")
        for clients_run in result.get("clients_by_batch", {"": result.get("clients", {})}).values():
            at = f", batch {clients_run['batch']}" if "clients_by_batch" in result else ""
            if "error" in clients_run:
                click.echo(f"{clients} clients at once{at}: {clients_run['error']}")
            for m, c in ((m, c) for m, c in clients_run.items() if isinstance(c, dict)):
                if "error" in c:
                    click.echo(f"{clients} clients at once{at}, {m}: {c['error']}")
                    continue
                click.echo(f"{clients} clients at once{at}, {m}: {c['aggregate_bytes_per_s']:.1f} B/s in all, "
                           f"{c['aggregate_vs_one_client']:.1f}x one client's; each client's time "
                           f"{c['slowdown']['median']:.2f}x its time alone (median), {c['slowdown']['max']:.2f}x "
                           f"(worst); output as alone: {c['outputs_identical_to_alone']}")
        click.echo(f"links: {result['links']}")
    if json_path:
        write_result(json_path, result)
        click.echo(f"wrote {json_path}")


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
    from .shape import Device, Shape, load_measured, project

    try:
        result = project(load_measured(measured_path), Shape(params=params, hidden=hidden, hops=hops), Device(),
                         rtt_ms, rate_mbit, source=str(measured_path))
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    sh, ln = result["shape"], result["links"]
    click.echo(f"PROJECTION (no model of this shape was run): {sh['params'] / 1e9:.2f}B parameters, hidden "
               f"{sh['hidden']} (assumed), {sh['hops']} hops of {sh['hop_params'] / 1e9:.2f}B on "
               f"{result['device']['name']} peak rates; links {ln['rtt_ms']:g} ms RTT, {ln['rate_mbit']:g} Mbit/s; "
               f"from {measured_path} (d {result['measured']['d_model']}, T {result['measured']['temperature']})")
    for m in (m for m in ("exact", "autoregressive", "blocktrain") if m in result):
        r = result[m]
        click.echo(f"{m + ':':<16}{r['seconds']:8.2f} s = links {r['latency_s']:.2f} s + serialization "
                   f"{r['serialization_s']:.2f} s + compute {r['compute_s']:.2f} s ({r['hop_pass_bound_by']}-bound); "
                   f"{r['traversals']:.1f} traversals, {r['bytes_moved'] / 1e6:.1f} MB")
    for k, what in (("speedup_exact_vs_autoregressive", "exact vs autoregressive"),
                    ("speedup_blocktrain_vs_autoregressive", "blocktrain vs autoregressive (not the same output)")):
        if k in result:
            click.echo(f"{what}: {result[k]:.1f}x")
    if json_path:
        write_result(json_path, result)
        click.echo(f"wrote {json_path}")


def _plot_sweep(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for rtt in sorted({r["rtt_ms"] for r in rows}):
        sel = [r for r in rows if r["rtt_ms"] == rtt]
        ax.plot([r["n_bytes"] for r in sel], [r["speedup_exact_vs_autoregressive"] for r in sel], "o-",
                label=f"exact, RTT {rtt:.0f} ms")
    ax.axhline(3, color="k", ls="--", label="3x (target at N=256, RTT 50 ms)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("output bytes N")
    ax.set_ylabel("autoregressive time / exact time")
    ax.set_title("Exact mode (identical output) vs one traversal per byte")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


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
@click.option("--sync", type=click.Choice(["grads", "params"]), default=None, help="Default: grads.")
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

    sw = {k: v for k, v in (("schedule", schedule), ("sync", sync), ("every", every), ("codec", codec),
                            ("density", density), ("outer_lr", outer_lr), ("overlap", overlap or None)) if v is not None}
    if (every or overlap) and not sync:
        sw["sync"] = "params"
    try:
        bench = bench_swarm.Bench(
            workers=[int(w) for w in workers.split(",")], steps=steps, seeds=[int(x) for x in seeds.split(",")],
            compare=[c.strip() for c in compare.split(",") if c.strip()], overrides=parse_set(overrides),
            out=Path(out), swarm=sw, test_windows=test_windows, link=link if wan else None, eval_every=eval_every,
            resume=resume, target_ce=target_ce, reference=reference, equal_total_lr=equal_total_lr)
    except (ConfigError, ValueError) as e:
        raise click.BadParameter(str(e), param_hint="--set/--workers/--seeds/--compare")
    try:
        result = bench.execute(save=(lambda r: _write_json(json_path, r)) if json_path else None,
                               bar=functools.partial(progress_bar, threads=0),  # the work runs in bt-peer processes
                               log=lambda s: click.echo(s, err=True))
    except bench_swarm.BenchError as e:
        raise click.ClickException(str(e))
    if "sync" in bench.compare:  # test CE against GB sent, for every run
        result["plot"] = str(Path(out) / "ce_vs_gb.png")
        bench_swarm.plot_ce_vs_gb(result, Path(result["plot"]))
        if json_path:
            _write_json(json_path, result)
    for line in _swarm_table(result, bench.K):
        click.echo(line)
    if "plot" in result:
        click.echo(f"wrote {result['plot']}")
    if json_path:
        click.echo(f"wrote {json_path}")


def _ints(text: str, name: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise click.BadParameter(f"{text!r}: expected comma-separated integers", param_hint=name) from None
    return vals


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

    sizes, alls = _ints(members, "--members"), _ints(all_sizes, "--all-to-all")
    if not sizes or any(not 4 <= w <= 1024 for w in sizes):
        raise click.BadParameter(f"{members!r}: sizes of 4..1024 members", param_hint="--members")
    ranges = {}
    for name, text in (("--rtt-ms", rtt_ms), ("--rate-mbit", rate_mbit)):
        try:
            lo, hi = (float(x) for x in text.split(","))
        except ValueError:
            raise click.BadParameter(f"{text!r}: expected LO,HI", param_hint=name) from None
        if not 0 < lo <= hi:
            raise click.BadParameter(f"{text!r}: expected 0 < LO <= HI", param_hint=name)
        ranges[name] = (lo, hi)
    if attackers and attackers >= min(sizes):
        raise click.BadParameter(f"{attackers} attackers need more members than that", param_hint="--attackers")
    base = sim.SimConfig(size=size, rounds=rounds, local_steps=local_steps, lr=lr, codec=codec, aggregate=aggregate,
                         churn=churn, timeout_s=timeout_s, views=views, heartbeat_s=heartbeat_s, step_ms=step_ms,
                         rtt_ms=ranges["--rtt-ms"], rate_mbit=ranges["--rate-mbit"], attackers=attackers,
                         attack=attack, eval_every=eval_every, seed=seed)

    def progress(w, name, st):
        if st.loss is not None:
            click.echo(f"  {w:>4} {name:<10} round {st.round:>4}  CE {st.loss:.4f}  consensus {st.consensus_rel:.4f}  "
                       f"{st.bytes_per_member / 1e3:,.0f} kB/member  t {st.time_s:,.1f} s", err=True)

    result = sim.bench(sizes, alls, base, target_loss, progress)
    click.echo(f"{'members':>7} {'run':<11} {'kB/member/round':>15} {'consensus':>9} {'CE':>7} {'to target':>9} "
               f"{'time s':>8} {'blocked s':>9}")
    for s in result["sizes"]:
        for name, run in [("gossip", s), *((k, s[k]) for k in ("all_to_all", "honest") if k in s)]:
            click.echo(f"{s['members']:>7} {name:<11} {run['bytes_per_member_per_round'] / 1e3:>15,.1f} "
                       f"{run['consensus_distance']:>9.4f} {run['loss']:>7.4f} {str(run['rounds_to_target']):>9} "
                       f"{run['time_s']:>8.1f} {run['max_blocked_s']:>9.2f}")
    click.echo(f"per-member bytes, largest / smallest size: {result['bytes_spread']:.2f}x")
    if png_path:
        sim.plot(result, png_path)
        click.echo(f"wrote {png_path}")
    if json_path:
        write_result(json_path, result)
        click.echo(f"wrote {json_path}")


def _write_json(path, result: dict) -> None:
    write_result(path, result)


def _swarm_table(result: dict, K: int) -> list[str]:
    lines = [f"{'run':<18} {'seeds':>5} " + " ".join(f"{'head ' + str(k):>14}" for k in range(K))
             + f" {'busy min':>8} {'wall s':>8} {'MB/worker':>9}"]
    for key, s in result["summary"].items():
        lines.append(f"{key:<18} {len(s['seeds']):>5} " + " ".join(
            f"{m:>7.4f}+-{sd:<5.3f}" for m, sd in zip(s["head_test_ce"], s["head_test_ce_sd"]))
            + f" {s['busy_fraction']['min']:>8.0%} {s['train_seconds']['mean']:>8.0f} "
            f"{s['bytes_per_worker']['mean'] / 1e6:>9.1f}")
    if "in_process_sequential" in result:
        ref = result["in_process_sequential"]
        lines.append(f"{'in-process seq.':<18} {len(result['seeds']):>5} " + " ".join(
            f"{c:>14.4f}" for c in ref["head_test_ce"]) + f"  (batch {ref['batch_size']})")
        lines.append(f"one worker per block against it: top head {ref['one_per_block_gap']:+.4f} "
                     f"({'within' if ref['one_per_block_within_0_02'] else 'not within'} 0.02)")
    for w, c in (result.get("sync_comparison") or {}).items():
        lines.append(f"{w} workers, {c['mode']} against every-step averaging: "
                     + (f"{c['bytes_ratio']:.0f}x fewer bytes per worker" if c["bytes_ratio"] else "no bytes")
                     + f", top-head test CE {c['ce_gap']:+.4f}")
    if result["target_ce"] is not None:
        lines.append(f"to valid CE {result['target_ce']:g} (training seconds / global step, per seed; '-': not reached):")
        for key, s in result["summary"].items():
            lines.append(f"  {key:<16} " + ", ".join(
                "-" if t is None else f"{t:.0f} s / step {n}" for t, n in zip(s["time_to_target_s"], s["steps_to_target"])))
    return lines


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
    from .average import hivemind_missing, run, summarize

    baselines = tuple(b for b in against.split(",") if b and b != "none")
    unknown = set(baselines) - {"gloo", "hivemind"}
    if unknown:
        raise click.BadParameter(f"unknown baseline(s) {sorted(unknown)}", param_hint="--against")
    if "hivemind" in baselines:
        why = hivemind_missing(hivemind_python)
        if why:
            raise click.ClickException(why)
    try:
        sizes = [int(x) for x in peers.split(",")]
    except ValueError:
        raise click.BadParameter(f"{peers!r}: expected comma-separated group sizes, e.g. 2,4", param_hint="--peers")
    if any(n < 2 for n in sizes):
        raise click.BadParameter("a group has at least 2 peers", param_hint="--peers")
    results = []
    for rep in range(repeats):
        for n in sizes:
            try:
                r = run(n, floats, rounds, baselines, codec, hivemind_python=hivemind_python)
            except RuntimeError as e:
                raise click.ClickException(str(e))
            r["repeat"] = rep + 1
            results.append(r)
            line = (f"run {rep + 1}/{repeats}: {n} peers, {floats:,} floats ({codec}): {r['blocktrain_s']:.3f} s, "
                    f"coverage {r['coverage']:.0%}")
            if "gloo_s" in r:
                line += (f"; gloo {r['gloo_s']:.3f} s: {r['vs_gloo']:.2f}x gloo (target <= {r['gloo_target']:g}x: "
                         f"{'met' if r['within_gloo_target'] else 'MISSED'})")
            if "hivemind_s" in r:
                line += (f"; hivemind {r['hivemind_s']:.3f} s: {r['vs_hivemind']:.1f}x faster (target >= 5x: "
                         f"{'met' if r['faster_than_hivemind_target'] else 'MISSED'})")
            click.echo(line)
    summary = summarize(results)
    if repeats > 1:
        for n, s in summary.items():
            line = f"{n} peers over {s['runs']} runs: median {s['median_blocktrain_s']:.3f} s"
            if "vs_gloo" in s:
                every = "yes" if s["every_run_within_gloo_target"] else "NO"
                line += (f", vs gloo median {s['median_vs_gloo']:.2f}x, worst {s['worst_vs_gloo']:.2f}x "
                         f"(every run within {s['gloo_target']:g}x: {every})")
            if "vs_hivemind" in s:
                line += f", vs hivemind worst {s['worst_vs_hivemind']:.1f}x faster"
            click.echo(line)
    if json_path:
        write_result(json_path, {"benchmark": "average", "argv": sys.argv[1:], "runs": results, "summary": summary})
        click.echo(f"wrote {json_path}")


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
    from pathlib import Path

    from .train import default_variants, measure_memory, plot, run_variants, summarize, table

    if quick:
        steps, d_model, n_head, test_windows = 60, 64, 2, test_windows or 50
    base_model = {"d_model": d_model, "n_head": n_head}
    base_train = {"steps": steps, "decay_frac": 0.2, "warmup": max(5, min(50, steps // 10)),
                  "eval_every": max(10, steps // 10)}
    vs = default_variants(base_model)
    if variants:
        want = [v.strip() for v in variants.split(",")]
        unknown = set(want) - {v.name for v in vs}
        if unknown:
            raise click.BadParameter(f"unknown variants {sorted(unknown)}; known: {[v.name for v in vs]}")
        vs = [v for v in vs if v.name in want]
    out = Path(results_dir)
    from blocktrain.blocks.progress import bar as progress_bar

    with progress_bar("bt-bench train", len(vs), unit="variant", threads=0) as pbar:  # variants run in child processes
        def progress(done, total, running):
            pbar.update(done - pbar.n)
            pbar.set_postfix_str(", ".join(f"{name} {at} steps" for name, at in running.items()))

        results = run_variants(vs, steps, base_train, out, jobs, test_windows or None,
                               log=lambda s: click.echo(s, err=True), progress=progress)
    click.echo("measuring memory of each trainer alone...", err=True)
    memory = measure_memory({**base_model, "head_layers": 1}, {**base_train, "steps": 5})
    summary = summarize(results, memory, steps, vs)
    plot(results, out / "curves.png")
    summary["plot"] = str(out / "curves.png")
    click.echo(table(summary))
    if json_path:
        write_result(json_path, summary)
        click.echo(f"wrote {json_path}")


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

    from .step import configs, run

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
    click.echo(f"{result['device']}, {threads} thread(s), median of {steps} timed step(s) per arm")
    click.echo(f"{'size':<6} {'arm':<8} {'GFLOP/step':>10} {'s/step':>8} {'GFLOP/s':>8} {'bytes/s':>9} "
               f"{'ratio':>6} {'grad+optim MB':>13} {'budget MB':>9}")
    for s in result["sizes"]:
        p = s["plain"]
        click.echo(f"{s['size']:<6} {'plain':<8} {p['flops_per_step'] / 1e9:>10.2f} {p['seconds_per_step']:>8.3f} "
                   f"{p['flops_per_s'] / 1e9:>8.2f} {p['bytes_per_s']:>9,.0f} {'':>6} "
                   f"{p['grad_optim_bytes'] / 1e6:>13.1f}")
        for b in s["blocks"]:
            click.echo(f"{s['size']:<6} {'block ' + str(b['block']):<8} {b['flops_per_step'] / 1e9:>10.2f} "
                       f"{b['seconds_per_step']:>8.3f} {b['flops_per_s'] / 1e9:>8.2f} {b['bytes_per_s']:>9,.0f} "
                       f"{b['ratio']:>6.3f} {b['grad_optim_bytes'] / 1e6:>13.1f} "
                       f"{b['grad_optim_budget_bytes'] / 1e6:>9.1f}{'' if b['within_budget'] else ' OVER'}")
    ok = lambda b: "met" if b else "MISSED"  # noqa: E731
    for name, met in result["targets"].items():
        click.echo(f"target {name}: {ok(met)}")
    if json_path:
        write_result(json_path, result)
        click.echo(f"wrote {json_path}")


if __name__ == "__main__":
    main()
