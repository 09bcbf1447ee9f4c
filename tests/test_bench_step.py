"""``bt-bench step``: the block worker's step against the plain loop, on a very small model."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from click.testing import CliRunner
from torch.nn import functional as F

from blocktrain.bench.step import PlainLoop, configs, counted_flops
from blocktrain.blocks.data import load_split
from blocktrain.blocks.device import threads
from blocktrain.blocks.train import BlockTrainer

from conftest import COMMANDS

main = COMMANDS["bt-bench"]

SMALL = ["--sizes", "tiny", "--set", "model.d_model=32", "--set", "model.n_head=2", "--batch", "2", "--seq", "16",
         "--steps", "2", "--threads", "1"]


def test_step_command_reports_every_block_with_its_ratio(tmp_path, monkeypatch):
    out = tmp_path / "step.json"
    monkeypatch.setattr(sys, "argv", ["bt-bench", "step", *SMALL, "--json", str(out)])  # what the JSON records
    with threads(2):  # the caller's count, which the run's --threads 1 must not replace
        r = CliRunner().invoke(main, ["step", *SMALL, "--json", str(out)])
        assert torch.get_num_threads() == 2
    assert r.exit_code == 0, r.output
    d = json.loads(out.read_text())
    assert d["command"].startswith("bt-bench step --sizes tiny") and d["code_version"]["code_hash"]
    assert d["threads"] == 1 and "side by side" in d["note"]
    (s,) = d["sizes"]
    K = s["model"]["n_blocks"]
    assert s["size"] == "tiny" and s["model"]["d_model"] == 32
    assert [b["block"] for b in s["blocks"]] == list(range(K))
    plain = s["plain"]
    assert plain["flops_per_step"] > 0 and plain["tokens_per_step"] == 2 * 16
    for b in s["blocks"]:
        assert b["flops_per_step"] > 0 and len(b["seconds"]) == 2
        assert b["flops_per_s"] == pytest.approx(b["flops_per_step"] / b["seconds_per_step"], rel=1e-12)
        assert b["ratio"] == pytest.approx(b["flops_per_s"] / plain["flops_per_s"], rel=1e-12)
        assert b["bytes_per_s"] == pytest.approx(2 * 16 / b["seconds_per_step"], rel=1e-12)
        assert b["tokens_per_step"] == 2 * (16 + 4 * 15)  # the rows carry 4 branches of 15 placeholders
        assert b["within_budget"] == (b["grad_optim_bytes"] <= b["grad_optim_budget_bytes"])
    assert s["ratio_min"] == min(b["ratio"] for b in s["blocks"])
    # block 1 trains what block 0 trains (its layers and a head of the same depth) on top of block 0's
    # frozen forward: it computes more
    assert s["blocks"][1]["flops_per_step"] > s["blocks"][0]["flops_per_step"]
    assert "block 2" in r.output and "ratio" in r.output


def test_step_command_refuses_an_unknown_size():
    r = CliRunner().invoke(main, ["step", "--sizes", "tiny,huge"])
    assert r.exit_code == 2
    assert "huge" in r.output and "tiny, small, base" in r.output


def test_step_command_refuses_an_unknown_key():
    r = CliRunner().invoke(main, ["step", "--sizes", "tiny", "--set", "model.nope=1"])
    assert r.exit_code == 2 and "model.nope" in r.output


def test_attention_on_the_cpu_is_counted():
    q = torch.randn(2, 4, 16, 8, requires_grad=True)
    flops = counted_flops(lambda: F.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward())
    fwd = 2 * (2 * 2 * 4 * 16 * 16 * 8)  # Q K^T and P V
    assert flops == 3 * fwd  # the backward: twice the forward


def test_plain_loop_counts_about_six_flops_per_parameter_and_token():
    ((_, m, t),) = configs(["tiny"], ["model.d_model=64", "model.n_head=2", "model.n_layer=3", "model.n_blocks=3",
                                      "model.draft_layers=0"], batch=2, seq=16)
    like = BlockTrainer(m, t, 0, load_split("valid")).opt
    plain = PlainLoop(m, t, load_split("valid"), torch.device("cpu"), "fp32", like)
    # the parameters that multiply: all but the embedding tables
    n = sum(p.numel() for name, p in plain.model.named_parameters()
            if name.split(".")[-2] not in ("tok", "pos", "slot_off"))
    flops = counted_flops(plain.train_step)
    assert 0.9 <= flops / (6 * n * 2 * 16) <= 1.25, flops / (6 * n * 2 * 16)
    # the same optimizer as the block worker's
    for mine, theirs in zip(plain.opt.param_groups, like.param_groups):
        assert {k: mine[k] for k in ("betas", "eps", "weight_decay", "lr")} == \
               {k: theirs[k] for k in ("betas", "eps", "weight_decay", "lr")}
