"""bt-bench faults: the figures it reads from a run (pure, here), and the silent faults of a real
network on bt-peer processes in network namespaces (slow; skipped with the reason where
namespaces cannot be made)."""

import pytest

from blocktrain.bench import faults, netns


def _run(fault, points, marks, ce, digests=("d", "d", "d", "d"), final=(0, 1, 2, 3), failed=(0, 0, 0, 0)):
    reps = [{"state": "done", "step": 10, "steps": 10, "ce_end": c, "failed_rounds": [{}] * f, "joins": [],
             "round_seconds": [0.1, 2.5 if f else 0.1]} for c, f in zip(ce, failed)]
    return {"fault": fault, "settled": True, "final_group": list(final), "stopped_at_end": [], "digests": list(digests),
            "marks": marks, "timeline": points, "reports": reps, "spec": {"dead_after_s": 2.0}}


def test_the_figures_of_a_fault_run_come_from_its_timeline_and_reports():
    none = _run("none", [(0.0, [[4, 6]] * 4)], {}, [2.0, 2.0, 2.0, 2.0])
    full = [[4, 9]] * 4
    split = [[2, 9], [2, 9], [2, 9], [2, 9]]
    cut = _run("partition", [(1.0, full), (5.0, full), (6.5, split), (26.0, split), (27.5, full)],
               {"fault": 5.0, "heal": 25.0, "one group": 27.5}, [2.01, 2.0, 2.03, 2.05], failed=(1, 0, 2, 0))
    s = faults.summarize(cut, none)
    assert s["detect_s"] == 1.5 and s["one_group_after_s"] == 2.5
    assert s["failed_rounds"] == [1, 0, 2, 0] and s["rounds_over_dead_after"] == [1, 0, 1, 0]
    assert s["final_group_identical"] and s["ce_vs_no_faults"] == [0.01, 0.0, 0.03, 0.05]
    dead = _run("link-down", [(5.0, full), (8.0, [[3, 9], [3, 9], [3, 9], [1, 9]])],
                {"fault": 5.0, "one group": 8.0}, [2.0] * 4, digests=("d", "d", "d", "x"), final=(0, 1, 2))
    s = faults.summarize(dead, none)  # the host cut off for good is not of the final group
    assert s["detect_s"] == 3.0 and s["one_group_after_s"] == 3.0 and s["final_group_identical"]
    assert not faults.summarize({**dead, "digests": ["d", "e", "d", "x"]}, none)["final_group_identical"]
    assert faults.report([s])[1].startswith("link-down")


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["link-down", "one-way", "pause"])
def test_a_swarm_in_namespaces_survives_a_silent_fault_with_one_final_state(tmp_path, fault):
    """Invariants, as a history checker would: the peers still reachable at the end were one group
    again after the fault, every one finished its block, and their final parameters are identical;
    a host cut off for good was departed within --dead-after and a round or two."""
    why = netns.available()
    if why:
        pytest.skip(f"network namespaces unavailable: {why}")
    spec = faults.RunSpec(fault, steps=900, hold_s=10.0, bound_s=240.0)
    r = faults.summarize(faults.run_one(spec, tmp_path / fault), None)
    assert r["settled"] and r["final_group_identical"], r
    assert all(r["done"][i] for i in range(3)) and r["stopped_at_end"] == [], r
    assert r["one_group_after_s"] is not None and r["one_group_after_s"] < 10, r
    if fault == "link-down":
        assert r["detect_s"] is not None and r["detect_s"] <= spec.dead_after_s + 3, r
