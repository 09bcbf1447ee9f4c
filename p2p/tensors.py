"""Torch adapter for tensor payloads: torch.Tensor <-> protocol WireTensor, with codecs.

Rules:
- ``raw`` moves the tensor's own bytes (zero-copy on send: the segments are views of the
  tensor's memory, so the tensor must stay alive and unchanged until the bytes are written).
- ``fp16`` / ``bf16`` round to nearest; ``int8`` stores round(x / scale) in [-127, 127] with
  scale = max|x| / 127 per segment (absolute error <= scale / 2 per element).
- ``topk`` (a BLOCK_UPDATE codec, not a tensor's) keeps the k largest-magnitude values of each
  chunk of TOPK_CHUNK_ELEMS elements as three raw tensors (positions, int8 values, a scale per
  chunk); the decoder checks every index, value and scale before it writes anything.
- ``sign`` (a BLOCK_UPDATE codec too) keeps one bit per element, its sign, and one scale per chunk
  of TOPK_CHUNK_ELEMS elements (the mean |x| of the chunk): 1.01 bits per element; the decoder
  checks the shapes, the scales and the last chunk's padding before it writes anything.
- Decoding never unpickles: bytes become a tensor through ``torch.frombuffer``.
"""

from __future__ import annotations

import torch

from blocktrain.protocol import SIGN_BYTES, TOPK_CHUNK_ELEMS
from blocktrain.protocol.events import SIGN_TENSORS
from blocktrain.protocol.tensors import SEGMENT_ELEMS, Codec, WireTensor, pack_tensor

TORCH_DTYPES = {
    "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64,
    "int64": torch.int64, "int32": torch.int32, "int16": torch.int16, "int8": torch.int8,
    "uint8": torch.uint8, "bool": torch.bool,
}
DTYPE_NAMES = {v: k for k, v in TORCH_DTYPES.items()}


def _bytes_view(t: torch.Tensor) -> memoryview:
    t = t.contiguous()
    if t.numel() == 0:
        return memoryview(b"")
    return t.view(-1).view(torch.uint8).numpy().data  # the array's buffer (numpy's stubs type it only there)


def to_wire(name: str, t: torch.Tensor, codec: Codec | str = Codec.RAW, compress: str = "auto",
            segment_elems: int = SEGMENT_ELEMS) -> WireTensor:
    codec = Codec(codec)
    if t.dtype not in DTYPE_NAMES:
        raise TypeError(f"tensor {name!r}: unsupported dtype {t.dtype}")
    t = t.detach().cpu().contiguous()
    dtype = DTYPE_NAMES[t.dtype]
    scales: tuple[float, ...] = ()
    if codec is Codec.FP16:
        enc = t.to(torch.float16)
    elif codec is Codec.BF16:
        enc = t.to(torch.bfloat16)
    elif codec is Codec.INT8:
        flat = t.reshape(-1).float()
        qs, sc = [], []
        for i in range(0, flat.numel(), segment_elems):
            seg = flat[i:i + segment_elems]
            s = float(seg.abs().max()) / 127.0 if seg.numel() else 0.0
            if not torch.isfinite(torch.tensor(s)):
                raise ValueError(f"tensor {name!r}: non-finite values cannot be int8-encoded")
            s = s or 1.0
            qs.append(torch.round(seg / s).clamp_(-127, 127).to(torch.int8))
            sc.append(s)
        enc = torch.cat(qs) if qs else torch.empty(0, dtype=torch.int8)
        scales = tuple(sc)
    else:
        enc = t
    return pack_tensor(name, dtype, tuple(t.shape), _bytes_view(enc), codec, scales, compress, segment_elems)


ENCODED_DTYPES = {Codec.FP16: torch.float16, Codec.BF16: torch.bfloat16, Codec.INT8: torch.int8}


def encode_into(name: str, x: torch.Tensor, codec: Codec | str, enc: torch.Tensor,
                decoded: torch.Tensor | None = None, segment_elems: int = SEGMENT_ELEMS) -> WireTensor:
    """``to_wire`` of a 1-D float32 ``x`` under a lossy codec, its encoding written into ``enc``
    (x.numel() elements of the codec's type: float16, bfloat16 or int8) instead of new memory;
    ``decoded`` (float32, optional) receives what the far end decodes. The same bytes as
    ``to_wire(name, x, codec, "never", segment_elems)``."""
    codec = Codec(codec)
    if enc.dtype is not ENCODED_DTYPES[codec] or enc.numel() != x.numel():
        raise ValueError(f"enc is {enc.numel()} {enc.dtype}, expected {x.numel()} {ENCODED_DTYPES[codec]}")
    scales: tuple[float, ...] = ()
    if codec is Codec.INT8:
        sc = []
        for i in range(0, x.numel(), segment_elems):
            seg, q = x[i:i + segment_elems], enc[i:i + segment_elems]
            s = float(seg.abs().max()) / 127.0 if seg.numel() else 0.0
            if not torch.isfinite(torch.tensor(s)):
                raise ValueError(f"tensor {name!r}: non-finite values cannot be int8-encoded")
            s = s or 1.0
            q.copy_(torch.div(seg, s).round_().clamp_(-127, 127))  # one temporary of a segment
            if decoded is not None:
                torch.mul(q, s, out=decoded[i:i + segment_elems])
            sc.append(s)
        scales = tuple(sc)
    else:
        enc.copy_(x)  # rounds to nearest
        if decoded is not None:
            decoded.copy_(enc)
    return pack_tensor(name, "float32", tuple(x.shape), _bytes_view(enc), codec, scales, "never", segment_elems)


def from_wire(w: WireTensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Rebuild the tensor (into ``out`` when given: same shape and dtype)."""
    dtype = TORCH_DTYPES[w.dtype]
    if out is not None and (tuple(out.shape) != w.shape or out.dtype != dtype or not out.is_contiguous()):
        raise ValueError(f"tensor {w.name!r}: out is {tuple(out.shape)} {out.dtype}, wire is {w.shape} {w.dtype}")
    if w.numel == 0:
        return out if out is not None else torch.empty(w.shape, dtype=dtype)
    if w.codec is Codec.RAW:
        if out is not None:
            w.decoded(out=_bytes_view(out))
            return out
        buf = bytearray(w.decoded())  # own the memory: the frame buffer is not ours to keep
        return torch.frombuffer(buf, dtype=dtype).view(w.shape)
    if out is not None and w.dtype == "float32" and out.is_contiguous():  # lossy, straight into out
        data = w.decoded()
        # torch wants writable memory (it is not written)
        src = torch.frombuffer(bytearray(data) if data.readonly else data, dtype=ENCODED_DTYPES[w.codec])
        flat = out.view(-1)
        flat.copy_(src)
        if w.codec is Codec.INT8:
            for i, s in enumerate(w.scales):
                flat[i * w.segment_elems:(i + 1) * w.segment_elems].mul_(s)
        return out
    buf = bytearray(w.decoded())
    if w.codec is Codec.INT8:
        q = torch.frombuffer(buf, dtype=torch.int8).float()
        scale = torch.tensor(w.scales, dtype=torch.float32).repeat_interleave(w.segment_elems)[: q.numel()]
        val = q * scale
    else:
        val = torch.frombuffer(buf, dtype=torch.float16 if w.codec is Codec.FP16 else torch.bfloat16)
    val = val.view(w.shape).to(dtype)
    if out is not None:
        out.copy_(val)
        return out
    return val


# --- topk: a sparse update (PROTOCOL.md section 7.1) -----------------------------------------------

def topk_count(density: float, chunk: int = TOPK_CHUNK_ELEMS) -> int:
    """Values kept per chunk at ``density`` (at least one)."""
    return max(1, min(chunk, round(density * chunk)))


def encode_topk(x: torch.Tensor, k: int, decoded: torch.Tensor | None = None) -> tuple[WireTensor, ...]:
    """The ``k`` largest-magnitude values of each chunk of TOPK_CHUNK_ELEMS elements of the 1-D
    float32 ``x`` (the last chunk may be shorter), as the wire tensors (idx, val, scale): positions
    in the chunk, increasing (the last chunk is padded with zeros to the chunk size: positions in
    the padding carry 0); int8 values; one scale per chunk (max |kept| / 127). ``decoded``
    (float32, like x) receives what the far end decodes, so the sender keeps x - decoded as its
    error feedback."""
    n, C = x.numel(), -(-x.numel() // TOPK_CHUNK_ELEMS)
    if not bool(torch.isfinite(x).all()):
        raise ValueError("non-finite values cannot be topk-encoded")
    padded = torch.zeros(C * TOPK_CHUNK_ELEMS)
    padded[:n] = x.reshape(-1)
    rows = padded.view(C, TOPK_CHUNK_ELEMS)
    k = min(k, TOPK_CHUNK_ELEMS if C > 1 or n == 0 else n)
    idx = rows.abs().topk(k, dim=1, sorted=False).indices.sort(dim=1).values
    vals = rows.gather(1, idx)
    scale = vals.abs().amax(dim=1) / 127.0 if k else torch.zeros(C)
    q = torch.div(vals, scale.clamp_min(torch.finfo(torch.float32).tiny)[:, None]).round_().clamp_(-127, 127)
    q = q.to(torch.int8)
    if decoded is not None:
        _scatter(decoded, idx, q, scale)
    idx16 = idx.to(torch.int16)
    return (pack_tensor("idx", "int16", tuple(idx16.shape), _bytes_view(idx16), Codec.RAW, (), "never"),
            pack_tensor("val", "int8", tuple(q.shape), _bytes_view(q), Codec.RAW, (), "never"),
            pack_tensor("scale", "float32", tuple(scale.shape), _bytes_view(scale), Codec.RAW, (), "never"))


def _scatter(out: torch.Tensor, idx: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> None:
    n, C = out.numel(), idx.shape[0]
    full = torch.zeros(C * TOPK_CHUNK_ELEMS)
    full.view(C, TOPK_CHUNK_ELEMS).scatter_(1, idx.long(), q.float() * scale[:, None])
    out.view(-1).copy_(full[:n])


def decode_topk(wires, numel: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """The dense float32 vector of ``numel`` elements a topk update (idx, val, scale) stands for,
    every value checked before use: ValueError names what is wrong (shapes for this length, an
    index outside its chunk or not increasing, -128, a scale not finite or negative)."""
    if len(wires) != 3 or tuple((w.name, w.dtype) for w in wires) != (("idx", "int16"), ("val", "int8"),
                                                                       ("scale", "float32")):
        raise ValueError("a topk update holds the tensors idx (int16), val (int8), scale (float32)")
    C = -(-numel // TOPK_CHUNK_ELEMS)
    iw, vw, sw = wires
    if len(iw.shape) != 2 or iw.shape[0] != C or vw.shape != iw.shape or sw.shape != (C,):
        raise ValueError(f"topk shapes {iw.shape}/{vw.shape}/{sw.shape} do not fit {numel} elements "
                         f"({C} chunks of {TOPK_CHUNK_ELEMS})")
    idx, q, scale = from_wire(iw).long(), from_wire(vw), from_wire(sw)
    if idx.numel():
        last = numel - (C - 1) * TOPK_CHUNK_ELEMS  # the last chunk's length; it is padded with zeros
        if bool((idx < 0).any()) or bool((idx >= TOPK_CHUNK_ELEMS).any()) \
                or bool(((idx[-1] >= last) & (q[-1] != 0)).any()):
            raise ValueError("a topk index lies outside its chunk (or a value in the last chunk's padding)")
        if idx.shape[1] > 1 and not bool((idx[:, 1:] > idx[:, :-1]).all()):
            raise ValueError("topk indices must increase within a chunk")
        if bool((q == -128).any()):
            raise ValueError("a topk value is -128 (values are -127..127)")
    if not bool(torch.isfinite(scale).all()) or bool((scale < 0).any()):
        raise ValueError("a topk scale is not finite or is negative")
    out = torch.empty(numel) if out is None else out
    _scatter(out, idx, q, scale)
    return out


# --- sign: one bit and a scale per chunk (PROTOCOL.md section 7.1) -----------------------------------

_BIT_WEIGHTS = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)


def encode_sign(x: torch.Tensor, decoded: torch.Tensor | None = None) -> tuple[WireTensor, ...]:
    """The 1-D float32 ``x`` as the wire tensors (bits, scale) of a ``sign`` update: per chunk of
    TOPK_CHUNK_ELEMS elements, bit i (byte i // 8, bit i % 8 counted from the least significant) is
    1 where x >= 0 (-0.0 included), and the chunk's scale is the mean |x| over its elements (the
    last chunk's own, not its padding, whose bits are 0). An element decodes to +scale or -scale.
    ``decoded`` (float32, like x) receives what the far end decodes (the sender's error feedback
    is x - decoded)."""
    n, C = x.numel(), -(-x.numel() // TOPK_CHUNK_ELEMS)
    if not bool(torch.isfinite(x).all()):
        raise ValueError("non-finite values cannot be sign-encoded")
    flat = x.reshape(-1)
    pos = torch.zeros(C * TOPK_CHUNK_ELEMS, dtype=torch.uint8)
    pos[:n] = flat >= 0
    bits = (pos.view(C, SIGN_BYTES, 8) * _BIT_WEIGHTS).sum(dim=2, dtype=torch.uint8)
    sums = torch.zeros(C * TOPK_CHUNK_ELEMS)
    sums[:n] = flat.abs()
    counts = torch.full((C,), float(TOPK_CHUNK_ELEMS))
    if C:
        counts[-1] = n - (C - 1) * TOPK_CHUNK_ELEMS
    scale = sums.view(C, TOPK_CHUNK_ELEMS).sum(dim=1) / counts
    if decoded is not None:
        _unpack_sign(decoded, pos, scale)
    return (pack_tensor("bits", "uint8", tuple(bits.shape), _bytes_view(bits), Codec.RAW, (), "never"),
            pack_tensor("scale", "float32", tuple(scale.shape), _bytes_view(scale), Codec.RAW, (), "never"))


def _unpack_sign(out: torch.Tensor, pos: torch.Tensor, scale: torch.Tensor) -> None:
    """``out`` (numel n) = +scale where pos is 1, -scale where it is 0, chunk by chunk."""
    n, C = out.numel(), scale.numel()
    full = (pos.view(C, TOPK_CHUNK_ELEMS).float() * 2 - 1) * scale[:, None]
    out.view(-1).copy_(full.view(-1)[:n])


def decode_sign(wires, numel: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """The dense float32 vector of ``numel`` elements a sign update (bits, scale) stands for,
    every value checked before use: ValueError names what is wrong (shapes for this length, a bit
    set in the last chunk's padding, a scale not finite or negative)."""
    if tuple((w.name, w.dtype) for w in wires) != SIGN_TENSORS:
        raise ValueError(f"a sign update holds the tensors {SIGN_TENSORS}")
    C = -(-numel // TOPK_CHUNK_ELEMS)
    bw, sw = wires
    if bw.shape != (C, SIGN_BYTES) or sw.shape != (C,):
        raise ValueError(f"sign shapes {bw.shape}/{sw.shape} do not fit {numel} elements "
                         f"({C} chunks of {TOPK_CHUNK_ELEMS}: ({C}, {SIGN_BYTES}) and ({C},))")
    bits, scale = from_wire(bw), from_wire(sw)
    if not bool(torch.isfinite(scale).all()) or bool((scale < 0).any()):
        raise ValueError("a sign scale is not finite or is negative")
    pos = bits.view(C, SIGN_BYTES, 1).bitwise_and(_BIT_WEIGHTS).ne(0).to(torch.uint8).view(-1)
    if bool(pos[numel:].any()):
        raise ValueError("a sign bit is set in the last chunk's padding")
    out = torch.empty(numel) if out is None else out
    _unpack_sign(out, pos, scale)
    return out
