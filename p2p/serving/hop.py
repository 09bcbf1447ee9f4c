"""The plan of one hop: what a serving hop checks in a request and where the request goes next, a
pure function of the request and the served state (no I/O, no clock, no task).

Rules:
- ``plan_hop(msg, sender, state)`` reads a PipelineForward and the hop's state (``HopState``: the
  blocks this peer serves, who is a member, which live member serves which block, the requests
  in flight and the sessions running here) and returns a ``HopPlan``; server.py runs it
  (expire, compute, forward or answer, relay the errors). The plan changes nothing.
- The client is who sent hop 0 over its authenticated connection, never a name in the request;
  later hops take ``reply_to`` from the member below, which checked it at hop 0.
- An error relayed from a hop below (meta "error") goes to the client only from a member, at the
  last hop (RELAY); anything else is dropped (IGNORE).
- Checks, in this order and all before any compute: the mode; reply_to and session; the codec;
  the route (hop 0 from the client itself, later hops only from members; this peer serves the
  block; one hop per block 0..K-1; the next hop a live member serving the next block); a spec or
  else ``end`` (END: free the session's caches along the chain); the spec (``decode.check_spec``);
  the client's requests in flight here; one traversal at a time per session (COMPUTE).
- A failed check is a plan of step REFUSE carrying the failure (every failure is answered).
  ``served`` is set once the route check passed: the run expires idle sessions from then on.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Mapping, Protocol

from blocktrain.blocks.decode import BadSpec, check_spec
from blocktrain.protocol import PipelineForward

from .api import DEFAULT_CODEC, FORWARDED, HIDDEN_CODECS, MODES, PipelineError, bad_request, block_at

if TYPE_CHECKING:
    from blocktrain.blocks.model import Block

MAX_INFLIGHT_PER_CLIENT = 8  # requests of one client computing or waiting at one hop


class Step(enum.Enum):
    RELAY = "relay"  # an error from a hop below: pass it to the client
    IGNORE = "ignore"  # an error relay this hop must not pass on
    REFUSE = "refuse"  # a check failed: answer the failure
    END = "end"  # free the session's caches here, then along the chain
    COMPUTE = "compute"  # run the block on the session's caches, then forward or answer


class HopState(Protocol):
    """What a hop's plan reads of the hop (PipelineServer; a plain object in tests)."""

    @property
    def addr(self) -> str:
        """This peer's listen address."""

    def held(self, mode: str) -> Mapping[int, Block]:
        """The blocks served in ``mode``, by index."""

    def is_member(self, peer_id: str) -> bool:
        """Whether ``peer_id`` is a member of the swarm."""

    def serves(self, addr: str, block: int | None) -> bool:
        """Whether the live member at ``addr`` serves ``block``."""

    def in_flight(self, client: str) -> int:
        """The client's requests computing or waiting here."""

    def is_busy(self, key: tuple) -> bool:
        """Whether the session ``key`` has a traversal running here."""


@dataclass(frozen=True)
class HopPlan:
    step: Step
    meta: dict  # the meta passed on (FORWARDED keys only; RELAY: the error as received)
    client: Any  # whom an answer or refusal goes to (a peer id, when the checks passed)
    block: Any  # this hop's block, as the request names it (None: it names none)
    last: bool  # this is the route's last hop
    served: Block | None = None  # the block this hop runs (the route check passed)
    key: tuple | None = None  # the session's caches here (END, COMPUTE)
    spec: dict | None = field(default=None, repr=False)  # the checked spec (COMPUTE)
    error: Exception | None = None  # why (REFUSE)


def session_key(client: str, meta: dict, k: int) -> tuple:
    """Where a session's caches live at a hop: (client, session, reference mode, block)."""
    return (client, meta["session"], meta["mode"] == "reference", k)


def plan_hop(msg: PipelineForward, sender: str, state: HopState) -> HopPlan:
    """The plan of ``msg`` from ``sender`` at this hop (see the rules above)."""
    meta = {key: msg.meta[key] for key in FORWARDED if key in msg.meta}
    if msg.hop == 0:
        meta.pop("client_addr", None)  # hop 0 says where its client connects from, not the client
    client = sender if msg.hop == 0 else meta.get("reply_to")
    base = HopPlan(Step.REFUSE, meta, client, block_at(meta, msg.hop), msg.hop + 1 == len(msg.route))
    if "error" in msg.meta:  # a hop without the client's connection reports through the last hop
        relay = base.last and state.is_member(sender) and isinstance(client, str)
        return replace(base, step=Step.RELAY if relay else Step.IGNORE, meta=dict(msg.meta))
    b = None
    try:
        b = _check_request(msg, sender, base, state)
        return _plan_traversal(msg, replace(base, served=b), state)
    except Exception as e:  # noqa: BLE001 - every failure is answered
        return replace(base, served=b, error=e)


def _check_request(msg: PipelineForward, sender: str, plan: HopPlan, state: HopState) -> Block:
    """The request's own fields, then its route; the block this hop runs."""
    meta, k = plan.meta, plan.block
    mode = meta.get("mode")
    if mode not in MODES:
        raise bad_request(f"unknown mode {mode!r}", k, msg.hop)
    if not isinstance(plan.client, str) or type(meta.get("session")) is not int:
        raise bad_request("reply_to (a peer id) and session (an int) are required", k, msg.hop)
    if meta.get("codec", DEFAULT_CODEC) not in HIDDEN_CODECS:  # before any compute: the request's fault
        raise bad_request(f"codec must be one of {sorted(HIDDEN_CODECS)}", k, msg.hop)
    return _check_route(msg, sender, plan, state, mode)


def _check_route(msg: PipelineForward, sender: str, plan: HopPlan, state: HopState, mode: str) -> Block:
    """Who may send this, and where it may go: hop 0 takes requests from the client itself;
    later hops only from members. The route is one hop per block 0..K-1 of this model."""
    meta, k = plan.meta, plan.block
    if msg.hop == 0 and meta.get("reply_to") != sender:
        raise bad_request("reply_to must be the sender's own peer id", k, msg.hop)
    if msg.hop > 0 and not state.is_member(sender):
        raise bad_request("only a member forwards a request past hop 0", k, msg.hop)
    held = state.held(mode)
    if not isinstance(k, int) or k not in held:
        hint = (": it was started without --reference DIR (the end-to-end model's checkpoints)"
                if mode == "reference" and isinstance(k, int) and k in state.held("exact") else "")
        raise PipelineError(f"peer {state.addr} does not serve block {k} ({mode}){hint}", k, msg.hop)
    n = held[k].cfg.n_blocks
    if len(msg.route) != n or meta.get("blocks") != list(range(n)):
        raise bad_request(f"a route is one hop per block 0..{n - 1}, in order", k, msg.hop)
    if msg.hop + 1 < n:  # before any compute: the next hop must be a member serving the next block
        nxt = msg.route[msg.hop + 1]
        if not state.serves(nxt, k + 1):
            raise PipelineError(f"the route's hop {nxt} is not a live member serving block {k + 1}", k + 1,
                                msg.hop + 1)
    return held[k]


def _plan_traversal(msg: PipelineForward, plan: HopPlan, state: HopState) -> HopPlan:
    """END for a request without a spec that ends its session; else the checked spec's COMPUTE."""
    meta, k, b = plan.meta, plan.block, plan.served
    assert b is not None, "the route check names the block first"
    key = session_key(plan.client, meta, k)
    if meta.get("spec") is None:  # the session is over: free its caches along the chain
        if not meta.get("end"):
            raise bad_request("a request needs a spec (or end, to free a session)", k, msg.hop)
        return replace(plan, step=Step.END, key=key)
    try:
        spec = check_spec(meta["spec"], b.cfg.max_seq_len)
    except BadSpec as e:
        raise bad_request(f"bad spec: {e}", k, msg.hop) from None
    if state.in_flight(plan.client) >= MAX_INFLIGHT_PER_CLIENT:
        raise bad_request(f"more than {MAX_INFLIGHT_PER_CLIENT} requests in flight at this hop", k, msg.hop)
    if state.is_busy(key):  # one traversal at a time per session
        raise PipelineError("this session's previous traversal is still running here", k, msg.hop, fault="session")
    return replace(plan, step=Step.COMPUTE, key=key, spec=spec)
