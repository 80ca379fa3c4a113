"""The driver's side of putting stages' weights on nodes that lack them, like a download manager:

  * several nodes fed at once (a thread per transfer), each with a bounded window of chunks in
    flight, so the driver holds at most `window` chunks per transfer and a node receives no more
    than that ahead of its disk;
  * a progress bar per node with its rate, as lines (the progress callback is line-based: a
    terminal, a log, a test), at every tenth of the way and at least every few seconds;
  * resumable: the node says which chunks it holds verified from an earlier, interrupted
    transfer (CacheWriter's journal) and only the rest are read and sent;
  * every chunk carries its hash (chunk_hash), checked on the node as it lands, before it is
    written; the whole entry's digest is checked again at the end (CacheWriter.finish).

The node's half is NodeAgent.begin / write / finish / suspend (cluster/node_agent.py).
"""

from __future__ import annotations

import bisect
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from specpipe.cluster.weights import CHUNK_BYTES, StageBytes, chunk_hash, chunk_spans

WINDOW = 4  # chunks in flight per transfer: the link stays busy, memory stays bounded
STALL_S = 120.0  # a node that takes no chunk for this long (frozen, cut off) is taken for lost
FINISH_S = 1800.0  # finish() hashes the whole entry again: minutes for tens of GB
BAR_WIDTH = 20
BAR_EVERY_S = 3.0


@dataclass
class Transfer:
    """One stage's bytes to one node."""

    node: str  # how the bar names the node
    label: str  # what it is for ("stage 2", "calibration layer")
    agent: object  # the node's NodeAgent (a Ray actor handle)
    sb: StageBytes
    digest: str
    root: Path  # where the stage bytes' relative paths start on the driver
    cache_max: Optional[str] = None  # --weight-cache-max: the node makes room before it begins
    keep: tuple = ()  # digests the node must not evict for room: the stages being placed there now


def missing(spans: list[tuple[str, int, int]], held: list[tuple[str, int, int]]) -> list[tuple[str, int, int]]:
    """The spans not wholly inside what the node holds (held spans may come from another chunk
    size: a span they only partly cover is sent again whole)."""
    merged: dict[str, list[list[int]]] = {}
    for rel, offset, length in sorted(held):
        runs = merged.setdefault(rel, [])
        if runs and offset <= runs[-1][1]:
            runs[-1][1] = max(runs[-1][1], offset + length)
        else:
            runs.append([offset, offset + length])
    out = []
    for rel, offset, length in spans:
        runs = merged.get(rel, [])
        i = bisect.bisect_right(runs, [offset, float("inf")]) - 1
        if not (i >= 0 and runs[i][0] <= offset and offset + length <= runs[i][1]):
            out.append((rel, offset, length))
    return out


class NodeBar:
    """One node's progress over all the transfers to it: bytes, rate, time left."""

    def __init__(self, node: str, labels: list[str], total: int, resumed: int, say: Callable[[str], None]) -> None:
        self.node, self.labels, self.total, self.say = node, labels, total, say
        self.resumed, self.sent = resumed, 0
        self.t0 = self.last_t = time.perf_counter()
        self.last_tenth = -1
        self.lock = threading.Lock()

    def add(self, n: int) -> None:
        with self.lock:
            self.sent += n
            now = time.perf_counter()
            tenth = int(10 * self.sent / max(1, self.total - self.resumed))
            if tenth != self.last_tenth or now - self.last_t >= BAR_EVERY_S:
                self.last_tenth, self.last_t = tenth, now
                self.say(self.line(now))

    def line(self, now: float) -> str:
        done = self.resumed + self.sent
        frac = done / max(1, self.total)
        rate = self.sent / max(1e-6, now - self.t0)
        left = (self.total - done) / rate if rate > 0 else float("inf")
        bar = "#" * int(BAR_WIDTH * frac) + "." * (BAR_WIDTH - int(BAR_WIDTH * frac))
        return (f"weights to node {self.node} ({', '.join(self.labels)}): [{bar}] {100 * frac:3.0f}% "
                f"{done / 2**20:.1f}/{self.total / 2**20:.1f} MiB, {rate / 2**20:.1f} MiB/s"
                + (f", {left:.0f} s left" if done < self.total and left != float("inf") else ""))

    def start_line(self) -> str:
        return (f"weights to node {self.node} ({', '.join(self.labels)}): {self.total / 2**20:.1f} MiB"
                + (f", resuming: {self.resumed / 2**20:.1f} MiB already there, verified" if self.resumed else ""))


def stream(transfers: list[Transfer], chunk_bytes: int = CHUNK_BYTES, window: int = WINDOW,
           progress: Optional[Callable[[str], None]] = None) -> list[str]:
    """Every transfer at once; the path each stage opens on its node, in order. A transfer that
    fails leaves what landed on its node for the next attempt (NodeAgent.suspend) and its error
    is raised once the others have ended (theirs are kept too)."""
    import ray

    say = progress or (lambda _m: None)
    if not transfers:
        return []
    plans: list[tuple[list, int]] = []  # per transfer: the spans to send, bytes held already
    begun = ray.get([t.agent.begin.remote(t.sb, t.digest, t.cache_max, t.keep) for t in transfers],
                    timeout=FINISH_S)
    for t, got in zip(transfers, begun):
        if got["evicted"]:
            say(f"cache of node {t.node}: removed {len(got['evicted'])} least recently used "
                f"entr{'ies' if len(got['evicted']) > 1 else 'y'}, {sum(n for _, n in got['evicted']) / 2**20:.1f} MiB, "
                f"to fit --weight-cache-max {t.cache_max or 'default'}")
        todo = missing(chunk_spans(t.sb, chunk_bytes), [tuple(h) for h in got["held"]])
        plans.append((todo, t.sb.total - sum(n for _, _, n in todo)))
    bars: dict[str, NodeBar] = {}
    for t, (todo, resumed) in zip(transfers, plans):
        bar = bars.get(t.node)
        if bar is None:
            bars[t.node] = NodeBar(t.node, [t.label], t.sb.total, resumed, say)
        else:
            bar.labels.append(t.label)
            bar.total += t.sb.total
            bar.resumed += resumed
    for bar in bars.values():
        say(bar.start_line())

    def one(t: Transfer, todo: list) -> str:
        inflight: list = []
        files: dict[str, object] = {}
        try:
            for rel, offset, length in todo:
                f = files.get(rel) or files.setdefault(rel, open(t.root / rel, "rb"))
                data = _read(f, offset, length, t.root / rel)
                inflight.append((t.agent.write.remote(t.digest, rel, offset, data, chunk_hash(data)), len(data)))
                if len(inflight) >= window:
                    ref, n = inflight.pop(0)
                    ray.get(ref, timeout=STALL_S)
                    bars[t.node].add(n)
            while inflight:
                ref, n = inflight.pop(0)
                ray.get(ref, timeout=STALL_S)
                bars[t.node].add(n)
            return ray.get(t.agent.finish.remote(t.digest), timeout=FINISH_S)
        except BaseException:
            try:  # keep what landed for the next attempt; a node that is gone keeps it anyway
                ray.get(t.agent.suspend.remote(t.digest), timeout=5.0)
            except Exception:  # noqa: BLE001
                pass
            raise
        finally:
            for f in files.values():
                f.close()

    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=len(transfers)) as pool:
        futures = [pool.submit(one, t, todo) for t, (todo, _) in zip(transfers, plans)]
        errors = [f.exception() for f in futures]
    for e in errors:
        if e is not None:
            raise e
    elapsed = time.perf_counter() - t0
    for bar in bars.values():
        say(f"weights to node {bar.node}: done, {bar.sent / 2**20:.1f} MiB sent in {elapsed:.1f} s"
            + (f" ({bar.resumed / 2**20:.1f} MiB resumed from its cache)" if bar.resumed else ""))
    return [f.result() for f in futures]


def _read(f, offset: int, length: int, path: Path) -> bytes:
    f.seek(offset)
    data = f.read(length)
    if len(data) != length:
        from specpipe.cluster.weights import WeightCacheError

        raise WeightCacheError(f"{path}: ends before byte {offset + length}, which the stage needs")
    return data
