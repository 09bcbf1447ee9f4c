import os

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
