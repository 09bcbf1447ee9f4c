"""``bt-bench shape`` (the paper's 75.8B logical shape): a projection from a measured
``bt-bench wan`` run. At the measured width it gives back the measured bytes and ``bt-bench wan``'s
link bound; wider hidden states add exactly their bytes between hops; compute is the roofline of
stated rates; a result without positions, of another chain length, or a shape that does not fit
a hop, is refused."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from blocktrain.bench.shape import Device, Shape, project
from blocktrain.bench.wan import _bound
from blocktrain.p2p.link import LinkSpec


def _bt_bench(*args):
    return subprocess.run([str(Path(sys.executable).parent / "bt-bench"), *args], capture_output=True, text=True,
                          timeout=300)


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> Path:
    """A real ``bt-bench wan`` run of every mode: 4 bytes after one validation prompt, unshaped links."""
    path = tmp_path_factory.mktemp("shape") / "wan.json"
    r = _bt_bench("wan", "--bytes", "4", "--prompts", "1", "--split", "valid", "--rtt-ms", "0", "--rate-mbit", "0",
                  "--json", str(path))
    assert r.returncode == 0, r.stderr[-2000:]
    return path


def test_at_the_measured_width_the_projection_is_the_measured_bytes_and_the_link_bound(measured):
    m = json.loads(measured.read_text())
    d, hops = m["model"]["d_model"], m["hops"]
    assert m["autoregressive"]["positions"] == m["blocktrain"]["positions"] == 64 + 4 - 1  # each position once
    assert m["exact"]["positions"] >= m["exact"]["traversals"]  # drafts are computed too
    same = project(m, Shape(params=1e9, hidden=d, hops=hops), rtt_ms=50, rate_mbit=100)
    link = LinkSpec(delay_ms=25, rate_mbit=100)
    for mode in ("exact", "autoregressive", "blocktrain"):
        r = same[mode]
        assert r["bytes_moved"] == m[mode]["bytes_moved"]
        assert r["latency_s"] + r["serialization_s"] == pytest.approx(
            _bound(m[mode]["traversals"], hops, link, m[mode]["bytes_moved"], 0.0))
    wide = project(m, Shape(hidden=8192, hops=hops), rtt_ms=50, rate_mbit=100, source=str(measured))
    for mode in ("exact", "autoregressive", "blocktrain"):
        grown = wide[mode]["bytes_moved"] - m[mode]["bytes_moved"]
        assert grown == m[mode]["positions"] * (hops - 1) * 2 * (8192 - d)  # the hidden states between hops
    assert wide["kind"].startswith("projection") and wide["shape"]["hidden_source"].startswith("assumed")
    assert wide["speedup_exact_vs_autoregressive"] > 0 and wide["measured"]["file"] == str(measured)


def test_a_hop_pass_is_the_longer_of_reading_its_weights_and_its_flops():
    h200 = Device()
    assert h200.pass_s(25e9, 1, 2) == pytest.approx(50e9 / 4.8e12)  # one position: the weights' read
    assert h200.pass_s(25e9, 320, 2) == pytest.approx(320 * 50e9 / 989e12)  # many: the FLOPs
    m = {"benchmark": "wan", "model": {"d_model": 192}, "hops": 3, "rtt_ms": 50, "rate_mbit": 100,
         "autoregressive": {"traversals": 256, "positions": 319, "bytes_moved": 9e5},
         "blocktrain": {"traversals": 1, "positions": 319, "bytes_moved": 5e5}}
    p = project(m)
    assert p["autoregressive"]["hop_pass_bound_by"] == "memory" and p["blocktrain"]["hop_pass_bound_by"] == "compute"
    assert p["autoregressive"]["compute_s"] == pytest.approx(256 * 3 * Device().pass_s(75.8e9 / 3, 319 / 256, 2))


def test_a_result_without_positions_or_a_shape_that_does_not_fit_is_refused(tmp_path, measured):
    m = json.loads(measured.read_text())
    old = {k: v for k, v in m.items()}
    old["exact"] = {k: v for k, v in m["exact"].items() if k != "positions"}
    with pytest.raises(ValueError, match="predates"):
        project(old)
    with pytest.raises(ValueError, match="ran over 3 hops, not 4"):
        project(m, Shape(hops=4))  # its links between hops are what is widened: 2 measured, not 3
    with pytest.raises(ValueError, match="do not fit"):
        project({**m, "hops": 1}, Shape(hops=1))  # 151.6 GB of fp16 on one 141 GB device
    with pytest.raises(ValueError, match="'wan'"):
        project({"benchmark": "gossip"})
    bad = tmp_path / "old.json"
    bad.write_text(json.dumps(old))
    r = _bt_bench("shape", "--measured", str(bad))
    assert r.returncode == 1 and "predates" in r.stderr


def test_bt_bench_shape_prints_a_labelled_projection_and_writes_its_provenance(tmp_path, measured):
    out = tmp_path / "shape.json"
    r = _bt_bench("shape", "--measured", str(measured), "--rtt-ms", "50", "--rate-mbit", "100", "--json", str(out))
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("PROJECTION (no model of this shape was run)") and "exact vs autoregressive" in r.stdout
    d = json.loads(out.read_text())
    assert d["benchmark"] == "shape" and "code_version" in d and "command" in d
    assert d["links"] == {"rtt_ms": 50.0, "rate_mbit": 100.0, "hops": 3}
