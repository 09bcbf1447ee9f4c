"""One hivemind DecentralizedAverager peer for ``bt-bench average --against hivemind``.

Run by path with a Python that has hivemind (the ``compare`` extra); imports nothing of
BlockTrain. usage: hivemind_child.py I N FLOATS ROUNDS DIR
Peer 0 starts the DHT and writes its multiaddrs to DIR/maddrs; the others join through them,
all on 127.0.0.1. Each round: matchmaking with ``require_trigger`` (not timed as averaging), then
the all-reduce, timed from the trigger to the result. Writes DIR/r{I}.json.
"""

import json
import os
import sys
import time

import torch


def main(i: int, n: int, floats: int, rounds: int, d: str):
    import hivemind
    from hivemind.averaging import DecentralizedAverager

    torch.set_num_threads(1)
    maddrs = os.path.join(d, "maddrs")
    if i == 0:
        dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        tmp = maddrs + ".tmp"
        with open(tmp, "w") as f:
            json.dump([str(a) for a in dht.get_visible_maddrs()], f)
        os.replace(tmp, maddrs)
    else:
        for _ in range(600):
            if os.path.exists(maddrs):
                break
            time.sleep(0.1)
        with open(maddrs) as f:
            initial = json.load(f)
        dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=initial)
    x = torch.randn(floats, generator=torch.Generator().manual_seed(i))
    av = DecentralizedAverager([x.clone()], dht, prefix="btbench", target_group_size=n, min_group_size=n,
                               min_matchmaking_time=2.0, request_timeout=1.0, start=True)
    times, total, sizes = [], [], []
    for _ in range(rounds):
        with av.get_tensors() as ts:
            ts[0].copy_(x)
        t0 = time.perf_counter()
        control = av.step(wait=False, require_trigger=True, timeout=300)
        while not control.stage.name.startswith("AWAITING_TRIGGER") and not control.done():
            time.sleep(0.001)
        t1 = time.perf_counter()
        control.allow_allreduce()
        out = control.result(timeout=300)
        t2 = time.perf_counter()
        times.append(t2 - t1)
        total.append(t2 - t0)
        sizes.append(len(out) if out else 0)
    with av.get_tensors() as ts:
        err = float((ts[0] - x).abs().max())  # > 0: it did average
    with open(os.path.join(d, f"r{i}.json"), "w") as f:
        json.dump({"times": times, "with_matchmaking": total, "group_sizes": sizes, "changed": err}, f)
    time.sleep(2.0)
    av.shutdown()
    dht.shutdown()


if __name__ == "__main__":
    a = sys.argv[1:]
    main(int(a[0]), int(a[1]), int(a[2]), int(a[3]), a[4])
