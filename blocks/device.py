"""Where a worker computes (``--device``) and in what precision (``--precision``).

Rules:
- ``auto`` picks the best device present: ``cuda`` (device 0), then ``mps``, then ``cpu``. A named
  device that is absent is a ``DeviceError`` that says what is present; nothing falls back silently.
- Parameters, optimizer state and activations live on the device; everything that leaves the
  worker (checkpoints, the flat vectors a round averages, served hidden states) is a CPU tensor,
  so checkpoints and the wire are device-independent. What a round sends comes off a CUDA device
  into pinned host memory (``to_host(pinned=True)``); what comes back (an averaged vector) is one
  transfer from the round's result buffer.
- ``bf16`` runs the forward passes under ``torch.autocast`` in bfloat16 (parameters, gradients and
  optimizer state stay float32); ``auto`` is bf16 on a CUDA device that supports it, fp32 elsewhere
  (on a CPU bf16 autocast is supported but rarely faster).
- Nothing here requires a GPU: on a machine without one, ``auto`` is ``cpu``.
"""

from __future__ import annotations

import contextlib

import torch

DEVICES = ("auto", "cpu", "cuda", "cuda:N", "mps")
PRECISIONS = ("auto", "fp32", "bf16")


class DeviceError(ValueError):
    """A device or precision that this machine does not have, or a malformed name."""


def _mps() -> bool:
    return bool(getattr(torch.backends, "mps", None) and torch.backends.mps.is_available())


def pick_device(name: str | None = "auto") -> torch.device:
    """The torch device ``name`` names (``auto``, ``cpu``, ``cuda``, ``cuda:N``, ``mps``), checked
    to be present."""
    name = (name or "auto").strip().lower()
    if name == "auto":
        return torch.device("cuda:0" if torch.cuda.is_available() else "mps" if _mps() else "cpu")
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise DeviceError(f"device {name!r}: expected one of {', '.join(DEVICES)}") from None
    if dev.type == "cpu":
        return torch.device("cpu")
    if dev.type == "cuda":
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        index = 0 if dev.index is None else dev.index
        if index >= n:
            raise DeviceError(f"device {name!r}: this machine has {n or 'no'} CUDA device(s)"
                              + ("" if n else f" (torch {torch.__version__} built "
                                 f"{'with' if torch.version.cuda else 'without'} CUDA)") + "; try --device cpu")
        return torch.device("cuda", index)
    if dev.type == "mps":
        if not _mps():
            raise DeviceError(f"device {name!r}: MPS is not available on this machine; try --device cpu")
        return dev
    raise DeviceError(f"device {name!r}: expected one of {', '.join(DEVICES)}")


def pick_precision(precision: str | None, device: torch.device) -> str:
    """``fp32`` or ``bf16`` for ``device`` (``auto``: bf16 on a CUDA device that supports it)."""
    p = (precision or "auto").strip().lower()
    if p not in PRECISIONS:
        raise DeviceError(f"precision {precision!r}: expected one of {', '.join(PRECISIONS)}")
    if p == "auto":
        return "bf16" if device.type == "cuda" and torch.cuda.is_bf16_supported() else "fp32"
    if p == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise DeviceError(f"{device} does not support bfloat16; use --precision fp32")
    return p


def autocast(device: torch.device, precision: str):
    """The forward passes' context: bf16 autocast, or nothing (fp32)."""
    if precision == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


@contextlib.contextmanager
def threads(n: int):
    """Torch computes on ``n`` threads inside the block and on as many as before after it: a
    job or benchmark run in process does not leave its ``--threads`` to its caller."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def describe(device: torch.device, precision: str) -> str:
    """One line for logs and results: the device (its name where it has one) and the precision."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    return f"{device} ({name}), {precision}"


def to_host(t: torch.Tensor, pinned: bool = False) -> torch.Tensor:
    """``t`` as a CPU tensor (itself when it is one): what leaves a worker. ``pinned``, from a CUDA
    device: into page-locked host memory in one DMA transfer, with no staging copy through pageable
    memory, for what goes on the wire every round (the flat vectors a round averages, gradients).
    torch's caching host allocator keeps such buffers once freed and reuses them round after round:
    about as much page-locked memory as the vectors of one round, held while the worker runs."""
    if t.device.type == "cpu":
        return t
    if not pinned or t.device.type != "cuda":
        return t.to("cpu")
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    out.copy_(t, non_blocking=True)
    torch.cuda.current_stream(t.device).synchronize()  # the bytes are there before anyone reads them
    return out


def host_state(module: torch.nn.Module) -> dict:
    """``module``'s state dict as CPU tensors of its own (a copy, whatever the device)."""
    return {k: v.detach().to("cpu", copy=True) for k, v in module.state_dict().items()}
