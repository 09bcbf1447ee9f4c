"""``bt-bench transport``: bulk throughput and round trips between two processes on loopback.

Measured in one run, interleaved by repeat: a raw-socket transfer (blocking sockets, reused
buffers: the ceiling), the peers' chunked stream unsealed and sealed, a raw asyncio (uvloop)
ping-pong and the peers' Ping/Pong. The receiver is a separate process in every case.
"""

from __future__ import annotations

import asyncio
import os
import socket
import statistics
import subprocess
import sys
import time

from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from .report import verdict

CHUNK = 4 * 1024 * 1024


# --- receiver side (child process) -----------------------------------------------------------

def _child_raw(port_file: str, total: int):
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    _announce(port_file, srv.getsockname()[1])
    s, _ = srv.accept()
    buf = bytearray(1 << 20)
    mv = memoryview(buf)
    got = 0
    while got < total:
        n = s.recv_into(mv)
        if not n:
            break
        got += n
    s.sendall(b"k")
    s.close()


def _announce(port_file: str, port: int):
    tmp = port_file + ".tmp"
    with open(tmp, "w") as f:
        f.write(str(port))
    os.replace(tmp, port_file)


async def _child_peer(port_file: str, psk: bytes, seal: bool, total: int):
    from blocktrain.p2p.transport import PeerConnection, Timeouts, make_connection
    from blocktrain.protocol import ConnectionClosed, Pong, Role, StreamChunk

    loop = asyncio.get_running_loop()
    done = loop.create_future()

    def factory():
        pc = PeerConnection(make_connection(Role.RESPONDER, X25519PrivateKey.generate(), psk, seal=seal), Timeouts())

        async def serve():
            got = 0
            while True:
                m = await pc.recv()
                if isinstance(m, StreamChunk):
                    got += len(m.data)
                    if got >= total:
                        pc.send_nowait(Pong(nonce=got))
                elif isinstance(m, ConnectionClosed):
                    break
                del m  # release the frame buffer for reuse
            if not done.done():
                done.set_result(None)
        loop.create_task(serve())
        return pc

    server = await loop.create_server(factory, "127.0.0.1", 0)
    _announce(port_file, server.sockets[0].getsockname()[1])
    await done
    server.close()


async def _child_echo(port_file: str):
    loop = asyncio.get_running_loop()
    done = loop.create_future()

    class Echo(asyncio.Protocol):
        def connection_made(self, t):
            self.t = t

        def data_received(self, data):
            self.t.write(data)

        def connection_lost(self, exc):
            if not done.done():
                done.set_result(None)

    server = await loop.create_server(Echo, "127.0.0.1", 0)
    _announce(port_file, server.sockets[0].getsockname()[1])
    await done
    server.close()


def child_main(argv):
    mode, port_file = argv[0], argv[1]
    import uvloop
    if mode == "raw":
        _child_raw(port_file, int(argv[2]))
    elif mode == "echo":
        uvloop.run(_child_echo(port_file))
    else:
        uvloop.run(_child_peer(port_file, bytes.fromhex(argv[2]), mode == "sealed", int(argv[3])))


# --- sender side -------------------------------------------------------------------------------

class _Child:
    def __init__(self, tmpdir, *args):
        self.port_file = os.path.join(tmpdir, f"port-{os.getpid()}-{time.monotonic_ns()}")
        self.proc = subprocess.Popen([sys.executable, "-m", "blocktrain.bench.transport", args[0], self.port_file,
                                      *map(str, args[1:])])
        deadline = time.monotonic() + 60
        while not os.path.exists(self.port_file):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"benchmark receiver {args[0]} did not start")
            time.sleep(0.02)
        self.port = int(open(self.port_file).read())

    def close(self):
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()  # ours, by pid
            self.proc.wait()
        os.unlink(self.port_file)


def raw_transfer(tmpdir, total: int) -> float:
    c = _Child(tmpdir, "raw", total)
    try:
        data = memoryview(os.urandom(CHUNK))
        s = socket.create_connection(("127.0.0.1", c.port))
        t0 = time.perf_counter()
        sent = 0
        while sent < total:
            n = min(CHUNK, total - sent)
            s.sendall(data[:n])
            sent += n
        s.recv(1)
        dt = time.perf_counter() - t0
        s.close()
        return total / dt
    finally:
        c.close()


async def peer_transfer(tmpdir, total: int, seal: bool, pings: int = 0) -> dict:
    from blocktrain.p2p.transport import Timeouts, make_connection, open_connection
    from blocktrain.protocol import Ping, Pong, Role, StreamChunk

    psk = os.urandom(32)
    c = _Child(tmpdir, "sealed" if seal else "plain", psk.hex(), total)
    try:
        pc = await open_connection("127.0.0.1", c.port,
                                   make_connection(Role.INITIATOR, X25519PrivateKey.generate(), psk, seal=seal),
                                   Timeouts())
        data = os.urandom(CHUNK)
        out = {}
        if pings:
            rtts = []
            for i in range(pings):
                t0 = time.perf_counter()
                pc.send_nowait(Ping(nonce=i))
                m = await pc.recv()
                assert isinstance(m, Pong) and m.nonce == i
                rtts.append(time.perf_counter() - t0)
            out["ping_rtt_us"] = statistics.median(rtts) * 1e6
        if total:
            t0 = time.perf_counter()
            off = 0
            while off < total:
                await pc.send(StreamChunk(offset=off, data=data[:min(CHUNK, total - off)], stream_id=1), bulk=True)
                off += CHUNK
            m = await pc.recv()
            assert isinstance(m, Pong) and m.nonce >= total
            out["bytes_per_s"] = total / (time.perf_counter() - t0)
        await pc.close("done")
        return out
    finally:
        c.close()


async def raw_pingpong(tmpdir, n: int) -> float:
    c = _Child(tmpdir, "echo")
    try:
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()

        class Client(asyncio.Protocol):
            def data_received(self, data):
                q.put_nowait(data)

        t, _ = await loop.create_connection(Client, "127.0.0.1", c.port)
        rtts = []
        msg = b"x" * 30  # about a Ping frame
        for _ in range(n):
            t0 = time.perf_counter()
            t.write(msg)
            got = 0
            while got < len(msg):
                got += len(await q.get())
            rtts.append(time.perf_counter() - t0)
        t.close()
        return statistics.median(rtts) * 1e6
    finally:
        c.close()


def run(total_bytes: int = 1 << 30, repeats: int = 3, pings: int = 2000, progress=None) -> dict:
    import tempfile

    import uvloop

    res = {k: [] for k in ("raw", "plain", "sealed", "raw_pingpong_us", "peer_ping_us")}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(repeats):
            res["raw"].append(raw_transfer(tmp, total_bytes))
            res["plain"].append(uvloop.run(peer_transfer(tmp, total_bytes, False))["bytes_per_s"])
            res["sealed"].append(uvloop.run(peer_transfer(tmp, total_bytes, True))["bytes_per_s"])
            res["raw_pingpong_us"].append(uvloop.run(raw_pingpong(tmp, pings)))
            res["peer_ping_us"].append(uvloop.run(peer_transfer(tmp, 0, True, pings))["ping_rtt_us"])
            if progress:
                progress(r + 1, repeats)
    med = {k: statistics.median(v) for k, v in res.items()}
    ratios = {"plain_vs_raw": med["plain"] / med["raw"], "sealed_vs_raw": med["sealed"] / med["raw"],
              "peer_ping_vs_raw_pingpong": med["peer_ping_us"] / med["raw_pingpong_us"]}
    return {
        "benchmark": "transport", "total_bytes": total_bytes, "repeats": repeats, "pings": pings,
        "what": "one stream of total_bytes from this process to a receiver process over loopback: raw blocking "
                "socket, peers' StreamChunk frames unsealed and sealed (AES-256-GCM), 4 MiB chunks; round trips: "
                "raw asyncio echo of 30 bytes vs the peers' sealed Ping/Pong; medians over repeats",
        "runs": res, "median": med,
        "throughput_gbps": {k: med[k] / 1e9 for k in ("raw", "plain", "sealed")},
        "ratios": ratios,
        "targets": {"plain_vs_raw": 0.6, "sealed_vs_raw": 0.4, "peer_ping_vs_raw_pingpong": 2.0},
        "met": {"plain_vs_raw": ratios["plain_vs_raw"] >= 0.6, "sealed_vs_raw": ratios["sealed_vs_raw"] >= 0.4,
                "peer_ping": ratios["peer_ping_vs_raw_pingpong"] <= 2.0},
    }


def rows(r: dict) -> list[tuple[str, str]]:
    """``bt-bench transport``'s report of ``run``'s result: (figure, value) rows."""
    g, q, m, met = r["throughput_gbps"], r["ratios"], r["median"], r["met"]
    return [
        ("raw socket", f"{g['raw']:.2f} GB/s"),
        ("peers, unsealed", f"{g['plain']:.2f} GB/s ({q['plain_vs_raw']:.0%} of raw, target 60%: "
                            f"{verdict(met['plain_vs_raw'])})"),
        ("peers, sealed", f"{g['sealed']:.2f} GB/s ({q['sealed_vs_raw']:.0%} of raw, target 40%: "
                          f"{verdict(met['sealed_vs_raw'])})"),
        ("raw asyncio ping-pong", f"{m['raw_pingpong_us']:.0f} us"),
        ("peers' Ping/Pong", f"{m['peer_ping_us']:.0f} us ({q['peer_ping_vs_raw_pingpong']:.1f}x raw, target <= 2x: "
                             f"{verdict(met['peer_ping'])})"),
    ]


if __name__ == "__main__":
    child_main(sys.argv[1:])
