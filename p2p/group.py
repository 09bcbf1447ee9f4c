"""Group membership, sans-IO: who this peer averages with, round by round.

Rules:
- Rule 1: everything that changes who is in the group happens in ``Group``'s methods, through the
  one table ``REPLIES`` (what each state answers to each control phase). Messages, departures
  and decisions go in; messages (``Send``) and decisions come out. No sockets, clocks or tasks:
  the driver (swarm/membership.py) sends, waits and times out.
- Rule 2: a group has one sponsor, its member with the smallest peer id. Only the sponsor admits
  a joiner: it picks the round ``at`` = its current round + ``margin``, answers ``welcome`` and
  tells every member ``admit``. Members finish a round only with the sponsor's parts, which it
  sends after the ``admit`` on the same connection, so every member learns of the joiner before
  the round ``at`` begins: all of them average with it from round ``at + 1``. The joiner takes
  the group's state at the end of round ``at`` (every member writes it and says ``ready``).
  At a sponsor change (a member with a smaller id is in from the next round) members on either
  side of it disagree on who sponsors, and both may admit one joiner for different rounds: a
  member takes an ADMIT from any member of its round or the next (for a round near its own; a
  member averaging now is admitted again only by the sponsor), keeps a pending joiner's earliest
  admission, and the joiner takes the earliest welcome of that group. Two joiners admitted by
  the two sponsors each hear of the other: a member that admits a joiner, or takes a new
  admission, tells it of every joiner pending and them of it (welcomes are snapshots), and a
  joiner counts in the pending joiners it hears of before it is in from a member its welcome
  names (or from one counted in that way). A joiner that gives up its admission tells the members
  and those joiners that it leaves.
- Rule 3: peers that start at once from the same state (same step and digest; from one seed,
  every peer's fresh block is the same) form the group together, from their next round, with no
  state to fetch; each learns of the others from their JOINs and its own JOIN's answers. With
  ``min_group`` a starting peer waits (retrying) until that many start together or a group exists.
  A starter that others counted in but that itself decided to ask again (it had not yet heard
  of them) is welcomed by any member into its first round as it stands (``same``), as long as
  its state is still that round's start point.
- Rule 4: starting with nobody training and no same-state starters: the starting peer with the
  most steps (then the smallest id) trains alone and sponsors the others.
- Rule 5: a member that departs (left, dead, connection lost, excluded) leaves the group for good;
  a peer that comes back joins again through a sponsor, taking the group's state. A LEAVE names
  its sender's round: an ADMIT of that peer for that round or before is stale (passed on before
  the LEAVE, arriving after it); the sponsor admits it again for a later round and every ADMIT of
  that says which LEAVE it follows (``after``), so the order they arrive in does not matter; a
  joiner does not count in a peer that left during its join attempt (its welcome may predate the
  LEAVE) unless it is admitted again. These rounds are the group's: forgotten when we leave it.
- Rule 6: two groups that meet (a split: a stopped peer resumed, a race at start) merge: each
  member tells non-members its group's (size, sponsor); the group of lower rank (smaller, then the
  larger sponsor id) yields: its members leave it and join the other one (rule 2).
- Rule 7: a member that left a group it trained in (it yielded: rule 6) is past the start: rule
  3's ``min_group`` and rule 4's wait do not apply to it. Welcomed, it takes the group's state
  (rule 2); otherwise (no welcome, or only redirects: the sponsor did not answer) it trains on
  alone from its own state, and rule 6 makes it ask again: the larger group's STATUS makes it
  yield and JOIN once more. A joiner waiting for the state of a group whose every member told it
  LEAVE (they finished, or left) stops waiting (``all_left``).
- Control messages are tensorless BLOCK_UPDATEs; ``meta["phase"]`` names them (PROTOCOL.md 7.2).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class State(str, enum.Enum):
    IDLE = "idle"  # not training in this group's scope
    STARTING = "starting"  # about to train: looking for a group to join
    TRAINING = "training"  # a member; rounds under way
    DONE = "done"  # finished training


class Phase(str, enum.Enum):
    JOIN = "join"  # joiner -> everyone in scope: {step, digest, round}
    WELCOME = "welcome"  # sponsor -> joiner: {at, members, block, same}
    REDIRECT = "redirect"  # non-sponsor member -> joiner: {sponsor}
    STARTING = "starting"  # a starting peer -> joiner: {step, digest}
    ABSENT = "absent"  # not training in this scope (or, with a round: not in that round's group)
    ADMIT = "admit"  # sponsor -> members and pending joiners; a member -> pending joiners: {peer, at}
    READY = "ready"  # every member -> joiner: the state at the end of round ``at`` can be fetched: {name}
    LEAVE = "leave"  # a member -> members: it leaves the group (yielding to another group, or done)
    STATUS = "status"  # a member -> a non-member in scope: {size, sponsor, round}
    EXCLUDED = "excluded"  # a member -> a peer whose update it rejected (averaging/; not group control)


CONTROL_PHASES = frozenset(p.value for p in Phase)


def is_control(meta: dict) -> bool:
    """The one place BLOCK_UPDATE's two protocols are told apart (PROTOCOL.md 7.2): group control
    (this module's; the membership driver takes it) or an averaging round's traffic (averaging/:
    the parts, EXCLUDED, and an ABSENT with a ``round_group``, which answers a round's part). A
    phase that is not a string is refused by name (ValueError: the peer closes the sender)."""
    phase = meta.get("phase")
    if phase is not None and not isinstance(phase, str):
        raise ValueError(f"BLOCK_UPDATE meta.phase must be a string, not {type(phase).__name__}")
    if phase == Phase.EXCLUDED.value or (phase == Phase.ABSENT.value and meta.get("round_group") is not None):
        return False
    return phase in CONTROL_PHASES

# An ADMIT names a round at most this far ahead of ours (its sender is a round ahead at most and
# admits ``margin`` rounds ahead); at most this many joiners are pending at once: what a member
# that is not the sponsor can make us hold stays small and bounded.
ADMIT_AHEAD = 64
MAX_PENDING = 256
MAX_ID_LEN = 128  # a peer id in an ADMIT (the driver checks the exact form)
# ADMITs a member passes on to pending joiners per round (rule 2): honest groups send a few per
# joiner; a member that admits and re-admits without end cannot make us send more than this.
MAX_FORWARDS = 4 * MAX_PENDING
MAX_EARLY = 1024  # admissions (peer, sender) a joiner keeps before it is in (MAX_PENDING per sender);
#                   peers whose LEAVE round is kept (the first recorded dropped first)
EARLY_PER_KEY = 4  # first rounds kept per (peer, sender) (an admission and re-admissions after a LEAVE)
MAX_EVENTS = 1024  # admissions, departures and yields kept for the report (the oldest go first)



def log_event(events: list, event: dict, bound: int = MAX_EVENTS) -> None:
    """Append ``event`` to a report's list; past ``bound``, the oldest go (identities are free)."""
    events.append(event)
    if len(events) > bound:
        del events[:len(events) - bound]


# What a peer answers to a JOIN in each state (rule 1). TRAINING: the sponsor welcomes, the other
# members redirect to it; STARTING: "starting", with the step and digest it starts from (rule 3).
REPLIES = {
    State.IDLE: Phase.ABSENT,
    State.STARTING: Phase.STARTING,
    State.TRAINING: Phase.WELCOME,
    State.DONE: Phase.ABSENT,
}


@dataclass(frozen=True)
class Send:
    """A control message for ``peer``: BLOCK_UPDATE(block, round, meta) without tensors."""
    peer: str
    round: int
    meta: dict


@dataclass(frozen=True)
class Decision:
    """What a joiner does once its JOIN has been answered (``Group.decide``)."""
    action: str  # "fetch" (wait for READY, take the state at ``at``), "train" (go on from our own
    #              state, admitted at ``at`` or alone), "retry" (ask again shortly)
    at: int = 0
    sponsor: str = ""
    members: tuple = ()
    block: int | None = None  # the block the group trains (relay: may differ from ours)
    why: str = ""


@dataclass
class _Reply:
    phase: Phase
    meta: dict


@dataclass
class EarlyAdmits:
    """Joiner side of rule 2: the admissions heard before we are in, (peer, sender) -> (first
    rounds, the LEAVE round they follow). Whose word counts is known only when we are in
    (``told_of``); bounded: MAX_EARLY in all, MAX_PENDING per sender."""
    by: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.by)

    def clear(self) -> None:
        self.by = {}

    def stale(self, peer: str, rnd: int) -> None:
        """``peer`` left in round ``rnd``: its admissions up to that round go."""
        early = {}
        for (p, sender), (firsts, after) in self.by.items():
            firsts = firsts if p != peer else tuple(f for f in firsts if f - 1 > rnd)
            if firsts:
                early[p, sender] = (firsts, after)
        self.by = early

    def keep(self, peer: str, sender: str, first: int, after: int, asked: set) -> None:
        """An admission heard before we are in, kept per (peer, sender) for _enter (whose word counts
        is known only then): its EARLY_PER_KEY earliest rounds and the latest LEAVE round it
        follows. MAX_EARLY in all, MAX_PENDING per sender, room made for the peers we asked."""
        key = (peer, sender)
        if key not in self.by:
            if sum(k[1] == sender for k in self.by) >= MAX_PENDING:
                return
            if len(self.by) >= MAX_EARLY:
                other = next((k for k in self.by if k[1] not in asked), None)
                if sender not in asked or other is None:
                    return
                del self.by[other]
        firsts, prev_after = self.by.get(key, ((), -1))
        self.by[key] = (tuple(sorted({*firsts, first}))[:EARLY_PER_KEY], max(after, prev_after))

    def told_of(self, members, me: str, gone: dict) -> dict:
        """Peer -> [(sender, first round)] of the admissions we take when we are in (rule 2): those
        sent by a member our welcome names, or by a peer counted in this way (a joiner in before us
        passes admissions on), less those up to the peer's last LEAVE (its own, or the ``after`` of
        one of these admissions: rule 5). The same whatever order the ADMITs came in."""
        by_sender: dict = {}
        for (p, sender), (firsts, after) in self.by.items():
            if p != me:
                by_sender.setdefault(sender, []).append((p, firsts, after))
        trusted, todo = set(members), [m for m in members if m in by_sender]
        heard: dict = {}
        while todo:
            sender = todo.pop()
            for p, firsts, after in by_sender.pop(sender, ()):
                heard.setdefault(p, []).append((sender, firsts, after))
                if p not in trusted:
                    trusted.add(p)
                    if p in by_sender:
                        todo.append(p)
        counted = {}
        for p, entries in heard.items():
            cut = max([after for _, _, after in entries] + [gone.get(p, -1)])
            told = [(q, f) for q, firsts, _ in entries for f in firsts if f - 1 > cut]
            if told:
                counted[p] = told
        return counted


@dataclass
class Group:
    """Membership of one averaging group, as one member sees it."""

    me: str
    margin: int = 2  # rounds between an admission and the joiner's first round (>= 2, rule 2)
    state: State = State.IDLE
    round: int = 0  # the round in progress (its members are fixed)
    digest: str = ""  # digest of our start point of the round in progress
    step: int = 0
    block: int = 0  # the block this group trains now
    joined: dict = field(default_factory=dict)  # member -> first round it averages with us
    events: list = field(default_factory=list)  # admissions, departures, yields: for the report
    _replies: dict = field(default_factory=dict)  # joiner side: peer -> _Reply
    _asked: set = field(default_factory=set)  # joiner side: peers our JOIN went to
    _admits_due: dict = field(default_factory=dict)  # round -> joiners that take the state written then
    _starters: dict = field(default_factory=dict)  # STARTING side: peer -> (step, digest) it starts from
    _early: "EarlyAdmits" = field(default_factory=lambda: EarlyAdmits())  # joiner side: before we are in
    _gone: dict = field(default_factory=dict)  # peer -> round of its LEAVE (MAX_EARLY; rule 5)
    _left: set = field(default_factory=set)  # joiner side: peers whose LEAVE came in this join attempt
    _forwards: int = 0  # ADMITs passed on in the round in progress (MAX_FORWARDS)

    # --- views -------------------------------------------------------------------------------
    def members(self, rnd: int | None = None) -> list[str]:
        """Sorted ids averaging in round ``rnd`` (default: the round in progress), us included."""
        r = self.round if rnd is None else rnd
        return sorted({self.me} | {p for p, first in self.joined.items() if first <= r})

    def sponsor(self) -> str:
        """The member with the smallest id, among those of the round in progress."""
        return min(self.members())

    def rank(self) -> tuple:
        """Orders groups for merging (rule 6): larger wins, then the smaller sponsor id."""
        return (len(self.joined) + 1, _neg(self.sponsor()))

    # --- as a joiner ---------------------------------------------------------------------------
    def start_join(self, candidates, step: int, digest: str, rnd: int) -> list[Send]:
        """Ask every candidate in scope to let us in; we are STARTING until ``decide``."""
        if self.state is not State.STARTING:
            self._gone = {}  # LEAVE rounds are a group's rounds: another group counts its own
        self.state, self.step, self.digest, self.round = State.STARTING, step, digest, rnd
        self.joined.clear()
        self._replies, self._asked = {}, set(candidates) - {self.me}  # starters seen before are kept
        self._left = set()
        return [Send(p, rnd, {"phase": Phase.JOIN.value, "step": step, "digest": digest})
                for p in sorted(self._asked)]

    def on_reply(self, peer: str, phase: Phase, meta: dict):
        if peer in self._asked:
            self._replies[peer] = _Reply(phase, meta)
            if phase is Phase.STARTING:
                self._starting(peer, meta)
            else:  # its newest answer: it no longer starts
                self._starters.pop(peer, None)

    def _starting(self, peer: str, meta: dict):
        step, digest = meta.get("step"), meta.get("digest")
        if type(step) is int and isinstance(digest, str):
            self._starters[peer] = (step, digest)

    def all_left(self, members) -> bool:
        """Every member of a welcome but us told us LEAVE during this join attempt (rule 7): the
        state it admitted us to will not come."""
        others = set(members) - {self.me}
        return bool(others) and others <= self._left

    def waiting_for(self) -> set:
        """Peers whose answer to our JOIN has not come (the driver times them out)."""
        return self._asked - set(self._replies)

    def decide(self, min_group: int = 1, begun: bool = False) -> Decision:
        """Rules 2-4, once every asked peer answered or the driver's timeout passed. ``begun``: we
        left a group we trained in (rule 7): no start barrier, we train on alone unless welcomed."""
        d, enter = _decide(self._replies, self._starters, self.me, (self.step, self.digest), self.round, min_group,
                           begun)
        if enter is not None:
            self._enter(*enter)
        return d

    def joined_group(self, at: int, members) -> None:
        """The joiner took the group's state after round ``at``: a member from ``at + 1``."""
        self._enter(at, members)

    def _enter(self, at: int, members) -> None:
        self._starters = {}
        self.state = State.TRAINING
        self.round = at + 1
        # a welcome is a snapshot: one that told us LEAVE since is counted in only if admitted again
        named = [p for p in members if p != self.me and p not in self._left]
        self.joined = {p: at + 1 for p in named}
        # admitted too, told before we were in: one admitted before us and missing from our
        # welcome's snapshot is in from our start; one the welcome names, later only on the
        # sponsor's word (it came back unseen), never past ADMIT_AHEAD
        sponsor = min(named, default=self.me)
        for p, told in self._early.told_of(named, self.me, self._gone).items():
            first = min((f for q, f in told if q == sponsor or p not in self.joined), default=None)
            if first is not None and first <= at + 1 + ADMIT_AHEAD:
                self.joined[p] = max(first, at + 1)
        self._replies, self._asked, self._admits_due, self._left = {}, set(), {}, set()
        self._early.clear()

    def give_up(self, at: int, members, why: str) -> list[Send]:
        """We do not take the state we were admitted to (it did not come, or was bad): LEAVE for the
        members of our welcome and for the pending joiners we would have counted in (they count us
        in too, from the ADMITs members passed on: rule 2), who would otherwise wait for our parts
        until their round fails. We ask again with ``start_join``."""
        told = sorted((set(members) | set(self._early.told_of(members, self.me, self._gone))) - {self.me})
        # the LEAVE's round covers every admission of this attempt (each sponsor that admitted us
        # welcomed us: rule 2), so that none of them passed on after it counts us in again
        last = max([at] + [w.meta["at"] for q, w in self._replies.items() if w.phase is Phase.WELCOME
                           and q in members and type(w.meta.get("at")) is int and at < w.meta["at"] <= at + ADMIT_AHEAD])
        self._early.clear()  # the next attempt's welcome and ADMITs are new
        self._left = set()
        return [Send(m, last, {"phase": Phase.LEAVE.value, "why": why}) for m in told]

    # --- as a member ---------------------------------------------------------------------------
    def begin_round(self, rnd: int, digest: str, block: int) -> list[str]:
        """Round ``rnd`` starts from a point with ``digest``: its members."""
        self.round, self.digest, self.block = rnd, digest, block
        self._forwards = 0
        return self.members(rnd)

    def on_join(self, peer: str, meta: dict) -> list[Send]:
        """A JOIN from ``peer`` (rules 2-4)."""
        answer = REPLIES[self.state]
        first = self.joined.get(peer)
        if answer is Phase.WELCOME and first is not None and first >= self.round \
                and meta.get("digest") == self.digest and self.digest:  # rule 3: counted in, still in step
            return [Send(peer, self.round, {"phase": Phase.WELCOME.value, "at": first - 1, "same": True,
                                            "block": self.block, "members": self.members(first)})]
        if answer is Phase.WELCOME and self.sponsor() != self.me:
            return [Send(peer, self.round, {"phase": Phase.REDIRECT.value, "sponsor": self.sponsor()})]
        if answer is Phase.STARTING:
            self._starting(peer, meta)  # it starts too: rule 3 may make us one group
            return [Send(peer, self.round, {"phase": Phase.STARTING.value, "step": self.step, "digest": self.digest})]
        if answer is Phase.ABSENT:
            return [Send(peer, self.round, {"phase": Phase.ABSENT.value})]
        at = max(self.round + self.margin, self._gone.get(peer, -1) + 1)  # after its LEAVE, if any (rule 5)
        if first is not None and first >= self.round:  # admitted, not yet in (rule 2; a JOIN that
            at = first - 1                               # reaches us late, in its first round): that admission
        out = [Send(m, self.round, self._admit_meta(peer, at))
               for m in sorted(self.joined) if m != peer]  # future members too: they must know
        self._admit(peer, at)
        out.append(Send(peer, self.round, {"phase": Phase.WELCOME.value, "at": at, "block": self.block,
                                           "members": self.members(at + 1)}))
        return out + self._pending_for(peer)

    def on_admit(self, sponsor: str, meta: dict) -> list[Send]:
        """An ADMIT from ``sponsor``; what we tell pending joiners of it (rule 2)."""
        peer, at = meta.get("peer"), meta.get("at")
        if not (isinstance(peer, str) and len(peer) <= MAX_ID_LEN and type(at) is int and peer != self.me):
            return []
        if at <= self._gone.get(peer, -1):
            return []  # stale: passed on before that peer's LEAVE (rule 5)
        after = meta.get("after")
        after = after if type(after) is int and 0 <= after < at else -1  # its LEAVE, before this admission
        if self.state is State.STARTING:  # we are admitted too, not yet in: keep it for _enter
            self._early.keep(peer, sponsor, at + 1, after, self._asked)
            return []
        if not (self.state is State.TRAINING and self.joined.get(sponsor, self.round + 2) <= self.round + 1
                and self.round - 1 <= at <= self.round + ADMIT_AHEAD):
            return []  # from a member of this round or the next (rule 2), for a round near ours
        first = self.joined.get(peer)
        if first is not None and first <= self.round and sponsor != self.sponsor():
            return []  # a member averaging now is admitted again (it came back) on the sponsor's word only
        if first is not None and self.round < first <= after + 1 \
                and sponsor in (self.sponsor(), min(self.members(self.round + 1))):  # the sponsor's word:
            self.depart(peer, "left (said by its new admission)")  # the admission we hold predates its
            self._stale(peer, after)                                # LEAVE, not here yet (rule 5)
            first = None
        if first is None and (at < self.round or sum(f > self.round for f in self.joined.values()) >= MAX_PENDING):
            return []  # a new peer is pending (from a round after ours), and they are bounded
        if not self._admit(peer, at):
            return []
        told = [Send(p, self.round, self._admit_meta(peer, at))
                for p, f in sorted(self.joined.items()) if f > self.round and p not in (peer, sponsor)]
        told += self._pending_for(peer)
        told = told[:max(0, MAX_FORWARDS - self._forwards)]
        self._forwards += len(told)
        return told

    def _pending_for(self, peer: str) -> list[Send]:
        """ADMITs telling the joiner ``peer`` of every other joiner pending: its welcome's member list
        is a snapshot, and a joiner admitted by the other sponsor at a sponsor change is in no
        welcome it got (rule 2)."""
        return [Send(peer, self.round, self._admit_meta(p, f - 1))
                for p, f in sorted(self.joined.items()) if f > self.round and p != peer]

    def _admit_meta(self, peer: str, at: int) -> dict:
        """An ADMIT of ``peer`` from round ``at + 1``; ``after``: the round of its last LEAVE we know,
        so that a receiver its LEAVE has not reached yet drops what it holds from before (rule 5)."""
        meta = {"phase": Phase.ADMIT.value, "peer": peer, "at": at}
        if self._gone.get(peer, at) < at:
            meta["after"] = self._gone[peer]
        return meta

    def _admit(self, peer: str, at: int) -> bool:
        """``peer`` averages with us from round ``at + 1``; every member writes the state it takes
        after round ``at``. A joiner not yet in that two sponsors admitted keeps the earliest
        admission (rule 2); one already averaging that is admitted again came back unseen.
        False if the admission changed nothing."""
        first = self.joined.get(peer)
        if first is not None and self.round < first <= at + 1:
            return False
        self._forget_due(peer)
        self.joined[peer] = at + 1
        self._admits_due.setdefault(at, set()).add(peer)
        self._event({"event": "admitted", "peer": peer, "from_round": at + 1})
        return True

    def _forget_due(self, peer: str) -> None:
        for due in self._admits_due.values():
            due.discard(peer)

    def ready_due(self, rnd: int) -> list[str]:
        """The joiners that take the group's state at the end of round ``rnd`` (every member writes
        it and tells them READY: ``ready``). Entries of rounds before it are dropped: their
        joiners were admitted again or are in."""
        for r in [r for r in self._admits_due if r < rnd]:
            del self._admits_due[r]
        return sorted(self._admits_due.pop(rnd, ()))

    def _event(self, e: dict) -> None:
        """For the report; bounded in total (identities are free): the oldest go first."""
        log_event(self.events, e, MAX_EVENTS)

    def admits_due_by(self, rnd: int) -> bool:
        """Whether joiners take the group's state at the end of round ``rnd`` (or of one before it
        not yet handed out): that round ends with every member at the same point."""
        return any(r <= rnd for r in self._admits_due)

    def ready(self, rnd: int, joiners, name: str) -> list[Send]:
        """READY for ``joiners``, from every member: the sponsor can change between an admission and
        its round, the admitting member can leave or lie about the round, and a joiner takes the
        first READY of its round (a duplicate is harmless)."""
        return [Send(p, rnd, {"phase": Phase.READY.value, "at": rnd, "name": name}) for p in joiners]

    def depart(self, peer: str, why: str) -> bool:
        """Rule 5; True if ``peer`` was a member."""
        was = self.joined.pop(peer, None) is not None
        self._forget_due(peer)
        if was:
            self._event({"event": "departed", "peer": peer, "round": self.round, "why": why})
        return was

    def on_leave(self, peer: str, rnd: int, why: str) -> bool:
        """A LEAVE from ``peer``, sent in its round ``rnd`` (rule 5): it departs; its admissions up to
        that round are stale; a joiner does not count it in. True if it was a member."""
        if type(rnd) is int and rnd >= 0:
            self._stale(peer, rnd)
            first = self.joined.get(peer)
            if first is not None and first - 1 > rnd:
                return False  # admitted again after this LEAVE (the admission came first)
        if self.state is State.STARTING:
            self._left.add(peer)
        return self.depart(peer, why)

    def _stale(self, peer: str, rnd: int) -> None:
        """``peer`` left in round ``rnd``: its admissions up to that round are stale (rule 5). The
        rounds of the last MAX_EARLY peers are kept (the first recorded goes first)."""
        if peer not in self._gone and len(self._gone) >= MAX_EARLY:
            del self._gone[next(iter(self._gone))]
        self._gone[peer] = max(rnd, self._gone.get(peer, rnd))
        self._early.stale(peer, rnd)

    # --- merging (rule 6) ------------------------------------------------------------------------
    def status_for(self, peer: str) -> Send:
        size, _ = self.rank()
        return Send(peer, self.round, {"phase": Phase.STATUS.value, "size": size, "sponsor": self.sponsor()})

    def on_status(self, peer: str, meta: dict) -> list[Send] | None:
        """A STATUS from a peer outside our group: None, or (we yield) LEAVEs for our members,
        after which the driver joins again."""
        size, sponsor = meta.get("size"), meta.get("sponsor")
        if self.state is not State.TRAINING or peer in self.joined or not isinstance(size, int) \
                or not isinstance(sponsor, str):
            return None
        if (size, _neg(sponsor)) <= self.rank():
            return None
        out = self.leave(f"yielding to the group of {sponsor[:12]} ({size} members)")
        return out

    def outranks(self, meta: dict) -> bool:
        """Whether our group ranks above the one a STATUS describes (then we answer it: rule 6)."""
        theirs = status_rank(meta)
        return theirs is not None and theirs < self.rank()

    def leave(self, why: str) -> list[Send]:
        out = [Send(m, self.round, {"phase": Phase.LEAVE.value, "why": why}) for m in self.joined]
        self._event({"event": "left group", "round": self.round, "why": why})
        self.joined.clear()
        self._admits_due = {}  # the joiners of a group we left are not ours to tell READY
        self._gone = {}  # nor its LEAVE rounds ours to apply (rounds are a group's)
        self.state = State.IDLE
        return out

    def finish(self) -> list[Send]:
        out = self.leave("done training") if self.joined else []
        self.state = State.DONE
        return out


def status_rank(meta: dict) -> tuple | None:
    """The rank (rule 6) of the group a STATUS describes, comparable with ``Group.rank``; None if
    malformed."""
    size, sponsor = meta.get("size"), meta.get("sponsor")
    return (size, _neg(sponsor)) if type(size) is int and isinstance(sponsor, str) else None


def _members(reply: _Reply) -> tuple:
    """The member ids a welcome names."""
    return tuple(m for m in reply.meta.get("members", ()) if isinstance(m, str))


def _neg(peer_id: str) -> tuple:
    """Sort key under which a smaller peer id ranks higher."""
    return tuple(-ord(c) for c in peer_id)


def _decide(replies: dict, starters: dict, me: str, start: tuple, rnd: int, min_group: int,
            begun: bool = False) -> tuple:
    """Rules 2-4 and 7 for a joiner that starts from ``start`` = (step, digest) and asks in round
    ``rnd`` (``begun``: it left a group it trained in): the Decision, and the (at, members) it
    enters the group with now (None: not now)."""
    welcome = [(p, r) for p, r in replies.items() if r.phase is Phase.WELCOME]
    if welcome:  # two groups' welcomes: join the larger (rule 6 merges the other)
        p, r = max(welcome, key=lambda w: (len(_members(w[1])), _neg(w[0])))
        # two welcomes of that group (sponsors either side of a change, rule 2): the earliest,
        # the admission its members keep
        twins = [(q, w) for q, w in welcome if q in _members(r) and type(w.meta.get("at")) is int]
        if twins and type(r.meta.get("at")) is int:
            p, r = min(twins, key=lambda w: (w[1].meta["at"], w[0]))
        members = _members(r)
        at, block = r.meta.get("at"), r.meta.get("block")
        block = block if type(block) is int else None
        if type(at) is not int or at < 0:
            return Decision("retry", why=f"{p[:12]} sent a malformed welcome"), None
        if r.meta.get("same") is True and me in members:
            return Decision("train", at, min(members), members, block,
                            "counted in by the others from the start; joining them as we stand"), (at, members)
        return Decision("fetch", at, p, members, block, f"the group's state after round {at}"), None
    redirected = any(r.phase is Phase.REDIRECT for r in replies.values())
    if begun:  # rule 7: past the start, never at its barrier; rule 6 (STATUS) makes us ask again
        why = "a group is training but its sponsor did not answer" if redirected else "no group welcomed us"
        return Decision("train", rnd - 1, me, (me,), None,
                        f"not admitted ({why}): training on alone from our own state, asking again"), (rnd - 1, ())
    if redirected:
        return Decision("retry", why="a group is training; its sponsor has not answered yet"), None
    same = sorted(p for p, sd in starters.items() if sd == start)
    if len(same) + 1 >= max(min_group, 2):  # rule 3: start together
        return Decision("train", rnd - 1, min([me, *same]), tuple(sorted([me, *same])), None,
                        f"starting together with {len(same)} peer(s) from the same state"), (rnd - 1, same)
    if len(same) + 1 < min_group:
        return Decision("retry", why=f"{len(same) + 1} of {min_group} peers ready to start together"), None
    ahead = [p for p, (step, _) in starters.items() if (-step, p) < (-start[0], me)]
    if ahead:
        first = min(ahead, key=lambda p: (-starters[p][0], p))
        return Decision("retry", sponsor=first, why=f"{first[:12]} starts the group"), None
    return Decision("train", rnd - 1, me, (me,), None, "no group in scope: we start it"), (rnd - 1, ())
