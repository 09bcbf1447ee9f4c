"""The serving API: what a serving client and a serving hop both speak (PROTOCOL.md section 7.3).

Rules:
- This module is the one home of the request's vocabulary: the modes, the meta keys a hop reads
  and passes on, the hidden-state codecs, and the faults. The client (client.py) and the server
  (server.py) import it; it imports neither, and no socket or task lives here.
- A refusal travels as PipelineResult(meta {"error", "hop", "block", "fault"}); ``refusal_meta``
  writes it from a failure, ``PipelineError.from_meta`` reads it back. ``fault`` says whose the
  failure is (FAULTS): "hop" (retry through another holder), "request" (the request itself is
  bad: no chain would serve it), "session" (a hop lost the session's caches: rebuild them) or
  "busy" (the hop is sound but saturated: another holder, else the same hop after a pause).
- Failures are typed: ``PipelineError`` carries the block, hop and fault, never a string to parse.
"""

from __future__ import annotations

from blocktrain.protocol import Codec, PipelineResult

MODES = ("exact", "autoregressive", "blocktrain", "reference")
# Whose a failure is (meta "fault"); anything else a hop reports is read as "hop" (a client of r10
# reads "busy" so: it avoids the hop).
FAULTS = ("hop", "request", "session", "busy")
# Codecs of the hidden states between hops (PROTOCOL.md section 6), and the one a request without
# "codec" gets.
HIDDEN_CODECS = frozenset(c.value for c in Codec)
DEFAULT_CODEC = "bf16"
# The meta keys a hop reads and passes on (anything else a client sends is dropped).
FORWARDED = ("mode", "blocks", "reply_to", "session", "spec", "end", "codec", "compute_s", "client_addr")
# ``client_addr`` (r12): the address the client connects from as hops count shares (shares.py), set
# by hop 0, never taken from a client; a middle hop reads at most this many characters of it.
MAX_CLIENT_ADDR = 64
# Characters of a refusal's error text kept (a hop's exception text is not ours to bound).
MAX_ERROR_CHARS = 1000
# --verify (verify.py): two answers whose next-byte distributions are at most this far apart
# (total variation) agree: far above what two holders differ by on one machine (0 on 15 outputs of
# the shipped model since exact rows are batch invariant; up to 1.8e-4 before), far below a lie.
VERIFY_TOL = 0.02
# Traversals whose chunks one hop computes together, one batch (the rest wait their turn, fair by
# client: fair.py), on one compute thread (the model code holds the interpreter lock for much of a
# chunk: a second thread made the client served beside it about twice as slow, the flood no
# faster). The default of bt-peer serve --batch. One on CPU, where a batch costs about what its
# chunks cost one by one (most of a chunk's time is the exact attention over each session's own
# cache, which does not batch: results/serving/batch_cost.json). 8 clients at once got 4.6x one
# client's output rate at batch 8, 4.9x at 1, 5.3x at 4 (one run each, in that order, on the same
# hops: results/wan/wan-valid-64-clients8-batch.json; within this machine's noise), and a client
# flooded by 8 known identities was 7.28x slower than alone at batch 8 against 2.82x at 1 (it waits
# for a whole batch and computes in one), while the flood got 15% more through
# (results/hardening/key_holders_flood_batch{8,1}.json). Exact rows are bitwise the same at any
# size (fixed-shape tiles, blocks/model.py's rules; checked at start by blocks.invariance, tested
# up to 64 x 16 rows under other machines' kernels); serving runs on CPU only.
COMPUTE_SLOTS = 1


class PipelineError(Exception):
    """A request could not be served; ``block`` and ``hop`` say where (None: the chain as a whole);
    ``fault`` says whose: "hop" (retry elsewhere), "request" (the request itself is bad),
    "session" (a hop lost the session's caches) or "busy" (the hop is saturated)."""

    def __init__(self, msg: str, block: int | None = None, hop: int | None = None, fault: str = "hop"):
        super().__init__(msg)
        self.block, self.hop, self.fault = block, hop, fault

    @classmethod
    def from_meta(cls, meta: dict) -> PipelineError:
        """The failure a refusal's meta reports, as the client raises it."""
        b, hop = meta.get("block"), meta.get("hop")
        fault = str(meta["fault"]) if meta.get("fault") in FAULTS else "hop"
        where = f"block {b}" if isinstance(b, int) else "the chain"
        text = (f"the request was refused by {where}: {meta['error']}" if fault == "request"
                else f"{where} failed (reported by hop {hop}): {meta['error']}")
        return cls(text, b if isinstance(b, int) else None, hop if isinstance(hop, int) else None, fault)


def bad_request(msg: str, block=None, hop=None) -> PipelineError:
    """A failure that is the request's own fault: no other chain would serve it either."""
    return PipelineError(msg, block, hop, fault="request")


def refusal_meta(e: Exception, block, hop: int) -> dict:
    """The refusal meta for failure ``e`` at ``hop`` running ``block``: a PipelineError's own
    block, hop and fault; any other exception is the hop's fault, named by its type."""
    if isinstance(e, PipelineError):
        failed, at, fault, text = e.block, e.hop if e.hop is not None else hop, e.fault, str(e)
    else:
        failed, at, fault, text = block, hop, "hop", f"{type(e).__name__}: {e}"
    return {"error": text[:MAX_ERROR_CHARS], "hop": at, "block": failed, "fault": fault}


def refusal(request_id: int, meta: dict) -> PipelineResult:
    """A refusal (PipelineResult with ``error``, ``hop``, ``block``, ``fault``) of ``request_id``."""
    return PipelineResult(request_id=request_id, tensors=(), meta={
        "error": str(meta.get("error"))[:MAX_ERROR_CHARS], **{k: meta.get(k) for k in ("hop", "block", "fault")}})


def block_at(meta: dict, hop: int):
    """The block the request's ``blocks`` names for ``hop``, or None."""
    blocks = meta.get("blocks")
    if isinstance(blocks, list) and type(hop) is int and 0 <= hop < len(blocks) and type(blocks[hop]) is int:
        return blocks[hop]
    return None
