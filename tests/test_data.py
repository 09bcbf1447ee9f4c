"""A corpus of the user's own text: bt-data prepare, and training reading it memory-mapped."""

import hashlib
import json

import pytest
import torch
from click.testing import CliRunner

from blocktrain.blocks import data
from blocktrain.blocks.data import ByteBatches, DataError, load_split, prepare, prepared
from blocktrain.blocks.datacli import main as bt_data


def _corpus(root):
    (root / "a").mkdir(parents=True)
    (root / "a" / "one.txt").write_bytes(b"first file\n" * 1500)
    (root / "a" / "two.txt").write_bytes(b"no newline at the end " * 1200)  # prepare adds one
    (root / "b.txt").write_bytes("caf\u00e9 and bytes \xff\n".encode() * 900)
    (root / "notes.md").write_bytes(b"not matched by the default glob\n")
    (root / "empty.txt").write_bytes(b"")
    files = [root / "a" / "one.txt", root / "a" / "two.txt", root / "b.txt", root / "empty.txt"]  # sorted
    return b"".join(f.read_bytes() + (b"\n" if f.read_bytes() and not f.read_bytes().endswith(b"\n") else b"")
                    for f in sorted(files))


@pytest.mark.parametrize("chunk", [4099, 1 << 20])  # chunks that straddle every cut, and one chunk per file
def test_prepare_carves_the_concatenation_at_the_stated_offsets_and_loads_it_mapped(tmp_path, monkeypatch, chunk):
    monkeypatch.setattr(data, "CHUNK", chunk)
    whole = _corpus(tmp_path / "src")
    m = prepare(tmp_path / "src", tmp_path / "out", valid_frac=0.1, test_frac=0.05)
    n = len(whole)
    cuts = int(n * 0.85), int(n * 0.95)
    want = {"train": whole[:cuts[0]], "valid": whole[cuts[0]:cuts[1]], "test": whole[cuts[1]:]}
    for sp, b in want.items():
        assert (tmp_path / "out" / f"{sp}.bin").read_bytes() == b
        assert m["splits"][sp] == {"file": f"{sp}.bin", "bytes": len(b), "sha256": hashlib.sha256(b).hexdigest()}
        t = load_split(sp, tmp_path / "out")
        assert t.dtype == torch.uint8 and bytes(t.numpy()) == b
    assert m["files"] == 4 and json.loads((tmp_path / "out" / "manifest.json").read_text()) == m
    again = prepare(tmp_path / "src", tmp_path / "src" / "again", valid_frac=0.1, test_frac=0.05, pattern="**/*")
    assert again["digest"] != m["digest"]  # notes.md is in, with **/*; the first run's output is not:
    again2 = prepare(tmp_path / "src", tmp_path / "src" / "again", valid_frac=0.1, test_frac=0.05, pattern="**/*")
    assert again2["digest"] == again["digest"]  # a pure function of the sources and the fractions
    x, y = ByteBatches(load_split("train", tmp_path / "out"), 4, 16, seed=3).batch(5)
    assert x.shape == (4, 16) and torch.equal(x[:, 1:], y[:, :-1])


def test_a_wikitext_folder_keeps_its_own_splits(tmp_path):
    src = tmp_path / "wt"
    src.mkdir()
    for sp in ("train", "valid", "test"):
        (src / f"wiki.{sp}.tokens").write_bytes(f" = {sp} = \n".encode() * 200)
    m = prepare(src, tmp_path / "out")
    assert m["valid_frac"] is None and "as they are" in m["carve"]
    for sp in ("train", "valid", "test"):
        assert bytes(load_split(sp, tmp_path / "out").numpy()) == (src / f"wiki.{sp}.tokens").read_bytes()


def test_bad_corpora_are_refused_with_what_to_do(tmp_path):
    whole = _corpus(tmp_path / "src")
    prepare(tmp_path / "src", tmp_path / "out", valid_frac=0.05, test_frac=0.05)
    assert prepared(tmp_path / "out")["splits"]["train"]["bytes"] == int(len(whole) * 0.9)
    with pytest.raises(DataError, match="fewer than 1025 bytes"):  # nothing to evaluate on
        prepare(tmp_path / "src", tmp_path / "tiny", valid_frac=0.001, test_frac=0.05)
    assert not (tmp_path / "tiny" / "manifest.json").exists()
    with pytest.raises(DataError, match="valid-frac"):
        prepare(tmp_path / "src", tmp_path / "x", valid_frac=0.0)
    with open(tmp_path / "out" / "train.bin", "r+b") as f:  # truncated after it was prepared
        f.truncate(100)
    with pytest.raises(DataError, match="manifest says .* prepare again"):
        load_split("train", tmp_path / "out")
    with pytest.raises(DataError, match="bt-data prepare .* --out DIR"):
        load_split("train", tmp_path / "src" / "b.txt")  # a text file is prepared first
    with pytest.raises(DataError, match="bt-data prepare"):
        load_split("train", tmp_path / "src")
    with pytest.raises(DataError, match="valid-frac"):
        prepare(tmp_path / "src", tmp_path / "x", valid_frac=0.7)
    with pytest.raises(DataError, match="no file matching"):
        prepare(tmp_path / "src", tmp_path / "x", pattern="*.nothing")
    (tmp_path / "out" / "manifest.json").write_text("{\"format\": \"something else\"}")
    with pytest.raises(DataError, match="not a manifest"):
        load_split("train", tmp_path / "out")


def test_bt_data_prepare_and_info(tmp_path):
    _corpus(tmp_path / "src")
    r = CliRunner().invoke(bt_data, ["prepare", str(tmp_path / "src"), "--out", str(tmp_path / "out"),
                                     "--valid-frac", "0.02", "--test-frac", "0.02"])
    assert r.exit_code == 0, r.output
    digest = prepared(tmp_path / "out")["digest"]
    assert f"digest {digest}" in r.output and "train" in r.output
    r = CliRunner().invoke(bt_data, ["info", str(tmp_path / "out")])
    assert r.exit_code == 0 and json.loads(r.stdout)["digest"] == digest and "sha256 match" in r.output
    valid = tmp_path / "out" / "valid.bin"  # one byte changed, the size kept: only the sha256 tells
    data = bytearray(valid.read_bytes())
    data[len(data) // 2] ^= 1
    valid.write_bytes(bytes(data))
    r = CliRunner().invoke(bt_data, ["info", str(tmp_path / "out")])
    assert r.exit_code == 2 and "valid.bin: sha256" in r.output and "damaged" in r.output
    r = CliRunner().invoke(bt_data, ["info", "--quick", str(tmp_path / "out")])
    assert r.exit_code == 0 and "sizes match" in r.output
    r = CliRunner().invoke(bt_data, ["prepare", str(tmp_path / "src"), "--out", str(tmp_path / "o2"),
                                     "--glob", "*.nothing"])
    assert r.exit_code == 2 and "no file matching" in r.output


def test_a_corpus_larger_than_memory_is_mapped_not_reserved(tmp_path):
    """A split is mapped with nothing reserved: a 64 GiB (sparse) train split loads and gives batches
    on a machine with less memory than that (torch.from_file's mapping reserved it all and failed
    past the machine's memory); a write stays in the process, the file is untouched."""
    _corpus(tmp_path / "src")
    prepare(tmp_path / "src", tmp_path / "out", valid_frac=0.05, test_frac=0.05)
    big = 64 << 30
    with open(tmp_path / "out" / "train.bin", "r+b") as f:
        f.truncate(big)  # sparse: no disk, no memory
    if (tmp_path / "out" / "train.bin").stat().st_blocks * 512 > 64 << 20:
        pytest.skip("this filesystem does not keep the file sparse")
    m = json.loads((tmp_path / "out" / "manifest.json").read_text())
    m["splits"]["train"]["bytes"] = big
    (tmp_path / "out" / "manifest.json").write_text(json.dumps(m))
    t = load_split("train", tmp_path / "out")
    assert t.numel() == big
    x, _ = ByteBatches(t, 4, 16, seed=1).batch(0)
    assert x.shape == (4, 16)
    first = int(t[0])
    t[0] = first ^ 0xFF
    with open(tmp_path / "out" / "train.bin", "rb") as f:
        assert f.read(1)[0] == first  # nothing is ever written to a user's corpus
