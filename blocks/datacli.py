"""``bt-data``: a corpus of your own text, prepared once for training (blocktrain.blocks.data).

This module parses the command line and prints; the work is ``data.prepare``.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import click

from .data import MANIFEST, DataError, cache_root, cached_corpora, prepare, prepared, remove_cached, verify
from .progress import bar


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main():
    """Prepare a corpus of your own text for `bt-train --data DIR` and `bt-peer join --data DIR`."""


@main.command("prepare")
@click.argument("src", type=click.Path(exists=True))
@click.option("--out", required=True, type=click.Path(file_okay=False), help="Directory to write the corpus to.")
@click.option("--valid-frac", default=0.01, show_default=True, type=float,
              help="Share of the bytes carved off as the validation split (before the test split).")
@click.option("--test-frac", default=0.01, show_default=True, type=float,
              help="Share of the bytes carved off as the test split (the last bytes).")
@click.option("--glob", "pattern", default="**/*.txt", show_default=True,
              help="Which files of a SRC folder to take (recursively, in sorted order).")
def prepare_cmd(src, out, valid_frac, test_frac, pattern):
    """Write SRC as train.bin, valid.bin and test.bin (raw bytes) with manifest.json (sizes, sha256,
    how valid and test were carved) in --out. SRC: one text file, a folder of them, or a folder of
    the standard WikiText files (whose own splits are kept). Training memory-maps the splits, so a
    worker's memory does not grow with the corpus. Peers of a swarm compare the manifest's digest
    when they join and never group with a peer of another corpus."""
    try:
        m = _with_bar("bt-data prepare", lambda progress: prepare(src, out, valid_frac, test_frac, pattern, progress))
    except (DataError, OSError) as e:
        click.echo(f"bt-data: {e}", err=True)
        sys.exit(2)
    for sp, d in m["splits"].items():
        click.echo(f"{sp:<6}{d['bytes']:>15,} bytes  sha256 {d['sha256'][:16]}  {Path(out) / d['file']}")
    click.echo(f"{m['files']} file(s) from {m['source']}; carved: {m['carve']}")
    click.echo(f"digest {m['digest']}; use it with --data {out}")


def _with_bar(title: str, work):
    """``work(progress)`` with a byte progress bar (``progress(done, total)``); its result."""
    with bar(title, None, unit="byte") as b:
        def progress(done, total):
            if b.total is None:
                b.total = total
            b.update(done - b.n)
        return work(progress)


@main.command("info")
@click.argument("directory", type=click.Path(exists=True, file_okay=False))
@click.option("--quick", is_flag=True, help="Check the files' sizes only, not their sha256 (which reads every byte).")
def info(directory, quick):
    """Check a prepared corpus against its manifest (sizes, and every split's sha256 unless
    --quick) and print the manifest. Its `digest` is what peers of a swarm compare at join."""
    try:
        if quick:
            m = prepared(directory)
            if m is None:
                raise DataError(f"{directory} has no {MANIFEST}: not a prepared corpus")
        else:
            m = _with_bar("bt-data info (sha256)", lambda progress: verify(directory, progress))
    except DataError as e:
        click.echo(f"bt-data: {e}", err=True)
        sys.exit(2)
    click.echo(json.dumps(m, indent=1))
    click.echo(f"{'sizes' if quick else 'sizes and sha256'} match the manifest; digest {m['digest']}", err=True)


@main.command("cache")
@click.option("--dir", "directory", type=click.Path(file_okay=False), default=None,
              help="The cache (default: $BT_DATA_CACHE, else ~/.cache/blocktrain/corpora).")
@click.option("--prune", is_flag=True, help="Remove the corpora whose source text changed or is gone (never used again).")
@click.option("--clear", is_flag=True, help="Remove every cached corpus (each is prepared again when next used).")
def cache_cmd(directory, prune, clear):
    """List the corpora prepared from text that bt-train or bt-peer was given as its data (a text
    file or folder is prepared once into this cache; a changed source is prepared into a new
    entry and the old one stays):
    size, last use, source, and whether it would be used again. --prune or --clear removes them;
    an entry a process is preparing right now is left alone (one a running job reads stays
    readable to it: its files are memory-mapped)."""
    if prune and clear:
        raise click.UsageError("give --prune or --clear, not both")
    root = cache_root(directory)
    entries = cached_corpora(directory)
    if not entries:
        click.echo(f"no cached corpora in {root}")
        return
    for e in entries:
        age = (time.time() - e.last_used) / 86400
        click.echo(f"{e.bytes:>15,} bytes  used {age:6.1f} days ago  {'current' if e.current else 'stale  '}  "
                   f"{e.path.name}  {e.source or '(no manifest)'}")
    total = sum(e.bytes for e in entries)
    if prune or clear:
        gone = remove_cached([e for e in entries if clear or not e.current])
        kept = len(entries) - len(gone)
        click.echo(f"removed {len(gone)} of {len(entries)} ({sum(e.bytes for e in gone):,} bytes); {kept} kept in {root}")
    else:
        stale = [e for e in entries if not e.current]
        click.echo(f"{len(entries)} cached corpora, {total:,} bytes in {root}"
                   + (f"; {len(stale)} stale ({sum(e.bytes for e in stale):,} bytes): --prune removes them"
                      if stale else ""))


if __name__ == "__main__":
    main()
