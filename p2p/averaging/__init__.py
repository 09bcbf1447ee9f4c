"""Same-block averaging: one round as a sans-IO object, and a thin asyncio driver.

The package, by concern; each module opens with the rules it implements, numbered as here:

- ``round.py``: ``AveragingRound``, one round (sans-IO): its pieces and their owners, departures,
  coverage, ``RoundReport`` and ``RoundFailed``; its settings (``RoundSpec``) and the memory a
  driver lends it (``Buffers``).
- ``pieces.py``: a round's pieces apart from its protocol: who is live and owns each piece
  (``Roster``), the arena's slots, what the aggregate of each piece found (``PieceRecords``).
- ``robust.py``: pure functions: what a part may be (``validate_part``), the robust aggregate
  (the norm test, centred clipping, the coordinate-wise median, the opposed-member test).
- ``codec.py``: the update codecs, a lossy codec's encoding with error feedback and its scratch,
  the arena's slots.
- ``early.py``: parts held for rounds not begun yet, within bounds.
- ``outbox.py``: what the round in progress has to send, sent in order, or handed out when it stops.
- ``driver.py``: ``Averager``, the thin asyncio driver: it sends, feeds the round as parts come,
  excludes members and lends the round its buffers.
- ``outer.py``: ``OuterOptimizer`` (the outer step), ``flatten`` and ``unflatten_``.
- ``gossip.py``: pure functions: a large group's partition into small groups, new every round.

Rules (the module named holds the full text; a rule that spans modules is in each, its part):
- Rule 1 (round.py): everything a round does happens in ``AveragingRound``: parts, departures and
  the deadline in; messages and, once done, a result with its coverage out. No socket, clock or
  task: the ``Averager`` feeds it and sends what it returns.
- Rule 2 (round.py; pieces.py): the vector is cut into P >= R pieces of at most PIECE_FLOATS; piece j is owned
  by member j mod R; reduce to the owner, gather from it; ``group`` digests members, round number
  and start point.
- Rule 3 (robust.py; round.py, driver.py): every incoming part is validated before use; a sender
  whose part fails is rejected, the round goes on without it, and the driver excludes it from
  later rounds and tells it.
- Rule 4 (round.py; pieces.py): a member that departs mid-round is dropped; its pieces move to live members.
- Rule 5 (round.py): coverage; below ``min_coverage`` the result raises ``RoundFailed``.
- Rule 6 (robust.py; round.py, pieces.py, driver.py): ``aggregate="robust"`` (3 or more members): every member
  computes every piece, by norm test and centred clipping; suspects SUSPECT_ROUNDS rounds in a row
  are excluded (far from the median; a part's norm over 100x its piece's median, the part left
  out of that piece, r6.23; pointing against the median, or, in sign rounds of updates, against
  the others' updates over the last rounds: ``PairWindow``). A ``sign`` round is gathered so with
  every aggregate (a plain mean in member order below 3 members or with ``mean``).
- Rule 7 (codec.py; round.py): lossy codecs keep their rounding error for the next round (error
  feedback); every member ends the round with the same bytes.
- Rule 8 (driver.py; outbox.py, codec.py): parts are fed to the round as they arrive and decoded where they
  belong (the result, or an arena kept from round to round); queued messages are released when
  ``average`` returns.
- Rule 9 (driver.py; round.py): a member that began the round with another view of the group
  fails it for us (``GroupMismatch``: nothing applied, it stays in the group) in up to
  MISMATCH_ROUNDS rounds since our rounds' members last changed (and, after its own admissions,
  MISMATCH_TOTAL in MISMATCH_WINDOW_S in all), then departs it. A member that
  left the group during the round's local steps departs it as it begins.
- Rule 10 (gossip.py; driver.py): a group of 2k members or more (gossip size k) averages each
  round in the small groups of a partition every member computes alike (3 to 2k + 1 members,
  about k + 1 on average, new every round; a view one member apart changes one or two); a round's ``group`` digest names its small group and the gossip salt; members
  excluded stay in that digest and depart the round at once.
"""

from .codec import UPDATE_CODECS
from .driver import Averager, remember
from .outer import OuterOptimizer, flatten, unflatten_
from .robust import Bounds, validate_part
from .round import AveragingRound, Buffers, GroupMismatch, Part, RoundFailed, RoundReport, RoundSpec

# The package's public names, for the swarm and the benchmarks; a module's own names (its limits,
# the robust aggregate's pieces) are imported from that module, and patched there.
__all__ = ["UPDATE_CODECS", "Averager", "AveragingRound", "Bounds", "Buffers", "GroupMismatch", "OuterOptimizer",
           "Part", "RoundFailed", "RoundReport", "RoundSpec", "flatten", "remember", "unflatten_", "validate_part"]
