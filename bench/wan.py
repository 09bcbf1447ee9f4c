"""``bt-bench wan``: one output sequence across a chain of peers on WAN-like links, three modes.

All modes run the same trained blocks on the same peers, links and codec (bf16 hidden states),
for the same prompts (64-byte windows of the WikiText-2 test split):

- ``exact``: each traversal verifies the last one's draft and proposes the next; its greedy
  output is checked, in the run, to be the autoregressive output byte for byte.
- ``autoregressive``: one traversal per byte, a KV cache per hop and session.
- ``blocktrain``: one traversal for the whole output (prompt + placeholders); its quality is
  stated beside its time: the CE of the true continuation per offset, against the model's own
  next-byte CE.

``clients`` > 1: after the modes ran one prompt at a time, that many clients (each its own
identity and connections) run exact and autoregressive at once, client j on prompt j; each
client's time beside its time alone (the same prompt, measured just before), the aggregate
output bytes per second beside one client's, and whether each output is the one it wrote alone.

Links are the in-process link shaper (one-way delay = RTT/2 on every link, rate limit), the only
delay that works on machines without netem; the report says so. The physical bound of a run is:
traversals x links x one-way delay + the serialization of every frame sent at the link rate +
the compute the peers measured.
"""

from __future__ import annotations

import asyncio
import os
import resource
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from blocktrain.blocks.decode import CHUNK, Sampling, one_traversal_spec
from blocktrain.blocks.config import ModelConfig
from blocktrain.p2p.serving.client import PipelineClient
from blocktrain.p2p.link import LinkSpec
from blocktrain.p2p.node import Peer
from blocktrain.p2p.serving.server import PipelineServer, ServedBlocks, load_served
from blocktrain.p2p.serving.api import COMPUTE_SLOTS
from blocktrain.p2p.transport import Timeouts

from .options import BadOption, OptionError
from .report import verdict

PROMPT_LEN = 64
MODES = ("blocktrain", "exact", "autoregressive")
# The sampled target (sampling moves the bytes, so no identity check): overall, and the worst prompt.
SAMPLED_TARGET = "speedup_exact_vs_autoregressive >= 3 (sampled), every prompt >= 2"


def test_prompts(n: int, n_bytes: int, seed: int = 0, split: str = "test") -> list[tuple[bytes, bytes]]:
    """``n`` (prompt, true continuation) pairs: 64-byte windows of ``split`` at evenly spread
    offsets, each followed by ``n_bytes`` of the text."""
    from blocktrain.blocks.data import read_split
    text = read_split(split)
    span = PROMPT_LEN + n_bytes
    step = max(1, (len(text) - span) // max(1, n))
    return [(text[i:i + PROMPT_LEN], text[i + PROMPT_LEN:i + span]) for i in range(seed, seed + step * n, step)][:n]


def _sent_bytes(peers, client) -> int:
    """Wire bytes sent so far by every peer (to members and to the client) and by the client."""
    return sum(p.traffic_totals()["sent"]["wire_bytes"] for p in peers) + client.sent_wire_bytes()


def _bound(traversals: float, hops: int, link: LinkSpec, moved: float, compute: float) -> float:
    return traversals * (hops + 1) * link.delay_ms / 1e3 + link.serialization_s(moved) + compute


@dataclass
class _Chain:
    """The served chain of a run: one peer per hop on the same links, their servers, one client."""

    hops: int
    max_seq_len: int
    link: LinkSpec
    psk: bytes
    tmo: Timeouts
    peers: list = field(default_factory=list)
    servers: list = field(default_factory=list)
    client: PipelineClient | None = None


def _load_model(checkpoints: str | Path | None, n_bytes: int) -> tuple[ServedBlocks, ModelConfig]:
    """Every block of the model, and its config; refused when the prompt and output overrun it."""
    served = load_served([0], checkpoints, check_rows=False)  # the model's shape
    cfg = next(iter(served.blocktrain.values())).cfg
    served = load_served(list(range(cfg.n_blocks)), checkpoints)
    if PROMPT_LEN + n_bytes - 1 > cfg.max_seq_len:
        raise ValueError(f"a {PROMPT_LEN}-byte prompt + {n_bytes} bytes needs {PROMPT_LEN + n_bytes - 1} positions; "
                         f"the model has {cfg.max_seq_len}")
    return served, cfg


async def _start_chain(served: ServedBlocks, cfg: ModelConfig, link: LinkSpec, batch: int) -> _Chain:
    """A peer per block on ``link``, each serving its block with hops' ``batch``, and the client."""
    chain = _Chain(hops=cfg.n_blocks, max_seq_len=cfg.max_seq_len, link=link, psk=os.urandom(32),
                   tmo=Timeouts(connect_s=30, handshake_s=30, heartbeat_s=5, dead_after_s=600))
    for k in range(chain.hops):
        p = await Peer(X25519PrivateKey.generate(), chain.psk, "127.0.0.1", 0, blocks=(k,), role="serve",
                       timeouts=chain.tmo, links={"default": link, "links": {}}).start()
        if chain.peers:
            await p.join("127.0.0.1", chain.peers[0].port)
        b = served.blocktrain[k]
        chain.servers.append(PipelineServer(p, ServedBlocks({k: b}, batch=batch, rows={b: served.rows[b]})))
        chain.peers.append(p)
    chain.client = PipelineClient(X25519PrivateKey.generate(), chain.psk, [p.addr for p in chain.peers],
                                  list(range(chain.hops)), chain.tmo, link, codec="bf16", timeout_s=600)
    return chain


async def _warm_up(chain: _Chain, prompt: bytes) -> None:
    """The client's connections, those between hops (handshakes are not part of a request) and
    one short request."""
    assert chain.client is not None
    await chain.client.connect()
    for p in chain.peers:
        for q in chain.peers:
            if q is not p:
                await p.connection(q.addr)
    await chain.client.generate(prompt, 2, "exact", max_seq_len=chain.max_seq_len)  # warm-up


async def _time_mode(chain: _Chain, mode: str, pairs, n_run: int, repeats: int, temperature: float,
                     progress) -> tuple[list[dict], list[bytes]]:
    """Every prompt's requests in ``mode``, ``repeats`` each: their stats (bytes sent added) and
    each prompt's first output."""
    client = chain.client
    assert client is not None
    runs, texts = [], []
    for i, (prompt, _) in enumerate(pairs):
        for r in range(repeats):
            before = _sent_bytes(chain.peers, client)
            text, st = await client.generate(prompt, n_run, mode, max_seq_len=chain.max_seq_len,
                                             sampling=Sampling(temperature, seed=i))
            st["bytes"] = _sent_bytes(chain.peers, client) - before
            runs.append(st)
            if r == 0:
                texts.append(text)
            progress(f"{mode}, prompt {i + 1}/{len(pairs)}: {runs[-1]['seconds']:.2f} s, "
                     f"{runs[-1]['traversals']} traversal(s)")
    return runs, texts


def _mode_figures(runs: list[dict], texts: list[bytes], hops: int, link: LinkSpec, n_bytes: int, n_run: int) -> dict:
    """One mode's figures: medians over its requests, scaled from ``n_run`` measured bytes to
    ``n_bytes``, beside its physical bound."""
    med = lambda k: statistics.median(r[k] for r in runs)  # noqa: E731
    scale = n_bytes / n_run
    secs, moved, compute, trav = med("seconds"), med("bytes"), med("compute_s"), med("traversals")
    bound = _bound(trav, hops, link, moved, compute)
    return {"seconds": secs * scale, "traversals": trav * scale, "bound_s": bound * scale,
            "vs_bound": secs / bound if bound else None, "bytes_moved": moved * scale,
            "compute_s": compute * scale, "bytes_per_traversal": n_run / trav,
            "measured_bytes": n_run, "extrapolated": scale != 1.0,
            # computed by every hop, all traversals (the prompt once, the output scaled)
            "positions": PROMPT_LEN + (med("positions") - PROMPT_LEN) * scale,
            "seconds_per_prompt": [r["seconds"] for r in runs],
            # output as it comes (not scaled): when the first byte was accepted, beside one traversal's time
            "first_byte_s": statistics.median(r["first_byte_s"] for r in runs if r.get("first_byte_s") is not None)
            if any(r.get("first_byte_s") is not None for r in runs) else None,
            "seconds_per_traversal": secs / trav if trav else None,
            "arrivals_first_prompt": runs[0].get("arrivals"),  # [seconds, bytes so far] per traversal
            "continuations_repeating_a_16gram": f"{sum(map(repeats_16gram, texts))}/{len(texts)}"}


def _judge_exact(out: dict, outputs: dict, n_bytes: int, n_prompts: int, temperature: float) -> None:
    """With exact and autoregressive both run: whether exact wrote autoregressive's output
    (greedy) or what its output is (sampled), and exact's speedup, overall and per prompt."""
    if temperature > 0:
        out["exact"]["output"] = ("sampled: distributed as autoregressive sampling, not the same bytes "
                                  "(tests/test_decode.py's statistical test)")
    if temperature == 0:
        n_cmp = min(len(outputs["autoregressive"][0]), n_bytes)
        same = sum(e[:n_cmp] == a[:n_cmp] for e, a in zip(outputs["exact"], outputs["autoregressive"]))
        if n_cmp == n_bytes:  # every byte compared
            out["exact"]["identical_to_autoregressive"] = same == n_prompts
        else:  # the autoregressive run was shortened: only its prefix can be compared
            out["exact"]["identical_prefix_bytes"] = n_cmp if same == n_prompts else 0
        out["exact"]["identical_prompts"] = f"{same}/{n_prompts} (first {n_cmp} bytes)"
    out["speedup_exact_vs_autoregressive"] = out["autoregressive"]["seconds"] / out["exact"]["seconds"]
    out["speedup_extrapolated"] = out["autoregressive"]["extrapolated"]
    per = sorted(a / e for a, e in zip(out["autoregressive"]["seconds_per_prompt"],
                                       out["exact"]["seconds_per_prompt"]))
    out["speedup_per_prompt"] = {"median": statistics.median(per), "min": per[0], "max": per[-1],
                                 "note": "same prompt and repeat, unscaled (an extrapolated run is shorter)"}


async def _clients_by_batch(chain: _Chain, clients: int, batches: tuple[int, ...], pairs, n_bytes: int,
                            modes, repeats: int, temperature: float, alone: dict, outputs: dict,
                            progress) -> dict:
    """``clients`` at once (``_together``), once per hops' batch size: the figures by size."""
    by_batch = {}
    for b in batches:
        try:
            for srv in chain.servers:  # fresh fair queues: each size starts with no client known
                srv.set_batch(b)
        except RuntimeError as e:  # a traversal of the size before still in flight
            by_batch[str(b)] = {"clients": clients, "batch": b, "error": str(e)}
            continue
        by_batch[str(b)] = await _together(clients, [p.addr for p in chain.peers], chain.psk, chain.tmo, chain.link,
                                           pairs, n_bytes, chain.max_seq_len, [m for m in modes if m != "blocktrain"],
                                           repeats, temperature, alone, outputs, progress, b)
    return by_batch


async def run(checkpoints: str | Path | None, n_bytes: int, rtt_ms: float, rate_mbit: float, prompts: int = 3,
              repeats: int = 1, modes=MODES, threads: int = 1, log=lambda s: None, ar_bytes: int | None = None,
              progress=lambda s: None, split: str = "test", temperature: float = 0.0, clients: int = 1,
              batches: tuple[int, ...] = (COMPUTE_SLOTS,)) -> dict:
    """Every mode on the same chain, prompts and links; medians over prompts x repeats; then, with
    ``clients`` > 1, that many clients at once (``_together``), once per batch size of
    ``batches`` (the hops' ``--batch``, the first one's run is ``clients``, every one's in
    ``clients_by_batch``).

    ``temperature`` > 0: exact and autoregressive sample (prompt i with seed i), each output
    distributed as autoregressive sampling but not the same bytes (no identity check: the
    statistical test of tests/test_decode.py is what holds it); blocktrain samples its one
    traversal.

    ``ar_bytes``: time autoregressive decoding on this many bytes and scale to ``n_bytes``
    (labelled ``extrapolated``; the sweep uses it); exact output is then checked against that
    prefix only."""
    torch.set_num_threads(threads)
    served, cfg = _load_model(checkpoints, n_bytes)
    chain = await _start_chain(served, cfg, LinkSpec(delay_ms=rtt_ms / 2, rate_mbit=rate_mbit), batches[0])
    client = chain.client
    assert client is not None
    pairs = test_prompts(prompts, n_bytes, split=split)
    out: dict = {"n_bytes": n_bytes, "rtt_ms": rtt_ms, "rate_mbit": rate_mbit, "hops": chain.hops,
                 "prompts": len(pairs), "split": split, "temperature": temperature,
                 "repeats": repeats, "model": cfg.to_dict(), "checkpoints": str(checkpoints or "shipped model"),
                 "links": "in-process link shaper (per-frame serialization at the rate, then one-way delay)",
                 "numerics": "exact and autoregressive both batch-invariant (what makes their output identical); "
                             "the one-traversal mode plain"}
    try:
        await _warm_up(chain, pairs[0][0])
        outputs: dict[str, list[bytes]] = {}
        alone: dict[str, list[float]] = {}  # per prompt: the median of its repeats, one client
        for mode in modes:
            n_run = min(n_bytes, ar_bytes) if mode == "autoregressive" and ar_bytes else n_bytes
            runs, outputs[mode] = await _time_mode(chain, mode, pairs, n_run, repeats, temperature, progress)
            alone[mode] = [statistics.median(r["seconds"] for r in runs[i * repeats:(i + 1) * repeats])
                           for i in range(len(pairs))]
            out[mode] = _mode_figures(runs, outputs[mode], chain.hops, chain.link, n_bytes, n_run)
        if "exact" in outputs and "autoregressive" in outputs:
            _judge_exact(out, outputs, n_bytes, len(pairs), temperature)
        if "blocktrain" in outputs:
            out["blocktrain"]["quality"] = await _one_traversal_quality(client, pairs, n_bytes)
            if "autoregressive" in outputs:
                out["speedup_blocktrain_vs_autoregressive"] = (out["autoregressive"]["seconds"]
                                                               / out["blocktrain"]["seconds"])
        if clients > 1:
            by_batch = await _clients_by_batch(chain, clients, batches, pairs, n_bytes, modes, repeats, temperature,
                                               alone, outputs, progress)
            out["clients"] = by_batch[str(batches[0])]
            if len(batches) > 1:
                out["clients_by_batch"] = by_batch
        out["process_peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        out["process_note"] = "the peers and the clients run in this one process: its peak RSS is all of theirs"
        out["sample"] = {m: outputs[m][0].decode("utf-8", "replace") for m in outputs}
        out["sample_prompt"] = pairs[0][0].decode("utf-8", "replace")
        return out
    finally:
        await client.close()
        await asyncio.gather(*(p.stop() for p in chain.peers))


async def _together(n: int, route: list[str], psk: bytes, tmo: Timeouts, link: LinkSpec, pairs, n_bytes: int,
                    max_seq_len: int, modes: list[str], repeats: int, temperature: float, alone: dict, outputs: dict,
                    progress, batch: int) -> dict:
    """``n`` clients at once, client j on prompt j, ``repeats`` times per mode: each client's median
    time against its time alone, the aggregate output bytes per second against one client's, and
    each output against the one written alone (the same seed when sampled)."""
    clients = [PipelineClient(X25519PrivateKey.generate(), psk, route, list(range(len(route))), tmo, link,
                              codec="bf16", timeout_s=600) for _ in range(n)]
    res: dict = {"clients": n, "prompts": f"client j on prompt j (0..{n - 1}), its own identity and connections",
                 "batch": batch,
                 "note": f"each hop computes the chunks ({CHUNK} tokens) of up to {batch} traversals "
                         "together, one forward over their rows (p2p/serving/batching.py), the slots fair by client "
                         "(p2p/serving/fair.py)"}
    try:
        failed = [e for e in await asyncio.gather(*(c.connect() for c in clients), return_exceptions=True)
                  if isinstance(e, BaseException)]
        if failed:
            res["error"] = f"{len(failed)} of {n} clients could not connect: {failed[0]!r}"
            return res
        for mode in modes:
            times: list[list[float]] = [[] for _ in range(n)]
            walls, same = [], 0

            async def one(j: int):
                return await clients[j].generate(pairs[j][0], n_bytes, mode, max_seq_len=max_seq_len,
                                                 sampling=Sampling(temperature, seed=j))

            for r in range(repeats):
                t0 = time.perf_counter()
                got = await asyncio.gather(*(one(j) for j in range(n)), return_exceptions=True)
                walls.append(time.perf_counter() - t0)
                errors = [e for e in got if isinstance(e, BaseException)]
                if errors:  # what ran alone stays measured; this mode's figures at once are not
                    res[mode] = {"error": f"{len(errors)} of {n} clients failed: {errors[0]!r}"}
                    break
                for j, (text, st) in enumerate(got):
                    times[j].append(st["seconds"])
                    same += r == 0 and text == outputs[mode][j]
                progress(f"{mode}, {n} clients at once, batch {batch}: {walls[-1]:.2f} s")
            if "error" in res.get(mode, {}):
                continue
            together = [statistics.median(t) for t in times]
            slowdown = [t / a for t, a in zip(together, alone[mode][:n])]
            wall = statistics.median(walls)
            one_client = n_bytes / statistics.median(alone[mode][:n])
            res[mode] = {"wall_s": wall, "seconds_per_client": together, "seconds_alone": alone[mode][:n],
                         "slowdown": {"median": statistics.median(slowdown), "max": max(slowdown), "per_client": slowdown},
                         "aggregate_bytes_per_s": n * n_bytes / wall, "one_client_bytes_per_s": one_client,
                         "aggregate_vs_one_client": n * n_bytes / wall / one_client,
                         "outputs_identical_to_alone": f"{same}/{n}"}
        return res
    finally:
        await asyncio.gather(*(c.close() for c in clients))


def repeats_16gram(text: bytes) -> bool:
    """Whether ``text`` holds some 16-byte sequence twice (how repetitive an output is)."""
    grams = [text[i:i + 16] for i in range(len(text) - 15)]
    return len(grams) != len(set(grams))


async def _one_traversal_quality(client: PipelineClient, pairs, n_bytes: int) -> dict:
    """CE (nats/byte) of the true continuation under one traversal's logits, per offset, and the
    next-byte CE of the same model (offset 1 is an ordinary next-byte prediction)."""
    ce = torch.zeros(n_bytes)
    for prompt, truth in pairs:
        logits, _, _ = await client.traverse(10 ** 9 + len(prompt), "blocktrain", one_traversal_spec(prompt, n_bytes),
                                             end=True)
        ce += torch.nn.functional.cross_entropy(logits, torch.tensor(list(truth)), reduction="none")
    ce /= len(pairs)
    offs = [o for o in (1, 2, 4, 8, 16, 64, 256) if o <= n_bytes]
    return {"ce_per_offset": {str(o): float(ce[o - 1]) for o in offs},
            "ce_mean_offsets_1_16": float(ce[:16].mean()), "ce_mean_all": float(ce.mean()),
            "note": "offset 1 is a next-byte prediction; placeholders beyond the trained offsets predict little"}


def compare(checkpoints, n_bytes: int, rtt_ms: float, rate_mbit: float, prompts: int = 3, repeats: int = 1,
            log=lambda s: None, ar_bytes: int | None = None, progress=lambda s: None, modes=MODES,
            split: str = "test", temperature: float = 0.0, clients: int = 1,
            batches: tuple[int, ...] = (COMPUTE_SLOTS,)) -> dict:
    """``progress(what)`` after each request (modes x prompts x repeats of them) and each round of
    clients at once. Targets are judged where the modes run allow it (the speedup and the identity
    need exact and autoregressive; the clients' targets, exact)."""
    import uvloop

    r = uvloop.run(run(checkpoints, n_bytes, rtt_ms, rate_mbit, prompts, repeats, modes=modes, log=log,
                       ar_bytes=ar_bytes, progress=progress, split=split, temperature=temperature, clients=clients,
                       batches=batches))
    r["modes"] = list(modes)
    r["within_bound"] = {m: r[m]["vs_bound"] <= 1.25 for m in MODES if m in r}
    r["targets"] = {"every mode within 1.25x of its bound": all(r["within_bound"].values())}
    if "exact" in r and "autoregressive" in r and temperature == 0:
        r["targets"]["speedup_exact_vs_autoregressive >= 3"] = (r["speedup_exact_vs_autoregressive"] >= 3
                                                                and not r["speedup_extrapolated"])
        r["targets"]["exact identical to autoregressive"] = bool(r["exact"].get("identical_to_autoregressive"))
    elif "exact" in r and "autoregressive" in r:
        r["targets"][SAMPLED_TARGET] = (r["speedup_exact_vs_autoregressive"] >= 3 and not r["speedup_extrapolated"]
                                        and r["speedup_per_prompt"]["min"] >= 2)
    if "clients" in r and "exact" in modes:
        n, c = r["clients"]["clients"], r["clients"].get("exact", {})
        ok = "error" not in c and "error" not in r["clients"]
        r["targets"][f"{n} clients (exact): aggregate bytes/s >= 4x one client's"] = ok and c["aggregate_vs_one_client"] >= 4
        r["targets"][f"{n} clients (exact): each client's median time <= 2x alone"] = ok and c["slowdown"]["max"] <= 2
    return r


def check_options(modes_given: tuple[str, ...], kernel: bool, sweep: bool, split: str, temperature: float,
                  clients: int, prompts: int, batches: str) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """``bt-bench wan``'s option combinations: the modes to run (in the order of MODES, whatever
    the order given; all of them when none is named) and the hops' batch sizes. Raises
    OptionError (BadOption naming the option) with what is wrong."""
    modes = tuple(m.strip() for v in modes_given for m in v.split(",") if m.strip())
    if modes_given and not modes:
        raise BadOption("name at least one mode: blocktrain, exact or autoregressive", "--mode")
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise BadOption(f"{', '.join(unknown)}: expected blocktrain, exact or autoregressive", "--mode")
    if (kernel or sweep) and modes:
        raise OptionError("--mode selects the modes of a plain run, not of --kernel (blocktrain and "
                          "autoregressive) or --sweep (all three)")
    modes = tuple(m for m in MODES if m in modes) or MODES  # the order of MODES, whatever the order given
    _check_plain_run_options(modes, kernel, sweep, split, temperature, clients, prompts)
    return modes, _batch_sizes(batches, clients)


def _check_plain_run_options(modes: tuple[str, ...], kernel: bool, sweep: bool, split: str, temperature: float,
                             clients: int, prompts: int) -> None:
    """The options that apply to the plain run only, and what ``clients`` needs."""
    if kernel and split != "test":
        raise OptionError("--split applies to the plain run and --sweep; --kernel has prompts of its own")
    if (kernel or sweep) and temperature:
        raise OptionError("--temperature applies to the plain run only")
    if (kernel or sweep) and clients > 1:
        raise OptionError("--clients applies to the plain run only")
    if clients > 1 and set(modes) <= {"blocktrain"}:
        raise OptionError("--clients runs exact and autoregressive at once: name one of them with --mode")
    if clients > prompts:
        raise BadOption(f"{clients} clients need --prompts {clients} or more: each client's time alone is "
                        "measured on its own prompt first", "--clients")


def _batch_sizes(batches: str, clients: int) -> tuple[int, ...]:
    """``--batch N[,N]``: distinct sizes in 1..64, given only with ``--clients``."""
    try:
        sizes = tuple(int(b) for b in batches.split(","))
    except ValueError:
        raise BadOption(f"{batches!r}: expected sizes such as 8 or 8,1", "--batch") from None
    if not all(1 <= b <= 64 for b in sizes) or len(set(sizes)) != len(sizes):
        raise BadOption(f"{batches!r}: distinct sizes in 1..64", "--batch")
    if batches != str(COMPUTE_SLOTS) and clients < 2:
        raise OptionError("--batch applies to --clients (one client's traversals are a batch of one)")
    return sizes


def sweep(checkpoints, rate_mbit: float, prompts: int, split: str, out: str | Path, log=lambda s: None) -> dict:
    """``bt-bench wan --sweep``: exact against autoregressive (timed on 32 bytes and scaled) at
    N in 16..256 and RTT in 0..200 ms; the rows and a PNG of the speedups in ``out``."""
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
    plot_sweep(rows, Path(out) / "sweep.png")
    return {"benchmark": "wan-sweep", "rate_mbit": rate_mbit, "rows": rows, "plot": str(Path(out) / "sweep.png")}


def plot_sweep(rows: list[dict], path: Path) -> None:
    """A PNG of exact's speedup over autoregressive against N, a line per RTT."""
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


def report(result: dict, modes, temperature: float, clients: int) -> list[str]:
    """``bt-bench wan``'s report of a plain run (``compare``'s result): each mode, the speedups,
    the clients at once, the links."""
    return [*_mode_lines(result, modes), *_speedup_lines(result, modes, temperature),
            *_clients_lines(result, clients), f"links: {result['links']}"]


def _mode_lines(result: dict, modes) -> list[str]:
    lines = []
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
        first = (f", first byte at {r['first_byte_s']:.3f} s (a traversal: {r['seconds_per_traversal']:.3f} s)"
                 if r.get("first_byte_s") is not None and r.get("seconds_per_traversal") else "")
        lines.append(f"{m + ':':<16}{r['seconds']:.3f} s, {r['traversals']:.0f} traversal(s), "
                     f"{r['bytes_moved']:,.0f} B, bound {r['bound_s']:.3f} s ({r['vs_bound']:.2f}x){first}{extra}")
    return lines


def _speedup_lines(result: dict, modes, temperature: float) -> list[str]:
    lines = []
    if "speedup_exact_vs_autoregressive" in result:
        per = result["speedup_per_prompt"]
        spread = f" (per prompt: median {per['median']:.1f}x, {per['min']:.1f}x-{per['max']:.1f}x)"
        if temperature == 0:
            lines.append(f"exact vs autoregressive at identical output: {result['speedup_exact_vs_autoregressive']:.1f}x"
                         f"{spread} (target >= 3: "
                         f"{verdict(result['targets']['speedup_exact_vs_autoregressive >= 3'])})")
        else:
            met = result["targets"][SAMPLED_TARGET]
            lines.append(f"exact vs autoregressive, both sampled at T {temperature}: "
                         f"{result['speedup_exact_vs_autoregressive']:.1f}x{spread} (target >= 3, every prompt "
                         f">= 2: {verdict(met)})")
        lines.append("continuations repeating a 16-gram: " + ", ".join(
            f"{m} {result[m]['continuations_repeating_a_16gram']}" for m in modes if m != "blocktrain"))
    if "speedup_blocktrain_vs_autoregressive" in result:
        lines.append(f"blocktrain vs autoregressive (not the same output): "
                     f"{result['speedup_blocktrain_vs_autoregressive']:.1f}x")
    return lines


def _clients_lines(result: dict, clients: int) -> list[str]:
    lines = []
    for clients_run in result.get("clients_by_batch", {"": result.get("clients", {})}).values():
        at = f", batch {clients_run['batch']}" if "clients_by_batch" in result else ""
        if "error" in clients_run:
            lines.append(f"{clients} clients at once{at}: {clients_run['error']}")
        for m, c in ((m, c) for m, c in clients_run.items() if isinstance(c, dict)):
            if "error" in c:
                lines.append(f"{clients} clients at once{at}, {m}: {c['error']}")
                continue
            lines.append(f"{clients} clients at once{at}, {m}: {c['aggregate_bytes_per_s']:.1f} B/s in all, "
                         f"{c['aggregate_vs_one_client']:.1f}x one client's; each client's time "
                         f"{c['slowdown']['median']:.2f}x its time alone (median), {c['slowdown']['max']:.2f}x "
                         f"(worst); output as alone: {c['outputs_identical_to_alone']}")
    return lines
