"""A checkpoint holder as its own process, for tests that kill it by pid mid-stream.

usage: python holder.py KEYFILE DIR RATE_MBIT ADDR_FILE
Serves DIR/<kind>/<name>.safetensors to swarm members over links shaped to RATE_MBIT; writes
its HOST:PORT to ADDR_FILE once listening; runs until killed.
"""

import asyncio
import os
import sys
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from blocktrain.p2p.checkpoints import CheckpointServer
from blocktrain.p2p.identity import load_swarm_key
from blocktrain.p2p.link import LinkSpec
from blocktrain.p2p.node import Peer
from blocktrain.p2p.transport import Timeouts


async def main(key, directory, rate, addr_file):
    links = {"default": LinkSpec(rate_mbit=rate), "links": {}}
    peer = await Peer(X25519PrivateKey.generate(), load_swarm_key(key), "127.0.0.1", 0, blocks=(1,),
                      timeouts=Timeouts(heartbeat_s=0.2, dead_after_s=3), links=links).start()
    CheckpointServer(peer, directory)
    tmp = Path(addr_file + ".tmp")
    tmp.write_text(peer.addr)
    os.replace(tmp, addr_file)
    await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4]))
