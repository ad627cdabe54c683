"""The on-disk model cache the download init container keeps: what a complete copy is.

A cache directory holds one model snapshot plus ``.kvpilot-model.json``, the marker. The
marker records the repository, the revision asked for, the commit it resolved to and the
file list (path, size, content digest) with a sha256 over that list. Invariants:

- the marker is written last, atomically (temporary file, fsync, rename, fsync of the
  directory), and removed before any file of the directory changes, so a directory whose
  download failed or was killed half-way never has a marker;
- a marker counts only if its checksum matches its own file list and every listed file is
  on disk with its recorded size (a truncated file fails that check).

Several pods may share the directory (a ReadWriteMany claim): ``cache_lock`` serializes
them with a POSIX lock (``fcntl.lockf``, which NFSv4 and the CSI file services honour).
No Hugging Face code here: ``model_fetch`` fills the directory.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

MARKER = ".kvpilot-model.json"
MARKER_VERSION = 1


@dataclass(frozen=True, slots=True)
class CachedFile:
    """One file of a snapshot: ``digest`` is the LFS sha256, else the git blob id."""

    path: str
    size: int
    digest: str


def files_checksum(files: Iterable[CachedFile]) -> str:
    """sha256 over the sorted (path, size, digest) list: equal exactly when the lists are."""
    h = hashlib.sha256()
    for f in sorted(files, key=lambda f: f.path):
        h.update(f"{f.path}\0{f.size}\0{f.digest}\n".encode())
    return h.hexdigest()


@dataclass(frozen=True, slots=True)
class Marker:
    """What a complete cache directory holds.

    Args:
        repo_id: ``org/name``.
        revision: the revision asked for (``main``, a tag, a commit).
        commit: the commit it resolved to.
        files: the snapshot's files.
    """

    repo_id: str
    revision: str
    commit: str
    files: tuple[CachedFile, ...]

    @property
    def checksum(self) -> str:
        return files_checksum(self.files)

    @property
    def num_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def to_json(self) -> str:
        return json.dumps({"version": MARKER_VERSION, "repo": self.repo_id, "revision": self.revision,
                           "commit": self.commit, "files_sha256": self.checksum,
                           "files": [{"path": f.path, "size": f.size, "digest": f.digest}
                                     for f in sorted(self.files, key=lambda f: f.path)]}, indent=1)


def read_marker(directory: Path) -> Marker | None:
    """The directory's marker, or None when absent, unreadable or inconsistent with itself."""
    try:
        data = json.loads((directory / MARKER).read_text())
        marker = Marker(data["repo"], data["revision"], data["commit"],
                        tuple(CachedFile(f["path"], int(f["size"]), f["digest"]) for f in data["files"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if data.get("version") != MARKER_VERSION or data.get("files_sha256") != marker.checksum:
        return None
    return marker


def damaged_files(directory: Path, files: Iterable[CachedFile]) -> list[str]:
    """Paths of ``files`` missing from ``directory`` or of another size (a truncated download)."""
    bad = []
    for f in files:
        try:
            if (directory / f.path).stat().st_size != f.size:
                bad.append(f.path)
        except OSError:
            bad.append(f.path)
    return bad


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_marker(directory: Path, marker: Marker) -> None:
    """Write the marker atomically: it appears whole, after the files it describes are durable."""
    for f in marker.files:  # the files first: a marker must never outlive lost file data
        with open(directory / f.path, "rb") as handle:
            os.fsync(handle.fileno())
    tmp = directory / f"{MARKER}.tmp"
    with open(tmp, "w") as handle:
        handle.write(marker.to_json())
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, directory / MARKER)
    _fsync_dir(directory)


def remove_marker(directory: Path) -> None:
    """Make the directory look incomplete (durably) before anything in it changes."""
    with contextlib.suppress(FileNotFoundError):
        (directory / MARKER).unlink()
        _fsync_dir(directory)


def prune(directory: Path, keep: Iterable[CachedFile]) -> list[str]:
    """Delete files under ``directory`` that are not in ``keep`` (stale shards of an older
    revision or another model would be loaded by the engine); hidden top-level entries (the
    marker, the downloader's metadata) stay. Returns the deleted paths."""
    wanted = {f.path for f in keep}
    removed = []
    for root, dirs, names in os.walk(directory, topdown=True):
        rel_root = Path(root).relative_to(directory)
        if rel_root == Path("."):
            dirs[:] = [d for d in dirs if not d.startswith(".")]
            names = [n for n in names if not n.startswith(".")]
        for name in names:
            rel = (rel_root / name).as_posix()
            if rel not in wanted:
                (Path(root) / name).unlink()
                removed.append(rel)
    for root, _, _ in os.walk(directory, topdown=False):
        rel_root = Path(root).relative_to(directory)
        if rel_root.parts and not rel_root.parts[0].startswith(".") and not os.listdir(root):
            os.rmdir(root)
    return sorted(removed)


@contextlib.contextmanager
def cache_lock(directory: Path) -> Iterator[None]:
    """Hold the cache directory's lock (a sibling file, so that the directory's own listing
    stays the snapshot's); blocks while another pod fills the cache."""
    directory.parent.mkdir(parents=True, exist_ok=True)
    with open(directory.parent / f".{directory.name}.lock", "a") as handle:
        fcntl.lockf(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.lockf(handle, fcntl.LOCK_UN)
