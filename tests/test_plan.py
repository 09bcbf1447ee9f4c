"""Named sizes and `bt-train --dry-run`: what a job costs, before it runs."""

import subprocess
import sys
from pathlib import Path

from blocktrain.blocks.config import JobConfig, load
from blocktrain.blocks.model import Block
from blocktrain.blocks.plan import dry_run


def test_the_dry_run_counts_the_parameters_of_the_real_blocks():
    job = load(JobConfig(), None, ["model.d_model=64", "model.n_head=2"], "tiny")
    p = dry_run(job)
    real = [sum(q.numel() for q in Block(job.model, k).parameters()) for k in range(job.model.n_blocks)]
    assert [r["params"] for r in p["blocks"]] == real and p["params_total"] == sum(real)
    b1 = p["blocks"][1]["memory"]
    assert b1["trained_bytes"] == 16 * real[1] and b1["frozen_below_bytes"] == 4 * real[0]
    assert 0 < p["blocks"][0]["train_flops_per_step"] < p["blocks"][2]["train_flops_per_step"]  # upper blocks run the lower


def test_a_size_is_a_preset_that_set_overrides():
    job = load(JobConfig(), None, ["model.n_layer=6"], "small")
    assert (job.model.d_model, job.model.n_head, job.model.n_layer) == (512, 8, 6)
    assert load(JobConfig(), size="tiny").model == JobConfig().model  # tiny is the default model


def test_bt_train_dry_run_prints_the_plan_and_trains_nothing(tmp_path):
    def bt_train(*args):  # the installed command, as a user runs it
        return subprocess.run([str(Path(sys.executable).parent / "bt-train"), *args], cwd=tmp_path,
                              capture_output=True, text=True, timeout=300)
    r = bt_train("--size", "base", "--dry-run")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "344,057,856 parameters" in r.stdout and r.stdout.count("TFLOP a step") == 4
    assert list(tmp_path.iterdir()) == []  # no run directory, no checkpoint
    r = bt_train("--size", "huge", "--dry-run")
    assert r.returncode == 2 and "huge" in r.stderr
