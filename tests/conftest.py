import os
from importlib.metadata import entry_points

import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from blocktrain.protocol import NEED_DATA, Connection, Role

torch.set_num_threads(1)


class ConnectionPair:
    """Two sans-IO Connections joined by a fake link (no sockets)."""

    def __init__(self, psk_a=None, psk_b=None, seal=(True, True), allow_a=None, allow_b=None):
        psk = os.urandom(32)
        self.key_a, self.key_b = X25519PrivateKey.generate(), X25519PrivateKey.generate()
        self.a = Connection(Role.INITIATOR, self.key_a, psk_a or psk, seal=seal[0], allowlist=allow_a,
                            info={"who": "a"})
        self.b = Connection(Role.RESPONDER, self.key_b, psk_b or psk, seal=seal[1], allowlist=allow_b,
                            info={"who": "b"})

    @staticmethod
    def drain(conn):
        out = []
        while True:
            ev = conn.next_event()
            if ev is NEED_DATA:
                return out
            out.append(ev)

    def deliver(self, src, dst, data=None):
        data = src.data_to_send() if data is None else data
        dst.receive_data(data)
        return self.drain(dst)

    def handshake(self):
        self.b.receive_data(self.a.initiate())
        assert self.drain(self.b) == []
        assert self.deliver(self.b, self.a) == []  # message 2 read, message 3 queued
        ev_b = self.deliver(self.a, self.b)  # message 3 read, confirmation queued
        ev_a = self.deliver(self.b, self.a)
        return ev_a, ev_b


@pytest.fixture
def pair():
    return ConnectionPair()


async def mesh(n: int, timeouts, blocks=(), psk: bytes | None = None) -> list:
    """n started peers on loopback, all joined through the first, full membership awaited (bounded).
    ``blocks``: every peer's blocks, or a list of them, one per peer."""
    from blocktrain.p2p.node import Peer

    psk = psk or os.urandom(32)
    peers = []
    per_peer = list(blocks) if blocks and isinstance(blocks[0], tuple) else [blocks] * n
    for i in range(n):
        p = await Peer(X25519PrivateKey.generate(), psk, "127.0.0.1", 0, blocks=per_peer[i], timeouts=timeouts).start()
        if peers:
            await p.join("127.0.0.1", peers[0].port)
        peers.append(p)
    for p in peers:  # bounded: membership events wake the wait
        await p.wait_for(lambda p=p: len(p.members()) == n - 1, 10.0)
    return peers


def crash(peer):
    """Make ``peer`` vanish as a killed process would: no Goodbye, sockets dropped, nothing answers."""
    peer._stopping = True
    if peer._server is not None:
        peer._server.close()
    for t in list(peer._tasks):
        t.cancel()
    for v in peer.members(alive=False):
        pc = peer.live_connection(v.peer_id)
        if pc is not None:
            pc.abort("crash")


def run_rounds(rounds: dict) -> int:
    """Sans-IO averaging rounds (member id -> AveragingRound) run to the end, every message
    delivered in order; the payload bytes they sent."""
    queue = [(p, part) for p, r in rounds.items() for part in r.start()]
    sent = 0
    while queue:
        src, part = queue.pop(0)
        sent += part.stored_bytes
        queue += [(part.peer, q) for q in rounds[part.peer].receive(src, part.msg)]
    return sent


# The commands as installed: pyproject's [project.scripts] entry points, loaded by name (tests
# drive the commands, not the CLI modules behind them).
COMMANDS = {e.name: e.load() for e in entry_points(group="console_scripts") if e.dist and e.dist.name == "blocktrain"}
