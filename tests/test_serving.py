"""The serving API (p2p/serving/api.py) shared by the client and the hops: a refusal a hop writes reads
back as the same typed failure; a peer's word is bounded and checked."""

import json
import subprocess
import sys
from pathlib import Path

from blocktrain.bench.wan import SAMPLED_TARGET
from blocktrain.p2p.serving.api import MAX_ERROR_CHARS, PipelineError, block_at, refusal, refusal_meta


def test_a_refusal_written_by_a_hop_reads_back_as_the_same_typed_failure():
    for e in (PipelineError("no caches", 1, 2, fault="session"), PipelineError("bad", 0, None, fault="request"),
              PipelineError("x" * 5000, None, None)):
        meta = refusal(3, refusal_meta(e, 2, 4)).meta
        got = PipelineError.from_meta(meta)
        assert (got.block, got.hop, got.fault) == (e.block, 4 if e.hop is None else e.hop, e.fault)
        assert len(meta["error"]) <= MAX_ERROR_CHARS
    assert "refused by block 0" in str(PipelineError.from_meta({"error": "bad", "block": 0, "fault": "request"}))
    odd = PipelineError.from_meta({"error": "?", "block": "1", "hop": [], "fault": "mine"})  # a peer's word
    assert (odd.block, odd.hop, odd.fault) == (None, None, "hop") and "the chain failed" in str(odd)


def test_block_at_reads_only_an_int_at_a_hop_in_range():
    assert block_at({"blocks": [0, 1, 2]}, 1) == 1
    for meta, hop in (({"blocks": [0, 1]}, 2), ({"blocks": [0, 1]}, -1), ({"blocks": [0, "1"]}, 1),
                      ({"blocks": (0, 1)}, 0), ({}, 0), ({"blocks": [0, True]}, 1)):
        assert block_at(meta, hop) is None


def _bt_bench(*args: str) -> subprocess.CompletedProcess:
    """The installed ``bt-bench``, as a user runs it."""
    return subprocess.run([str(Path(sys.executable).parent / "bt-bench"), *args], capture_output=True, text=True,
                          timeout=600)


def _wan(*args: str, json_path=None):
    """``bt-bench wan ARGS`` on unshaped links (``--rtt-ms 0 --rate-mbit 0``), validation prompts;
    (its stdout, the JSON it wrote or None)."""
    extra = ["--rtt-ms", "0", "--rate-mbit", "0", "--split", "valid"] + (["--json", str(json_path)] if json_path else [])
    r = _bt_bench("wan", *args, *extra)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout, json.loads(json_path.read_text()) if json_path else None


def _refused(*args: str) -> str:
    """``bt-bench ARGS`` refused as a usage error (exit code 2); what it said."""
    r = _bt_bench(*args)
    assert r.returncode == 2, r.stdout + r.stderr
    return r.stderr


def test_bench_wan_runs_the_modes_named_and_judges_only_what_they_allow(tmp_path):
    """The design card's `bt-bench wan --mode blocktrain|autoregressive`: only the modes
    named run; the exact-mode targets (speedup, identity) are not judged without exact."""
    _, d = _wan("--mode", "autoregressive,blocktrain", "--mode", "blocktrain", "--bytes", "4", "--prompts", "1",
                json_path=tmp_path / "wan.json")
    assert d["modes"] == ["blocktrain", "autoregressive"] and "exact" not in d and d["split"] == "valid"
    assert d["autoregressive"]["traversals"] == 4 and d["blocktrain"]["traversals"] == 1
    assert set(d["targets"]) == {"every mode within 1.25x of its bound"} and "speedup_blocktrain_vs_autoregressive" in d
    # output as it comes: one arrival per traversal that accepted bytes, growing to the whole output
    ar, bt = d["autoregressive"], d["blocktrain"]
    assert [b for _, b in ar["arrivals_first_prompt"]] == [1, 2, 3, 4] and bt["arrivals_first_prompt"][0][1] == 4
    assert 0 < ar["first_byte_s"] == ar["arrivals_first_prompt"][0][0] < ar["arrivals_first_prompt"][-1][0]
    assert bt["first_byte_s"] == bt["seconds_per_prompt"][0]  # one traversal brings every byte
    for every in ([], ["--mode", "exact", "--mode", "blocktrain", "--mode", "autoregressive"]):
        assert "--mode" in _refused("wan", "--mode", "exact", "--kernel", *every)  # --kernel runs its own two modes
    assert "fast: expected" in _refused("wan", "--mode", "exact,fast")
    assert "at least one mode" in _refused("wan", "--mode", ",")


def test_bench_wan_clients_at_once_each_write_what_they_wrote_alone(tmp_path):
    """`--clients N`: N clients, each its own identity, run exact and autoregressive at
    once after the modes ran alone; each client's output is the one it wrote alone, and its time
    and the aggregate rate stand beside its time alone."""
    out, d = _wan("--mode", "exact,autoregressive", "--clients", "3", "--bytes", "6", "--prompts", "3", "--batch", "3,1",
                json_path=tmp_path / "wan.json")
    assert d["clients"]["batch"] == 3 and set(d["clients_by_batch"]) == {"3", "1"}  # the first size is judged
    for mode in ("exact", "autoregressive"):
        assert d["clients_by_batch"]["1"][mode]["outputs_identical_to_alone"] == "3/3"
        c = d["clients"][mode]
        assert c["outputs_identical_to_alone"] == "3/3" and len(c["seconds_per_client"]) == 3
        assert c["seconds_alone"] == d[mode]["seconds_per_prompt"][:3]
        assert c["aggregate_bytes_per_s"] == 3 * 6 / c["wall_s"] and c["slowdown"]["median"] <= c["slowdown"]["max"]
    assert {"3 clients (exact): aggregate bytes/s >= 4x one client's",
            "3 clients (exact): each client's median time <= 2x alone"} <= set(d["targets"])
    assert d["process_peak_rss_mib"] > 0 and "3 clients at once, batch 1, exact" in out
    assert "--prompts 4" in _refused("wan", "--clients", "4", "--prompts", "3")
    assert "--clients" in _refused("wan", "--sweep", "--clients", "2")
    assert "--batch applies to --clients" in _refused("wan", "--batch", "2")
    assert "distinct sizes in 1..64" in _refused("wan", "--clients", "2", "--prompts", "2", "--batch", "8,0")
    assert "--clients runs exact and autoregressive" in _refused("wan", "--clients", "2", "--prompts", "2", "--mode",
                                                                  "blocktrain")


def test_bench_wan_samples_at_a_temperature_and_judges_the_sampled_target(tmp_path):
    """`--temperature`: exact and autoregressive sample; no identity check (the bytes differ by
    design), the sampled target judged, the per-prompt spread and the repetition reported."""
    _, d = _wan("--mode", "exact,autoregressive", "--bytes", "6", "--prompts", "2", "--temperature", "0.8",
                json_path=tmp_path / "wan.json")
    assert d["temperature"] == 0.8 and "identical_prompts" not in d["exact"] and "sampled" in d["exact"]["output"]
    assert set(d["targets"]) == {"every mode within 1.25x of its bound", SAMPLED_TARGET}
    per = d["speedup_per_prompt"]
    assert per["min"] <= per["median"] <= per["max"] and d["autoregressive"]["traversals"] == 6
    assert d["exact"]["continuations_repeating_a_16gram"] == "0/2"  # 6 bytes hold no 16-gram
    assert "--temperature" in _refused("wan", "--sweep", "--temperature", "0.8")
