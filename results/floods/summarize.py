"""The table of README.md from the JSONs of this folder (FLOOD-before.json, FLOOD-pool.json).

    .venv/bin/python results/floods/summarize.py
"""
import json
from pathlib import Path

HERE = Path(__file__).parent


def rows():
    for flood in ("streams", "parts", "near", "serving"):
        runs = {v: json.loads((HERE / f"{flood}-{v}.json").read_text())
                for v in ("before", "pool") if (HERE / f"{flood}-{v}.json").exists()}
        if not runs:
            continue
        base = {v: r.get("baseline_rss_mib", r["waves"][0]["rss_before_mib"]) for v, r in runs.items()}
        for i, w in enumerate(next(iter(runs.values()))["waves"]):
            cells = []
            for v in ("before", "pool"):
                if v not in runs or i >= len(runs[v]["waves"]):
                    cells.append("-")
                    continue
                x = runs[v]["waves"][i]
                cell = f"{x['rss_before_mib']:.0f} / {x['rss_peak_mib']:.0f} / {x['rss_after_30s_mib']:.0f}"
                cell += f" (+{x['rss_after_30s_mib'] - base[v]:.0f})"
                if "slowdown" in x:
                    cell += f", {x['slowdown']}x"
                cells.append(cell)
            commits = " / ".join(runs[v]["runtime"]["commit"][:7] for v in ("before", "pool") if v in runs)
            yield f"| {flood} | {w['identities']} | {cells[0]} | {cells[1]} | {commits} |"


if __name__ == "__main__":
    print("| flood | identities | before: RSS before / peak / +30 s, MiB (+ vs the fresh victim) "
          "| with the pool | commits |")
    print("| --- | --- | --- | --- | --- |")
    for r in rows():
        print(r)
