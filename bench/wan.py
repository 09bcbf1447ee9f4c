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
from pathlib import Path

import torch
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from blocktrain.blocks.decode import CHUNK, Sampling, one_traversal_spec
from blocktrain.p2p.serving.client import PipelineClient
from blocktrain.p2p.link import LinkSpec
from blocktrain.p2p.node import Peer
from blocktrain.p2p.serving.server import PipelineServer, ServedBlocks, load_served
from blocktrain.p2p.serving.api import COMPUTE_SLOTS
from blocktrain.p2p.transport import Timeouts

PROMPT_LEN = 64
MODES = ("blocktrain", "exact", "autoregressive")


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
    served = load_served([0], checkpoints)  # the model's shape
    cfg = next(iter(served.blocktrain.values())).cfg
    hops = cfg.n_blocks
    served = load_served(list(range(hops)), checkpoints)
    if PROMPT_LEN + n_bytes - 1 > cfg.max_seq_len:
        raise ValueError(f"a {PROMPT_LEN}-byte prompt + {n_bytes} bytes needs {PROMPT_LEN + n_bytes - 1} positions; "
                         f"the model has {cfg.max_seq_len}")
    link = LinkSpec(delay_ms=rtt_ms / 2, rate_mbit=rate_mbit)
    psk = os.urandom(32)
    tmo = Timeouts(connect_s=30, handshake_s=30, heartbeat_s=5, dead_after_s=600)
    peers, servers = [], []
    for k in range(hops):
        p = await Peer(X25519PrivateKey.generate(), psk, "127.0.0.1", 0, blocks=(k,), role="serve", timeouts=tmo,
                       links={"default": link, "links": {}}).start()
        if peers:
            await p.join("127.0.0.1", peers[0].port)
        servers.append(PipelineServer(p, ServedBlocks({k: served.blocktrain[k]}, batch=batches[0])))
        peers.append(p)
    client = PipelineClient(X25519PrivateKey.generate(), psk, [p.addr for p in peers], list(range(hops)), tmo, link,
                            codec="bf16", timeout_s=600)
    pairs = test_prompts(prompts, n_bytes, split=split)
    out: dict = {"n_bytes": n_bytes, "rtt_ms": rtt_ms, "rate_mbit": rate_mbit, "hops": hops, "prompts": len(pairs),
                 "split": split, "temperature": temperature,
                 "repeats": repeats, "model": cfg.to_dict(), "checkpoints": str(checkpoints or "shipped model"),
                 "links": "in-process link shaper (per-frame serialization at the rate, then one-way delay)",
                 "numerics": "exact and autoregressive both batch-invariant (what makes their output identical); "
                             "the one-traversal mode plain"}
    try:
        await client.connect()
        for p in peers:  # warm the connections between hops (handshakes are not part of a request)
            for q in peers:
                if q is not p:
                    await p.connection(q.addr)
        await client.generate(pairs[0][0], 2, "exact", max_seq_len=cfg.max_seq_len)  # warm-up
        outputs: dict[str, list[bytes]] = {}
        alone: dict[str, list[float]] = {}  # per prompt: the median of its repeats, one client
        for mode in modes:
            n_run = min(n_bytes, ar_bytes) if mode == "autoregressive" and ar_bytes else n_bytes
            runs, texts = [], []
            for i, (prompt, _) in enumerate(pairs):
                for r in range(repeats):
                    before = _sent_bytes(peers, client)
                    text, st = await client.generate(prompt, n_run, mode, max_seq_len=cfg.max_seq_len,
                                                     sampling=Sampling(temperature, seed=i))
                    st["bytes"] = _sent_bytes(peers, client) - before
                    runs.append(st)
                    if r == 0:
                        texts.append(text)
                    progress(f"{mode}, prompt {i + 1}/{len(pairs)}: {runs[-1]['seconds']:.2f} s, "
                             f"{runs[-1]['traversals']} traversal(s)")
            outputs[mode] = texts
            alone[mode] = [statistics.median(r["seconds"] for r in runs[i * repeats:(i + 1) * repeats])
                           for i in range(len(pairs))]
            med = lambda k: statistics.median(r[k] for r in runs)  # noqa: E731
            scale = n_bytes / n_run
            secs, moved, compute, trav = med("seconds"), med("bytes"), med("compute_s"), med("traversals")
            bound = _bound(trav, hops, link, moved, compute)
            out[mode] = {"seconds": secs * scale, "traversals": trav * scale, "bound_s": bound * scale,
                         "vs_bound": secs / bound if bound else None, "bytes_moved": moved * scale,
                         "compute_s": compute * scale, "bytes_per_traversal": n_run / trav,
                         "measured_bytes": n_run, "extrapolated": scale != 1.0,
                         # computed by every hop, all traversals (the prompt once, the output scaled)
                         "positions": PROMPT_LEN + (med("positions") - PROMPT_LEN) * scale,
                         "seconds_per_prompt": [r["seconds"] for r in runs],
                         "continuations_repeating_a_16gram": f"{sum(map(repeats_16gram, texts))}/{len(texts)}"}
        if "exact" in outputs and "autoregressive" in outputs and temperature > 0:
            out["exact"]["output"] = ("sampled: distributed as autoregressive sampling, not the same bytes "
                                      "(tests/test_decode.py's statistical test)")
        if "exact" in outputs and "autoregressive" in outputs and temperature == 0:
            n_cmp = min(len(outputs["autoregressive"][0]), n_bytes)
            same = sum(e[:n_cmp] == a[:n_cmp] for e, a in zip(outputs["exact"], outputs["autoregressive"]))
            if n_cmp == n_bytes:  # every byte compared
                out["exact"]["identical_to_autoregressive"] = same == len(pairs)
            else:  # the autoregressive run was shortened: only its prefix can be compared
                out["exact"]["identical_prefix_bytes"] = n_cmp if same == len(pairs) else 0
            out["exact"]["identical_prompts"] = f"{same}/{len(pairs)} (first {n_cmp} bytes)"
        if "exact" in outputs and "autoregressive" in outputs:
            out["speedup_exact_vs_autoregressive"] = out["autoregressive"]["seconds"] / out["exact"]["seconds"]
            out["speedup_extrapolated"] = out["autoregressive"]["extrapolated"]
            per = sorted(a / e for a, e in zip(out["autoregressive"]["seconds_per_prompt"],
                                               out["exact"]["seconds_per_prompt"]))
            out["speedup_per_prompt"] = {"median": statistics.median(per), "min": per[0], "max": per[-1],
                                         "note": "same prompt and repeat, unscaled (an extrapolated run is shorter)"}
        if "blocktrain" in outputs:
            out["blocktrain"]["quality"] = await _one_traversal_quality(client, pairs, n_bytes)
            if "autoregressive" in outputs:
                out["speedup_blocktrain_vs_autoregressive"] = (out["autoregressive"]["seconds"]
                                                               / out["blocktrain"]["seconds"])
        if clients > 1:
            by_batch = {}
            for b in batches:
                try:
                    for srv in servers:  # fresh fair queues: each size starts with no client known
                        srv.set_batch(b)
                except RuntimeError as e:  # a traversal of the size before still in flight
                    by_batch[str(b)] = {"clients": clients, "batch": b, "error": str(e)}
                    continue
                by_batch[str(b)] = await _together(clients, [p.addr for p in peers], psk, tmo, link, pairs, n_bytes,
                                                   cfg.max_seq_len, [m for m in modes if m != "blocktrain"], repeats,
                                                   temperature, alone, outputs, progress, b)
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
        await asyncio.gather(*(p.stop() for p in peers))


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
        r["targets"]["speedup_exact_vs_autoregressive >= 2 (sampled)"] = (r["speedup_exact_vs_autoregressive"] >= 2
                                                                          and not r["speedup_extrapolated"])
    if "clients" in r and "exact" in modes:
        n, c = r["clients"]["clients"], r["clients"].get("exact", {})
        ok = "error" not in c and "error" not in r["clients"]
        r["targets"][f"{n} clients (exact): aggregate bytes/s >= 4x one client's"] = ok and c["aggregate_vs_one_client"] >= 4
        r["targets"][f"{n} clients (exact): each client's median time <= 2x alone"] = ok and c["slowdown"]["max"] <= 2
    return r
