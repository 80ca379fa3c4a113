"""A GGUF or safetensors file truncated, overwritten or replaced after it was opened: one
CheckpointError naming the file, never a SIGBUS (loader/checked_file.py). The risky part runs in a
child process, so a signal fails the test instead of killing pytest."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import gguf
import numpy as np
import pytest
from checkpoint_fuzz import write_tiny_gguf, write_tiny_hf

from specpipe.loader import CheckpointError, open_checkpoint

# Run in a child: open the checkpoint, change its weights file as `change` says, then read every
# tensor and build the last stage (before, both read the float tensors through a memory map).
CHILD = textwrap.dedent("""
    import os, struct, sys
    from pathlib import Path
    from specpipe.config import StageSpec
    from specpipe.loader import CheckpointError, open_checkpoint
    from specpipe.model.stage import build_stage
    import specpipe.loader.checked_file as checked_file

    checkpoint, change = Path(sys.argv[1]), sys.argv[2]
    ckpt = open_checkpoint(checkpoint)
    path = checkpoint / "model.safetensors" if checkpoint.is_dir() else checkpoint
    with open(path, "rb") as f:  # where the tensor data starts: after the safetensors header, or the GGUF's directory
        data_start = 8 + struct.unpack("<Q", f.read(8))[0] if checkpoint.is_dir() else min(
            t.data_offset for t in ckpt._file.tensors)
    size = path.stat().st_size
    if change.startswith("truncate"):
        os.truncate(path, {"truncate_to_directory": data_start, "truncate_mid_data": (data_start + size) // 2,
                           "truncate_to_zero": 0, "truncate_unchecked": data_start + 100}[change])
    elif change == "overwrite":  # same size, the tensor data zeroed in place
        with open(path, "r+b") as f:
            f.seek(data_start)
            f.write(bytes(size - data_start))
    elif change == "grow":
        with open(path, "ab") as f:
            f.write(bytes(4096))
    if change == "truncate_unchecked":  # a cut between the check and the read: the read comes back short
        checked_file.CheckedFile.check = lambda self, what: None
    try:
        for name in sorted(ckpt.names()):
            ckpt.load(name)
        build_stage(ckpt, StageSpec(1, 2, False, True))
    except CheckpointError as e:
        print("CheckpointError:", e)
    else:
        print("loaded")
""")


@pytest.mark.parametrize("fmt", ["gguf", "safetensors"])
@pytest.mark.parametrize("change", ["truncate_to_directory", "truncate_mid_data", "truncate_to_zero",
                                    "truncate_unchecked", "overwrite", "grow"])
def test_a_file_changed_after_open_is_a_checkpoint_error_not_a_signal(tmp_path, fmt, change):
    # Before: reading a tensor touched the memory map's pages past the new end (GGUF: the float
    # tensors; safetensors: every tensor), and the process died of SIGBUS (exit -7); an overwrite
    # loaded whatever the bytes had become.
    if fmt == "gguf":
        checkpoint, file = write_tiny_gguf(tmp_path / "changed.gguf"), "changed.gguf"
    else:
        checkpoint, file = write_tiny_hf(tmp_path / "changed_hf"), "model.safetensors"
    run = subprocess.run([sys.executable, "-c", CHILD, str(checkpoint), change], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, f"child died (exit {run.returncode}): {run.stderr[-2000:]}"
    out = run.stdout.strip()
    assert out.startswith(f"CheckpointError: {file}: "), out
    if change == "truncate_unchecked":
        assert "truncated file" in out and "cut short after it was opened" in out, out
    else:
        assert "the file changed after it was opened" in out, out


def _all_tensors(ckpt) -> dict[str, np.ndarray]:
    return {name: ckpt.load(name).numpy() for name in sorted(ckpt.names())}


@pytest.mark.parametrize("fmt", ["gguf", "safetensors"])
def test_a_file_replaced_after_open_keeps_loading_the_one_opened(tmp_path, fmt):
    # A download or a cache that renames a new file over the path: the open descriptor still reads
    # the file that was opened, so the stage is built from one file, not a mix of two.
    checkpoint = write_tiny_gguf(tmp_path / "m.gguf") if fmt == "gguf" else write_tiny_hf(tmp_path / "hf")
    path = checkpoint / "model.safetensors" if fmt == "safetensors" else checkpoint
    expected = _all_tensors(open_checkpoint(checkpoint))
    ckpt = open_checkpoint(checkpoint)
    other = bytearray(path.read_bytes())
    start = len(other) // 2  # inside the tensor data of either format
    other[start:] = bytes(len(other) - start)
    (tmp_path / "new").write_bytes(bytes(other))
    os.replace(tmp_path / "new", path)
    got = _all_tensors(ckpt)
    assert got.keys() == expected.keys()
    assert all(np.array_equal(got[n], expected[n]) for n in got)
    assert not all(np.array_equal(got[n], t) for n, t in _all_tensors(open_checkpoint(checkpoint)).items())


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs Linux's /proc/self/maps")
@pytest.mark.parametrize("fmt", ["gguf", "safetensors"])
def test_no_memory_map_of_the_file_outlives_open(tmp_path, fmt):
    # Without a garbage collection: the map must go with the reader, not when a cycle is collected.
    checkpoint = write_tiny_gguf(tmp_path / "unmapped.gguf") if fmt == "gguf" else write_tiny_hf(tmp_path / "hf")
    gc.disable()
    try:
        ckpt = open_checkpoint(checkpoint)
        ckpt.load("norm.weight")
        ckpt.load_packed("layers.0.self_attn.q_proj.weight")
        maps = Path("/proc/self/maps").read_text()
    finally:
        gc.enable()
    assert checkpoint.name not in maps and "model.safetensors" not in maps
    ckpt.close()
    with pytest.raises(CheckpointError, match="checkpoint is closed"):
        ckpt.load("norm.weight")


def test_reads_match_gguf_py(tmp_path):
    # The pread path gives the same bytes as gguf-py's reader for every tensor and stored type.
    path = write_tiny_gguf(tmp_path / "same.gguf")
    ckpt = open_checkpoint(path)
    reference = {t.name: np.array(t.data) for t in gguf.GGUFReader(path).tensors}
    for t in ckpt._file.tensors:
        assert np.array_equal(t.data, reference[t.name]), t.name
        assert t.data.dtype == reference[t.name].dtype


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_safetensors_reads_match_safetensors(tmp_path, dtype):
    # The pread path gives what safetensors' own reader gives, dtype kept (load(..., None)).
    import torch
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from specpipe.loader.hf import canonical

    d = write_tiny_hf(tmp_path / "hf")
    st = d / "model.safetensors"
    save_file({n: t.to(getattr(torch, dtype)) for n, t in load_file(st).items()}, st)
    ckpt = open_checkpoint(d)
    with safe_open(st, framework="pt") as f:
        for key in f.keys():
            got, want = ckpt.load(canonical(key), None), f.get_tensor(key)
            assert got.dtype == want.dtype and torch.equal(got, want), key


def test_the_tensor_directory_matches_gguf_py(tmp_path):
    # gguf_metadata.py reads the directory gguf-py's reader used to: the same records, field by field.
    from test_gguf import Q, tiny_weights, write_gguf

    from specpipe.loader.gguf_file import GGUFFile

    for qtype in (Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q5_1):
        path = write_gguf(tmp_path / f"{qtype.name}.gguf", tiny_weights(), qtype=qtype)
        ours, theirs = GGUFFile(path).tensors, gguf.GGUFReader(path).tensors
        assert [t.name for t in ours] == [t.name for t in theirs]
        for a, b in zip(ours, theirs):
            assert (a.shape, a.tensor_type, a.data_offset, a.n_bytes, a.dtype, a.item_shape) == (
                tuple(b.shape.tolist()), b.tensor_type, b.data_offset, b.n_bytes, b.data.dtype, b.data.shape), a.name


def test_a_header_cut_while_it_is_read_is_an_error(tmp_path):
    # The header is read with pread, not through a map: a file shorter than it was when its size
    # was taken (cut during the open) gives a short read, hence one error, never a SIGBUS.
    from specpipe.loader.gguf_metadata import GGUFMetadataError, read_gguf_header

    path = write_tiny_gguf(tmp_path / "h.gguf")
    size = path.stat().st_size
    os.truncate(path, 2000)
    with open(path, "rb") as f, pytest.raises(GGUFMetadataError, match="truncated GGUF file .*file has 2000"):
        read_gguf_header(f.fileno(), size, path)
