"""The main loop of a stage process: receive, compute, send, until the driver says stop.

    control <- driver, rows <- previous rank  ->  StageWorker.step  ->  rows -> next rank
                                                                  (last stage: results -> driver)

A local driver starts each stage as a program of its own, `python -m specpipe.worker.stage_main
--rank R ...` (`stage_argv` writes the arguments, `main` reads them), never by re-importing the
user's script: so scripts without a main guard, scripts on standard input and notebooks work.
Everything a stage needs is on its command line, except the pipeline's key, which comes through
a pipe on its standard input; the rest comes through the rendezvous store.

Blame: a message that does not decode or that the stage refuses is its sender's fault (the driver
for Control, the previous rank for Rows) and is noted as `bad/R` = "SENDER why"; anything else
that goes wrong here is this stage's own, `failed/R`; a link that went is `lost/R` (a
consequence elsewhere). The driver reads these notes to name the culprit (remote_pipeline.py).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import struct
import sys
import time
from typing import Callable, Optional

import torch

from specpipe.config import LinkOptions, StageSpec
from specpipe.distributed.transport import (TAG_CONTROL, TAG_REPORT, TAG_RESULTS, TAG_ROWS, LinkError, MalformedMessage,
                                            Transport, short_error)
from specpipe.kv.slot_table import KVStateError
from specpipe.distributed.wire import WireError, decode_control, decode_rows_header, encode_report, encode_results, encode_rows
from specpipe.loader import open_checkpoint
from specpipe.model.stage import build_stage
from specpipe.worker.memory import process_memory
from specpipe.worker.stage_worker import StageWorker


def send_rows(t: Transport, dst: int, batch: list) -> None:
    if dst == 0:
        return  # the last stage sends results, not rows
    header, tensors = encode_rows(batch)
    t.send_ints(dst, TAG_ROWS, header)
    for data in tensors:
        t.send_tensor(dst, TAG_ROWS, data)


def run_stage(t: Transport, model_path: str, spec: StageSpec, num_blocks: int, block_size: int,
              device: str, dtype: Optional[torch.dtype], quantization: Optional[str] = None,
              window_blocks: int = 0) -> None:
    rank, num_stages = t.rank, t.world_size - 1
    t.start_heartbeat()
    try:
        model = build_stage(open_checkpoint(model_path), spec, device, dtype, quantization)
        worker = StageWorker(model, num_blocks, block_size, horizon=rank,  # rank r is stage index r - 1
                             window_blocks=window_blocks)
    except Exception as e:  # reported through the store so the driver can show it
        t.store.set(f"error/{rank}", f"{type(e).__name__}: {e}")
        raise
    rss, peak = process_memory()
    # The driver sizes its block manager by the smallest pool over the stages.
    t.store.set(f"ready/{rank}", f"{rss} {peak} {worker.stats.weight_bytes} {worker.stats.kv_bytes} {num_blocks} "
                                 f"{block_size} {window_blocks}")
    try:
        t.init_groups()
    except (RuntimeError, OSError) as e:  # typically: an address the other ranks cannot reach
        why = (f"could not connect to the other ranks ({short_error(e)}); set SPECPIPE_SOCKET_IFNAME to the "
               f"network interface that reaches MASTER_ADDR")
        t.store.set(f"failed/{rank}", why)
        raise LinkError(why) from None
    prev = rank - 1  # rank 0, the driver, feeds stage 1
    nxt = 0 if rank == num_stages else rank + 1
    stats = worker.stats
    send_rows(t, nxt, [])  # prime the link: at step k the next stage computes what we sent at k-1
    while True:
        t0 = time.perf_counter()
        with from_peer(0):
            control = decode_control(t.recv_ints(0, TAG_CONTROL))
        if control.shutdown:
            return
        t.end_step()
        batch = []
        with from_peer(prev):
            for rows, shape, dt in decode_rows_header(t.recv_ints(prev, TAG_ROWS), limits=worker.limits):
                if shape is not None:  # a failure marker carries no tensor
                    rows.data = t.recv_tensor(prev, TAG_ROWS, shape, dt)
                    if rows.masks is not None:  # structured output: the head rows' token masks
                        rows.masks = t.recv_tensor(prev, TAG_ROWS, tuple(rows.masks.shape), torch.long)
                    if rows.seen is not None:  # penalties: the context and each head row's path
                        rows.seen = t.recv_tensor(prev, TAG_ROWS, tuple(rows.seen.shape), torch.long)
                        rows.paths = t.recv_tensor(prev, TAG_ROWS, tuple(rows.paths.shape), torch.long)
                batch.append(rows)
        stats.wait_s += time.perf_counter() - t0
        with refused_by_stage(prev):  # a Control or Rows the stage's state refuses (a cycle, a lost parent)
            out = worker.step(control, batch)
        if nxt == 0:
            t.send_ints(0, TAG_RESULTS, encode_results(out))
        else:
            send_rows(t, nxt, out)
        stats.bytes_sent = t.bytes_sent
        if control.report:
            stats.rss_bytes, stats.peak_rss_bytes = process_memory()
            t.send_ints(0, TAG_REPORT, encode_report(stats, worker.take_spans()))


@contextlib.contextmanager
def from_peer(peer: int):
    """A message from `peer` that does not decode is the peer's fault (or a version mismatch): a
    MalformedMessage naming it, which ends this stage as a dead one would (the driver starts the
    stages again), never a stage left computing garbage."""
    try:
        yield
    except (WireError, ValueError, struct.error) as e:
        raise MalformedMessage(f"malformed message from {_who(peer)}: {e}", sender=peer) from None


@contextlib.contextmanager
def refused_by_stage(prev: int):
    """While a step is applied: an error that says which message broke the stage's rules
    (`source`: "control" from the driver, "rows" from the previous rank) blames that sender;
    any other error is this stage's own and propagates as it is."""
    try:
        yield
    except (KVStateError, WireError, ValueError) as e:
        source = getattr(e, "source", None)
        if source is None:
            raise
        sender = 0 if source == "control" else prev
        raise MalformedMessage(f"{_who(sender)} sent a step this stage refuses: {e}", sender=sender) from None


def _who(rank: int) -> str:
    return "the driver" if rank == 0 else f"rank {rank}"


def cuda_index(rank: int, device_count: int, local_rank: str | None) -> int:
    """The GPU of stage `rank`. Under torchrun LOCAL_RANK numbers the ranks of this machine only
    (a stage alone on a second machine has LOCAL_RANK 0), so it is the index to use; a stage
    spawned by a local driver has none, and ranks 1..S take GPUs 0..S-1. Wraps around when the
    stages outnumber the GPUs."""
    index = int(local_rank) if local_rank is not None else rank - 1
    return index % device_count


def stage_process_main(rank: int, world_size: int, master_addr: str, master_port: int, model_path: str,
                       spec: StageSpec, num_blocks: int, block_size: int, device: str, dtype: torch.dtype, link,
                       threads: int = 0, managed: bool = False, parent: int = 0,
                       quantization: Optional[str] = None, window_blocks: int = 0,
                       key: bytes = b"") -> None:
    """Entry point of a stage process (started by a local driver, or one rank under torchrun);
    `key`: the pipeline's secret (the rendezvous and every link check it).

    `managed`: started by a local driver, which owns the stages' lifetime. Such a stage ignores
    Ctrl-C (the terminal sends it to the whole process group; the driver finishes the step and
    shuts the stages down, or terminates them) and leaves error reporting to the driver.
    `parent`: the driver's pid; if it died before the death signal was armed, exit at once.
    """
    import signal

    from specpipe.distributed.ranks import die_with_parent

    die_with_parent()
    if parent and os.getppid() != parent:
        sys.exit(1)  # the driver is already gone: nobody would ever stop us
    if managed:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    if threads:
        torch.set_num_threads(threads)
    use_nccl = None
    if device == "cuda":
        # One GPU per stage when there are enough; otherwise stages share and use host copies.
        count = torch.cuda.device_count()
        device = f"cuda:{cuda_index(rank, count, os.environ.get('LOCAL_RANK'))}"
        use_nccl = count >= world_size - 1 or "LOCAL_RANK" in os.environ
    try:
        serve_stage(rank, lambda: Transport(rank, world_size, master_addr, master_port, link, device, key=key,
                                            use_nccl=use_nccl),
                    model_path, spec, num_blocks, block_size, device, dtype, quantization, window_blocks)
    except KeyboardInterrupt:
        pass
    except MalformedMessage as e:  # the peer's fault, but this stage is where it was seen: named in the store
        if not managed:
            print(f"specpipe {e}; exiting", file=sys.stderr)
        sys.exit(1)
    except LinkError as e:  # a consequence, not a cause: the store tells the driver not to blame us
        if not managed:
            print(f"specpipe stage {rank}: {short_error(e, 400)}; exiting", file=sys.stderr)
        sys.exit(1)


def serve_stage(rank: int, open_transport: Callable[[], Transport], *stage_args, **stage_kw) -> None:
    """Open stage `rank`'s transport and run the stage on it (`run_stage`'s arguments after the
    transport), closing it whatever happens; a local or torchrun stage process and a Ray stage
    actor alike. A failure is noted in the rendezvous before it propagates, so the driver (if it
    is still there) names the right stage: failed/R for this stage's fault or a malformed message
    it saw, lost/R for a link that went (a consequence elsewhere, not a cause here)."""
    t = None
    try:
        t = open_transport()
        run_stage(t, *stage_args, **stage_kw)
    except MalformedMessage as e:
        if e.sender is None:
            _store_note(t, f"failed/{rank}", str(e))
        else:
            _store_note(t, f"bad/{rank}", f"{e.sender} {e}")
        raise
    except LinkError as e:
        _store_note(t, f"lost/{rank}", str(e))
        raise
    except Exception as e:
        _store_note(t, f"failed/{rank}", f"{type(e).__name__}: {e}")
        raise
    finally:
        if t is not None:
            t.close()


def stage_argv(rank: int, world_size: int, master_addr: str, master_port: int, model_path: str, spec: StageSpec,
               num_blocks: int, block_size: int, device: str, dtype: Optional[torch.dtype], link: LinkOptions,
               threads: int = 0, quantization: Optional[str] = None, window_blocks: int = 0) -> list[str]:
    """The command-line arguments of a managed local stage (read back by `main`)."""
    return ["--rank", str(rank), "--world-size", str(world_size), "--addr", master_addr, "--port", str(master_port),
            "--model", model_path, "--layers", f"{spec.start}:{spec.end}", *(["--first"] if spec.first else []),
            *(["--last"] if spec.last else []), "--num-blocks", str(num_blocks), "--block-size", str(block_size),
            "--window-blocks", str(window_blocks),
            "--device", device, "--dtype", "auto" if dtype is None else str(dtype).removeprefix("torch."),
            *(["--quantization", quantization] if quantization else []), "--delay-ms", repr(link.delay_ms),
            "--bandwidth-mbps", repr(link.bandwidth_mbps), "--timeout-s", repr(link.timeout_s),
            *(["--link-encryption"] if link.encrypt else []),
            "--threads", str(threads), "--parent", str(os.getpid())]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m specpipe.worker.stage_main",
                                description="one pipeline stage, started by a local SpecPipe driver")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--addr", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--layers", required=True, help="START:END, END exclusive")
    p.add_argument("--first", action="store_true")
    p.add_argument("--last", action="store_true")
    p.add_argument("--num-blocks", type=int, required=True)
    p.add_argument("--block-size", type=int, required=True)
    p.add_argument("--window-blocks", type=int, default=0, help="the sliding-window layers' own KV pool")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="activations (auto: float32, weights kept as stored)")
    p.add_argument("--quantization", default=None, choices=["int8", "int4"])
    p.add_argument("--delay-ms", type=float, default=0.0)
    p.add_argument("--bandwidth-mbps", type=float, default=0.0)
    p.add_argument("--timeout-s", type=float, default=30.0)
    p.add_argument("--link-encryption", action="store_true")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--parent", type=int, default=0, help="the driver's pid: exit if it is already gone")
    a = p.parse_args(argv)
    start, end = (int(x) for x in a.layers.split(":"))
    stage_process_main(a.rank, a.world_size, a.addr, a.port, a.model, StageSpec(start, end, a.first, a.last),
                       a.num_blocks, a.block_size, a.device, None if a.dtype == "auto" else getattr(torch, a.dtype),
                       LinkOptions(a.delay_ms, a.bandwidth_mbps, a.timeout_s, a.link_encryption), a.threads, managed=True,
                       parent=a.parent, quantization=a.quantization, window_blocks=a.window_blocks,
                       key=_key_from_stdin())


def _key_from_stdin() -> bytes:
    """The key a local driver writes, in hex, to this process's standard input (then closes)."""
    text = sys.stdin.buffer.read(8192).strip()
    try:
        key = bytes.fromhex(text.decode())
    except (UnicodeDecodeError, ValueError):
        key = b""
    if len(key) < 16:
        sys.exit("specpipe stage: no pipeline key on standard input (this program is started by a SpecPipe driver)")
    return key


def _store_note(t, key: str, value: str) -> None:
    """Best effort: the driver may already be gone."""
    if t is None:
        return
    try:
        t.store.set(key, value)
    except Exception:
        pass


if __name__ == "__main__":
    main()
