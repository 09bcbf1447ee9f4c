"""Swarm training: joiner catch-up, restart from a checkpoint, a peer killed mid-training."""

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import torch

from blocktrain.blocks.data import as_tensor, read_split
from blocktrain.blocks.model import ModelConfig
from blocktrain.blocks.train import TrainConfig
from blocktrain.p2p.averaging import flatten
from blocktrain.p2p.swarm import SwarmConfig, SwarmPeer
from blocktrain.p2p.transport import Timeouts

from conftest import mesh

# In-process trainers share one interpreter: a heartbeat may wait for the GIL, so death is slow to call
FAST = Timeouts(connect_s=5, handshake_s=3, heartbeat_s=0.2, dead_after_s=30, close_s=1)
MC = ModelConfig(d_model=32, n_head=2, n_layer=2, n_blocks=2, max_seq_len=64)
TC = TrainConfig(steps=200, batch_size=4, seq_len=32, warmup=2)
SC = SwarmConfig(every=10, round_timeout_s=20, join_timeout_s=5, eval_windows=2)
DATA = as_tensor(read_split("valid"))


def _slowed(sp: SwarmPeer, seconds: float) -> SwarmPeer:
    """Make every local step take a little longer, so that a test can act between rounds."""
    step = sp.trainer.train_step

    def slow_step():
        time.sleep(seconds)
        return step()
    sp.trainer.train_step = slow_step
    return sp


def _params(sp: SwarmPeer) -> torch.Tensor:
    return flatten(list(sp.trainer.block.parameters()))


async def test_joiner_pulls_the_checkpoint_and_averages_from_the_next_round(tmp_path):
    peers = await mesh(3, FAST, blocks=(0,))
    try:
        sps = [_slowed(SwarmPeer(p, 0, MC, TC, SC, tmp_path / f"w{i}", DATA, DATA, shard=(i, 3)), 0.01)
               for i, p in enumerate(peers)]
        first = [asyncio.ensure_future(sp.run(120)) for sp in sps[:2]]
        deadline = time.monotonic() + 60
        while len(sps[0].swarm.report.rounds) < 3:  # the group is under way without the third
            assert time.monotonic() < deadline and not any(t.done() for t in first)
            await asyncio.sleep(0.05)
        joiner = await sps[2].run(120)
        await asyncio.gather(*first)
        assert joiner["catch_up"] and joiner["catch_up"][0]["step"] >= 30  # started from the group's point
        assert all(len(r["members"]) == 2 for r in sps[0].swarm.report.rounds[:3])
        joint = [r for r in joiner["rounds"] if len(r["members"]) == 3]
        assert joint and all(r["coverage"] == 1.0 for r in joint)
        assert joint[0]["round"] > 3  # it averaged from a round after the checkpoint it pulled
        a, b, c = (_params(sp) for sp in sps)
        assert torch.allclose(a, b, atol=1e-6) and torch.allclose(a, c, atol=1e-6)  # one model after the last round
        rep = peers[2].report()
        assert rep["by_kind"]["received"]["checkpoint"]["payload_bytes"] >= joiner["catch_up"][0]["bytes"]
        assert rep["training"]["ce_end"] < rep["training"]["ce_start"]
    finally:
        for p in peers:
            await p.stop()


async def test_restarted_peer_resumes_from_its_own_checkpoint(tmp_path):
    peers = await mesh(1, FAST, blocks=(0,))
    try:
        sp = SwarmPeer(peers[0], 0, MC, TC, SC, tmp_path / "w", DATA, DATA)
        await sp.run(20)
        saved = _params(sp)
        again = SwarmPeer(peers[0], 0, MC, TC, SC, tmp_path / "w", DATA, DATA)
        assert not torch.equal(_params(again), saved)  # a fresh block until it reads the checkpoint
        rep = await again.run(40)
        assert [r["step"] for r in rep["rounds"]] == [30, 40] and not rep["catch_up"]
    finally:
        await peers[0].stop()


async def test_lower_blocks_come_from_the_swarm_and_count_as_their_own_kind(tmp_path):
    peers = await mesh(2, FAST, blocks=[(0,), (1,)])
    try:
        sps = [SwarmPeer(p, k, MC, TC, SC, tmp_path / f"w{k}", DATA, DATA) for k, p in enumerate(peers)]
        reps = await asyncio.gather(sps[0].run(40), sps[1].run(40))
        lower = reps[1]["lower_refreshes"]
        assert lower and lower[0]["step"] == 0 and lower[0]["lower_steps"][0] >= 10
        got = peers[1].report()["by_kind"]["received"]
        assert got["lower-checkpoint"]["payload_bytes"] > 0 and "checkpoint" not in got
        # the assembled model: every block's newest checkpoint from the swarm, verified, evaluated
        from blocktrain.p2p.cli import assemble_from_swarm, evaluate_assembled
        from blocktrain.p2p.identity import load_or_create_identity
        host, port = peers[0].addr.rsplit(":", 1)
        res = await assemble_from_swarm(host, int(port), load_or_create_identity(tmp_path / "client"),
                                        peers[0].swarm_key, tmp_path / "asm")
        assert {k: v["step"] for k, v in res["blocks"].items()} == {0: 40, 1: 40}
        assert res["blocks"][1]["from"] == peers[1].addr
        ev = evaluate_assembled(tmp_path / "asm", None, 4)
        assert ev["test_ce"] == ev["head_ce"][-1] < 5.0
        assert peers[0].report()["by_kind"]["sent"]["checkpoint"]["payload_bytes"] >= res["blocks"][0]["bytes"]
        # what bt-peer report makes of a training peer's report
        from click.testing import CliRunner

        from blocktrain.p2p.cli import main
        (tmp_path / "r1.json").write_text(json.dumps(peers[1].report()))
        out = CliRunner().invoke(main, ["report", str(tmp_path / "r1.json")])
        assert out.exit_code == 0, out.output
        assert "training block 1: done at step 40" in out.output and "CE per GB" in out.output
        assert any(line.startswith("lower-checkpoint") for line in out.output.splitlines())
    finally:
        for p in peers:
            await p.stop()


def _peer_cmd(tmp_path, i, port, bootstrap=None):
    cmd = [sys.executable, "-m", "blocktrain.p2p.cli", "join" if bootstrap else "start"]
    if bootstrap:
        cmd.append(bootstrap)
    return cmd + ["--block", "0", "--listen", f"127.0.0.1:{port}", "--swarm-key", str(tmp_path / "swarm.key"),
                  "--identity", str(tmp_path / f"id{i}"), "--report", str(tmp_path / f"r{i}.json"),
                  "--report-every", "0.5", "--heartbeat", "0.2", "--dead-after", "2", "--quiet",
                  "--work-dir", str(tmp_path / f"w{i}"), "--shard", f"{i}/3", "--every", "5", "--steps", "100000",
                  "--round-timeout", "20",
                  "--set", "model.d_model=32", "--set", "model.n_head=2", "--set", "model.n_layer=2",
                  "--set", "model.n_blocks=2", "--set", "batch_size=4", "--set", "seq_len=32", "--set", "warmup=2"]


def _report(tmp_path, i) -> dict:
    try:
        return json.loads((tmp_path / f"r{i}.json").read_text())
    except (OSError, ValueError):
        return {}


def _rounds(tmp_path, i) -> list:
    return _report(tmp_path, i).get("training", {}).get("rounds", [])


def test_killed_peer_leaves_the_others_training(tmp_path):
    from blocktrain.p2p.identity import new_swarm_key
    new_swarm_key(tmp_path / "swarm.key")
    import socket
    ports = []
    for _ in range(3):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    procs = [subprocess.Popen(_peer_cmd(tmp_path, 0, ports[0]), stderr=open(tmp_path / "l0", "w"))]
    try:
        time.sleep(1.0)
        procs += [subprocess.Popen(_peer_cmd(tmp_path, i, ports[i], f"127.0.0.1:{ports[0]}"), stderr=open(tmp_path / f"l{i}", "w"))
                  for i in (1, 2)]
        deadline = time.monotonic() + 120
        while not all(any(len(r["members"]) == 3 for r in _rounds(tmp_path, i)) for i in range(3)):
            assert time.monotonic() < deadline, "the three peers never averaged together"
            assert all(p.poll() is None for p in procs)
            time.sleep(0.2)
        victim = _report(tmp_path, 2)["peer_id"]
        os.kill(procs[2].pid, signal.SIGKILL)  # no goodbye: its sockets just close
        procs[2].wait(10)
        killed_at = {i: len(_rounds(tmp_path, i)) for i in (0, 1)}
        while not all(len(_rounds(tmp_path, i)) >= killed_at[i] + 4 for i in (0, 1)):
            assert time.monotonic() < deadline, "the survivors stopped averaging after the kill"
            assert all(p.poll() is None for p in procs[:2])
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
    for i in (0, 1):
        rep = _report(tmp_path, i)["training"]
        after = rep["rounds"][killed_at[i] + 1:]  # the round in flight at the kill may have included it
        assert after and all(victim not in r["members"] or victim in r["departed"] for r in after)
        assert all(r["coverage"] == 1.0 for r in after)
        assert not [f for f in rep["failed_rounds"] if f["round"] >= after[0]["round"]]  # (joining may fail some)
        assert rep["state"] in ("training", "done")


async def test_peer_sending_nan_updates_is_excluded_and_reported(tmp_path):
    peers = await mesh(3, FAST, blocks=(0,))
    try:
        sps = [SwarmPeer(p, 0, MC, TC, SC, tmp_path / f"w{i}", DATA, DATA, shard=(i, 3)) for i, p in enumerate(peers)]
        bad = sps[2].trainer
        step = bad.train_step

        def diverges():  # from its 15th step on, its parameters are NaN: so is its pseudo-gradient
            loss = step()
            if bad.step >= 15:
                with torch.no_grad():
                    for p in bad.block.parameters():
                        p.fill_(float("nan"))
            return loss
        bad.train_step = diverges
        reps = await asyncio.gather(*(sp.run(40) for sp in sps))
        for rep in reps[:2]:
            assert [e["peer"] for e in rep["rejected_updates"]] == [peers[2].id]
            assert "NaN" in rep["rejected_updates"][0]["reason"] and rep["rejected_updates"][0]["round"] == 2
            assert peers[2].id in rep["excluded_peers"]
            later = [r for r in rep["rounds"] if r["round"] > 2]
            assert later and all(peers[2].id not in r["members"] and r["coverage"] == 1.0 for r in later)
            assert all(torch.isfinite(p).all() for p in sps[0].trainer.block.parameters())
        assert torch.allclose(_params(sps[0]), _params(sps[1]), atol=1e-6)
        text = peers[0].report()["training"]["rejected_updates"][0]
        assert text["peer"] == peers[2].id
        # the excluded peer was told, stopped waiting for the others and trained on alone
        assert set(reps[2]["excluded_by"]) == {peers[0].id, peers[1].id}
        assert all(r["members"] == [peers[2].id] for r in reps[2]["rounds"] if r["round"] > 2)
    finally:
        for p in peers:
            await p.stop()
