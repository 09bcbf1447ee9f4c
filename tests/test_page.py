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
from blocktrain.p2p.swarm import SwarmConfig, SwarmTrainer
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
    sc = SwarmConfig(round_timeout_s=20, join_timeout_s=3, eval_windows=2, eval_every=10, min_group=3)
    data = as_tensor(read_split("valid"))
    sps = [SwarmTrainer(p, i, mc, tc, sc, tmp_path / f"w{i}", data, data) for i, p in enumerate(peers)]
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
        assert v["training"]["state"] == "done" and v["training"]["curve"]
        assert set(v["member_work"]) == {peers[1].id, peers[2].id}  # the others' own work sections
        assert all(w["step"] == 90 for w in v["member_work"].values())
        assert "update" in v["by_kind"]["sent"]
        text = body.decode()
        assert "swarm_key" not in text and "private" not in text and str(tmp_path) not in text
        code, body = await _get(page.port, "/")
        assert code == 200 and b"<title>BlockTrain swarm</title>" in body
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
        assert "(this peer)" in dom and "polyline" in dom and "update" in dom and "cannot reach" not in dom
        proc = await asyncio.create_subprocess_exec(CHROMIUM, *common, "--window-size=900,1400",
                                                    f"--screenshot={shot}", url, stdout=asyncio.subprocess.DEVNULL,
                                                    stderr=asyncio.subprocess.DEVNULL)
        await asyncio.wait_for(proc.wait(), 120)
        assert shot.exists() and shot.stat().st_size > 10_000
        keep = os.environ.get("BT_PAGE_SCREENSHOT")  # results/page.png is made with this set
        if keep:
            Path(keep).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(shot, keep)
    finally:
        await page.stop()
        for p in peers:
            await p.stop()
