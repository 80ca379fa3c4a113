"""A node's copy of one pipeline stage's weights: the driver's own file where the node has the
same one, else the stage's bytes streamed from the driver into a content-addressed cache.

Glossary:
  stage bytes -- what a stage reads of the checkpoint's files (StageBytes, from
                 Checkpoint.stage_ranges): the files with their sizes, and the byte ranges of
                 them that must be present (headers and the stage's tensors).
  root        -- the directory the stage bytes' relative paths start from: a GGUF file's parent,
                 or the Hugging Face directory itself.
  digest      -- blake2b-256 over the checkpoint's name, each file's path and size, and each
                 range's position and bytes. Two copies with one digest build the same stage.
  entry       -- <cache>/weights/<digest>/: a sparse copy of the checkpoint (files at their full
                 size, only the stage's ranges written, at their original offsets), so the loaders
                 open it exactly like the original. It appears only by an atomic rename, complete.
  part        -- <cache>/weights/.part-<digest>/: an entry being written, with a journal of the
                 chunks that landed (each checked against its chunk hash as it landed), kept when
                 a transfer is cut off so that the next one resumes from it (CacheWriter).
  in use      -- <cache>/weights/.inuse/<digest>: a lock file a stage holds shared (flock)
                 while it serves from the entry (hold_entry); eviction skips an entry whose lock
                 it cannot take exclusively, and a part whose writer's lock is held.
  last used   -- an entry directory's mtime: set when it is finished, found (find), held.
  eviction    -- before a transfer, least recently used entries and parts are removed until
                 what the cache holds plus the transfer fit --weight-cache-max (make_room).

Why find() hashes an entry's bytes again every time, rather than trusting the digest cache: the
entry may have been cut short by a full disk, damaged on disk, or edited; a wrong weight would
not fail, it would silently change every token. The driver's own file is hashed once and the
digest kept (keyed by path, sizes and mtimes), since the driver has to hash it for every node.
"""

from __future__ import annotations

import bisect
import dataclasses
import hashlib
import json
import os
import re
import shutil
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Iterator, Optional

from specpipe.cache import cache_dir
from specpipe.config import WEIGHT_CACHE_MAX_DEFAULT, parse_cache_max, parse_weight_chunk
from specpipe.loader.checkpoint import StageBytes

__all__ = ["StageBytes", "WeightCacheError", "cache_dir", "stage_digest", "iter_chunks", "chunk_spans",
           "chunk_hash", "WeightCache", "CacheWriter", "CacheItem", "hold_entry", "parse_weight_chunk",
           "parse_cache_max"]

CHUNK_BYTES = 8 << 20  # reads and streamed messages: large enough to be cheap, small enough to hold
_DIGEST = re.compile(r"[0-9a-f]{64}")
STALE_S = 24 * 3600  # a temporary entry untouched this long belongs to a writer that died
JOURNAL, LOCK = ".chunks", ".lock"  # in a part directory: the chunks written, the writer's lock
INUSE = ".inuse"  # <cache>/weights/.inuse/<digest>: held (flock, shared) by a stage serving the entry
RECENT_S = 120.0  # an entry found or finished this recently is about to be opened: not evicted


class WeightCacheError(RuntimeError):
    """Stage bytes that cannot be hashed, streamed or cached; the message is meant for the user."""


CACHE_MAX_DEFAULT = WEIGHT_CACHE_MAX_DEFAULT  # --weight-cache-max unset (the option's rules: config.py)


def _check_layout(sb: StageBytes) -> None:
    """Refuse stage bytes that could write outside an entry or that no checkpoint could have:
    they come from another machine. Every path is a plain file name (no checkpoint SpecPipe
    opens has subdirectories), every range lies inside its file."""
    def plain(name: object) -> bool:
        return isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\\" not in name \
            and "\0" not in name

    if not plain(sb.name):
        raise WeightCacheError(f"stage bytes name {sb.name!r} is not a plain file name")
    sizes = dict(sb.files)
    if len(sizes) != len(sb.files) or not all(plain(rel) and isinstance(size, int) and size >= 0
                                              for rel, size in sb.files):
        raise WeightCacheError(f"{sb.name}: stage bytes list odd files {sb.files!r}")
    if not sb.is_dir and [rel for rel, _ in sb.files] != [sb.name]:
        raise WeightCacheError(f"{sb.name}: a single-file checkpoint's stage bytes must list just that file")
    for rel, offset, length in sb.ranges:
        if rel not in sizes or not (isinstance(offset, int) and isinstance(length, int)) \
                or offset < 0 or length <= 0 or offset + length > sizes[rel]:
            raise WeightCacheError(f"{sb.name}: range ({rel!r}, {offset}, {length}) is not inside a listed file")


def _sizes_match(root: Path, sb: StageBytes) -> bool:
    try:
        return all((root / rel).stat().st_size == size for rel, size in sb.files)
    except OSError:
        return False


def _read_range(path: Path, offset: int, length: int, chunk_bytes: int) -> Iterator[tuple[int, bytes]]:
    """(offset, bytes) of [offset, offset + length) in chunks; a file shorter than that is an error."""
    with open(path, "rb") as f:
        f.seek(offset)
        end = offset + length
        while offset < end:
            data = f.read(min(chunk_bytes, end - offset))
            if not data:
                raise WeightCacheError(f"{path}: ends at byte {offset}, the stage needs bytes up to {end}")
            yield offset, data
            offset += len(data)


def _hash(root: Path, sb: StageBytes, chunk_bytes: int = CHUNK_BYTES) -> str:
    """The digest, from the bytes themselves (see the glossary)."""
    h = hashlib.blake2b(digest_size=32)
    h.update(json.dumps([sb.name, sb.is_dir, sb.files]).encode() + b"\n")
    for rel, offset, length in sb.ranges:
        h.update(f"{rel}\0{offset}\0{length}\n".encode())
        for _, data in _read_range(root / rel, offset, length, chunk_bytes):
            h.update(data)
    return h.hexdigest()


def stage_digest(root: Path, sb: StageBytes, cache: Optional[Path] = None) -> str:
    """The digest of the stage bytes under `root`, read once and then remembered.

    Remembered under `cache` (default cache_dir()) by the files' absolute paths, sizes and
    mtime_ns and the ranges, so the driver hashes a 40 GB model once, not once per node and run;
    rewriting a file changes its mtime and so the key. (A rewrite that restores the old mtime is
    not seen; WeightCache.find never trusts this for its own entries.)
    """
    root = Path(root).resolve()
    _check_layout(sb)
    try:
        stats = [(rel, (root / rel).stat()) for rel, _ in sb.files]
    except OSError as e:
        raise WeightCacheError(f"{root}: cannot hash the stage's files ({e})") from None
    for (rel, st), (_, size) in zip(stats, sb.files):
        if st.st_size != size:
            raise WeightCacheError(f"{root / rel}: has {st.st_size} bytes, the stage bytes say {size}")
    key = json.dumps([str(root), sb.name, sb.is_dir, [(rel, st.st_size, st.st_mtime_ns) for rel, st in stats],
                      sb.ranges])
    memo = (Path(cache) if cache is not None else cache_dir()) / "digests" / \
        hashlib.blake2b(key.encode(), digest_size=16).hexdigest()
    try:
        known = memo.read_text().strip()
        if _DIGEST.fullmatch(known):
            return known
    except OSError:
        pass
    digest = _hash(root, sb)
    try:  # a cache that cannot be written costs a re-read next time, nothing more
        memo.parent.mkdir(parents=True, exist_ok=True)
        tmp = memo.with_name(f"{memo.name}.{os.getpid()}.tmp")
        tmp.write_text(digest + "\n")
        os.replace(tmp, memo)
    except OSError:
        pass
    return digest


def iter_chunks(root: Path, sb: StageBytes, chunk_bytes: int = CHUNK_BYTES) -> Iterator[tuple[str, int, bytes]]:
    """The driver's side of streaming: (relative path, offset, bytes) covering every range, in
    chunks of at most `chunk_bytes`, for CacheWriter.write on the node."""
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
    for rel, offset, length in sb.ranges:
        for at, data in _read_range(Path(root) / rel, offset, length, chunk_bytes):
            yield rel, at, data


def chunk_spans(sb: StageBytes, chunk_bytes: int = CHUNK_BYTES) -> list[tuple[str, int, int]]:
    """(relative path, offset, length) of the chunks iter_chunks reads, without reading them."""
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
    return [(rel, at, min(chunk_bytes, offset + length - at))
            for rel, offset, length in sb.ranges for at in range(offset, offset + length, chunk_bytes)]


def chunk_hash(data: bytes) -> str:
    """A streamed chunk's own check: blake2b-128 of its bytes."""
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def _check_digest(digest: str) -> None:
    if not (isinstance(digest, str) and _DIGEST.fullmatch(digest)):  # it becomes a directory name
        raise WeightCacheError(f"not a stage digest: {digest!r}")


def _entry_root(entry: Path, sb: StageBytes) -> Path:
    """Where an entry keeps the files: in a directory of the checkpoint's name for a Hugging Face
    checkpoint, the entry itself for a GGUF file (which is named like the original)."""
    return entry / sb.name if sb.is_dir else entry


def _entry_good(entry: Path, sb: StageBytes, digest: str) -> bool:
    """The entry's files have the right sizes and its bytes hash to `digest`, read now."""
    root = _entry_root(entry, sb)
    try:
        return _sizes_match(root, sb) and _hash(root, sb) == digest
    except (OSError, WeightCacheError):
        return False


def _remove(path: Path) -> None:
    """Delete a directory tree, first renamed aside so no reader ever sees half of it."""
    aside = path.with_name(f".trash-{path.name}-{uuid.uuid4().hex[:12]}")
    try:
        os.rename(path, aside)
    except OSError:
        return  # gone already (another process removed it)
    shutil.rmtree(aside, ignore_errors=True)


def _touch(path: Path) -> None:
    try:
        os.utime(path)
    except OSError:
        pass


@dataclasses.dataclass(frozen=True)
class CacheItem:
    """An entry or a part in a node's cache (WeightCache.items)."""

    path: Path
    kind: str  # "entry" | "part"
    digest: Optional[str]  # None: a second writer's .tmp-* directory
    bytes: int  # on disk (a sparse file's holes cost nothing)
    used: float  # when last used (entry: its mtime; part: its newest file's)


def hold_entry(path: str | Path) -> Optional[object]:
    """Mark the cache entry that `path` (what a stage opens) lies in as in use while the returned
    file stays open (a shared flock on <cache>/weights/.inuse/<digest>): a stage serving from it
    keeps eviction away. None where `path` is not in a cache entry (the driver's own file);
    WeightCacheError where the entry is gone (evicted between find and now: the stage fails to
    start and is placed again, its bytes streamed again)."""
    import fcntl

    path = Path(path)
    for entry in [path, *path.parents]:
        if _DIGEST.fullmatch(entry.name) and entry.parent.name == "weights":
            break
    else:
        return None
    (entry.parent / INUSE).mkdir(exist_ok=True)
    lock = open(entry.parent / INUSE / entry.name, "a")
    fcntl.flock(lock.fileno(), fcntl.LOCK_SH)  # waits while an eviction of it is under way
    if not entry.is_dir():
        lock.close()
        raise WeightCacheError(f"{entry}: the cache entry was removed before the stage opened it")
    _touch(entry)
    return lock


class WeightCache:
    """A node's content-addressed store of stage copies, under <root>/weights/<digest>/."""

    def __init__(self, root: Optional[Path] = None) -> None:
        self.root = Path(root) if root is not None else cache_dir()
        self.weights = self.root / "weights"

    def entry(self, digest: str) -> Path:
        _check_digest(digest)
        return self.weights / digest

    def find(self, sb: StageBytes, digest: str, local_root: Optional[Path] = None) -> Optional[Path]:
        """The checkpoint path to open for these stage bytes, or None when they must be fetched.

        local_root: the driver's checkpoint path (file or directory); used when this node has
        files of the same sizes there whose stage digest is `digest`. Else a cache entry whose
        files have the right sizes and whose bytes hash to `digest` now; an entry that does not
        (truncated, corrupted) is deleted, so the caller fetches it again.
        """
        _check_layout(sb)
        entry = self.entry(digest)
        if local_root is not None:
            local_root = Path(local_root).expanduser()
            root = sb.root_of(local_root)
            if local_root.exists() and local_root.name == sb.name and _sizes_match(root, sb):
                try:
                    if stage_digest(root, sb, self.root) == digest:
                        return local_root
                except (OSError, WeightCacheError):
                    pass  # unreadable here: use the cache instead
        if not entry.is_dir():
            return None
        if not _entry_good(entry, sb, digest):
            _remove(entry)
            return None
        _touch(entry)  # used now: the last to be evicted
        return sb.checkpoint_path(_entry_root(entry, sb))

    def writer(self, sb: StageBytes, digest: str) -> "CacheWriter":
        """A new entry for `digest`, written by the caller (from iter_chunks' chunks)."""
        self._sweep()
        return CacheWriter(self, sb, digest)

    # -- eviction ------------------------------------------------------------------------------
    def cap_bytes(self, cache_max: Optional[str] = None) -> int:
        """--weight-cache-max in bytes on this node: a size as given; a share (default 50%) of
        what the cache holds plus the disk's free space where it lives."""
        kind, value = parse_cache_max(cache_max if cache_max is not None else CACHE_MAX_DEFAULT)
        if kind == "bytes":
            return int(value)
        self.weights.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(self.weights).free
        return int(value * (free + sum(item.bytes for item in self.items())))

    def items(self) -> list["CacheItem"]:
        """Every entry and part in the cache, with its bytes on disk and when it was last used."""
        out = []
        if not self.weights.is_dir():
            return out
        for path in self.weights.iterdir():
            name = path.name
            if _DIGEST.fullmatch(name):
                kind, digest = "entry", name
            elif name.startswith(".part-") and _DIGEST.fullmatch(name[6:]):
                kind, digest = "part", name[6:]
            elif name.startswith(".tmp-"):
                kind, digest = "part", None
            else:
                continue  # .inuse, .trash-* (being removed)
            try:
                used, size = path.stat().st_mtime, 0
                for f in path.rglob("*"):
                    st = f.stat()
                    size += st.st_blocks * 512 if f.is_file() else 0  # sparse files: what the disk holds
                    used = max(used, st.st_mtime) if kind == "part" else used
            except OSError:
                continue  # removed meanwhile
            out.append(CacheItem(path, kind, digest, size, used))
        return out

    def make_room(self, need: int, cache_max: Optional[str] = None, keep: frozenset = frozenset(),
                  pending: int = 0, now: Optional[float] = None) -> list["CacheItem"]:
        """Remove least recently used entries and parts until what the cache holds plus `need`
        bytes (a new transfer's) plus `pending` (transfers under way, not yet on disk) fit the
        cap; returns what was removed. Never removed: the digests in `keep` (the
        stages being placed now), an entry a stage holds (hold_entry) or found or finished in the
        last RECENT_S (a stage about to open it), a part whose writer holds its lock. Where the
        rest cannot make room, the new bytes go in all the same (the cap is exceeded by what is
        in use) unless they alone exceed the cap: then WeightCacheError, naming the option."""
        cap = self.cap_bytes(cache_max)
        if need > cap:
            raise WeightCacheError(f"a stage of {need / 2**20:.1f} MiB does not fit this node's weight cache "
                                   f"({cap / 2**20:.1f} MiB by --weight-cache-max "
                                   f"{cache_max or CACHE_MAX_DEFAULT}): raise --weight-cache-max")
        now = time.time() if now is None else now
        items = self.items()
        held = sum(item.bytes for item in items)
        removed: list[CacheItem] = []
        for item in sorted(items, key=lambda i: i.used):
            if held + need + pending <= cap:
                break
            if item.digest in keep or (item.kind == "entry" and now - item.used < RECENT_S):
                continue
            if self._evict(item):
                held -= item.bytes
                removed.append(item)
        return removed

    def _evict(self, item: "CacheItem") -> bool:
        """Remove `item` unless it is in use (a stage holds the entry, a writer the part)."""
        import fcntl

        if item.kind == "entry":
            (self.weights / INUSE).mkdir(exist_ok=True)
            lock_path = self.weights / INUSE / item.digest
        else:
            lock_path = item.path / LOCK
        try:
            lock = open(lock_path, "a")
        except OSError:
            return False  # a part being removed, or not ours to touch
        try:
            try:
                fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                return False  # in use
            if item.kind == "entry":
                _remove(item.path)
                lock_path.unlink(missing_ok=True)  # a holder waiting on it finds the entry gone
            else:
                shutil.rmtree(item.path, ignore_errors=True)
            return True
        finally:
            lock.close()

    def _sweep(self) -> None:
        """Remove what crashed processes left: temporary entries nobody has written to for a day
        (their sparse files can hold most of a stage) and entries half removed."""
        if not self.weights.is_dir():
            return
        now = time.time()
        for tmp in [*self.weights.glob(".tmp-*"), *self.weights.glob(".part-*"), *self.weights.glob(".trash-*")]:
            try:
                newest = max([tmp.stat().st_mtime] + [f.stat().st_mtime for f in tmp.rglob("*")])
            except OSError:
                continue  # being removed right now
            if now - newest > STALE_S:
                shutil.rmtree(tmp, ignore_errors=True)


class CacheWriter:
    """One entry being written: a directory beside the final one, holding the checkpoint's files
    at their full sizes as holes; `write` fills the needed ranges, `finish` checks the digest and
    renames the directory into place. Use as a context manager to abort on an error.

    Resumable: the directory is <cache>/weights/.part-<digest>/, the same for every writer of
    that digest, and a journal there lists each chunk written with its chunk hash. A writer that
    finds a part directory left by one that died (its node lost mid-stream, the driver
    interrupted) re-hashes the journal's chunks from the disk and keeps those that still match
    (`held`): the driver sends only the rest. The part directory is locked (flock) while a writer
    holds it, so a second writer of the same digest meanwhile writes a fresh directory of its own
    instead; the lock goes with the process that held it.

    `write` may be called from several threads at once (the node agent serves a few calls
    concurrently while the driver keeps chunks in flight). A shared seek() + write() put chunks at
    each other's offsets; os.pwrite names its offset, and the lock (the disk is the bottleneck
    anyway) keeps finish/abort from closing a file under a write, whose descriptor number the OS
    could meanwhile give to another file."""

    def __init__(self, cache: WeightCache, sb: StageBytes, digest: str) -> None:
        _check_layout(sb)
        self.sb, self.digest, self.final = sb, digest, cache.entry(digest)
        cache.weights.mkdir(parents=True, exist_ok=True)
        self._files: dict[str, object] = {}
        self._lock = threading.Lock()
        self._ranges: dict[str, list[tuple[int, int]]] = {}  # rel -> sorted (start, end)
        for rel, offset, length in sb.ranges:
            self._ranges.setdefault(rel, []).append((offset, offset + length))
        for spans in self._ranges.values():
            spans.sort()
        self.tmp, self._lock_file = self._claim(cache)
        self._root = _entry_root(self.tmp, sb)
        self.held: list[tuple[str, int, int]] = []  # chunks already here, verified (a resumed entry)
        try:
            self._root.mkdir(exist_ok=True)
            for rel, size in sb.files:
                path = self._root / rel
                f = open(path, "r+b" if path.exists() else "w+b")
                if os.fstat(f.fileno()).st_size != size:
                    f.truncate(size)  # sparse: the holes cost no disk
                self._files[rel] = f
            self.held = self._verified_journal()
            self._journal = open(self.tmp / JOURNAL, "a")
        except OSError as e:
            self.abort()
            raise WeightCacheError(f"{self.tmp}: cannot create the stage's files ({e})") from None

    def _claim(self, cache: WeightCache) -> tuple[Path, object]:
        """The part directory of this digest, locked; a fresh one where another writer holds it."""
        import fcntl

        part = cache.weights / f".part-{self.digest}"
        for path in (part, None):
            if path is None:
                path = Path(tempfile.mkdtemp(prefix=f".tmp-{self.digest[:16]}-", dir=cache.weights))
            else:
                path.mkdir(exist_ok=True)
            lock = open(path / LOCK, "a")
            try:
                fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                os.utime(path)  # touched: the sweep leaves it alone
                return path, lock
            except OSError:
                lock.close()
        raise WeightCacheError(f"{cache.weights}: cannot lock a directory to write {self.digest} in")

    def _verified_journal(self) -> list[tuple[str, int, int]]:
        """The journal's chunks whose bytes on disk still hash as recorded (the rest are sent
        again: a chunk the OS had not written out when the machine died reads as zeros); the
        journal rewritten to just those."""
        path = self.tmp / JOURNAL
        try:
            lines = path.read_text().splitlines()
        except OSError:
            return []
        good, kept = [], []
        for line in lines:
            parts = line.split("\t")
            if len(parts) != 4 or not parts[1].isdigit() or not parts[2].isdigit():
                continue  # a line cut short by the writer's death
            rel, offset, length, digest = parts[0], int(parts[1]), int(parts[2]), parts[3]
            f = self._files.get(rel)
            if f is None or not self._inside(rel, offset, length) or \
                    chunk_hash(os.pread(f.fileno(), length, offset)) != digest:
                continue
            good.append((rel, offset, length))
            kept.append(line + "\n")
        tmp = path.with_name(JOURNAL + ".new")
        tmp.write_text("".join(kept))
        os.replace(tmp, path)
        return good

    def _inside(self, relpath: str, offset: int, length: int) -> bool:
        spans = self._ranges.get(relpath, [])
        i = bisect.bisect_right(spans, (offset, float("inf"))) - 1
        return offset >= 0 and i >= 0 and offset + length <= spans[i][1]

    def write(self, relpath: str, offset: int, data: bytes, digest: Optional[str] = None) -> None:
        """Put `data` at `offset` of `relpath`; it must lie inside one of the needed ranges, so a
        confused or hostile sender cannot grow the entry or write where no weight is. `digest`:
        the chunk's hash (chunk_hash) as the sender read it; a chunk that does not match is
        refused as it lands, before it is written, so a damaged transfer is named at its chunk
        rather than by the whole entry's digest at the end."""
        if not self._inside(relpath, offset, len(data)):
            raise WeightCacheError(f"{self.sb.name}: refusing to write {len(data)} bytes at {relpath!r} offset "
                                   f"{offset}: not inside a range the stage needs")
        got = chunk_hash(data)
        if digest is not None and got != digest:
            raise WeightCacheError(f"{self.sb.name}: the chunk at {relpath!r} offset {offset} ({len(data)} bytes) "
                                   f"hashes to {got}, the sender read {digest}: damaged in transfer")
        with self._lock:
            f = self._files.get(relpath)
            if f is None:
                raise WeightCacheError(f"{self.sb.name}: the entry is already finished or aborted")
            view, at = memoryview(data), offset
            while view:  # pwrite may write less than asked (a signal, a full pipe): go on from there
                n = os.pwrite(f.fileno(), view, at)
                view, at = view[n:], at + n
            # After the bytes: a journal line never names a chunk that is not (in the page cache)
            # there. No fsync: a resumed writer re-hashes every chunk the journal names.
            self._journal.write(f"{relpath}\t{offset}\t{len(data)}\t{got}\n")
            self._journal.flush()

    def finish(self) -> Path:
        """Check what was written against the digest and move the entry into place; the path to
        open. When another writer finished the same entry first, theirs is kept."""
        self._close()
        try:
            got = _hash(self._root, self.sb)
        except (OSError, WeightCacheError) as e:
            self.abort()
            raise WeightCacheError(f"{self.sb.name}: cannot check the written stage bytes ({e})") from None
        if got != self.digest:
            self.abort()
            raise WeightCacheError(f"{self.sb.name}: the stage bytes written hash to {got}, expected "
                                   f"{self.digest} (a chunk missing or damaged in transfer)")
        for name in (JOURNAL, LOCK):  # the entry holds the checkpoint's files only
            (self.tmp / name).unlink(missing_ok=True)
        for attempt in range(2):
            try:
                os.rename(self.tmp, self.final)  # atomic: readers see no entry or a whole one
                break
            except OSError as e:
                if not self.final.is_dir():
                    self.abort()
                    raise WeightCacheError(f"{self.final}: cannot move the entry into place ({e})") from None
                # Another writer got there first. Theirs holds the same bytes, unless it is a
                # damaged entry nobody has removed yet: then it goes and ours takes its place.
                if attempt == 1 or _entry_good(self.final, self.sb, self.digest):
                    self.abort()
                    break
                _remove(self.final)
        self._unlock()
        _touch(self.final)
        return self.sb.checkpoint_path(_entry_root(self.final, self.sb))

    def suspend(self) -> None:
        """Stop writing but keep what landed, for a later writer of this digest to resume."""
        self._close()
        self._unlock()

    def abort(self) -> None:
        """Drop the unfinished entry."""
        self._close()
        shutil.rmtree(self.tmp, ignore_errors=True)
        self._unlock()

    def _close(self) -> None:
        with self._lock:
            for f in self._files.values():
                f.close()
            self._files.clear()
            journal = getattr(self, "_journal", None)
            if journal is not None:
                journal.close()
                self._journal = None

    def _unlock(self) -> None:
        lock, self._lock_file = getattr(self, "_lock_file", None), None
        if lock is not None:
            lock.close()  # closing the descriptor releases the flock

    def __enter__(self) -> "CacheWriter":
        return self

    def __exit__(self, kind, value, tb) -> None:
        if kind is not None:
            self.abort()
