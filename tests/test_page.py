"""The live swarm page: JSON and HTML from a live 3-peer swarm, rendered in headless Chromium."""

import asyncio
import json
import os
import shutil
from pathlib import Path

import pytest

from blocktrain.blocks.data import as_tensor, read_split
from blocktrain.blocks.model import ModelConfig
from blocktrain.blocks.train import TrainConfig
from blocktrain.p2p.page import SwarmPage
from blocktrain.p2p.swarm import PeerJob, SwarmConfig, SwarmTrainer, TrainerSpec
from blocktrain.p2p.transport import Timeouts

from conftest import mesh

FAST = Timeouts(connect_s=5, handshake_s=3, heartbeat_s=0.2, dead_after_s=30, close_s=1)
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--hide-scrollbars"]


async def _get(port: int, path: str, method: str = "GET") -> tuple[int, bytes]:
    r, w = await asyncio.open_connection("127.0.0.1", port)
    w.write(f"{method} {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    data = await asyncio.wait_for(r.read(), 10)
    w.close()
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


async def _swarm_with_page(tmp_path):
    peers = await mesh(3, FAST, blocks=[(0,), (1,), (2,)])
    mc = ModelConfig(d_model=32, n_head=2, n_layer=3, n_blocks=3, max_seq_len=64)
    tc = TrainConfig(steps=30, batch_size=4, seq_len=32, warmup=2)
    sc = SwarmConfig(round_timeout_s=20, join_timeout_s=3, eval_windows=2, min_group=3)  # eval_every: its default
    data = as_tensor(read_split("valid"))
    sps = [SwarmTrainer(p, TrainerSpec(i, PeerJob(mc, tc, sc), tmp_path / f"w{i}"), data, data)
           for i, p in enumerate(peers)]
    page = await SwarmPage(peers[0]).start()
    await asyncio.gather(*(sp.run() for sp in sps))
    await asyncio.sleep(3.5)  # one poll of the members' work sections (page.POLL_S)
    return peers, page


async def test_page_serves_the_swarm_as_this_peer_sees_it_and_nothing_else(tmp_path):
    peers, page = await _swarm_with_page(tmp_path)
    try:
        code, body = await _get(page.port, "/status.json")
        v = json.loads(body)
        assert code == 200 and v["peer_id"] == peers[0].id
        assert {m["peer_id"] for m in v["members"]} == {peers[1].id, peers[2].id}
        assert v["training"]["state"] == "done" and len(v["training"]["curve"]) >= 20  # by default
        assert set(v["member_work"]) == {peers[1].id, peers[2].id}  # the others' own work sections
        assert all(w["step"] == 90 for w in v["member_work"].values())
        assert all(w["rounds_applied"] == 90 and w["coverage_min"] == 1.0 for w in v["member_work"].values())
        # every block's head has its own curve points (relay: block 0, then 1, then 2)
        assert {len(p[2]) for p in v["training"]["curve"]} == {1, 2, 3}
        assert "update" in v["by_kind"]["sent"]
        text = body.decode()
        assert "swarm_key" not in text and "private" not in text and str(tmp_path) not in text
        code, body = await _get(page.port, "/")
        assert code == 200 and b"<title>BlockTrain swarm</title>" in body
        text = (await _get(page.port, "/status.txt"))[1].decode()  # the same, as text
        assert "training: block 0, done, step 90/90, valid CE" in text, text
        assert sum(line.startswith("member ") and "says: done" in line for line in text.splitlines()) == 2, text
        assert (await _get(page.port, "/etc/passwd"))[0] == 404
        assert (await _get(page.port, "/status.json", "POST"))[0] == 405
    finally:
        await page.stop()
        for p in peers:
            await p.stop()


@pytest.mark.skipif(CHROMIUM is None, reason="no Chromium installed (Debian: apt-get install chromium)")
async def test_page_renders_in_headless_chromium(tmp_path):
    peers, page = await _swarm_with_page(tmp_path)
    url = f"http://127.0.0.1:{page.port}/"
    try:
        shot = tmp_path / "swarm-page.png"
        common = CHROMIUM_FLAGS + [f"--user-data-dir={tmp_path / 'chrome'}", "--virtual-time-budget=4000"]
        proc = await asyncio.create_subprocess_exec(CHROMIUM, *common, "--dump-dom", url,
                                                    stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL)
        dom, _ = await asyncio.wait_for(proc.communicate(), 120)
        dom = dom.decode().split("<script>")[0]  # the rendered body, not the script's own text
        for p in peers:  # every member and its work, rendered by the page's script
            assert p.id[:12] in dom
        assert "(this peer)" in dom and "update" in dom and "cannot reach" not in dom
        assert dom.count("<polyline") == 3 and all(f"block {b}</span>" in dom for b in range(3))  # a curve per block
        blocks = dom.split('id="blocks"')[1].split("</table>")[0]
        assert blocks.count("<tr>") == 4 and "100%" in blocks and "latest valid CE" in blocks  # a row per block
        proc = await asyncio.create_subprocess_exec(CHROMIUM, *common, "--window-size=900,1400",
                                                    f"--screenshot={shot}", url, stdout=asyncio.subprocess.DEVNULL,
                                                    stderr=asyncio.subprocess.DEVNULL)
        await asyncio.wait_for(proc.wait(), 120)
        assert shot.exists() and shot.stat().st_size > 10_000
        keep = os.environ.get("BT_PAGE_SCREENSHOT")  # results/swarm-page.png is made with this set
        if keep:
            Path(keep).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(shot, keep)
    finally:
        await page.stop()
        for p in peers:
            await p.stop()


def test_bt_peer_http_serves_the_page_on_loopback_given_a_bare_port(tmp_path):
    """``bt-peer start --http PORT``: the page of the real CLI, bound to 127.0.0.1."""
    import socket
    import subprocess
    import sys
    import time

    from blocktrain.p2p.identity import new_swarm_key
    new_swarm_key(tmp_path / "key")
    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "blocktrain.p2p.cli", "start", "--no-train", "--listen",
                             "127.0.0.1:0", "--http", str(port), "--swarm-key", str(tmp_path / "key"),
                             "--identity", str(tmp_path / "id"), "--quiet"], stderr=subprocess.PIPE)
    try:
        import select
        deadline = time.monotonic() + 60
        err = b""
        # raw reads of the pipe: a buffered readline after select can leave a second line that came
        # in the same chunk in Python's buffer, where select never sees it
        while b"swarm page:" not in err.rpartition(b"\n")[0]:  # a whole line; never past the deadline
            assert time.monotonic() < deadline and proc.poll() is None, f"no page announced: {err!r}"
            if select.select([proc.stderr], [], [], 1.0)[0]:
                err += os.read(proc.stderr.fileno(), 65536)
        line = next(x for x in err.decode().splitlines() if "swarm page:" in x)
        assert f"http://127.0.0.1:{port}/" in line
        code, body = asyncio.run(_get(port, "/status.json"))
        v = json.loads(body)
        assert code == 200 and v["role"] == "bootstrap" and v["members"] == [] and v["training"] is None
    finally:
        proc.terminate()
        proc.wait(30)


def test_what_a_member_says_about_its_work_reaches_the_page_only_as_numbers_and_words():
    """A member with the swarm key can still be malicious: its work section is cut to the page's
    keys and types, so no markup of its reaches the browser (the page builds HTML from it)."""
    from blocktrain.p2p.page import WORK_KEYS, clean_work
    evil = "<img src=x onerror=alert(1)>"
    assert clean_work({"holds": 10**18, "training_block": -1, "round": 2**60, "coverage_min": 7.0}) | {} == \
        {**clean_work({}), "holds": None, "training_block": None, "round": None, "coverage_min": None}  # bounded
    w = clean_work({"holds": evil, "training_block": 1, "state": evil, "schedule": "relay", "step": float("nan"),
                    "steps": 300, "round": 7, "group": ["a" * 64, 5, "b" * 999], "rounds_applied": [1],
                    "coverage_min": 0.5, "curve": [[10, 1.5, [2.0, 1.9]], [evil, 1, [1]], [20, 2.5, [evil]],
                                                   [30, 3.0, [1.8, 1.7]]] + [[1, 1, [1]]] * 40,
                    "secret": "x"})
    assert set(w) == set(WORK_KEYS)
    assert w["holds"] is None and w["state"] is None and w["step"] is None and w["rounds_applied"] is None
    assert w["training_block"] == 1 and w["schedule"] == "relay" and w["coverage_min"] == 0.5
    assert w["group"] == ["a" * 64] and len(w["curve"]) <= 20
    assert all(isinstance(c, (int, float)) for p in w["curve"] for c in [p[0], p[1], *p[2]])
    assert evil not in json.dumps(w)
    ok = clean_work({"state": "waiting for lower blocks", "curve": [[10, 1.5, [2.0, 1.9]]]})
    assert ok["state"] == "waiting for lower blocks" and ok["curve"] == [[10, 1.5, [2.0, 1.9]]]


def test_a_lying_member_is_shown_as_a_claim_with_this_peers_doubts():
    """A member claiming step 10^12, 10^9 rounds, CE 0.01 was shown as fact.
    Its claims are checked against each other and against this peer's own work; the doubts are
    named beside them (and the page leaves doubted members out of the per-block summary)."""
    from blocktrain.p2p.page import clean_work, doubts
    liar_id, honest_id = "l" * 64, "h" * 64
    mine = clean_work({"training_block": 0, "step": 400, "steps": 1000, "state": "training",
                       "group": [liar_id, honest_id], "curve": [[400, 10.0, [2.1]]]})
    liar = clean_work({"training_block": 0, "step": 10**12, "steps": 1000, "rounds_applied": 10**9,
                       "coverage_min": 1.0, "state": "training", "curve": [[400, 10.0, [0.01]]]})
    said = doubts(liar, mine, liar_id)
    assert any("beyond its 1000 steps" in d for d in said) and any("rounds applied in 1000" in d for d in said)
    assert any("far ahead" in d for d in said) and any("far below this peer's 2.100" in d for d in said)
    assert doubts(liar, None, liar_id)  # a peer that trains nothing still sees that the claims contradict themselves
    honest = clean_work({"training_block": 0, "step": 395, "steps": 1000, "rounds_applied": 395,
                         "state": "training", "curve": [[400, 10.0, [2.0]], [420, 11.0, [1.2]]]})
    assert doubts(honest, mine, honest_id) == [] and doubts(honest, None, honest_id) == []  # CE compared at one step
    other = clean_work({"training_block": 0, "step": 3, "steps": 10})
    assert doubts(other, mine, "o" * 64) == ["trains 10 steps where this peer trains 1000"]
    # a member of another group, or while we are not training (just started): its step is not ours to judge
    ahead = clean_work({"training_block": 1, "step": 900, "steps": 1000, "state": "training"})
    assert doubts(ahead, mine, "o" * 64) == [] and doubts(ahead, {**mine, "state": "joining"}, liar_id) == []


def _report(pid: str, links: dict, start: float = 0.0, end: float = 1.0) -> dict:
    """A minimal transfer report of ``pid``: links {remote: (sent wire bytes, received wire bytes)},
    counted from ``start`` to ``end``."""
    from blocktrain.p2p.reports import REPORT_KIND
    peers = {q: {d: {"by_type": {"block_update": {"frames": 1, "payload_bytes": n, "wire_bytes": n}}}
                 for d, n in zip(("sent", "received"), sr)} for q, sr in links.items()}
    tot = {d: {"frames": 1, "payload_bytes": 0, "wire_bytes": sum(sr[i] for sr in links.values())}
           for i, d in enumerate(("sent", "received"))}
    return {"kind": REPORT_KIND, "peer_id": pid, "addr": "127.0.0.1:1", "blocks": [0], "role": "train",
            "start_time": start, "end_time": end, "totals": tot, "by_kind": {}, "peers": peers}


def test_reports_are_claims_and_two_ends_of_a_link_are_compared(tmp_path):
    """What a report says is its peer's claim. Where both ends of a link
    reported, what one says it sent is checked against what the other says it received; beyond
    the slack (in flight between two reports' moments) the summary says they disagree."""
    from blocktrain.p2p.reports import LINK_SLACK_BYTES, ReportError, summarise, summary_lines
    a, b, c = "a" * 64, "b" * 64, "c" * 64
    files = []
    for pid, links in ((a, {b: (10_000_000, 2_000_000), c: (5_000, 0)}),  # a claims 10 MB sent to b
                       (b, {a: (2_000_000 + LINK_SLACK_BYTES // 2, 1_000_000)})):  # b got 1 MB from a
        files.append(tmp_path / f"{pid[0]}.json")
        files[-1].write_text(json.dumps(_report(pid, links)))
    agg = summarise(files)
    assert agg["disagreements"] == [{"from": a, "to": b, "sent_says": 10_000_000, "received_says": 1_000_000}]
    assert agg["links_compared"] == {"compared": 2, "not_compared": 0}
    text = "\n".join(summary_lines(agg))  # b -> a within the slack; a -> c: c did not report
    assert f"DISAGREE: {a[:12]} says it sent" in text and text.count("DISAGREE:") == 1
    assert "own report says" in text
    # honest reports that cannot be compared: a resumed with its identity (its report counts its
    # new life only), and c, whose report folded departed peers' rows (none for a)
    files[0].write_text(json.dumps(_report(a, {b: (0, 500_000), c: (5_000_000, 0)}, start=0.5, end=1.0)))
    c_report = _report(c, {"departed": (0, 10)})
    files.append(tmp_path / "c.json")
    files[-1].write_text(json.dumps(c_report))
    agg = summarise(files)
    assert agg["disagreements"] == [] and agg["links_compared"] == {"compared": 2, "not_compared": 1}
    assert "2 link direction(s) compared, 1 not" in "\n".join(summary_lines(agg))
    del c_report["peers"]["departed"]  # c kept every row: it never received what a says it sent
    files[-1].write_text(json.dumps(c_report))
    assert [(x["from"], x["to"]) for x in summarise(files)["disagreements"]] == [(a, c)]
    for broken in ({"peers": []}, {"peer_id": ["x"]}, {"end_time": "late"}, {"totals": {}},
                   {"peers": {b: {"sent": {"by_type": {"ping": {"frames": 1, "payload_bytes": 1, "wire_bytes": "1"}}},
                                  "received": {"by_type": {}}}}}):
        files[-1].write_text(json.dumps({**c_report, **broken}))
        with pytest.raises(ReportError, match="not a BlockTrain transfer report"):
            summarise(files)


def test_bt_peer_status_marks_what_members_announced_as_claimed():
    """`bt-peer status` showed a lying member 'alive on block 0' as fact:
    its blocks and role are what it announced, its state and last heard what the asked peer saw."""
    from blocktrain.p2p.reports import status_lines
    st = {"peer_id": "a" * 64, "addr": "127.0.0.1:1", "blocks": [0], "role": "train",
          "members": [{"peer_id": "b" * 64, "addr": "127.0.0.1:2", "blocks": [0], "role": "train",
                       "state": "alive", "last_heard_s": 0.4}],
          "traffic": {"sent": {"wire_bytes": 10}, "received": {"wire_bytes": 20}}}
    lines = status_lines(st)
    assert "as it says" in lines[0]
    head = next(i for i, line in enumerate(lines) if line.startswith("peer  "))
    assert "blocks*" in lines[head] and "role*" in lines[head] and lines[head + 1].startswith("b" * 16)
    assert any(line.startswith("* claimed") for line in lines)


async def test_the_page_carries_a_text_summary_for_curl_and_browsers_without_javascript(monkeypatch):
    """The page was blank without JavaScript ("loading..."): GET / carries the summary rendered by
    the peer (escaped: members' claims are never markup), and GET /status.txt is that text alone."""
    from conftest import mesh as mesh_

    peers = await mesh_(2, FAST, blocks=[(0,), (1,)])
    page = await SwarmPage(peers[0]).start()
    try:
        code, body = await _get(page.port, "/status.txt")
        text = body.decode()
        assert code == 200 and text.startswith("BlockTrain swarm, as this peer sees it")
        assert peers[0].id[:16] in text and peers[1].id[:16] in text and "bytes moved by this peer" in text
        code, body = await _get(page.port, "/")
        assert code == 200 and b"<noscript><pre>BlockTrain swarm, as this peer sees it" in body
        assert peers[1].id[:16].encode() in body
        monkeypatch.setattr(page, "text", lambda: "member says <script>alert(1)</script>\n")
        body = (await _get(page.port, "/"))[1]
        assert b"member says &lt;script&gt;alert(1)&lt;/script&gt;" in body and b"<script>alert" not in body
    finally:
        await page.stop()
        for p in peers:
            await p.stop()
