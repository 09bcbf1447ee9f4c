"""A client fetches a checkpoint from one holder behind a shaped 0.1 Mbit/s, 25 ms link, for longer
than a holder's idle bound for clients (300 s): does the fetch finish? (results/lowcomm/auto.md: an
assembly over such a link failed 301 s in; this reproduction, in one process, finished in 362 s.)

    python experiments/lowcomm/slow_fetch.py
"""
import asyncio
import logging
import os
import tempfile
import time
from pathlib import Path
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from blocktrain.p2p.checkpoints import CheckpointServer, CheckpointFetcher
from blocktrain.p2p.link import LinkSpec
from blocktrain.p2p.node import Peer
from blocktrain.p2p.transport import Timeouts

logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")


async def main():
    tmp = Path(tempfile.mkdtemp())
    psk = os.urandom(32)
    links = {"default": LinkSpec(delay_ms=25, rate_mbit=0.1), "links": {}}
    a = await Peer(X25519PrivateKey.generate(), psk, "127.0.0.1", 0, links=links).start()  # the holder
    me = await Peer(X25519PrivateKey.generate(), psk, "127.0.0.1", 0, role="client",
                    timeouts=Timeouts(connect_s=30, handshake_s=30)).start()
    data = os.urandom(4_500_000)
    (tmp/"checkpoint").mkdir(parents=True); (tmp/"checkpoint"/"block0.safetensors").write_bytes(data)
    CheckpointServer(a, tmp)
    f = CheckpointFetcher(me, chunk_timeout_s=30)
    t0 = time.monotonic()
    try:
        got = await f.fetch([a.addr], "checkpoint", "block0")
        print("GOT", len(got), round(time.monotonic()-t0,1), flush=True)
    except Exception as e:
        print("ERR", round(time.monotonic()-t0,1), e, flush=True)
    await a.stop(); await me.stop()


asyncio.run(main())
