"""The live swarm page: ``bt-peer start/join/serve --http 127.0.0.1:PORT``.

Rules:
- Read-only: GET ``/`` (one self-contained HTML page that polls the JSON), GET ``/status.json``
  (the swarm as this peer sees it) and GET ``/status.txt`` (a summary rendered here, for curl and
  text browsers; the HTML page carries it too, for a browser without JavaScript); anything else
  is 404, any other method 405. What members claim reaches the HTML escaped.
- Nothing secret: no keys, no identities' private parts, no file paths outside the report.
- Bounded: a request head of at most MAX_HEAD_BYTES read within HEAD_TIMEOUT_S, at most
  MAX_CONNECTIONS at once; bound to loopback unless the operator says otherwise.
- The view: this peer's status (members with blocks, roles, liveness), every member's own work
  section (what it trains, its step, round, group, recent valid CE), asked of the members every
  POLL_S seconds over the existing connections, this peer's traffic by kind and by remote peer,
  its training report's summary and its serving counters.
"""

from __future__ import annotations

import asyncio
import html
import json
import logging
import math
import time

from blocktrain.protocol import Status

from .reports import status_lines
from .services import PeerServices

log = logging.getLogger("blocktrain.p2p")

MAX_HEAD_BYTES = 8192
HEAD_TIMEOUT_S = 5.0
MAX_CONNECTIONS = 32
POLL_S = 3.0
# Keys of a member's work section shown on the page (a member's reply is cut to these, bounded).
WORK_KEYS = ("holds", "training_block", "state", "schedule", "step", "steps", "round", "group", "rounds_applied",
             "coverage_min", "curve")


MAX_SHOWN_BLOCKS = 64  # the page lists blocks 0..63 at most (a member's word is bounded)
MAX_COUNT = 2**48  # steps, rounds: anything larger is not a count


def _num(x):
    return x if type(x) in (int, float) and math.isfinite(x) else None


def _count(x, bound: int = MAX_COUNT):
    return x if type(x) is int and 0 <= x < bound else None


def clean_work(work: dict) -> dict:
    """A member's work section as the page may show it: the keys of WORK_KEYS, each of its type
    (numbers, short words, a short curve of numbers); anything else becomes None. A member with
    the swarm key can still be malicious: nothing it sends reaches the page as markup."""
    out = {k: _count(work.get(k), MAX_SHOWN_BLOCKS) for k in ("holds", "training_block")}
    out |= {k: _count(work.get(k)) for k in ("step", "steps", "round", "rounds_applied")}
    cov = _num(work.get("coverage_min"))
    out["coverage_min"] = cov if cov is not None and 0 <= cov <= 1 else None
    for k in ("state", "schedule"):
        v = work.get(k)
        out[k] = v if isinstance(v, str) and len(v) <= 40 and v.replace(" ", "").isalnum() else None
    group = work.get("group")
    out["group"] = [g for g in group[:64] if isinstance(g, str) and len(g) <= 64] if isinstance(group, list) else []
    curve = work.get("curve")
    out["curve"] = [[p[0], p[1], [_num(c) for c in p[2][:64]]] for p in curve[-20:]
                    if isinstance(p, list) and len(p) == 3 and _num(p[0]) is not None and _num(p[1]) is not None
                    and isinstance(p[2], list) and p[2] and all(_num(c) is not None for c in p[2][:64])] \
        if isinstance(curve, list) else []
    return out


CE_DOUBT_NATS = 0.5  # a member's head CE this far below ours on the same block is doubted


def doubts(w: dict, mine: dict | None, pid: str = "") -> list[str]:
    """What this peer doubts of member ``pid``'s work section ``w`` (cleaned): what contradicts
    itself, or, for a member of our own group while we train, what this peer sees of its own work
    (``mine``, None when it trains nothing): its step (a group trains in step) and its CE at the
    same step on the same block. A member with the swarm key may lie: the page shows its section
    as its claim, with these doubts beside it, and leaves doubted claims out of the per-block
    summary."""
    out = []
    step, steps, applied = w.get("step"), w.get("steps"), w.get("rounds_applied")
    if step is not None and steps is not None and step > steps:
        out.append(f"step {step} beyond its {steps} steps")
    if applied is not None and steps is not None and applied > steps:
        out.append(f"{applied} rounds applied in {steps} steps")
    if not mine:
        return out
    if steps is not None and mine.get("steps") is not None and steps != mine["steps"]:
        out.append(f"trains {steps} steps where this peer trains {mine['steps']}")
    if mine.get("state") != "training" or pid not in (mine.get("group") or []):
        return out
    if step is not None and mine.get("step") is not None and step > mine["step"] + max(50, (steps or 0) // 10):
        out.append(f"step {step}, far ahead of this peer's {mine['step']} in one group")
    ce, my_ce = _ce_at(w, mine)
    if ce is not None and my_ce is not None and ce < my_ce - CE_DOUBT_NATS:
        out.append(f"valid CE {ce:.3f}, far below this peer's {my_ce:.3f} at the same step")
    return out


def _ce_at(w: dict, mine: dict):
    """(its CE, ours) of the top head at the newest step both curves have (None, None if none)."""
    def points(x):
        try:
            return {p[0]: _num(p[2][-1]) for p in x.get("curve") or []}
        except (TypeError, IndexError, KeyError):
            return {}
    theirs, ours = points(w), points(mine)
    both = set(theirs) & set(ours)  # steps: numbers (clean_work)
    return (theirs[max(both)], ours[max(both)]) if both else (None, None)


class SwarmPage:
    def __init__(self, peer: PeerServices, host: str = "127.0.0.1", port: int = 0):
        self.peer, self.host, self.port = peer, host, port
        self.member_work: dict[str, dict] = {}  # peer id -> its work section, as it last told us
        self._server = None
        self._open = 0
        self._poller = None
        peer.on(Status, self._on_status, inline=True)

    async def start(self):
        self._server = await asyncio.start_server(self._handle, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        self._poller = self.peer.spawn(self._poll(), "swarm page poll")
        log.info("swarm page on http://%s:%d/", self.host, self.port)
        return self

    async def stop(self):
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    # --- the members' work sections -----------------------------------------------------------
    def _on_status(self, msg: Status, pc, pid):
        st = msg.status  # a member's reply to our poll (the node answers requests itself)
        work = st.get("work") if isinstance(st, dict) else None
        if isinstance(work, dict) and self.peer.member(pid) is not None:
            w = clean_work(work)
            self.member_work[pid] = w | {"time": time.time(), "doubts": doubts(w, self.peer.status().get("work"), pid)}

    async def _poll(self):
        while True:
            for m in self.peer.members():
                pc = self.peer.live_connection(m.peer_id)
                if pc is not None:
                    try:
                        pc.send_nowait(Status(status={}))
                    except ConnectionError:
                        pass
            for pid in [p for p in self.member_work if self.peer.member(p) is None]:
                del self.member_work[pid]
            await asyncio.sleep(POLL_S)  # the page's refresh cadence

    def view(self) -> dict:
        st = self.peer.status()
        rep = self.peer.report()
        tr = rep.get("training") or {}
        traffic = {pid: {"addr": t.get("addr"), "client": t.get("client"),
                         "sent": t["sent"]["total"]["wire_bytes"], "received": t["received"]["total"]["wire_bytes"]}
                   for pid, t in rep["peers"].items()}
        return {
            "peer_id": st["peer_id"], "addr": st["addr"], "blocks": st["blocks"], "role": st["role"],
            "reach": st.get("reach"), "time": time.time(), "members": st["members"], "work": st.get("work"),
            "member_work": self.member_work, "by_kind": rep["by_kind"], "totals": rep["totals"],
            "by_peer": traffic, "serving": rep.get("serving"),
            "training": {k: tr.get(k) for k in ("block", "state", "schedule", "sync", "sync_mode", "sync_choices",
                                                "step", "steps", "block_in_work",
                                                "round", "rounds_applied", "coverage_min", "ce_start", "ce_end",
                                                "head_ce", "busy", "memory", "curve", "phases")} if tr else None,
            "failed_rounds": len(tr.get("failed_rounds", [])) if tr else 0,
            "rejected_updates": tr.get("rejected_updates", []) if tr else [],
        }

    def text(self) -> str:
        """The page as plain text, rendered here: what ``bt-peer status`` prints of this peer, then
        its training, the members' claims of their work and its serving counters."""
        v = self.view()
        lines = ["BlockTrain swarm, as this peer sees it (the live page at / refreshes itself with JavaScript; "
                 "/status.json holds all of it)", *status_lines(self.peer.status())]
        tr = v["training"]
        if tr:
            ce = _num(tr.get("ce_end"))
            lines.append(f"training: block {tr.get('block')}, {tr.get('state')}, step {tr.get('step')}/{tr.get('steps')}"
                         + (f", valid CE {ce:.4f}" if ce is not None else "")
                         + f"; {v['failed_rounds']} failed rounds; rounds: {tr.get('sync_mode')}")
        for pid, w in sorted(v["member_work"].items()):
            lines.append(f"member {pid[:16]} says: {w.get('state')}, block {w.get('training_block')}, step "
                         f"{w.get('step')}/{w.get('steps')}" + "".join(f"; doubted: {d}" for d in w.get("doubts", [])))
        s = v["serving"]
        if s:
            lines.append(f"serving blocks {s.get('blocks')}: {s.get('requests')} requests served, "
                         f"{s.get('sessions')} open sessions")
        return "\n".join(lines) + "\n"

    # --- HTTP ------------------------------------------------------------------------------------
    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        if self._open >= MAX_CONNECTIONS:
            writer.close()
            return
        self._open += 1
        try:
            async with asyncio.timeout(HEAD_TIMEOUT_S):
                head = await reader.readuntil(b"\r\n\r\n")
            if len(head) > MAX_HEAD_BYTES:
                raise ValueError("head too large")
            method, path, _ = head.split(b"\r\n", 1)[0].decode("latin-1").split(" ", 2)
            if method != "GET":
                self._reply(writer, 405, "text/plain", b"read-only: GET / or /status.json\n")
            elif path.split("?")[0] == "/status.json":
                self._reply(writer, 200, "application/json", json.dumps(self.view()).encode())
            elif path.split("?")[0] == "/status.txt":
                self._reply(writer, 200, "text/plain; charset=utf-8", self.text().encode())
            elif path.split("?")[0] == "/":
                page = PAGE.replace(TEXT_SUMMARY, f"<noscript><pre>{html.escape(self.text())}</pre></noscript>")
                self._reply(writer, 200, "text/html; charset=utf-8", page.encode())
            else:
                self._reply(writer, 404, "text/plain", b"not found: GET / or /status.json\n")
            await writer.drain()
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError,
                ConnectionError):
            pass
        finally:
            self._open -= 1
            writer.close()

    @staticmethod
    def _reply(writer, code: int, ctype: str, body: bytes):
        reason = {200: "OK", 404: "Not Found", 405: "Method Not Allowed"}[code]
        writer.write(f"HTTP/1.1 {code} {reason}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
                     f"Cache-Control: no-store\r\nConnection: close\r\n\r\n".encode() + body)


TEXT_SUMMARY = "<!-- the summary, rendered by the peer -->"  # where GET / puts SwarmPage.text()
PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>BlockTrain swarm</title>
<style>
body{font:14px/1.4 system-ui,sans-serif;margin:1.5em;color:#222;background:#fafafa}
h1{font-size:1.3em;margin:0 0 .2em} h2{font-size:1.05em;margin:1.4em 0 .4em}
table{border-collapse:collapse;background:#fff} td,th{border:1px solid #ddd;padding:.25em .6em;text-align:left}
th{background:#f0f0f0} .num{text-align:right;font-variant-numeric:tabular-nums}
.alive{color:#1a7f37} .suspect{color:#b35900} .muted{color:#777} #err{color:#b00}
svg{background:#fff;border:1px solid #ddd}
</style></head><body>
<h1>BlockTrain swarm</h1><div id="me" class="muted">loading...</div><div id="err"></div>
<!-- the summary, rendered by the peer -->
<h2>Members</h2><table id="members"></table>
<h2>Blocks</h2><table id="blocks"></table>
<h2>Valid CE of each block's head while it trained</h2><svg id="curve" width="560" height="220"></svg>
<div id="legend" class="muted"></div>
<h2>Peers' work: what each member says of itself (a claim), with what this peer doubts of it</h2><table id="work"></table>
<h2>Bytes by kind</h2><table id="kinds"></table>
<h2>Bytes by peer</h2><table id="peers"></table>
<h2>Serving</h2><div id="serving" class="muted">-</div>
<script>
const $ = id => document.getElementById(id);
const mb = b => (b / 1048576).toFixed(1) + " MiB";
const esc = s => String(s).replace(/[&<>"]/g, c => ({"&":"&amp;","<":"&lt;",">":"&gt;",'"':"&quot;"}[c]));
function table(el, head, rows) {
  el.innerHTML = "<tr>" + head.map(h => "<th>" + h + "</th>").join("") + "</tr>" +
    rows.map(r => "<tr>" + r.map(c => "<td" + (typeof c === "number" ? ' class="num"' : "") + ">" + c + "</td>").join("") + "</tr>").join("");
}
const COLORS = ["#0969da", "#cf222e", "#1a7f37", "#8250df", "#bf8700", "#57606a"];
// A curve point is [step, seconds, heads]: heads[k] is head k's CE; the block in work is the last.
function byBlock(works) {
  const blocks = {};
  for (const w of works) for (const p of (w.curve || [])) {
    const b = p[2].length - 1; (blocks[b] = blocks[b] || new Map()).set(p[0], p[2][b]);
  }
  return blocks;
}
function curve(blocks) {
  const svg = $("curve"); const W = 560, H = 220, P = 40;
  const all = Object.values(blocks).flatMap(m => [...m.entries()]);
  if (!all.length) { svg.innerHTML = '<text x="20" y="110" fill="#777">no valid CE points yet (one comes every swarm.eval_every steps)</text>'; $("legend").textContent = ""; return; }
  const xs = all.map(p => p[0]), ys = all.map(p => p[1]);
  const x0 = Math.min(...xs), x1 = Math.max(...xs), y0 = Math.min(...ys), y1 = Math.max(...ys);
  const X = x => P + (W - 2 * P) * (x - x0) / ((x1 - x0) || 1), Y = y => H - P - (H - 2 * P) * (y - y0) / ((y1 - y0) || 1);
  svg.innerHTML = Object.entries(blocks).map(([b, m]) => {
    const pts = [...m.entries()].sort((a, c) => a[0] - c[0]);
    return '<polyline fill="none" stroke="' + COLORS[b % COLORS.length] + '" stroke-width="2" points="' +
      pts.map(p => X(p[0]) + "," + Y(p[1])).join(" ") + '"/>';
  }).join("") +
    '<text x="' + P + '" y="' + (H - 8) + '" fill="#555">step ' + x0 + '</text><text x="' + (W - P - 60) + '" y="' + (H - 8) + '" fill="#555">step ' + x1 + '</text>' +
    '<text x="4" y="' + (Y(y1) + 4) + '" fill="#555">' + y1.toFixed(3) + '</text><text x="4" y="' + (Y(y0) + 4) + '" fill="#555">' + y0.toFixed(3) + '</text>';
  $("legend").innerHTML = Object.keys(blocks).map(b => '<span style="color:' + COLORS[b % COLORS.length] + '">&#9632; block ' + b + "</span>").join(" &nbsp; ");
}
async function refresh() {
  try {
    const s = await (await fetch("status.json", {cache: "no-store"})).json();
    $("err").textContent = "";
    const r = s.reach || {};
    const reach = r.reachable === true ? "reachable" : r.reachable === false ? "not reachable (behind NAT or a firewall)"
      : "reachability not known";
    $("me").textContent = "peer " + s.peer_id.slice(0, 16) + " at " + (s.addr || "(no address)") + ", blocks [" + s.blocks +
      "], role " + s.role + "; " + reach + (r.observed ? ", seen from " + r.observed : "") +
      " - updated " + new Date(s.time * 1000).toLocaleTimeString();
    table($("members"), ["peer", "address", "blocks", "role", "liveness", "last heard"],
      [[s.peer_id.slice(0, 12) + " (this peer)", esc(s.addr), "[" + s.blocks + "]", s.role, '<span class="alive">alive</span>', "-"]]
      .concat(s.members.map(m => [m.peer_id.slice(0, 12), esc(m.addr), "[" + m.blocks + "]", m.role,
        '<span class="' + m.state + '">' + m.state + "</span>", m.last_heard_s.toFixed(1) + " s"])));
    const works = [], named = [];
    const row = (id, w) => { if (!w) return; if (!(w.doubts || []).length) named.push(w); works.push([id, w.holds, w.training_block ?? "-", esc(w.state),
      w.step + " / " + w.steps, w.round, (w.group || []).length, w.rounds_applied ?? "-",
      w.coverage_min == null ? "-" : (100 * w.coverage_min).toFixed(0) + "%",
      w.curve && w.curve.length ? w.curve[w.curve.length - 1][2].slice(-1)[0].toFixed(3) : "-",
      (w.doubts || []).length ? '<span class="suspect">' + w.doubts.map(esc).join("; ") + "</span>" : "-"]); };
    row(s.peer_id.slice(0, 12) + " (this peer)", s.work);
    for (const [pid, w] of Object.entries(s.member_work || {})) row(pid.slice(0, 12), w);
    table($("work"), ["peer", "holds block", "training block", "state", "step", "round", "group size",
      "rounds applied", "coverage (min)", "valid CE", "doubted by this peer"], works);
    const blocks = byBlock(named);
    const nb = Math.min(64, Math.max(-1, ...Object.keys(blocks).map(Number), ...named.map(w => w.holds ?? -1)) + 1);
    const rows = [];
    for (let b = 0; b < nb; b++) {
      const on = named.filter(w => w.training_block === b), holders = named.filter(w => w.holds === b);
      const pts = blocks[b] ? [...blocks[b].entries()].sort((a, c) => a[0] - c[0]) : [];
      const src = on.length ? on : holders;  // after its turn: what its holders report
      const cov = src.map(w => w.coverage_min).filter(c => c != null);
      const done = holders.length && holders.every(w => w.state === "done");
      rows.push([b, holders.length, on.length || "-",
        on.length ? Math.max(...on.map(w => w.step)) + " / " + on[0].steps : done ? "done" : "-",
        src.length ? Math.max(...src.map(w => w.rounds_applied || 0)) : "-",
        cov.length ? (100 * Math.min(...cov)).toFixed(0) + "%" : "-",
        pts.length ? pts[pts.length - 1][1].toFixed(3) + " at step " + pts[pts.length - 1][0] : "-"]);
    }
    table($("blocks"), ["block", "held by", "training it now", "step", "rounds applied", "coverage (min)",
      "latest valid CE of its head"], rows);
    curve(blocks);
    const kinds = new Set([...Object.keys(s.by_kind.sent), ...Object.keys(s.by_kind.received)]);
    table($("kinds"), ["kind", "sent", "received"], [...kinds].sort().map(k =>
      [k, mb((s.by_kind.sent[k] || {}).wire_bytes || 0), mb((s.by_kind.received[k] || {}).wire_bytes || 0)]));
    table($("peers"), ["remote peer", "address", "sent", "received"], Object.entries(s.by_peer).map(([p, t]) =>
      [p.slice(0, 12) + (t.client ? " (client)" : ""), esc(t.addr || "-"), mb(t.sent), mb(t.received)]));
    $("serving").textContent = s.serving ? ("blocks [" + s.serving.blocks + "], " + s.serving.requests + " requests served, " +
      s.serving.sessions + " open sessions" + Object.entries(s.serving.exact || {}).map(([b, how]) =>
      "; block " + b + ": " + how).join("")) : "not serving";
  } catch (e) { $("err").textContent = "cannot reach the peer: " + e; }
}
refresh(); setInterval(refresh, 2000);
</script></body></html>
"""
