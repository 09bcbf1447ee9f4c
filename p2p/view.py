"""The client's view of the swarm: what a status reply says, who holds a block, a serving chain.

Rules:
- A client (generate, assemble, status) is never a member: it sees the swarm through one
  member's status reply (node.status_when_listening, the clients' one rule). ``status_members``
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

from .node import status_when_listening
from .serving import PipelineError

MAX_ROUTE_BLOCKS = 256  # bound on a peer's word for how many blocks a model has


class NoChain(PipelineError):
    """The swarm has no live serving peer for some block."""


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
        if alive and get("role") == role and block in get("blocks"):
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
    ask again for up to ``wait_s`` (the clients' one rule: node.status_when_listening)."""
    def ready(st):
        try:
            chain(st, avoid)
            return True
        except NoChain as e:
            return f"no chain through the swarm yet ({e})"
    st = await status_when_listening(host, port, ident, key, tmo, wait_s, log, ready)
    return st, chain(st, avoid)
