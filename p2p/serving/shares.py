"""Whose share of a serving hop's compute a client takes (fair.py's client), by its address.

Rules:
- A hop that holds the client's connection (hop 0, the last hop) knows the address it connects
  from; a middle hop does not (it sees the hop below): it counts the address hop 0 passed on
  (``client_addr``, r12) as the word of the member that forwarded it, each member's addresses
  apart, so a member can speak only for the traffic it forwards; the client's identity where
  there is none.
- Identities are free, addresses are not. The first ``PER_ADDRESS`` identities a hop sees from
  one address have a share each (with the hop's credit for a client back from a round trip);
  every further identity from that address takes one share with all the others past the first
  ``PER_ADDRESS`` of it. A flood of identities from one address so takes at most
  ``PER_ADDRESS + 1`` shares, not one each. One: each share a flood holds is one the client must
  share the hop with, and a share whose identities are all busy has no idle credit (96
  identities from another address, results/floods/README.md: 8 made a client 3.5x-17.8x slower,
  none 2.6x-3.0x); the first identity of an address, the one that came before any flood from
  it, keeps its own (8 identities x 8 traversals from the client's own address: 90x slower with
  none).
- An address is an IPv4 address (also one mapped into IPv6) or an IPv6 /64 (one home's prefix).
- Bounded: at most ``MAX_ADDRESSES`` addresses are remembered (the least recently seen goes,
  and with it the identities it had), ``PER_ADDRESS`` identities each.
- What it does not stop: an attacker on its victims' own address can take that address's first
  shares before them, and flood from many addresses takes a share per address.
"""

from __future__ import annotations

import collections
import ipaddress

PER_ADDRESS = 1  # identities of one address with a share of their own at a hop
MAX_ADDRESSES = 4096  # addresses remembered


def address_share(peer_addr) -> str | None:
    """The address of a connection's remote end (``peer_addr``, the socket's) as shares count it:
    an IPv4 address (also one mapped into IPv6), an IPv6 /64, None where it is not an IP."""
    if not isinstance(peer_addr, tuple) or not peer_addr:
        return None
    try:
        ip = ipaddress.ip_address(str(peer_addr[0]).split("%")[0])
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return str(ip.ipv4_mapped)
    return str(ipaddress.ip_network(f"{ip}/64", strict=False)) if ip.version == 6 else str(ip)


class Shares:
    """The share each client takes, by the address it connects from (the rules above)."""

    def __init__(self, per_address: int = PER_ADDRESS, max_addresses: int = MAX_ADDRESSES):
        self.per_address, self.max_addresses = per_address, max_addresses
        self._ids: collections.OrderedDict[str, set[str]] = collections.OrderedDict()  # least recent first

    def of(self, client: str, address: str | None) -> str:
        """The share ``client`` takes, connecting from ``address`` (None: not known here)."""
        if address is None:
            return client
        ids = self._ids.pop(address, None)
        self._ids[address] = ids = ids if ids is not None else set()
        if len(self._ids) > self.max_addresses:
            self._ids.popitem(last=False)
        if client in ids or len(ids) < self.per_address:
            ids.add(client)
            return client
        return f"address {address}"
