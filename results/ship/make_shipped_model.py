"""Make the small trained model the package ships (blocks/data/model/) from a bt-train run.

    mkdir -p runs/ship && git rev-parse HEAD > runs/ship/COMMIT  # the code it trains with
    .venv/bin/bt-train --steps 3000 --schedule sequential --device cuda --set model.d_model=192 \
        --set model.n_head=6 --set train.batch_size=64 --set train.position_shift=true \
        --set test_windows=0 --out runs/ship
    .venv/bin/python results/ship/make_shipped_model.py runs/ship

The shipped model of 12-04 was trained so on one H200 (bf16 autocast, 270 s with its reference;
results/ship/train-results.json and train-curves.png are that run's own files); on 2 CPU cores
the same command takes about 16x longer.

The shipped model of 12-05 is that model fine-tuned on windows of 384 bytes on 2 CPU cores, so
that a session's context may pass 128 bytes (the 12-04 model's next-byte CE rose from 1.2 to 3.8
by position 384, and sampled output turned to noise once the context passed 128 bytes):

    mkdir -p runs/ship-long && git rev-parse HEAD > runs/ship-long/COMMIT
    .venv/bin/bt-train --init shipped --schedule sequential --steps 300 --set train.seq_len=384 \
        --set train.batch_size=24 --set train.lr=0.0005 --set test_windows=0 --device cpu --threads 2 \
        --out runs/ship-long
    .venv/bin/python results/ship/make_shipped_model.py runs/ship-long

(results/ship/finetune-384-results.json is that run's own results.json. It ran in a clone at
/tmp/ft, so model.json's command measures /tmp/ft/runs/ship-long, the --out of the bt-train before
it.) model.json records
where a fine-tuned model started (``started_from``: the commit whose blocks/data/model it was).

(The command recorded in model.json is the run's own, from its results.json; for a run that did not
record one, rebuilt from its settings.)

Stores each block in bfloat16 (half the bytes; loaded back as float32), then measures what is
shipped: the test CE of every head along the chain (the whole test split in 128-byte windows),
the exact-mode bytes per traversal on 200 validation prompts, greedy and sampled (temperature
0.8), and how many greedy continuations repeat a 16-gram; writes blocks/data/model/MODEL.md and
model.json beside the blocks.
"""
import hashlib
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

from blocktrain.bench.provenance import code_version
from blocktrain.bench.wan import repeats_16gram
from blocktrain.blocks import checkpoint as ckpt
from blocktrain.blocks import decode
from blocktrain.blocks.data import read_split
from blocktrain.blocks.evaluate import evaluate, load_chain

run = Path(sys.argv[1])
made_by = code_version()  # before this script rewrites the shipped files (which would make the tree dirty)
out = ckpt.SHIPPED_MODEL
out.mkdir(parents=True, exist_ok=True)
res = json.loads((run / "results.json").read_text())
assert res["blocktrain"]["draft_curve"] if "draft_curve" in res["blocktrain"] else True
for k, path in ckpt.block_files(run / "checkpoints").items():
    c = ckpt.load(path)
    tensors = {n: t.to(torch.bfloat16) if t.is_floating_point() else t for n, t in c.tensors.items()}
    extra = {**c.extra, "stored": "bfloat16", "from_run": str(run)}
    if c.block == len(ckpt.block_files(run / "checkpoints")) - 1 and "drafter_steps" not in extra:
        extra["drafter_steps"] = res["job"]["train"]["steps"] * res["job"]["train"].get("draft_frac", 0.6)
    ckpt.save(ckpt.Checkpoint(c.config, c.block, c.step, tensors, extra=extra), out / ckpt.block_file(k))

ev = evaluate(out, windows=0, seq_len=128)  # the whole test split in 128-byte windows (the serving targets' measure)
ev_train = evaluate(out, windows=1000, seq_len=res["job"]["train"]["seq_len"])  # ... and as it trained
blocks, _ = load_chain(out)
text = read_split("valid")  # the validation split's prompts (the drafting settings were chosen on them: not held out)


@torch.no_grad()
def ce_by_position(T: int = 512, rows: int = 48, band: int = 64) -> dict:
    """The chain's next-byte CE in ``rows`` validation windows of ``T`` bytes, per band of positions:
    where the context a session has outgrows the windows the model trained on."""
    data = torch.tensor(list(text[:rows * 8192]))
    xs = torch.stack([data[i:i + T + 1] for i in range(0, rows * 8192, 8192)])
    h, y = xs[:, :-1].long(), xs[:, 1:].long()
    for b in blocks:
        b.eval()
        h = b.trunk(h)
    ce = torch.nn.functional.cross_entropy(blocks[-1].logits(h).flatten(0, 1), y.flatten(), reduction="none")
    ce = ce.view(rows, T)
    return {f"{a}-{a + band - 1}": float(ce[:, a:a + band].mean()) for a in range(0, T, band)}


def drafting_by_prompt_length(lengths=(32, 64, 128, 192, 256), prompts: int = 8, n_out: int = 48) -> dict:
    """Exact greedy bytes per traversal for ``n_out`` bytes after prompts of each length."""
    gap = (len(text) - 512) // prompts
    return {str(L): sum(decode.generate(blocks, list(text[i * gap:i * gap + L]), n_out, draft_len=16,
                                        drafter=True)[1].bytes_per_traversal(n_out) for i in range(prompts)) / prompts
            for L in lengths}


by_position, by_prompt = ce_by_position(), drafting_by_prompt_length()
n, span = 200, 64 + 64
step = (len(text) - span) // n
t0 = time.perf_counter()
bpt, bpt_sampled, same, repeats = [], [], 0, 0


for i in range(n):
    prompt = list(text[i * step:i * step + 64])
    exact, st = decode.generate(blocks, prompt, 64, draft_len=16, drafter=True)
    bpt.append(st.bytes_per_traversal(64))
    repeats += repeats_16gram(bytes(exact))
    _, st_s = decode.generate(blocks, prompt, 64, draft_len=16, drafter=True,
                              sampling=decode.Sampling(temperature=0.8, seed=i))
    bpt_sampled.append(st_s.bytes_per_traversal(64))
    if i < 20:  # byte-identity on a subset (autoregressive costs 64 traversals each)
        ar, _ = decode.generate(blocks, prompt, 64)
        same += ar == exact


def off_text(b: bytes) -> float:
    """Share of bytes that are no printable ASCII, space or newline: WikiText is almost all such text."""
    return sum(not (32 <= c < 127 or c == 10) for c in b) / max(1, len(b))


long_n, long_out = 20, 256  # sampled sessions past the 128 bytes the first model trained on
long_off, long_bpt = [], []
for i in range(long_n):
    prompt = list(text[i * step:i * step + 64])
    out_s, st_l = decode.generate(blocks, prompt, long_out, draft_len=16, drafter=True,
                                  sampling=decode.Sampling(temperature=0.8, seed=1000 + i))
    long_off.append((off_text(bytes(out_s[:128])), off_text(bytes(out_s[128:]))))
    long_bpt.append(st_l.bytes_per_traversal(long_out))
test_off = off_text(bytes(read_split("test")[:200000]))  # what text itself holds of them
data_sha = {s: hashlib.sha256(read_split(s)).hexdigest() for s in ("train", "valid", "test")}
from blocktrain.blocks.model import ModelConfig  # noqa: E402
from blocktrain.blocks.train import TrainConfig  # noqa: E402

at = (run / "COMMIT").read_text().strip() if (run / "COMMIT").exists() else None  # the code it trained with
init = res["job"].get("init")  # a run that started from a model (bt-train --init): its lineage
if init is not None:
    prev = {}
    if init["name"] == "shipped" and at:  # the model shipped at the commit it trained with, from git
        shown = subprocess.run(["git", "show", f"{at}:blocks/data/model/model.json"], capture_output=True, text=True,
                               cwd=Path(__file__).parent)
        prev = json.loads(shown.stdout) if shown.returncode == 0 else {}
    init = {**init, "directory": init["name"], "files_at_commit": at if init["name"] == "shipped" else None,
            "its_command": prev.get("command"), "its_test_ce_heads": prev.get("test_ce_heads_shipped_bf16")}
sets = [] if init else [f"--set model.{k}={v}" for k, v in res["job"]["model"].items()
                        if ModelConfig().to_dict().get(k) != v]  # --init: the model settings are its own
sets += [f"--set train.{k}={v}" for k, v in res["job"]["train"].items()
         if k != "steps" and TrainConfig().to_dict().get(k) != v]
ref = res.get("reference") or {}
med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
device = res["job"].get("device", "cpu")
rebuilt = (f"bt-train {'--init ' + init['name'] + ' ' if init else ''}"
           f"--steps {res['job']['train']['steps']} {' '.join(sets)} --schedule {res['job']['schedule']} "
           f"--device {device.split(':')[0]} "
           f"{'' if ref else '--no-reference '}--set test_windows={res['job']['test_windows']} --out {run}; "
           f"python results/ship/make_shipped_model.py {run}")
meta = {"command": (f"{res['command']}; python results/ship/make_shipped_model.py {run}" if res.get("command")
                    else rebuilt),  # bt-train records its own command line; older runs' is rebuilt
        "trained_at_commit": at,
        "started_from": init,
        "made_by": made_by,
        "model": res["job"]["model"], "train": res["job"]["train"],
        "data": "embedded WikiText-2 (wiki.*.tokens), sha256 of the bytes: " + json.dumps(data_sha),
        "test_ce_heads_shipped_bf16": ev["head_ce"], "test_windows": "whole split, 128-byte windows",
        f"test_ce_heads_shipped_bf16_{ev_train['seq_len']}_byte_windows_1000": ev_train["head_ce"],
        "trained_on": f"{device} ({res['job'].get('precision', 'fp32')})",
        "test_ce_heads_at_training": res["blocktrain"]["test_ce_heads"],
        "reference_test_ce": ref.get("test_ce"),
        "prompts": f"{n} validation prompts of 64 bytes, 64 bytes each",
        "exact_greedy_bytes_per_traversal": {"mean": sum(bpt) / n, "median": med(bpt), "min": min(bpt), "max": max(bpt)},
        "exact_sampled_t0.8_bytes_per_traversal": {"mean": sum(bpt_sampled) / n, "median": med(bpt_sampled),
                                                   "min": min(bpt_sampled), "max": max(bpt_sampled)},
        "greedy_continuations_repeating_a_16gram": f"{repeats}/{n}",
        "exact_identical_to_autoregressive": f"{same}/20",
        "sampled_t0.8_256_bytes": {
            "prompts": f"{long_n} validation prompts of 64 bytes, one draft chain",
            "off_text_share_bytes_1_128": sum(a for a, _ in long_off) / long_n,
            "off_text_share_bytes_129_256": sum(b for _, b in long_off) / long_n,
            "bytes_per_traversal_mean": sum(long_bpt) / long_n,
            "note": f"off text: bytes that are no printable ASCII, space or newline (the test split: {test_off:.4f})"},
        "next_byte_ce_by_position_512_byte_valid_windows": by_position,
        "exact_greedy_bytes_per_traversal_by_prompt_length_48_bytes_out": by_prompt,
        "measure_seconds": time.perf_counter() - t0}
(out / "model.json").write_text(json.dumps(meta, indent=1))
if not init:
    started = ""
elif init["files_at_commit"]:
    started = (f", starting from the model shipped at that commit (`{init['its_command']}`; test CE per head "
               f"{' / '.join(f'{x:.4f}' for x in init['its_test_ce_heads'] or [])}; `git show "
               f"{init['files_at_commit']}:blocks/data/model/block0.safetensors` and so on)")
else:
    started = f", starting from the checkpoints in {init['name']} (sha256 in model.json)"
(out / "MODEL.md").write_text(f"""# The shipped model

A small BlockTrain model trained by the project's own `bt-train` on the embedded WikiText-2
bytes (CC BY-SA 3.0, see ../README.md), so that `bt-peer serve` and `bt-bench wan` work on a
fresh clone without training first. d {meta['model']['d_model']}, {meta['model']['n_layer']} layers in
{meta['model']['n_blocks']} blocks, a one-layer draft model on the last block; weights stored bfloat16.
Trained on {meta['trained_on']} at commit {meta['trained_at_commit']}{started}.

- Made by: `{meta['command']}`
- Test CE of each head along the chain (nats/byte, the whole test split in windows of 128 bytes,
  shipped weights): {' / '.join(f'{x:.4f}' for x in ev['head_ce'])}; {
  f"the end-to-end reference trained at the same settings (same objective, steps, batches): {ref['test_ce']:.4f}"
  if ref else "no end-to-end reference was trained with it"}.
- Exact mode, 64 bytes after each of {n} validation prompts of 64 bytes:
  - greedy: {meta['exact_greedy_bytes_per_traversal']['mean']:.2f} bytes per traversal (median
    {meta['exact_greedy_bytes_per_traversal']['median']:.2f}, min {meta['exact_greedy_bytes_per_traversal']['min']:.2f});
    output identical to autoregressive decoding on {same}/20 checked;
  - sampled at temperature 0.8: {meta['exact_sampled_t0.8_bytes_per_traversal']['mean']:.2f} bytes per
    traversal (median {meta['exact_sampled_t0.8_bytes_per_traversal']['median']:.2f}) with one draft chain; the client
    drafts wide when it samples (4 chains of 8): results/README.md, section 4;
  - {repeats} of {n} greedy continuations repeat a 16-gram.
- Sampled at temperature 0.8, 256 bytes after each of {long_n} validation prompts: the share of
  bytes that are no printable ASCII, space or newline is {meta['sampled_t0.8_256_bytes']['off_text_share_bytes_1_128']:.3f}
  in the first 128 and {meta['sampled_t0.8_256_bytes']['off_text_share_bytes_129_256']:.3f} in the next 128 (the test split's own: {test_off:.4f};
  a model past its context writes noise, which shows here first).
- Context: it trained on windows of {meta['train']['seq_len']} bytes, and past them it is worse. Its
  next-byte CE in 512-byte validation windows, by position:
  {', '.join(f'{k} {v:.2f}' for k, v in by_position.items())}. Exact greedy drafting, 48 bytes
  after prompts of 32 / 64 / 128 / 192 / 256 bytes (8 prompts each):
  {' / '.join(f'{v:.2f}' for v in by_prompt.values())} bytes per traversal. Keep prompt + output
  within about {meta['train']['seq_len']} bytes.
- Data: {meta['data']}

model.json holds the full configs and figures.
""")
print(json.dumps(meta, indent=1))
