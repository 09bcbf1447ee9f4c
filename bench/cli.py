"""``bt-bench``: BlockTrain's benchmarks. Each prints a table and can write JSON (--json PATH)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click


def _emit(result: dict, json_path: str | None, rows: list[tuple]):
    width = max(len(r[0]) for r in rows)
    for name, value in rows:
        click.echo(f"  {name:<{width}}  {value}")
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(result, indent=1))
        click.echo(f"wrote {json_path}")


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main():
    """BlockTrain benchmarks. Figures are medians of repeated runs; every ratio compares two
    figures measured side by side in the same run (this machine is shared and noisy)."""


@main.command()
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Write the full result as JSON here.")
@click.option("--repeats", default=7, show_default=True, type=click.IntRange(3, 101),
              help="Timed repetitions; medians are reported.")
@click.option("--chunk-mib", default=4, show_default=True, type=click.IntRange(1, 15),
              help="Size of the large payload, MiB.")
@click.option("--small-frames", default=20000, show_default=True, type=click.IntRange(1000, 10**7),
              help="Small frames per timed batch.")
def codec(json_path, repeats, chunk_mib, small_frames):
    """In-process encode+decode throughput of the wire protocol.

    Large payloads: one StreamChunk of --chunk-mib random bytes through two in-process
    Connections, plaintext and sealed (AES-256-GCM), against a memcpy of the same bytes and raw
    AES-256-GCM encrypt+decrypt of them, measured interleaved. Small frames: Ping messages
    encoded and decoded per second. Targets: plaintext >= 50% of memcpy, sealed >= 60% of raw
    AES-GCM, >= 100,000 small frames/s.
    """
    from .codec import run

    with click.progressbar(length=repeats, label="codec", file=sys.stderr) as bar:
        last = [0]

        def progress(done, total):
            bar.update(done - last[0])
            last[0] = done

        r = run(chunk_mib * 1024 * 1024, repeats, small_frames=small_frames, progress=progress)
    g, q, s, met = r["throughput_gbps"], r["ratios"], r["small_frames_per_s"], r["met"]
    ok = lambda b: "met" if b else "MISSED"  # noqa: E731
    _emit(r, json_path, [
        ("memcpy", f"{g['memcpy']:.2f} GB/s"),
        ("plaintext encode+decode", f"{g['plain']:.2f} GB/s  ({q['plain_vs_memcpy']:.0%} of memcpy, target 50%: "
                                    f"{ok(met['plain_vs_memcpy'])})"),
        ("raw AES-256-GCM enc+dec", f"{g['raw_aes']:.2f} GB/s"),
        ("sealed encode+decode", f"{g['sealed']:.2f} GB/s  ({q['sealed_vs_raw_aes_gcm']:.0%} of raw AES-GCM, "
                                 f"target 60%: {ok(met['sealed_vs_raw_aes_gcm'])})"),
        ("small frames, plaintext", f"{s['plain']:,.0f} /s  (target 100,000: {ok(met['small_frames_plain'])})"),
        ("small frames, sealed", f"{s['sealed']:,.0f} /s  (target 100,000: {ok(met['small_frames_sealed'])})"),
    ])


if __name__ == "__main__":
    main()
