"""The kernel WAN path: hosts in Linux network namespaces, veth to a bridge, tc rate limits,
and a userspace delay relay (this kernel has no netem).

Rules:
- Every namespace, link and process here is this module's own, named with a per-run prefix,
  and removed by ``NetnsLab.down()`` (also on errors). Addresses are in 198.18.0.0/24, the
  benchmarking range (RFC 2544), and exist only inside these namespaces.
- Rate: an HTB class on each host's egress. Delay: each host runs a relay that listens on
  ``RELAY_PORT`` and forwards to its own service port, holding every chunk for ``delay_ms`` in
  both directions; peers advertise the relay's address, so every connection to a host crosses
  its relay: one-way delay ``delay_ms`` each way. Where tc netem exists, ``netem=True`` uses it
  instead. Every report says which ran.
- Needs root and iproute2; ``available()`` says why not, and tests skip on it.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys

RELAY_PORT = 9000
SUBNET = "198.18.0"


def _run(*cmd: str, check=True) -> subprocess.CompletedProcess:
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if check and p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {p.stderr.strip()}")
    return p


def available() -> str | None:
    """None when the kernel path can run here, else the reason it cannot."""
    if os.geteuid() != 0:
        return "needs root (network namespaces and tc)"
    if not shutil.which("ip") or not shutil.which("tc"):
        return "needs iproute2 (ip, tc)"
    name = f"btprobe{os.getpid()}"
    p = _run("ip", "netns", "add", name, check=False)
    if p.returncode != 0:
        return f"cannot create a network namespace: {p.stderr.strip()}"
    _run("ip", "netns", "del", name, check=False)
    return None


def netem_available() -> bool:
    p = _run("tc", "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms", check=False)
    if p.returncode == 0:
        _run("tc", "qdisc", "del", "dev", "lo", "root", check=False)
        return True
    return False


class NetnsLab:
    def __init__(self, hosts: int, rate_mbit: float, delay_ms: float):
        self.n, self.rate_mbit, self.delay_ms = hosts, rate_mbit, delay_ms
        self.prefix = f"bt{os.getpid() % 100000}"
        self.sw = f"{self.prefix}sw"
        self.procs: list[subprocess.Popen] = []
        self.netem = False
        self.delay_via = "none"

    def ns(self, i: int) -> str:
        return f"{self.prefix}h{i}"

    def ip(self, i: int) -> str:
        return f"{SUBNET}.{i + 1}"

    def relay_addr(self, i: int) -> str:
        return f"{self.ip(i)}:{RELAY_PORT}"

    def up(self, service_port: int = 7000):
        try:
            _run("ip", "netns", "add", self.sw)
            _run("ip", "netns", "exec", self.sw, "ip", "link", "add", "br0", "type", "bridge")
            _run("ip", "netns", "exec", self.sw, "ip", "link", "set", "br0", "up")
            self.netem = bool(self.delay_ms) and netem_available()
            for i in range(self.n):
                ns, a, b = self.ns(i), f"{self.prefix}a{i}", f"{self.prefix}b{i}"
                _run("ip", "netns", "add", ns)
                _run("ip", "link", "add", a, "type", "veth", "peer", "name", b)
                _run("ip", "link", "set", a, "netns", ns)
                _run("ip", "link", "set", b, "netns", self.sw)
                _run("ip", "netns", "exec", self.sw, "ip", "link", "set", b, "master", "br0")
                _run("ip", "netns", "exec", self.sw, "ip", "link", "set", b, "up")
                _run("ip", "netns", "exec", ns, "ip", "link", "set", a, "name", "eth0")
                _run("ip", "netns", "exec", ns, "ip", "addr", "add", f"{self.ip(i)}/24", "dev", "eth0")
                _run("ip", "netns", "exec", ns, "ip", "link", "set", "eth0", "up")
                _run("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
                if self.rate_mbit:
                    _run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "eth0", "root", "handle", "1:",
                         "htb", "default", "1")
                    _run("ip", "netns", "exec", ns, "tc", "class", "add", "dev", "eth0", "parent", "1:", "classid",
                         "1:1", "htb", "rate", f"{self.rate_mbit}mbit")
                    if self.netem:
                        _run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "eth0", "parent", "1:1",
                             "netem", "delay", f"{self.delay_ms}ms")
                elif self.netem:
                    _run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "eth0", "root", "netem", "delay",
                         f"{self.delay_ms}ms")
                # the relay: delay in userspace where netem is missing, a plain forwarder otherwise
                relay_delay = 0.0 if self.netem else self.delay_ms
                self.procs.append(subprocess.Popen(
                    ["ip", "netns", "exec", ns, sys.executable, "-m", "blocktrain.bench.netns", "relay",
                     f"0.0.0.0:{RELAY_PORT}", f"127.0.0.1:{service_port}", str(relay_delay)]))
            self.delay_via = ("tc netem" if self.netem else "userspace relay") if self.delay_ms else "none"
        except BaseException:
            self.down()
            raise
        return self

    def spawn(self, i: int, argv: list[str], **kw) -> subprocess.Popen:
        p = subprocess.Popen(["ip", "netns", "exec", self.ns(i), *argv], **kw)
        self.procs.append(p)
        return p

    def down(self):
        for p in self.procs:  # ours, by pid
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        self.procs.clear()
        for i in range(self.n):
            _run("ip", "netns", "del", self.ns(i), check=False)
        _run("ip", "netns", "del", self.sw, check=False)

    def __enter__(self):  # ``with NetnsLab(...) as lab:`` brings it up and always down
        return self.up()

    def __exit__(self, *exc):
        self.down()


# --- the delay relay (runs inside a namespace) ------------------------------------------------

# Bytes a relay holds per direction before it stops reading (bounded memory).
RELAY_MAX_BUFFER_BYTES = 16 * 1024 * 1024


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay_s: float):
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    held = 0

    async def sender():
        nonlocal held
        while True:
            due, data = await queue.get()
            if data is None:
                break
            wait = due - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            writer.write(data)
            held -= len(data)
            await writer.drain()
        writer.close()

    task = loop.create_task(sender())
    try:
        while True:
            data = await reader.read(256 * 1024)
            if not data:
                break
            held += len(data)
            queue.put_nowait((loop.time() + delay_s, data))
            while held > RELAY_MAX_BUFFER_BYTES:
                await asyncio.sleep(0.001)
    finally:
        queue.put_nowait((0.0, None))
        await task


async def relay(listen: str, target: str, delay_ms: float):
    lh, _, lp = listen.rpartition(":")
    th, _, tp = target.rpartition(":")
    delay_s = delay_ms / 1e3

    async def handle(r1, w1):
        try:
            r2, w2 = await asyncio.open_connection(th, int(tp))
        except OSError:
            w1.close()
            return
        await asyncio.gather(_pump(r1, w2, delay_s), _pump(r2, w1, delay_s), return_exceptions=True)

    server = await asyncio.start_server(handle, lh, int(lp))
    async with server:
        await server.serve_forever()


def main(argv):
    if argv and argv[0] == "relay":
        asyncio.run(relay(argv[1], argv[2], float(argv[3])))
    else:
        print("usage: python -m blocktrain.bench.netns relay LISTEN TARGET DELAY_MS", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main(sys.argv[1:])
