"""``bt-bench shape``: the serving modes at a logical model shape, projected from a measured run.

A projection, not a run: no model of that shape is computed here. The paper serves "up to a
75.80B-parameter logical fp16 shape" over three public-network GPU hosts; its abstract gives the
parameter count and nothing else (hidden size and layer count are not in it, nor in this
repository), so the hidden width is an input, 8192 by default and labelled assumed.

What each figure comes from (every input is named in the result):

- **Measured** (a ``bt-bench wan --json`` file, on the project's own model): per mode, the
  traversals and positions of one output, and the bytes it moved at the model's width ``d``.
  Exact mode's traversals are what its drafts earned on that model (greedy or sampled), so the
  projection assumes a model of the logical shape accepts drafts as well as the measured one.
- **Bytes at the shape**: the measured bytes plus, on each of the ``hops - 1`` links between hops,
  the hidden states' growth from ``d`` to ``H`` (2 bytes a value, fp16 or bf16 as measured): the
  specs, logits (a byte vocabulary: 256 per row) and framing are as measured.
- **Links**: ``traversals x (hops + 1)`` one-way delays, and every byte serialized at the rate
  (the bound of ``bt-bench wan``, which measured runs come within 1.25x of).
- **Compute**: stated rates, not measured. Each traversal passes every hop once, in turn; a
  hop's pass over ``p`` positions takes at least max(its weights / memory bandwidth, ``p`` x 2 x
  its parameters / FLOP rate) at the device's peak (a lower bound: real kernels reach less),
  evaluated at the mode's mean positions per traversal. Not counted: the KV cache's reads (under
  1% of the weights' at these lengths), the draft model's compute, and queueing between hops.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

PAPER_PARAMS = 75.80e9  # "up to a 75.80B-parameter logical fp16 shape" (arXiv 2606.24722, abstract)
MODES = ("exact", "autoregressive", "blocktrain")


@dataclass(frozen=True)
class Shape:
    params: float = PAPER_PARAMS
    hidden: int = 8192
    hops: int = 3
    value_bytes: int = 2  # fp16 weights and hidden states

    def __post_init__(self):
        if not (self.params > 0 and self.hidden > 0 and self.hops >= 1):
            raise ValueError(f"bad shape {self}: parameters and hidden size must be > 0, hops >= 1")

    @property
    def hop_params(self) -> float:
        return self.params / self.hops


@dataclass(frozen=True)
class Device:
    name: str = "H200 SXM"
    memory_bytes_per_s: float = 4.8e12  # HBM3e, spec sheet
    flops: float = 989e12  # dense fp16/bf16 tensor-core peak, spec sheet
    memory_bytes: float = 141e9

    def pass_terms(self, params: float, positions: float, value_bytes: int) -> tuple[float, float]:
        """One pass of ``positions`` positions through ``params`` parameters: (reading the weights,
        the FLOPs), each at peak; the pass takes at least the longer."""
        return params * value_bytes / self.memory_bytes_per_s, positions * 2 * params / self.flops

    def pass_s(self, params: float, positions: float, value_bytes: int) -> float:
        """The least time one pass of ``positions`` positions through ``params`` parameters can take."""
        return max(self.pass_terms(params, positions, value_bytes))


def project_mode(m: dict, d_model: int, shape: Shape, device: Device, rtt_ms: float, rate_mbit: float) -> dict:
    """One mode's output at ``shape`` from its measured figures ``m`` (a ``bt-bench wan`` mode)."""
    trav, pos = float(m["traversals"]), float(m["positions"])
    hidden_growth = pos * (shape.hops - 1) * shape.value_bytes * (shape.hidden - d_model)  # the same links, wider
    moved = float(m["bytes_moved"]) + hidden_growth
    latency = trav * (shape.hops + 1) * rtt_ms / 2 / 1e3
    serialization = moved * 8 / (rate_mbit * 1e6) if rate_mbit else 0.0
    memory, flops = device.pass_terms(shape.hop_params, pos / trav, shape.value_bytes)
    per_pass = max(memory, flops)
    compute = trav * shape.hops * per_pass
    return {"traversals": trav, "positions": pos, "positions_per_traversal": pos / trav,
            "bytes_moved": moved, "latency_s": latency, "serialization_s": serialization,
            "compute_s": compute, "hop_pass_s": per_pass, "hop_pass_bound_by": "memory" if memory >= flops else "compute",
            "seconds": latency + serialization + compute}


def project(measured: dict, shape: Shape = Shape(), device: Device = Device(), rtt_ms: float | None = None,
            rate_mbit: float | None = None, source: str = "") -> dict:
    """Every mode of ``measured`` (a ``bt-bench wan`` result with positions) at ``shape``; the
    links default to the measured run's."""
    if measured.get("benchmark") != "wan":
        raise ValueError("expected a `bt-bench wan --json` result (its 'benchmark' is 'wan')")
    modes = [m for m in MODES if m in measured]
    missing = [m for m in modes if "positions" not in measured[m]]
    if missing or not modes:
        raise ValueError(f"{source or 'the measured run'} records no positions for {', '.join(missing) or 'any mode'}: "
                         "it predates them; run `bt-bench wan --json F` again")
    if shape.hop_params * shape.value_bytes > device.memory_bytes:
        raise ValueError(f"a hop's {shape.hop_params / 1e9:.1f}B parameters do not fit the {device.name}'s "
                         f"{device.memory_bytes / 1e9:.0f} GB: measure and project a chain of more hops")
    if measured.get("hops") != shape.hops:
        raise ValueError(f"{source or 'the measured run'} ran over {measured.get('hops')} hops, not {shape.hops}: "
                         "its traversals' hidden-state links are what the projection widens; measure a chain of "
                         f"{shape.hops} (a model of {shape.hops} blocks)")
    d = int(measured["model"]["d_model"])
    rtt = measured["rtt_ms"] if rtt_ms is None else rtt_ms
    rate = measured["rate_mbit"] if rate_mbit is None else rate_mbit
    out: dict = {
        "benchmark": "shape",
        "kind": "projection: no model of this shape was run; link time from the measured run's traversals "
                "and bytes, compute from the device's stated peak rates (a lower bound)",
        "shape": {**asdict(shape), "hop_params": shape.hop_params,
                  "params_source": "the paper's abstract (75.80B logical fp16 shape)" if shape.params == PAPER_PARAMS
                  else "given", "hidden_source": "assumed (the abstract gives no hidden size)"},
        "device": {**asdict(device), "source": "spec sheet peak rates, not measured"},
        "links": {"rtt_ms": rtt, "rate_mbit": rate, "hops": shape.hops},
        "measured": {"file": source, "d_model": d, "hops": measured.get("hops"), "n_bytes": measured.get("n_bytes"),
                     "prompts": measured.get("prompts"), "split": measured.get("split"),
                     "temperature": measured.get("temperature"), "code_version": measured.get("code_version"),
                     "command": measured.get("command"),
                     "vs_bound": {m: measured[m].get("vs_bound") for m in modes}},
        "not_counted": "KV cache reads, the draft model's compute, queueing between hops",
    }
    for m in modes:
        out[m] = project_mode(measured[m], d, shape, device, rtt, rate)
    if "exact" in out and "autoregressive" in out:
        out["speedup_exact_vs_autoregressive"] = out["autoregressive"]["seconds"] / out["exact"]["seconds"]
    if "blocktrain" in out and "autoregressive" in out:
        out["speedup_blocktrain_vs_autoregressive"] = (out["autoregressive"]["seconds"]
                                                       / out["blocktrain"]["seconds"])
    return out


def load_measured(path: str | Path) -> dict:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: cannot read a `bt-bench wan` result: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: not a `bt-bench wan` result")
    return data


def report(result: dict) -> list[str]:
    """``bt-bench shape``'s report of ``project``'s result: what was projected from what, a line
    per mode and the speedups."""
    sh, ln = result["shape"], result["links"]
    lines = [f"PROJECTION (no model of this shape was run): {sh['params'] / 1e9:.2f}B parameters, hidden "
             f"{sh['hidden']} (assumed), {sh['hops']} hops of {sh['hop_params'] / 1e9:.2f}B on "
             f"{result['device']['name']} peak rates; links {ln['rtt_ms']:g} ms RTT, {ln['rate_mbit']:g} Mbit/s; "
             f"from {result['measured']['file']} (d {result['measured']['d_model']}, "
             f"T {result['measured']['temperature']})"]
    for m in (m for m in ("exact", "autoregressive", "blocktrain") if m in result):
        r = result[m]
        lines.append(f"{m + ':':<16}{r['seconds']:8.2f} s = links {r['latency_s']:.2f} s + serialization "
                     f"{r['serialization_s']:.2f} s + compute {r['compute_s']:.2f} s ({r['hop_pass_bound_by']}-bound); "
                     f"{r['traversals']:.1f} traversals, {r['bytes_moved'] / 1e6:.1f} MB")
    for k, what in (("speedup_exact_vs_autoregressive", "exact vs autoregressive"),
                    ("speedup_blocktrain_vs_autoregressive", "blocktrain vs autoregressive (not the same output)")):
        if k in result:
            lines.append(f"{what}: {result[k]:.1f}x")
    return lines
