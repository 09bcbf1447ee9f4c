"""``bt-bench wan --kernel``: the same comparison with peers as processes in network namespaces.

Hosts 0..K-1 serve one block each (random weights, written as checkpoints to a temporary
directory); host K is the client. Links: veth through a bridge, HTB at the rate, and the delay
from tc netem where the kernel has it, else from the userspace relay of ``netns.py``.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SERVICE_PORT = 7000


def _write_random_model(directory: Path, hops: int, n_bytes: int, d_model: int, layers_per_block: int):
    import torch

    from blocktrain.blocks import checkpoint as ckpt
    from blocktrain.blocks.model import Block, EndToEnd, ModelConfig

    cfg = ModelConfig(d_model=d_model, n_head=max(1, d_model // 32), n_layer=hops * layers_per_block, n_blocks=hops,
                      max_seq_len=64 + n_bytes, head_layers=0, draft_layers=0)
    torch.manual_seed(0)
    e2e = EndToEnd(cfg)
    for k in range(hops):
        ckpt.save(ckpt.Checkpoint(cfg.to_dict(), k, 0, Block(cfg, k).state_dict()),
                  ckpt.block_path(directory / "checkpoints", k))
        ckpt.save(ckpt.Checkpoint(cfg.to_dict(), k, 0, e2e.blocks[k].state_dict()),
                  ckpt.block_path(directory / "reference", k))


def _wait_listening(ns: str, port: int, proc, timeout_s: float = 120.0):
    """Wait until something in namespace ``ns`` listens on ``port`` (from /proc/net/tcp)."""
    want = f":{port:04X} "
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"serving peer in {ns} exited with {proc.returncode}")
        tcp = subprocess.run(["ip", "netns", "exec", ns, "cat", "/proc/net/tcp"], capture_output=True, text=True).stdout
        if any(want in line.split(" 0A ")[0] and " 0A " in line for line in tcp.splitlines()):
            return
        time.sleep(0.2)
    raise RuntimeError(f"serving peer in {ns} did not listen on {port} within {timeout_s}s")


def run_kernel(n_bytes: int = 256, rtt_ms: float = 50.0, rate_mbit: float = 100.0, hops: int = 3,
               d_model: int = 192, layers_per_block: int = 2, repeats: int = 3, measure_ar: int | None = None,
               log=print) -> dict:
    from blocktrain.p2p.identity import new_swarm_key

    from .netns import NetnsLab, available

    why = available()
    if why:
        raise RuntimeError(f"kernel path unavailable: {why}")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        _write_random_model(tmp, hops, n_bytes, d_model, layers_per_block)
        new_swarm_key(tmp / "swarm.key")
        lab = NetnsLab(hops + 1, rate_mbit, rtt_ms / 2)
        lab.up(SERVICE_PORT)
        try:
            log(f"kernel path: {hops + 1} namespaces, HTB {rate_mbit} Mbit/s, delay via {lab.delay_via}")
            for k in range(hops):
                argv = [sys.executable, "-m", "blocktrain.p2p.cli", "serve"]
                if k:
                    argv.append(lab.relay_addr(0))
                argv += ["--block", str(k), "--listen", f"0.0.0.0:{SERVICE_PORT}", "--advertise", lab.relay_addr(k),
                         "--swarm-key", str(tmp / "swarm.key"), "--identity", str(tmp / f"id{k}"),
                         "--checkpoints", str(tmp / "checkpoints"), "--reference", str(tmp / "reference"), "--quiet",
                         "--dead-after", "600"]
                proc = lab.spawn(k, argv, stderr=subprocess.DEVNULL)
                _wait_listening(lab.ns(k), SERVICE_PORT, proc)
            out = subprocess.run(
                ["ip", "netns", "exec", lab.ns(hops), sys.executable, "-m", "blocktrain.bench.wan_kernel", "client",
                 json.dumps({"route": [lab.relay_addr(k) for k in range(hops)], "key": str(tmp / "swarm.key"),
                             "identity": str(tmp / "client"), "n": n_bytes, "repeats": repeats,
                             "measure_ar": measure_ar})],
                capture_output=True, text=True, timeout=3600)
            if out.returncode != 0:
                raise RuntimeError(f"kernel-path client failed: {out.stderr[-3000:]}")
            res = json.loads(out.stdout.strip().splitlines()[-1])
            delay_via = lab.delay_via
        finally:
            lab.down()
    link_delay = rtt_ms / 2e3
    frame = 120  # header, tag and metadata of one PipelineForward, about
    for mode in ("blocktrain", "autoregressive"):
        r = res[mode]
        m = r["measured_bytes"]
        scale = n_bytes / m
        # the client sees its own two links; hop-to-hop bytes follow from the payload sizes (bf16)
        if mode == "blocktrain":
            hop_bytes = (hops - 1) * ((64 + m - 1) * d_model * 2 + frame)
        else:
            hop_bytes = (hops - 1) * (64 * d_model * 2 + frame + (m - 1) * (d_model * 2 + frame))
        r["bytes"] = r["bytes"] + hop_bytes
        r["hop_bytes_estimated"] = hop_bytes
        r["bound_s"] = (r["traversals"] * (hops + 1) * link_delay
                        + (r["bytes"] * 8 / (rate_mbit * 1e6) if rate_mbit else 0) + r["compute_s"])
        r["vs_bound"] = r["seconds"] / r["bound_s"] if r["bound_s"] else None
        r["extrapolated"] = scale != 1.0
        for key in ("seconds", "bound_s", "compute_s", "bytes", "traversals"):
            r[key] *= scale
    speedup = res["autoregressive"]["seconds"] / res["blocktrain"]["seconds"]
    return {"benchmark": "wan-kernel", "n_bytes": n_bytes, "rtt_ms": rtt_ms, "rate_mbit": rate_mbit, "hops": hops,
            "links": f"network namespaces, veth + bridge, tc HTB rate, delay via {delay_via}",
            "weights": "random (timing does not depend on them)", **res, "speedup": speedup,
            "target_speedup": 0.5 * n_bytes, "speedup_met": speedup >= 0.5 * n_bytes}


async def _client(spec: dict) -> dict:
    from blocktrain.p2p.identity import load_or_create_identity, load_swarm_key
    from blocktrain.p2p.serving.client import PipelineClient
    from blocktrain.p2p.transport import Timeouts

    client = PipelineClient(load_or_create_identity(spec["identity"]), load_swarm_key(spec["key"]), spec["route"],
                            list(range(len(spec["route"]))), Timeouts(connect_s=30, handshake_s=30), timeout_s=600)
    await client.connect()
    prompt = bytes(range(32, 96))
    out = {}
    try:
        for mode in ("blocktrain", "autoregressive"):
            gen = lambda prompt, n, mode=mode: client.generate(prompt, n, mode)  # noqa: E731
            n = spec["n"] if mode == "blocktrain" or not spec.get("measure_ar") else min(spec["n"], spec["measure_ar"])
            await gen(prompt, 2)  # warm-up: connections between hops, thread pools
            runs = []
            for _ in range(spec["repeats"] if mode == "blocktrain" else max(1, spec["repeats"] // 2)):
                before = sum(pc.conn.counter.snapshot()["sent"]["total"]["wire_bytes"] +
                             pc.conn.counter.snapshot()["received"]["total"]["wire_bytes"] for pc in client.conns.values())
                _, st = await gen(prompt, n)
                st["client_bytes"] = sum(pc.conn.counter.snapshot()["sent"]["total"]["wire_bytes"] +
                                         pc.conn.counter.snapshot()["received"]["total"]["wire_bytes"]
                                         for pc in client.conns.values()) - before
                runs.append(st)
            med = lambda k: statistics.median(r[k] for r in runs)  # noqa: E731
            out[mode] = {"seconds": med("seconds"), "compute_s": med("compute_s"), "traversals": runs[0]["traversals"],
                         "measured_bytes": n, "bytes": med("client_bytes"), "runs": runs}
    finally:
        await client.close()
    return out


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "client":
        import uvloop
        print(json.dumps(uvloop.run(_client(json.loads(sys.argv[2])))))
    else:
        print("usage: python -m blocktrain.bench.wan_kernel client SPEC_JSON", file=sys.stderr)
        sys.exit(2)


def report(result: dict) -> list[str]:
    """``bt-bench wan --kernel``'s report of ``run_kernel``'s result: a line per mode."""
    return [f"{m + ':':<16}{r['seconds']:.3f} s, {r['traversals']:.0f} traversal(s), bound {r['bound_s']:.3f} s "
            f"({r['vs_bound']:.2f}x){' (extrapolated)' if r['extrapolated'] else ''}"
            for m, r in ((m, result[m]) for m in ("blocktrain", "autoregressive"))]
