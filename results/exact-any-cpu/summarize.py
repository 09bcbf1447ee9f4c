"""The figures of README.md here, computed from this folder's files: per mode the median CPU
seconds of each code version and the new/old ratio pair by pair (cpu/), eight clients' process
CPU time and wall time (clients8/), and the AVX2 kernels' identity checks (avx2/).
usage: python results/exact-any-cpu/summarize.py [--json OUT]"""

import argparse
import json
import statistics as st
from pathlib import Path

HERE = Path(__file__).resolve().parent
MODES = ["exact_greedy", "exact_sampled", "autoregressive_greedy", "autoregressive_sampled"]


def pairs(folder: Path, suffix: str) -> tuple[list[int], str, str]:
    names = {p.stem.rsplit("-", 1)[0] for p in folder.glob(f"*-*{suffix}")}
    old, new = "old", next(n for n in sorted(names) if n.startswith("new"))
    reps = sorted({int(p.stem.rsplit("-", 1)[1]) for p in folder.glob(f"{old}-*{suffix}")}
                  & {int(p.stem.rsplit("-", 1)[1]) for p in folder.glob(f"{new}-*{suffix}")})
    return reps, old, new


def cpu() -> dict:
    reps, old, new = pairs(HERE / "cpu", ".json")
    load = {v: [json.loads((HERE / "cpu" / f"{v}-{r}.json").read_text()) for r in reps] for v in (old, new)}
    out = {"pairs": len(reps), "commits": {v: load[v][0]["code_version"]["commit"][:7] for v in load}, "modes": {}}
    for m in MODES:
        o = [d["cpu_s"][m]["median"] for d in load[old]]
        n = [d["cpu_s"][m]["median"] for d in load[new]]
        ratios = [b / a for a, b in zip(o, n)]
        out["modes"][m] = {"old_s": round(st.median(o), 3), "new_s": round(st.median(n), 3),
                           "new_over_old": round(st.median(ratios), 3), "pair_ratios": [round(x, 2) for x in ratios],
                           "outputs_identical": all(d["outputs"][m] == load[old][0]["outputs"][m]
                                                    for d in load[old] + load[new])}
    return out


def clients8() -> dict:
    folder = HERE / "clients8"
    reps, old, new = pairs(folder, ".time")
    rows = {}
    for v in (old, new):
        for r in reps:
            user, sys_, wall = map(float, (folder / f"{v}-{r}.time").read_text().split())
            d = json.loads((folder / f"clients8-{v}-{r}.json").read_text())
            rows[(v, r)] = {"cpu_s": user + sys_, "exact_wall_s": d["clients"]["exact"]["wall_s"],
                            "ar_wall_s": d["clients"]["autoregressive"]["wall_s"],
                            "identical": [d["clients"][m]["outputs_identical_to_alone"] for m in ("exact", "autoregressive")],
                            "commit": d["code_version"]["commit"][:7]}
    ratio = lambda k: round(st.median(rows[(new, r)][k] / rows[(old, r)][k] for r in reps), 3)
    return {"pairs": len(reps), "commits": {v: rows[(v, reps[0])]["commit"] for v in (old, new)},
            "process_cpu_new_over_old": ratio("cpu_s"), "exact_clients_wall_new_over_old": ratio("exact_wall_s"),
            "autoregressive_clients_wall_new_over_old": ratio("ar_wall_s"),
            "outputs_identical_to_alone": sorted({x for r in rows.values() for x in r["identical"]}),
            "runs": {f"{v}-{r}": row for (v, r), row in rows.items()}}


def avx2() -> dict:
    out = {}
    for p in sorted((HERE / "avx2").glob("*.json")):
        d = json.loads(p.read_text())
        out[p.name] = {"commit": d["code_version"]["commit"][:7], "temperature": d.get("temperature", 0.0),
                       "identical_prompts": d["exact"].get("identical_prompts"),
                       "speedup": round(d["speedup_exact_vs_autoregressive"], 2),
                       "bytes_per_traversal": round(d["exact"]["bytes_per_traversal"], 2)}
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json")
    a = ap.parse_args()
    from blocktrain.provenance import code_version
    res = {"code_version": code_version(), "command": "python results/exact-any-cpu/summarize.py"
           + (f" --json {a.json}" if a.json else ""), "cpu": cpu(), "clients8": clients8(), "avx2": avx2()}
    print(json.dumps(res, indent=1))
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
