"""Reachability: the address members see this peer from, whether they can dial it, and the
address it advertises (PROTOCOL.md section 4: the hello keys ``seen``, ``dial_back``, ``dialed``).

Rules:
- Observed address: a responder's hello tells the initiator ``seen``, the "host:port" the
  initiator's connection comes from (transport.py). Behind a home router that is the router's
  address and a port it picked; the host is where the world sees this peer.
- Dial-back, as libp2p's AutoNAT: until a member has reached this peer, the hello of every
  connection it opens or accepts carries ``dial_back``, the port it listens on (a first peer that
  never dials out asks the members that dial it). A member asked dials the host that connection
  reaches (where an inbound one comes from; the host it dialled for an outbound one), never
  another (no member can be made to dial a third party), at that port: once per asking identity
  per ``DIAL_BACK_EVERY_S`` (a refused ask is asked again on the next connection),
  ``MAX_DIAL_BACKS`` at once in all (identities are free), within ``DIAL_BACK_TIMEOUT_S`` to
  connect and as long for the handshake. Its hello there carries ``dialed``, the address it
  dialled, and it drops the connection once the handshake is done: a ``dialed`` connection
  carries nothing else and is never a member's (connections.py). Each side counts its bytes
  under the other's identity.
- Reachable: a member's ``dialed`` connection arrived at our listener. Not reachable: we asked
  and none arrived within ``DIAL_BACK_WAIT_S`` of the first ask a member took; a later one still
  counts. A peer listening on a given address (not 0.0.0.0 or ::) that a member connected to is
  reachable there too.
- The address advertised (hellos, ANNOUNCE, PEER_LIST): ``--advertise`` as given; else the
  listen address when its host is a given one, unless it is loopback in a swarm reached at
  another host (nobody there can dial it); else none ("") until a dial-back confirms one, then
  the address the member dialled. Advertised as none, members never dial this peer (as a
  client's record), it dials them, and the connections it opens carry everything both ways.
- A member's ``seen`` and ``dialed`` are its word about us: a lying key holder can make this
  peer advertise an address others cannot dial (they fail to dial it; this peer still dials
  them). The status names who confirmed the address. A ``seen`` whose host is not an IP address
  (what a responder sees a connection come from always is) is not taken: its text never reaches
  logs or the status.
- Loopback stays on its machine: a dial-back that confirms a loopback address says nothing (not
  reachable, nothing advertised) once this peer joined a swarm at another host, and it goes on
  asking; a PEER_LIST to a member elsewhere leaves out
  the records of loopback addresses (``for_member``): nobody there can dial them.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import ipaddress
import logging
import time
from typing import TYPE_CHECKING, Callable

from blocktrain.protocol import Role

from .transport import make_connection, open_connection

if TYPE_CHECKING:
    from .node import Peer
    from .transport import PeerConnection

log = logging.getLogger("blocktrain.p2p")

UNSPECIFIED_HOSTS = ("", "0.0.0.0", "::")
DIAL_BACK_WAIT_S = 10.0  # after the first ask a member took: no dial-back by then means not reachable
DIAL_BACK_EVERY_S = 10.0  # one dial-back per asking identity this often
DIAL_BACK_TIMEOUT_S = 4.0  # a dial-back's connect, and its handshake: both within DIAL_BACK_WAIT_S
MAX_DIAL_BACKS = 4  # dial-backs in flight at once, in all
MAX_ASKERS = 1024  # identities remembered as having asked (identities are free: the oldest go)
MAX_SEEN = 16  # members whose ``seen`` is kept (the latest)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def is_ip(host: str) -> bool:
    """An IP address, without an IPv6 scope (whose text after ``%`` is free)."""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return "%" not in host


def for_member(records, member_host: str | None) -> tuple:
    """The PEER_LIST records for a member at ``member_host`` (None: not known): loopback addresses
    only for a member on loopback (nobody elsewhere can dial them)."""
    if member_host is None or is_loopback(member_host):
        return tuple(records)
    return tuple(r for r in records if not ((where := split_addr(r.addr)) and is_loopback(where[0])))


def split_addr(addr: str) -> tuple[str, int] | None:
    """("host", port) of a "host:port", or None when it is not one."""
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 1 << 16:
        return None
    return host.strip("[]"), int(port)


class Reachability:
    """This peer's reachability and advertised address (the rules above); the peer owns it."""

    def __init__(self, peer: "Peer", account: Callable[[str, "PeerConnection"], None]):
        """``account(pid, pc)``: adds a dial-back connection's bytes to the traffic rows, under ``pid``."""
        self.peer, self.account = peer, account
        self.reachable: bool | None = None  # None: not known (yet)
        self.confirmed_by = ""  # the member whose connection showed it
        self.why = ""  # for people: how it was learnt, or why it is not reachable
        self.seen: collections.OrderedDict[str, str] = collections.OrderedDict()  # member -> "host:port"
        self.asks = 0  # hellos that asked for a dial-back
        self.dial_backs = {"asked_of_us": 0, "dialled": 0, "reached": 0, "refused": 0}
        self._deadline_set = False  # the wait for a dial-back runs from the first ask a member took
        self._answered: collections.OrderedDict[str, float] = collections.OrderedDict()  # asker -> when
        self._in_flight = 0
        self._elsewhere = False  # we joined a swarm at a host that is not loopback
        self._watchers: list[Callable[["Reachability"], None]] = []

    # --- the address we advertise ------------------------------------------------------------
    def listen_addr(self) -> str:
        """The address to advertise once listening (``--advertise``, a given host, or none)."""
        p = self.peer
        if p.advertise:
            return p.advertise
        return "" if p.host in UNSPECIFIED_HOSTS else f"{p.host}:{p.port}"

    def joining(self, host: str) -> None:
        """We join through ``host``: a loopback listen address is nobody's to dial there."""
        p = self.peer
        self._elsewhere = self._elsewhere or not is_loopback(host)
        if not p.advertise and is_loopback(p.host) and not is_loopback(host) and p.addr:
            log.warning("listening on %s, which members at %s cannot dial: advertising no address (give "
                        "--listen a routable host, or --advertise)", p.addr, host)
            p.set_addr("")

    def dial_back_port(self) -> int | None:
        """The port a connection's hello asks to be dialled back at (until a member reached us), or None."""
        p = self.peer
        if self.reachable or p.role == "client" or not p.port:
            return None
        return self.dial_back_target()

    def asked_member(self) -> None:
        """A member took a connection whose hello asked for a dial-back (a dial that never
        connected asked nobody): the wait for a dial-back runs from the first."""
        self.asks += 1
        if not self._deadline_set:
            self._deadline_set = True
            self.peer.spawn(self._deadline(), "dial-back deadline")

    async def _deadline(self) -> None:
        await asyncio.sleep(DIAL_BACK_WAIT_S)
        if self.reachable is not None:
            return
        p, seen = self.peer, self.observed_host()
        told = split_addr(p.advertise) if p.advertise else None
        given = told[0] if told else p.host
        if given not in UNSPECIFIED_HOSTS and seen and seen != given:  # they dial back where they see us
            self.why = f"members see this peer from {seen}, not {given}: whether they can dial {given} is not known"
            log.info("reachability not known: %s", self.why)
        else:
            self.reachable = False
            self.why = (f"no member could dial it back at port {self.dial_back_target()} within "
                        f"{DIAL_BACK_WAIT_S:g} s: behind a router or firewall that drops connections from outside "
                        "(forward the port, or give --advertise); it still dials members, which carry everything")
            log.info("not reachable: %s", self.why)
        self._changed()

    def dial_back_target(self) -> int:
        where = split_addr(self.peer.advertise) if self.peer.advertise else None
        return where[1] if where else self.peer.port

    # --- what members tell us ------------------------------------------------------------------
    def observed(self, pid: str, seen: object) -> None:
        """A member we dialled says it sees us from ``seen``."""
        if not isinstance(seen, str) or (where := split_addr(seen)) is None or not is_ip(where[0]):
            return
        self.seen.pop(pid, None)
        self.seen[pid] = seen
        while len(self.seen) > MAX_SEEN:
            self.seen.popitem(last=False)

    def observed_host(self) -> str:
        """The host most members we dialled see us from ("" if none told us)."""
        hosts = collections.Counter(split_addr(s)[0] for s in self.seen.values())  # type: ignore[index]
        return hosts.most_common(1)[0][0] if hosts else ""

    def reached(self, pid: str, dialed: object, *, dial_back: bool, local: object = None) -> None:
        """Member ``pid`` connected to our listener: by a dial-back at ``dialed`` (``local``: the
        address it arrived at, our end of the socket), or (not ``dial_back``) as a member, which
        shows a given listen address reachable."""
        p = self.peer
        if not dial_back and p.host in UNSPECIFIED_HOSTS:
            return  # reachable at some address of ours, but which one the member dialled is unknown
        if dial_back:
            self.dial_backs["reached"] += 1
        if self.reachable:
            return
        addr = self._confirmed(dialed, local) if dial_back else f"{p.host}:{p.port}"
        if dial_back and self._elsewhere and addr and is_loopback(split_addr(addr)[0]):  # type: ignore[index]
            return  # a member on our machine dialled loopback: nothing said of the swarm elsewhere
        self.reachable, self.confirmed_by = True, pid
        self.why = (f"member {pid[:12]} connected to {addr}" if not dial_back else
                    f"member {pid[:12]} dialled {addr} back" if addr else
                    f"member {pid[:12]} dialled us back at an address no member sees us at")
        log.info("reachable: %s", self.why)
        if addr and not p.advertise and p.host in UNSPECIFIED_HOSTS and not p.addr:
            p.set_addr(addr)
        self._changed()

    def _confirmed(self, dialed: object, local: object) -> str:
        """The address a dial-back confirms: what the member says it dialled, if that is the port we
        asked at and a host we know to be ours (where members see us from, or where the connection
        arrived); else "" (reachable, at an address we cannot name)."""
        where = split_addr(dialed) if isinstance(dialed, str) else None
        if where is None or where[1] != self.dial_back_target():
            return ""
        ours = {split_addr(s)[0] for s in self.seen.values()}  # type: ignore[index]
        if isinstance(local, tuple) and local:
            ours.add(str(local[0]))
        return dialed if where[0] in ours else ""  # type: ignore[return-value]

    def on_change(self, fn: Callable[["Reachability"], None]) -> None:
        self._watchers.append(fn)

    def _changed(self) -> None:
        for fn in list(self._watchers):
            fn(self)
        self.peer.notify()

    # --- dialling members back -------------------------------------------------------------------
    def asked(self, pid: str, pc: "PeerConnection", port: object) -> None:
        """Member ``pid``'s hello on ``pc`` asks to be dialled back at ``port``, at the host ``pc``
        reaches (inbound: where it comes from; outbound: the host we dialled)."""
        self.dial_backs["asked_of_us"] += 1
        now = time.monotonic()
        last = self._answered.get(pid)
        seen = pc.peer_addr
        if type(port) is not int or not isinstance(seen, tuple) or self._in_flight >= MAX_DIAL_BACKS or \
                (last is not None and now - last < DIAL_BACK_EVERY_S) or self.peer.stopping:
            self.dial_backs["refused"] += 1
            return
        self._answered.pop(pid, None)
        self._answered[pid] = now
        while len(self._answered) > MAX_ASKERS:
            self._answered.popitem(last=False)
        self._in_flight += 1
        self.peer.spawn(self._dial_back(pid, str(seen[0]), port), f"dial back {pid[:12]}")

    async def _dial_back(self, pid: str, host: str, port: int) -> None:
        p = self.peer
        addr = f"{host}:{port}"
        conn = make_connection(Role.INITIATOR, p.identity, p.swarm_key, allowlist={pid}, seal=p.seal,
                               info={"addr": p.addr, "blocks": list(p.blocks), "role": p.role, "dialed": addr})
        try:
            self.dial_backs["dialled"] += 1
            quick = dataclasses.replace(p.timeouts, connect_s=min(p.timeouts.connect_s, DIAL_BACK_TIMEOUT_S),
                                        handshake_s=min(p.timeouts.handshake_s, DIAL_BACK_TIMEOUT_S))
            pc = await open_connection(host, port, conn, quick, name=f"dial-back {addr}")
        except (OSError, ConnectionError) as e:
            log.info("dial-back of %s at %s failed: %s", pid[:12], addr, e)
            return
        finally:
            self._in_flight -= 1
        pc.abort("dial-back done")  # the asker closes it too, as soon as its hello is read: nothing more to say
        try:
            await pc.wait_closed()
        finally:
            self.account(pid, pc)

    # --- what the status says --------------------------------------------------------------------
    def status(self) -> dict:
        p = self.peer
        return {"addr": p.addr, "listen": f"{p.host}:{p.port}", "advertise": p.advertise or "",
                "observed": self.observed_host(), "reachable": self.reachable,
                "confirmed_by": self.confirmed_by[:12], "why": self.why, "asks": self.asks, **self.dial_backs}

    def line(self) -> str:
        """One line for people: reachable or not, and the address others dial."""
        if self.reachable:
            return f"reachable at {self.peer.addr or '(an address no member sees us at)'}: {self.why}"
        if self.reachable is False:
            seen = self.observed_host()
            return "not reachable from the swarm" + (f" (seen from {seen})" if seen else "") + f": {self.why}"
        return "reachability not known yet" + (" (asked members to dial back)" if self.asks else "")
