"""``bt-bench average``: time to average F float32 among N peer processes on loopback.

Beside it, in the same run: torch.distributed's gloo all_reduce over the same number of processes
and floats, and hivemind's DecentralizedAverager (``bench/hivemind_child.py``, run with a Python
that has the ``compare`` extra; its all-reduce is timed from the trigger after matchmaking, so
matchmaking is not charged to it). Each figure is the median over rounds after a first warm-up
round; a round's time is its slowest peer's.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .ports import free_ports
from .options import BadOption
from .report import verdict



async def _peer_child(i: int, n: int, ports: list[int], floats: int, rounds: int, key_hex: str, out: str,
                      codec: str):
    import torch
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

    from blocktrain.p2p.averaging import Averager
    from blocktrain.p2p.node import Peer
    from blocktrain.p2p.transport import Timeouts

    torch.set_num_threads(1)
    p = await Peer(X25519PrivateKey.generate(), bytes.fromhex(key_hex), "127.0.0.1", ports[i], blocks=(0,),
                   timeouts=Timeouts(heartbeat_s=5, dead_after_s=600)).start()
    av = Averager(p, 0, codec=codec, timeout_s=600, floats=floats)  # before anyone can send us a part
    if i:
        await p.join("127.0.0.1", ports[0], timeout_s=30.0)
    await p.wait_for(lambda: len(p.members()) == n - 1, 60.0)
    members = [p.id] + [m.peer_id for m in p.members()]
    for pid in members[1:]:  # connect everyone before timing
        await p.connection(pid)
    x = torch.randn(floats, generator=torch.Generator().manual_seed(i))
    result = torch.empty_like(x)  # the result's buffer, reused round after round as the swarm's trainer does
    times, cov = [], []
    for r in range(rounds):
        t0 = time.perf_counter()
        _, rep = await av.average(r + 1, x, members, out=result)
        times.append(time.perf_counter() - t0)
        cov.append(rep.coverage)
    Path(out).write_text(json.dumps({"times": times, "coverage": cov}))
    await asyncio.sleep(1.0)  # let the others finish their last gathers before we go
    await p.stop()


def _gloo_child(i: int, n: int, port: int, floats: int, rounds: int, out: str):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=i, world_size=n)
    x = torch.randn(floats, generator=torch.Generator().manual_seed(i))
    times = []
    for _ in range(rounds):
        y = x.clone()
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(y)
        y /= n
        times.append(time.perf_counter() - t0)
    Path(out).write_text(json.dumps({"times": times}))
    dist.destroy_process_group()


def _wait_all(procs: list, timeout_s: float):
    """Wait for every process; any still running after that (or on an error) is killed, by pid."""
    try:
        for p in procs:
            p.wait(timeout=timeout_s)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def _spawn_all(args_for, n: int, timeout_s: float) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        outs = [os.path.join(tmp, f"r{i}.json") for i in range(n)]
        procs = [subprocess.Popen([sys.executable, "-m", "blocktrain.bench.average", *map(str, args_for(i, outs[i]))])
                 for i in range(n)]
        _wait_all(procs, timeout_s)
        bad = [i for i, p in enumerate(procs) if p.returncode != 0]
        if bad:
            raise RuntimeError(f"benchmark processes {bad} failed")
        return [json.loads(Path(o).read_text()) for o in outs]


def hivemind_missing(python: str) -> str | None:
    """Why ``python`` cannot run the hivemind comparison, or None if it can."""
    r = subprocess.run([python, "-c", "import hivemind, torch; print(hivemind.__version__)"], capture_output=True,
                       text=True, timeout=120)
    if r.returncode:
        return (f"{python} cannot import hivemind ({r.stderr.strip().splitlines()[-1] if r.stderr.strip() else 'error'}); "
                "install the comparison extra (pip install -e '.[compare]', kept out of the test install) "
                "or point --hivemind-python at a Python that has hivemind 1.1.12")
    return None


# The averaging targets: ours at most this many times gloo's fp32 all_reduce (by group size), and at
# least HIVEMIND_TARGET times faster than hivemind.
GLOO_TARGET = {2: 1.5}
GLOO_TARGET_DEFAULT = 2.0
HIVEMIND_TARGET = 5.0


def gloo_target(peers: int) -> float:
    return GLOO_TARGET.get(peers, GLOO_TARGET_DEFAULT)


def summarize(runs: list[dict]) -> dict:
    """Per group size: every run's ratios, their median and worst, and whether every run met the
    targets (each of several consecutive runs must meet them, not only their median)."""
    out = {}
    for n in sorted({r["peers"] for r in runs}):
        rs = [r for r in runs if r["peers"] == n]
        s = {"runs": len(rs), "blocktrain_s": [r["blocktrain_s"] for r in rs],
             "median_blocktrain_s": statistics.median(r["blocktrain_s"] for r in rs)}
        for key, worst, ok in (("vs_gloo", max, "within_gloo_target"),
                               ("vs_hivemind", min, "faster_than_hivemind_target")):
            vals = [r[key] for r in rs if key in r]
            if vals:
                s[key] = vals
                s[f"median_{key}"] = statistics.median(vals)
                s[f"worst_{key}"] = worst(vals)
                s[f"every_run_{ok}"] = all(r[ok] for r in rs)
        if any("vs_gloo" in r for r in rs):
            s["gloo_target"] = gloo_target(n)
        out[str(n)] = s
    return out


def run(peers: int, floats: int, rounds: int = 4, against=("gloo",), codec: str = "raw", timeout_s: float = 900,
        hivemind_python: str = sys.executable) -> dict:
    res = {"benchmark": "average", "peers": peers, "floats": floats, "rounds": rounds, "codec": codec}
    key = os.urandom(32).hex()
    ports = free_ports(peers)
    ours = _spawn_all(lambda i, out: ["peer", i, peers, ",".join(map(str, ports)), floats, rounds, key, out, codec],
                      peers, timeout_s)
    # a round ends at different moments on different peers: the round's time is the slowest peer's
    per_round = [max(o["times"][r] for o in ours) for r in range(rounds)]
    res["blocktrain_s"] = statistics.median(per_round[1:] if rounds > 1 else per_round)
    res["blocktrain_rounds_s"] = per_round
    res["coverage"] = min(c for o in ours for c in o["coverage"])
    if "hivemind" in against:
        with tempfile.TemporaryDirectory() as tmp:
            child = str(Path(__file__).with_name("hivemind_child.py"))
            procs = [subprocess.Popen([hivemind_python, child, str(i), str(peers), str(floats), str(rounds), tmp],
                                      stdout=subprocess.DEVNULL, stderr=open(os.path.join(tmp, f"log{i}"), "w"))
                     for i in range(peers)]
            _wait_all(procs, timeout_s)
            if any(p.returncode for p in procs):
                log = Path(tmp, "log0").read_text()[-2000:]
                raise RuntimeError(f"hivemind peers failed: {log}")
            hm = [json.loads(Path(tmp, f"r{i}.json").read_text()) for i in range(peers)]
        hr = [max(o["times"][r] for o in hm) for r in range(rounds)]
        res["hivemind_s"] = statistics.median(hr[1:] if rounds > 1 else hr)
        res["hivemind_rounds_s"] = hr
        res["hivemind_with_matchmaking_s"] = statistics.median(
            [max(o["with_matchmaking"][r] for o in hm) for r in range(1, rounds)] or [0])
        res["hivemind_group_sizes"] = sorted({s for o in hm for s in o["group_sizes"]})
        res["vs_hivemind"] = res["hivemind_s"] / res["blocktrain_s"]
        res["faster_than_hivemind_target"] = res["vs_hivemind"] >= HIVEMIND_TARGET
    if "gloo" in against:
        port = free_ports(1)[0]
        g = _spawn_all(lambda i, out: ["gloo", i, peers, port, floats, rounds, out], peers, timeout_s)
        gr = [max(o["times"][r] for o in g) for r in range(rounds)]
        res["gloo_s"] = statistics.median(gr[1:] if rounds > 1 else gr)
        res["gloo_rounds_s"] = gr
        res["vs_gloo"] = res["blocktrain_s"] / res["gloo_s"]
        res["gloo_target"] = gloo_target(peers)
        res["within_gloo_target"] = res["vs_gloo"] <= res["gloo_target"]
    return res


BASELINES = ("gloo", "hivemind")


def baselines(against: str) -> tuple[str, ...]:
    """``--against``: gloo, hivemind, both (comma-separated) or none. Raises BadOption."""
    chosen = tuple(b for b in against.split(",") if b and b != "none")
    unknown = set(chosen) - set(BASELINES)
    if unknown:
        raise BadOption(f"unknown baseline(s) {sorted(unknown)}", "--against")
    return chosen


def group_sizes(peers: str) -> list[int]:
    """``--peers``: comma-separated group sizes of at least 2. Raises BadOption."""
    try:
        sizes = [int(x) for x in peers.split(",")]
    except ValueError:
        raise BadOption(f"{peers!r}: expected comma-separated group sizes, e.g. 2,4", "--peers") from None
    if any(n < 2 for n in sizes):
        raise BadOption("a group has at least 2 peers", "--peers")
    return sizes


def run_repeats(sizes: list[int], floats: int, rounds: int, against: tuple[str, ...], codec: str,
                hivemind_python: str, repeats: int, on_run=lambda r: None) -> list[dict]:
    """``repeats`` runs of the whole comparison, every group size in each; ``on_run(r)`` as each
    ends (``r["repeat"]``: which run). Raises RuntimeError when a run's processes fail."""
    results = []
    for rep in range(repeats):
        for n in sizes:
            r = run(n, floats, rounds, against, codec, hivemind_python=hivemind_python)
            r["repeat"] = rep + 1
            results.append(r)
            on_run(r)
    return results


def result(runs: list[dict], summary: dict, argv: list[str]) -> dict:
    """``bt-bench average``'s JSON: every run, their summary by group size, the command's args."""
    return {"benchmark": "average", "argv": argv, "runs": runs, "summary": summary}


def run_line(r: dict, repeats: int) -> str:
    """``bt-bench average``'s report of one run: its time, coverage, and each baseline's ratio."""
    line = (f"run {r['repeat']}/{repeats}: {r['peers']} peers, {r['floats']:,} floats ({r['codec']}): "
            f"{r['blocktrain_s']:.3f} s, coverage {r['coverage']:.0%}")
    if "gloo_s" in r:
        line += (f"; gloo {r['gloo_s']:.3f} s: {r['vs_gloo']:.2f}x gloo (target <= {r['gloo_target']:g}x: "
                 f"{verdict(r['within_gloo_target'])})")
    if "hivemind_s" in r:
        line += (f"; hivemind {r['hivemind_s']:.3f} s: {r['vs_hivemind']:.1f}x faster (target >= 5x: "
                 f"{verdict(r['faster_than_hivemind_target'])})")
    return line


def summary_lines(summary: dict) -> list[str]:
    """``bt-bench average``'s report over several runs: a line per group size."""
    lines = []
    for n, s in summary.items():
        line = f"{n} peers over {s['runs']} runs: median {s['median_blocktrain_s']:.3f} s"
        if "vs_gloo" in s:
            every = "yes" if s["every_run_within_gloo_target"] else "NO"
            line += (f", vs gloo median {s['median_vs_gloo']:.2f}x, worst {s['worst_vs_gloo']:.2f}x "
                     f"(every run within {s['gloo_target']:g}x: {every})")
        if "vs_hivemind" in s:
            line += f", vs hivemind worst {s['worst_vs_hivemind']:.1f}x faster"
        lines.append(line)
    return lines


def main(argv):
    if argv[0] == "peer":
        i, n, ports, floats, rounds, key, out, codec = argv[1:]
        from blocktrain.p2p.transport import install_uvloop
        install_uvloop()  # as bt-peer runs
        asyncio.run(_peer_child(int(i), int(n), [int(p) for p in ports.split(",")], int(floats), int(rounds), key,
                                out, codec))
    elif argv[0] == "gloo":
        i, n, port, floats, rounds, out = argv[1:]
        _gloo_child(int(i), int(n), int(port), int(floats), int(rounds), out)


if __name__ == "__main__":
    main(sys.argv[1:])
