"""The tables of README.md from the JSONs of this folder (FLOOD-LABEL.json), one column per label.

    .venv/bin/python results/floods/summarize.py                      # before, pool
    .venv/bin/python results/floods/summarize.py head shed release    # the frame buffer runs
"""
import json
import sys
from pathlib import Path

HERE = Path(__file__).parent


def rows(labels):
    for flood in ("streams", "parts", "near", "serving"):
        runs = {v: json.loads((HERE / f"{flood}-{v}.json").read_text())
                for v in labels if (HERE / f"{flood}-{v}.json").exists()}
        runs = {v: r for v, r in runs.items() if r.get("waves")}  # a run that failed before its waves: no row
        if not runs:
            continue
        base = {v: r.get("baseline_rss_mib", r["waves"][0]["rss_before_mib"]) for v, r in runs.items()}
        for i, w in enumerate(next(iter(runs.values()))["waves"]):
            cells = []
            for v in labels:
                if v not in runs or i >= len(runs[v]["waves"]):
                    cells.append("-")
                    continue
                x = runs[v]["waves"][i]
                cell = f"{x['rss_before_mib']:.0f} / {x['rss_peak_mib']:.0f} / {x['rss_after_30s_mib']:.0f}"
                cell += f" ({x['rss_after_30s_mib'] - base[v]:+.0f})"
                if "slowdown" in x:
                    cell += f", {x['slowdown']}x"
                cells.append(cell)
            commits = " / ".join(runs[v]["runtime"]["commit"][:7] for v in labels if v in runs)
            yield f"| {flood} | {w['identities']} | " + " | ".join(cells) + f" | {commits} |"


if __name__ == "__main__":
    labels = sys.argv[1:] or ["before", "pool"]
    print("| flood | identities | " + " | ".join(f"{v}: RSS before / peak / +30 s, MiB (+ vs the fresh victim)"
                                                  for v in labels) + " | commits |")
    print("| --- | --- | " + "--- | " * len(labels) + "--- |")
    for r in rows(labels):
        print(r)
