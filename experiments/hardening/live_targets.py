"""The hardening targets 1 and 5 (handshake floods, idle sockets, a resumed fetch), measured with live
`bt-peer` processes on loopback.

    .venv/bin/python experiments/hardening/live_targets.py --json results/hardening/live_targets.json

Target 1 (an attacker without the swarm key), against one `bt-peer start --no-train`:
 (a) waves of 64 connections, each sending one 18-byte HANDSHAKE header announcing a 16 MiB
     payload (and nothing else): the peer's VmRSS before, just after, and 30 s after; VmHWM.
     Beside it, (a2): 64 connections that send a valid handshake message 1 (wrong swarm key),
     read message 2, then announce message 3 at the handshake frame limit (65,535 bytes) and send
     all but its last byte, held open: what the most a pending handshake may buffer costs.
 (b) 1,000 idle TCP sockets held open (never closed by us): the peer's fd count (/proc/PID/fd)
     at baseline, peak and over time, until it is back at baseline; against the handshake
     timeout (Timeouts.handshake_s, 10 s, not settable from the CLI).
 (c) with 64 and 200 silent sockets held open (opened afresh before every call), the wall time
     of `bt-peer status 127.0.0.1:PORT --swarm-key K --identity ID --json`, 5 calls, median;
     beside it the same command with no silent sockets (the CLI's own start-up) and the answer
     latency of an in-process `query_status` (the peer's share).
Target 5: two `bt-peer start --block 1` processes (tiny model, 2 steps per block, then they stay
and serve their work dirs) hold the same 24 MiB of checkpoint bytes under different names (holder
A: checkpoint/big; holder B: other bytes under checkpoint/big, the same bytes under
checkpoint/big.r7, as group members do). Holder A's outgoing links are shaped to 40 Mbit/s. The
fetcher is an in-process Peer + CheckpointFetcher in this script (no CLI command fetches an
arbitrary checkpoint name); it asks A then B; A is killed (SIGKILL, by pid) once half the bytes
have arrived. Refetched bytes = stream payload received - file size (CheckpointFetcher's
received_by_kind counts whole chunks; the fetcher peer's traffic report counts wire bytes too).

Only processes this script starts are stopped, by pid. Everything lives in a temporary directory.
"""
import argparse
import asyncio
import json
import os
import resource
import signal
import socket
import statistics
import struct
import subprocess
import tempfile
import time
import zlib
from pathlib import Path

from _live import BT_PEER, RESULTS, STARTED, TINY, finish, out, provenance, stop
from blocktrain.bench.ports import free_port
from blocktrain.p2p.transport import Timeouts
from blocktrain.protocol.frames import HEADER_BYTES, MAX_FRAME_BYTES, MessageType

HANDSHAKE_S = Timeouts().handshake_s
RESULTS.update({"command": "python experiments/hardening/live_targets.py --json results/hardening/live_targets.json",
                "handshake_timeout_s": HANDSHAKE_S})


def status_field(pid, field) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])  # kB
    raise KeyError(field)


def rss_mib(pid) -> float:
    return round(status_field(pid, "VmRSS") / 1024, 1)


def hwm_mib(pid) -> float:
    return round(status_field(pid, "VmHWM") / 1024, 1)


def fds(pid) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))



def header(mtype, flags, stream_id, length) -> bytes:
    head = struct.pack(">2sBBBBII", b"BT", 1, mtype, flags, 0, stream_id, length)
    h = head + struct.pack(">I", zlib.crc32(head))
    assert len(h) == HEADER_BYTES
    return h


def start_peer(tmp: Path, name: str, args: list[str], port: int) -> subprocess.Popen:
    log = open(tmp / f"{name}.log", "wb")
    p = subprocess.Popen([BT_PEER, *args, "--listen", f"127.0.0.1:{port}", "--swarm-key", str(tmp / "swarm.key"),
                          "--identity", str(tmp / f"{name}.id"), "--quiet"],
                         stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    STARTED.append(p)
    return p


def wait_listening(p, port, tmp, name, timeout=60):
    """Until `bt-peer status` answers (no raw probe socket: it would sit in a pending slot)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if p.poll() is not None:
            raise RuntimeError(f"{name} exited {p.returncode}: {(tmp / f'{name}.log').read_text()[-2000:]}")
        r = subprocess.run([BT_PEER, "status", f"127.0.0.1:{port}", "--swarm-key", str(tmp / "swarm.key"),
                            "--identity", str(tmp / "caller.id"), "--json", "--timeout", "2"],
                           capture_output=True, text=True)
        if r.returncode == 0:
            return json.loads(r.stdout)
        time.sleep(0.5)
    raise RuntimeError(f"{name} did not answer status within {timeout} s")


CONNECT_TIMES: list[float] = []


def open_socks(port, n) -> list[socket.socket]:
    socks = []
    for _ in range(n):
        try:
            t = time.monotonic()
            socks.append(socket.create_connection(("127.0.0.1", port), timeout=5))
            CONNECT_TIMES.append(time.monotonic() - t)
        except OSError as e:
            print(json.dumps({"open_failed_after": len(socks), "error": str(e)}), flush=True)
            break
    return socks


def closed_by_peer(socks, wait_s=0.0) -> int:
    """How many of ``socks`` the peer has closed (EOF or reset), reading whatever it sent first."""
    n = 0
    deadline = time.monotonic() + wait_s
    pending = list(socks)
    while True:
        rest = []
        for s in pending:
            s.setblocking(False)
            try:
                while True:
                    d = s.recv(65536)
                    if not d:
                        n += 1
                        break
            except BlockingIOError:
                rest.append(s)
            except OSError:
                n += 1
        pending = rest
        if not pending or time.monotonic() >= deadline:
            return n
        time.sleep(0.05)


def close_all(socks):
    for s in socks:
        try:
            s.close()
        except OSError:
            pass


# --- target 1 ------------------------------------------------------------------------------------
def target1(tmp: Path):
    port = free_port()
    p = start_peer(tmp, "victim", ["start", "--no-train"], port)
    wait_listening(p, port, tmp, "victim")
    time.sleep(1.0)
    pid = p.pid

    # (a) 16 MiB headers, 5 waves of 64
    hdr = header(MessageType.HANDSHAKE, 0, 0, MAX_FRAME_BYTES)
    rss0, hwm0 = rss_mib(pid), hwm_mib(pid)
    waves = []
    for w in range(5):
        socks = open_socks(port, 64)
        sent = 0
        for s in socks:
            try:
                s.sendall(hdr)
                sent += 1
            except OSError:
                pass
        closed = closed_by_peer(socks, wait_s=2.0)
        waves.append({"wave": w + 1, "connections": len(socks), "headers_sent": sent, "closed_by_peer_within_2s": closed,
                      "rss_mib": rss_mib(pid)})
        close_all(socks)
    time.sleep(1.0)
    rss_after, hwm_after = rss_mib(pid), hwm_mib(pid)
    # (a2) 64 connections that send a valid handshake message 1 (with a wrong swarm key), read
    # message 2, then announce message 3 at the handshake limit (65,535 bytes) and send all but its
    # last byte, held open: the most a pending handshake may make the peer buffer
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
    from blocktrain.p2p.transport import CLIENT_INFO, make_connection
    from blocktrain.protocol import Role
    socks = open_socks(port, 64)
    got_msg2 = 0
    for s in socks:
        try:
            s.sendall(make_connection(Role.INITIATOR, X25519PrivateKey.generate(), os.urandom(32),
                                      info=CLIENT_INFO).initiate())
            s.settimeout(5)
            if len(s.recv(65536)) >= HEADER_BYTES:
                got_msg2 += 1
            s.sendall(header(MessageType.HANDSHAKE, 0, 0, 65535) + os.urandom(65534))
        except OSError:
            pass
    time.sleep(1.5)
    a2 = {"connections": len(socks), "message_2_received": got_msg2, "rss_mib_while_held": rss_mib(pid),
          "fds_while_held": fds(pid), "closed_by_peer_within_1_5s": closed_by_peer(socks)}
    close_all(socks)
    time.sleep(30.0)
    rss_30 = rss_mib(pid)
    growth = round(max(rss_after, rss_30, a2["rss_mib_while_held"]) - rss0, 1)
    out("target1a_16mib_headers", {
        "waves": waves, "rss_before_mib": rss0, "rss_after_waves_mib": rss_after, "rss_30s_later_mib": rss_30,
        "vmhwm_before_mib": hwm0, "vmhwm_after_mib": hwm_after, "peak_growth_mib": round(hwm_after - hwm0, 1),
        "handshake_limit_frames_64x65535": a2, "max_growth_mib": growth, "target_mib": 16, "met": growth <= 16})

    # (b) 1,000 idle sockets, left open
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 1400:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(max(1400, soft), hard), hard))
    peer_limit = int(next(l.split()[3] for l in open(f"/proc/{pid}/limits") if l.startswith("Max open files")))
    time.sleep(HANDSHAKE_S + 1)  # the (a2) connections were closed: let the peer settle
    base = fds(pid)
    t0 = time.monotonic()
    CONNECT_TIMES.clear()
    socks = open_socks(port, 1000)
    t_open = time.monotonic() - t0
    ct = sorted(CONNECT_TIMES)
    t_last = time.monotonic()
    series, peak, back = [], 0, None
    while time.monotonic() - t_last < HANDSHAKE_S + 10:
        n = fds(pid)
        peak = max(peak, n)
        series.append((round(time.monotonic() - t_last, 2), n))
        if n <= base and back is None:
            back = round(time.monotonic() - t_last, 2)
            break
        time.sleep(0.2)
    closed = closed_by_peer(socks)
    at_open = fds(pid)
    # thin the series for the JSON: every change, plus the ends
    thin = [s for i, s in enumerate(series) if i in (0, len(series) - 1) or s[1] != series[i - 1][1]]
    out("target1b_idle_sockets", {
        "sockets_opened": len(socks), "seconds_to_open": round(t_open, 2),
        "connect_s_median_p99_max": [round(ct[len(ct) // 2], 4), round(ct[int(len(ct) * 0.99)], 4), round(ct[-1], 4)],
        "connects_over_0_5s": sum(t > 0.5 for t in ct), "our_fd_soft_limit": resource.getrlimit(
            resource.RLIMIT_NOFILE)[0], "peer_fd_limit": peer_limit, "peer_fds_baseline": base, "peer_fds_peak": peak,
        "peer_fds_over_time_s_after_last_open": thin, "seconds_to_baseline_after_last_open": back,
        "our_sockets_closed_by_peer": closed, "peer_fds_at_end": at_open,
        "met": back is not None and back <= HANDSHAKE_S + 0.5,
        "note": f"target: back to baseline within the handshake timeout ({HANDSHAKE_S} s); met allows 0.5 s for "
                "the event loop's timer and the 0.2 s sampling"})
    close_all(socks)

    # (c) status latency with 0, 64, 200 silent sockets
    time.sleep(1.0)
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
    from blocktrain.p2p.identity import load_swarm_key
    from blocktrain.p2p.view import query_status
    key = load_swarm_key(str(tmp / "swarm.key"))
    cmd = [BT_PEER, "status", f"127.0.0.1:{port}", "--swarm-key", str(tmp / "swarm.key"), "--identity",
           str(tmp / "caller.id"), "--json"]
    res = {"command": " ".join(["bt-peer"] + cmd[1:]).replace(str(tmp), "TMP")}
    for n in (0, 64, 200):
        cli, inproc, ok, held = [], [], 0, []
        for _ in range(5):
            socks = open_socks(port, n)
            time.sleep(0.3)
            held.append(fds(pid))
            t = time.monotonic()
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
            cli.append(round(time.monotonic() - t, 3))
            if r.returncode == 0 and json.loads(r.stdout).get("peer_id"):
                ok += 1
            else:
                res.setdefault("failures", []).append({"silent": n, "rc": r.returncode, "stderr": r.stderr[-300:]})
            t = time.monotonic()
            try:
                asyncio.run(query_status("127.0.0.1", port, X25519PrivateKey.generate(), key,
                                         Timeouts(connect_s=10, handshake_s=10)))
                inproc.append(round(time.monotonic() - t, 3))
            except Exception as e:  # noqa: BLE001  (a measurement: record what happened)
                inproc.append(None)
                res.setdefault("failures", []).append({"silent": n, "in_process": str(e)[:300]})
            close_all(socks)
            time.sleep(0.2)
        res[f"silent_{n}"] = {"cli_wall_s": cli, "cli_median_s": statistics.median(cli), "answered": ok,
                              "in_process_query_status_s": inproc,
                              "in_process_median_s": statistics.median([x for x in inproc if x is not None] or [0]),
                              "peer_fds_while_held": held}
    res["met"] = all(res[f"silent_{n}"]["cli_median_s"] <= 1.0 and res[f"silent_{n}"]["answered"] == 5
                     for n in (64, 200))
    out("target1c_status_latency", res)
    out("target1_victim_alive_at_end", p.poll() is None)
    stop(p)


# --- target 5 ------------------------------------------------------------------------------------
async def fetch_killing_first(tmp, a_addr, b_addr, pa, size):
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
    from blocktrain.p2p.checkpoints import CheckpointFetcher
    from blocktrain.p2p.identity import load_swarm_key
    from blocktrain.p2p.node import Peer
    me = await Peer(X25519PrivateKey.generate(), load_swarm_key(str(tmp / "swarm.key")), "127.0.0.1", 0,
                    timeouts=Timeouts(heartbeat_s=0.5, dead_after_s=30)).start()
    try:
        fetcher = CheckpointFetcher(me, chunk_timeout_s=20)
        t0 = time.monotonic()
        task = asyncio.ensure_future(fetcher.fetch([a_addr, b_addr], "checkpoint", "big"))
        at_kill = None
        while not task.done() and time.monotonic() - t0 < 60:
            got = fetcher.received_by_kind.get("checkpoint", 0)
            if got >= size // 2:
                os.kill(pa.pid, signal.SIGKILL)
                at_kill = {"received_bytes": got, "seconds": round(time.monotonic() - t0, 2)}
                break
            await asyncio.sleep(0.005)
        data = await asyncio.wait_for(task, 60)
        secs = round(time.monotonic() - t0, 2)
        rep = me.traffic_report()
        return data, fetcher.received_by_kind.get("checkpoint", 0), at_kill, secs, rep
    finally:
        await me.stop()


def target5(tmp: Path):
    size = 24 * 1024 * 1024
    x, y = os.urandom(size), os.urandom(size)
    files = {"a": {"big": x}, "b": {"big": y, "big.r7": x}}
    procs, addrs = {}, {}
    for name, extra in (("a", ["--link", "rate=40"]), ("b", [])):
        d = tmp / f"work-{name}" / "serve" / "checkpoint"
        d.mkdir(parents=True)
        for n, blob in files[name].items():
            (d / f"{n}.safetensors").write_bytes(blob)
        port = free_port()
        procs[name] = start_peer(tmp, f"holder-{name}", ["start", "--block", "1", "--steps", "2",
                                                          "--work-dir", str(tmp / f"work-{name}"),
                                                          "--report", str(tmp / f"report-{name}.json"),
                                                          "--report-every", "0.5", *TINY, *extra], port)
        addrs[name] = f"127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    for name, p in procs.items():  # trained (2 steps per block) and now only serving
        while True:
            try:
                if json.loads((tmp / f"report-{name}.json").read_text()).get("training", {}).get("state") == "done":
                    break
            except (OSError, ValueError):
                pass
            if p.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"holder {name} did not finish training: "
                                   f"{(tmp / f'holder-{name}.log').read_text()[-2000:]}")
            time.sleep(0.5)
    data, received, at_kill, secs, rep = asyncio.run(fetch_killing_first(tmp, addrs["a"], addrs["b"], procs["a"], size))
    procs["a"].wait(10)
    time.sleep(1.5)  # holder B's report (every 0.5 s)
    b_sent = None
    try:
        rb = json.loads((tmp / "report-b.json").read_text())
        b_sent = rb.get("by_kind", {}).get("sent", {}).get("checkpoint")
    except (OSError, ValueError):
        pass
    by_kind = rep.get("by_kind", {}).get("received", {}).get("checkpoint")
    out("target5_resume_across_holders", {
        "measure": "live holder processes (bt-peer start --block 1, A shaped to 40 Mbit/s), fetcher in-process "
                   "(Peer + CheckpointFetcher in this script)",
        "file_bytes": size, "chunk_bytes": 4 * 1024 * 1024, "received_when_holder_a_killed": at_kill,
        "verified_identical": data == x, "payload_bytes_received": received, "refetched_bytes": received - size,
        "fetcher_traffic_checkpoint_received": by_kind, "holder_b_report_checkpoint_sent": b_sent,
        "seconds": secs, "met": data == x and received - size == 0 and at_kill is not None})
    out("target5_holder_b_alive_at_end", procs["b"].poll() is None)
    for p in procs.values():
        stop(p)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default="results/hardening/live_targets.json")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bt-live-targets-"))
    t0 = time.monotonic()
    try:
        out("code", provenance())
        subprocess.run([BT_PEER, "keygen", "--out", str(tmp / "swarm.key")], check=True, capture_output=True)
        target1(tmp)
        target5(tmp)
    finally:
        finish(t0, args.json, tmp)

if __name__ == "__main__":
    main()
