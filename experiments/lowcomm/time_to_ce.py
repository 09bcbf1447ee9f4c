"""Time to a validation CE on a slow link, from a lowcomm_ce.py run's curve and bytes: a model of
the wall time, not a measurement of one (said in every line it prints).

For each run (a JSON line of ``lowcomm_ce.py ... --curve N``): every curve point is [step, valid
CE, bytes each worker had sent by then]. On a link of RATE Mbit/s up and RTT ms, a worker's time
to step s is s x its step's compute (``step_seconds``, measured in that run: the workers took
turns on one core, so it is one worker's step) plus, for every round so far, the round's bytes
over its uplink and one round trip: a round waits for its parts (no overlap), the way the swarm
runs them without ``--overlap``. With ``--overlap-model``, a round's transfer hides behind the next
round's compute (what ``--overlap`` does), so a step costs max(compute, transfer per step).

The time to a CE is the time to the first curve point at or below it; a run that never reaches
it has none. The ratio (one fp32 gradient copy over the link) / (a step's compute) is printed
for the link: about 800 for d 128 here at 0.1 Mbit/s, a GPU's on a home link.

usage: python experiments/lowcomm/time_to_ce.py RUNS.jsonl [...] --rate 0.1 --rtt 50 [--target CE]
       [--overlap-model] [--floats N]
"""

import argparse
import json
import sys


def rounds_by(curve_step: int, every: int, dense_first: int, mode: str) -> int:
    """Rounds a run had finished by ``curve_step`` (its rounds end every ``every`` steps after the
    first ``dense_first``, and every step in grads mode)."""
    if mode == "grads":
        return curve_step
    if mode == "alone":
        return 0
    dense = min(curve_step, dense_first)
    return dense + (curve_step - dense) // every


def timeline(run: dict, rate_mbit: float, rtt_s: float, overlap: bool) -> list[tuple[int, float, float]]:
    """[(step, valid CE, modelled seconds)] of the run's curve on the link."""
    out = []
    for step, ce, sent in run["curve"]:
        rounds = rounds_by(step, run["every"], run.get("dense_first", 0), run["mode"])
        transfer = sent * 8 / (rate_mbit * 1e6) + rounds * rtt_s  # its bytes up, one round trip per round
        compute = step * run["step_seconds"]
        out.append((step, ce, max(compute, transfer) if overlap else compute + transfer))
    return out


def name(run: dict) -> str:
    if run["mode"] == "grads":
        return "gradients every step"
    if run["mode"] == "alone":
        return "one worker alone (no rounds)"
    extra = f", rounds every step for the first {run['dense_first']}" if run.get("dense_first") else ""
    return (f"params every {run['every']}, {run['codec']}, outer {run['outer_lr']}"
            + (f" momentum {run['outer_momentum']}" if run.get("outer_momentum") else "") + extra)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("runs", nargs="+")
    ap.add_argument("--rate", type=float, default=0.1, help="uplink Mbit/s")
    ap.add_argument("--rtt", type=float, default=50.0, help="round trip ms")
    ap.add_argument("--target", type=float, default=None,
                    help="the valid CE to time (default: the worst final CE among the runs: one every run reaches)")
    ap.add_argument("--overlap-model", action="store_true")
    ap.add_argument("--floats", type=int, default=728_320, help="parameters of the block (d 128 block 0: 2,913,280 bytes in fp32)")
    a = ap.parse_args()
    runs = [json.loads(line) for f in a.runs for line in open(f) if line.strip()]
    runs = [r for r in runs if r.get("curve")]
    if not runs:
        sys.exit("no run with a curve (lowcomm_ce.py --curve N)")
    target = a.target if a.target is not None else max(r["curve"][-1][1] for r in runs)
    step_s = sorted(r["step_seconds"] for r in runs)[len(runs) // 2]
    ratio = a.floats * 4 * 8 / (a.rate * 1e6) / step_s
    print(f"# modelled, not measured: uplink {a.rate} Mbit/s, RTT {a.rtt:g} ms, "
          f"{'rounds overlapped with compute' if a.overlap_model else 'rounds waited for'}; "
          f"fp32 copy / step compute = {ratio:.0f}; target valid CE {target:.4f}")
    rows = []
    for r in runs:
        tl = timeline(r, a.rate, a.rtt / 1000, a.overlap_model)
        hit = next(((s, t) for s, ce, t in tl if ce <= target), None)
        per_step = r["bytes_sent_per_worker"] / r["steps"]
        rows.append((hit[1] if hit else float("inf"), name(r), hit, per_step, r))
    for t, nm, hit, per_step, r in sorted(rows, key=lambda x: x[0]):
        where = f"step {hit[0]}, {t / 3600:.2f} h" if hit else "never"
        print(json.dumps({"run": nm, "time_to_target_s": None if not hit else round(t, 1), "at": where,
                          "bytes_per_worker_per_step": round(per_step), "final_valid_ce": r["curve"][-1][1],
                          "test_ce": round(r["test_ce"], 4), "commit": r["code_version"]["commit"][:7],
                          "command": r["command"], "modelled": True}))


if __name__ == "__main__":
    main()
