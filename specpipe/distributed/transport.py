"""Moving messages between ranks with torch.distributed.

Rank 0 is the driver, ranks 1..S the stages. Control data (headers, node ids, tokens) travel as
int64 vectors over a gloo group; activations travel over the default group, which is NCCL when the
stages run on CUDA, gloo otherwise. Each kind of message has its own tag, so the driver -> stage 1
link can carry both control and rows in order.

Link emulation: `delay_ms` and `bandwidth_mbps` make each message arrive as over a slower network,
so a cluster's network can be rehearsed on one machine (these kernels have no netem). As on a real
network, messages to different peers are in flight at the same time: a message arrives `delay`
plus its bytes / bandwidth after it was sent, and only messages on the same link (this rank to
one peer) queue behind each other for bandwidth. The sender never waits: it stamps each message
with its due time (LinkClock) and the receiver holds the message until then. The stamp is
wall-clock time, so the emulation assumes the ranks share a clock: true for processes on one
machine and across network namespaces (which do not virtualize CLOCK_REALTIME); between real
hosts clock skew would shift every arrival, but there the network is real anyway. Without
emulation the stamp is 0 and nobody waits.

Liveness: every stage keeps a heartbeat in the rendezvous store; when a receive fails or times
out, the driver reads the heartbeats to name the stage that stopped.
"""

from __future__ import annotations

import collections
import datetime
import os
import socket
import threading
import time
from typing import Callable, Optional

import torch
import torch.distributed as dist

from specpipe.config import LinkOptions

TAG_CONTROL, TAG_ROWS, TAG_RESULTS, TAG_REPORT = 1, 2, 3, 4
HEARTBEAT_S = 0.5


class LinkError(RuntimeError):
    """A peer died, a link stopped, or a receive ran past its deadline."""


def short_error(e: BaseException, limit: int = 200) -> str:
    """The first sentence of an error (gloo appends several lines of advice) for one-line reports."""
    text = str(e).strip()
    if not text:
        return type(e).__name__
    text = text.splitlines()[0].split(". This is typically")[0]
    return text if len(text) <= limit else text[:limit - 3] + "..."


class LinkClock:
    """The sender's side of link emulation: when each message it sends is due at its peer."""

    def __init__(self, options: LinkOptions) -> None:
        self.options = options
        self._free_ns: dict[int, int] = {}  # peer -> when its link has finished what was sent so far

    def due_ns(self, dst: int, nbytes: int, now_ns: Optional[int] = None) -> int:
        """Arrival time (time.time_ns) of `nbytes` sent to `dst` now; 0 when nothing is emulated."""
        opts = self.options
        if not opts.emulated:
            return 0
        now = time.time_ns() if now_ns is None else now_ns
        # Bandwidth is per link: the bytes go out after those already queued for the same peer.
        start = max(now, self._free_ns.get(dst, 0))
        sent = start + (round(nbytes * 8e3 / opts.bandwidth_mbps) if opts.bandwidth_mbps else 0)
        self._free_ns[dst] = sent
        return sent + round(opts.delay_ms * 1e6)


def _hold_until(due_ns: int) -> None:
    """The receiver's side: a message is not seen before its emulated arrival time."""
    if due_ns > 0 and (wait := (due_ns - time.time_ns()) / 1e9) > 0:
        time.sleep(wait)


class Transport:
    def __init__(self, rank: int, world_size: int, master_addr: str, master_port: int,
                 options: LinkOptions = LinkOptions(), device: str = "cpu",
                 connect_timeout_s: float = 300.0, use_nccl: Optional[bool] = None) -> None:
        self.rank, self.world_size, self.options = rank, world_size, options
        self.device = torch.device(device)
        # NCCL needs one GPU per rank; stages sharing a GPU send activations through host memory.
        self.use_nccl = self.device.type == "cuda" if use_nccl is None else use_nccl
        # The rendezvous store is ours, so it also carries readiness, errors and heartbeats. The
        # process groups join only once every stage has loaded its layers (init_groups), so a
        # stage that fails while loading is reported instead of leaving the others waiting.
        self.store = dist.TCPStore(master_addr, master_port, world_size, is_master=rank == 0,
                                   timeout=datetime.timedelta(seconds=connect_timeout_s),
                                   wait_for_workers=False)
        self._addr, self._port = master_addr, master_port
        self.control_group = None
        self.bytes_sent = 0
        self.links = LinkClock(options)
        # Sends are asynchronous: a gloo send completes only when the peer posts the matching
        # receive, and a blocking one would let a busy or departed peer stall this rank.
        # Sends of the last few steps, oldest first: (work, buffer) per send, one list per step.
        # gloo's Work.is_completed() stays False until wait() is called, so finished sends are
        # only recognised by the pipeline's lock-step (see end_step).
        self._inflight: collections.deque[list[tuple[object, torch.Tensor]]] = collections.deque([[]])
        self.num_stages = world_size - 1

    def init_groups(self, abort: Optional[Callable[[], Optional[str]]] = None) -> None:
        """Join the process groups. `abort` (driver): polled while waiting for the other ranks;
        when it returns a reason (a stage failed to join), give up with a LinkError instead of
        waiting for the rendezvous to time out."""
        backend = "nccl" if self.use_nccl else "gloo"
        choose_gloo_interface(self._addr)
        if abort is None:
            self._init_groups(backend)
            return
        failure: list[BaseException] = []

        def join() -> None:
            try:
                self._init_groups(backend)
            except BaseException as e:  # noqa: BLE001  (re-raised in the caller's thread)
                failure.append(e)

        th = threading.Thread(target=join, name="specpipe-init-groups", daemon=True)
        th.start()
        while th.is_alive():
            th.join(0.1)
            if th.is_alive() and (why := abort()) is not None:
                # The joining thread stays blocked in the rendezvous; the caller is about to exit.
                raise LinkError(why)
        if failure:
            raise LinkError(f"joining the process group failed: {short_error(failure[0])}")

    def _init_groups(self, backend: str) -> None:
        # Stages wait for the driver indefinitely between requests, so the groups' own timeout
        # is long; the driver bounds each wait itself (LinkOptions.timeout_s).
        dist.init_process_group(backend, store=dist.PrefixStore("pg", self.store), rank=self.rank,
                                world_size=self.world_size, timeout=datetime.timedelta(days=1))
        self.control_group = dist.new_group(backend="gloo") if backend == "nccl" else dist.group.WORLD

    # -- int64 vectors (control) -----------------------------------------------------------------
    # On the wire: a header [length, due time] (the receiver must know the length before it can
    # post the receive), then the values when there are any.
    def send_ints(self, dst: int, tag: int, values: list[int]) -> None:
        nbytes = 8 * (len(values) + 2)
        due = self.links.due_ns(dst, nbytes)
        self._isend(torch.tensor([len(values), due], dtype=torch.long), dst, self.control_group, tag)
        if values:
            self._isend(torch.tensor(values, dtype=torch.long), dst, self.control_group, tag)
        self.bytes_sent += nbytes

    def recv_ints(self, src: int, tag: int, timeout_s: Optional[float] = None) -> list[int]:
        header = torch.empty(2, dtype=torch.long)
        self._recv(header, src, tag, self.control_group, timeout_s)
        n, due = header.tolist()
        values = []
        if n:
            buf = torch.empty(n, dtype=torch.long)
            self._recv(buf, src, tag, self.control_group, timeout_s)
            values = buf.tolist()
        _hold_until(due)
        return values

    # -- tensors (activations, tokens) -------------------------------------------------------------
    # On the wire: the due time as one int64 on the control group (the tensor may go over NCCL,
    # which carries no int64 side channel of ours), then the tensor itself.
    def send_tensor(self, dst: int, tag: int, t: torch.Tensor) -> None:
        if t.device.type != "cpu" and not self.use_nccl:
            t = t.cpu()
        group = self.control_group if t.device.type == "cpu" else None
        nbytes = 8 + t.numel() * t.element_size()
        due = self.links.due_ns(dst, nbytes)
        self._isend(torch.tensor([due], dtype=torch.long), dst, self.control_group, tag)
        self._isend(t.contiguous(), dst, group, tag if group is not None else 0)
        self.bytes_sent += nbytes

    def _isend(self, t: torch.Tensor, dst: int, group, tag: int) -> None:
        try:
            work = dist.isend(t, dst, group=group, tag=tag)
        except RuntimeError as e:
            raise LinkError(f"send to rank {dst} failed: {e}") from None
        self._inflight[-1].append((work, t))  # keep the buffer alive until the peer has it

    def end_step(self) -> None:
        """Every rank calls this once per pipeline step. A send made S + 1 steps ago has been
        received: at step t the driver has collected step t - 1 from the last stage, which
        computed what stage S - 1 sent at step t - 2, and so on up the pipeline, so every rank
        has taken in everything sent up to step t - S - 1. Waiting for those sends returns at
        once and frees them; without it they would pile up for the life of the pipeline."""
        self._inflight.append([])
        while len(self._inflight) > self.num_stages + 2:
            for work, _ in self._inflight.popleft():
                work.wait()

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait (bounded) until the peers have taken every message sent so far; True if they have.
        Closing the groups with sends still in flight can cut them off (the shutdown message)."""
        deadline = time.monotonic() + timeout_s
        pending = [w for step in self._inflight for w in step]
        self._inflight = collections.deque([[]])
        for work, _ in pending:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            try:
                work.wait(timeout=datetime.timedelta(seconds=left))
            except RuntimeError:
                return False
        return True

    def recv_tensor(self, src: int, tag: int, shape: tuple[int, ...], dtype: torch.dtype,
                    timeout_s: Optional[float] = None) -> torch.Tensor:
        # Token ids stay on the CPU; activations arrive on this rank's device.
        on_cpu = dtype == torch.long or not self.use_nccl
        due = torch.empty(1, dtype=torch.long)
        self._recv(due, src, tag, self.control_group, timeout_s)
        buf = torch.empty(shape, dtype=dtype, device="cpu" if on_cpu else self.device)
        self._recv(buf, src, tag if on_cpu else 0, self.control_group if on_cpu else None, timeout_s)
        _hold_until(int(due))
        return buf if dtype == torch.long else buf.to(self.device)

    def _recv(self, buf, src, tag, group, timeout_s) -> None:
        try:
            work = dist.irecv(buf, src, group=group, tag=tag)
            if timeout_s is None:
                work.wait()
            else:
                work.wait(timeout=datetime.timedelta(seconds=timeout_s))
        except RuntimeError as e:
            raise LinkError(f"receive from rank {src} failed: {e}") from None

    # -- liveness ---------------------------------------------------------------------------------
    def start_heartbeat(self) -> None:
        """Stages: publish a heartbeat from a thread with its own store connection."""
        store = dist.TCPStore(self._addr, self._port, self.world_size, is_master=False,
                              timeout=datetime.timedelta(seconds=30))
        key = f"heartbeat/{self.rank}"

        def beat() -> None:
            while True:
                try:
                    store.set(key, repr(time.time()))
                except Exception:  # the driver is gone: nothing left to tell
                    return
                time.sleep(HEARTBEAT_S)

        threading.Thread(target=beat, name="specpipe-heartbeat", daemon=True).start()

    def silent_ranks(self, max_age_s: float = 4 * HEARTBEAT_S) -> list[int]:
        """Driver: ranks whose heartbeat is older than `max_age_s` (dead or cut off)."""
        now, out = time.time(), []
        for r in range(1, self.world_size):
            try:
                last = float(self.store.get(f"heartbeat/{r}").decode()) if self.store.check([f"heartbeat/{r}"]) else 0.0
            except Exception:
                last = 0.0
            if now - last > max_age_s:
                out.append(r)
        return out

    def close(self) -> None:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


def choose_gloo_interface(master_addr: str) -> Optional[str]:
    """Set GLOO_SOCKET_IFNAME, unless the user did, to the interface that reaches `master_addr`.

    Without it gloo binds to the address the host name resolves to, which on many machines (and in
    every network namespace) is a loopback address: the other hosts then cannot connect and the
    rendezvous hangs. A loopback master means a single-host job, where gloo's default is right.
    """
    if os.environ.get("GLOO_SOCKET_IFNAME"):
        return os.environ["GLOO_SOCKET_IFNAME"]
    name = interface_for(master_addr)
    if name is not None:
        os.environ["GLOO_SOCKET_IFNAME"] = name
    return name


def interface_for(addr: str) -> Optional[str]:
    """Linux: the name of the (IPv4) interface whose address this host uses to reach `addr`;
    None for loopback or when it cannot be told."""
    try:
        import fcntl
        import struct

        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((addr, 9))  # UDP: no packet is sent, the kernel only picks a route
            local = s.getsockname()[0]
        if local.startswith("127."):
            return None
        for _, name in socket.if_nameindex():
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                try:
                    packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))  # SIOCGIFADDR
                except OSError:
                    continue
            if socket.inet_ntoa(packed[20:24]) == local:
                return name
    except (OSError, ImportError, ValueError):
        pass
    return None
