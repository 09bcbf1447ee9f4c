"""Naming a gossip partner that reverses its update (gossip's attack target; PROTOCOL r6.15).

Three measurements, each printed and written to --json:

- ``synthetic``: one robust round of 4 members (3 honest, 1 reversed) whose start points are
  ``apart`` updates' norms apart, each member measuring updates from its own start point: how
  many of the 9 honest receivers (3 seeds x 3) find the reversed one opposed.
- ``cosines``: the simulator's 16-member flip run (bench/gossip.py, k 4, 40 rounds): every honest
  receiver's cosine of each partner's update with the median's (both from its own start point),
  honest partners against the attacker, and the partners' start points' distance from the
  receiver's over their update's norm.
- ``sizes``: flip and x8 at 16 and 64 members, 40 rounds: honest members that named the attacker,
  and honest members named by honest ones.

    python experiments/gossip/flip_naming.py --json results/gossip/r6.15/flip_naming.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict

import torch

from blocktrain.bench import gossip as G
from blocktrain.bench.provenance import code_version
from blocktrain.p2p.averaging import AveragingRound, RoundSpec
from blocktrain.p2p.averaging.robust import coordinate_median

IDS4 = ["a", "b", "c", "d"]


def synthetic(apart_values=(0.5, 0.7, 1.0), seeds=(0, 1, 2), n=20_000) -> dict:
    out = {}
    for apart in apart_values:
        named = 0
        for seed in seeds:
            torch.manual_seed(seed)
            base, g = 3 * torch.randn(n), torch.randn(n)
            starts = {p: base + apart * torch.randn(n) for p in IDS4}
            moved = {p: g + torch.randn(n) for p in IDS4}
            xs = {p: starts[p] + moved[p] for p in IDS4[:3]} | {"d": starts["d"] - moved["d"]}
            rs = {p: AveragingRound(p, 0, 1, IDS4, xs[p], RoundSpec(aggregate="robust"), origin=starts[p])
                  for p in IDS4}
            queue = [(p, part) for p, r in rs.items() for part in r.start()]
            while queue:
                src, part = queue.pop(0)
                queue += [(part.peer, q) for q in rs[part.peer].receive(src, part.msg)]
            named += sum("d" in rs[p].result()[1].opposed for p in IDS4[:3])
        out[str(apart)] = f"{named}/{3 * len(seeds)}"
        print(f"synthetic: start points {apart} updates apart: the reversed update opposed for {out[str(apart)]} "
              "honest receivers", flush=True)
    return out


def cosines() -> dict:
    cos: dict = defaultdict(list)
    ratio: list[float] = []
    sim = G.Simulation(G.SimConfig(members=16, attackers=1, attack="flip", rounds=40))
    exchange = sim._exchange

    def observed(groups_of, rnd, views, starts):
        for me, group in groups_of.items():
            if sim.members[me].attacker or sim.banned.get(me):
                continue  # honest receivers that have not excluded the attacker yet
            xs = {p: sim._vector(sim.members[p], starts) for p in group if p in groups_of}
            if len(xs) < 3:
                continue
            med, o = coordinate_median(torch.stack([xs[p] for p in sorted(xs)])), starts[me]
            for p, x in xs.items():
                if p == me:
                    continue
                u, m = x - o, med - o
                cos["attacker" if sim.members[p].attacker else "honest"].append(float(u @ m / (u.norm() * m.norm())))
                if not sim.members[p].attacker:
                    ratio.append(float((starts[p] - o).norm() / (x - starts[p]).norm()))
        return exchange(groups_of, rnd, views, starts)

    sim._exchange = observed
    sim.run()

    def spread(v):
        v = sorted(v)
        return {"n": len(v), "min": v[0], "median": statistics.median(v), "max": v[-1]}
    out = {"cosine_with_the_median": {k: spread(v) for k, v in cos.items()},
           "start_distance_over_update_norm": spread(ratio), "named_by": len(sim.named)}
    print("cosines:", json.dumps(out, indent=1), flush=True)
    return out


def sizes() -> list:
    rows = []
    for attack in ("flip", "x8"):
        for members in (16, 64):
            sim = G.Simulation(G.SimConfig(members=members, attackers=1, attack=attack, rounds=40))
            sim.run()
            rows.append({"attack": attack, "members": members, "named_by": len(sim.named),
                         "honest_members": members - 1, "honest_excluded_by_honest": sim.honest_excluded,
                         "honest_ce": sim.loss()})
            print("sizes:", rows[-1], flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args(argv)
    result = {"benchmark": "gossip-flip-naming", "synthetic": synthetic(), "cosines": cosines(), "sizes": sizes()}
    if args.json:
        command = " ".join(["python", "experiments/gossip/flip_naming.py", *(sys.argv[1:] if argv is None else argv)])
        with open(args.json, "w") as f:
            json.dump({**result, "code_version": code_version(), "command": command}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
