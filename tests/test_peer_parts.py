"""The peer's parts without sockets: the redial schedule and dial cool-down, the member table, the
traffic ledger, the handler registry and the waiters (p2p/redial.py, members.py, ledger.py,
handlers.py, waiters.py). Time is passed in; connections are stand-ins."""

import asyncio

import pytest

from blocktrain.p2p.handlers import Handlers
from blocktrain.p2p.ledger import DEPARTED_ROW, TrafficLedger
from blocktrain.p2p.members import MemberTable
from blocktrain.p2p.redial import DIAL_COOLDOWN_S, REDIAL_MAX_S, REDIAL_MIN_S, Redials
from blocktrain.p2p.services import Liveness
from blocktrain.p2p.waiters import Waiters
from blocktrain.protocol import BlockUpdate, ErrorCode, PeerInfo, Ping, RemoteProtocolError


class _Closed:
    def __init__(self, done=False):
        self._done = done

    def done(self):
        return self._done


class _Counter:
    def __init__(self, frames):
        self.frames = frames

    def snapshot(self):
        c = {"frames": self.frames, "payload_bytes": 10 * self.frames, "wire_bytes": 20 * self.frames}
        return {"sent": {"by_type": {"PING": dict(c)}, "by_kind": {"control": dict(c)}, "total": dict(c)},
                "received": {"by_type": {}, "by_kind": {}, "total": {k: 0 for k in c}}}


class _Conn:
    """What the parts read of a PeerConnection: last_heard, closed, counts (accounted: added to
    the traffic rows), and aborts."""

    def __init__(self, last_heard=0.0, closed=False, frames=1, accounted=False):
        self.last_heard, self.closed, self.refused, self.accounted = last_heard, _Closed(closed), None, accounted
        self.conn = type("C", (), {"counter": _Counter(frames)})()

    def abort_with(self, code, reason, cause):
        self.refused = (code, reason)


def _info(i, addr=None, role="train", blocks=(0,)):
    return PeerInfo(f"{i:064x}", addr if addr is not None else f"10.0.0.{i}:7000", blocks, role, 0)


# --- redial.py --------------------------------------------------------------------------------------

def test_redials_back_off_from_min_to_max_and_give_up():
    r = Redials(redial_for_s=300)
    r.schedule("a:1", "p", now=0.0)
    dials = []
    for i in range(800):  # 400 s of heartbeats, 0.5 s apart
        now = 0.5 * i
        dials += [now for _ in r.due(now)]
    gaps = [round(b - a) for a, b in zip(dials, dials[1:])]
    assert dials[0] == REDIAL_MIN_S and gaps[:6] == [min(2 ** i, REDIAL_MAX_S) for i in range(6)]
    assert set(gaps[5:]) == {REDIAL_MAX_S} and dials[-1] <= 300 and len(r) == 0
    assert max(gaps) <= 5  # a partition that heals is dialled again within 5 s (at 30 s: 15 s to one group)


def test_a_redial_soon_comes_at_once_and_an_address_being_dialled_waits():
    r = Redials(redial_for_s=60)
    r.schedule("a:1", "p", now=10.0, soon=True)
    assert r.due(10.0, dialing={"a:1"}) == [] and r.by_addr["a:1"].backoff == REDIAL_MIN_S  # waits, unchanged
    assert r.due(10.0) == ["a:1"] and r.due(10.5) == []
    r.schedule("a:1", "p", now=10.6, soon=True)  # lost again just now: brought forward
    assert r.due(10.6) == ["a:1"]
    r.schedule("", "p", now=11.0)  # no address: nothing to dial
    r.forget("a:1")
    assert len(r) == 0


def test_redials_are_bounded_and_the_closest_to_giving_up_makes_room():
    r = Redials(redial_for_s=100, max_redials=3)
    for i in range(5):
        r.schedule(f"a:{i}", "p", now=float(i))
    assert sorted(r.by_addr) == ["a:2", "a:3", "a:4"]


def test_a_failed_address_cools_down_and_failures_are_bounded():
    r = Redials(redial_for_s=60, max_failed=2)
    r.failed("a:1", now=0.0)
    assert r.cooling("a:1", now=DIAL_COOLDOWN_S) and not r.cooling("b:1", now=0.0)
    assert not r.cooling("a:1", now=DIAL_COOLDOWN_S + 0.1) and "a:1" not in r.failures  # forgotten once cool
    for addr in ("a:1", "b:1", "c:1"):
        r.failed(addr, now=1.0)
    assert list(r.failures) == ["b:1", "c:1"]


# --- members.py -------------------------------------------------------------------------------------

def test_a_full_table_displaces_the_longest_silent_member_that_is_not_alive():
    t = MemberTable(max_members=3, max_known=10)
    for i in range(3):
        t.add(_info(i), _Conn(), now=float(i))
    assert t.full() and t.displaced() is None  # all alive: a newcomer is refused
    for i in (1, 2):
        t.by_id[_info(i).peer_id].liveness = Liveness.SUSPECT
    assert t.displaced() == _info(1).peer_id  # heard longest ago of those not alive


def test_identities_seen_before_are_remembered_up_to_the_bound():
    t = MemberTable(max_members=10, max_known=2)
    assert t.add(_info(1), _Conn(), 0.0) is False
    t.pop(_info(1).peer_id)
    assert t.add(_info(1), _Conn(), 0.0) is True  # BACK
    t.add(_info(2), _Conn(), 0.0)
    t.add(_info(3), _Conn(), 0.0)
    assert list(t.known) == [_info(2).peer_id, _info(3).peer_id]  # 1 was seen longest ago


def test_views_lists_and_lookups():
    t = MemberTable()
    t.add(_info(2, blocks=(1,), role="serve"), _Conn(last_heard=5.0), now=1.0)
    t.add(_info(1), _Conn(closed=True), now=1.0)
    t.add(_info(3), None, now=1.0)
    t.by_id[_info(3).peer_id].liveness = Liveness.SUSPECT
    assert [v.peer_id for v in t.views(6.0)] == [_info(1).peer_id, _info(2).peer_id]  # sorted, alive only
    assert len(t.views(6.0, alive=False)) == 3 and [v.role for v in t.views(6.0, block=1)] == ["serve"]
    assert t.view(_info(2).peer_id, 6.0).last_heard_s == 1.0  # heard on its connection at 5
    assert [p.peer_id for p in t.peer_list(1.5)] == [_info(2).peer_id, _info(1).peer_id]
    assert t.peer_list(1.5)[0].last_seen_ms == 500 and t.peer_list(1e9)[0].last_seen_ms == 2**32 - 1
    assert t.find("10.0.0.2:7000") is t.get(_info(2).peer_id) and t.find("nowhere") is None
    assert t.live_conn(_info(2).peer_id) is not None and t.live_conn(_info(1).peer_id) is None
    assert len(t.conns()) == 2 and len(t.live_conns()) == 1
    t.forgive(100.0)
    assert all(m.heard() == 100.0 for m in t.by_id.values())


# --- ledger.py --------------------------------------------------------------------------------------

def test_departed_rows_fold_into_one_and_totals_stay_exact():
    ledger = TrafficLedger(max_rows=4)
    connected = {"p0", "p1"}
    for i in range(10):
        ledger.add(f"p{i}", _Counter(i + 1).snapshot(), f"10.0.0.{i}:7", lambda p: p in connected)
    assert len(ledger.rows) <= 4 and "p0" in ledger.rows and "p1" in ledger.rows  # connected: never folded
    rep = ledger.report({}, {})
    assert rep["totals"]["sent"]["frames"] == sum(range(1, 11))
    assert rep["peers"][DEPARTED_ROW]["departed_peers"] == ledger.departed_peers > 0
    assert rep["peers"][DEPARTED_ROW]["client"] is False


def test_a_report_adds_live_connections_and_marks_clients():
    ledger = TrafficLedger()
    ledger.add("c", _Counter(1).snapshot(), "", lambda p: False)
    t = MemberTable()
    t.add(_info(1), _Conn(frames=2), now=0.0)
    rep = ledger.report(t.by_id, {"k": _Conn(frames=3)})
    peers = rep["peers"]
    assert peers["c"]["client"] and peers["k"]["client"] and not peers[_info(1).peer_id]["client"]
    assert peers[_info(1).peer_id]["addr"] == "10.0.0.1:7000" and rep["totals"]["sent"]["frames"] == 6
    ledger.add(_info(1).peer_id, _Counter(2).snapshot(), "10.0.0.1:7000", lambda p: True)  # its connection ended
    t.by_id[_info(1).peer_id].conn.accounted = True  # ... and the member still holds it (a peer stopping)
    assert ledger.report(t.by_id, {})["peers"][_info(1).peer_id]["sent"]["total"]["frames"] == 2  # once, not twice


# --- handlers.py ------------------------------------------------------------------------------------

class _Spawner:
    def __init__(self):
        self.names, self.coros = [], []

    def __call__(self, coro, name):
        self.names.append(name)
        self.coros.append(coro)


async def test_inline_handlers_run_in_order_and_others_are_spawned_by_name():
    spawn, got = _Spawner(), []
    h = Handlers(spawn)
    h.on(Ping, lambda m, pc, pid: got.append(m.nonce), inline=True)

    async def later(m, pc, pid):
        got.append(m.round)
    h.on(BlockUpdate, later)
    assert h.handles(Ping) and h.handles(BlockUpdate) and not h.handles(PeerInfo)
    assert h.deliver(Ping(nonce=1), _Conn(), "p") is True and got == [1]
    assert h.deliver(BlockUpdate(block=0, round=7), _Conn(), "p") is True and spawn.names == ["handle BlockUpdate"]
    await spawn.coros[0]
    assert got == [1, 7] and h.deliver(_info(1), _Conn(), "p") is None  # no handler: the peer's own


async def test_a_handler_that_raises_refuses_the_senders_message_by_type():
    spawn = _Spawner()
    h = Handlers(spawn)

    def bad(m, pc, pid):
        raise ValueError("no such phase")
    h.on(Ping, bad, inline=True)
    pc = _Conn()
    assert h.deliver(Ping(nonce=1), pc, "p" * 64) is False
    assert pc.refused[0] == ErrorCode.MALFORMED_METADATA and "ValueError" in pc.refused[1]

    async def protocol(m, pc, pid):
        raise RemoteProtocolError("bad tensor", ErrorCode.BAD_TENSOR)
    h.on(BlockUpdate, protocol)
    pc2 = _Conn()
    assert h.deliver(BlockUpdate(block=0, round=1), pc2, "p" * 64) is True
    await spawn.coros[0]
    assert pc2.refused[0] == ErrorCode.BAD_TENSOR and h.input_failures == {"ValueError": 1, "RemoteProtocolError": 1}


async def test_a_connection_error_in_a_handler_is_not_the_senders_fault():
    h = Handlers(_Spawner())

    def gone(m, pc, pid):
        raise ConnectionError("closed")
    h.on(Ping, gone, inline=True)
    pc = _Conn()
    with pytest.raises(ConnectionError):
        h.deliver(Ping(nonce=1), pc, "p")
    assert pc.refused is None and not h.input_failures


def test_every_handler_for_a_type_gets_each_message():
    """A second ``on`` replaced the first, so a training peer's checkpoint server
    never heard a STREAM_RESET (its fetcher's handler had replaced the server's). Now both hear it,
    in the order they registered."""
    got = []
    h = Handlers(_Spawner())
    h.on(Ping, lambda m, pc, pid: got.append("first"), inline=True)
    h.on(Ping, lambda m, pc, pid: got.append("second"), inline=True)
    assert h.deliver(Ping(nonce=1), _Conn(), "p") is True
    assert got == ["first", "second"]


async def test_a_training_peers_checkpoint_server_hears_a_reset_of_a_stream_it_sends(tmp_path):
    """The server and the fetcher on one peer (as a SwarmTrainer builds them) both take STREAM_RESET:
    the reset of a stream the server sends reaches the server."""
    from blocktrain.p2p.checkpoints import CheckpointFetcher, CheckpointServer
    from blocktrain.protocol import StreamReset

    class _Peer:
        def __init__(self):
            self.handlers = Handlers(_Spawner())

        def on(self, t, fn, *, inline=False):
            self.handlers.on(t, fn, inline=inline)
    peer = _Peer()
    server = CheckpointServer(peer, tmp_path)
    CheckpointFetcher(peer)
    server._serving.add(("p" * 64, 7))
    peer.handlers.deliver(StreamReset(code=1, reason="enough", stream_id=7), _Conn(), "p" * 64)
    assert ("p" * 64, 7) in server._reset


# --- waiters.py -------------------------------------------------------------------------------------

async def test_waiters_wake_on_notify_and_give_up_when_stopping_or_late():
    stopping, flag = [False], [False]
    w = Waiters(lambda: stopping[0])
    task = asyncio.ensure_future(w.wait_for(lambda: flag[0], 10))
    await asyncio.sleep(0)
    flag[0] = True
    w.notify()
    assert await asyncio.wait_for(task, 1) is True
    assert await w.wait_for(lambda: False, 0.01) is False
    stopping[0] = True
    assert await w.wait_for(lambda: False, None) is False


async def test_a_cancel_in_the_same_turn_as_the_notify_ends_the_wait():
    """asyncio.wait_for in Python 3.11 returns the inner result when the cancel comes in the same
    turn of the loop, and the cancel is lost (a stopped trainer trained on to its end)."""
    flag = [False]
    w = Waiters(lambda: False)
    task = asyncio.ensure_future(w.wait_for(lambda: flag[0], 10))
    await asyncio.sleep(0)
    flag[0] = True
    w.notify()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


def test_the_package_bounds_its_waits_with_asyncio_timeout_not_wait_for():
    """The rule of waiters.py, everywhere: asyncio.wait_for drops a cancel that comes in the turn
    its wait ends (Python 3.11), so a stopped peer's task may go on."""
    from pathlib import Path
    root = Path(__file__).resolve().parent.parent
    found = [f"{p.relative_to(root)}:{i}" for d in ("p2p", "protocol", "blocks", "bench")
             for p in (root / d).rglob("*.py")
             for i, line in enumerate(p.read_text().splitlines(), 1) if "asyncio.wait_for(" in line]
    assert not found, f"asyncio.wait_for in the package (use asyncio.timeout): {found}"
