"""A stage's bytes (Checkpoint.stage_ranges) and a node's cache of them (cluster/weights.py): the
ranges hold just the stage's tensors, a sparse copy streamed through CacheWriter builds the same
stage as the original file, and a damaged copy or a changed local file is never used."""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import time
from pathlib import Path

import gguf
import pytest
import torch

from checkpoint_helpers import gguf_twin
from specpipe.cluster import weights
from specpipe.cluster.weights import WeightCache, WeightCacheError, iter_chunks, stage_digest
from specpipe.loader import open_checkpoint
from specpipe.loader.partition import partition_layers
from specpipe.model.stage import build_stage

STAGES = partition_layers(4, 3)  # layers [0, 2) + embedding, [2, 3), [3, 4) + norm and head


@pytest.fixture(autouse=True)
def cache_env(tmp_path, monkeypatch):
    """Every test's digest cache and weight cache in its own directory, never the user's."""
    monkeypatch.setenv("SPECPIPE_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(params=["hf", "hf-sharded", "gguf"])
def model(request, tiny_model_dir, tmp_path) -> Path:
    """A private copy of the tiny Llama (tests modify it): a Hugging Face directory (one file, or
    shards with an index), or a GGUF file."""
    src = tiny_model_dir("llama", max_shard_size="200KB" if request.param == "hf-sharded" else None)
    if request.param.startswith("hf"):
        return Path(shutil.copytree(src, tmp_path / "src" / "tiny_llama"))
    (tmp_path / "src").mkdir()
    return gguf_twin(src, tmp_path / "src" / "tiny_llama.gguf")


def tensor_spans(path: Path) -> dict[str, tuple[str, int, int]]:
    """File name, start and end of every tensor's data, read independently of the loader: the
    safetensors header by hand, GGUF through gguf's own reader."""
    spans = {}
    if path.is_dir():
        for shard in path.glob("*.safetensors"):
            raw = shard.read_bytes()
            n = struct.unpack("<Q", raw[:8])[0]
            for name, e in json.loads(raw[8:8 + n]).items():
                if name != "__metadata__":
                    spans[name] = (shard.name, 8 + n + e["data_offsets"][0], 8 + n + e["data_offsets"][1])
    else:
        for t in gguf.GGUFReader(path).tensors:
            spans[t.name] = (path.name, int(t.data_offset), int(t.data_offset) + int(t.n_bytes))
    return spans


def layer_of(name: str):
    m = re.search(r"(?:layers|blk)\.(\d+)\.", name)
    return int(m.group(1)) if m else None


def covered(ranges, rel: str, a: int, b: int) -> bool:
    return any(r == rel and o <= a and b <= o + n for r, o, n in ranges)


def touches(ranges, rel: str, a: int, b: int) -> bool:
    return any(r == rel and o < b and a < o + n for r, o, n in ranges)


def weight_range(sb, model: Path) -> tuple[str, int, int]:
    """(file, offset, length) of the data of one tensor the stage needs."""
    rel, a, b = max(s for s in tensor_spans(model).values() if covered(sb.ranges, *s))
    return rel, a, b - a


def stream(cache: WeightCache, ckpt_path: Path, sb, digest: str, chunk_bytes: int = 4096) -> Path:
    with cache.writer(sb, digest) as w:
        for rel, offset, data in iter_chunks(sb.root_of(ckpt_path), sb, chunk_bytes):
            w.write(rel, offset, data)
        return w.finish()


def same_stage(a: Path, b: Path, spec) -> None:
    sa = build_stage(open_checkpoint(a), spec, stack=False).state_dict()
    sb = build_stage(open_checkpoint(b), spec, stack=False).state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


def test_ranges_hold_only_the_stages_tensors(model):
    ckpt, spans = open_checkpoint(model), tensor_spans(model)
    for spec in STAGES:
        sb = ckpt.stage_ranges(spec)
        assert sb.ranges == sorted(sb.ranges) and sb.total < sum(size for _, size in sb.files)
        for name, (rel, a, b) in spans.items():
            layer = layer_of(name)
            if layer is not None:
                want = spec.start <= layer < spec.end
            elif "embd" in name or "embed" in name:
                want = spec.first  # untied: the last stage has its own head
            else:  # norm, LM head
                want = spec.last
            assert covered(sb.ranges, rel, a, b) if want else not touches(sb.ranges, rel, a, b), (spec, name)
        if model.is_dir():
            assert "model.safetensors.index.json" in dict(sb.files) or len(sb.files) == 5
        # Every preamble, and (HF) every JSON file whole.
        assert all(covered(sb.ranges, rel, 0, 8) for rel, _ in sb.files if not rel.endswith(".json"))
        assert all(covered(sb.ranges, rel, 0, size) for rel, size in sb.files if rel.endswith(".json"))


def test_tied_head_and_gguf_tables_go_to_the_stages_that_read_them(tiny_model_dir, tmp_path):
    tied = tiny_model_dir("llama", tie_word_embeddings=True)
    spans, ckpt = tensor_spans(tied), open_checkpoint(tied)
    rel, a, b = spans["model.embed_tokens.weight"]
    for spec in STAGES:
        assert covered(ckpt.stage_ranges(spec).ranges, rel, a, b) == (spec.first or spec.last)
    # Phi-3's LongRoPE factors are tensors the config is read from: every stage needs them.
    phi = gguf_twin(tiny_model_dir("phi3"), tmp_path / "phi3.gguf")
    spans, ckpt = tensor_spans(phi), open_checkpoint(phi)
    for spec in STAGES:
        sb = ckpt.stage_ranges(spec)
        for name in ("rope_factors_long.weight", "rope_factors_short.weight"):
            assert covered(sb.ranges, *spans[name])
    cache = WeightCache()
    sb = ckpt.stage_ranges(STAGES[1])
    copy = stream(cache, phi, sb, stage_digest(phi.parent, sb))
    same_stage(phi, copy, STAGES[1])


def test_streamed_sparse_copy_builds_the_same_stage(model, cache_env):
    ckpt, cache = open_checkpoint(model), WeightCache()
    for spec in STAGES:
        sb = ckpt.stage_ranges(spec)
        digest = stage_digest(sb.root_of(model), sb)
        assert cache.find(sb, digest, None) is None
        copy = stream(cache, model, sb, digest)
        assert copy.name == model.name and copy.is_dir() == model.is_dir()
        assert copy.parent.parent == cache_env / "weights"
        same_stage(model, copy, spec)
        assert cache.find(sb, digest, None) == copy  # the next run loads it locally
        assert not list((cache_env / "weights").glob(".tmp-*"))
        # The copy really is sparse: another stage's layer is zeros in it.
        other = next(s for s in STAGES if s != spec)
        name, (rel, a, b) = next((n, s) for n, s in tensor_spans(model).items() if layer_of(n) == other.start)
        with open(sb.root_of(copy) / rel, "rb") as f:
            f.seek(a)
            assert f.read(b - a) == bytes(b - a)


def test_a_second_writer_keeps_the_first_entry(model):
    sb = open_checkpoint(model).stage_ranges(STAGES[2])
    digest, cache = stage_digest(sb.root_of(model), sb), WeightCache()
    first = stream(cache, model, sb, digest)
    assert stream(cache, model, sb, digest) == first
    assert cache.find(sb, digest) == first


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_a_damaged_entry_is_removed_and_fetched_again(model, damage):
    sb = open_checkpoint(model).stage_ranges(STAGES[1])
    digest, cache = stage_digest(sb.root_of(model), sb), WeightCache()
    copy = stream(cache, model, sb, digest)
    rel, offset, length = weight_range(sb, model)
    path = sb.root_of(copy) / rel
    with open(path, "r+b") as f:
        if damage == "truncate":
            f.truncate(offset + length // 2)
        else:
            f.seek(offset + length // 2)
            byte = f.read(1)
            f.seek(offset + length // 2)
            f.write(bytes([byte[0] ^ 0x01]))
    assert cache.find(sb, digest) is None
    assert not cache.entry(digest).exists()
    assert stream(cache, model, sb, digest) == copy and cache.find(sb, digest) == copy


def test_the_drivers_path_is_used_where_the_node_has_the_same_bytes(model):
    sb = open_checkpoint(model).stage_ranges(STAGES[0])
    digest, cache = stage_digest(sb.root_of(model), sb), WeightCache()
    assert cache.find(sb, digest, model) == model
    assert not cache.weights.exists()  # nothing was copied
    # A different file at that path (same size, one weight of the stage changed) is not used.
    rel, offset, length = weight_range(sb, model)
    path = sb.root_of(model) / rel
    data = bytearray(path.read_bytes())
    data[offset + length - 1] ^= 0x01
    path.write_bytes(bytes(data))
    assert cache.find(sb, digest, model) is None
    assert cache.find(sb, digest, sb.root_of(model) / "elsewhere") is None


def test_stage_digest_is_read_once(model, cache_env, monkeypatch):
    sb = open_checkpoint(model).stage_ranges(STAGES[2])
    root = sb.root_of(model)
    digest = stage_digest(root, sb)
    reads = []
    real = weights._read_range
    monkeypatch.setattr(weights, "_read_range", lambda *a: reads.append(a) or real(*a))
    assert stage_digest(root, sb) == digest and reads == []
    # Changing a needed byte while keeping size and mtime fools the remembered digest (that is
    # the key), but never a cache entry, which find() hashes again.
    rel, offset, _ = weight_range(sb, model)
    path = root / rel
    st = path.stat()
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert stage_digest(root, sb) == digest and reads == []
    # A real rewrite (new mtime) is hashed again.
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert stage_digest(root, sb) != digest and reads


def test_writes_outside_the_needed_ranges_are_refused(model):
    sb = open_checkpoint(model).stage_ranges(STAGES[1])
    digest, cache = stage_digest(sb.root_of(model), sb), WeightCache()
    w = cache.writer(sb, digest)
    # A range that starts after its file's header, so the byte before it is outside every range.
    rel, offset, length = next(r for r in sb.ranges if r[0].endswith((".gguf", ".safetensors")) and r[1] > 0)
    w.write(rel, offset, b"\0" * length)  # the whole range is fine
    for bad in [(rel, offset - 1, b"\0\0"), (rel, offset + length - 1, b"\0\0"), ("other.bin", 0, b"\0"),
                (rel, -1, b"\0")]:
        with pytest.raises(WeightCacheError, match="not inside a range"):
            w.write(*bad)
    with pytest.raises(WeightCacheError, match="hash to"):  # most ranges were never written
        w.finish()
    assert not w.tmp.exists() and not cache.entry(digest).exists()


def test_stage_bytes_from_elsewhere_cannot_leave_the_cache(model):
    sb = open_checkpoint(model).stage_ranges(STAGES[1])
    cache = WeightCache()
    evil = type(sb)(sb.name, sb.is_dir, [("../escape", 10)] + sb.files, sb.ranges)
    with pytest.raises(WeightCacheError, match="odd files"):
        cache.writer(evil, "0" * 64)
    with pytest.raises(WeightCacheError, match="not a stage digest"):
        cache.writer(sb, "../x")
    beyond = type(sb)(sb.name, sb.is_dir, sb.files, sb.ranges + [(sb.files[-1][0], sb.files[-1][1], 1)])
    with pytest.raises(WeightCacheError, match="not inside a listed file"):
        cache.find(beyond, "0" * 64)


def test_a_dead_writers_leftovers_are_swept(model):
    sb = open_checkpoint(model).stage_ranges(STAGES[1])
    digest, cache = stage_digest(sb.root_of(model), sb), WeightCache()
    dead, alive = cache.writer(sb, digest), cache.writer(sb, digest)
    for f in [dead.tmp, *dead.tmp.rglob("*")]:
        os.utime(f, (0, 0))
    stream(cache, model, sb, digest)
    assert not dead.tmp.exists() and alive.tmp.exists()
    alive.abort()
    dead.abort()  # closes its files


def test_chunks_written_at_once_land_at_their_own_offsets(tmp_path):
    """The node agent serves several `write` calls at once (a Ray actor with max_concurrency > 1,
    the driver keeping chunks in flight): each chunk must land at its own offset whatever the
    others do meanwhile, so the entry's digest checks out (a shared seek() + write() did not)."""
    from concurrent.futures import ThreadPoolExecutor

    from specpipe.loader.checkpoint import StageBytes

    src = tmp_path / "src"
    src.mkdir()
    size, chunk = 24 << 20, 64 << 10  # 384 chunks: a stage of many chunks, as real stages are
    (src / "model.gguf").write_bytes(os.urandom(size))
    sb = StageBytes("model.gguf", False, [("model.gguf", size)], [("model.gguf", 4096, size - 4096)])
    digest = stage_digest(src, sb)
    chunks = list(iter_chunks(src, sb, chunk))
    assert len(chunks) > 300
    for attempt in range(3):  # a race: several tries, each must come out whole
        with WeightCache(tmp_path / f"node{attempt}").writer(sb, digest) as w:
            with ThreadPoolExecutor(8) as pool:
                list(pool.map(lambda c: w.write(*c), chunks))
            path = w.finish()  # raises where a chunk landed elsewhere (the digest differs)
        assert path.read_bytes()[4096:] == (src / "model.gguf").read_bytes()[4096:]


# -- resuming a transfer, each chunk checked as it lands ---------------------------------------

def random_stage(tmp_path: Path, size: int = 4 << 20):
    from specpipe.loader.checkpoint import StageBytes

    src = tmp_path / "src"
    src.mkdir(parents=True, exist_ok=True)
    (src / "model.gguf").write_bytes(os.urandom(size))
    sb = StageBytes("model.gguf", False, [("model.gguf", size)], [("model.gguf", 4096, size - 4096)])
    return src, sb, stage_digest(src, sb)


def test_a_cut_off_transfer_resumes_from_its_verified_chunks(tmp_path):
    """A writer that stops (its process died: suspend() is what is left on disk) leaves a part
    directory; the next writer of that digest holds the chunks that landed, re-hashed from disk,
    and finishing after the rest gives the right entry."""
    from specpipe.cluster.weights import chunk_hash

    src, sb, digest = random_stage(tmp_path)
    chunk = 64 << 10
    chunks = list(iter_chunks(src, sb, chunk))
    cache = WeightCache(tmp_path / "node")
    w = cache.writer(sb, digest)
    assert w.held == [] and w.tmp.name == f".part-{digest}"
    for rel, offset, data in chunks[:20]:
        w.write(rel, offset, data, chunk_hash(data))
    w.suspend()
    again = cache.writer(sb, digest)
    assert again.tmp == w.tmp and sorted(again.held) == [(r, o, len(d)) for r, o, d in chunks[:20]]
    for rel, offset, data in chunks[20:]:
        again.write(rel, offset, data, chunk_hash(data))
    path = again.finish()
    assert path.read_bytes()[4096:] == (src / "model.gguf").read_bytes()[4096:]
    assert sorted(p.name for p in path.parent.iterdir()) == ["model.gguf"]  # no journal, no lock
    assert not w.tmp.exists()


def test_a_chunk_damaged_on_disk_or_in_transfer_is_not_kept(tmp_path):
    from specpipe.cluster.weights import chunk_hash

    src, sb, digest = random_stage(tmp_path)
    chunks = list(iter_chunks(src, sb, 64 << 10))
    cache = WeightCache(tmp_path / "node")
    w = cache.writer(sb, digest)
    rel, offset, data = chunks[0]
    bad = bytes([data[0] ^ 1]) + data[1:]
    with pytest.raises(WeightCacheError, match="damaged in transfer"):  # refused as it lands
        w.write(rel, offset, bad, chunk_hash(data))
    for c in chunks[:4]:
        w.write(*c, chunk_hash(c[2]))
    w.suspend()
    with open(w.tmp / "model.gguf", "r+b") as f:  # the disk loses chunk 2 (zeros, as an unflushed page)
        f.seek(chunks[2][1])
        f.write(bytes(len(chunks[2][2])))
    again = cache.writer(sb, digest)
    assert sorted(again.held) == sorted((r, o, len(d)) for r, o, d in [chunks[0], chunks[1], chunks[3]])
    again.abort()


def test_a_second_writer_of_a_digest_meanwhile_writes_apart(tmp_path):
    """The part directory is locked while a writer holds it: another writer of the same digest
    (a second driver) writes a directory of its own, resuming nothing, harming nothing."""
    src, sb, digest = random_stage(tmp_path, 1 << 20)
    cache = WeightCache(tmp_path / "node")
    first, second = cache.writer(sb, digest), cache.writer(sb, digest)
    assert first.tmp != second.tmp and second.tmp.name.startswith(".tmp-")
    for c in iter_chunks(src, sb, 64 << 10):
        second.write(*c)
    assert second.finish().read_bytes()[4096:] == (src / "model.gguf").read_bytes()[4096:]
    first.abort()


def test_the_driver_sends_only_what_the_node_lacks():
    from specpipe.cluster.streaming import missing

    spans = [("f", o, 10) for o in range(0, 100, 10)]
    # Held in another chunk size: spans wholly inside are skipped, partly covered ones re-sent.
    held = [("f", 0, 25), ("f", 25, 10), ("f", 60, 15), ("g", 0, 100)]
    assert missing(spans, held) == [("f", o, 10) for o in (30, 40, 50, 70, 80, 90)]
    assert missing(spans, []) == spans


# -- eviction: --weight-cache-max --------------------------------------------------------------

def cached_entries(tmp_path: Path, cache: WeightCache, n: int, size: int = 1 << 20) -> list:
    """`n` entries of `size` bytes each (random stages), the first the least recently used."""
    out = []
    for i in range(n):
        src, sb, digest = random_stage(tmp_path / f"m{i}", size)
        path = stream(cache, src / "model.gguf", sb, digest, 64 << 10)
        os.utime(cache.entry(digest), (1000.0 + i, 1000.0 + i))  # used long ago, in this order
        out.append((sb, digest, path))
    return out


def test_eviction_removes_the_least_recently_used_entries_first(tmp_path):
    cache = WeightCache(tmp_path / "node")
    entries = cached_entries(tmp_path, cache, 4)
    held = sum(i.bytes for i in cache.items())
    assert held >= 4 * (1 << 20) - 4 * 4096  # sparse: the 4 KiB header holes cost nothing
    one = held // 4
    # Room for one more entry under a cap of four: the oldest one goes, the others stay.
    removed = cache.make_room(one, f"{4 * one + 1}")
    assert [r.digest for r in removed] == [entries[0][1]]
    assert cache.find(entries[0][0], entries[0][1]) is None
    assert cache.find(entries[1][0], entries[1][1]) == entries[1][2]  # found: used now, the newest
    # A new stage of two entries' size (an hour later) evicts 2 and 3, not the entry just used.
    removed = cache.make_room(2 * one, f"{3 * one + 1}", now=time.time() + 3600)
    assert [r.digest for r in removed] == [entries[2][1], entries[3][1]]
    assert cache.find(entries[1][0], entries[1][1]) == entries[1][2]
    # Nothing to do under the cap.
    assert cache.make_room(one, "1GiB") == []


def test_eviction_spares_what_is_in_use_kept_recent_or_being_written(tmp_path):
    from specpipe.cluster.weights import chunk_hash, hold_entry

    cache = WeightCache(tmp_path / "node")
    (a, da, pa), (b, db, pb), (c, dc, pc) = cached_entries(tmp_path, cache, 3)
    one = max(i.bytes for i in cache.items())
    lock = hold_entry(pa)  # a stage serving from entry a
    assert lock is not None and hold_entry(tmp_path / "m0" / "src" / "model.gguf") is None  # not in a cache
    # A transfer under way (its writer holds the part's lock), older than everything.
    src, sd, dd = random_stage(tmp_path / "m9", 1 << 20)
    w = cache.writer(sd, dd)
    for rel, offset, data in list(iter_chunks(src, sd, 64 << 10))[:4]:
        w.write(rel, offset, data, chunk_hash(data))
    os.utime(w.tmp, (1.0, 1.0))
    for f in w.tmp.iterdir():
        os.utime(f, (1.0, 1.0))
    removed = cache.make_room(10 * one, "1TiB", keep=frozenset({db}), pending=0)
    assert removed == []  # under the cap: nothing
    removed = cache.make_room(one, f"{one}", keep=frozenset({db}), now=time.time() + 3600)
    # a in use, b kept, the part being written: only c may go (and the cap still is not met).
    assert [r.digest for r in removed] == [dc]
    assert cache.entry(da).is_dir() and cache.entry(db).is_dir() and w.tmp.is_dir()
    # Found a moment ago: about to be opened by a stage, not evicted either.
    lock.close()
    assert cache.find(a, da) == pa
    assert cache.make_room(one, f"{one}", keep=frozenset({db})) == []
    # Released and old: a goes; a part nobody writes any more goes too (oldest first).
    w.suspend()
    removed = cache.make_room(one, f"{one}", keep=frozenset({db}), now=time.time() + 3600)
    assert [r.kind for r in removed] == ["part", "entry"] and removed[1].digest == da
    assert not w.tmp.exists() and not cache.entry(da).exists()
    with pytest.raises(WeightCacheError, match="removed before the stage opened it"):
        hold_entry(pa)  # a stage told to open an entry evicted meanwhile fails, to be placed again


def test_a_stage_larger_than_the_cap_is_refused_naming_the_option(tmp_path, monkeypatch):
    cache = WeightCache(tmp_path / "node")
    with pytest.raises(WeightCacheError, match="raise --weight-cache-max"):
        cache.make_room(2 << 20, "1MiB")
    # A share: of what the cache holds plus the disk's free space.
    cached_entries(tmp_path, cache, 1)
    held = sum(i.bytes for i in cache.items())
    monkeypatch.setattr(weights.shutil, "disk_usage", lambda _p: shutil._ntuple_diskusage(10 << 30, 0, 1 << 30))
    assert cache.cap_bytes("50%") == (held + (1 << 30)) // 2 == cache.cap_bytes(None)
    assert cache.cap_bytes("3MiB") == 3 << 20


def test_the_node_agent_makes_room_before_a_transfer_begins(tmp_path):
    """NodeAgent.begin (called directly, no Ray): the cap counts the transfers already under way,
    the stages being placed (`keep`) stay, and it says what it removed."""
    from specpipe.cluster.node_agent import NodeAgent

    agent = NodeAgent(str(tmp_path / "node"))
    entries = cached_entries(tmp_path, agent.cache, 3)
    one = max(i.bytes for i in agent.cache.items())
    src, sb, digest = random_stage(tmp_path / "new1", 1 << 20)
    cap = f"{4 * one + 8192}"
    got = agent.begin(sb, digest, cap, keep=(entries[0][1],))
    assert got["held"] == [] and got["evicted"] == []  # three entries + one coming fit four
    src2, sb2, digest2 = random_stage(tmp_path / "new2", 1 << 20)
    got = agent.begin(sb2, digest2, cap, keep=(entries[0][1],))
    # The first transfer has written nothing yet but counts: one entry goes, the oldest not kept.
    assert [name for name, _ in got["evicted"]] == [entries[1][1]]
    agent.abort(digest)
    agent.abort(digest2)
