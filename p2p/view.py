"""The client's view of the swarm: what a status reply says, who holds a block, a serving chain.

Rules:
- A client (generate, assemble, status) is never a member: it sees the swarm through one
  member's status reply (``status_when_listening``, the clients' one rule). ``status_members``
  reads the reply's members, the answering peer included; nothing else parses a reply's members.
- ``holders`` reads a member list the same way whether it comes from a status reply (dicts) or
  from a peer's own membership (MemberViews): live members with the role that hold the block,
  smallest peer id first.
- ``chain`` is one live serving peer per block 0..K-1, the first holder of each, avoiding the
  peers that failed; a block nobody serves is ``NoChain`` naming it. K is the model's blocks as
  the answering peer says (bounded by MAX_ROUTE_BLOCKS), else the highest served block + 1.
- Pure functions over a reply, except ``chain_when_ready``, which asks for the reply.
"""

from __future__ import annotations

import asyncio
import time

from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from blocktrain.protocol import ConnectionClosed, Role, Status

from .transport import CLIENT_INFO, Timeouts, make_connection, open_connection

MAX_ROUTE_BLOCKS = 256  # bound on a peer's word for how many blocks a model has


async def query_status(host: str, port: int, identity: X25519PrivateKey, swarm_key: bytes,
                       timeouts: Timeouts = Timeouts()) -> dict:
    """Ask one peer for its view of the swarm (as a client, never a member). A peer that has no
    address to advertise yet (it listens on 0.0.0.0: reach.py) is given the one we reached it at."""
    conn = make_connection(Role.INITIATOR, identity, swarm_key, info=CLIENT_INFO)
    pc = await open_connection(host, port, conn, timeouts, name=f"{host}:{port}")
    try:
        pc.send_nowait(Status(status={}))
        while True:
            async with asyncio.timeout(timeouts.handshake_s):
                msg = await pc.recv()
            if isinstance(msg, Status):
                if isinstance(msg.status, dict) and msg.status.get("addr") == "":
                    return {**msg.status, "addr": f"{host}:{port}"}
                return msg.status
            if isinstance(msg, ConnectionClosed):
                raise ConnectionError(f"{host}:{port} closed before answering: {msg.reason}")
    except TimeoutError:
        raise ConnectionError(f"{host}:{port} did not answer within {timeouts.handshake_s} s") from None
    finally:
        await pc.close("done", linger=False)


class NothingListens(ConnectionRefusedError):
    """Nothing listened at a client's address for as long as it was told to wait."""


async def status_when_listening(host: str, port: int, identity: X25519PrivateKey, swarm_key: bytes,
                                timeouts: Timeouts = Timeouts(), wait_s: float = 0.0, log=lambda s: None,
                                ready=lambda st: True) -> dict:
    """The one rule of every client command (status, generate, assemble): ask HOST:PORT for its
    status; while nothing listens there (connection refused: a peer still starting) or its answer
    is not ``ready`` yet, ask again with backoff for up to ``wait_s`` seconds, saying so in one
    line when the waiting begins. Any other failure (a wrong key, no answer within the timeouts)
    is raised at once. NothingListens names how long it waited and how often it asked."""
    t0, delay, tries, said = time.monotonic(), 0.1, 0, False
    while True:
        tries += 1
        try:
            st = await query_status(host, port, identity, swarm_key, timeouts)
            why = ready(st)
            if why is True:
                return st
        except ConnectionRefusedError:
            st, why = None, f"nothing listens at {host}:{port} yet (a peer still starting?)"
        if time.monotonic() - t0 + delay > wait_s:
            if st is not None:
                return st  # the caller says what is missing from the answer
            raise NothingListens(f"nothing listens at {host}:{port} (connection refused; asked {tries} time(s) in "
                                 f"{time.monotonic() - t0:.0f} s: is the peer running? --wait asks for longer)")
        if not said:
            said = True
            log(f"{why}; asking again for up to {wait_s:g} s (--wait)")
        await asyncio.sleep(delay)  # backoff, as the node's join
        delay = min(2 * delay, 2.0)



class NoChain(Exception):
    """The swarm has no live serving peer for ``block`` (None: for any block)."""

    def __init__(self, msg: str, block: int | None = None):
        super().__init__(msg)
        self.block = block


def status_members(st: dict) -> list[dict]:
    """The members of a status reply, the answering peer included (as a live member)."""
    me = {"peer_id": st["peer_id"], "addr": st["addr"], "blocks": st["blocks"], "role": st["role"], "state": "alive"}
    return [me] + list(st["members"])


def holders(members, block: int, role: str = "train") -> list[str]:
    """Addresses of the live members with ``role`` that hold ``block``, smallest peer id first.
    ``members``: MemberViews, or status-reply member dicts."""
    out = []
    for m in members:
        def get(k: str, m=m):
            return m.get(k) if isinstance(m, dict) else getattr(m, k)
        alive = get("state") == "alive" if isinstance(m, dict) else m.alive
        if alive and get("role") == role and block in get("blocks") and get("addr"):  # "": nobody can dial it
            out.append((get("peer_id"), get("addr")))
    return [a for _, a in sorted(out)]


def chain(st: dict, avoid: set[str] | frozenset[str] = frozenset()) -> list[str]:
    """One live serving peer per block 0..K-1 from a status reply, avoiding ``avoid``."""
    members = [m for m in status_members(st) if m["addr"] not in avoid]
    blocks = sorted({b for m in members if m["role"] == "serve" and m["state"] == "alive" for b in m["blocks"]})
    if not blocks:
        raise NoChain("no live serving peers known" + (f" (avoiding {sorted(avoid)})" if avoid else ""))
    n = (st.get("serving") or {}).get("n_blocks")  # the model's blocks, if the peer asked serves
    n = n if type(n) is int and 1 <= n <= MAX_ROUTE_BLOCKS else max(blocks) + 1
    route = []
    for b in range(n):  # every block: a chain cut short (a peer not yet joined) is refused by hop 0
        h = holders(members, b, "serve")
        if not h:
            raise NoChain(f"no live peer serves block {b}" + (f" (avoiding {sorted(avoid)})" if avoid else ""), b)
        route.append(h[0])
    return route


async def chain_when_ready(host, port, ident, key, tmo, avoid, wait_s: float, log=lambda s: None):
    """The swarm view and a chain through it; while the serving peers are still starting (the peer
    not yet listening, or no chain yet: serving peers join by gossip within a heartbeat or two),
    ask again for up to ``wait_s`` (the clients' one rule: ``status_when_listening``)."""
    def ready(st):
        try:
            chain(st, avoid)
            return True
        except NoChain as e:
            return f"no chain through the swarm yet ({e})"
    st = await status_when_listening(host, port, ident, key, tmo, wait_s, log, ready)
    return st, chain(st, avoid)
