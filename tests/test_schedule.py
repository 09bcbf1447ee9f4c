"""The relay and parallel schedules (p2p/swarm/schedule.py): pure, no torch, no sockets."""

import subprocess
import sys

import pytest

from blocktrain.p2p.swarm.schedule import EVAL_POINTS, Schedule


def test_relay_trains_every_block_in_turn_and_each_ends_at_a_multiple_of_its_steps():
    s = Schedule(k=1, n_blocks=3, S=10, H=2)
    assert s.plan == (0, 1, 2) and s.total_steps == 30
    assert [s.block_at(g) for g in (0, 9, 10, 19, 20, 29, 30)] == [0, 0, 1, 1, 2, 2, 2]
    assert [g for g in range(31) if s.ends_block(g, s.block_at(g - 1) if g else 0)] == [10, 20, 30]
    assert not s.ends_block(10, 1) and not s.ends_block(0, 0)  # a failed first round of block 1 (or 0) ends nothing
    assert [g for g in range(0, 30, 2) if s.last_round(g)] == [8, 18, 28]
    assert [s.final_step(b) for b in s.plan] == [10, 20, 30]
    assert not any(s.refresh_due(g) for g in range(31))  # relay: the lower blocks are our own


def test_parallel_trains_its_own_block_and_refreshes_its_input():
    s = Schedule(k=2, n_blocks=3, S=12, H=3, relay=False, refresh_every=6)
    assert s.plan == (2,) and s.total_steps == 12 and {s.block_at(g) for g in range(13)} == {2}
    assert not any(s.ends_block(g, 2) for g in range(13))  # nothing to hand over
    assert [g for g in range(13) if s.refresh_due(g)] == [6, 12]
    every10 = Schedule(k=2, n_blocks=3, S=100, H=10, relay=False, refresh_every=25)  # rounds that split the block:
    assert [g for g in range(0, 101, 10) if every10.refresh_due(g)] == [50, 100]  # multiples only, as always
    assert not any(Schedule(0, 3, 12, 3, relay=False).refresh_due(g) for g in range(13))  # block 0 has no input


def test_rounds_picked_inside_a_block_end_at_its_end_and_pass_no_refresh_or_report():
    """sync=auto: rounds of 1 step, then of 5 (not a divisor of 12): the block's last round is
    what is left of it, it is the last round, and every multiple of the refresh period is passed."""
    s = Schedule(k=2, n_blocks=3, S=12, H=1, relay=False, refresh_every=4)
    g, ends, refreshed = 0, [], []
    for _ in range(2):
        g += s.round_steps(g)
        refreshed += [g] if s.refresh_due(g) else []
    s.pick(5)
    while g < 12:
        last = s.last_round(g)
        g += s.round_steps(g)
        ends.append((g, last))
        refreshed += [g] if s.refresh_due(g) else []
    assert ends == [(7, False), (12, True)]
    assert refreshed == [7, 12]  # the first round past 4, then the one past 8 (and at 12)
    # a pick that divides the block still ends rounds off its multiples after the probe rounds
    s = Schedule(k=2, n_blocks=3, S=12, H=1, relay=False, refresh_every=4)
    g, refreshed = 3, []
    s.pick(2)
    while g < 12:
        g += s.round_steps(g)
        refreshed += [g] if s.refresh_due(g) else []
    assert refreshed == [5, 9, 12]


def test_curve_points_come_whenever_a_multiple_is_passed():
    s = Schedule(k=0, n_blocks=2, S=105, H=7)
    assert s.eval_period == 210 // EVAL_POINTS == 10
    marks = [s.eval_mark(g) for g in range(0, 211, 7)]  # rounds of 7 steps: no multiple of 10 is missed
    assert sorted(set(marks)) == list(range(22)) and marks == sorted(marks)
    assert Schedule(0, 2, 100, 4, eval_every=0).eval_mark(40) is None


def test_steps_must_split_into_rounds():
    with pytest.raises(ValueError, match="do not split into rounds"):
        Schedule(k=0, n_blocks=2, S=10, H=3)
    s = Schedule(k=0, n_blocks=2, S=10, H=5)
    with pytest.raises(ValueError, match="do not split"):
        s.set_steps(12)
    s.set_steps(20)
    assert s.total_steps == 40


def test_the_schedule_imports_no_torch():
    code = ("import sys, importlib.util as u; spec = u.spec_from_file_location('s', sys.argv[1]); "
            "m = u.module_from_spec(spec); sys.modules['s'] = m; spec.loader.exec_module(m); assert 'torch' not in sys.modules")
    import blocktrain.p2p.swarm.schedule as mod
    subprocess.run([sys.executable, "-c", code, mod.__file__], check=True)
