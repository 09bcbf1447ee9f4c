"""A key holder's `bt-peer`: the real CLI, run with the argv a user would give it, after patching
what one group-control attack needs. group_control.py starts it; BT_FORGE says which attack:

    BT_FORGE=mismatched:PEER_ID  every averaging part it sends lists PEER_ID in meta `mismatched`
    BT_FORGE=departed:PEER_ID    the same with meta `departed`
    BT_FORGE=status              it never joins a group; every 0.5 s it sends each training peer of
                                 its scope a control `status` {size 3, sponsor "00"*32} (its own
                                 scope and job digest, as an honest member's status carries)
    BT_FORGE=state               the group state it serves its joiners says `step` 10^15 (the
                                 global step, `gstep`, stays the true one)

    BT_FORGE=... python experiments/hardening/forger.py join HOST:PORT --block 0 ...

Which tree `blocktrain` comes from is whatever sys.path gives (group_control.py sets PYTHONPATH
to a sitecustomize that imports a worktree of the measured commit); the first line it prints
says which file was imported.
"""
import asyncio
import os
import sys

import blocktrain
import blocktrain.p2p.averaging.driver as driver
from blocktrain.p2p.cli import main

MODE, _, TARGET = os.environ.get("BT_FORGE", "").partition(":")
print(f"forger: {MODE} {TARGET[:12]} blocktrain from {blocktrain.__file__}", file=sys.stderr, flush=True)
SENT = {"status_frames": 0}


def forge_relays(key: str, target: str) -> None:
    """Every round's parts relay ``target`` under meta ``key`` (beside what we relay honestly)."""
    begin = driver.Averager._begin

    def _begin(self, *a, **k):
        r = begin(self, *a, **k)
        honest = r.roster.meta

        def meta():
            m = honest()
            if target != self.peer.id:
                m[key] = sorted(set(m.get(key, [])) | {target})
            return m
        r.roster.meta = meta
        return r
    driver.Averager._begin = _begin


def forge_status() -> None:
    """Never join; tell every training peer of our scope, every 0.5 s, of a group of 3 whose sponsor
    is 00...00 (outranking any group of 3: a smaller sponsor id ranks higher)."""
    from blocktrain.p2p.group import Send
    from blocktrain.p2p.swarm.membership import Membership

    async def join(self, *a, **k):
        print("forger: not joining; sending status {size 3, sponsor 00..00} every 0.5 s", file=sys.stderr, flush=True)
        while True:
            for pid in self.candidates():
                self.send([Send(pid, 0, {"phase": "status", "size": 3, "sponsor": "00" * 32})])
                SENT["status_frames"] += 1
            SENT["rounds"] = SENT.get("rounds", 0) + 1
            if SENT["rounds"] % 10 == 0:  # every 5 s
                print(f"forger: {SENT['status_frames']} status frames sent", file=sys.stderr, flush=True)
            await asyncio.sleep(0.5)
    Membership.join = join


def forge_state() -> None:
    """The join state we publish carries step 10^15; our own training is untouched."""
    from blocktrain.p2p.swarm.store import CheckpointStore
    save = CheckpointStore.save_join_state

    def save_join_state(self, c, rnd):
        c.extra.setdefault("gstep", c.step)  # the global step stays plausible
        c.step = 10 ** 15
        print(f"forger: join state of round {rnd} written with step 10^15, gstep {c.extra['gstep']}",
              file=sys.stderr, flush=True)
        return save(self, c, rnd)
    CheckpointStore.save_join_state = save_join_state


if MODE in ("mismatched", "departed"):
    assert len(TARGET) == 64, "BT_FORGE=mismatched:PEER_ID (64 hex digits)"
    forge_relays(MODE, TARGET)
elif MODE == "status":
    forge_status()
elif MODE == "state":
    forge_state()
else:
    raise SystemExit(f"BT_FORGE={MODE!r}: mismatched:ID, departed:ID, status or state")

if __name__ == "__main__":
    sys.argv = ["bt-peer", *sys.argv[1:]]
    sys.exit(main())
