"""The live targets for key holders, measured against real `bt-peer` processes on loopback.

    .venv/bin/python experiments/hardening/key_holders.py --json results/hardening/key_holders.json

Every attacker here holds the swarm key, and makes a fresh identity whenever it likes.

(1) Identity churn: against one `bt-peer start --no-train --report R --report-every 1`, N fresh
    identities (default 5,000), 8 at a time: handshake as a member, ANNOUNCE, PING, then GOODBYE
    (every other one vanishes without it). Every 250 identities, and for 35 s after the last: the
    wall time of a status query (an in-process `query_status`: handshake + answer), the peer's
    VmRSS and open descriptors. Target: status under 1 s throughout and after; RSS and fds within
    10% of the baseline after they leave. The report file's size is recorded as it goes.
(2) Fuzz: against a training peer (`bt-peer start --block 0`, tiny model, training all along),
    F sealed frames (default 100,000) after a valid member handshake, each followed by a PING
    whose PONG (or the close) is awaited, so every frame counted was read by the peer:
    half are messages of every type with random fields (random meta values, routes, tensors), half
    are valid messages whose payload bytes were then mutated (bytes changed, cut short or grown)
    before sealing. A connection the peer closes is opened again (a new handshake, same identity).
    Afterwards: status times (5 queries), the peer's `input_failures` (from its report: refusals
    by exception type) and whether its log holds a traceback. Target: no unhandled exception,
    status under 1 s afterwards.
(3) Stream-request flood: one `bt-peer start --block 0` (tiny model, 2 steps, then it serves its
    work dir) holding a 12 MiB file under checkpoint/big; S identities (default 96) each open a
    client connection, send 4 STREAM_REQUESTs for it and read nothing for 15 s; then they close.
    VmRSS before, at the peak (sampled every 0.25 s) and 10 s after. Target: +64 MiB at most.

(4) Serving flood: three `bt-peer serve` processes (the shipped model); a legitimate client's
    `generate` (64 bytes, exact) alone, 5 times (--flood-runs), then while 8 identities each keep
    8 traversals of a 200-byte new session in flight, from a process of their own; then the same
    with a new identity for every flood traversal. Target: at most 2x slower (median); the last
    hop's RSS; the cores each process kept busy.

Only processes this script starts are stopped, by pid; everything lives in a temporary directory.
"""
import argparse
import asyncio
import collections
import json
import math
import os
import random
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from _live import BT_PEER, RESULTS, TINY, finish, out, provenance
from live_targets import fds, free_port, rss_mib, start_peer, wait_listening

import blocktrain.protocol.connection as wire
from blocktrain.provenance import code_version
from blocktrain.p2p.identity import load_or_create_identity, load_swarm_key, peer_id
from blocktrain.p2p.tensors import to_wire
from blocktrain.p2p.transport import CLIENT_INFO, Timeouts, make_connection, open_connection
from blocktrain.p2p.view import query_status
from blocktrain.protocol import (Announce, BlockUpdate, PeerInfo, PeerList, PipelineForward, PipelineResult, Ping,
                                 ProtocolError, Role, Status, StreamChunk, StreamEnd, StreamOpen, StreamRequest,
                                 StreamReset)

RESULTS["command"] = "python experiments/hardening/key_holders.py --json results/hardening/key_holders.json"
FAST = Timeouts(connect_s=10, handshake_s=10, heartbeat_s=1.0, dead_after_s=30, close_s=1)


def keys(tmp: Path):
    return load_swarm_key(tmp / "swarm.key"), load_or_create_identity(tmp / "caller.id")


async def status_s(port: int, psk: bytes, ident) -> float:
    t = time.perf_counter()
    await query_status("127.0.0.1", port, ident, psk, FAST)
    return round(time.perf_counter() - t, 3)


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def sample(pid: int) -> dict:
    return {"rss_mib": rss_mib(pid), "fds": fds(pid)}


# --- (1) identity churn ----------------------------------------------------------------------------

async def churn_one(port: int, psk: bytes, i: int):
    key = X25519PrivateKey.generate()
    info = {"addr": f"127.0.{1 + i // 250 % 200}.{2 + i % 250}:9", "blocks": [0], "role": "train"}
    pc = await open_connection("127.0.0.1", port, make_connection(Role.INITIATOR, key, psk, info=info), FAST)
    pc.send_nowait(Announce(peer=PeerInfo(peer_id(key), info["addr"], (0,), "train", 0)))
    pc.send_nowait(Ping(nonce=i + 1))
    if i % 2:
        await pc.close("bye")
    else:
        await pc.drain()
        pc.abort("vanished")
    await pc.wait_closed()


async def churn(tmp: Path, pid: int, port: int, n: int):
    psk, ident = keys(tmp)
    report = tmp / "victim.report.json"
    base = {**sample(pid), "status_s": await status_s(port, psk, ident)}
    rows, failed, t0 = [], 0, time.monotonic()
    sem = asyncio.Semaphore(8)

    async def one(i):
        nonlocal failed
        async with sem:
            try:
                await churn_one(port, psk, i)
            except (ConnectionError, OSError, ProtocolError):
                failed += 1

    for start in range(0, n, 250):
        await asyncio.gather(*(one(i) for i in range(start, min(n, start + 250))))
        rows.append({"identities": min(n, start + 250), "s": round(time.monotonic() - t0, 1),
                     "status_s": await status_s(port, psk, ident), **sample(pid),
                     "report_bytes": report.stat().st_size if report.exists() else None})
        print(json.dumps(rows[-1]), flush=True)
    after = []
    for k in range(7):  # 35 s after the last one left
        await asyncio.sleep(5)
        after.append({"after_s": 5 * (k + 1), "status_s": await status_s(port, psk, ident), **sample(pid)})
    st = await query_status("127.0.0.1", port, ident, psk, FAST)
    during = [r["status_s"] for r in rows]
    last = after[-1]
    out("churn", {"identities": n, "failed_connections": failed, "baseline": base, "during": rows, "after": after,
                  "status_s_max_during": max(during), "status_s_max_after": max(a["status_s"] for a in after),
                  "rss_after_vs_baseline": round(last["rss_mib"] / base["rss_mib"], 3),
                  "fds_after_vs_baseline": round(last["fds"] / base["fds"], 3),
                  "members_known_after": len(st["members"]),
                  "target_met": max(during) < 1 and max(a["status_s"] for a in after) < 1
                  and last["rss_mib"] <= 1.1 * base["rss_mib"] and last["fds"] <= 1.1 * base["fds"]})


# --- (2) fuzz --------------------------------------------------------------------------------------

KEYS = ("phase", "part", "group", "round_group", "departed", "contributors", "reason", "scope", "peer", "at", "name",
        "why", "size", "sponsor", "step", "digest", "members", "same", "after", "block", "reply_to", "session", "mode",
        "spec", "blocks", "end", "codec", "compute_s", "error", "hop", "fault", "drafter", "ids", "positions")
PHASES = ("join", "welcome", "admit", "ready", "absent", "excluded", "leave", "status", "reduce", "gather", "split")
WIRE = [to_wire("x", torch.zeros(3)), to_wire("x", torch.randn(1, 4, 16)), to_wire("logits", torch.zeros(2, 2)),
        to_wire("x", torch.zeros(4, dtype=torch.int16))]


def rvalue(r: random.Random, depth: int = 0):
    k = r.randrange(10 if depth < 2 else 7)
    return [lambda: None, lambda: r.random() < 0.5, lambda: r.randint(-2**63, 2**64 - 1),
            lambda: r.choice([float("nan"), float("inf"), -1e308, r.random()]), lambda: r.choice(PHASES),
            lambda: os.urandom(r.randrange(9)).hex(), lambda: os.urandom(r.randrange(9)),
            lambda: [rvalue(r, depth + 1) for _ in range(r.randrange(5))],
            lambda: {r.choice(KEYS): rvalue(r, depth + 1) for _ in range(r.randrange(5))},
            lambda: list(range(r.randrange(800)))][k]()


def rmeta(r: random.Random) -> dict:
    return {r.choice(KEYS) if r.random() < 0.8 else os.urandom(3).hex(): rvalue(r) for _ in range(r.randrange(8))}


def rmessage(r: random.Random):
    u = lambda: r.choice([0, 1, 2, r.randrange(2**32)])  # noqa: E731
    tens = lambda: tuple(r.choice(WIRE) for _ in range(r.randrange(3)))  # noqa: E731
    sid = r.randint(1, 9)
    makers = [
        lambda: BlockUpdate(block=r.randrange(4), round=u(), tensors=tens(), meta=rmeta(r)),
        lambda: PipelineForward(request_id=u(), route=tuple(os.urandom(4).hex() for _ in range(r.randrange(4))),
                                hop=r.randrange(5), tensors=tens(), meta=rmeta(r)),
        lambda: PipelineResult(request_id=u(), tensors=tens(), meta=rmeta(r)),
        lambda: Status(status=rmeta(r)),
        lambda: StreamRequest(stream_id=sid, kind=r.choice(["checkpoint", "update", "x"]), name=os.urandom(4).hex(),
                              offset=u()),
        lambda: StreamOpen(stream_id=sid, kind=r.choice(["checkpoint", "update"]), name=os.urandom(4).hex(),
                           total_size=u(), offset=u(), meta=rmeta(r)),
        lambda: StreamChunk(stream_id=sid, offset=u(), data=os.urandom(r.randrange(17))),
        lambda: StreamEnd(stream_id=sid),
        lambda: StreamReset(stream_id=sid, reason="x"),
        lambda: PeerList(peers=tuple(PeerInfo(r.choice(["ab" * 32, "cd" * 32]), r.choice(["", "127.0.0.1:1"]))
                                     for _ in range(r.randrange(4)))),
        lambda: Ping(nonce=u()),
    ]
    while True:
        try:
            return r.choice(makers)()
        except ProtocolError:
            continue  # what the encoder itself refuses never reaches the wire


MUTATE = [False]
_encode = wire.encode_payload
_rng = random.Random(7)


def mutated_payload(msg, compress=True):
    """The payload as the encoder writes it, then (while MUTATE) bytes changed, cut or grown."""
    flags, bufs = _encode(msg, compress)
    if not MUTATE[0]:
        return flags, bufs
    b = bytearray(b"".join(bytes(x) for x in bufs))
    for _ in range(_rng.randint(1, 4)):
        op = _rng.random()
        if op < 0.6 and b:
            b[_rng.randrange(len(b))] = _rng.randrange(256)
        elif op < 0.8 and b:
            del b[_rng.randrange(len(b)):]
        else:
            b += os.urandom(_rng.randint(1, 16))
    return flags, [bytes(b)]


async def fuzz(tmp: Path, pid: int, port: int, n: int, log: Path, report: Path):
    """``n`` fuzz frames, each followed by a PING whose PONG (or the connection's close) is awaited
    before the next: every frame counted was read by the peer (a frame queued behind one that
    closed the connection never is)."""
    from blocktrain.protocol import ConnectionClosed, Pong
    psk, ident = keys(tmp)
    key = X25519PrivateKey.generate()
    info = {"addr": "127.0.0.9:9", "blocks": [0], "role": "train"}
    r = random.Random(0)
    base = {**sample(pid), "status_s": await status_s(port, psk, ident)}
    sent, closed_by_peer, connections, pc, t0 = 0, 0, 0, None, time.monotonic()
    try:
        while sent < n and time.monotonic() - t0 < 1800:
            if pc is None or pc.closed.done():
                if pc is not None:
                    pc.abort("reopen")
                pc = await open_connection("127.0.0.1", port, make_connection(Role.INITIATOR, key, psk, info=info), FAST)
                pc.send_nowait(Announce(peer=PeerInfo(peer_id(key), info["addr"], (0,), "train", 0)))
                connections += 1
            msg = rmessage(r)
            wire.encode_payload = mutated_payload if sent % 2 else _encode
            MUTATE[0] = sent % 2 == 1
            try:
                pc.send_nowait(msg)
            except (ConnectionError, ProtocolError):
                continue
            finally:
                MUTATE[0], wire.encode_payload = False, _encode
            sent += 1
            try:
                pc.send_nowait(Ping(nonce=sent))
                while True:
                    m = await asyncio.wait_for(pc.recv(), 10)
                    if isinstance(m, ConnectionClosed):
                        closed_by_peer += 1
                        break
                    if isinstance(m, Pong) and m.nonce == sent:
                        break
            except (ConnectionError, ProtocolError):
                closed_by_peer += 1
            except asyncio.TimeoutError:
                pc.abort("no pong within 10 s")
                print(json.dumps({"no_pong_after_frame": sent}), flush=True)
            if sent % 10000 == 0:
                print(json.dumps({"fuzz_frames": sent, "closed_by_peer": closed_by_peer, "connections": connections,
                                  "s": round(time.monotonic() - t0, 1), **sample(pid)}), flush=True)
    finally:
        wire.encode_payload = _encode
        if pc is not None:
            pc.abort("done")
    await asyncio.sleep(3)
    times = [await status_s(port, psk, ident) for _ in range(5)]
    rep = json.loads(report.read_text()) if report.exists() else {}
    text = log.read_text(errors="replace")
    out("fuzz", {"frames": sent, "half_byte_mutated": True, "connections_opened": connections,
                 "frames_that_closed_the_connection": closed_by_peer, "seconds": round(time.monotonic() - t0, 1),
                 "baseline": base, "after": sample(pid), "status_s_after": times,
                 "status_s_after_median": statistics.median(times),
                 "input_failures": rep.get("input_failures"), "log_tracebacks": text.count("Traceback"),
                 "log_typeerrors": text.count("TypeError"),
                 "target_met": max(times) < 1 and "Traceback" not in text})


# --- (3) stream-request flood ----------------------------------------------------------------------

async def streams(tmp: Path, n_ids: int):
    psk, ident = keys(tmp)
    port = free_port()
    work = tmp / "holder-work"
    p = start_peer(tmp, "holder", ["start", "--block", "0", *TINY, "--steps", "2", "--work-dir", str(work)], port)
    wait_listening(p, port, tmp, "holder")
    deadline = time.monotonic() + 120
    while not (work / "serve").is_dir():
        assert time.monotonic() < deadline, "the holder never made its serve directory"
        await asyncio.sleep(0.5)
    (work / "serve" / "checkpoint").mkdir(parents=True, exist_ok=True)
    (work / "serve" / "checkpoint" / "big.safetensors").write_bytes(os.urandom(12 << 20))
    await asyncio.sleep(3)
    base = sample(p.pid)
    conns, opened = [], 0
    for _ in range(n_ids):
        pc = await open_connection("127.0.0.1", port, make_connection(
            Role.INITIATOR, X25519PrivateKey.generate(), psk, info=CLIENT_INFO), FAST)
        pc.transport.pause_reading()  # read nothing: what the peer queues for us stays with it
        for sid in range(1, 5):
            pc.send_nowait(StreamRequest(kind="checkpoint", name="big", offset=0, stream_id=sid))
        conns.append(pc)
        opened += 1
    peak, t0 = dict(base), time.monotonic()
    while time.monotonic() - t0 < 15:
        s = sample(p.pid)
        peak = {k: max(peak[k], s[k]) for k in s}
        await asyncio.sleep(0.25)
    for pc in conns:
        pc.abort("done")
    await asyncio.sleep(10)
    after = sample(p.pid)
    out("streams", {"identities": opened, "requests": 4 * opened, "file_mib": 12, "baseline": base, "peak": peak,
                    "after_10s": after, "rss_peak_minus_baseline_mib": round(peak["rss_mib"] - base["rss_mib"], 1),
                    "target_met": peak["rss_mib"] - base["rss_mib"] <= 64})


# --- (4) serving flood -----------------------------------------------------------------------------

async def serving_flood(tmp: Path, n_ids: int, in_flight: int, runs: int, fresh: bool = False, batch: int | None = None):
    """Three `bt-peer serve` processes (the shipped model, blocks 0..2). A legitimate client's
    `generate` (64 bytes, exact, greedy) alone, ``runs`` times; then again while ``n_ids``
    identities each keep ``in_flight`` traversals in flight (a new session of a 200-byte prompt
    each, ended with it; a refused one is sent again after 50 ms). ``fresh``: instead, the
    ``n_ids`` x ``in_flight`` flooders each use a new identity for every traversal (a new key,
    new connections). The flood runs in a process of its own (the attacker's machine; here it
    shares the cores). The last hop's RSS throughout. ``batch``: the hops' `bt-peer serve --batch`
    (None: its default)."""
    from blocktrain.p2p.serving.client import generate
    psk, ident = keys(tmp)
    ports, procs = [free_port() for _ in range(3)], []
    for k, port in enumerate(ports):
        boot = [] if k == 0 else [f"127.0.0.1:{ports[0]}"]
        procs.append(start_peer(tmp, f"serve{k}", ["serve", *boot, "--block", str(k),
                                                   *([] if batch is None else ["--batch", str(batch)])], port))
        wait_listening(procs[-1], port, tmp, f"serve{k}")
    route = [f"127.0.0.1:{p}" for p in ports]
    prompt = b"The history of the city begins in the early years of the nineteenth century , when "
    await generate("127.0.0.1", ports[0], ident, psk, prompt, 8, "exact", 60, wait_s=60)  # the chain is up

    failures: list[str] = []
    rebuilds: list[int] = []  # per generate: caches a hop lost mid-session (fault "session"), rebuilt
    attempts: list[int] = []  # per generate: chains tried

    async def legit():
        t = time.perf_counter()
        try:
            out, stats = await generate("127.0.0.1", ports[0], ident, psk, prompt, 64, "exact", 120)
            rebuilds.append(stats.get("rebuilds", 0))
            attempts.append(stats["attempts"])
        except Exception as e:  # noqa: BLE001 - a failed generate is a result here
            failures.append(f"{type(e).__name__}: {e}")
            rebuilds.append(None)
            attempts.append(None)
            return None, None
        return time.perf_counter() - t, out
    alone = [await legit() for _ in range(runs)]
    rss0 = rss_mib(procs[2].pid)
    counts, stop = tmp / f"flood-{fresh}.json", tmp / f"flood-{fresh}.stop"  # each run its own
    flooder = subprocess.Popen([os.sys.executable, __file__, "--flood-worker", json.dumps(
        {"route": route, "key": str(tmp / "swarm.key"), "ids": n_ids, "in_flight": in_flight, "fresh": fresh,
         "prompt": prompt.decode(), "stop": str(stop), "out": str(counts), "max_s": 300})])
    try:
        peak = rss0
        await asyncio.sleep(5)
        flooded, cpu0, t0 = [], [cpu_s(p.pid) for p in procs + [flooder]], time.monotonic()
        for _ in range(runs):
            flooded.append(await legit())
            peak = max(peak, rss_mib(procs[2].pid))
        cpu = [round((cpu_s(p.pid) - c) / (time.monotonic() - t0), 2) for p, c in zip(procs + [flooder], cpu0)]
        stop.touch()
        flooder.wait(timeout=180)
    finally:
        if flooder.poll() is None:
            flooder.kill()
            flooder.wait()
    flood = json.loads(counts.read_text()) if counts.exists() else {}
    await asyncio.sleep(5)
    done = [t for t, _ in flooded if t is not None]
    a, f = statistics.median(t for t, _ in alone if t is not None), statistics.median(done) if done else math.inf
    out("serving_flood_fresh_identities" if fresh else "serving_flood", {
        "identities": "a new one for every traversal" if fresh else n_ids, "in_flight_each": in_flight,
        "flooders": n_ids * in_flight, "legit_bytes": 64, "runs": runs, "serve_batch": batch,
                          "legit_alone_s": [t and round(t, 2) for t, _ in alone],
                          "legit_flooded_s": [t and round(t, 2) for t, _ in flooded],
                          "legit_failed": failures,
                          "legit_rebuilds": rebuilds[runs:], "legit_attempts": attempts[runs:],
                          "slowdown_median": round(f / a, 2),
                          "same_output": all(o == alone[0][1] for _, o in alone + flooded if o is not None),
                          "flood_answered": flood.get("answered"), "flood_refused": flood.get("refused"),
                          "flood_tokens_per_s": flood.get("tokens_per_s"),
                          "flooders_died": flood.get("flooders_died"),
                          "cores_busy_while_flooded": {"hops": cpu[:3], "flooding_process": cpu[3],
                                                       "note": "CPU seconds per second, while the flooded "
                                                               "generates ran; the machine has 2 cores"},
                          "last_hop_rss_mib": {"before": rss0, "peak": peak, "after_5s": rss_mib(procs[2].pid)},
                          "target_met": f / a <= 2 and not failures,
                          "note": "3 hops, the flooding process and the client share this machine's 2 cores: "
                                  "CPU contention inflates the slowdown"})


async def flood_worker(cfg: dict):
    """The attacker (run as its own process by ``serving_flood``): ``ids`` identities, each with
    ``in_flight`` traversals of a new 200-byte session in flight, until the stop file appears;
    ``fresh``: every traversal from a new identity."""
    import secrets

    from blocktrain.blocks.decode import recompute_spec
    from blocktrain.p2p.serving.client import PipelineClient
    from blocktrain.p2p.serving.api import PipelineError
    psk = load_swarm_key(Path(cfg["key"]))
    text = (b"x" * 20 + cfg["prompt"].encode()) * 2
    spec = recompute_spec(text[:201], 200)  # 200 new positions, one logits row
    answered, refused, stop = [0], [0], asyncio.Event()
    clients = [PipelineClient(X25519PrivateKey.generate(), psk, cfg["route"], [0, 1, 2], FAST, timeout_s=120)
               for _ in range(cfg["ids"])]

    async def flood(c):
        while not stop.is_set():
            if cfg["fresh"]:
                c = PipelineClient(X25519PrivateKey.generate(), psk, cfg["route"], [0, 1, 2], FAST, timeout_s=120)
            try:
                if cfg["fresh"]:
                    await c.connect()
                await c.traverse(secrets.randbits(62), "autoregressive", spec, end=True)
                answered[0] += 1
            except (PipelineError, ConnectionError, OSError, ProtocolError):
                refused[0] += 1
                await asyncio.sleep(0.05)
            finally:
                if cfg["fresh"]:
                    await c.close()
    for c in clients:
        await c.connect()
    t0 = time.monotonic()
    tasks = [asyncio.ensure_future(flood(c)) for c in clients for _ in range(cfg["in_flight"])]
    while not Path(cfg["stop"]).exists() and time.monotonic() - t0 < cfg["max_s"]:
        await asyncio.sleep(0.1)
    stop.set()
    ended = await asyncio.gather(*tasks, return_exceptions=True)
    died = collections.Counter(type(e).__name__ for e in ended if isinstance(e, BaseException))
    s = time.monotonic() - t0
    for c in clients:
        await c.close()
    Path(cfg["out"]).write_text(json.dumps({"answered": answered[0], "refused": refused[0], "seconds": round(s, 1),
                                            "tokens_per_s": round(200 * answered[0] / s, 1),
                                            "flooders_died": dict(died)}))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default="results/hardening/key_holders.json")
    ap.add_argument("--identities", type=int, default=5000)
    ap.add_argument("--frames", type=int, default=100000)
    ap.add_argument("--stream-identities", type=int, default=96)
    ap.add_argument("--only", default="churn,fuzz,streams,flood",
                    help="comma list of churn, fuzz, streams, flood (both floods), flood-fresh (that one only)")
    ap.add_argument("--flood-runs", type=int, default=5, help="generate runs alone and flooded (medians)")
    ap.add_argument("--serve-batch", type=int, help="the hops' bt-peer serve --batch (default: its default)")
    ap.add_argument("--flood-worker", help=argparse.SUPPRESS)  # serving_flood's attacker process
    args = ap.parse_args()
    if args.flood_worker:
        asyncio.run(flood_worker(json.loads(args.flood_worker)))
        return
    if args.json != "results/hardening/key_holders.json" or args.identities != 5000 or args.frames != 100000:
        RESULTS["command"] = ("python experiments/hardening/key_holders.py " +
                              " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()
                                       if k != "flood_worker"))
    only = set(args.only.split(","))
    tmp = Path(tempfile.mkdtemp(prefix="bt-key-holders-"))
    t0 = time.monotonic()
    try:
        out("code", provenance())
        RESULTS["code_version"] = code_version()
        subprocess.run([BT_PEER, "keygen", "--out", str(tmp / "swarm.key")], check=True, capture_output=True)
        if "churn" in only:
            port = free_port()
            p = start_peer(tmp, "victim", ["start", "--no-train", "--report", str(tmp / "victim.report.json"),
                                           "--report-every", "1"], port)
            wait_listening(p, port, tmp, "victim")
            time.sleep(2)
            asyncio.run(churn(tmp, p.pid, port, args.identities))
        if "fuzz" in only:  # a training peer: group control, averaging and checkpoint streams all answer
            port = free_port()
            p = start_peer(tmp, "fuzzed", ["start", "--block", "0", *TINY, "--steps", "1000000", "--report",
                                           str(tmp / "fuzzed.report.json"), "--report-every", "1"], port)
            wait_listening(p, port, tmp, "fuzzed")
            time.sleep(2)
            asyncio.run(fuzz(tmp, p.pid, port, args.frames, tmp / "fuzzed.log", tmp / "fuzzed.report.json"))
        if "streams" in only:
            asyncio.run(streams(tmp, args.stream_identities))
        if "flood" in only:
            asyncio.run(serving_flood(tmp, 8, 8, args.flood_runs, batch=args.serve_batch))
        if "flood" in only or "flood-fresh" in only:
            asyncio.run(serving_flood(tmp, 8, 8, args.flood_runs, fresh=True, batch=args.serve_batch))
    finally:
        finish(t0, args.json, tmp)


if __name__ == "__main__":
    main()
