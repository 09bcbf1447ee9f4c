"""In-memory peers for driving services without sockets: ``FakePeer`` implements ``PeerServices``
(p2p/services.py) and nothing more, so a service that reaches past the interface fails here.

Every message crosses a ``FakeConnection`` as wire bytes (``frame_message`` at send time, parsed by a
``MessageReader`` at the other end on a later turn of the loop): what a service sends is snapshotted
when sent, and what arrives was decoded as a real peer would decode it. All peers of a ``FakeNet``
are members of each other; ``leave`` takes one out (its connections close, the others see it LEFT).
"""

from __future__ import annotations

import asyncio

from blocktrain.p2p.services import Change, Liveness, MembershipEvent, MemberView, PeerServices, PeerUnreachable
from blocktrain.p2p.transport import Timeouts
from blocktrain.p2p.waiters import Waiters
from blocktrain.protocol.events import MessageReader, frame_message


class FakeConnection:
    """One side of an in-memory link from ``src`` to ``dst``."""

    def __init__(self, src: "FakePeer", dst: "FakePeer"):
        self.src, self.dst = src, dst
        self.closed = asyncio.get_running_loop().create_future()
        self.close_reason = ""
        self.sent_bytes = 0
        self._reader = MessageReader()

    def send_nowait(self, msg, bulk: bool = False) -> None:
        if self.closed.done():
            raise ConnectionError(f"connection to {self.dst.id[:12]} is closed: {self.close_reason}")
        frame = frame_message(msg)
        self.sent_bytes += len(frame)
        asyncio.get_running_loop().call_soon(self.dst.deliver, self.src.id, frame)

    async def send(self, msg, bulk: bool = False) -> None:
        self.send_nowait(msg, bulk)
        await asyncio.sleep(0)

    def release_queued(self, msgs) -> int:
        return 0  # sent messages are bytes already

    def receive(self, frame: bytes):
        """A frame from the other end, decoded as a real peer would decode it."""
        self._reader.feed(frame)
        return self._reader.next_message()

    def close(self, reason: str) -> None:
        if not self.closed.done():
            self.close_reason = reason
            self.closed.set_result(None)


class FakeNet:
    def __init__(self):
        self.peers: dict[str, FakePeer] = {}

    def peer(self, n: int, blocks=(), role: str = "train") -> "FakePeer":
        p = FakePeer(self, f"{n:02x}" * 32, blocks, role)
        for other in self.peers.values():
            other.emit(Change.JOINED, p)
        self.peers[p.id] = p
        return p

    def leave(self, p: "FakePeer") -> None:
        del self.peers[p.id]
        for other in self.peers.values():
            for c in (other.conns.pop(p.id, None), p.conns.pop(other.id, None)):
                if c is not None:
                    c.close("left")
            other.emit(Change.LEFT, p)


class FakePeer:
    def __init__(self, net: FakeNet, pid: str, blocks, role: str):
        self.net, self.id, self.blocks, self.role = net, pid, tuple(blocks), role
        self.addr = f"fake:{pid[:8]}"
        self.timeouts = Timeouts(connect_s=2, handshake_s=2, heartbeat_s=0.2, dead_after_s=30, close_s=1)
        self.conns: dict[str, FakeConnection] = {}
        self.sections: dict = {}
        self._handlers: dict = {}
        self._subscribers: list = []
        self._waiters = Waiters(lambda: False)
        self._tasks: set = set()

    # --- the PeerServices interface --------------------------------------------------------------
    def on(self, msg_type: type, handler, *, inline: bool = False) -> None:
        self._handlers.setdefault(msg_type, []).append((handler, inline))  # every subscriber hears it

    def members(self, *, block=None, role=None, alive: bool = True) -> list[MemberView]:
        return [self._view(p) for pid, p in sorted(self.net.peers.items()) if pid != self.id
                and (block is None or block in p.blocks) and (role is None or p.role == role)]

    def member(self, peer_id: str) -> MemberView | None:
        p = self.net.peers.get(peer_id) or next((q for q in self.net.peers.values() if q.addr == peer_id), None)
        return self._view(p) if p is not None and p.id != self.id else None

    async def connection(self, peer: str) -> FakeConnection:
        pc = self.live_connection(peer)
        if pc is None:
            raise PeerUnreachable(peer, peer, "not in the fake net")
        return pc

    def settled(self) -> bool:
        return True

    def live_connection(self, peer: str) -> FakeConnection | None:
        m = self.member(peer)
        if m is None:
            return None
        if m.peer_id not in self.conns:
            self.conns[m.peer_id] = FakeConnection(self, self.net.peers[m.peer_id])
        return self.conns[m.peer_id]

    def client_connection(self, peer_id: str) -> None:
        return None

    def on_membership(self, callback):
        self._subscribers.append(callback)
        return lambda: self._subscribers.remove(callback)

    async def wait_for(self, predicate, timeout: float | None = None) -> bool:
        return await self._waiters.wait_for(predicate, timeout)

    def notify(self) -> None:
        self._waiters.notify()

    def spawn(self, coro, name: str) -> asyncio.Task:
        t = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)
        return t

    def report_section(self, name: str, fn) -> None:
        self.sections[name] = fn

    def write_report(self) -> None:
        pass

    def status(self) -> dict:
        return {"peer_id": self.id, "addr": self.addr, "blocks": list(self.blocks), "role": self.role,
                "members": [{"peer_id": m.peer_id, "addr": m.addr} for m in self.members()],
                "traffic": self.traffic_totals(), **{k: f() for k, f in self.sections.items() if k == "work"}}

    def report(self) -> dict:
        return {"peer_id": self.id, "totals": self.traffic_totals(), **{k: f() for k, f in self.sections.items()}}

    def traffic_totals(self) -> dict:
        sent = sum(c.sent_bytes for c in self.conns.values())
        got = sum(p.conns[self.id].sent_bytes for p in self.net.peers.values() if self.id in p.conns)
        return {"sent": {"wire_bytes": sent}, "received": {"wire_bytes": got}}

    # --- the fake net's side -----------------------------------------------------------------------
    def _view(self, p: "FakePeer") -> MemberView:
        return MemberView(p.id, p.addr, p.blocks, p.role, Liveness.ALIVE, 0.0)

    def emit(self, change: Change, p: "FakePeer") -> None:
        for cb in list(self._subscribers):
            cb(MembershipEvent(change, p.id, p.addr))
        self.notify()

    def deliver(self, src: str, frame: bytes) -> None:
        """A frame from ``src`` arrives: decoded, then handed to the handler of its type."""
        if src not in self.net.peers or self.id not in self.net.peers:
            return  # one of us left meanwhile
        back = self.live_connection(src)
        assert back is not None
        msg = back.receive(frame)
        for handler, inline in self._handlers.get(type(msg), ()):
            if inline:
                handler(msg, back, src)
            else:
                self.spawn(handler(msg, back, src), f"handle {type(msg).__name__}")

    async def stop(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


def _is_peer_services(p: PeerServices) -> PeerServices:
    return p  # for a type checker: FakePeer is a PeerServices
