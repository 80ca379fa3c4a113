"""A GGUF truncated, overwritten or replaced after it was opened: one CheckpointError naming the
file, never a SIGBUS (loader/gguf_file.py). The risky part runs in a child process, so a signal
fails the test instead of killing pytest."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import gguf
import numpy as np
import pytest
from checkpoint_fuzz import write_tiny_gguf

from specpipe.loader import CheckpointError, open_checkpoint

# Run in a child: open the file, change it as `change` says, then read every tensor and build the
# last stage (its norms and LM head are read as floats, once through the memory map).
CHILD = textwrap.dedent("""
    import os, sys
    from pathlib import Path
    sys.path.insert(0, sys.argv[3])
    from specpipe.config import StageSpec
    from specpipe.loader import CheckpointError, open_checkpoint
    from specpipe.model.stage import build_stage
    import specpipe.loader.gguf_file as gguf_file

    path, change = Path(sys.argv[1]), sys.argv[2]
    ckpt = open_checkpoint(path)
    data_start, size = min(t.data_offset for t in ckpt._file.tensors), path.stat().st_size
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
        gguf_file.GGUFFile._check = lambda self, what: None
    try:
        for name in sorted(ckpt.names()):
            ckpt.load(name)
        build_stage(ckpt, StageSpec(1, 2, False, True))
    except CheckpointError as e:
        print("CheckpointError:", e)
    else:
        print("loaded")
""")


@pytest.mark.parametrize("change", ["truncate_to_directory", "truncate_mid_data", "truncate_to_zero",
                                    "truncate_unchecked", "overwrite", "grow"])
def test_a_file_changed_after_open_is_a_checkpoint_error_not_a_signal(tmp_path, change):
    # Before: loading a float tensor touched the memory map's pages past the new end, and the
    # process died of SIGBUS (exit -7); an overwrite loaded whatever the bytes had become.
    path = write_tiny_gguf(tmp_path / "changed.gguf")
    run = subprocess.run([sys.executable, "-c", CHILD, str(path), change, str(Path(__file__).parent)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, f"child died (exit {run.returncode}): {run.stderr[-2000:]}"
    out = run.stdout.strip()
    assert out.startswith("CheckpointError: changed.gguf: "), out
    if change == "truncate_unchecked":
        assert "truncated GGUF file" in out, out
    else:
        assert "the file changed after it was opened" in out, out


def _all_tensors(ckpt) -> dict[str, np.ndarray]:
    return {name: ckpt.load(name).numpy() for name in sorted(ckpt.names())}


def test_a_file_replaced_after_open_keeps_loading_the_one_opened(tmp_path):
    # A download or a cache that renames a new file over the path: the open descriptor still reads
    # the file that was opened, so the stage is built from one file, not a mix of two.
    path = write_tiny_gguf(tmp_path / "m.gguf")
    expected = _all_tensors(open_checkpoint(path))
    ckpt = open_checkpoint(path)
    other = bytearray(path.read_bytes())
    start = min(t.data_offset for t in ckpt._file.tensors)
    other[start:] = bytes(len(other) - start)
    (tmp_path / "new.gguf").write_bytes(bytes(other))
    os.replace(tmp_path / "new.gguf", path)
    got = _all_tensors(ckpt)
    assert got.keys() == expected.keys()
    assert all(np.array_equal(got[n], expected[n]) for n in got)


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs Linux's /proc/self/maps")
def test_no_memory_map_of_the_file_outlives_open(tmp_path):
    path = write_tiny_gguf(tmp_path / "unmapped.gguf")
    ckpt = open_checkpoint(path)
    ckpt.load("norm.weight")
    ckpt.load_packed("layers.0.self_attn.q_proj.weight")
    assert str(path) not in Path("/proc/self/maps").read_text()
    ckpt.close()
    with pytest.raises(CheckpointError, match="unmapped.gguf: checkpoint is closed"):
        ckpt.load("norm.weight")


def test_reads_match_gguf_py(tmp_path):
    # The pread path gives the same bytes as gguf-py's reader for every tensor and stored type.
    path = write_tiny_gguf(tmp_path / "same.gguf")
    ckpt = open_checkpoint(path)
    reference = {t.name: np.array(t.data) for t in gguf.GGUFReader(path).tensors}
    for t in ckpt._file.tensors:
        assert np.array_equal(t.data, reference[t.name]), t.name
        assert t.data.dtype == reference[t.name].dtype
