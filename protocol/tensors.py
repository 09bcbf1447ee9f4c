"""Tensor payloads on the wire: named tensors, each cut into segments, lz4 where it pays.

Rules:
- Rule 1: a tensor is described in the message metadata (name, dtype, shape, codec, segment
  size, stored segment lengths, lz4 flags, int8 scales); its bytes follow raw in the body,
  never re-encoded by msgpack.
- Rule 2: the codec says how elements are stored: ``raw`` (the dtype's own bytes, little-endian),
  ``fp16``, ``bf16`` (2 bytes per element, from a float dtype), ``int8`` (1 byte per element,
  value = q * scale, one scale per segment, a msgpack float 64 in ``k``). The numeric conversion
  lives in the torch adapter (``blocktrain.p2p.tensors``); this layer moves and checks bytes.
- Rule 3: a segment holds ``SEGMENT_ELEMS`` elements (the last one fewer). Each segment is
  lz4-block-compressed only when that makes it smaller; ``compress="auto"`` first tries a sample.
- Rule 4: decoding checks every length against what dtype, shape and codec imply before it
  allocates or decompresses; any mismatch is a RemoteProtocolError(BAD_TENSOR).
- Rule 5: a description that is not a map of the known keys with their msgpack types (``n``,
  ``d``, ``c`` str; ``g`` int; ``s``, ``L`` arrays of int; ``z`` array of bool; ``k`` array of
  float) is MALFORMED_METADATA; well-typed values that are out of range or inconsistent with
  each other or with the body are BAD_TENSOR.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

import lz4.block

from .errors import ErrorCode, LocalProtocolError

DTYPE_BYTES = {
    "float32": 4, "float16": 2, "bfloat16": 2, "float64": 8,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1,
}
FLOAT_DTYPES = {"float32", "float16", "bfloat16", "float64"}


class Codec(str, Enum):
    RAW = "raw"
    FP16 = "fp16"
    BF16 = "bf16"
    INT8 = "int8"

    @property
    def lossy(self) -> bool:
        return self is not Codec.RAW


CODEC_BYTES = {Codec.FP16: 2, Codec.BF16: 2, Codec.INT8: 1}
# 2**20 elements: 4 MiB of fp32 per segment, the unit of lz4 and of an int8 scale.
SEGMENT_ELEMS = 1 << 20
# Elements of one tensor a peer may announce; bounds allocation before any byte is checked.
MAX_TENSOR_ELEMS = 1 << 31
# Bytes of a segment sampled by compress="auto" before compressing the whole segment.
LZ4_SAMPLE_BYTES = 64 * 1024
# A sample must shrink to this fraction for the whole segment to be tried (fp32 noise: ~1.0).
LZ4_SAMPLE_RATIO = 0.9


def stored_width(dtype: str, codec: Codec) -> int:
    return DTYPE_BYTES[dtype] if codec is Codec.RAW else CODEC_BYTES[codec]


@dataclass(frozen=True)
class WireTensor:
    """One tensor as it travels: description plus stored segment buffers.

    ``segments`` holds one buffer per segment (lz4-compressed where ``lz4[i]``); ``scales``
    holds one float per segment for the int8 codec, else is empty.
    """

    name: str
    dtype: str
    shape: tuple
    codec: Codec = Codec.RAW
    segments: tuple = ()
    lz4: tuple = ()
    scales: tuple = ()
    segment_elems: int = SEGMENT_ELEMS

    def __post_init__(self):
        object.__setattr__(self, "codec", Codec(self.codec))
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))
        check_description(self.name, self.dtype, self.shape, self.codec, self.segment_elems)
        n = num_segments(self.numel, self.segment_elems)
        if len(self.segments) != n or len(self.lz4) != n:
            raise LocalProtocolError(f"tensor {self.name!r}: {len(self.segments)} segments / {len(self.lz4)} "
                                     f"flags, expected {n}", ErrorCode.BAD_TENSOR)
        if (self.codec is Codec.INT8) != bool(self.scales) and n:
            raise LocalProtocolError(f"tensor {self.name!r}: int8 needs one scale per segment, others none",
                                     ErrorCode.BAD_TENSOR)
        if self.codec is Codec.INT8 and len(self.scales) != n:
            raise LocalProtocolError(f"tensor {self.name!r}: {len(self.scales)} scales for {n} segments",
                                     ErrorCode.BAD_TENSOR)
        if any(not math.isfinite(s) for s in self.scales):
            raise LocalProtocolError(f"tensor {self.name!r}: non-finite int8 scale", ErrorCode.BAD_TENSOR)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def width(self) -> int:
        return stored_width(self.dtype, self.codec)

    @property
    def stored_bytes(self) -> int:
        return sum(len(s) for s in self.segments)

    @property
    def raw_bytes(self) -> int:
        return self.numel * self.width

    def segment_raw_len(self, i: int) -> int:
        n = self.numel
        return (min(n, (i + 1) * self.segment_elems) - i * self.segment_elems) * self.width

    def decoded(self, out=None) -> memoryview:
        """The codec-encoded bytes (lz4 undone), into ``out`` (a writable buffer) if given."""
        total = self.raw_bytes
        if out is None:
            if len(self.segments) == 1 and not self.lz4[0]:
                return memoryview(self.segments[0])  # zero-copy
            out = bytearray(total)
        mv = memoryview(out).cast("B")
        if len(mv) != total:
            raise LocalProtocolError(f"tensor {self.name!r}: output buffer holds {len(mv)} bytes, needs {total}",
                                     ErrorCode.BAD_TENSOR)
        pos = 0
        for i, seg in enumerate(self.segments):
            raw_len = self.segment_raw_len(i)
            if self.lz4[i]:
                try:
                    data = lz4.block.decompress(seg, uncompressed_size=raw_len)
                except lz4.block.LZ4BlockError as e:
                    raise LocalProtocolError(f"tensor {self.name!r} segment {i}: bad lz4 data: {e}",
                                             ErrorCode.BAD_TENSOR) from None
                if len(data) != raw_len:
                    raise LocalProtocolError(f"tensor {self.name!r} segment {i}: lz4 gave {len(data)} bytes, "
                                             f"expected {raw_len}", ErrorCode.BAD_TENSOR)
                mv[pos:pos + raw_len] = data
            else:
                mv[pos:pos + raw_len] = seg
            pos += raw_len
        return mv


def num_segments(numel: int, segment_elems: int) -> int:
    return -(-numel // segment_elems)


def check_description(name, dtype, shape, codec, segment_elems) -> None:
    if not isinstance(name, str) or not name or len(name) > 256:
        raise LocalProtocolError(f"tensor name must be a non-empty string of <= 256 chars, got {name!r}",
                                 ErrorCode.BAD_TENSOR)
    if dtype not in DTYPE_BYTES:
        raise LocalProtocolError(f"tensor {name!r}: unknown dtype {dtype!r}", ErrorCode.BAD_TENSOR)
    if len(shape) > 8 or any(s < 0 for s in shape):
        raise LocalProtocolError(f"tensor {name!r}: bad shape {shape}", ErrorCode.BAD_TENSOR)
    if math.prod(shape) > MAX_TENSOR_ELEMS:
        raise LocalProtocolError(f"tensor {name!r}: {math.prod(shape)} elements > {MAX_TENSOR_ELEMS}",
                                 ErrorCode.BAD_TENSOR)
    if codec is not Codec.RAW and dtype not in FLOAT_DTYPES:
        raise LocalProtocolError(f"tensor {name!r}: codec {codec.value} needs a float dtype, not {dtype}",
                                 ErrorCode.BAD_TENSOR)
    if not isinstance(segment_elems, int) or not 1 <= segment_elems <= SEGMENT_ELEMS * 16:
        raise LocalProtocolError(f"tensor {name!r}: bad segment size {segment_elems}", ErrorCode.BAD_TENSOR)


def maybe_lz4(seg: memoryview, compress: str):
    if compress == "never" or len(seg) < 64:
        return seg, False
    if compress == "auto" and len(seg) > LZ4_SAMPLE_BYTES:
        sample = lz4.block.compress(seg[:LZ4_SAMPLE_BYTES], store_size=False)
        if len(sample) > LZ4_SAMPLE_RATIO * LZ4_SAMPLE_BYTES:
            return seg, False
    c = lz4.block.compress(seg, store_size=False)
    if len(c) < len(seg):
        return c, True
    return seg, False


def pack_tensor(name: str, dtype: str, shape, data, codec: Codec | str = Codec.RAW, scales=(),
                compress: str = "auto", segment_elems: int = SEGMENT_ELEMS) -> WireTensor:
    """Cut codec-encoded bytes ``data`` into segments (zero-copy views), lz4 where it pays.

    ``compress``: "auto" (sample first), "always" (try every segment), "never".
    """
    if compress not in ("auto", "always", "never"):
        raise LocalProtocolError(f"compress must be auto|always|never, got {compress!r}")
    codec = Codec(codec)
    shape = tuple(int(s) for s in shape)
    check_description(name, dtype, shape, codec, segment_elems)
    mv = memoryview(data).cast("B")
    width = stored_width(dtype, codec)
    numel = math.prod(shape)
    if len(mv) != numel * width:
        raise LocalProtocolError(f"tensor {name!r}: {len(mv)} bytes for {numel} x {width}-byte elements",
                                 ErrorCode.BAD_TENSOR)
    segs, flags = [], []
    step = segment_elems * width
    for off in range(0, len(mv), step):
        s, z = maybe_lz4(mv[off:off + step], compress)
        segs.append(s)
        flags.append(z)
    return WireTensor(name, dtype, shape, codec, tuple(segs), tuple(flags), tuple(float(x) for x in scales),
                      segment_elems)


def describe(t: WireTensor) -> dict:
    """The metadata map of one tensor (msgpack-ready)."""
    d = {"n": t.name, "d": t.dtype, "s": list(t.shape), "c": t.codec.value, "g": t.segment_elems,
         "L": [len(s) for s in t.segments], "z": [bool(z) for z in t.lz4]}
    if t.scales:
        d["k"] = list(t.scales)
    return d


_DESC_KEYS = {"n", "d", "s", "c", "g", "L", "z", "k"}
_REQUIRED_KEYS = _DESC_KEYS - {"k"}


def _ints(v) -> bool:
    return type(v) is list and all(type(x) is int for x in v)  # type() is: a bool is not an int here


def from_description(d, body: memoryview, pos: int) -> tuple[WireTensor, int]:
    """Rebuild a WireTensor from its metadata and the body; returns it and the next body offset."""
    if not (type(d) is dict and _REQUIRED_KEYS <= d.keys() and not d.keys() - _DESC_KEYS
            and type(d["n"]) is str and type(d["d"]) is str and type(d["c"]) is str and type(d["g"]) is int
            and _ints(d["s"]) and _ints(d["L"]) and type(d["z"]) is list and all(type(z) is bool for z in d["z"])
            and (type(d.get("k", [])) is list and all(type(x) is float for x in d.get("k", [])))):
        raise LocalProtocolError(f"malformed tensor description {d!r:.200}", ErrorCode.MALFORMED_METADATA)
    try:
        codec = Codec(d["c"])
    except ValueError:
        raise LocalProtocolError(f"unknown tensor codec {d['c']!r}", ErrorCode.BAD_TENSOR) from None
    shape, lens, zs = d["s"], d["L"], d["z"]
    if any(x < 0 for x in lens):
        raise LocalProtocolError(f"tensor {d['n']!r}: negative segment length", ErrorCode.BAD_TENSOR)
    check_description(d["n"], d["d"], tuple(shape), codec, d["g"])
    width = stored_width(d["d"], codec)
    numel = math.prod(shape)
    n = num_segments(numel, d["g"])
    if len(lens) != n or len(zs) != n:
        raise LocalProtocolError(f"tensor {d['n']!r}: {len(lens)} segment lengths for {n} segments",
                                 ErrorCode.BAD_TENSOR)
    if ("k" in d) != (codec is Codec.INT8 and n > 0):  # one encoding per tensor: no empty or stray ``k``
        raise LocalProtocolError(f"tensor {d['n']!r}: 'k' must be present exactly for an int8 tensor with elements",
                                 ErrorCode.BAD_TENSOR)
    segs = []
    for i, (ln, z) in enumerate(zip(lens, zs)):
        raw_len = (min(numel, (i + 1) * d["g"]) - i * d["g"]) * width
        if (not z and ln != raw_len) or (z and not 0 < ln < raw_len):
            raise LocalProtocolError(f"tensor {d['n']!r} segment {i}: stored {ln} bytes, raw {raw_len} "
                                     f"({'lz4' if z else 'uncompressed'})", ErrorCode.BAD_TENSOR)
        if pos + ln > len(body):
            raise LocalProtocolError(f"tensor {d['n']!r}: body ends before segment {i}", ErrorCode.BAD_TENSOR)
        segs.append(body[pos:pos + ln])
        pos += ln
    scales = d.get("k", [])
    return WireTensor(d["n"], d["d"], tuple(shape), codec, tuple(segs), tuple(zs), tuple(scales), d["g"]), pos
