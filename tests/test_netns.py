"""The kernel WAN path (network namespaces): skipped cleanly where it cannot run."""

import os

import pytest

from blocktrain.bench import netns


def test_available_explains_when_not_root(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert "root" in netns.available()


@pytest.mark.slow
def test_kernel_path_serves_both_modes_within_bounds():
    why = netns.available()
    if why:
        pytest.skip(f"kernel path unavailable: {why}")
    from blocktrain.bench.wan_kernel import run_kernel
    r = run_kernel(n_bytes=16, rtt_ms=40, rate_mbit=100, hops=3, d_model=64, repeats=1, log=lambda s: None)
    assert "namespaces" in r["links"]
    for mode in ("blocktrain", "autoregressive"):
        assert r[mode]["bound_s"] > 0 and r[mode]["vs_bound"] is not None  # speed itself is bt-bench's
    assert r["autoregressive"]["traversals"] == 16 and r["blocktrain"]["traversals"] == 1
    assert not [n for n in os.popen("ip netns list").read().split() if n.startswith(f"bt{os.getpid() % 100000}")]
