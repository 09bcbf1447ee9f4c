"""The thin asyncio driver of averaging rounds: ``Averager``.

Rules (numbered as in the package's index, ``__init__.py``):
- Rule 3 (here): a member whose part the round rejected is excluded from our later rounds and
  told (phase ``excluded``); one that tells us we are excluded is not waited for again.
- Rule 6 (here): a member that is a suspect of the robust aggregate (robust.py) SUSPECT_ROUNDS
  rounds in a row is excluded, named.
- Rule 8: every part is fed to the round as it arrives, in the connection's reader, and decoded
  at once where it belongs: the result (``out``, the caller's buffer when given) or the sender's
  place in an arena the ``Averager`` keeps from round to round, like a lossy codec's buffers
  (codec.py). A round so touches no fresh memory and no frame waits in a queue holding its
  receive buffer. When ``average`` returns, the round's messages still queued on a connection are
  released (copied), so nothing it sent views the buffers the next round writes. Parts for a
  round not begun yet are held within bounds (early.py); what the round has to send goes out
  in order from an ``Outbox`` (outbox.py).
- Rule 9 (here): a member that began the round with another view of the group (its parts carry
  another ``group`` digest, or it answers that it is not in our round's group: what we see
  ourselves, not what another member relays in meta ``mismatched``, round.py, rule 4, r7) fails
  the round for us (``GroupMismatch``):
  nothing applied (the error feedback is restored too), and it stays in the group. A departure or
  admission reaches members at different moments, so two honest members may begin one round with
  different members; departing each other there split the group in two (merged again only by
  STATUS, rule 6 of group.py, after a state fetch). The next round is begun once the change reached
  both (two under overlap, where a round begins before the one on the wire ends): a member's
  mismatches fail up to ``MISMATCH_ROUNDS`` rounds since the members of our rounds last changed,
  and, after its own admissions, ``MISMATCH_TOTAL`` in ``MISMATCH_WINDOW_S`` in all (r7);
  after that the member departs the round as any departed member (the round goes on without it,
  and it leaves the group). A key holder that forges digests so costs its group at most that many
  rounds per change of members, and MISMATCH_TOTAL per identity in MISMATCH_WINDOW_S. A member that left the group while the round's local steps ran
  (``average``'s ``gone``: it said LEAVE, or the swarm saw it leave or die) departs the round as
  it begins: restarted with its identity, it is a member of the swarm again and would answer that
  it is not in the round, a mismatch that fails the round for a member that began it late while
  the others, which began it before the departure, finish it without it. Not in a gossip round
  (rule 10): a member departed from a small group's round leaves that round only, so a mismatched
  member departs it and the round goes on.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from blocktrain.protocol import BlockUpdate, ProtocolError

from ..group import Phase, is_control, log_event
from ..services import PeerServices, PeerUnreachable
from .codec import SIGN, UPDATE_CODECS, lossy_scratch
from .early import AHEAD_ROUNDS, EarlyParts
from .robust import Bounds, PairWindow
from .outbox import Outbox
from .round import AveragingRound, Buffers, GroupMismatch, RoundFailed, RoundReport, RoundSpec

if TYPE_CHECKING:
    from ..transport import PeerConnection

log = logging.getLogger("blocktrain.p2p")

# Rounds in a row as a suspect before a member is excluded: an honest member's batch can make it
# an outlier once or twice (a block's first steps), an attacker's update is one every round.
SUSPECT_ROUNDS = 5
# Members named (excluded, excluding us) and events kept: identities are free, so what is kept of
# them is bounded in total; past it the oldest goes (an old identity excluded long ago may come back
# and be judged again, as any new one).
MAX_NAMED = 1024
# Rounds a member that sees another group fails for us, since our rounds' members last changed,
# before it departs (rule 9): a change of members reaches a round's members before its next round
# begins, or, under overlap, the one after.
MISMATCH_ROUNDS = 2
# ... and, counted over the rounds after its own admissions, at most this many in this window (r7).
MISMATCH_TOTAL = 4
MISMATCH_WINDOW_S = 600.0
MISMATCHED = ("sees another group", "not in this round's group")  # the round's departure reasons
# Rounds in which a member's word about others (meta ``departed``/``mismatched``) was contradicted by
# the named member's own part before it is named and its word ignored (rule 4 of round.py, r7): an
# honest member's claim can lose a race once (a member that sent its part, then died).
CLAIMS_NAMED = 2


def mismatches_within_allowance(r: AveragingRound, ids, state: dict, now: float | None = None) -> list[str]:
    """Rule 9, for a member whose rounds' members are ``ids``: the members that saw another group
    in round ``r`` and, since ``ids`` last changed, in at most MISMATCH_ROUNDS rounds; the round
    fails over them. Where the last change was the mismatched member's own admission (it left and
    was admitted again: a change it makes itself), its tolerated rounds also count toward
    MISMATCH_TOTAL in MISMATCH_WINDOW_S (r7), so leaving and joining again earns it no new ones;
    changes others make (departures at a partition) do not count there. ``state`` is the member's
    count, kept from round to round (``tolerated``: member -> when, MAX_NAMED kept)."""
    now = time.monotonic() if now is None else now
    if state.get("ids") != list(ids):
        before = set(state.get("ids") or ())
        state["ids"], state["counts"] = list(ids), {}
        state["admitted"] = set(ids) - before if before else set()  # whose admission the change was
    counts, tolerated = state["counts"], state.setdefault("tolerated", {})
    out = []
    for p in sorted(r.mismatched):
        counts[p] = counts.get(p, 0) + 1
        own = p in state.get("admitted", ())
        recent = [t for t in tolerated.get(p, ()) if now - t < MISMATCH_WINDOW_S]
        if counts[p] <= MISMATCH_ROUNDS and not (own and len(recent) >= MISMATCH_TOTAL):
            recent += [now] if own else []
            out.append(p)
        tolerated.pop(p, None)
        if recent:
            remember(tolerated, p, recent)
    return out


def outliers_in_a_row(r: AveragingRound, me: str, streak: dict,
                      window: PairWindow | None = None) -> list[tuple[str, str]]:
    """Rule 6, for ``me`` after robust round ``r``: its suspects (members far from the median or,
    by their parts' norms, far above it, and members opposed to the median,
    or, with ``window``, to the others' updates over the last rounds: the round is taken into it
    when its parts are sign-coded updates, not a gossip round's parameters) counted in ``streak``
    (member -> rounds in a row as a suspect, rounds with it); those that reach SUSPECT_ROUNDS,
    each with why."""
    if not r.robust:
        return []
    opposed, suspects, far = r.opposed(), r.suspects, r.far
    if window is not None and r.origin is None and r.spec.update_codec == SIGN:
        window.add(r.pairs, r.ids)
        opposed = {**window.opposed(r.live(), me), **opposed}
    out = []
    for pid in r.live():
        if pid == me:
            continue
        if pid in suspects or pid in opposed or pid in far:
            streak[pid] = streak.pop(pid, 0) + 1  # the most recently counted last
            if streak[pid] >= SUSPECT_ROUNDS:
                why = (f"a part's norm {far[pid]:.3g}x the median of its piece's parts" if pid in far else
                       f"{suspects[pid]:.1f} median distances from the others'" if pid in suspects else
                       f"pointing against the others' updates or their median, cosine {opposed[pid]:.2f}")
                out.append((pid, f"its update was an outlier {SUSPECT_ROUNDS} rounds in a row ({why} in round "
                                 f"{r.round})"))
                del streak[pid]  # named: judged again from nothing if it is ever forgotten and back
        else:
            streak.pop(pid, None)
    while len(streak) > MAX_NAMED:  # identities are free: members that left as suspects, the oldest first
        del streak[next(iter(streak))]
    return out


def name_claimers(r: AveragingRound, failed: dict, unheeded: dict, events: list, block: int) -> None:
    """Rule 4 of round.py (r7): a member whose word about others the named members' own parts
    contradicted in CLAIMS_NAMED rounds (counted in ``failed`` over the whole run) is named, and
    its word ignored from then on (``unheeded``: member -> why)."""
    for pid, why in r.contradicted.items():
        remember(failed, pid, failed.get(pid, 0) + 1)
        if failed[pid] == CLAIMS_NAMED:
            why = f"its word about others failed in {CLAIMS_NAMED} rounds ({why})"
            remember(unheeded, pid, why)
            log_event(events, {"event": "named", "peer": pid, "round": r.round, "time": time.time(), "reason": why})
            log.warning("block %d round %d: %s speaks for others: %s; its word is ignored from now on",
                        block, r.round, pid[:12], why)


def remember(names: dict, key, value, bound: int = MAX_NAMED) -> None:
    """``names[key] = value``, the oldest entries dropped past ``bound``."""
    names[key] = value
    while len(names) > bound:
        del names[next(iter(names))]


class Averager(EarlyParts):
    """Drives averaging rounds for one block over the peer's connections (the thin asyncio part)."""

    def __init__(self, peer: PeerServices, block: int, codec: str = "raw", min_coverage: float = 1.0,
                 max_norm: float = 1e6, timeout_s: float = 30.0, aggregate: str = "mean", floats: int = 0,
                 density: float = 0.01, steps: bool = False):
        """``floats``: the vector size of the rounds, when known before the first one (it sizes what
        is held of members' parts that come before we begin a round; later rounds know it).
        ``steps``: the parts are members' optimizer steps (sync params), and rule 6's pair window
        judges their sign rounds; per-step gradients are too noisy late in a deeper block."""
        super().__init__(block, floats)
        self.peer = peer
        self._suspect_streak: dict[str, int] = {}
        self._pair_window = PairWindow() if steps else None  # rule 6's pair test over the last rounds
        self._mismatch_state: dict = {}  # rule 9: mismatched rounds per member (mismatches_within_allowance)
        self._claims_failed: dict[str, int] = {}  # member -> rounds its word about others was contradicted
        self.unheeded: dict[str, str] = {}  # members named for their word about others (ignored since) -> why
        if codec not in UPDATE_CODECS:
            raise ValueError(f"averaging codec {codec!r}: expected one of {UPDATE_CODECS}")
        self.spec = RoundSpec(codec, aggregate, Bounds(max_norm), min_coverage, density)  # every round's
        self.timeout_s = timeout_s
        self.banned: dict[str, str] = {}  # peer id -> why (we rejected its update)
        self.shunned: dict[str, str] = {}  # peers that rejected ours -> their reason
        self.events: list[dict] = []
        self._residual: torch.Tensor | None = None
        self._arena = torch.empty(0)  # members' parts of a round are decoded here (AveragingRound)
        self._scratch: dict | None = None  # a lossy codec's buffers, lent to every round
        self._round: AveragingRound | None = None
        self.outbox = Outbox(peer)  # what the round in progress has to send next
        self._wake: asyncio.Event | None = None  # set when the outbox has parts or the round is done
        self._failure: BaseException | None = None  # a bug met while feeding the round (raised by average)
        self._absent_told: set = set()
        self._last_group: str | None = None  # the ``group`` digest of the round we ran last
        self._gossip_group: list | None = None  # the whole group of the gossip round in progress (rule 10)
        peer.on(BlockUpdate, self._route, inline=True)
        peer.on_membership(self._membership)

    # --- inputs, in the connections' readers ---------------------------------------------------
    def _route(self, msg: BlockUpdate, pc, pid: str):
        if is_control(msg.meta):  # group control: the membership driver's (it hears this message too)
            return
        phase = msg.meta.get("phase")
        if phase == Phase.EXCLUDED.value:
            self.excluded_by(pid, msg.round, str(msg.meta.get("reason", ""))[:500])
        elif phase == Phase.ABSENT.value and msg.meta.get("round_group") is not None:
            self._put(msg.round, pid, msg)  # "I am not in your round": a departure for that round
        elif pid in self.banned:
            return
        else:
            self._put(msg.round, pid, msg)

    def _put(self, rnd: int, pid: str, msg):
        r = self._round
        if r is not None and rnd == r.round:
            self._feed(pid, msg)
        elif self.current < rnd <= self.current + AHEAD_ROUNDS:
            if self.peer.member(pid) is None:
                return
            self._hold(rnd, pid, msg)
        elif msg.tensors and msg.meta.get("group") and (rnd != self.current or
                                                        msg.meta["group"] != self._last_group):
            # A round we are not in at all; or the round we ended last, seen by a member of another
            # view (it would wait for us until its deadline).
            self.tell_absent(pid, rnd)

    def _membership(self, ev):
        if ev.departed and self._round is not None:
            self._feed(ev.peer_id, ev.change.value)

    def expect(self, rnd: int) -> None:
        """Our next round is ``rnd``: its parts (and the next one's) are held if they come early;
        those held for earlier rounds are not ours: their senders hear that we are not in them."""
        self.current = rnd - 1
        for old, pid, msg in self._drop_early(rnd):
            if msg.tensors:
                self.tell_absent(pid, old)
        self._recount_early()

    def alone(self, rnd: int) -> None:
        """We trained round ``rnd`` alone (a group of one: no ``average``): parts of it or an earlier
        round are not ours, and their senders hear so (ABSENT), so a member that still counts us in
        learns of the split at once, not at its round's deadline (swarm/membership.py, r6.22).
        Never moves back: a round in progress, or a later one begun, stands."""
        if self._round is None and rnd > self.current:
            self.expect(rnd + 1)

    def depart(self, pid: str, why: str) -> None:
        """A member left the group (a service's own signal): it departs the round in progress."""
        if self._round is not None:
            self._feed(pid, why)

    def leave_round(self, why: str) -> None:
        """We left the group (yielding: group.py rule 6): the round in progress is ours alone now;
        every other member departs it, not relayed (a member that yielded too never sends its
        parts, and the round would wait out its deadline while the group we join trains on)."""
        r = self._round
        for pid in list(r.ids) if r is not None else ():
            if pid != self.peer.id and self._round is r:
                self._feed(pid, why, relay=False)

    def set_mode(self, codec: str, mode: str, steps: bool) -> None:
        """Rounds of another sync mode from now on (swarm/auto.py: codec, tag, parts that are steps);
        the old rounds' error feedback and pair window go with the old arithmetic."""
        self.spec = replace(self.spec, codec=codec, mode=mode)
        self._residual, self._scratch, self._pair_window = None, None, PairWindow() if steps else None

    # --- rounds --------------------------------------------------------------------------------
    async def average(self, rnd: int, vector: torch.Tensor, members, start: str = "",
                      out: torch.Tensor | None = None, group=None,
                      origin: torch.Tensor | None = None, gone=None, choice=None) -> tuple[torch.Tensor, RoundReport]:
        """Average ``vector`` (1-D float32) with ``members`` (peer ids, or id -> address; ours
        included) in round ``rnd`` whose start point has digest ``start``. The result is written
        into ``out`` when given (a caller that reuses one buffer round after round makes the round
        touch no fresh memory), else into a new tensor. ``group``: a gossip round's whole group
        (``members`` is its small group, rule 10): members we excluded stay in the round's
        ``group`` digest, which every partner computes alike, and depart it at once; a member of
        another view departs the round without failing it (rule 9 is not applied). ``origin``:
        where ``vector`` is a point (a gossip round's parameters), our start point of the steps it
        took, which a robust round measures the members' updates from (``AveragingRound``).
        ``gone``: members of ``members`` that left the group since the round's members were fixed
        (id -> why; the local steps ran meanwhile): they depart the round as it begins, after what
        they sent of it is taken in. ``choice``: our parts' meta ``choice`` (swarm/auto.py)."""
        t0 = time.perf_counter()
        self._gossip_group = None if group is None else sorted(group)
        r = self._begin(rnd, vector, members, start, out, origin, choice)
        self._last_group = r.group
        early = self._begin_early(rnd, r.ids, vector.numel())
        conns: dict[str, PeerConnection] = {}
        sent: list[BlockUpdate] = []
        deadline = time.monotonic() + self.timeout_s
        try:
            bytes_sent = await self._run(r, early, conns, sent, deadline, gone or {})
        finally:
            self._round, self.outbox.parts, self._wake, self._failure = None, [], None, None
            for pc in conns.values():  # what is still queued stops viewing our buffers (reused next round)
                pc.release_queued(sent)
        self._residual = r.residual
        self._suspicions(r, rnd)
        name_claimers(r, self._claims_failed, self.unheeded, self.events, self.block)
        try:
            self._mismatches(r)
            out, rep = r.result()
        except RoundFailed:
            r.undo_feedback()
            raise
        rep.seconds, rep.bytes_sent = time.perf_counter() - t0, bytes_sent
        return out, rep

    def _begin(self, rnd: int, vector: torch.Tensor, members, start: str,
               out: torch.Tensor | None, origin: torch.Tensor | None = None, choice=None) -> AveragingRound:
        """Round ``rnd`` with the members we have not excluded (nor that exclude us), this driver's
        buffers lent to it; it becomes the round in progress."""
        ids = list(members) if self._gossip_group is not None else \
            [p for p in members if p not in self.banned and p not in self.shunned]
        if self.spec.codec != "raw" and (self._scratch is None or self._scratch["x"].numel() != vector.numel()):
            self._scratch = None
            self._scratch = lossy_scratch(vector.numel(), self.spec.codec)
        r = AveragingRound(self.peer.id, self.block, rnd, ids, vector, self.spec, start=start, residual=self._residual,
                           lent=Buffers(out, self._lend_arena, self._scratch), origin=origin, choice=choice)
        r.roster.ignored = frozenset(self.unheeded)
        self._round, self.outbox.parts, self._wake, self.current = r, [], asyncio.Event(), rnd
        return r

    async def _run(self, r: AveragingRound, early: list, conns: dict, sent: list, deadline: float,
                   gone: dict) -> int:
        """Runs round ``r`` (the one in progress) until it is done or, past ``deadline``, expired:
        sends what it returns and feeds it what comes (``early``: what came before it began;
        ``gone``: see ``average``). Returns the payload bytes sent."""
        bytes_sent = 0
        for pid in r.ids:
            if pid in self.banned or pid in self.shunned:  # a gossip round's (rule 10; else not in ids)
                self._feed(pid, "excluded" if pid in self.banned else "excluded us", relay=False)
        self.outbox.parts += r.start()
        for pid, msg in early:
            self._feed(pid, msg)
        for pid in r.ids:  # after their early parts: what a member sent before it left counts here as
            if pid == self.peer.id:  # at the members that began the round before it left (rule 4)
                continue
            if pid in gone:
                self._feed(pid, str(gone[pid])[:200])
            elif self.peer.member(pid) is None:
                self._feed(pid, "not a member")
        while True:
            bytes_sent += await self.outbox.send(r, conns, sent, self._feed)
            if self._failure is not None:
                raise self._failure
            if r.done:
                return bytes_sent
            left = deadline - time.monotonic()
            if left <= 0:
                before = len(r.rejected)
                self.outbox.parts += r.expire()
                for rej in r.rejected[before:]:  # parts validated now (a piece's last) can reject a member
                    self._reject(rej["peer"], rej["reason"], r.round)
                continue
            assert self._wake is not None, "set by _begin until the round ends"
            self._wake.clear()
            try:
                async with asyncio.timeout(left):  # not wait_for: see waiters.py
                    await self._wake.wait()
            except TimeoutError:
                pass

    def _feed(self, pid: str, msg, relay: bool = True) -> None:
        """Everything for the round in progress goes in here as it comes, in the connections'
        readers: a part is checked and decoded where it belongs at once (no frame waits in a queue
        holding its receive buffer while we send); what the round has to send next goes to the
        outbox. ``msg`` is a BlockUpdate or, for a departure, why (``relay``: round.py's ``depart``)."""
        r = self._round
        assert r is not None and self._wake is not None, "fed only while a round is in progress"
        before = len(r.rejected)
        try:
            if isinstance(msg, str):
                out = r.depart(pid, msg, relay)
            elif msg.meta.get("phase") == Phase.ABSENT.value:
                out = r.mismatch(pid, MISMATCHED[1])
            elif msg.meta.get("group") != r.group:  # another view of the group: not usable
                self._mismatch(pid, r.round)
                out = r.mismatch(pid, MISMATCHED[0])
            else:
                out = r.receive(pid, msg)
        except Exception as e:  # a bug, not the peer's doing: the round fails here, the reader goes on
            log.exception("round %d: feeding a part from %s failed", r.round, pid[:12])
            self._failure = e
            out = []
        for rej in r.rejected[before:]:
            self._reject(rej["peer"], rej["reason"], r.round)
        self.outbox.parts += out
        self._wake.set()

    def _lend_arena(self, floats: int) -> torch.Tensor:
        """The arena for a round that needs ``floats``: kept from round to round, remade when too
        small or more than twice too large (the group shrank)."""
        if not floats <= self._arena.numel() <= 2 * floats:
            self._arena = torch.empty(0)  # the old one goes first: never both at once
            self._arena = torch.empty(floats)
        return self._arena

    def _suspicions(self, r: AveragingRound, rnd: int):
        """Rule 6: a member that is a suspect SUSPECT_ROUNDS rounds in a row is excluded (named)."""
        for pid, why in outliers_in_a_row(r, self.peer.id, self._suspect_streak, self._pair_window):
            self._reject(pid, why, rnd)

    def _mismatches(self, r: AveragingRound) -> None:
        """Rule 9: GroupMismatch when a member saw another group in this round and, since our
        rounds' members last changed, in at most MISMATCH_ROUNDS rounds. Not in a gossip round
        (rule 10): a member departed from a small group's round leaves that round only, so the
        round goes on without it and the group does not split."""
        if self._gossip_group is not None:
            return
        tolerated = mismatches_within_allowance(r, r.ids, self._mismatch_state)
        if tolerated:
            raise GroupMismatch(self.block, r.round, tolerated, frozenset(r.silent()))

    def _mismatch(self, pid: str, rnd: int):
        if not any(e.get("peer") == pid and e["event"] == "group mismatch" for e in self.events):
            log_event(self.events, {"event": "group mismatch", "peer": pid, "round": rnd, "time": time.time()})
            log.info("round %d: %s sees another group; its parts are not mixed in", rnd, pid[:12])
        self.tell_absent(pid, rnd)

    def tell_absent(self, pid: str, rnd: int):
        if (pid, rnd) in self._absent_told:
            return
        self._absent_told.add((pid, rnd))
        if len(self._absent_told) > 4096:
            self._absent_told.clear()
        self._tell(pid, BlockUpdate(block=self.block, round=rnd, meta={"phase": Phase.ABSENT.value,
                                                                       "round_group": True}))

    def _tell(self, pid: str, msg: BlockUpdate):
        self.peer.spawn(self._send_control(pid, msg), f"tell {msg.meta.get('phase')}")

    async def _send_control(self, pid: str, msg: BlockUpdate):
        try:
            (await self.peer.connection(pid)).send_nowait(msg)
        except (ConnectionError, ProtocolError, PeerUnreachable):
            pass

    def _reject(self, pid: str, why: str, rnd: int):
        self.reject(pid, why, rnd)

    def reject(self, pid: str, why: str, rnd: int):
        """Exclude ``pid`` from our rounds from now on, tell it, and report why."""
        if pid in self.banned:
            return
        remember(self.banned, pid, why)
        log_event(self.events, {"event": "rejected update", "peer": pid, "round": rnd, "reason": why, "time": time.time()})
        log.warning("block %d round %d: rejected update from %s: %s; excluded from later rounds",
                    self.block, rnd, pid[:12], why)
        self._tell(pid, BlockUpdate(block=self.block, round=rnd, meta={"phase": Phase.EXCLUDED.value, "reason": why}))

    def excluded_by(self, pid: str, rnd: int, why: str):
        """``pid`` rejected our update and will ignore us: stop waiting for it, now and later."""
        if pid in self.shunned:
            return
        remember(self.shunned, pid, why)
        log_event(self.events, {"event": "excluded by", "peer": pid, "round": rnd, "reason": why, "time": time.time()})
        log.warning("block %d: %s rejected our update in round %d (%s) and excludes us", self.block, pid[:12], rnd, why)
        if self._round is not None:
            self._feed(pid, "excluded us", relay=self._gossip_group is None)  # gossip: between us (rule 10)
