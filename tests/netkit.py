"""Network faults for the many-hosts tests (issue 20, items 13 and 14): a worker "on
another host" is a process in a network namespace of its own, reaching PostgreSQL over
its own veth link; the test drops every packet on that link, silently, as a partition or a
dead switch would — no RST, no ICMP — and later lets them through again.

* :func:`namespaces_unavailable` says why this machine cannot (not root, no ``ip``, no
  ``ip netns``, no ``pfifo`` qdisc to drop with): the tests skip with that reason.
* :class:`Netns` creates a namespace; :meth:`Netns.link` adds a veth pair (a /30 of
  10.231.0.0/16) and a TCP forwarder in this process from the link's host-side address to
  PostgreSQL (which listens on 127.0.0.1 only); :meth:`Link.drop` / :meth:`Link.heal`
  put / take away a ``pfifo limit 0`` qdisc on both ends of the link (every packet is
  dropped on the way out, in both directions); :meth:`Netns.close` removes everything.

The forwarder is part of "the network": when the link drops packets, the forwarder's own
connection to the server stays up, so the server sees a client that went silent (an idle
or idle-in-transaction session) — as it would behind a NAT or a load balancer.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from urllib.parse import urlsplit, urlunsplit

_counter = 0
_counter_lock = threading.Lock()


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def _tc_in(netns: str | None, *args: str) -> subprocess.CompletedProcess[str]:
    prefix = ["ip", "netns", "exec", netns] if netns else []
    return subprocess.run(
        [*prefix, "tc", *args], capture_output=True, text=True, check=False, timeout=30
    )


def namespaces_unavailable() -> str | None:
    """Why network namespaces cannot be used here (``None``: they can)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "the ip and tc commands (iproute2) are not installed"
    probe = f"flprobe{os.getpid() % 100000}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"ip netns add failed: {made.stderr.strip()}"
    try:
        dropping = _tc_in(probe, "qdisc", "add", "dev", "lo", "root", "pfifo", "limit", "0")
        if dropping.returncode != 0:
            return f"no pfifo qdisc to drop packets with: {dropping.stderr.strip()}"
    finally:
        _ip("netns", "del", probe, check=False)
    return None


class Forwarder:
    """A TCP forwarder: ``listen`` → ``target``, two threads per connection."""

    def __init__(self, listen: tuple[str, int], target: tuple[str, int]) -> None:
        self.target = target
        self._server = socket.create_server(listen, reuse_port=False)
        self.address: tuple[str, int] = self._server.getsockname()[:2]
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self._closed = False
        threading.Thread(target=self._accept, name="netkit-accept", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target, timeout=10)
                upstream.settimeout(None)
            except OSError:
                client.close()
                continue
            with self._lock:
                if self._closed:
                    client.close()
                    upstream.close()
                    return
                self._sockets += [client, upstream]
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(
                    target=self._pump, args=(src, dst), name="netkit-pump", daemon=True
                ).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            sockets, self._sockets = self._sockets, []
        with contextlib.suppress(OSError):
            self._server.close()
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                sock.close()


@dataclass
class Link:
    """One veth pair between this (the root) namespace and ``netns``."""

    netns: str
    host_if: str
    ns_if: str
    host_ip: str
    ns_ip: str
    forwarder: Forwarder | None = None
    dropping: bool = False

    def drop(self) -> None:
        """Drop every packet on this link from now on, both ways, silently."""
        for netns, dev in ((self.netns, self.ns_if), (None, self.host_if)):
            done = _tc_in(netns, "qdisc", "replace", "dev", dev, "root", "pfifo", "limit", "0")
            if done.returncode != 0:
                raise RuntimeError(f"cannot drop packets on {dev}: {done.stderr.strip()}")
        self.dropping = True

    def heal(self) -> None:
        """Let packets through again."""
        for netns, dev in ((self.netns, self.ns_if), (None, self.host_if)):
            _tc_in(netns, "qdisc", "del", "dev", dev, "root")
        self.dropping = False

    def url_through(self, url: str) -> str:
        """``url`` (a PostgreSQL URL of the local server) as seen from the namespace: its
        host and port replaced by the forwarder's."""
        assert self.forwarder is not None, "link.forward() first"
        host, port = self.forwarder.address
        parts = urlsplit(url)
        userinfo = parts.netloc.rpartition("@")[0]
        netloc = f"{userinfo}@{host}:{port}" if userinfo else f"{host}:{port}"
        return urlunsplit(parts._replace(netloc=netloc))

    def forward(self, target: tuple[str, int]) -> Forwarder:
        """Forward connections to the host-side address (any port) to ``target``."""
        self.forwarder = Forwarder((self.host_ip, 0), target)
        return self.forwarder


@dataclass
class Netns:
    """A network namespace for one test; :meth:`close` removes it with its links."""

    tag: str
    name: str = ""
    links: list[Link] = field(default_factory=list)

    def __post_init__(self) -> None:
        global _counter
        with _counter_lock:
            _counter += 1
            self._number = _counter
        self.name = f"fl{self.tag}{os.getpid() % 100000}n{self._number}"
        _ip("netns", "add", self.name)
        _ip("netns", "exec", self.name, "ip", "link", "set", "lo", "up")

    def link(self) -> Link:
        index = len(self.links)
        stem = f"{os.getpid() % 10000}{self._number % 10}{index}"
        host_if, ns_if = f"flh{stem}", f"fln{stem}"
        # A /30 per link: 10.231.<pid-derived>.<4 x link>; unique within this machine's run.
        third = (os.getpid() * 7 + self._number) % 250
        base = 4 * (index % 60)
        host_ip, ns_ip = f"10.231.{third}.{base + 1}", f"10.231.{third}.{base + 2}"
        _ip("link", "add", host_if, "type", "veth", "peer", "name", ns_if)
        _ip("link", "set", ns_if, "netns", self.name)
        _ip("addr", "add", f"{host_ip}/30", "dev", host_if)
        _ip("link", "set", host_if, "up")
        inside = ("netns", "exec", self.name, "ip")
        _ip(*inside, "addr", "add", f"{ns_ip}/30", "dev", ns_if)
        _ip(*inside, "link", "set", ns_if, "up")
        link = Link(self.name, host_if, ns_if, host_ip, ns_ip)
        self.links.append(link)
        return link

    def prefix(self) -> Sequence[str]:
        """The command prefix that runs a process in this namespace."""
        return ("ip", "netns", "exec", self.name)

    def close(self) -> None:
        for link in self.links:
            if link.forwarder is not None:
                link.forwarder.close()
            _ip("link", "del", link.host_if, check=False)
        _ip("netns", "del", self.name, check=False)
