"""Byte-level WikiText data: the embedded default, a user's directory, deterministic batches.

Rules:
- A split is a flat uint8 tensor of the file's bytes (vocabulary 256).
- The embedded default is WikiText-2 (CC BY-SA 3.0, see data/README.md), xz-compressed in the
  package and verified by sha256 when it is opened.
- A user's directory holds the standard WikiText file names: ``wiki.{train,valid,test}.tokens``
  (WikiText-2/-103 tokenized) or ``wiki.{train,valid,test}.raw`` (the raw variants).
- A prepared directory (``prepare``, ``bt-data prepare``) holds ``{train,valid,test}.bin``: a
  corpus of the user's own text as raw bytes, with ``manifest.json`` (sizes, sha256, sources, how
  valid and test were carved). Its splits are memory-mapped (``load_split``): a worker's memory
  does not grow with the corpus. The manifest is written last: a directory without it is not a
  prepared corpus (an interrupted ``prepare`` is redone, never half-read).
- Batches are a pure function of (seed, step, shard): a restarted trainer that knows its step
  reads exactly the batches it would have read, and each of ``num_shards`` workers reads its own
  disjoint slice of the training bytes.
"""

from __future__ import annotations

import hashlib
import json
import lzma
import mmap
import os
import sys
import weakref
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch

SPLITS = ("train", "valid", "test")
VARIANTS = ("tokens", "raw")

# sha256 of the uncompressed embedded files; a mismatch means a damaged install.
EMBEDDED_SHA256 = {
    "wiki.train.tokens": "9e9fa1ad55b1c2c95b08e37dd8e653f638fac2c6de904b79e813611eefbc985f",
    "wiki.valid.tokens": "f0737ed31fc1329026e95cb8b98e19c2a182c39c240ab909dc31abf2f8af58e8",
    "wiki.test.tokens": "d790b833ef8cf03a90db7bf1271b7520b83c45ce07ba3c1a9699df81e239eca0",
    "wiki.valid.raw": "4cd0f6876d07a413aa911261ff6d363c72d757d47f0fdd6015702014c89cb9c7",
    "wiki.test.raw": "173c87a53759e0201f33e0ccf978e510c2042d7f2cb78229d9a50d79b9e7dd08",
}


class DataError(Exception):
    """A data file is missing, damaged or unusable."""


def _file_name(split: str, variant: str) -> str:
    if split not in SPLITS:
        raise DataError(f"unknown split {split!r}; expected one of {SPLITS}")
    if variant not in VARIANTS:
        raise DataError(f"unknown variant {variant!r}; expected one of {VARIANTS}")
    return f"wiki.{split}.{variant}"


def read_embedded(split: str, variant: str = "tokens") -> bytes:
    """The bytes of one embedded WikiText-2 split, verified by sha256."""
    name = _file_name(split, variant)
    if name not in EMBEDDED_SHA256:
        raise DataError(f"{name} is not embedded (the raw train split is not shipped); "
                        "pass --data DIR with your own copy")
    blob = resources.files("blocktrain.blocks").joinpath("data", name + ".xz").read_bytes()
    data = lzma.decompress(blob)
    digest = hashlib.sha256(data).hexdigest()
    if digest != EMBEDDED_SHA256[name]:
        raise DataError(f"embedded {name} is damaged: sha256 {digest} != {EMBEDDED_SHA256[name]}")
    return data


def read_split(split: str, data_dir: str | Path | None = None, variant: str = "tokens") -> bytes:
    """One split's bytes from ``data_dir`` (standard WikiText names), or the embedded default."""
    if data_dir is None:
        return read_embedded(split, variant)
    path = Path(data_dir) / _file_name(split, variant)
    if not path.is_file():
        found = sorted(p.name for p in Path(data_dir).glob("wiki.*")) if Path(data_dir).is_dir() else []
        raise DataError(f"{path} not found (directory holds: {found or 'no wiki.* files'}); "
                        "expected the standard WikiText names wiki.{train,valid,test}.{tokens,raw}")
    data = path.read_bytes()
    if len(data) < 2:
        raise DataError(f"{path} is empty")
    return data


MANIFEST = "manifest.json"
PREPARED_FORMAT = "blocktrain-bytes/1"
CHUNK = 8 << 20  # bytes read and written at a time by prepare (its memory, whatever the corpus)
MIN_SPLIT_BYTES = 1025  # prepare's floor per split (one 1024-byte window); a job checks its own seq_len too


def prepare(src: str | Path, out: str | Path, valid_frac: float = 0.01, test_frac: float = 0.01,
            pattern: str = "**/*.txt", progress=lambda done, total: None) -> dict:
    """Write ``out``/{train,valid,test}.bin and ``out``/manifest.json from ``src``: one text file, a
    folder (its files matching ``pattern``, recursively, in sorted order), or a folder of standard
    WikiText files (its own three splits, as they are). Files are concatenated, a newline added
    after any that lacks one; of the concatenation's N bytes the last ``test_frac`` are test, the
    ``valid_frac`` before them valid, the rest train (cut at byte offsets, stated in the manifest).
    Streams CHUNK bytes at a time. Returns the manifest."""
    src, out = Path(src), Path(out)
    if not 0 < valid_frac < 0.5 or not 0 < test_frac < 0.5:
        raise DataError(f"--valid-frac and --test-frac must be in (0, 0.5), got {valid_frac} and {test_frac}")
    if not src.exists():
        raise DataError(f"{src} does not exist")
    wikitext = src.is_dir() and all((src / _file_name(sp, "tokens")).is_file() for sp in SPLITS)
    if wikitext:
        plan = {sp: [src / _file_name(sp, "tokens")] for sp in SPLITS}
        carve = "the source's own WikiText splits (wiki.{train,valid,test}.tokens), as they are"
    else:
        inside = out.resolve()  # a --out inside SRC: its own files are not sources
        files = [src] if src.is_file() else sorted(p for p in src.glob(pattern)
                                                   if p.is_file() and inside not in p.resolve().parents)
        if not files:
            raise DataError(f"{src} holds no file matching {pattern!r} (--glob)")
        plan = {"all": files}
        carve = (f"files in sorted order, a newline after any that lacks one; of the N bytes, the last "
                 f"{test_frac} are test, the {valid_frac} before them valid, the rest train")
    out.mkdir(parents=True, exist_ok=True)
    (out / MANIFEST).unlink(missing_ok=True)  # not a prepared corpus until the new manifest is written
    splits = _write_splits(plan, out, valid_frac, test_frac, progress)
    small = [sp for sp in SPLITS if splits[sp]["bytes"] < MIN_SPLIT_BYTES]
    if small:
        raise DataError(f"{src}: the {' and '.join(small)} split(s) would hold fewer than {MIN_SPLIT_BYTES} bytes "
                        f"({', '.join(str(splits[sp]['bytes']) for sp in small)}): a larger corpus or fraction")
    manifest = {"format": PREPARED_FORMAT, "source": str(src.resolve()), "carve": carve,
                "valid_frac": None if wikitext else valid_frac, "test_frac": None if wikitext else test_frac,
                "files": sum(len(v) for v in plan.values()), "splits": splits}
    manifest["digest"] = hashlib.sha256(json.dumps(
        {k: splits[k]["sha256"] for k in SPLITS}, sort_keys=True).encode()).hexdigest()[:16]
    tmp = out / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1))
    os.replace(tmp, out / MANIFEST)
    return manifest


def _sources(files):
    """(bytes, is the last chunk of a file) of ``files`` in order, CHUNK at a time, with a newline
    after a file that lacks one."""
    for f in files:
        last = b""
        with open(f, "rb") as fh:
            while chunk := fh.read(CHUNK):
                last = chunk
                yield chunk
        if last and not last.endswith(b"\n"):
            yield b"\n"


def _write_splits(plan: dict, out: Path, valid_frac: float, test_frac: float, progress) -> dict:
    if "all" in plan:
        total = sum(f.stat().st_size for f in plan["all"])
        total += sum(1 for f in plan["all"] if f.stat().st_size and not _ends_with_newline(f))
        cut_valid, cut_test = int(total * (1 - valid_frac - test_frac)), int(total * (1 - test_frac))
        bounds = {"train": (0, cut_valid), "valid": (cut_valid, cut_test), "test": (cut_test, total)}
        streams = {sp: plan["all"] for sp in SPLITS}
    else:
        total = sum(plan[sp][0].stat().st_size for sp in SPLITS)
        bounds, streams = None, plan
    written, done = {}, 0
    handles = {sp: open(out / f"{sp}.bin.tmp", "wb") for sp in SPLITS}
    digests = {sp: hashlib.sha256() for sp in SPLITS}
    try:
        if bounds is None:
            for sp in SPLITS:
                for chunk in _sources(streams[sp]):
                    handles[sp].write(chunk)
                    digests[sp].update(chunk)
                    done += len(chunk)
                    progress(done, total)
        else:
            pos = 0
            for chunk in _sources(plan["all"]):
                for sp in SPLITS:
                    lo, hi = bounds[sp]
                    piece = chunk[max(lo - pos, 0):max(min(hi - pos, len(chunk)), 0)]
                    if piece:
                        handles[sp].write(piece)
                        digests[sp].update(piece)
                pos += len(chunk)
                progress(pos, total)
    finally:
        for h in handles.values():
            h.close()
    for sp in SPLITS:
        os.replace(out / f"{sp}.bin.tmp", out / f"{sp}.bin")
        written[sp] = {"file": f"{sp}.bin", "bytes": (out / f"{sp}.bin").stat().st_size,
                       "sha256": digests[sp].hexdigest()}
    return written


def _ends_with_newline(f: Path) -> bool:
    with open(f, "rb") as fh:
        fh.seek(-1, os.SEEK_END)
        return fh.read(1) == b"\n"


def prepared(data_dir: str | Path | None) -> dict | None:
    """The manifest of a prepared corpus at ``data_dir`` (None: not one), its files' sizes checked."""
    if data_dir is None or not (Path(data_dir) / MANIFEST).is_file():
        return None
    path = Path(data_dir) / MANIFEST
    try:
        m = json.loads(path.read_text())
        splits = m["splits"]
        ok = m.get("format") == PREPARED_FORMAT and all(type(splits[sp]["bytes"]) is int for sp in SPLITS)
    except (ValueError, KeyError, TypeError):
        ok = False
    if not ok:
        raise DataError(f"{path} is not a manifest bt-data prepare wrote ({PREPARED_FORMAT}); prepare again")
    for sp in SPLITS:
        f = Path(data_dir) / f"{sp}.bin"
        size = f.stat().st_size if f.is_file() else None
        if size != splits[sp]["bytes"]:
            raise DataError(f"{f}: {size if size is not None else 'missing'}, the manifest says "
                            f"{splits[sp]['bytes']} bytes; prepare again")
    return m


def verify(data_dir: str | Path, progress=lambda done, total: None) -> dict:
    """A prepared corpus checked in full: sizes (``prepared``), then every split's sha256 against
    its manifest, streamed CHUNK bytes at a time. Returns the manifest; DataError names a damaged split."""
    m = prepared(data_dir)
    if m is None:
        raise DataError(f"{data_dir} has no {MANIFEST}: not a prepared corpus")
    total, done = sum(m["splits"][sp]["bytes"] for sp in SPLITS), 0
    for sp in SPLITS:
        h = hashlib.sha256()
        with open(Path(data_dir) / f"{sp}.bin", "rb") as f:
            while chunk := f.read(CHUNK):
                h.update(chunk)
                done += len(chunk)
                progress(done, total)
        if h.hexdigest() != m["splits"][sp]["sha256"]:
            raise DataError(f"{Path(data_dir) / (sp + '.bin')}: sha256 {h.hexdigest()[:16]}..., the manifest says "
                            f"{m['splits'][sp]['sha256'][:16]}...: damaged; prepare again")
    return m


def load_split(split: str, data: str | Path | None = None, variant: str = "tokens") -> torch.Tensor:
    """One split as a flat uint8 tensor: memory-mapped from a prepared corpus (read-only use: the
    mapping is private, nothing is written back), else read whole (the embedded default, a WikiText
    directory). A text file or another folder: a DataError that names the prepare command."""
    m = prepared(data)
    if m is not None:
        _file_name(split, variant)  # a known split and variant (a prepared corpus has one variant)
        n = m["splits"][split]["bytes"]
        if n < 2:
            raise DataError(f"{Path(str(data)) / (split + '.bin')} holds {n} bytes: prepare with a larger "
                            f"--{split}-frac" if split != "train" else f"{data}: the train split is empty")
        return _mapped(Path(str(data)) / f"{split}.bin")
    if data is not None and (Path(data).is_file() or (Path(data).is_dir() and not any(Path(data).glob("wiki.*")))):
        raise DataError(f"{data} is neither a prepared corpus nor a WikiText directory; prepare it once with "
                        f"`bt-data prepare {data} --out DIR`, then pass --data DIR")
    return as_tensor(read_split(split, data, variant))


def resolve_data(data: str | Path | None, say=lambda line: None, cache: str | Path | None = None) -> str | None:
    """What ``--data`` names, as something ``load_split`` reads: the embedded default (None), a
    prepared corpus or a WikiText directory as they are; a text file or another folder is prepared
    once (``prepare``, default fractions and glob) into ``cache``/KEY (default
    ``$BT_DATA_CACHE`` or ``~/.cache/blocktrain/corpora``), KEY a hash of the source's path, sizes
    and modification times, and reused while they stay the same (a changed source is prepared
    into a new KEY; older ones stay until the user removes them). Concurrent callers (peers started
    together on one machine) prepare it once: the others wait on a lock."""
    if data is None or prepared(data) is not None:
        return None if data is None else str(data)
    src = Path(data)
    if src.is_dir() and any(src.glob("wiki.*")):
        return str(src)
    if not src.exists():
        raise DataError(f"{src} does not exist")
    files = _cached_files(src)
    if not files:
        raise DataError(f"{src} holds no .txt file (prepare another glob with `bt-data prepare {src} --glob ... "
                        "--out DIR`, then pass --data DIR)")
    out = cache_root(cache) / _cache_key(src, files)
    import fcntl
    for _ in range(3):  # `bt-data cache --clear` may remove the folder meanwhile: then again
        out.mkdir(parents=True, exist_ok=True)
        try:
            lock = open(out / ".lock", "w")  # opened for writing: its mtime says when it was last used
        except FileNotFoundError:
            continue
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if os.fstat(lock.fileno()).st_ino == os.stat(out / ".lock").st_ino:
                break  # the lock we hold is the folder's own
        except FileNotFoundError:
            pass
        lock.close()  # removed while we waited: another lock file, or none
    else:
        raise DataError(f"{out} keeps disappearing while it is prepared (another process clearing the cache?)")
    with lock:  # held: one preparer; the others find its manifest
        try:
            m = prepared(out) if (out / MANIFEST).is_file() else None
        except DataError:  # damaged (a file removed or cut): prepared again
            m = None
        if m is None:
            say(f"preparing {src} ({sum(f.stat().st_size for f in files):,} bytes) into {out} (once; "
                "bt-data prepare does this with other fractions or a glob)")
            m = prepare(src, out)
    say(f"data: {src} as prepared in {out} (corpus digest {m['digest']})")
    return str(out)


def cache_root(cache: str | Path | None = None) -> Path:
    """Where ``resolve_data`` prepares text it is given: ``cache``, else ``$BT_DATA_CACHE``, else
    ``~/.cache/blocktrain/corpora``."""
    return Path(cache or os.environ.get("BT_DATA_CACHE") or Path.home() / ".cache" / "blocktrain" / "corpora")


def _cached_files(src: Path) -> list[Path]:
    return [src] if src.is_file() else sorted(p for p in src.glob("**/*.txt") if p.is_file())


def _cache_key(src: Path, files: list[Path]) -> str:
    """16 hex digits of the source's path and its files' paths, sizes and modification times."""
    h = hashlib.sha256(str(src.resolve()).encode())
    for f in files:
        st = f.stat()
        h.update(f"\0{f.resolve()}\0{st.st_size}\0{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


@dataclass(frozen=True)
class CachedCorpus:
    path: Path
    source: str | None  # the text it was prepared from (None: no readable manifest)
    bytes: int  # on disk
    last_used: float  # when resolve_data last took it (seconds since the epoch)
    current: bool  # its source is still there, unchanged: resolve_data would take it again


def cached_corpora(cache: str | Path | None = None) -> list[CachedCorpus]:
    """What ``resolve_data`` prepared into the cache, oldest use first. An entry whose source
    changed or went away is never taken again (a changed source is prepared into a new entry)."""
    root = cache_root(cache)
    out = []
    for d in sorted(p for p in root.iterdir() if _is_entry(p)) if root.is_dir() else []:
        try:
            size = sum(f.stat().st_size for f in d.rglob("*") if f.is_file())
            lock = d / ".lock"
            used = (lock if lock.exists() else d).stat().st_mtime
        except FileNotFoundError:  # removed while we listed it
            continue
        try:
            m = json.loads((d / MANIFEST).read_text())
            source = str(m["source"])
        except (OSError, ValueError, KeyError, TypeError):
            source = None
        current = False
        if source is not None and Path(source).exists():
            files = _cached_files(Path(source))
            current = bool(files) and _cache_key(Path(source), files) == d.name
        out.append(CachedCorpus(d, source, size, used, current))
    return sorted(out, key=lambda c: c.last_used)


def _is_entry(d: Path) -> bool:
    """A folder resolve_data made: named by a 16-hex-digit key, holding its lock or manifest
    (nothing else in the cache folder is ever listed, let alone removed)."""
    return d.is_dir() and len(d.name) == 16 and all(c in "0123456789abcdef" for c in d.name) \
        and ((d / ".lock").is_file() or (d / MANIFEST).is_file())


def remove_cached(entries: list[CachedCorpus]) -> list[CachedCorpus]:
    """Remove ``entries`` from the cache, but for any a process is preparing right now (its lock
    is held); returns those removed."""
    import fcntl
    import shutil
    gone = []
    for e in entries:
        try:
            with open(e.path / ".lock", "a") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # in use: left alone
                shutil.rmtree(e.path)
            gone.append(e)
        except BlockingIOError:
            continue
        except FileNotFoundError:
            gone.append(e)
    return gone


def corpus_digest(data: str | Path | None) -> str:
    """16 hex digits naming the corpus ``data`` holds (what ``load_split`` reads), the same on every
    machine: a prepared corpus's manifest digest, the sha256 of a WikiText directory's tokens files,
    the embedded WikiText-2's. Peers of a swarm compare it before they group."""
    m = prepared(data)
    if m is not None:
        return m["digest"]
    if data is None:
        shas = {sp: EMBEDDED_SHA256[_file_name(sp, "tokens")] for sp in SPLITS}
    else:
        shas = {}
        for sp in SPLITS:
            h = hashlib.sha256()
            with open(Path(data) / _file_name(sp, "tokens"), "rb") as f:
                while chunk := f.read(CHUNK):
                    h.update(chunk)
            shas[sp] = h.hexdigest()
    return hashlib.sha256(json.dumps(shas, sort_keys=True).encode()).hexdigest()[:16]


# Linux's MAP_NORESERVE (Python's mmap names it from 3.13 on): no memory reserved for the mapping.
MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000 if sys.platform.startswith("linux") else 0)


def _mapped(path: Path) -> torch.Tensor:
    """The file as a flat uint8 tensor on a private copy-on-write mapping with nothing reserved:
    pages are read as used, a write (nothing here writes) stays in this process, never reaches the
    file. torch.from_file maps privately without MAP_NORESERVE, so the kernel reserves memory for
    the whole file and a corpus larger than RAM fails; a read-only mapping would crash the process
    on a write."""
    if not hasattr(mmap, "MAP_PRIVATE"):  # no POSIX mmap: read it whole
        return as_tensor(path.read_bytes())
    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_PRIVATE | MAP_NORESERVE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    t = torch.frombuffer(m, dtype=torch.uint8)
    ptr = t.untyped_storage().data_ptr()
    _MAPPINGS[ptr] = m
    weakref.finalize(t, _MAPPINGS.pop, ptr, None)  # while the tensor load_split returned lives
    return t


# A mapped split's mmap, by the address of its storage (views of the split share it: drop_pages).
# The mapping is private and writable only so that torch takes it; nothing may write to a split
# (drop_pages would silently undo the write).
_MAPPINGS: dict[int, mmap.mmap] = {}


def drop_pages(data: torch.Tensor) -> None:
    """Unmap the pages of a mapped split that reads have mapped (nothing if ``data`` is not one):
    the kernel maps a read's neighbourhood too (fault-around, readahead), so random windows over a
    large corpus would otherwise leave the process's RSS growing toward the corpus's size. Clean
    pages of a private file mapping: a later read maps them again from the page cache."""
    m = _MAPPINGS.get(data.untyped_storage().data_ptr())
    if m is not None and hasattr(mmap, "MADV_DONTNEED"):
        m.madvise(mmap.MADV_DONTNEED)


def as_tensor(data: bytes) -> torch.Tensor:
    """Bytes as a flat uint8 tensor (a copy: the tensor owns its memory)."""
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


@dataclass(frozen=True)
class ByteBatches:
    """Deterministic random windows over a byte tensor.

    ``batch(step)`` returns ``(x, y)``, each ``(batch_size, seq_len)`` int64, ``y`` shifted by one
    byte. Shard ``shard`` of ``num_shards`` draws windows only from its own contiguous slice.
    """

    data: torch.Tensor
    batch_size: int
    seq_len: int
    seed: int = 0
    shard: int = 0
    num_shards: int = 1

    def __post_init__(self):
        assert self.data.dtype == torch.uint8 and self.data.dim() == 1, "data must be flat uint8"
        assert 0 <= self.shard < self.num_shards, f"shard {self.shard} not in [0, {self.num_shards})"
        lo, hi = self.bounds()
        if hi - lo < self.seq_len + 2:
            raise DataError(f"shard {self.shard}/{self.num_shards} holds {hi - lo} bytes, "
                            f"fewer than one window of {self.seq_len + 1}")

    def bounds(self) -> tuple[int, int]:
        n = self.data.numel()
        per = n // self.num_shards
        return self.shard * per, (self.shard + 1) * per

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        lo, hi = self.bounds()
        g = torch.Generator().manual_seed(_mix(self.seed, self.shard, step))
        starts = torch.randint(lo, hi - self.seq_len - 1, (self.batch_size,), generator=g)
        idx = starts[:, None] + torch.arange(self.seq_len + 1)[None, :]
        w = self.data[idx].long()
        drop_pages(self.data)  # a mapped corpus: what this read mapped goes again (RSS stays flat)
        return w[:, :-1], w[:, 1:]


def _mix(*values: int) -> int:
    """A stable 62-bit seed from small integers (Python's hash() is not a contract)."""
    h = 0x243F6A8885A308D3
    for v in values:
        h = ((h ^ (v & 0xFFFF_FFFF_FFFF)) * 0x100000001B3) % (1 << 62)
    return h


def eval_windows(data: torch.Tensor, seq_len: int, max_windows: int | None = None):
    """Non-overlapping ``(x, y)`` windows covering ``data`` in order (for test CE), as views of
    ``data`` in its own dtype (no copy): a caller turns the rows it uses to int64 (``.long()``) a
    batch at a time, so a whole split (``--test-windows 0``) never becomes int64 at once (8x its
    bytes)."""
    n = (data.numel() - 1) // seq_len
    if max_windows is not None:
        n = min(n, max_windows)
    x = data[: n * seq_len].view(n, seq_len)
    y = data[1: n * seq_len + 1].view(n, seq_len)
    return x, y
