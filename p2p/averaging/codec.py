"""The codecs of a round's parts, and the memory a round reuses.

Rules (numbered as in the package's index, ``__init__.py``):
- Rule 7: lossy codecs (fp16, bf16, int8) keep the rounding error of what this peer sent and add
  it to the next round's input (error feedback). An owner decodes its own average exactly as the
  others do, so every member ends the round with the same bytes. topk (sparse) and sign (a bit and
  a chunk's scale per value) do the same with what the others decode of its part.
- Rule 8 (memory): a round encodes into a lossy codec's scratch (``lossy_scratch``) and decodes
  the other members' parts into an arena (``arena_views``), both lent by the driver and kept from
  round to round, so a round touches no fresh memory.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from blocktrain.protocol import Codec, WireTensor

from ..tensors import ENCODED_DTYPES, encode_into, encode_sign, encode_topk, to_wire

# The BLOCK_UPDATE codecs of a round: a tensor codec, or a compact one of several raw tensors:
# topk (sparse) or sign (one bit per value); both with error feedback (rule 7).
TOPK = "topk"
SIGN = "sign"
COMPACT = (TOPK, SIGN)
UPDATE_CODECS = tuple(c.value for c in Codec) + COMPACT

# A part's tensors as they travel: one dense tensor, or a compact codec's (topk: indices, values,
# scales; sign: bits, scales).
Wire = WireTensor | tuple[WireTensor, ...]


def lossy_scratch(n: int, codec: Codec | str) -> dict:
    """Buffers of a lossy round of n floats: x (vector + residual), enc (x encoded: what is sent;
    topk, sign: what the others decode), residual (what the encoding lost, fed into the next round)."""
    enc = torch.empty(n) if codec in COMPACT else torch.empty(n, dtype=ENCODED_DTYPES[Codec(codec)])
    return {"x": torch.empty(n), "enc": enc, "residual": torch.empty(n)}


@dataclass
class Encoded:
    """Our part of a round, encoded once: ``x`` (what is encoded: the vector, plus the last
    round's residual when lossy), ``wires`` (one per piece), ``residual`` (lossy: what the
    encoding lost, for the next round), ``sent`` (topk, sign: what the others decode of ``x``)."""
    x: torch.Tensor
    wires: list[Wire]
    residual: torch.Tensor | None = None
    sent: torch.Tensor | None = None


def encode_vector(vector: torch.Tensor, spans: list[tuple[int, int]], codec: str, k: int,
                  residual: torch.Tensor | None, scratch: dict | None) -> Encoded:
    """``vector`` (flat float32) encoded piece by piece (``spans``) under the round's update codec
    ``codec``; lossy ones with error feedback (rule 7), in ``scratch`` when it fits (else fresh
    buffers); ``residual``: the last round's, added first. ``k``: topk's values per chunk."""
    compact = codec in COMPACT
    if not compact and not Codec(codec).lossy:
        return Encoded(vector, [to_wire("part", vector[a:b], Codec(codec), "never") for a, b in spans])
    n = vector.numel()
    enc_dtype = torch.float32 if compact else ENCODED_DTYPES[Codec(codec)]
    if scratch is None or scratch["x"].numel() != n or scratch["enc"].dtype != enc_dtype:
        scratch = lossy_scratch(n, codec)
    x = scratch["x"]
    if residual is not None and residual.numel() == n:
        torch.add(vector, residual, out=x)  # before the residual's buffer is written again
    else:
        x.copy_(vector)
    if codec == Codec.INT8 and not bool(torch.isfinite(x).all()):  # before anything is written
        raise ValueError("non-finite values cannot be int8-encoded")
    res = scratch["residual"]  # first what the others decode, then what they miss of x
    sent = None
    wires: list[Wire]
    if compact:
        sent = scratch["enc"]  # what the others decode of our part
        wires = [encode_topk(x[a:b], k, sent[a:b]) if codec == TOPK else encode_sign(x[a:b], sent[a:b])
                 for a, b in spans]
        res.copy_(sent)
    else:
        wires = [encode_into("part", x[a:b], Codec(codec), scratch["enc"][a:b], res[a:b]) for a, b in spans]
    return Encoded(x, wires, torch.sub(x, res, out=res), sent)


def arena_views(arena: torch.Tensor | Callable[[int], torch.Tensor] | None, others: list[str],
                floats: int) -> dict[str, torch.Tensor] | None:
    """Each of ``others``' slot of ``floats`` in ``arena`` (float32; or a function that lends one
    of the size it is asked), in order; None when there is no arena that fits (fresh tensors then)."""
    if callable(arena):  # the driver lends one of the size asked
        arena = arena(len(others) * floats)
    if arena is not None and arena.dtype == torch.float32 and arena.numel() >= len(others) * floats:
        return {p: arena[i * floats:(i + 1) * floats] for i, p in enumerate(others)}
    return None
