"""The membership driver: runs a ``Group`` (group.py, sans-IO) over the peer.

Rules:
- Control messages (``BlockUpdate`` whose phase ``group.is_control`` says is control) arrive in
  the connections' readers and go to ``Group``; what it wants said goes out on the live connection at once, else after dialling a
  member we know. A peer id from a message (an ADMIT's joiner) is never dialled as an address.
- Scope: relay peers form one group; parallel peers one group per block. A JOIN from another
  scope is answered ABSENT (we are not in its group).
- A rejoin (we left a group we trained in: group.py rule 7) never waits at the start barrier:
  not welcomed, it trains on alone from its own state and says so; rule 6's STATUS makes it ask
  again. Yielding, every other member departs the round in progress (``Averager.leave_round``;
  it is ours alone now: a member that yielded too never sends its parts, and the round would wait
  out its timeout while the group we yield to trains on), and a round begun before the yield
  departs them as it begins (``Rounds._gone``).
- Joining (``join``): ask the candidates, then start alone or together, or take the group's state:
  wait for a READY for our admission round from a member of the group that admitted us, fetch
  that state (with, relay, the final blocks below), check it (checks.py) and install it. A state
  that fails the checks and came from one peer gets that peer rejected by the averager.
- READYs are kept only while joining: the newest ``READY_KEPT`` rounds, ``READY_PER_MEMBER``
  from one member (one member's flood pushes out only its own), names bounded.
- STATUS (group.py rule 6): a size no group here can have, or a STATUS from an excluded peer, is
  ignored; a larger group makes us leave ours and join it (``rejoin``); a lower-ranked group's
  member hears ours at once (at most every ``STATUS_REPLY_S``), peers outside our group every
  ``STATUS_EVERY_S`` and, once they have left our group, at the end of our first round at which
  they are live. We send no STATUS once we left our group, and take none from a peer that is not
  a live training peer of our scope.
- A split (r6.22): a member left alone (no member, no joiner pending) by members that trained
  with it and departed its rounds without a LEAVE, Goodbye, death or exclusion trains no further
  round until each of them has told it where it stands (a STATUS, JOIN, LEAVE, ABSENT or STARTING
  of our scope) or is gone from the table of our scope's training peers, ``SPLIT_WAIT_S`` at most
  (``after_split``; meanwhile it tells them its STATUS as they come back): alone it trains a round
  in milliseconds, and could finish its block apart from the group it is about to rejoin. Its
  lone rounds answer the parts a member still counting it in sends (``Averager.alone``); while it
  waits, such a part of a round ahead is answered ABSENT at once, so that member departs it and
  then tells it its STATUS (it waited for our lone round before, which came only at the wait's
  bound: a 5 s wait in a partition run). A member
  that once left by a LEAVE and came back counts as any other (``left`` forgets it at every
  round's end, gossip rounds too).
- Scope: another scope's JOIN is answered ABSENT in the joiner's scope (``is_scope``), as by a
  peer that trains nothing (``refuse_joins``).
- After each round, joiners admitted at it are told the name of the state they take (READY).
- Job (PROTOCOL.md 7.2 "Job"): every control message we send carries ``job``
  (settings.job_digest: the shared settings and the corpus). One that carries another job is not
  of our group: a JOIN is answered ABSENT (with our job, so the joiner learns why), an answer to
  our JOIN counts as ABSENT, anything else is dropped; each such peer is named once
  (``other_jobs``, ``MAX_OTHER_JOBS`` kept, ``OTHER_JOB_LINES`` named a minute). A ``job`` not of
  the form ``JOB_FORM`` is another job; a LEAVE is honoured whatever its job (it removes only its
  sender). A first join whose every asked peer answered with another job, attempt after attempt
  for ``JOB_PATIENCE_S``, stops with ``JobMismatch``: the user started this peer with the wrong
  data or settings. A rejoin never stops on it. A message without ``job`` (an older peer) is not
  checked.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from typing import Callable

from blocktrain.blocks import checkpoint as ckpt
from blocktrain.protocol import BlockUpdate, ProtocolError
from blocktrain.protocol.events import is_peer_id

from ..averaging import Averager
from ..checkpoints import CHECKPOINT, LOWER, CheckpointFetcher, FetchError
from ..group import Decision, Group, Phase, Send, State, is_control, log_event, status_rank
from ..services import Change, PeerServices, PeerUnreachable
from .checks import StateCheck
from .lower import SwarmError
from .schedule import Position
from .settings import job_difference

log = logging.getLogger("blocktrain.p2p")

# A peer outside our group is told our group's status at most this often (rule 6 of group.py).
STATUS_EVERY_S = 5.0
# ... and answered at most this often when its STATUS ranks below ours (so that it yields at once).
STATUS_REPLY_S = 0.5
STATUS_KEPT = 64  # when last told or answered, for peers no longer in scope: pruned past twice the candidates plus this
# A STATUS vouches for its sender's place in its group this long (members repeat it every STATUS_EVERY_S).
STATUS_HEARD_S = 2 * STATUS_EVERY_S + 1.0
# A peer whose STATUS claims, this many times, a group that ranks above ours by more members than
# say so themselves is named (once; its claims count only as far as they are vouched for anyway).
UNVOUCHED_NAMED = 3
MAX_UNVOUCHED = 1024  # peers whose unvouched claims are counted (the oldest go first)
SPLIT_WAIT_S = STATUS_EVERY_S  # a member split off alone waits this long at most for the others' status
# What a member split from us may say that tells us where it stands (its rank, or that it joins,
# leaves or trains nothing); an ADMIT or READY says it still counts us in, which settles nothing.
SETTLES_SPLIT = frozenset({Phase.STATUS, Phase.JOIN, Phase.LEAVE, Phase.ABSENT, Phase.STARTING})
READY_KEPT = 16  # READYs (round, member) a joiner keeps; the oldest round goes first
READY_PER_MEMBER = 2  # of them from one member (an honest one tells one per admission)
MAX_LEFT = 1024  # members remembered as having left (Membership.left; identities are free: the oldest go)
MAX_OTHER_JOBS = 64  # peers of another job remembered (named once each; identities are free: the oldest go)
OTHER_JOB_LINES = 8  # of them named per minute at most (each identity is named once, and identities are free)
JOB_FORM = re.compile(r"[0-9a-f]{16}\.[0-9a-f]{16}")  # a job of any other form counts as another job
SCOPE_FORM = re.compile(r"relay|block:(0|[1-9][0-9]{0,4})")  # PROTOCOL.md 7.2 ([0-9]: ASCII digits only)
JOB_PATIENCE_S = 5.0  # a first join stops (JobMismatch) only after meeting only other jobs this long


def is_scope(x) -> bool:
    """``x`` names a scope: ``relay``, or ``block:K`` of a u16 K."""
    m = SCOPE_FORM.fullmatch(x) if isinstance(x, str) else None
    return m is not None and (m.group(1) is None or int(m.group(1)) <= 0xFFFF)


class JobMismatch(SwarmError):
    """Every peer in scope trains another job (corpus or shared settings) than ours."""


class OtherJobs:
    """Peers of another job than ours (peer -> its job, ``jobs``: MAX_OTHER_JOBS kept), each named
    once (``say``), at most OTHER_JOB_LINES lines a minute."""

    def __init__(self) -> None:
        self.jobs: dict[str, str] = {}
        self._said_at: list[float] = []  # when peers of another job were named

    def name(self, pid: str, theirs, ours: str, say: Callable[[str], None]) -> None:
        if pid in self.jobs:
            return
        job = theirs if isinstance(theirs, str) and JOB_FORM.fullmatch(theirs) else "malformed"
        self.jobs[pid] = job
        while len(self.jobs) > MAX_OTHER_JOBS:
            del self.jobs[next(iter(self.jobs))]
        now = time.monotonic()
        self._said_at = [t for t in self._said_at if now - t < 60.0]
        if len(self._said_at) < OTHER_JOB_LINES:
            self._said_at.append(now)
            say(f"peer {pid[:12]} trains {job_difference(ours, job)}; not grouping with it")


class Outsiders:
    """Rule 6 of group.py's bookkeeping: when each peer outside our group was last told our status
    (``status_sent``, STATUS_EVERY_S) or answered (``status_replied``, STATUS_REPLY_S); our group's
    members and pending joiners (``insiders``) and members (``trained_with``) at the last
    ``tell_outsiders``; the members that left us alone alive (``split_from``: ``after_split`` waits
    for their status)."""

    def __init__(self, me: str):
        self.me = me
        self.status_sent: dict[str, float] = {}
        self.status_replied: dict[str, float] = {}
        self.insiders: set[str] = set()
        self.trained_with: set[str] = set()
        self.split_from: set[str] = set()
        self.apart_since: int | None = None  # the step since which our group trains apart from members it lost
        self._heard: dict[str, tuple[str, int, float]] = {}  # peer -> (sponsor, size, when): its own STATUS
        self.unvouched: dict[str, int] = {}  # peer -> its STATUSes that claimed more than was vouched

    def forget_group(self) -> None:
        """We left our group (yielding, or idle): its members are no split of ours."""
        self.insiders, self.trained_with, self.split_from = set(), set(), set()

    def regroup(self, members: set[str], trained_with: set[str], left, out, step: int) -> None:
        """Our group now, at global step ``step``: members that left it since are owed our status
        (their last time dropped); alone, those that trained with us, did not leave (``left``) and
        are not excluded either way (``out``) are a split. A group that lost members trains apart
        from them from ``step`` (``apart_since``: what taking another group's state drops)."""
        gone = self.insiders - members
        if self.trained_with - trained_with:
            self.apart_since = step
        for pid in gone:
            self.status_sent.pop(pid, None)
        if members == {self.me}:  # alone: a LEAVE, Goodbye or death is no split; a joiner never trained with
            # us; a member we excluded (or that excluded us) will not tell us where it stands
            self.split_from |= {p for p in gone & self.trained_with if p not in left and p not in out}
        else:
            self.split_from = set()
        self.insiders, self.trained_with = members, trained_with

    def due(self, candidates: list[str]) -> list[str]:
        """The candidates outside our group not told our status for STATUS_EVERY_S, marked told now;
        what is kept of peers no longer live is pruned past a bound."""
        now, out = time.monotonic(), []
        for pid in candidates:
            if pid not in self.insiders and now - self.status_sent.get(pid, 0.0) > STATUS_EVERY_S:
                self.status_sent[pid] = now
                out.append(pid)
        if len(self.status_sent) + len(self.status_replied) > 2 * len(candidates) + STATUS_KEPT:
            live = set(candidates)  # identities are free: only live peers' are kept
            self.status_sent = {p: t for p, t in self.status_sent.items() if p in live}
            self.status_replied = {p: t for p, t in self.status_replied.items() if p in live}
        return out

    def weigh(self, pid: str, meta: dict, candidates: list[str], group: Group, say: Callable[[str], None]) -> dict:
        """``pid``'s STATUS (its ``size`` an int, its ``sponsor`` a peer id) as far as it is vouched
        for: its meta with ``size`` no more than ``vouched``. At its UNVOUCHED_NAMED-th STATUS that
        ranks above ``group`` by its word only, ``pid`` is named (``say``, and the group's events)."""
        size, sponsor = meta["size"], meta["sponsor"]
        self._heard[pid] = (sponsor, size, time.monotonic())
        vouched = {**meta, "size": min(size, self.vouched(sponsor, candidates))}
        if vouched["size"] == size:  # every member it claims said so: none of them spoke for others
            for p in [p for p, h in self._heard.items() if h[0] == sponsor]:
                self.unvouched.pop(p, None)
        if not status_rank(meta) > group.rank() >= status_rank(vouched):  # type: ignore[operator]
            return vouched
        n = self.unvouched[pid] = self.unvouched.get(pid, 0) + 1
        while len(self.unvouched) > MAX_UNVOUCHED:  # identities are free: the oldest go
            del self.unvouched[next(iter(self.unvouched))]
        if n == UNVOUCHED_NAMED:
            why = f"its status claims {size} members with sponsor {sponsor[:12]}; {vouched['size']} say so themselves"
            say(f"peer {pid[:12]} speaks for others: {why}; not yielding to it")
            log_event(group.events, {"event": "named", "peer": pid, "round": group.round, "why": why})
        return vouched

    def vouched(self, sponsor: str, candidates: list[str]) -> int:
        """How many live training peers outside our group say, each in its own STATUS of the last
        STATUS_HEARD_S, that they are in ``sponsor``'s group, the sponsor among them (else 0). A
        STATUS speaks for its sender: the size it claims counts no further than this."""
        now, live = time.monotonic(), set(candidates) - self.insiders
        self._heard = {p: h for p, h in self._heard.items() if p in live and now - h[2] <= STATUS_HEARD_S}
        said = {p for p, h in self._heard.items() if h[0] == sponsor}
        return len(said) if sponsor in said else 0

    def reply_due(self, pid: str) -> bool:
        """``pid``'s STATUS may be answered now (STATUS_REPLY_S apart): marked answered if so."""
        if time.monotonic() - self.status_replied.get(pid, 0.0) > STATUS_REPLY_S:
            self.status_replied[pid] = time.monotonic()  # apart from status_sent: a STATUS we sent it
            return True  # at a split, just before it dropped us, is no answer
        return False


class Readies:
    """The READYs a joiner hears, (round, member) -> the state's name: the newest rounds kept
    (READY_KEPT), READY_PER_MEMBER from one member (its flood pushes out only its own)."""

    def __init__(self) -> None:
        self.named: dict[tuple, str] = {}

    def keep(self, pid: str, meta: dict) -> None:
        at, name = meta.get("at"), meta.get("name")
        if not (type(at) is int and isinstance(name, str) and len(name) <= 64):
            return
        theirs = sorted(k for k in self.named if k[1] == pid)
        if (at, pid) not in self.named and len(theirs) >= READY_PER_MEMBER:
            del self.named[theirs[0]]
        self.named[(at, pid)] = name
        while len(self.named) > READY_KEPT:
            del self.named[min(self.named)]

    def told(self, d: Decision) -> tuple | None:
        """The first READY for our round from a member of the group that welcomed us."""
        return next(((p, n) for (a, p), n in self.named.items() if a == d.at and p in d.members), None)

    def clear(self) -> None:
        self.named.clear()


class Membership:
    def __init__(self, peer: PeerServices, group: Group, averager: Averager, pos: Position, scope: str,
                 block_filter: int | None, fetcher: CheckpointFetcher, check: StateCheck, joins: list,
                 say: Callable[[str], None], job: str = ""):
        self.peer, self.group, self.averager, self.pos = peer, group, averager, pos
        self.job = job  # settings.job_digest ("": not checked)
        self.others = OtherJobs()
        self.other_jobs = self.others.jobs  # peer -> its job, for peers of another job (MAX_OTHER_JOBS)
        self._other_now: set[str] = set()  # answers to the join attempt in progress that carried another job
        self._asked_now: set[str] = set()  # whom the join attempt in progress asked
        self.scope, self.block_filter = scope, block_filter  # parallel: our block; relay: None
        self.fetcher, self.check, self.joins, self.say = fetcher, check, joins, say
        self.joining = False
        self.rejoin = False  # a larger group exists: leave ours and join it before the next round
        self.readies = Readies()  # READYs heard while joining
        self.outsiders = Outsiders(peer.id)  # rule 6's STATUS to peers outside our group; splits
        # members that left the group by a LEAVE or as the swarm saw them leave (Goodbye) or die (not
        # a closed connection, which is redialled; nor those a round departed), newest last: Rounds
        # departs them from a round begun before (its ``gone``); one back in our group is forgotten
        # here (tell_outsiders), so that a later departure or split of it is judged anew
        self.left: dict[str, str] = {}
        peer.on(BlockUpdate, self._on_block_update, inline=True)
        peer.on_membership(self._membership)

    def candidates(self) -> list[str]:
        """Live training peers in our group's scope (relay: all; parallel: those on our block)."""
        return [m.peer_id for m in self.peer.members(role="train", block=self.block_filter)
                if m.peer_id not in self.averager.banned and m.peer_id not in self.averager.shunned]

    # --- in: control messages (in the connections' readers) ----------------------------------------
    def _on_block_update(self, msg: BlockUpdate, pc, pid: str) -> None:
        """BLOCK_UPDATE carries group control and averaging rounds; group.is_control tells them
        apart (the averager hears every one too and takes the rest), in arrival order."""
        if is_control(msg.meta):
            self.on_control(msg, pc, pid)
        elif msg.tensors and pid in self.outsiders.split_from and msg.round > self.averager.current \
                and self.split_pending():
            # a member we wait for after a split counts us in a round ahead: it hears at once that we
            # are not in it (else it waits for us until our lone round), and tells us where it
            # stands once it departed us (its STATUS at its round's end)
            self.averager.tell_absent(pid, msg.round)

    def on_control(self, msg: BlockUpdate, pc, pid: str) -> None:
        meta = msg.meta
        try:
            phase = Phase(meta.get("phase"))
        except ValueError:
            return
        if meta.get("scope") != self.scope:
            theirs = meta.get("scope")
            if phase is Phase.JOIN and is_scope(theirs):
                # another scope's join: we are not in its group, said in its scope (the joiner takes
                # answers of its own scope only; in ours it waited its join timeout for us)
                self.send([Send(pid, msg.round, {"phase": Phase.ABSENT.value, "scope": theirs})])
            return
        if pid in self.outsiders.split_from and phase in SETTLES_SPLIT:  # it told us where it stands
            self.outsiders.split_from.discard(pid)
            self.peer.notify()
        theirs = meta.get("job", self.job)  # absent: an older peer, not checked
        if self.job and theirs != self.job and phase is not Phase.LEAVE:  # not of our group, whatever it says
            # (a LEAVE removes only its sender: honoured whatever its job)
            self.others.name(pid, theirs, self.job, self.say)
            if phase is Phase.JOIN:
                self.send([Send(pid, msg.round, {"phase": Phase.ABSENT.value})])
            elif phase in (Phase.WELCOME, Phase.REDIRECT, Phase.STARTING, Phase.ABSENT):
                if self.joining and pid in self._asked_now:
                    self._other_now.add(pid)
                self.group.on_reply(pid, Phase.ABSENT, {})
            self.peer.notify()
            return
        if phase is Phase.JOIN:
            self.send(self.group.on_join(pid, meta))
        elif phase in (Phase.WELCOME, Phase.REDIRECT, Phase.STARTING, Phase.ABSENT):
            self.group.on_reply(pid, phase, meta)
        elif phase is Phase.ADMIT:
            if is_peer_id(meta.get("peer")):  # never an address or a name of any length
                self.send(self.group.on_admit(pid, meta))
        elif phase is Phase.READY:
            if self.joining:
                self.readies.keep(pid, meta)
        elif phase is Phase.LEAVE:
            if self.group.on_leave(pid, msg.round, str(meta.get("why", ""))[:200]):
                self._left(pid, "left the group")
                self.averager.depart(pid, "left the group")
        elif phase is Phase.STATUS:
            self._on_status(pid, meta)
        self.peer.notify()

    def _on_status(self, pid: str, meta: dict) -> None:
        """A STATUS speaks for its sender (r7): its group ranks as large as is vouched for (``Outsiders.weigh``)."""
        size, candidates = meta.get("size"), self.candidates()  # (without the banned and shunned)
        if pid not in candidates or type(size) is not int or not 1 <= size <= len(candidates) + 1 \
                or not is_peer_id(meta.get("sponsor")):
            return  # not a live training peer of our scope, or a size no group here can have
        vouched = self.outsiders.weigh(pid, meta, candidates, self.group, self.say)
        leave = self.group.on_status(pid, vouched) if vouched["size"] else None
        if leave is not None:
            self.say(f"another group is larger; leaving ours to join it ({len(leave)} member(s) told)")
            self.send(leave)
            self.averager.leave_round("we left the group (yielding)")  # ours alone now: not waited for
            self.rejoin = True
            self.outsiders.forget_group()
            self.peer.notify()
        elif self.group.state is State.TRAINING and pid not in self.group.joined and self.group.outranks(meta) \
                and self.outsiders.reply_due(pid):
            # ours ranks higher: say so now. Two members that dropped a dead third at different rounds each
            # see the other outside; without this reply the split lasted STATUS_EVERY_S.
            self.send([self.group.status_for(pid)])

    def _membership(self, ev) -> None:
        if ev.departed and ev.change is not Change.SUSPECT:
            self.outsiders.split_from.discard(ev.peer_id)  # gone: nothing to wait for (after_split)
        if ev.departed and self.group.depart(ev.peer_id, ev.change.value):
            if ev.change is not Change.SUSPECT:  # a closed connection, redialled: it may be in the round still
                self._left(ev.peer_id, f"left the group ({ev.change.value})")
            log.info("%s left the group (%s)", ev.peer_id[:12], ev.change.value)

    def _left(self, pid: str, why: str) -> None:
        """``pid`` left the group (``left``); at most MAX_LEFT kept, the oldest going first (a
        member that left long ago is in no round begun before it left)."""
        self.left.pop(pid, None)
        self.left[pid] = why
        while len(self.left) > MAX_LEFT:
            del self.left[next(iter(self.left))]

    # --- out ---------------------------------------------------------------------------------------
    def send(self, sends: list[Send]) -> None:
        """Control messages, in order: on the live connection at once, else after dialling a member
        we know. A peer id from a message (an ADMIT's joiner) is never dialled as an address."""
        for s in sends:
            job = {"job": self.job} if self.job else {}
            msg = BlockUpdate(block=self.pos.block, round=max(0, s.round), meta={"scope": self.scope, **s.meta, **job})
            pc = self.peer.live_connection(s.peer)
            if pc is not None:
                try:
                    pc.send_nowait(msg)
                    continue
                except (ConnectionError, ProtocolError):
                    pass
            if self.peer.member(s.peer) is None:
                log.info("not telling %s %s: not a member we know", s.peer[:12], s.meta.get("phase"))
                continue
            self.peer.spawn(self._dial_send(s.peer, msg), "group control")

    async def _dial_send(self, pid: str, msg: BlockUpdate) -> None:
        try:
            (await self.peer.connection(pid)).send_nowait(msg)
        except (ConnectionError, ProtocolError, PeerUnreachable) as e:
            log.info("cannot tell %s %s: %s", pid[:12], msg.meta.get("phase"), e)

    async def round_done(self, rnd: int, save_join_state: Callable[[int], str]) -> None:
        """After round ``rnd``: joiners admitted at it take the state we have now; outsiders hear ours."""
        due = self.group.ready_due(rnd)
        if due:
            name = await asyncio.to_thread(save_join_state, rnd)  # disk work off the event loop
            self.send(self.group.ready(rnd, due, name))
        self.tell_outsiders()

    def tell_outsiders(self) -> None:
        """Rule 6 of group.py: training peers in scope but outside our group hear our status, every
        STATUS_EVERY_S; one that has left our group since the last call is owed it (its last time
        dropped: a split, whose two sides must learn each other's rank now, whatever they were
        told in an earlier one), sent now if it is a live candidate, else at the first call at
        which it is one. Members that trained with us and left us alone alive are what
        ``after_split`` waits to hear from. A member of our group is forgotten as having left
        (``left``), whatever kind of round we train (gossip too)."""
        if self.group.state is not State.TRAINING:  # we left our group: no status for a group we have not
            self.outsiders.forget_group()
            return
        trained_with = set(self.group.members())
        for pid in trained_with & self.left.keys():  # back in our group: a later departure is judged anew
            del self.left[pid]  # (Rounds._gone; and a later split from it is waited for: after_split)
        out = self.averager.banned.keys() | self.averager.shunned.keys()
        self.outsiders.regroup(trained_with | set(self.group.joined), trained_with, self.left, out, self.pos.gstep)
        for pid in self.outsiders.due(self.candidates()):
            self.send([self.group.status_for(pid)])

    def split_pending(self) -> bool:
        """Alone (no member, no joiner pending) after a split, and a member that left us is still
        in the swarm's table (alive, or its connection being redialled) and has not told us where
        it stands since; nor have we yielded."""
        if not self.outsiders.split_from or self.rejoin or self.group.state is not State.TRAINING \
                or set(self.group.members()) | set(self.group.joined) != {self.peer.id}:
            return False
        present = {m.peer_id for m in self.peer.members(role="train", block=self.block_filter, alive=False)}
        out = self.averager.banned.keys() | self.averager.shunned.keys()
        return not self.outsiders.split_from.isdisjoint(present - out)

    async def after_split(self) -> None:
        """Before a round alone after a split: wait, SPLIT_WAIT_S at most, until every member that
        left us has told us where it stands or is gone; each that is live hears our STATUS (owed)
        as soon as it is. Once: a split not settled in that time is left to the periodic STATUS."""
        self.tell_outsiders()  # a departure since the last round's end: a split now, not a round later
        if not self.split_pending():
            return
        self.say(f"split from {len(self.outsiders.split_from)} member(s) still in the swarm: waiting for them")
        deadline = time.monotonic() + SPLIT_WAIT_S
        while self.split_pending() and time.monotonic() < deadline:
            self.tell_outsiders()  # the owed STATUS to each that is live now
            live = set(self.candidates())
            if not await self.peer.wait_for(lambda: not self.split_pending() or set(self.candidates()) != live,
                                            deadline - time.monotonic()):
                break  # the deadline, or the peer stops (wait_for then returns at once)
        self.outsiders.split_from = set()

    # --- joining -----------------------------------------------------------------------------------
    async def join(self, start_digest: Callable[[], str], min_group: int, join_timeout_s: float,
                   ready_timeout_s: float, install: Callable[[ckpt.Checkpoint, dict, str], None]) -> None:
        """Find our group (group.py): start it, start together, or take its state (``install``d).
        Returns when we are a member (or alone)."""
        delay, said = 0.2, None
        first_join, only_others_since = not self.joins, None
        self.joining = True
        try:
            while True:
                self.readies.clear()  # an earlier attempt's admission is not this one's
                self._other_now = set()
                rnd = self.pos.rnd + 1
                asked = self._asked_now = set(self.candidates()) - {self.peer.id}
                self.send(self.group.start_join(asked, self.pos.gstep, start_digest(), rnd))
                await self.peer.wait_for(lambda: not self.group.waiting_for(), join_timeout_s)
                if first_join and asked and self._other_now >= asked:  # every peer in scope answered: another job
                    only_others_since = only_others_since or time.monotonic()
                    if time.monotonic() - only_others_since >= JOB_PATIENCE_S:
                        theirs = self.other_jobs.get(min(asked), "malformed")
                        raise JobMismatch(f"every peer in scope ({len(asked)}) trains "
                                          f"{job_difference(self.job, theirs)}")
                    await asyncio.sleep(delay)  # ours may not be known yet: ask again before deciding
                    delay = min(2 * delay, 2.0)
                    continue
                only_others_since = None
                d = self.group.decide(min_group, begun=not first_join)
                if d.action == "train":
                    self._joined(d, "own state")
                    if not first_join and len(d.members) == 1:
                        self.say(f"{d.why} (step {self.pos.gstep})")
                    return
                if d.action == "fetch":
                    if await self._take_group_state(d, ready_timeout_s, install):
                        return
                    continue
                if d.why and d.why != said:
                    said = d.why
                    self.say(f"waiting: {d.why}")
                await asyncio.sleep(delay)  # backoff: ask again
                delay = min(2 * delay, 2.0)
        finally:
            self.joining = False

    def _joined(self, d: Decision, how: str, nbytes: int = 0, dropped: dict | None = None) -> None:
        """In a group from round ``d.at + 1`` (``dropped``: our own state the group's replaced)."""
        self.pos.rnd = d.at
        self.averager.expect(d.at + 1)
        self.averager.expect_members(self.group.members(d.at + 1))
        self.joins.append({"round": d.at + 1, "how": how, "sponsor": d.sponsor, "members": list(d.members),
                           "bytes": nbytes, "time": time.time(), "why": d.why, "step": self.pos.gstep,
                           **({"dropped": dropped} if dropped else {})})
        if len(d.members) > 1 or how != "own state":
            self.say(f"in a group of {len(self.group.members(d.at + 1))} from round {d.at + 1} ({d.why})")
        self.outsiders.apart_since = None  # a state taken: what we train from here is the group's
        if dropped:
            self.say(f"our own state (step {dropped['own_step']}: {dropped['steps']} step(s) trained apart since step "
                     f"{dropped['since_step']}) is dropped for the group's (step {self.pos.gstep})")

    async def _take_group_state(self, d: Decision, timeout_s: float, install) -> bool:
        """Wait for a member's READY for round ``d.at`` and install that state; False to retry."""
        self.averager.expect(d.at + 1)  # the group's parts for our first round may come early
        self.averager.expect_members(d.members)
        self.say(f"admitted by {d.sponsor[:12]} from round {d.at + 1}; waiting for the group's state")
        ok = await self.peer.wait_for(lambda: self.readies.told(d) is not None or self.peer.member(d.sponsor) is None
                                      or self.group.all_left(d.members), timeout_s)
        told = self.readies.told(d)
        if not ok or told is None:
            gone = self.group.all_left(d.members)
            self.say("the group's state did not come" + (" (its members left)" if gone else "") + "; asking again")
            self.send(self.group.give_up(d.at, d.members, "no state"))
            return False
        teller, name = told
        by: list = []  # whose version of the state we got (not always the sponsor's)
        try:
            sources = state_sources(self.peer, d.members, teller)
            c, lowers, nbytes = await fetch_state(self.fetcher, self.check.schedule.relay, sources, name, by)
            self.check.state(c, lowers, d.at)
        except (FetchError, ckpt.CheckpointError, ValueError) as e:
            if not isinstance(e, FetchError) and len(set(by)) == 1:  # one peer's bytes, not a state of ours:
                bad = next((m.peer_id for m in self.peer.members() if m.addr == by[0]), None)  # never asked again
                if bad is not None:
                    self.averager.reject(bad, f"served a bad state: {e}", d.at)
            self.say(f"could not take the group's state: {e}; asking again")
            self.send(self.group.give_up(d.at, d.members, "state fetch failed"))
            return False
        self.readies.clear()
        own = self.pos.gstep  # what taking the group's state drops: our steps since our last join
        install(c, lowers, f"the group's state after round {d.at} ({name})")
        self.group.joined_group(d.at, d.members)
        self._joined(d, "fetched the group's state", nbytes, dropped=_dropped(self.joins, self.outsiders, own,
                                                                              self.pos.gstep))
        return True


def _dropped(joins: list, outsiders: Outsiders, own: int, theirs: int) -> dict | None:
    """What taking a group's state at step ``theirs`` drops of ours at step ``own``: the steps we
    trained apart, since our group last lost members or since our last join, whichever came last
    (a healed partition's side that yields: the steps it trained apart); None on a first join, and
    where we trained no step since (nothing of ours is dropped: a rejoin at the start, say)."""
    if not joins:
        return None
    since = int(joins[-1].get("step", own))
    if outsiders.apart_since is not None:  # our group lost members after our last join (reset at a join)
        since = max(since, outsiders.apart_since)
    if own <= since:
        return None
    return {"own_step": own, "steps": own - since, "since_step": since, "group_step": theirs}


def state_sources(peer: PeerServices, members, teller: str) -> list[str]:
    """Where the group's state is fetched from: the member that told us its name first, then the
    others of the group (addresses of members we know)."""
    others = [m.addr for m in (peer.member(p) for p in members) if m is not None and m.peer_id != teller]
    return [a for a in [getattr(peer.member(teller), "addr", None)] + others if a]


async def fetch_state(fetcher: CheckpointFetcher, relay: bool, sources: list[str], name: str, by: list) -> tuple:
    """The group's state ``name`` and (``relay``) the final blocks below it, from ``sources``
    (``by``: whose bytes came): (the checkpoint, block -> its tensors, the bytes fetched)."""
    blob = await fetcher.fetch(sources, CHECKPOINT, name, source=by)
    c = ckpt.decode(blob, f"the group's state {name}")
    if c.block is None:  # checked before it counts the lower blocks to fetch
        raise ValueError(f"{name} is an end-to-end checkpoint, not a block's state")
    lowers, nbytes = {}, len(blob)
    if relay:
        for j in range(c.block):
            lb = await fetcher.fetch(sources, LOWER, ckpt.block_name(j), source=by)
            lowers[j] = ckpt.decode(lb, f"lower block {j}").tensors
            nbytes += len(lb)
    return c, lowers, nbytes


def refuse_joins(peer: PeerServices) -> None:
    """For a peer that trains nothing: every JOIN is answered ABSENT at once (nobody waits on it),
    in the JOIN's scope (the joiner takes answers of its own scope only); a JOIN that names no
    scope (``is_scope``: none, not a string, block 65536) is not answered (it was once answered
    with ``scope: nil``)."""
    def handler(msg: BlockUpdate, pc, pid):
        scope = msg.meta.get("scope")
        if msg.meta.get("phase") == Phase.JOIN.value and is_scope(scope):
            try:
                pc.send_nowait(BlockUpdate(block=msg.block, round=msg.round,
                                           meta={"phase": Phase.ABSENT.value, "scope": scope}))
            except (ConnectionError, ProtocolError):
                pass
    peer.on(BlockUpdate, handler, inline=True)
