"""Moving messages between ranks.

Rank 0 is the driver, ranks 1..S the stages. Control data (headers, node ids, tokens) travel as
int64 vectors, and activations of stages on CPUs as tensors' bytes, over one TCP connection per
pair of ranks (sockets.py); activations between GPUs over NCCL (torch.distributed). Each kind of
message has its own tag, so the driver -> stage 1 link can carry both control and rows in order.

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

Security: the rendezvous store admits only holders of the pipeline's key (store.py), and every
link proves it and carries a MAC on every frame (sockets.py, channel.py).

Liveness: every stage keeps a heartbeat in the rendezvous store; when a receive fails or times
out, the driver reads the heartbeats to name the stage that stopped.
"""

from __future__ import annotations

import collections
import datetime
import struct
import threading
import time
from typing import Callable, Optional

import torch
import torch.distributed as dist

from specpipe.config import LinkOptions
from specpipe.distributed.sockets import MalformedFrame, Mesh, SocketError, addresses
from specpipe.distributed.store import open_store

TAG_CONTROL, TAG_ROWS, TAG_RESULTS, TAG_REPORT = 1, 2, 3, 4
HEARTBEAT_S = 0.5
# The largest payload of each tag that is read into a new buffer: int64 vectors of a step's
# control, rows headers, results and reports (an activation is read into a tensor of the shape its
# header announced, checked against the stage's model: wire.py, so its frame must be exactly that
# size). A frame beyond these, of any other tag, or of a negative length is refused before
# anything is allocated for it.
FRAME_LIMITS = {TAG_CONTROL: 64 << 20, TAG_ROWS: 64 << 20, TAG_RESULTS: 64 << 20, TAG_REPORT: 64 << 20}


class LinkError(RuntimeError):
    """A peer died, a link stopped, or a receive ran past its deadline."""


class MalformedMessage(LinkError):
    """A peer sent what no SpecPipe rank of this version sends: the link cannot be trusted.
    `sender`: the rank whose message it was (None: this rank's own fault, named in the text)."""

    def __init__(self, message: str, sender: Optional[int] = None) -> None:
        super().__init__(message)
        self.sender = sender


def short_error(e: BaseException, limit: int = 200) -> str:
    """The first sentence of an error (torch.distributed appends several lines of advice) for one-line reports."""
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
                 options: LinkOptions = LinkOptions(), device: str = "cpu", *, key: bytes,
                 connect_timeout_s: float = 300.0, use_nccl: Optional[bool] = None, store=None,
                 address: Optional[str] = None,
                 frame_limits: Optional[dict[int, int]] = FRAME_LIMITS) -> None:
        """`key`: the pipeline's secret: the rendezvous admits only its holders, every link proves
        it and every frame carries a MAC made with it (store.py, channel.py); `store`: an open
        store client to use instead of the one at master_addr:master_port (rank 0 starts that
        store's server; port 0: any free one, `store.port` says which); `address`: the address
        this rank publishes and listens on (default: found from master_addr); `frame_limits`: the
        tags a link carries and their largest payloads (FRAME_LIMITS)."""
        self.rank, self.world_size, self.options = rank, world_size, options
        self.key, self.frame_limits = key, frame_limits
        self.device = torch.device(device)
        # NCCL needs one GPU per rank; stages sharing a GPU send activations through host memory.
        self.use_nccl = self.device.type == "cuda" if use_nccl is None else use_nccl
        # The rendezvous store is ours, so it also carries readiness, errors and heartbeats. The
        # links join only once every stage has loaded its layers (init_groups), so a stage that
        # fails while loading is reported instead of leaving the others waiting.
        if store is None:
            bind = addresses(master_addr, 0)[1] if rank == 0 else None  # where the mesh's rank 0 listens too
            store = open_store(rank, world_size, master_addr, master_port, key, connect_timeout_s, bind)
        self.store = store
        self._addr, self._address = master_addr, address
        self._connect_timeout_s = connect_timeout_s
        self.mesh: Optional[Mesh] = None
        self._heartbeat: Optional[threading.Thread] = None
        self._heartbeat_stop = threading.Event()
        self.bytes_sent = 0
        self.links = LinkClock(options)
        # The driver bounds its sends as it bounds its receives; a stage's send waits as long as
        # the next stage computes (a long prefill) before it reads.
        self._send_timeout_s = options.timeout_s if rank == 0 else None
        # NCCL sends (activations between GPUs) are asynchronous: those of the last few steps,
        # oldest first, one list per step, kept until they are known to be received (end_step).
        self._inflight: collections.deque[list[tuple[object, torch.Tensor]]] = collections.deque([[]])
        self.num_stages = world_size - 1

    def init_groups(self, abort: Optional[Callable[[], Optional[str]]] = None) -> None:
        """Connect to the other ranks (and join NCCL's group where activations go over it).
        `abort` (driver): polled while waiting for the other ranks; when it returns a reason (a
        stage failed to join), give up with a LinkError instead of waiting for the timeout."""
        if abort is None:
            self._init_groups()
            return
        failure: list[BaseException] = []

        def join() -> None:
            try:
                self._init_groups()
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
            raise LinkError(f"connecting to the other ranks failed: {short_error(failure[0])}")

    def _init_groups(self) -> None:
        where = (self._address, self._address) if self._address else addresses(self._addr, self.rank)
        mesh = Mesh(self.rank, self.world_size, self.store, where[0], self.key, bind=where[1], limits=self.frame_limits,
                    encrypt=self.options.encrypt)
        mesh.connect(self._connect_timeout_s)
        self.mesh = mesh
        if self.use_nccl:
            # Stages wait for the driver indefinitely between requests, so the group's own
            # timeout is long; the driver bounds each wait itself (LinkOptions.timeout_s).
            dist.init_process_group("nccl", store=dist.PrefixStore("pg", self.store), rank=self.rank,
                                    world_size=self.world_size, timeout=datetime.timedelta(days=1))

    # -- int64 vectors (control) -----------------------------------------------------------------
    def send_ints(self, dst: int, tag: int, values: list[int]) -> None:
        payload = struct.pack(f"<{len(values)}q", *values)
        self._send(dst, tag, payload)

    def recv_ints(self, src: int, tag: int, timeout_s: Optional[float] = None) -> list[int]:
        due, data = self._recv(src, tag, None, timeout_s)
        _hold_until(due)
        return list(struct.unpack(f"<{data.nbytes // 8}q", data))

    # -- tensors (activations, tokens) -------------------------------------------------------------
    # A CPU tensor travels as one message (its bytes); over NCCL, a message with the due time and
    # no payload precedes the tensor itself.
    def send_tensor(self, dst: int, tag: int, t: torch.Tensor) -> None:
        if t.device.type != "cpu" and not self.use_nccl:
            t = t.cpu()
        if t.device.type == "cpu":
            self._send(dst, tag, _bytes_of(t.contiguous()))
            return
        nbytes = t.numel() * t.element_size()
        self._send(dst, tag, b"", nbytes)
        try:
            work = dist.isend(t.contiguous(), dst, tag=0)
        except RuntimeError as e:
            raise LinkError(f"send to rank {dst} failed: {e}") from None
        self._inflight[-1].append((work, t))  # keep the buffer alive until the peer has it

    def recv_tensor(self, src: int, tag: int, shape: tuple[int, ...], dtype: torch.dtype,
                    timeout_s: Optional[float] = None) -> torch.Tensor:
        # Token ids stay on the CPU; activations arrive on this rank's device.
        on_cpu = dtype == torch.long or not self.use_nccl
        if on_cpu:
            buf = torch.empty(shape, dtype=dtype)
            due, _ = self._recv(src, tag, _bytes_of(buf), timeout_s)
            _hold_until(due)
            return buf if dtype == torch.long else buf.to(self.device)
        due, _ = self._recv(src, tag, None, timeout_s)
        buf = torch.empty(shape, dtype=dtype, device=self.device)
        try:
            work = dist.irecv(buf, src, tag=0)
            work.wait() if timeout_s is None else work.wait(timeout=datetime.timedelta(seconds=timeout_s))
        except RuntimeError as e:
            raise LinkError(f"receive from rank {src} failed: {e}") from None
        _hold_until(due)
        return buf

    def _send(self, dst: int, tag: int, payload, nbytes: Optional[int] = None) -> None:
        nbytes = len(payload) if nbytes is None else nbytes
        due = self.links.due_ns(dst, 8 + nbytes)
        try:
            self.mesh.send(dst, tag, due, payload, self._send_timeout_s)
        except SocketError as e:
            raise LinkError(str(e)) from None
        self.bytes_sent += 8 + nbytes

    def _recv(self, src: int, tag: int, into, timeout_s: Optional[float]):
        try:
            return self.mesh.recv(src, tag, into, timeout_s)
        except MalformedFrame as e:  # the sender's fault (or a stranger's on the way), not a lost link
            raise MalformedMessage(str(e), sender=src) from None
        except SocketError as e:
            raise LinkError(f"receive from rank {src} failed: {e}") from None

    def end_step(self) -> None:
        """Every rank calls this once per pipeline step. A send made S + 1 steps ago has been
        received: at step t the driver has collected step t - 1 from the last stage, which
        computed what stage S - 1 sent at step t - 2, and so on up the pipeline, so every rank
        has taken in everything sent up to step t - S - 1. Waiting for those NCCL sends returns
        at once and frees them; without it they would pile up for the life of the pipeline."""
        self._inflight.append([])
        while len(self._inflight) > self.num_stages + 2:
            for work, _ in self._inflight.popleft():
                work.wait()

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait (bounded) until the peers have taken every NCCL send made so far; True if they
        have. (A socket message is the kernel's once `send` returns; closing does not cut it off.)"""
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

    # -- liveness ---------------------------------------------------------------------------------
    def start_heartbeat(self) -> None:
        """Stages: publish a heartbeat from a thread with its own store connection."""
        store = self.store.clone()
        key, stop = f"heartbeat/{self.rank}", self._heartbeat_stop

        def beat() -> None:
            while not stop.is_set():
                try:
                    store.set(key, repr(time.time()))
                except Exception:  # the driver is gone: nothing left to tell
                    return
                stop.wait(HEARTBEAT_S)

        self._heartbeat = threading.Thread(target=beat, name="specpipe-heartbeat", daemon=True)
        self._heartbeat.start()

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
        # The heartbeat stops before the process exits: a thread still inside the store's C++ call
        # while the interpreter tears down can abort the process ("terminate called without an
        # active exception", seen once in 45 stage shutdowns). Its store call gives up within the
        # store's timeout at worst.
        self._heartbeat_stop.set()
        if self._heartbeat is not None:
            self._heartbeat.join(timeout=2 * HEARTBEAT_S)
        if self.mesh is not None:
            self.mesh.close()
        self.store.close()
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


def _bytes_of(t: torch.Tensor) -> memoryview:
    """A contiguous CPU tensor's memory as bytes (any dtype, bfloat16 included), not copied."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())
