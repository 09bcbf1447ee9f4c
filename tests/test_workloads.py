"""Real workloads: a user's text as --data, the corpus and settings every peer of a swarm shares
(the job, compared at join), devices and precision on a machine without a GPU, gradient
accumulation."""

import asyncio
import json

import pytest
import torch
from click.testing import CliRunner

from blocktrain.blocks import checkpoint as ckpt
from blocktrain.blocks.config import ConfigError, JobConfig, TrainConfig, load
from blocktrain.blocks.data import (DataError, as_tensor, corpus_digest, load_split, prepare, read_embedded, read_split,
                                    resolve_data)
from blocktrain.blocks.device import DeviceError, pick_device, pick_precision, threads
from blocktrain.blocks.model import ModelConfig
from blocktrain.blocks.train import BlockTrainer, EndToEndTrainer
from blocktrain.p2p.swarm import PeerJob, SwarmConfig, SwarmTrainer, TrainerSpec
from blocktrain.p2p.swarm.membership import JobMismatch
from blocktrain.p2p.swarm.settings import job_difference, job_digest

from conftest import COMMANDS, mesh
from test_swarm import FAST, MC, SC, TC

DATA = as_tensor(read_split("valid"))


def _text(path, words=40000, seed=0):
    g = torch.Generator().manual_seed(seed)
    vocab = ["the", "river", "of", "a", "stone", "bridge", "north", "city", "in", "was", "built", "and"]
    idx = torch.randint(0, len(vocab), (words,), generator=g).tolist()
    path.write_text(" ".join(vocab[i] for i in idx) + "\n")
    return path


# --- data: a text file as --data ------------------------------------------------------------------

def test_a_text_file_is_prepared_once_into_the_cache_and_prepared_again_when_it_changes(tmp_path):
    src = _text(tmp_path / "corpus.txt")
    said = []
    first = resolve_data(src, said.append, cache=tmp_path / "cache")
    assert any("preparing" in s for s in said) and (tmp_path / "cache") in __import__("pathlib").Path(first).parents
    said.clear()
    assert resolve_data(src, said.append, cache=tmp_path / "cache") == first
    assert not any("preparing" in s for s in said)  # reused
    whole = src.read_bytes()
    got = b"".join(bytes(load_split(sp, first).tolist()) for sp in ("train", "valid", "test"))
    assert got == whole  # the three splits are the file, cut in order
    _text(src, seed=1)  # the file changed: another corpus
    assert resolve_data(src, said.append, cache=tmp_path / "cache") != first
    # a folder of .txt files; a folder without any is refused with what to do
    (tmp_path / "books").mkdir()
    _text(tmp_path / "books" / "a.txt")
    assert corpus_digest(resolve_data(tmp_path / "books", cache=tmp_path / "cache")) \
        == corpus_digest(resolve_data(tmp_path / "books" / "a.txt", cache=tmp_path / "cache"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="no .txt file"):
        resolve_data(tmp_path / "empty", cache=tmp_path / "cache")
    # the embedded default and a prepared corpus pass through as they are
    assert resolve_data(None) is None and resolve_data(first) == first


def test_the_corpus_digest_names_the_bytes_not_the_format(tmp_path):
    """WikiText-2 embedded, as a WikiText directory and prepared: one digest; other bytes: another."""
    wiki = tmp_path / "wiki"
    wiki.mkdir()
    for sp in ("train", "valid", "test"):
        (wiki / f"wiki.{sp}.tokens").write_bytes(read_embedded(sp) if sp != "train" else read_embedded("valid"))
    prepared = tmp_path / "prepared"
    m = prepare(wiki, prepared)
    assert corpus_digest(wiki) == corpus_digest(prepared) == m["digest"]
    assert corpus_digest(None) == "00bcecbceb487a88"  # PROTOCOL.md 7.2, "Job"
    assert corpus_digest(None) != corpus_digest(wiki)  # its train split is other bytes


def test_bt_train_trains_on_a_text_file(tmp_path, monkeypatch):
    main = COMMANDS["bt-train"]
    monkeypatch.setenv("BT_DATA_CACHE", str(tmp_path / "cache"))
    src = _text(tmp_path / "mine.txt")
    with threads(2):  # the caller's count, which an in-process run must leave as it found it
        r = CliRunner().invoke(main, ["--data", str(src), "--out", str(tmp_path / "run"), "--steps", "3",
                                      "--no-reference", "--set", "model.d_model=32", "--set", "model.n_head=2",
                                      "--set", "train.batch_size=4", "--set", "train.seq_len=32",
                                      "--set", "train.eval_every=3", "--set", "draft_frac=0",
                                      "--set", "test_windows=4", "--device", "cpu", "--threads", "1"])
        assert torch.get_num_threads() == 2
    assert r.exit_code == 0, r.output
    res = json.loads((tmp_path / "run" / "results.json").read_text())
    assert res["job"]["device"] == "cpu" and res["job"]["data"].startswith(str(tmp_path / "cache"))
    assert all(0 < ce < 6 for ce in res["blocktrain"]["test_ce_heads"])
    report = r.output[r.output.index("test CE, nats/byte"):]  # it scored this text, not WikiText-2
    assert report.startswith(f"test CE, nats/byte (the test split of {src}):") and "WikiText" not in report
    assert res["job"]["corpus"] == str(src)
    from blocktrain.provenance import code_hash  # which code made it, and the command that asked
    assert res["code_version"]["code_hash"] == code_hash() and res["command"].startswith("bt-train")


def test_bt_train_init_starts_every_block_from_a_trained_model(tmp_path):
    """`--init DIR`: every block (and the draft model) starts from DIR's checkpoints, with their
    model settings; at a learning rate of 1e-9 the run ends where it began. Another model shape,
    --processes and a directory without blocks are refused before training."""
    main = COMMANDS["bt-train"]
    tiny = ["--set", "model.d_model=32", "--set", "model.n_head=2", "--set", "train.batch_size=4",
            "--set", "train.eval_every=2", "--set", "test_windows=4", "--device", "cpu", "--threads", "1"]
    r = CliRunner().invoke(main, ["--out", str(tmp_path / "a"), "--steps", "3", "--no-reference",
                                  "--set", "train.seq_len=32", *tiny])
    assert r.exit_code == 0, r.output
    a = tmp_path / "a" / "checkpoints"
    r = CliRunner().invoke(main, ["--init", str(a), "--out", str(tmp_path / "b"), "--steps", "2",
                                  "--set", "train.lr=1e-9", "--set", "train.seq_len=48", *tiny[4:]])
    assert r.exit_code == 0, r.output
    assert "reference: not trained (--init" in r.output
    res = json.loads((tmp_path / "b" / "results.json").read_text())
    assert res["job"]["model"]["d_model"] == 32 and res["job"]["train"]["seq_len"] == 48  # their shape, our windows
    assert res["job"]["init"]["sha256"] == {str(k): ckpt.load(p).sha256 for k, p in ckpt.block_files(a).items()}
    assert "reference" not in res and res["reference_skipped"]
    from blocktrain.blocks.evaluate import load_chain
    from blocktrain.blocks.job import init_model
    from blocktrain.blocks.train import eval_chain
    chain, _ = load_chain(a)  # the whole chain started from a's: every head scores as a's did
    assert res["blocktrain"]["test_ce_heads"] == pytest.approx(eval_chain(chain, load_split("test"), 48, 4), abs=1e-4)
    for k, path in ckpt.block_files(tmp_path / "b" / "checkpoints").items():
        before, after = ckpt.load(a / ckpt.block_file(k)).tensors, ckpt.load(path).tensors
        assert before.keys() == after.keys()
        assert any(n.startswith("drafter") for n in after) == (k == 2)
        for n in before:
            assert torch.allclose(before[n], after[n], atol=1e-6), (k, n)
    r = CliRunner().invoke(main, ["--init", str(a), "--set", "model.d_model=64", "--out", str(tmp_path / "c")])
    assert r.exit_code == 2 and "model.d_model 32 there, 64 here" in r.output and not (tmp_path / "c").exists()
    r = CliRunner().invoke(main, ["--init", str(a), "--processes", "--out", str(tmp_path / "c")])
    assert r.exit_code == 2 and "--processes" in r.output and not (tmp_path / "c").exists()
    r = CliRunner().invoke(main, ["--init", str(tmp_path), "--out", str(tmp_path / "c")])
    assert r.exit_code == 2 and "no block0.safetensors" in r.output
    (tmp_path / "job.json").write_text(json.dumps({"init": str(a)}))  # named by a config file: the same
    r = CliRunner().invoke(main, ["--config", str(tmp_path / "job.json"), "--dry-run"])
    assert r.exit_code == 0 and "model: d 32" in r.output, r.output
    assert init_model("shipped").d_model == 192  # the shipped model, stored bf16
    r = CliRunner().invoke(main, ["--init", "shipped", "--set", "model.n_head=6", "--dry-run"])  # 6 heads of d 192
    assert r.exit_code == 0 and "model: d 192, 6 heads" in r.output, r.output


# --- devices, precision, micro-batches ----------------------------------------------------------------

def test_devices_are_checked_and_auto_is_the_cpu_without_a_gpu():
    assert pick_device("cpu") == torch.device("cpu")
    if not torch.cuda.is_available():
        assert pick_device("auto").type in ("cpu", "mps")
        with pytest.raises(DeviceError, match="no CUDA device"):
            pick_device("cuda:0")
    with pytest.raises(DeviceError, match="expected one of"):
        pick_device("tpu7")
    assert pick_precision("auto", torch.device("cpu")) == "fp32"
    assert pick_precision("bf16", torch.device("cpu")) == "bf16"
    with pytest.raises(DeviceError, match="precision"):
        pick_precision("fp8", torch.device("cpu"))

def test_an_absent_device_is_refused_before_anything_is_written(tmp_path):
    main = COMMANDS["bt-train"]
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    r = CliRunner().invoke(main, ["--device", f"cuda:{n}", "--out", str(tmp_path / "run")])
    assert r.exit_code == 2 and "CUDA device" in r.output and not (tmp_path / "run").exists()


@pytest.mark.parametrize("slots", [4, 0])  # a weighted loss (placeholder branches), a plain mean (masked tails)
def test_micro_batches_give_the_steps_gradient_in_slices(slots):
    mc = ModelConfig(d_model=32, n_head=2, n_layer=3, n_blocks=3, max_seq_len=64)
    base = TrainConfig(steps=4, batch_size=8, seq_len=32, warmup=1, slot_branches=slots)
    for k in (0, 2):
        grads = []
        for m in (1, 4):
            tr = BlockTrainer(mc, TrainConfig(**{**base.to_dict(), "micro_batches": m}), k, DATA)
            if k:
                tr.set_lower([BlockTrainer(mc, base, j, DATA).block.state_dict() for j in range(k)])
            tr.compute_grads()
            grads.append(tr.grads())
        assert torch.allclose(grads[0], grads[1], atol=1e-6, rtol=1e-4)
        assert grads[0].abs().sum() > 0
    # the reference: its gradients as the step left them (no clipping: AdamW and a clip would hide a scale)
    e = [EndToEndTrainer(mc, TrainConfig(**{**base.to_dict(), "micro_batches": m, "grad_clip": 1e9}), DATA)
         for m in (1, 8)]
    assert abs(e[0].train_step() - e[1].train_step()) < 1e-5
    g = [torch.cat([p.grad.reshape(-1) for p in t.model.parameters() if p.grad is not None]) for t in e]
    assert g[0].abs().sum() > 0 and torch.allclose(g[0], g[1], atol=1e-6, rtol=1e-4)
    with pytest.raises(ConfigError, match="micro_batches"):
        load(JobConfig(), None, ["train.micro_batches=9", "train.batch_size=8"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (scripts/gpu_check.sh runs it)")
def test_what_a_cuda_worker_sends_is_in_pinned_host_memory():
    from blocktrain.blocks.device import to_host
    from blocktrain.p2p.averaging.outer import flatten
    t = torch.randn(1000, device="cuda")
    h = to_host(t, pinned=True)
    assert h.device.type == "cpu" and h.is_pinned() and torch.equal(h, t.cpu())
    assert not to_host(t).is_pinned()  # checkpoints: pageable
    params = [torch.nn.Parameter(torch.randn(3, 4, device="cuda")), torch.nn.Parameter(torch.randn(5, device="cuda"))]
    flat = flatten(params)
    assert flat.is_pinned() and torch.equal(flat, torch.cat([p.detach().cpu().reshape(-1) for p in params]))
    c = torch.randn(4)
    assert to_host(c, pinned=True) is c  # a CPU tensor is itself


def test_bf16_autocast_trains_and_checkpoints_stay_float32_on_the_cpu(tmp_path):
    mc = ModelConfig(d_model=32, n_head=2, n_layer=3, n_blocks=3, max_seq_len=64)
    tc = TrainConfig(steps=4, batch_size=4, seq_len=32, warmup=1)
    tr = BlockTrainer(mc, tc, 1, DATA, device="cpu", precision="bf16")
    tr.set_lower([BlockTrainer(mc, tc, 0, DATA).block.state_dict()])
    losses = [tr.train_step() for _ in range(3)]
    assert all(0 < x < 7 for x in losses)
    c = tr.checkpoint()
    assert all(t.dtype == torch.float32 and t.device.type == "cpu" for t in c.tensors.values())
    ckpt.save(c, tmp_path / "b.safetensors")
    again = BlockTrainer(mc, tc, 1, DATA)
    again.restore(ckpt.load(tmp_path / "b.safetensors"))
    assert again.step == 3


# --- the job: compared at join ---------------------------------------------------------------------

def _job_rows():
    from vectors import tables
    rows = tables("Job digest")
    assert len(rows) >= 4
    return rows


def test_the_job_digest_vectors_of_protocol_md_both_ways():
    from vectors import VALID
    rows = _job_rows()
    for sets, corpus, job in rows:
        items = [] if sets == "(defaults)" else [s.strip() for s in sets.split(",")]
        c = corpus_digest(None) if corpus == "embedded WikiText-2" else corpus
        assert job_digest(load(PeerJob(), None, items), c) == job
    jobs = [r[2] for r in rows]
    assert VALID["block_update_join_job"].meta["job"] == jobs[0]
    # and back: which half differs is read from the digests alone
    assert "other settings" in job_difference(jobs[0], jobs[1]) and "corpus" not in job_difference(jobs[0], jobs[1])
    assert jobs[0] == jobs[2]  # a peer's own timeouts and batch slicing are not the swarm's
    assert "another corpus" in job_difference(jobs[0], jobs[3]) and "settings" not in job_difference(jobs[0], jobs[3])


async def test_a_peer_of_another_corpus_is_never_grouped_and_stops_when_it_meets_only_others(tmp_path):
    """Two peers of one corpus train together; a third, on another corpus, is answered ABSENT by
    both and stops with JobMismatch, naming the corpus; the two name it too and end identical."""
    peers = await mesh(3, FAST, blocks=[(0,), (1,), (2,)])
    sc = SwarmConfig(**{**SC.__dict__, "min_group": 2})
    a, b = "aa" * 8, "bb" * 8
    try:
        said: list = []  # what the third peer says (its progress lines, the membership's included)
        sps = [SwarmTrainer(p, TrainerSpec(i, PeerJob(MC, TC, sc), tmp_path / f"w{i}", corpus=c), DATA, DATA,
                            progress=said.append if i == 2 else None)
               for i, (p, c) in enumerate(zip(peers, (a, a, b)))]
        results = await asyncio.wait_for(asyncio.gather(*(sp.run() for sp in sps), return_exceptions=True), 120)
        assert isinstance(results[2], JobMismatch) and "another corpus" in str(results[2]), results[2]
        assert all(isinstance(r, dict) for r in results[:2]), results[:2]
        assert [len(j["members"]) for j in results[0]["joins"]] == [2]
        assert all(peers[2].id in sp.membership.other_jobs for sp in sps[:2])
        assert any("another corpus" in s for s in said)
        x, y = (torch.cat([t.reshape(-1) for t in sp.finals[1].values()]) for sp in sps[:2])
        assert torch.equal(x, y)
    finally:
        for p in peers:
            await p.stop()


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/status"), reason="reads VmRSS from /proc")
def test_random_windows_over_a_mapped_corpus_leave_the_rss_flat(tmp_path):
    """The kernel maps a read's neighbourhood too: without drop_pages, 400 batches of 16 random
    windows over a 48 MiB corpus whose pages are cached map most of it (about 64 KiB a window)."""
    from blocktrain.blocks.data import ByteBatches

    def rss_mib():
        return int(open("/proc/self/status").read().split("VmRSS:")[1].split()[0]) / 1024
    src = tmp_path / "src.txt"
    g = torch.Generator().manual_seed(0)
    src.write_bytes(bytes((torch.randint(97, 123, (48 << 20,), generator=g)).to(torch.uint8).tolist()))
    prepare(src, tmp_path / "c")
    train = load_split("train", tmp_path / "c")
    b = ByteBatches(train, 16, 128, seed=1)
    b.batch(0)
    before = rss_mib()
    for s in range(1, 400):
        b.batch(s)
    assert rss_mib() - before < 8, f"RSS grew {rss_mib() - before:.1f} MiB"


def test_the_corpus_cache_lists_what_it_holds_and_prunes_only_stale_entries(tmp_path):
    """Text given to --data is prepared into a cache that kept every version for good;
    `bt-data cache` lists the entries, --prune removes those whose source changed or is gone (never
    used again) and keeps the current one, --clear removes the rest."""
    from click.testing import CliRunner

    from blocktrain.blocks.datacli import main
    cache = tmp_path / "cache"
    src, gone = _text(tmp_path / "corpus.txt"), _text(tmp_path / "gone.txt", seed=2)
    old = resolve_data(src, cache=cache)
    resolve_data(gone, cache=cache)
    gone.unlink()
    _text(src, seed=1)  # changed: prepared into a new entry, the old one is stale
    new = resolve_data(src, cache=cache)
    r = CliRunner().invoke(main, ["cache", "--dir", str(cache)])
    assert r.exit_code == 0 and "3 cached corpora" in r.output and "2 stale" in r.output, r.output
    r = CliRunner().invoke(main, ["cache", "--dir", str(cache), "--prune"])
    assert r.exit_code == 0 and "removed 2 of 3" in r.output, r.output
    from pathlib import Path
    assert Path(new).is_dir() and not Path(old).exists() and resolve_data(src, cache=cache) == new
    r = CliRunner().invoke(main, ["cache", "--dir", str(cache), "--clear"])
    assert r.exit_code == 0 and "removed 1 of 1" in r.output and not Path(new).exists(), r.output
    assert "no cached corpora" in CliRunner().invoke(main, ["cache", "--dir", str(cache)]).output
