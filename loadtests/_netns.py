"""Hosts as Linux network namespaces: a hub host with the service address, spokes linked point to point.

Why point to point and no bridge: a Linux bridge's traffic can pass the root namespace's iptables FORWARD
chain (br_netfilter, which Docker loads with a DROP policy), so a test through a bridge depends on the
machine's firewall. Here no packet is forwarded: the hub host (``hosts[0]``) carries the service address
(``service_ip``, a /32 on its loopback) and every other host, and the root namespace (the harness: health
checks, the ledger), has its own veth pair to the hub with a route to that address.

Every name (namespaces, veth interfaces) carries a random tag, and :meth:`Topology.destroy` removes only
what this object created, after SIGKILLing, by pid, every process left in its namespaces. Needs root and
iproute2.
"""

from __future__ import annotations

import ipaddress
import os
import random
import signal
import subprocess
import uuid


def _ip(*args: str, netns: str | None = None, check: bool = True) -> str:
    argv = ["ip", *(["-n", netns] if netns else []), *args]
    res = subprocess.run(argv, capture_output=True, text=True)
    if check and res.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {res.stderr.strip()}")
    return res.stdout


def _free_subnet() -> ipaddress.IPv4Network:
    """A 10.x.y.0/24 block (split into /26 links) that no interface of the root namespace uses."""
    used = [ipaddress.ip_interface(w).network for line in _ip("-4", "-o", "addr").splitlines()
            for w in line.split() if "/" in w and w[0].isdigit()]
    for _ in range(200):
        net = ipaddress.IPv4Network(f"10.{random.randint(64, 250)}.{random.randint(0, 255)}.0/24")
        if not any(net.overlaps(u) for u in used):
            return net
    raise RuntimeError("no free 10.x.y.0/24 block for the host namespaces")


class Topology:
    """``n`` network namespaces; ``hosts[0]`` is the hub that holds :attr:`service_ip`."""

    def __init__(self, n: int = 3) -> None:
        if n < 2:
            raise ValueError(f"a topology needs at least 2 hosts, got {n}")
        self.tag = uuid.uuid4().hex[:6]
        self.hosts = [f"rh-{self.tag}-{i}" for i in range(n)]
        net = _free_subnet()
        links = list(net.subnets(new_prefix=28))  # link 0: root <-> hub; link i: host i <-> hub
        self.service_ip = str(links[-1][1])
        self._links = links[:n]
        self._created_ns: list[str] = []
        self._root_veth: str | None = None

    def create(self) -> "Topology":
        hub = self.hosts[0]
        for ns in self.hosts:
            _ip("netns", "add", ns)
            self._created_ns.append(ns)
            _ip("link", "set", "lo", "up", netns=ns)
        _ip("addr", "add", f"{self.service_ip}/32", "dev", "lo", netns=hub)
        for i, ns in enumerate(self.hosts):
            link = self._links[i]
            hub_end, far_end = f"rh{self.tag}h{i}", f"rh{self.tag}f{i}"
            _ip("link", "add", hub_end, "netns", hub, "type", "veth", "peer", "name", far_end)
            if i == 0:  # the root namespace's link (far end stays in root)
                self._root_veth = far_end
                far_ns = None
            else:
                _ip("link", "set", far_end, "netns", ns)
                far_ns = ns
            _ip("addr", "add", f"{link[1]}/{link.prefixlen}", "dev", hub_end, netns=hub)
            _ip("addr", "add", f"{link[2]}/{link.prefixlen}", "dev", far_end, netns=far_ns)
            _ip("link", "set", hub_end, "up", netns=hub)
            _ip("link", "set", far_end, "up", netns=far_ns)
            _ip("route", "add", f"{self.service_ip}/32", "via", str(link[1]), netns=far_ns)
        return self

    def prefix(self, host: int) -> list[str]:
        """The argv prefix that runs a command on host ``host``."""
        return ["ip", "netns", "exec", self.hosts[host]]

    def pids(self, host: int) -> list[int]:
        """Every process running in host ``host``'s namespace."""
        return [int(p) for p in _ip("netns", "pids", self.hosts[host], check=False).split()]

    def kill_host(self, host: int) -> list[int]:
        """SIGKILL every process of the host (by pid, from the namespace's pid list); returns them."""
        pids = self.pids(host)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return pids

    def set_link(self, host: int, up: bool) -> None:
        """Cut (or restore) a host's link to the hub: a dead host's address stops answering too."""
        _ip("link", "set", f"rh{self.tag}h{host}", "up" if up else "down", netns=self.hosts[0])

    def destroy(self) -> None:
        """SIGKILL what is left in our namespaces, delete them (their veths go with them) and our root veth."""
        for i, ns in enumerate(self.hosts):
            if ns in self._created_ns:
                self.kill_host(i)
        for ns in reversed(self._created_ns):
            _ip("netns", "del", ns, check=False)
        self._created_ns.clear()
        if self._root_veth is not None:
            _ip("link", "del", self._root_veth, check=False)  # normally gone with the hub's end
            self._root_veth = None

    def leftovers(self) -> list[str]:
        """Namespaces or links with this topology's tag that still exist (empty after :meth:`destroy`)."""
        names = _ip("netns", "list", check=False) + _ip("-o", "link", check=False)
        return sorted({w.split("@")[0].rstrip(":") for w in names.split() if self.tag in w})
