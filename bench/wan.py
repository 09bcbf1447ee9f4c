"""``bt-bench wan``: one output sequence across a chain of peers on WAN-like links.

Both modes run on the same peers, links and codec (bf16 hidden states): blocktrain (one
traversal for the whole N-byte continuation) and autoregressive (the matched end-to-end model
split by the same layers, KV cache per peer, one traversal per byte). Links are the in-process
link shaper (one-way delay = RTT/2 on every link, rate limit), the only delay that works on
machines without netem; the report says so.

The physical bound of a run is: traversals x links x one-way delay + the serialization of every
frame sent at the link rate + the compute the peers measured.
"""

from __future__ import annotations

import asyncio
import os
import statistics

import torch
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from blocktrain.blocks.model import Block, EndToEnd, ModelConfig
from blocktrain.p2p.link import LinkSpec
from blocktrain.p2p.node import Peer
from blocktrain.p2p.client import PipelineClient
from blocktrain.p2p.pipeline import PipelineServer, ServedBlocks
from blocktrain.p2p.transport import Timeouts

PROMPT_LEN = 64


def _sent_bytes(peers, client) -> int:
    """Wire bytes sent so far by every peer (to members and to the client) and by the client."""
    total = sum(p.traffic_totals()["sent"]["wire_bytes"] for p in peers)  # clients' connections included
    total += client.sent_wire_bytes()
    return total


async def run_one(mode: str, n_bytes: int, rtt_ms: float, rate_mbit: float, hops: int = 3, d_model: int = 192,
                  n_head: int = 6, layers_per_block: int = 2, repeats: int = 3, measure_ar: int | None = None,
                  threads: int = 1) -> dict:
    torch.set_num_threads(threads)
    cfg = ModelConfig(d_model=d_model, n_head=n_head, n_layer=hops * layers_per_block, n_blocks=hops,
                      max_seq_len=PROMPT_LEN + n_bytes, head_layers=0)
    torch.manual_seed(0)
    bt = [Block(cfg, k) for k in range(hops)]
    e2e = EndToEnd(cfg)
    link = LinkSpec(delay_ms=rtt_ms / 2, rate_mbit=rate_mbit)
    psk = os.urandom(32)
    tmo = Timeouts(connect_s=30, handshake_s=30, heartbeat_s=5, dead_after_s=600)
    peers = []
    for k in range(hops):
        p = await Peer(X25519PrivateKey.generate(), psk, "127.0.0.1", 0, blocks=(k,), role="serve", timeouts=tmo,
                       links={"default": link, "links": {}}).start()
        if peers:
            await p.join("127.0.0.1", peers[0].port)
        PipelineServer(p, ServedBlocks({k: bt[k]}, {k: e2e.blocks[k]}))
        peers.append(p)
    client = PipelineClient(X25519PrivateKey.generate(), psk, [p.addr for p in peers], list(range(hops)), tmo, link,
                            codec="bf16", timeout_s=600)
    try:
        await client.connect()
        for p in peers:  # warm the connections between hops (handshakes are not part of a request)
            for q in peers:
                if q is not p:
                    await p.connection(q.addr)
        prompt = bytes(range(32, 32 + PROMPT_LEN))
        n_run = n_bytes if mode == "blocktrain" or measure_ar is None else min(n_bytes, measure_ar)
        gen = client.generate_blocktrain if mode == "blocktrain" else client.generate_autoregressive
        await gen(prompt, min(n_run, 2))  # warm-up (thread pools, allocators)
        runs = []
        for _ in range(repeats):
            before = _sent_bytes(peers, client)
            _, st = await gen(prompt, n_run)
            st["bytes"] = _sent_bytes(peers, client) - before
            runs.append(st)
        secs = statistics.median(r["seconds"] for r in runs)
        compute = statistics.median(r["compute_s"] for r in runs)
        moved = statistics.median(r["bytes"] for r in runs)
        links_per_traversal = hops + 1  # client -> hop 1 -> ... -> hop K -> client
        traversals = runs[0]["traversals"]
        bound = (traversals * links_per_traversal * link.delay_ms / 1e3 + link.serialization_s(moved) + compute)
        scale = n_bytes / n_run  # autoregressive runs may be measured on fewer bytes, then scaled
        return {
            "mode": mode, "n_bytes": n_bytes, "rtt_ms": rtt_ms, "rate_mbit": rate_mbit, "hops": hops,
            "model": cfg.to_dict(), "weights": "random (timing does not depend on them)",
            "measured_bytes": n_run, "extrapolated": scale != 1.0,
            "seconds": secs * scale, "traversals": traversals * scale, "bytes_moved": moved * scale,
            "compute_s": compute * scale, "bound_s": bound * scale, "vs_bound": secs / bound if bound else None,
            "links": "in-process link shaper (per-frame serialization at the rate, then one-way delay)",
            "runs": runs,
        }
    finally:
        await client.close()
        await asyncio.gather(*(p.stop() for p in peers))


def compare(n_bytes: int, rtt_ms: float, rate_mbit: float, hops: int = 3, repeats: int = 3,
            measure_ar: int | None = None, **kw) -> dict:
    import uvloop

    bt = uvloop.run(run_one("blocktrain", n_bytes, rtt_ms, rate_mbit, hops, repeats=repeats, **kw))
    ar = uvloop.run(run_one("autoregressive", n_bytes, rtt_ms, rate_mbit, hops, repeats=max(1, repeats // 2),
                            measure_ar=measure_ar, **kw))
    speedup = ar["seconds"] / bt["seconds"]
    return {"blocktrain": bt, "autoregressive": ar, "speedup": speedup, "target_speedup": 0.5 * n_bytes,
            "speedup_met": speedup >= 0.5 * n_bytes,
            "within_bound": {"blocktrain": bt["vs_bound"] <= 1.25, "autoregressive": ar["vs_bound"] <= 1.25}}
