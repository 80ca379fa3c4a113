"""Blame the right peer: a message a stage refuses is its sender's fault, named with the sender's
rank; a stage's own fault is its own; a link that merely went is a consequence. Before, any frame a
stage refused was "stage 2 lost a link", and any refusal while applying a step blamed the previous
rank, even for the driver's Control or the stage's own fault."""

from __future__ import annotations

import os

import pytest

from specpipe.config import EngineConfig
from specpipe.distributed.channel import MAC_BYTES
from specpipe.distributed.remote_pipeline import PipelineError, RemotePipeline
from specpipe.distributed.sockets import HEADER
from specpipe.distributed.transport import TAG_CONTROL, MalformedMessage
from specpipe.engine.engine import Engine
from specpipe.kv.slot_table import KVStateError
from specpipe.sampling import SamplingParams
from specpipe.worker.stage_main import from_peer, refused_by_stage


class NotesStore:
    def __init__(self, notes: dict[str, str]) -> None:
        self.notes = notes

    def check(self, keys):
        return all(k in self.notes for k in keys)

    def get(self, key):
        return self.notes[key].encode()


class FakeTransport:
    def __init__(self, notes):
        self.store = NotesStore(notes)

    def silent_ranks(self):
        return []


@pytest.mark.parametrize("notes,named,not_named", [
    ({"bad/2": "1 malformed message from rank 1: rows of 3 values", "lost/1": "x"},
     "stage 1 sent stage 2 a message it refused", "stage 2 lost"),
    ({"bad/1": "0 the driver sent a step this stage refuses: no such request"},
     "the driver sent stage 1 a message it refused", "stage 1 failed"),
    ({"failed/2": "MemoryError: out of memory"}, "stage 2 failed: MemoryError", "stage 1"),
])
def test_the_driver_names_the_sender_of_a_refused_message(notes, named, not_named):
    pipe = RemotePipeline(FakeTransport(notes), 2)
    err = str(pipe._fail(RuntimeError("link closed")))
    assert named in err and not_named not in err, err


def test_a_stage_attributes_what_it_refuses():
    with pytest.raises(MalformedMessage) as e:
        with from_peer(0):
            raise ValueError("control of 3 values")
    assert e.value.sender == 0 and "the driver" in str(e.value)
    for source, sender in (("control", 0), ("rows", 1)):
        err = KVStateError("a parent the stage does not hold")
        err.source = source
        with pytest.raises(MalformedMessage) as e:
            with refused_by_stage(prev=1):
                raise err
        assert e.value.sender == sender
    with pytest.raises(KVStateError):  # no source: the stage's own fault, not the previous rank's
        with refused_by_stage(prev=1):
            raise KVStateError("an inconsistency of this stage's own")


def test_an_altered_frame_ends_the_pipeline_naming_its_link(tiny_llama_dir):
    """End to end: a frame on the driver's link to stage 1 with a wrong MAC (what a relay that
    altered it would deliver): stage 1 refuses it and the request's error names the driver's
    link, not "stage 1 lost a link"."""
    engine = Engine(EngineConfig(model=str(tiny_llama_dir), stages=2, kv_memory="1MiB", transport="processes",
                                 restart_stages=0, stage_timeout_s=10))
    try:
        assert len(engine.generate([5, 17, 33], SamplingParams(max_tokens=2)).token_ids) == 2
        sock = engine.pipeline.t.mesh.peers[1].sock
        sock.sendall(HEADER.pack(TAG_CONTROL, 8, 0) + b"\x00" * 8 + os.urandom(MAC_BYTES))
        try:
            out = engine.generate([5, 17, 33], SamplingParams(max_tokens=2))
            text = f"{out.finish_reason} {out.error if hasattr(out, 'error') else out.stats}"
        except PipelineError as e:
            text = str(e)
        assert "the driver sent stage 1 a message it refused" in text and "MAC" in text, text
    finally:
        engine.close()
