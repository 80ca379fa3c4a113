"""Hosts with their own addresses on one machine: Linux network namespaces on a bridge, and a
Ray cluster with a node in each.

    Hosts(n)          n namespaces "hosts", each joined by a veth pair to one bridge, addresses
                      10.<net>.0.1..n/24; the bridge itself holds 10.<net>.0.254, so a process in
                      this (the root) namespace -- the test, the driver -- reaches every host.
    host.link(False)  its veth set down: a partition (packets vanish, no reset is sent)
    hosts.throttle(a, b, rate)
                      the a<->b pair slowed by tc's tbf (under an htb class that a u32 filter on the
                      peer's address selects), so only that pair's traffic is slowed, both ways
    RayHosts(hosts)   a Ray head in the root namespace on the bridge's address (no CPUs: it only
                      carries the driver's actors) and a worker node in every host (`ip netns exec
                      NS ray start`), each with a --temp-dir and SPECPIPE_CACHE_DIR of its own and
                      SPECPIPE_USE_SHARED_PATH=0, so every stage's weights are streamed from the
                      driver as to a machine that lacks the file.

Everything is torn down by close() (and the context managers), a failure half-way included.
Ray processes are found and ended by their session directory under the node's own temp dir, never
with `ray stop` (which stops every Ray cluster on the machine, other people's included).
NamespacesUnavailable says why namespaces cannot be made (no root, no `ip`): tests skip with it.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Optional


class NamespacesUnavailable(RuntimeError):
    """Network namespaces cannot be made here; the message is the reason a test skips with."""


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=check)


def tc(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["tc", *args], capture_output=True, text=True, timeout=30, check=check)


@dataclass
class Host:
    ns: str  # the namespace's name
    ifname: str  # the veth end inside the namespace
    peer: str  # its other end, on the bridge
    address: str

    def cmd(self, *argv: str) -> list[str]:
        """`argv` as run inside this host's namespace."""
        return ["ip", "netns", "exec", self.ns, *argv]

    def link(self, up: bool) -> None:
        """Down: the host is cut off; frames to and from it vanish (no RST, no ICMP), as when a
        cable is pulled or a switch port dies."""
        ip("-n", self.ns, "link", "set", self.ifname, "up" if up else "down")


class Hosts:
    """`n` namespaces on a bridge (see the module docstring). Use as a context manager, or call
    close(); both remove everything made, whatever state it was left in."""

    def __init__(self, n: int, net: Optional[int] = None) -> None:
        if not 1 <= n <= 9:
            raise ValueError(f"1 to 9 hosts, got {n}")
        if sys.platform != "linux" or os.geteuid() != 0:
            raise NamespacesUnavailable("network namespaces need root on Linux")
        if shutil.which("ip") is None:
            raise NamespacesUnavailable("the `ip` command (iproute2) is not installed")
        tag = f"{os.getpid() % 100000}{uuid.uuid4().hex[:2]}"  # unique, short: interface names <= 15
        # A /24 of its own per process (several test runs may share the machine).
        self.net = net if net is not None else 100 + (os.getpid() + int(tag[-2:], 16)) % 150
        self.bridge = f"spbr{tag}"
        self.bridge_address = f"10.{self.net}.0.254"
        self.hosts = [Host(f"specpipe-{tag}-{i}", f"spv{tag}{i}", f"spp{tag}{i}", f"10.{self.net}.0.{i + 1}")
                      for i in range(n)]
        self._made_ns: list[str] = []
        self._made_bridge = False
        self._shaped: set[str] = set()  # namespaces with a qdisc of ours on their veth
        try:
            self._make()
        except BaseException:
            self.close()
            raise

    def _make(self) -> None:
        try:
            ip("netns", "add", self.hosts[0].ns)
        except (subprocess.CalledProcessError, FileNotFoundError) as e:
            raise NamespacesUnavailable(f"cannot create network namespaces here: "
                                        f"{getattr(e, 'stderr', '') or e}".strip()) from None
        self._made_ns.append(self.hosts[0].ns)
        ip("link", "add", self.bridge, "type", "bridge")
        self._made_bridge = True
        ip("addr", "add", f"{self.bridge_address}/24", "dev", self.bridge)
        ip("link", "set", self.bridge, "up")
        for i, h in enumerate(self.hosts):
            if i:
                ip("netns", "add", h.ns)
                self._made_ns.append(h.ns)
            ip("link", "add", h.ifname, "type", "veth", "peer", "name", h.peer)
            ip("link", "set", h.peer, "master", self.bridge)
            ip("link", "set", h.peer, "up")
            ip("link", "set", h.ifname, "netns", h.ns)
            ip("-n", h.ns, "addr", "add", f"{h.address}/24", "dev", h.ifname)
            ip("-n", h.ns, "link", "set", h.ifname, "up")
            ip("-n", h.ns, "link", "set", "lo", "up")

    def __getitem__(self, i: int) -> Host:
        return self.hosts[i]

    def __len__(self) -> int:
        return len(self.hosts)

    def __enter__(self) -> "Hosts":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- slow links ------------------------------------------------------------------------------
    def throttle(self, a: Host, b: Host, rate: str = "10mbit") -> None:
        """The a<->b pair at `rate`, both ways, through the tbf the issue names (burst 32kbit,
        latency 400ms); their traffic with every other host and the driver is untouched. An htb
        root whose default class is unlimited, a class for the peer with the tbf under it, and a
        u32 filter on the peer's address (this kernel has no prio qdisc and no flower filter)."""
        for src, dst in ((a, b), (b, a)):
            dev = ["dev", src.ifname]
            if src.ns not in self._shaped:
                tc("-n", src.ns, "qdisc", "add", *dev, "root", "handle", "1:", "htb", "default", "1", "r2q", "100000")
                tc("-n", src.ns, "class", "add", *dev, "parent", "1:", "classid", "1:1", "htb", "rate", "100gbit")
                self._shaped.add(src.ns)
            minor = 10 + self.hosts.index(dst)
            tc("-n", src.ns, "class", "add", *dev, "parent", "1:", "classid", f"1:{minor}", "htb", "rate", "100gbit")
            tc("-n", src.ns, "qdisc", "add", *dev, "parent", f"1:{minor}", "handle", f"{minor}:", "tbf", "rate", rate,
               "burst", "32kbit", "latency", "400ms")
            tc("-n", src.ns, "filter", "add", *dev, "parent", "1:", "protocol", "ip", "prio", "1", "u32", "match", "ip",
               "dst", f"{dst.address}/32", "flowid", f"1:{minor}")

    def throttle_host(self, h: Host, rate: str = "10mbit") -> None:
        """Everything a host sends at `rate`: the plain `tc qdisc add dev X root tbf` of a slow
        uplink."""
        tc("-n", h.ns, "qdisc", "add", "dev", h.ifname, "root", "tbf", "rate", rate, "burst", "32kbit",
           "latency", "400ms")
        self._shaped.add(h.ns)

    def unthrottle(self) -> None:
        for h in self.hosts:
            if h.ns in self._shaped:
                tc("-n", h.ns, "qdisc", "del", "dev", h.ifname, "root", check=False)
        self._shaped.clear()

    def close(self) -> None:
        self.unthrottle()  # deleting the namespace would drop them too; this says so
        for ns in self._made_ns:  # deleting a namespace deletes the veth end in it, and so its peer
            ip("netns", "del", ns, check=False)
        self._made_ns.clear()
        if self._made_bridge:
            ip("link", "del", self.bridge, check=False)
            self._made_bridge = False
        leftovers = ip("-o", "link", "show", check=False).stdout
        for h in self.hosts:  # should be gone already; make sure
            if f" {h.peer}@" in leftovers or f" {h.peer}:" in leftovers:
                ip("link", "del", h.peer, check=False)


# -- Ray on the hosts -------------------------------------------------------------------------------

def free_port(address: str) -> int:
    with socket.socket() as s:
        s.bind((address, 0))
        return s.getsockname()[1]


def node_processes(temp_dir: Path) -> list[int]:
    """Pids of the Ray processes of the node started with `temp_dir`: those that name their
    session directory (under the temp dir) on their command line -- the GCS, the raylet, the
    agents -- and all their descendants: the workers and actors, whose command line Ray rewrites
    to "ray::Class.method"."""
    needle = str(temp_dir).rstrip("/") + "/"
    parent: dict[int, int] = {}
    roots = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        parent[int(entry)] = int(stat[stat.rindex(")") + 2:].split()[1])
        if needle in cmd:
            roots.append(int(entry))
    found, frontier = set(roots), list(roots)
    while frontier:
        p = frontier.pop()
        kids = [c for c, pp in parent.items() if pp == p and c not in found]
        found.update(kids)
        frontier += kids
    return sorted(found)


def namespace_processes(ns: str) -> list[int]:
    """Every process in network namespace `ns`: all that runs on that "host"."""
    out = ip("netns", "pids", ns, check=False).stdout.split()
    return [int(p) for p in out if p.isdigit() and int(p) != os.getpid()]


def signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def end_processes(pids: list[int], grace_s: float = 5.0) -> None:
    """SIGCONT (a frozen one cannot act on SIGTERM), SIGTERM, then SIGKILL what is left: Ray's GCS
    and raylet outlast SIGTERM now and then."""
    signal_all(pids, signal.SIGCONT)
    signal_all(pids, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(Path(f"/proc/{p}").exists() for p in pids):
        time.sleep(0.1)
    signal_all(pids, signal.SIGKILL)


class RayHosts:
    """A Ray cluster over `hosts` (see the module docstring): `address` is the head's, for
    ray.init(address, _node_ip_address=hosts.bridge_address) in this process."""

    def __init__(self, hosts: Hosts, root: Path, cpus_per_node: int = 1, env: Optional[dict] = None) -> None:
        self.hosts, self.root = hosts, Path(root)
        self.temp_dirs: dict[str, Path] = {}  # "head" or the host's namespace -> its --temp-dir
        self.caches: dict[str, Path] = {}  # host namespace -> its SPECPIPE_CACHE_DIR
        self.port = free_port(hosts.bridge_address)
        self.address = f"{hosts.bridge_address}:{self.port}"
        base = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "SPECPIPE_"))}
        base.update(env or {})
        self._all_temp: list[Path] = []  # every temp dir made, a node started again included
        try:
            self._start("head", ["--head", "--port", str(self.port), "--num-cpus", "0",
                                 "--node-ip-address", hosts.bridge_address], None, base)
            # The workers' `ray start` at once: each spends most of its 5-10 s importing and waiting.
            with ThreadPoolExecutor(len(hosts)) as pool:
                for f in [pool.submit(self.start_node, h, cpus_per_node, base) for h in hosts.hosts]:
                    f.result()
        except BaseException:
            self.close()
            raise

    def _start(self, name: str, args: list[str], host: Optional[Host], env: dict) -> None:
        # Ray's socket paths must stay under 107 bytes: a short temp dir of its own per node.
        tmp = Path(f"/tmp/spray-{os.getpid()}-{uuid.uuid4().hex[:6]}")
        tmp.mkdir()
        self.temp_dirs[name] = tmp
        self._all_temp.append(tmp)
        # No dashboard (the head's only: a worker refuses the flag), a small object store: a node
        # costs about half a gigabyte as it is.
        head_only = ["--include-dashboard", "false"] if host is None else []
        argv = ["ray", "start", *args, *head_only, "--temp-dir", str(tmp), "--disable-usage-stats",
                "--object-store-memory", str(100 << 20)]
        proc = subprocess.run(host.cmd(*argv) if host else argv, env=env, capture_output=True, text=True,
                              timeout=120)
        if proc.returncode != 0:
            raise RuntimeError(f"ray start for {name} failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n"
                               f"{proc.stderr[-3000:]}")

    def start_node(self, h: Host, cpus: int = 1, env: Optional[dict] = None) -> None:
        """A worker node in host `h` (again, after kill(h)), with its own cache, which survives."""
        env = dict(env if env is not None else {k: v for k, v in os.environ.items()
                                                 if not k.startswith(("RAY_", "SPECPIPE_"))})
        cache = self.caches.setdefault(h.ns, self.root / f"cache-{h.address}")
        cache.mkdir(parents=True, exist_ok=True)
        env.update(SPECPIPE_CACHE_DIR=str(cache), SPECPIPE_USE_SHARED_PATH="0")
        self._start(h.ns, ["--address", self.address, "--num-cpus", str(cpus), "--node-ip-address", h.address],
                    h, env)

    def pids(self, h: Host) -> list[int]:
        """Everything running on host `h`: its namespace's processes and its node's."""
        return sorted(set(namespace_processes(h.ns)) | set(node_processes(self.temp_dirs[h.ns])))

    def freeze(self, h: Host) -> list[int]:
        """Every process of the host's node stopped (SIGSTOP), as a host that hangs: its sockets
        stay open and silent. Returns the pids for thaw()."""
        pids = self.pids(h)
        signal_all(pids, signal.SIGSTOP)
        return pids

    def thaw(self, pids: list[int]) -> None:
        signal_all(pids, signal.SIGCONT)

    def kill(self, h: Host) -> None:
        """The host lost: every process of its node killed at once (no goodbye to the GCS)."""
        signal_all(self.pids(h), signal.SIGKILL)

    def close(self) -> None:
        """Every process of every node this made, ended; their temp dirs removed. Workers first,
        so that none reports to a head that is gone."""
        head = self.temp_dirs.get("head")
        workers = {pid for t in self._all_temp if t != head for pid in node_processes(t)}
        workers |= {pid for h in self.hosts.hosts for pid in namespace_processes(h.ns)}
        end_processes(sorted(workers))  # together: one grace period, not one per node
        if head is not None:
            end_processes(node_processes(head))
        for tmp in self._all_temp:
            shutil.rmtree(tmp, ignore_errors=True)
        self.temp_dirs.clear()
        self._all_temp.clear()
