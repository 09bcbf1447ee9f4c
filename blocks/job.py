"""The main job as a library: train a BlockTrain model and the end-to-end reference under the
same budget, evaluate both, write ``results.json``, ``curves.png`` and the checkpoints.

Rules:
- Nothing here parses arguments or prints: progress goes to ``bar(desc, total, work=...)`` (a
  context manager with ``update(n)`` and ``set_postfix_str(s)``) and text to ``log``; the CLI
  chooses how they look (blocks/cli.py). One bar covers the whole job (the blocks, the draft
  phase, the reference and its draft phase), its steps weighted by their FLOPs (``job_work``) so
  that the time left counts a reference step as what it costs beside a block's.
- Checkpoints: ``OUT/checkpoints/block{k}.safetensors`` (BlockTrain) and
  ``OUT/reference/block{k}.safetensors`` (the end-to-end model split by the same layers).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import resource
import sys
import time
from pathlib import Path

from blocktrain.provenance import code_version

from . import checkpoint as ckpt
from .config import JobConfig
from .data import DataError, load_split, prepared, resolve_data
from .device import describe, pick_device, pick_precision, threads
from .evaluate import load_chain
from .model import Assembled, ModelConfig, draft_flops_per_token, train_flops_per_token
from .run import train_blocktrain, train_e2e
from .schedule import BlockPlan, make_plans, work_segments
from . import decode
from .train import eval_chain, eval_continuation, eval_e2e


class _Quiet:
    def update(self, n: int = 1):
        pass

    def set_postfix_str(self, s: str):
        pass


@contextlib.contextmanager
def no_bar(desc: str, total: int | None, **kw):
    yield _Quiet()


# The job's final evaluation continues 64-byte prompts by 32 bytes (one traversal and byte by byte).
EVAL_PROMPT_BYTES, EVAL_CONTINUATION_BYTES = 64, 32


def init_directory(name: str) -> Path:
    """The directory ``--init`` names: ``shipped`` is the model the package ships."""
    return ckpt.SHIPPED_MODEL if name == "shipped" else Path(name)


def init_model(name: str) -> ModelConfig:
    """The model config of the checkpoints ``--init`` names (block 0's): a job that starts from them
    has their shape unless it says otherwise (and then ``load_init`` refuses)."""
    files = ckpt.block_files(init_directory(name))
    if 0 not in files:
        raise ckpt.CheckpointError(f"--init {name}: no block0.safetensors in {init_directory(name)}")
    return ModelConfig.from_dict(ckpt.load(files[0]).config)


def load_init(job: JobConfig) -> tuple[list[dict], dict]:
    """The state dicts every block starts from (``job.init``), checked whole and against the job's
    model, and what results.json records of them (the directory, each file's sha256)."""
    assert job.init is not None
    directory = init_directory(job.init)
    digests: dict = {}
    blocks, _ = load_chain(directory, digests)
    theirs = blocks[0].cfg
    if theirs != job.model:
        ours = job.model.to_dict()
        diff = {k: (v, ours[k]) for k, v in theirs.to_dict().items() if ours[k] != v}
        raise ValueError(f"--init {job.init}: its blocks are another model than the job's ("
                         + ", ".join(f"model.{k} {a} there, {b} here" for k, (a, b) in diff.items())
                         + "); drop the model settings that differ")
    return ([b.state_dict() for b in blocks],
            {"directory": str(directory), "name": job.init, "sha256": digests})


def check_job(job: JobConfig):
    """Everything the job will need, checked before any training (nothing is lost at the end)."""
    if job.init is not None and job.processes:
        raise ValueError("--init with --processes: the block worker processes start from scratch; train in one "
                         "process (drop --processes)")
    need = max(job.train.seq_len, EVAL_PROMPT_BYTES + EVAL_CONTINUATION_BYTES)
    if job.model.max_seq_len < need:
        raise ValueError(f"model.max_seq_len {job.model.max_seq_len} is too short: training windows of "
                         f"{job.train.seq_len} bytes and the final evaluation ({EVAL_PROMPT_BYTES}-byte prompts + "
                         f"{EVAL_CONTINUATION_BYTES} bytes) need {need}; "
                         + ("lower train.seq_len (--init: the model is the checkpoints')" if job.init is not None
                            else "raise it or lower train.seq_len"))


def job_work(job: JobConfig, plans: list[BlockPlan]) -> list[tuple[int, float]]:
    """The whole job's steps in the order they run, as (steps, estimated training FLOPs of each):
    the blocks under the schedule, the last block's draft phase, then the end-to-end reference and
    its own draft phase (none under --init). One progress bar counts them all."""
    mc, tc = job.model, job.train
    tokens = tc.batch_size * tc.seq_len
    draft = tc.draft_steps if mc.draft_layers else 0
    draft_cost = float(draft_flops_per_token(mc, tc.seq_len, tc.draft_unroll) * tokens)
    costs = [float(train_flops_per_token(mc, k, tc.seq_len) * tokens) for k in range(mc.n_blocks)]
    if job.processes:  # the K workers' steps are counted together, and they run at the same time
        work = [(mc.n_blocks * tc.steps, sum(costs) / mc.n_blocks ** 2)]
    else:
        work = work_segments(plans, tc.steps, costs) + [(draft, draft_cost)]
    if job.reference and job.init is None:
        work += [(tc.steps, float(train_flops_per_token(mc, None, tc.seq_len) * tokens)), (draft, draft_cost)]
    return [(n, c) for n, c in work if n > 0]


def progress_for(bar, starts=None, phase=None):
    """The runner's progress callback for ``bar``: a step, and the valid CE of the heads whose
    blocks had begun (``starts``: the step each block begins) when the latest point was taken;
    ``phase(t)``, if given, names what step t trains (shown before the CE)."""
    point = {"ces": None, "step": 0}  # the latest curve point and the step it was measured at

    def cb(t, total, ces):
        bar.update(1)
        if ces is not point["ces"]:  # a new point: the runner reports it at the step it was taken
            point.update(ces=ces, step=t)
        if ces:  # only heads measured after their block began training mean anything: a block
            # that just began shows its untrained CE until the next evaluation
            shown = [f"{c:.3f}" for k, c in enumerate(ces) if starts is None or point["step"] > starts[k]]
            text = "valid CE " + " / ".join(shown)
        else:
            text = "valid CE at the first evaluation"
        bar.set_postfix_str(f"{phase(t)}, {text}" if phase is not None else text)
    return cb


def blocktrain_phase(plans: list[BlockPlan], steps: int):
    """What wall step t (1-based, as the runner reports it) of the BlockTrain run trains, in words
    (past the schedule: the last block's draft model)."""
    wall = max(p.end(steps) for p in plans)

    def name(t: int) -> str:
        if t > wall:
            return f"block {len(plans) - 1}'s draft model"
        active = [k for k, p in enumerate(plans) if p.start < t <= p.end(steps)]
        if len(active) == 1:
            k = active[0]
            return f"block {k}, step {t - plans[k].start}/{steps}"
        return f"blocks {active[0]}-{active[-1]}, step {t}/{wall}"
    return name


def run_job(job: JobConfig, log=lambda s: None, bar=no_bar, command: str | None = None) -> dict:
    """The job: results.json records the code version (taken first: what is measured) and
    ``command`` (the command line that asked for it)."""
    made_by = code_version()
    check_job(job)
    with threads(job.threads):  # in process (tests, notebooks) the caller keeps its own count
        return _run_checked_job(job, made_by, log, bar, command)


def _run_checked_job(job: JobConfig, made_by: dict, log, bar, command: str | None) -> dict:
    device = pick_device(job.device)  # before anything is written
    precision = pick_precision(job.precision, device)
    init, init_info = load_init(job) if job.init is not None else (None, None)  # checked before anything is written
    out = Path(job.out or f"runs/train-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    corpus = job.data or "embedded WikiText-2"  # as the user named it, before it is prepared into a cache
    data = resolve_data(job.data, log)
    job = dataclasses.replace(job, data=data)  # the workers (--processes) read what was prepared
    train, valid, test = (load_split(sp, job.data) for sp in ("train", "valid", "test"))
    for name, t in (("valid", valid), ("test", test)):  # before training, not after it
        if t.numel() < job.train.seq_len + 1:
            raise DataError(f"the {name} split holds {t.numel()} bytes, fewer than one window of "
                            f"train.seq_len + 1 = {job.train.seq_len + 1}")
    try:
        test_raw = None if prepared(job.data) else load_split("test", job.data, "raw")
    except DataError:
        test_raw = None
    tw = job.test_windows or None
    mc, tc = job.model, job.train
    log(f"data: train {train.numel():,} bytes, valid {valid.numel():,}, test {test.numel():,} "
        f"({'embedded WikiText-2' if job.data is None else job.data})")
    log(f"model: d {mc.d_model}, {mc.n_layer} layers in {mc.n_blocks} blocks, head_layers {mc.head_layers}; "
        f"{tc.steps} steps of {tc.batch_size}x{tc.seq_len} bytes"
        + (f" in {tc.micro_batches} slices" if tc.micro_batches > 1 else "")
        + f"; schedule {job.schedule}; on {describe(device, precision)}")
    if init_info is not None:
        log(f"every block starts from {init_info['directory']} (--init {job.init})")

    plans = make_plans(job.schedule, mc.n_blocks, tc.steps, tc.decay_frac)
    work = job_work(job, plans)
    with bar("bt-train", sum(n for n, _ in work), work=work) as job_bar:  # one bar: blocks, drafts, reference
        if job.processes:
            bt = train_in_processes(job, out / "checkpoints", log, job_bar)
        else:
            phase = blocktrain_phase(plans, tc.steps)
            bt = train_blocktrain(mc, tc, job.schedule, train, valid,
                                  progress_for(job_bar, [p.start for p in plans], phase),
                                  device=device, precision=precision, init=init)
        heads = eval_chain(bt.blocks, test, tc.seq_len, tw)  # on the device the blocks trained on
        heads_raw = eval_chain(bt.blocks, test_raw, tc.seq_len, tw) if test_raw is not None else None
        bt.blocks = [b.cpu() for b in bt.blocks]  # checkpoints and the serving checks below: on the CPU
        if not job.processes:
            for k, b in enumerate(bt.blocks):
                ckpt.save(ckpt.Checkpoint(mc.to_dict(), k, tc.steps, b.state_dict(), data_position=tc.steps,
                                          extra={"schedule": job.schedule, "final": True,
                                                 **({"drafter_steps": tc.draft_steps} if b.drafter is not None else {})}),
                          out / "checkpoints" / ckpt.block_file(k))
        asm = Assembled(bt.blocks)
        result = {
            "job": {"model": mc.to_dict(), "train": tc.to_dict(), "schedule": job.schedule,
                    "test_windows": job.test_windows, "data": job.data or "embedded WikiText-2", "corpus": corpus,
                    "device": str(device), "precision": precision, "init": init_info},
            "blocktrain": {
                "test_ce_heads": heads, "test_ce": heads[-1], "test_raw_ce_heads": heads_raw,
                "curve": bt.curve, "train_seconds": bt.seconds, "train_flops": bt.train_flops,
                "busy_fraction": bt.busy_fraction, "trainable_bytes_per_block": bt.trainable_bytes,
                "workers_per_block": bt.workers_per_block, "starts": bt.starts,
                "continuation_one_traversal": eval_continuation(asm, test, EVAL_PROMPT_BYTES, EVAL_CONTINUATION_BYTES, 64, one_traversal=True),
            },
        }
        if job.reference and init_info is not None:
            log("end-to-end reference: not trained (--init: there is no end-to-end model to start from, and one "
                "trained from scratch would not be a reference at the same settings)")
            result["reference_skipped"] = "--init: no end-to-end model to start from"
        elif job.reference:
            phase = lambda t: (f"end-to-end reference, step {t}/{tc.steps}" if t <= tc.steps  # noqa: E731
                               else "the reference's draft model")
            e2e = train_e2e(mc, tc, train, valid, progress_for(job_bar, phase=phase), device=device,
                            precision=precision)
            ce = eval_e2e(e2e.model, test, tc.seq_len, tw)
            ce_raw = eval_e2e(e2e.model, test_raw, tc.seq_len, tw) if test_raw is not None else None
            e2e.model = e2e.model.cpu()
            for k, b in enumerate(e2e.model.blocks):  # the reference, split by the same layers, for serving
                ckpt.save(ckpt.Checkpoint(mc.to_dict(), k, tc.steps, b.state_dict(), extra={"model": "end-to-end"}),
                          out / "reference" / ckpt.block_file(k))
            fwd = lambda ids: e2e.model(ids)[0]  # noqa: E731
            result["reference"] = {
                "test_ce": ce, "test_raw_ce": ce_raw,
                "curve": e2e.curve, "train_seconds": e2e.seconds, "train_flops": e2e.train_flops,
                "trainable_bytes": e2e.trainable_bytes[0],
                "continuation_teacher_forced": eval_continuation(fwd, test, EVAL_PROMPT_BYTES, EVAL_CONTINUATION_BYTES, 64, one_traversal=False),
            }
            result["gap_ce"] = heads[-1] - ce
    prompt = test[:64].long()[None]
    exact, st = decode.generate(bt.blocks, prompt[0].tolist(), 64, draft_len=16,
                                drafter=bt.blocks[-1].drafter is not None, slots=0 if bt.blocks[-1].drafter else 16)
    result["samples"] = {
        "prompt": bytes(prompt[0].tolist()).decode("utf-8", "replace"),
        "blocktrain_exact": exact.decode("utf-8", "replace"),  # the chain's own greedy output
        "exact_bytes_per_traversal": st.bytes_per_traversal(len(exact)),
        "blocktrain_one_traversal": bytes(asm.generate_one_traversal(prompt, 32)[0].tolist()).decode("utf-8", "replace"),
    }
    if "reference" in result:
        result["samples"]["reference_autoregressive"] = bytes(e2e.model.generate(prompt, 64)[0].tolist()).decode(
            "utf-8", "replace")
    result["code_version"], result["command"] = made_by, command
    result["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    result["wall_seconds"] = time.perf_counter() - t0
    (out / "results.json").write_text(json.dumps(result, indent=1))
    plot_curves(result, out / "curves.png")
    log(summary(result))
    log(f"wrote {out / 'results.json'}, {out / 'curves.png'}, {out / 'checkpoints'}")
    return result


def train_in_processes(job: JobConfig, directory: Path, log, bar=_Quiet()):
    """K worker processes (blocktrain.blocks.worker), one per block; progress (their steps, to
    ``bar``, which the caller opened) from their files."""
    import subprocess

    from .model import Block
    from .run import RunResult
    from .checkpoint import block_path

    if job.schedule == "relay":
        raise ValueError("--processes runs staggered, parallel or sequential; relay averages gradients between "
                         "workers, which needs the network (bt-peer)")
    mc, tc = job.model, job.train
    directory.mkdir(parents=True, exist_ok=True)
    procs = []
    t0 = time.perf_counter()
    try:
        for k in range(mc.n_blocks):
            cmd = [sys.executable, "-m", "blocktrain.blocks.worker", "--block", str(k), "--dir", str(directory),
                   "--schedule", job.schedule, "--model", json.dumps(mc.to_dict()),
                   "--train", json.dumps(tc.to_dict()), "--ckpt-every", str(tc.refresh_every), "--threads", "1"]
            if job.data is not None:  # the workers train on the job's data, not the embedded default
                cmd += ["--data", str(job.data)]
            cmd += ["--device", job.device, "--precision", job.precision]
            procs.append(subprocess.Popen(cmd))
        done = 0
        bar.set_postfix_str(f"blocktrain ({job.schedule}, {mc.n_blocks} processes)")
        while any(p.poll() is None for p in procs):
            time.sleep(1.0)
            steps = 0
            for k in range(mc.n_blocks):
                try:
                    steps += ckpt.load(block_path(directory, k)).step
                except ckpt.CheckpointError:
                    pass  # not written yet, or being replaced
            bar.update(steps - done)
            done = steps
        bad = [k for k, p in enumerate(procs) if p.returncode != 0]
        if bad:
            raise RuntimeError(f"block workers {bad} failed; their checkpoints in {directory} are kept")
    finally:
        for p in procs:  # interrupted: stop our workers, by pid; their checkpoints stay for a restart
            if p.poll() is None:
                p.terminate()
                p.wait(timeout=30)
    blocks = []
    for k in range(mc.n_blocks):
        c = ckpt.load(block_path(directory, k))
        b = Block(mc, k)
        b.load_state_dict(c.tensors)
        blocks.append(b)
    res = RunResult(f"blocktrain-{job.schedule}-processes", blocks=blocks, seconds=time.perf_counter() - t0)
    res.wall_steps = tc.steps * (mc.n_blocks if job.schedule == "sequential" else 1)
    res.busy_fraction = 1 / mc.n_blocks if job.schedule == "sequential" else 1.0
    from .model import train_flops_per_token
    res.train_flops = float(sum(train_flops_per_token(mc, k, tc.seq_len) for k in range(mc.n_blocks))
                            * tc.steps * tc.batch_size * tc.seq_len)
    res.trainable_bytes = []
    log(f"block workers finished in {res.seconds:.0f} s")
    return res


def plot_curves(result: dict, path: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    curve = result["blocktrain"]["curve"]
    starts = result["blocktrain"].get("starts") or []
    for k in range(len(curve[0][1]) if curve else 0):
        s = starts[k] if k < len(starts) else 0
        pts = [c for c in curve if c[0] > s]  # a block's head means nothing before it trains
        ax.plot([c[0] for c in pts], [c[1][k] for c in pts], label=f"BlockTrain head of block {k}")
    if "reference" in result:
        ref = result["reference"]["curve"]
        ax.plot([c[0] for c in ref], [c[1][0] for c in ref], "k--", label="end-to-end reference")
    w, steps = result["blocktrain"].get("workers_per_block", 1), result["job"]["train"]["steps"]
    ax.set_xlabel("wall time, in one worker's full-batch steps" + (
        f"\n(each block's {steps} optimizer steps are shared by {w} workers: {steps / w:.4g} on this axis)"
        if w > 1 else ""))
    ax.set_ylabel("valid CE (nats/byte)")
    ax.set_title(f"BlockTrain ({result['job']['schedule']}) vs end-to-end, {Path(_corpus(result)).name} bytes")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _corpus(r: dict) -> str:
    """The corpus the job trained and scored on, as the user named it (``--data``)."""
    return r["job"].get("corpus") or r["job"].get("data") or "embedded WikiText-2"


def _test_split(r: dict) -> str:
    corpus = _corpus(r)
    if corpus == "embedded WikiText-2":
        return "WikiText-2 wiki.test.tokens, embedded"
    if (Path(corpus) / "wiki.test.tokens").is_file():
        return str(Path(corpus) / "wiki.test.tokens")
    return f"the test split of {corpus}"


def summary(r: dict) -> str:
    b = r["blocktrain"]
    lines = ["", f"test CE, nats/byte ({_test_split(r)}):"]
    for k, ce in enumerate(b["test_ce_heads"]):  # blocks numbered from 0, as bt-peer's --block
        lines.append(f"  BlockTrain head of block {k:<2}      {ce:.4f}")
    if "reference" in r:
        lines.append(f"  end-to-end reference           {r['reference']['test_ce']:.4f}")
        lines.append(f"  gap (assembled - reference)    {r['gap_ce']:+.4f}")
        c1 = b["continuation_one_traversal"]
        c2 = r["reference"]["continuation_teacher_forced"]
        lines.append(f"  32-byte continuation: one traversal CE {c1['ce']:.3f} acc {c1['byte_accuracy']:.1%}; "
                     f"byte-by-byte (teacher-forced) CE {c2['ce']:.3f} acc {c2['byte_accuracy']:.1%}")
    lines.append(f"  wall time {r['wall_seconds']:.0f} s, peak RSS {r['peak_rss_mib']:.0f} MiB")
    smp = r.get("samples")
    if smp:
        lines.append(f"the chain's own greedy output after a test prompt (exact mode, "
                     f"{smp['exact_bytes_per_traversal']:.1f} bytes per traversal):")
        lines.append(f"  {smp['prompt']!r} -> {smp['blocktrain_exact']!r}")
    return "\n".join(lines)


