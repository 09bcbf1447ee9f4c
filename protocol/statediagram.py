"""Generate PROTOCOL.md's state diagram (Mermaid) from ``connection.TRANSITIONS``.

Run ``python -m blocktrain.protocol.statediagram``; a test checks PROTOCOL.md holds its output.
"""

from __future__ import annotations

from .connection import TRANSITIONS, Role


def mermaid(role: Role) -> str:
    lines = ["stateDiagram-v2"]
    for (r, state), row in TRANSITIONS.items():
        if r is not role:
            continue
        for ev, nxt in row.items():
            lines.append(f"    {state.value} --> {nxt.value}: {ev.value}")
    return "\n".join(lines)


def main():
    for role in Role:
        print(f"{role.value}:\n```mermaid\n{mermaid(role)}\n```")


if __name__ == "__main__":
    main()
