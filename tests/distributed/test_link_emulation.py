"""Link emulation behaves like a network, not like a sender that sleeps per message.

First the schedule on its own (LinkClock, no processes), then four real ranks on loopback
connections: rank 0 sends, ranks 1-3 time each message from its send to the moment recv returns it.
One set of processes runs every scenario (starting ranks costs seconds; a scenario 0.1 s).
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import time

import pytest
import torch

from specpipe.config import LinkOptions
from specpipe.distributed.transport import LinkClock, Transport

D_MS = 50.0  # the emulated delay
BW_MBPS = 8.0  # 1 MB/s: a PAYLOAD-byte tensor takes about 50 ms on the link
PAYLOAD = 50_000
T_MS = (PAYLOAD + 8) * 8e-3 / BW_MBPS  # the tensor and its 8-byte stamp, in ms at BW_MBPS
TAG = 7


# ---- the schedule ----------------------------------------------------------------------------

def test_clock_broadcast_is_parallel_and_links_queue_for_bandwidth():
    ms = 1_000_000
    clock = LinkClock(LinkOptions(delay_ms=10))
    assert [clock.due_ns(dst, 100, now_ns=0) for dst in (1, 2, 3)] == [10 * ms] * 3
    assert clock.due_ns(1, 100, now_ns=ms) == 11 * ms  # latency alone does not queue

    clock = LinkClock(LinkOptions(delay_ms=10, bandwidth_mbps=8))  # 1 byte per microsecond
    assert clock.due_ns(1, 1000, now_ns=0) == 11 * ms
    assert clock.due_ns(1, 1000, now_ns=0) == 12 * ms  # behind the first on the same link
    assert clock.due_ns(2, 1000, now_ns=0) == 11 * ms  # another link is free
    assert clock.due_ns(1, 1000, now_ns=5 * ms) == 16 * ms  # the link was idle from 2 ms
    assert LinkClock(LinkOptions()).due_ns(1, 10**9) == 0  # no emulation: nothing to wait for


# ---- real ranks ---------------------------------------------------------------------------------

# name -> (link options, [(destination, "ints" | "tensor"), ...] in the order rank 0 sends them)
SCENARIOS = {
    "plain": (LinkOptions(), [(1, "ints"), (2, "ints"), (3, "ints")]),
    "delay": (LinkOptions(delay_ms=D_MS), [(1, "ints"), (2, "ints"), (3, "ints")]),
    "bandwidth": (LinkOptions(bandwidth_mbps=BW_MBPS),
                  [(1, "tensor"), (1, "tensor"), (2, "tensor"), (3, "tensor")]),
}


def _barrier(t: Transport, name: str) -> None:
    """Every rank has arrived (through the rendezvous store)."""
    t.store.add(name, 1)
    while t.store.add(name, 0) < t.world_size:
        time.sleep(0.001)


def _rank(rank: int, port: int, out: mp.Queue) -> None:
    t = Transport(rank, 4, "127.0.0.1", port, key=b"k" * 32, connect_timeout_s=60, frame_limits=None)  # its own tags
    try:
        t.init_groups()
        for name, (options, plan) in SCENARIOS.items():
            t.links = LinkClock(options)
            _barrier(t, f"ready/{name}")  # every receiver is waiting before rank 0 sends
            if rank == 0:
                start = time.time_ns()
                for dst, kind in plan:
                    if kind == "ints":
                        t.send_ints(dst, TAG, [start])
                    else:
                        payload = torch.zeros(PAYLOAD // 8, dtype=torch.long)
                        payload[0] = start
                        t.send_tensor(dst, TAG, payload)
                out.put((name, 0, (time.time_ns() - start) / 1e6))  # how long sending took
                t.flush()
            else:
                for dst, kind in plan:
                    if dst != rank:
                        continue
                    if kind == "ints":
                        (sent,) = t.recv_ints(0, TAG, timeout_s=30)
                    else:
                        sent = int(t.recv_tensor(0, TAG, (PAYLOAD // 8,), torch.long, timeout_s=30)[0])
                    out.put((name, rank, (time.time_ns() - sent) / 1e6))
        _barrier(t, "done")
    except BaseException as e:  # noqa: BLE001  (reported to the test, which fails with it)
        out.put(("error", rank, repr(e)))
    finally:
        t.close()


@pytest.fixture(scope="module")
def timings() -> dict[str, dict[int, list[float]]]:
    """scenario -> rank -> milliseconds (rank 0: sending; others: each message's latency)."""
    from specpipe.distributed.ranks import free_port

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, out), daemon=True) for r in range(4)]
    for p in procs:
        p.start()
    expected = sum(1 + len(plan) for _, plan in SCENARIOS.values())
    got: dict[str, dict[int, list[float]]] = {}
    try:
        for _ in range(expected):
            name, rank, value = out.get(timeout=120)
            assert name != "error", f"rank {rank}: {value}"
            got.setdefault(name, {}).setdefault(rank, []).append(value)
    except queue.Empty:
        pytest.fail(f"the ranks stopped reporting; so far: {got}")
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    return got


def test_zero_delay_adds_nothing(timings):
    plain = timings["plain"]
    assert max(plain[r][0] for r in (1, 2, 3)) < D_MS / 2


def test_a_broadcast_takes_one_delay_not_one_per_peer(timings):
    delay = timings["delay"]
    assert delay[0][0] < D_MS / 2  # the sender does not wait for the link
    latencies = [delay[r][0] for r in (1, 2, 3)]
    assert min(latencies) >= D_MS
    assert max(latencies) < 2 * D_MS  # a sender sleeping per message would make the last 3 x D


def test_messages_on_one_link_queue_for_bandwidth(timings):
    bw = timings["bandwidth"]
    assert bw[0][0] < T_MS / 2
    first, second = bw[1]
    assert T_MS <= first < 1.8 * T_MS
    assert second >= 2 * T_MS  # it went out after the first had
    # rank 3's message was sent after two others, but on a link of its own
    assert T_MS <= bw[2][0] < 1.8 * T_MS and T_MS <= bw[3][0] < 1.8 * T_MS
