"""Floods by many identities, each holding the swarm key, against live `bt-peer` processes on
loopback (tiny model): the victim's RSS before each wave, at its peak (sampled every 0.2 s) and
30 s after the wave's connections closed, for waves of 96, 192 and 384 identities in turn.

    .venv/bin/python experiments/floods/flood.py streams --json results/floods/streams-after.json

Floods (one victim each, fresh; the waves run against it one after the other):
- ``streams``: the victim trains block 0 for 2 steps, then serves its checkpoint (about 0.5 MB).
  Each identity opens a member connection, sends 4 STREAM_REQUESTs for checkpoint/block0 and
  reads nothing for the wave (12 s); then every connection closes.
- ``parts`` / ``near``: the victim trains block 0 (alone). Each identity opens a member
  connection and sends 4 BLOCK_UPDATE parts of 4 MiB (random float32, so lz4 cannot shrink
  them) for a far-future round (10^9 + i; ``parts``) or the next rounds (1..4; ``near``), then
  closes once they are written. 32 identities send at once.
- ``serving``: three `bt-peer serve` hops (tiny model: blocks 0..2). A legitimate client's
  `generate` (32 bytes, autoregressive) alone, 3 times, then 3 times while each identity of the
  wave keeps 1 traversal (a new 64-byte session) in flight from a process of its own, connecting
  from 127.0.0.2 (``--flood-from``; the legitimate client from 127.0.0.1); the
  victim is the last hop; slowdown = median flooded / median alone; the cores each side kept busy
  meanwhile (CPU seconds per second: the three hops, the flooder, this client). With
  ``--cpu-load N`` no flood is sent: N processes that only spin take the cores instead, so the
  same figures say what the compute share alone costs the client (the flood's part is the rest).
  ``legit_in_hops_s``: of each legitimate run, the seconds its traversals spent in the hops'
  compute path (waiting for the slot and computing, the hops' meta ``compute_s``).

Every loop is bounded in count and time; only the processes this script starts are stopped, by
pid. The JSON records the code version (commit) and the command.
"""
import argparse
import asyncio
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "hardening"))
from _live import BT_PEER, RESULTS, STARTED, TINY, finish, out, provenance  # noqa: E402
from live_targets import rss_mib, start_peer, wait_listening  # noqa: E402

from blocktrain.bench.ports import free_port  # noqa: E402
from blocktrain.p2p.identity import load_swarm_key, peer_id  # noqa: E402
from blocktrain.p2p.tensors import to_wire  # noqa: E402
from blocktrain.p2p.transport import Timeouts, make_connection, open_connection  # noqa: E402
from blocktrain.protocol import Announce, BlockUpdate, PeerInfo, ProtocolError, Role, StreamRequest  # noqa: E402
from blocktrain.provenance import code_version  # noqa: E402

FAST = Timeouts(connect_s=10, handshake_s=10, heartbeat_s=1.0, dead_after_s=60, close_s=1)
WAVE_S = 12  # the longest a wave's attack runs
AFTER_S = 30  # RSS measured this long after the wave's connections closed
AT_ONCE = 32  # identities connecting (and sending) at once
# The serving flood's identities connect from this loopback address, the legitimate client from
# 127.0.0.1: the attacker is another host (--flood-from "" : the client's own address, as before 51f23e0).
FLOOD_FROM = "127.0.0.2"
PART_FLOATS = 1 << 20  # 4 MiB of float32 per part


class Peak:
    """The victim's RSS sampled every 0.2 s while the attack runs."""

    def __init__(self, pid: int):
        self.pid, self.mib, self._task = pid, rss_mib(pid), None

    async def _loop(self):
        while True:
            self.mib = max(self.mib, rss_mib(self.pid))
            await asyncio.sleep(0.2)

    def __enter__(self):
        self._task = asyncio.ensure_future(self._loop())
        return self

    def __exit__(self, *exc):
        self._task.cancel()
        self.mib = max(self.mib, rss_mib(self.pid))


async def member(port: int, psk: bytes, i: int):
    key = X25519PrivateKey.generate()
    info = {"addr": f"127.0.{1 + i // 250 % 200}.{2 + i % 250}:9", "blocks": [0], "role": "train"}
    pc = await open_connection("127.0.0.1", port, make_connection(Role.INITIATOR, key, psk, info=info), FAST)
    pc.send_nowait(Announce(peer=PeerInfo(peer_id(key), info["addr"], (0,), "train", 0)))
    return pc


async def streams_wave(port: int, psk: bytes, n: int, base: int) -> dict:
    conns, failed, sem = [], 0, asyncio.Semaphore(AT_ONCE)

    async def one(i):
        nonlocal failed
        async with sem:
            try:
                pc = await member(port, psk, base + i)
            except (ConnectionError, OSError, ProtocolError):
                failed += 1
                return
            pc.transport.pause_reading()  # read nothing: what the victim sends us stays with it
            for sid in range(1, 5):
                pc.send_nowait(StreamRequest(kind="checkpoint", name="block0", offset=0, stream_id=sid))
            conns.append(pc)
    t0 = time.monotonic()
    await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(n))), WAVE_S * 4)
    await asyncio.sleep(max(0.0, WAVE_S - (time.monotonic() - t0)))
    for pc in conns:
        pc.abort("wave over")
    return {"connected": len(conns), "failed": failed, "requests": 4 * len(conns)}


async def parts_wave(port: int, psk: bytes, n: int, base: int, near: bool) -> dict:
    tensor = to_wire("part", torch.randn(PART_FLOATS), compress="never")
    sent, failed, sem = 0, 0, asyncio.Semaphore(AT_ONCE)

    async def one(i):
        nonlocal sent, failed
        async with sem:
            try:
                pc = await member(port, psk, base + i)
                for k in range(4):
                    rnd = 1 + k if near else 10**9 + k
                    await pc.send(BlockUpdate(block=0, round=rnd, tensors=(tensor,),
                                              meta={"phase": "reduce", "part": 0, "group": "0" * 16}), bulk=True)
                    sent += 1
                await asyncio.wait_for(pc.close("sent", linger=False), 10)
            except (ConnectionError, OSError, ProtocolError, asyncio.TimeoutError):
                failed += 1
    await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(n))), 240)
    return {"parts_sent": sent, "failed": failed, "part_mib": 4 * PART_FLOATS / 2**20}


async def wave(kind: str, pid: int, port: int, psk: bytes, n: int, base: int) -> dict:
    before = rss_mib(pid)
    t0 = time.monotonic()
    with Peak(pid) as peak:
        if kind == "streams":
            info = await streams_wave(port, psk, n, base)
        else:
            info = await parts_wave(port, psk, n, base, kind == "near")
    attack_s = time.monotonic() - t0
    await asyncio.sleep(AFTER_S)
    row = {"identities": n, "rss_before_mib": before, "rss_peak_mib": peak.mib, "rss_after_30s_mib": rss_mib(pid),
           "attack_s": round(attack_s, 1), **info}
    print(json.dumps(row), flush=True)
    return row


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system) a process has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def victim(tmp: Path, kind: str, verbose: bool = False) -> tuple:
    port = free_port()
    work = tmp / "victim-work"
    steps = "2" if kind == "streams" else "1000000"
    p = start_peer(tmp, "victim", ["start", "--block", "0", *TINY, "--steps", steps, "--work-dir", str(work),
                                   *(["-v"] if verbose else [])], port)
    wait_listening(p, port, tmp, "victim", timeout=120)
    if kind == "streams":
        deadline = time.monotonic() + 120
        while not (work / "serve" / "checkpoint" / "block0.safetensors").exists():
            assert time.monotonic() < deadline, "the victim never published its checkpoint"
            time.sleep(0.5)
        out("checkpoint_bytes", (work / "serve" / "checkpoint" / "block0.safetensors").stat().st_size)
    time.sleep(5)
    return p, port


# --- serving ---------------------------------------------------------------------------------------



def cpu_burners(n: int) -> list:
    """``n`` processes that only spin (no traffic): the compute share a saturated machine leaves
    the hops, without any flood at them (--cpu-load)."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


async def serving_waves(tmp: Path, waves: list[int], flood_from: str = FLOOD_FROM, cpu_load: int = 0) -> list:
    from blocktrain.p2p.serving.client import generate
    psk = load_swarm_key(tmp / "swarm.key")
    ident = X25519PrivateKey.generate()
    ports, procs = [free_port() for _ in range(3)], []
    for k, port in enumerate(ports):
        boot = [] if k == 0 else [f"127.0.0.1:{ports[0]}"]
        procs.append(start_peer(tmp, f"serve{k}", ["serve", *boot, "--block", str(k), ], port))
        wait_listening(procs[-1], port, tmp, f"serve{k}", timeout=120)
    prompt = b"The history of the city begins "
    await generate("127.0.0.1", ports[0], ident, psk, prompt, 4, "autoregressive", 60, wait_s=60)

    in_hops: list = []  # per legit run: its seconds inside the hops' compute path (slot wait + chunks)

    async def legit() -> float:
        t = time.perf_counter()
        _, st = await generate("127.0.0.1", ports[0], ident, psk, prompt, 32, "autoregressive", 120,
                               log=lambda s: print("legit:", s, flush=True))  # a failed attempt's cause
        in_hops.append(round(st["compute_s"], 3))
        return time.perf_counter() - t
    rows, victim_pid = [], procs[2].pid
    for n in waves:
        in_hops.clear()
        alone = [await legit() for _ in range(3)]
        before = rss_mib(victim_pid)
        stop, counts = tmp / f"stop-{n}", tmp / f"counts-{n}.json"
        if cpu_load:  # no flood: only the cores taken (the compute share the hops are left)
            flooders = cpu_burners(cpu_load)
        else:
            flooders = [subprocess.Popen([sys.executable, __file__, "--flood-worker", json.dumps(
                {"route": [f"127.0.0.1:{p}" for p in ports], "key": str(tmp / "swarm.key"), "ids": n,
                 "stop": str(stop), "out": str(counts), "max_s": 120, "bind": flood_from})])]
        STARTED.extend(flooders)
        with Peak(victim_pid) as peak:
            await asyncio.sleep(5)
            pids = {"hops": [p.pid for p in procs], "flooder": [f.pid for f in flooders], "client": [os.getpid()]}
            cpu0, t_flooded = {k: sum(map(cpu_s, v)) for k, v in pids.items()}, time.monotonic()
            flooded = [await legit() for _ in range(3)]
            wall = time.monotonic() - t_flooded
            cpu = {k: round((sum(map(cpu_s, v)) - cpu0[k]) / wall, 2) for k, v in pids.items()}
            stop.touch()
            for f in flooders:
                if cpu_load:
                    f.kill()
                f.wait(timeout=90)
        await asyncio.sleep(AFTER_S)
        row = {"identities": n, "rss_before_mib": before, "rss_peak_mib": peak.mib,
               "rss_after_30s_mib": rss_mib(victim_pid), "legit_alone_s": [round(t, 2) for t in alone],
               "legit_flooded_s": [round(t, 2) for t in flooded],
               # the hops' meta compute_s, summed over the run's traversals: alone 3, then flooded 3
               "legit_in_hops_s": list(in_hops),
               "slowdown": round(statistics.median(flooded) / statistics.median(alone), 2),
               "cores_busy_while_flooded": {**cpu, "of": os.cpu_count()},
               "flood": json.loads(counts.read_text()) if counts.exists() else None}
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


async def flood_worker(cfg: dict):
    """The serving flood's attacker, a process of its own: ``ids`` identities, each keeping one
    traversal of a new 64-byte session in flight until the stop file appears (``max_s`` at most)."""
    from blocktrain.blocks.decode import recompute_spec
    from blocktrain.p2p.serving.api import PipelineError
    from blocktrain.p2p.serving.client import PipelineClient
    psk = load_swarm_key(Path(cfg["key"]))
    spec = recompute_spec((b"x" * 80)[:65], 64)
    answered, refused, stop = [0], [0], asyncio.Event()
    clients = [PipelineClient(X25519PrivateKey.generate(), psk, cfg["route"], [0, 1, 2], FAST, timeout_s=60,
                              **({"bind": cfg["bind"]} if cfg.get("bind") else {}))
               for _ in range(cfg["ids"])]

    async def flood(c):
        while not stop.is_set():
            try:
                await c.traverse(secrets.randbits(62), "autoregressive", spec, end=True)
                answered[0] += 1
            except (PipelineError, ConnectionError, OSError, ProtocolError, asyncio.TimeoutError):
                refused[0] += 1
                await asyncio.sleep(0.05)
    sem = asyncio.Semaphore(AT_ONCE)

    async def connect(c):
        async with sem:
            await c.connect()
    await asyncio.gather(*(connect(c) for c in clients), return_exceptions=True)
    t0 = time.monotonic()
    tasks = [asyncio.ensure_future(flood(c)) for c in clients]
    while not Path(cfg["stop"]).exists() and time.monotonic() - t0 < cfg["max_s"]:
        await asyncio.sleep(0.1)
    stop.set()
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for c in clients:
        await c.close()
    Path(cfg["out"]).write_text(json.dumps({"answered": answered[0], "refused": refused[0],
                                            "seconds": round(time.monotonic() - t0, 1)}))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("flood", choices=["streams", "parts", "near", "serving"])
    ap.add_argument("--waves", default="96,192,384")
    ap.add_argument("--json", required=False)
    ap.add_argument("--victim-verbose", action="store_true",
                    help="start the victim with -v and record its malloc_trim durations and event loop stalls")
    ap.add_argument("--flood-from", default=FLOOD_FROM,
                    help="serving: the loopback address the flood's identities connect from ('' for the client's)")
    ap.add_argument("--cpu-load", type=int, default=0,
                    help="serving: no flood; N processes that only spin take the cores instead, "
                         "for the slowdown the compute share alone makes")
    ap.add_argument("--flood-worker", help=argparse.SUPPRESS)
    if "--flood-worker" in sys.argv:
        asyncio.run(flood_worker(json.loads(sys.argv[sys.argv.index("--flood-worker") + 1])))
        return
    args = ap.parse_args()
    waves = [int(x) for x in args.waves.split(",")]
    RESULTS["command"] = "python " + " ".join(sys.argv)
    RESULTS["code_version"] = code_version()
    RESULTS["code"] = provenance()
    # the runtime measured: this checkout's, or (FLOOD_RUNTIME_COMMIT) an export of that commit put
    # first on PYTHONPATH (run.sh), so that a figure names the exact commit it measured
    import blocktrain
    RESULTS["runtime"] = {"commit": os.environ.get("FLOOD_RUNTIME_COMMIT") or code_version()["commit"],
                          "package": str(Path(blocktrain.__file__).parent), "code_hash": code_version()["code_hash"]}
    RESULTS["flood"] = args.flood
    tmp = Path(tempfile.mkdtemp(prefix="bt-floods-"))
    t0 = time.monotonic()
    try:
        subprocess.run([BT_PEER, "keygen", "--out", str(tmp / "swarm.key")], check=True, capture_output=True)
        if args.flood == "serving":
            out("flood_from", args.flood_from or "127.0.0.1 (the client's)")
            out("cpu_load", args.cpu_load)
            out("waves", asyncio.run(serving_waves(tmp, waves, args.flood_from, args.cpu_load)))
        else:
            p, port = victim(tmp, args.flood, args.victim_verbose)
            psk = load_swarm_key(tmp / "swarm.key")
            out("baseline_rss_mib", rss_mib(p.pid))

            async def run():
                rows, base = [], 0
                for n in waves:
                    rows.append(await wave(args.flood, p.pid, port, psk, n, base))
                    base += n
                return rows
            out("waves", asyncio.run(run()))
            out("victim_alive", p.poll() is None)
            if args.victim_verbose:
                lines = (tmp / "victim.log").read_text(errors="replace").splitlines()
                out("malloc_trim_s", [float(l.split("malloc_trim took ")[1].split()[0]) for l in lines
                                      if "malloc_trim took " in l])
                out("loop_stalls", [l for l in lines if "event loop stalled" in l])
    finally:
        finish(t0, args.json or f"/tmp/flood-{args.flood}.json", tmp)


if __name__ == "__main__":
    main()
