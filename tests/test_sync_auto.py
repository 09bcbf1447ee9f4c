"""sync=auto (p2p/swarm/auto.py): the pick from measured figures, and a group that takes one pick."""

import asyncio
import math

import pytest
import torch

from blocktrain.p2p.swarm import SwarmConfig, auto
from blocktrain.p2p.swarm.auto import MAX_H, PROBE, AutoSync, Pace, SyncMode, choice_of, choose, grads_ratio
from blocktrain.blocks.train import TrainConfig

from conftest import mesh
from test_swarm import FAST, SC, TC, _two_then_a_joiner, finals, restarted_third, slowed, trainers

AUTO = SwarmConfig(**{**SC.__dict__, "sync": "auto", "min_group": 3})


def test_a_fast_link_keeps_gradients_every_step_and_a_slow_one_picks_rounds_within_the_share():
    # a probe round of 0.1 ms against 100 ms of compute: a gradient round 3.2 ms, 3% of the time
    fast = [Pace(0.1, 0.0001, 1000, 32.0)] * 3
    mode, figures = choose(fast, 0.1)
    assert mode == SyncMode() and figures["grads_share"] <= 0.1
    for wire, step in [(0.05, 0.1), (0.5, 0.3), (2.0, 0.3), (10.0, 0.01)]:
        mode, figures = choose([Pace(step, wire, 1000, 32.0)], 0.1)
        assert mode.sync == "params" and mode.codec == "sign" and 1 <= mode.every <= MAX_H
        if mode.every < MAX_H:  # the smallest H that keeps the probe's wire time within 10%
            assert wire / (wire + mode.every * step) <= 0.1 < wire / (wire + (mode.every - 1) * step)
        assert mode.outer_lr == (1.7 if mode.every < 4 else 1.0)
    assert choose([Pace(0.01, 10.0, 1000, 32.0)], 0.1)[0].every == MAX_H  # bounded
    # medians: one odd round does not decide
    paces = [Pace(0.1, 0.0001, 1, 32.0), Pace(0.1, 0.0001, 1, 32.0), Pace(0.1, 5.0, 1, 32.0)]
    assert choose(paces, 0.1)[0] == SyncMode()


def test_grads_ratio_is_the_fp32_bytes_over_the_sign_bytes_of_the_same_round():
    n = 10 * 4096
    assert grads_ratio(n, 3, "robust") == pytest.approx(4 * n / (10 * (512 + 4)))
    assert grads_ratio(n, 4, "mean") == pytest.approx(grads_ratio(n, 3, "robust") * 2 / 4)
    assert grads_ratio(n, 2, "robust") == pytest.approx(grads_ratio(n, 3, "robust"))  # 2 members: a plain mean


@pytest.mark.parametrize("tag", ["grads", "params/1/sign/1.7", "params/32/sign/1", "params/64/sign/1"])
def test_a_mode_tag_round_trips(tag):
    assert SyncMode.parse(tag).tag == tag


@pytest.mark.parametrize("tag", ["", "Grads", "params/0/sign/1", "params/65/sign/1", "params/4/raw/1",
                                 "params/04/sign/1", "params/4/sign/2", "params/4/sign/1.0", 7, None, ["grads"],
                                 "grads ", "params/1000/sign/1"])
def test_a_mode_auto_cannot_pick_is_refused(tag):
    assert SyncMode.parse(tag) is None


@pytest.mark.parametrize("said", [None, "grads", {"mode": "params/99/sign/1"}, {"mode": "grads", "x": math.nan},
                                  {"mode": "grads", "x": math.inf}, {"mode": "grads", "x": -1},
                                  {"mode": "grads", "x": True}, {"mode": "grads", "x": "1"},
                                  {"mode": "grads", 3: 1}, {"mode": "grads", "x" * 33: 1},
                                  {"mode": "grads", "X": 1}, {"mode": "grads", "a\x1b": 1},
                                  {"mode": "grads", **{f"k{i}": 1 for i in range(9)}}])
def test_a_choice_with_a_bad_mode_or_figure_is_not_taken(said):
    assert choice_of(said) is None
    a = AutoSync(0.1)
    assert not a.take(said, 3, "sponsor") and a.probing and a.mode == PROBE


def test_a_choice_is_taken_once_per_block_and_kept_in_the_checkpoint():
    a = AutoSync(0.1)
    assert a.proposal() is None  # no figures yet: the sponsor says nothing
    a.measured(Pace(0.1, 0.2, 1000, 32.0))
    assert a.proposal() is None  # one round: not yet
    a.measured(Pace(0.1, 0.2, 1000, 32.0))
    said = a.proposal()
    assert SyncMode.parse(said["mode"]).every == 18  # 0.2 / (0.2 + 18 x 0.1) = 10%
    assert a.take(said, 5, "s") and not a.probing and a.saved == said["mode"]
    assert not a.take({"mode": "grads"}, 6, "s") and a.saved == said["mode"]  # one pick per block
    b = AutoSync(0.1)
    b.restore(a.saved)
    assert b.mode == a.mode and not b.probing
    b.restore("")
    assert b.probing and b.mode == PROBE
    a.reset()
    assert a.probing and a.saved == ""


@pytest.mark.parametrize("set_", [{"every": 4}, {"codec": "sign"}, {"outer_lr": 1.7}, {"overlap": True},
                                  {"gossip": 3}, {"outer": "nesterov"}])
def test_auto_refuses_settings_it_picks_itself(set_):
    with pytest.raises(ValueError, match="sync=auto picks"):
        SwarmConfig(sync="auto", **set_)


def _picks(monkeypatch, mode: SyncMode):
    """Every sponsor picks ``mode`` whatever it measured (choose is tested above)."""
    monkeypatch.setattr(auto, "choose", lambda paces, share: (mode, {"step_s": 0.01, "probe_wire_s": 0.02,
                                                                      "grads_share": 0.5}))


@pytest.mark.parametrize("mode", [SyncMode(), SyncMode("params", 5, "sign", 1.0)], ids=["grads", "rounds-of-5"])
async def test_the_group_takes_its_sponsors_pick_in_every_block_and_ends_identical(tmp_path, monkeypatch, mode):
    """Three peers, relay over 3 blocks of 12 steps: each block probes (two rounds the sponsor
    measures, a third whose sponsor says its pick), then runs the pick to the block's end (rounds
    of 5 do not divide the 9 steps left: 5 + 4); the three end byte-identical, and say the pick."""
    _picks(monkeypatch, mode)
    peers = await mesh(3, FAST, blocks=[(0,), (1,), (2,)])
    try:
        sps = trainers(peers, tmp_path, AUTO)
        reps = await asyncio.wait_for(asyncio.gather(*(sp.run() for sp in sps)), 120)
        a, b, c = (finals(sp) for sp in sps)
        assert torch.equal(a, b) and torch.equal(a, c)
        per_block = 3 + (9 if mode.sync == "grads" else 2)
        for r in reps:
            assert r["state"] == "done" and not r["failed_rounds"] and r["rounds_applied"] == 3 * per_block
            assert [(x["block"], x["mode"], x["round"]) for x in r["sync_choices"]] == \
                [(k, mode.tag, 3 + k * per_block) for k in range(3)]
            assert not r["rejected_updates"]
            assert all(x["by"] == min(p.id for p in peers) for x in r["sync_choices"])
    finally:
        for p in peers:
            await p.stop()


async def test_a_member_that_takes_another_pick_is_of_another_view_and_the_others_train_on(tmp_path, monkeypatch):
    """A member whose rounds run another mode than the group's (here it takes its own pick in place
    of the sponsor's) begins them under another group digest: the others count it mismatched, by
    name (its rounds are not mixed in), and train on together, identical; it joins again, taking
    the group's state and pick."""
    _picks(monkeypatch, SyncMode("params", 2, "sign", 1.7))
    peers = await mesh(3, FAST, blocks=[(0,), (1,), (2,)])
    try:
        sc = SwarmConfig(**{**AUTO.__dict__, "cut_off_ok": True})
        sps = trainers(peers, tmp_path, sc)
        odd = max(sps, key=lambda sp: sp.peer.id)  # not the sponsor
        take = odd.rounds.picker.auto.take
        odd.rounds.picker.auto.take = lambda said, rnd, by: take(said and {"mode": "params/3/sign/1.7"}, rnd, by)
        reps = await asyncio.wait_for(asyncio.gather(*(sp.run() for sp in sps)), 120)
        honest = [sp for sp in sps if sp is not odd]
        assert torch.equal(finals(honest[0]), finals(honest[1]))
        # ... and the odd one, after its mismatches, joins again and takes the group's state and pick
        taken = [c for c in reps[sps.index(odd)]["sync_choices"] if c["round"] is None]  # (in whichever block)
        assert taken and taken[0]["mode"] == "params/2/sign/1.7" and "group's state" in taken[0]["by"]
        for sp in honest:
            r = reps[sps.index(sp)]
            assert any(odd.peer.id[:12] in f["reason"] and "another view" in f["reason"] for f in r["failed_rounds"])
            assert not r["rejected_updates"]  # an honest disagreement is no forgery
    finally:
        for p in peers:
            await p.stop()


def test_a_part_of_another_mode_under_the_groups_digest_is_rejected_by_name():
    """A part that says another mode than the round's under the round's own group digest (a
    forger's: an honest member's other mode changes its digest) is rejected, by name."""
    from blocktrain.p2p.averaging import AveragingRound, RoundSpec

    from conftest import run_rounds
    ids = ["a" * 64, "b" * 64, "c" * 64]
    mine, forged = RoundSpec(codec="sign", aggregate="robust", mode="params/1/sign/1.7"), \
        RoundSpec(codec="sign", aggregate="robust", mode="grads")
    rs = {p: AveragingRound(p, 0, 1, ids, torch.randn(100), forged if p == ids[2] else mine, start="s|x")
          for p in ids}
    run_rounds(rs)
    for p in ids[:2]:
        rep = rs[p].result()[1]
        assert [r["peer"] for r in rep.rejected] == [ids[2]]
        assert "another sync mode: 'grads', ours 'params/1/sign/1.7'" in rep.rejected[0]["reason"]


class _Tr:
    """A block trainer as the picker sees it: its parameters, and its optimizer resets counted."""
    def __init__(self):
        self.block, self.resets = torch.nn.Linear(4, 4), 0

    def reset_optimizer(self):
        self.resets += 1


def _picker(monkeypatch, mode: SyncMode, me="a" * 64):
    from types import SimpleNamespace

    from blocktrain.p2p.swarm.picker import Picker
    from blocktrain.p2p.swarm.report import Stats
    from blocktrain.p2p.swarm.schedule import Position, Schedule
    _picks(monkeypatch, mode)
    averager = SimpleNamespace(set_mode=lambda codec, tag, steps: None)
    return Picker(0.1, "robust", Schedule(0, 1, 12, 1), averager, Position(0), Stats(), me, lambda line: None)


def _rep(contributors, choices=None, departed=()):
    from types import SimpleNamespace
    return SimpleNamespace(seconds=0.01, bytes_sent=100, departed=list(departed), choices=choices or {},
                           parts=[{"contributors": list(c)} for c in contributors])


def test_a_choice_is_taken_only_where_the_sponsors_part_counted_in_every_piece(monkeypatch):
    a, b, c = "a" * 64, "b" * 64, "c" * 64
    said = {"mode": "params/4/sign/1"}
    p, tr = _picker(monkeypatch, SyncMode("params", 4, "sign", 1.0), me=b), _Tr()
    p.probed(2, [a, b, c], _rep([[a, b, c], [b, c]], {a: said}), 0.1, None, tr)  # a's part missing in a piece
    assert p.auto.probing and len(p.auto.paces) == 1
    p.probed(3, [a, b, c], _rep([[a, b, c], [a, b, c]], {a: said}, departed=[a]), 0.1, None, tr)  # counted: taken
    assert not p.auto.probing and p.auto.mode.tag == "params/4/sign/1" and tr.resets == 0


def test_a_round_every_other_member_departed_measures_nothing_and_a_sponsor_picks_after_two_rounds(monkeypatch):
    a, b, c = "a" * 64, "b" * 64, "c" * 64
    p, tr = _picker(monkeypatch, SyncMode("params", 4, "sign", 1.0), me=a), _Tr()
    p.probed(1, [a, b, c], _rep([[a]], departed=[b, c]), 0.1, None, tr)
    assert p.auto.paces == [] and p.choice([a, b, c]) is None
    p.probed(2, [a, b, c], _rep([[a, b, c]]), 0.1, None, tr)
    assert p.choice([a, b, c]) is None  # one round measured: not yet
    p.probed(3, [a, b, c], _rep([[a, b, c]]), 0.1, None, tr)
    assert p.choice([a, b, c])["mode"] == "params/4/sign/1" and p.choice([b, c]) is None  # (b sponsors that one)


def test_taking_gradient_rounds_resets_the_optimizer_before_the_rounds_state_is_saved(monkeypatch):
    a, b = "a" * 64, "b" * 64
    p, tr = _picker(monkeypatch, SyncMode(), me=b), _Tr()
    p.probed(2, [a, b], _rep([[a, b]], {a: {"mode": "grads"}}), 0.1, None, tr)
    assert not p.auto.probing and tr.resets == 1  # at the take, not at the next round's start
    p.restore_from({"sync_mode": "grads"}, 0, 5, "the group's state")
    assert p.apply(tr) is not None and tr.resets == 1  # a restored state's moments are the group's


@pytest.mark.parametrize("mode", [SyncMode(), SyncMode("params", 4, "sign", 1.0)], ids=["grads", "rounds-of-4"])
async def test_a_joiner_takes_the_groups_pick_with_its_state_and_ends_identical(tmp_path, monkeypatch, mode):
    _picks(monkeypatch, mode)
    peers = await mesh(3, FAST, blocks=[(0,), (1,), (2,)])
    tc = TrainConfig(**{**TC.to_dict(), "steps": 42})
    try:
        sc = SwarmConfig(**{**AUTO.__dict__, "min_group": 2})
        sps = [slowed(sp, 0.01) for sp in trainers(peers, tmp_path, sc, tc)]
        reps, joiner = await _two_then_a_joiner(sps, 4)
        assert joiner["joins"][-1]["how"] == "fetched the group's state"
        assert joiner["sync_choices"][0]["mode"] == mode.tag  # the block it joined: taken from the state
        a, b, c = (finals(sp) for sp in sps)
        assert torch.equal(a, b) and torch.equal(a, c)
        assert not any(r["failed_rounds"] or r["rejected_updates"] for r in reps + [joiner])
    finally:
        for p in peers:
            await p.stop()


def test_the_sync_mode_vectors_of_protocol_md_both_ways():
    import json

    from vectors import VALID, tables
    rows = tables("Sync mode")
    assert {r[0] for r in rows} == {"mode", "choice"} and any(r[2] == "refused" for r in rows)
    for key, value, taken in rows:
        said = json.loads(value.strip("`"))
        got = SyncMode.parse(said) if key == "mode" else (choice_of(said) or (None,))[0]
        assert (got.tag if got is not None else "refused") == taken, (key, value)
        if taken != "refused":  # and back: the tag written from the mode it parses to
            assert SyncMode.parse(taken).tag == taken
    part = VALID["block_update_sign_auto"].meta  # the valid frame's keys are the first choice row's
    assert SyncMode.parse(part["mode"]) == PROBE
    first = next(r for r in rows if r[0] == "choice")
    assert part["choice"] == json.loads(first[1].strip("`"))


async def test_a_member_restarted_in_the_picked_rounds_keeps_the_pick_and_ends_identical(tmp_path, monkeypatch):
    """A member stopped after the block took its pick and started again (same identity and work
    directory) resumes with the pick from its own checkpoint, rejoins, and the three end
    byte-identical; its report says where its pick came from."""
    from blocktrain.p2p.swarm import PeerJob, store

    from test_swarm import MC
    monkeypatch.setattr(store, "SAVE_EVERY_S", 0.0)  # a checkpoint after every round
    _picks(monkeypatch, SyncMode("params", 3, "sign", 1.7))
    peers = await mesh(3, FAST, blocks=[(0,), (1,), (2,)])
    tc = TrainConfig(**{**TC.to_dict(), "steps": 48})
    try:
        sps = [slowed(sp, 0.02) for sp in trainers(peers, tmp_path, AUTO, tc)]
        tasks = [asyncio.ensure_future(sp.run()) for sp in sps]
        again = await restarted_third(peers, sps, tasks, 5, PeerJob(MC, tc, AUTO), tmp_path, 0.02)  # past the pick
        assert again.rounds.mode_line() == "auto: sign rounds of 3 step(s), outer lr 1.7"  # from its own checkpoint
        rep = await asyncio.wait_for(again.run(), 240)
        reps = await asyncio.wait_for(asyncio.gather(*tasks[:2]), 240)
        assert all(r["state"] == "done" for r in reps + [rep])
        a, b, c = finals(sps[0]), finals(sps[1]), finals(again)
        assert torch.equal(a, b) and torch.equal(a, c)
        assert rep["sync_choices"][0]["mode"] == "params/3/sign/1.7" and rep["sync_choices"][0]["round"] is None
    finally:
        for p in peers:
            await p.stop()
