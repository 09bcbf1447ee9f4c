"""``bt-train``: the main job. Train a BlockTrain model and the end-to-end reference, same budget.

This module parses the command line and prints; the job itself is blocktrain.blocks.job.
"""

from __future__ import annotations

import shlex
import sys

import click

from . import checkpoint as ckpt
from .config import SIZES, ConfigError, JobConfig, load, parse_set, read_config_file
from .data import DataError
from .progress import bar
from .schedule import SCHEDULES


@click.command(context_settings={"help_option_names": ["-h", "--help"]},
               epilog="Examples: bt-train | bt-train --steps 1000 --set model.d_model=192 --set model.n_head=6 | "
                      "bt-train --config job.json --schedule sequential --out runs/seq | "
                      "bt-train --init shipped --data mine.txt --steps 200 --schedule sequential")
@click.option("--size", type=click.Choice(list(SIZES)), default=None,
              help="A named model size (tiny = the default d 128 x 6 layers, small d 512 x 12, base d 1024 x 24); "
                   "--config and --set override it. --dry-run prints what it costs.")
@click.option("--dry-run", is_flag=True, help="Print each block's parameters, a worker's memory and the FLOPs of a "
                                              "step, then exit without training.")
@click.option("--config", "config_file", type=click.Path(dir_okay=False, exists=True),
              help="JSON file of overrides (the same keys as --set, or nested sections).")
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE",
              help="Override one setting: model.d_model=192, train.lr=1e-3, steps=500 (a bare key when one "
                   "section has it). Unknown keys are errors.")
@click.option("--steps", type=click.IntRange(1), default=None, help="Optimizer steps per block and for the reference "
              "(train.steps, default 300).")
@click.option("--schedule", type=click.Choice(SCHEDULES), default=None,
              help="When each block trains (default relay: every worker on one block, then the next).")
@click.option("--data", type=click.Path(exists=True), default=None,
              help="A text file or a folder of .txt files (prepared once into a cache; `bt-data prepare` chooses "
                   "the fractions), a corpus `bt-data prepare` wrote (memory-mapped: any size), or a directory "
                   "with wiki.{train,valid,test}.tokens (default: the embedded WikiText-2).")
@click.option("--device", default=None, metavar="auto|cpu|cuda[:N]|mps",
              help="Where to train (default auto: cuda, else mps, else cpu). Checkpoints are device-independent.")
@click.option("--precision", type=click.Choice(["auto", "fp32", "bf16"]), default=None,
              help="bf16: forward passes under bfloat16 autocast (default auto: bf16 on a CUDA device that "
                   "supports it, else fp32).")
@click.option("--out", type=click.Path(file_okay=False), default=None, help="Output directory (default runs/train-<time>).")
@click.option("--init", default=None, metavar="DIR|shipped",
              help="Start every block from the checkpoints in DIR (a bt-train OUT/checkpoints, or `shipped`: the "
                   "model the package ships) instead of from scratch: fine-tune it on --data, or on longer windows "
                   "(--set train.seq_len=384). The model settings are theirs; the training settings are this "
                   "job's (defaults, --config, --set); the reference is not trained.")
@click.option("--no-reference", is_flag=True, default=None, help="Skip the end-to-end reference.")
@click.option("--processes", is_flag=True, default=None,
              help="Train each block in its own process, exchanging checkpoint files (staggered, parallel or "
                   "sequential; relay needs same-block averaging between workers, which bt-peer provides).")
@click.option("--threads", type=click.IntRange(1), default=None, help="torch threads (default 2).")
def main(size, dry_run, config_file, sets, steps, schedule, data, device, precision, out, init, no_reference,
         processes, threads):
    """Train a 3-block BlockTrain model and the end-to-end reference on WikiText-2 bytes, under the
    same budget; report the test CE of every head along the chain, write results.json, curves.png
    and the checkpoints (servable with `bt-peer serve --checkpoints OUT/checkpoints`).

    Defaults live in one place (the config dataclasses); --config FILE and --set KEY=VALUE
    override them, typed by the fields; unknown keys are errors.
    """
    from .job import init_model, run_job
    options = {"train.steps": steps, "schedule": schedule, "data": data, "device": device, "precision": precision,
               "out": out, "threads": threads, "init": init, "reference": False if no_reference else None,
               "processes": True if processes else None}
    try:  # --init (or --set init=, or a config file's): the model settings are the checkpoints'
        name = init or parse_set(sets).get("init") or (read_config_file(config_file).get("init") if config_file else None)
        try:
            base = JobConfig(model=init_model(name)) if name else JobConfig()
        except (ckpt.CheckpointError, ValueError) as e:
            raise click.BadParameter(str(e), param_hint="--init") from None
        job = load(base, config_file, sets, size, **options)
    except ConfigError as e:
        raise click.BadParameter(str(e), param_hint="configuration") from None
    if dry_run:
        _print_plan(job)
        return
    try:
        run_job(job, log=lambda s: click.echo(s, err=True), bar=bar, command=shlex.join(["bt-train", *sys.argv[1:]]))
    except (DataError, ValueError, RuntimeError, ckpt.CheckpointError) as e:
        click.echo(f"bt-train: {e}", err=True)
        sys.exit(2)
    except KeyboardInterrupt:
        click.echo("bt-train: interrupted; checkpoints written so far are kept", err=True)
        sys.exit(130)


def _print_plan(job: JobConfig) -> None:
    from .plan import dry_run
    p = dry_run(job)
    m = job.model
    gib = lambda n: f"{n / 2**30:.2f} GiB"  # noqa: E731
    click.echo(f"model: d {m.d_model}, {m.n_head} heads, {m.n_layer} layers in {m.n_blocks} blocks, "
               f"{p['params_total']:,} parameters; batch {p['batch'][0]} x {p['batch'][1]} bytes"
               + (f" in {p['micro_batches']} slices" if p["micro_batches"] > 1 else "") + ", "
               f"{p['steps_per_block']} steps per block")
    for r in p["blocks"]:
        mem = r["memory"]
        click.echo(f"block {r['block']}: {r['params']:>13,} parameters; a worker holds {gib(mem['total_bytes_estimate'])} "
                   f"(trained {gib(mem['trained_bytes'])}, frozen below {gib(mem['frozen_below_bytes'])}, "
                   f"activations ~{gib(mem['activations_bytes_estimate'])}); "
                   f"{r['train_flops_per_step'] / 1e12:.3f} TFLOP a step")
    click.echo(f"end-to-end reference: {p['reference_flops_per_step'] / 1e12:.3f} TFLOP a step. {p['note']}.")


if __name__ == "__main__":
    main()
