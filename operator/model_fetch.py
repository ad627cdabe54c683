"""Init-container entry point: put an ``hf://org/name[@revision]`` model into a cache directory.

``hf://org/name/path/file.gguf[@revision]`` fetches that one GGUF file of the repository
(the engine serves it with ``--model DIR/path/file.gguf``); ``--tokenizer-only`` fetches a
repository's tokenizer files only (``spec.model.tokenizer``, for a GGUF file whose own
tokenizer should be replaced).

Runs in the engine image before the engine starts, so that the engine only ever reads a
local directory: ``python -m kvpilot.operator.model_fetch --uri hf://Qwen/Qwen3-0.6B --dest
/models/model``. The directory is usually on the service's cache claim, so it outlives the
pod; ``model_cache`` says what a complete copy is. One start:

1. take the cache lock (replicas sharing a ReadWriteMany claim wait for each other);
2. resolve the revision to a commit and list its files (one Hub API call; none at all when
   the revision is a commit hash the cache already holds); if the Hub cannot be reached
   and the cache holds the same revision, use it;
3. if the marker names that commit and file list and every file has its size: done,
   nothing is downloaded;
4. else remove the marker; delete files the new snapshot does not have, files whose content
   changed (by the old marker's digests) and files of the wrong size, so that the claim
   needs room for one copy only; download what is missing
   (``huggingface_hub.snapshot_download``, which skips files it already has for that
   commit); check every size again (one retry for files that are still wrong); write the
   marker last.

The token comes from ``HF_TOKEN`` and a mirror from ``HF_ENDPOINT`` (the operator maps the
spec's credentials Secret into the environment). Only weights, configs and tokenizer files
are fetched (no ``*.bin`` / ``*.pth`` duplicates of the safetensors, no ``*.py`` code: the
engine never runs a repository's code). File names come from the Hub (or a mirror) and are
not trusted: a snapshot listing a name that would leave the cache directory (``../x``,
``/etc/x``, a symlinked folder) or land on its hidden entries (the marker) is refused
before any file is touched.
"""

from __future__ import annotations

import argparse
import logging
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from kvpilot.operator.contract.inference_service import URI_FORMS
from kvpilot.operator.model_cache import (
    CachedFile,
    Marker,
    cache_lock,
    damaged_files,
    files_checksum,
    prune,
    read_marker,
    remove_marker,
    write_marker,
)

HF_URI = re.compile(URI_FORMS["hf"] + "$")
COMMIT = re.compile(r"^[0-9a-f]{40}$")
DEFAULT_REVISION = "main"
ALLOW_PATTERNS = ("*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken", "*.jinja")
TOKENIZER_PATTERNS = ("tokenizer*", "special_tokens_map.json", "vocab.*", "merges.txt", "*.model",
                      "*.tiktoken", "*.jinja", "chat_template*", "added_tokens.json")

logger = logging.getLogger("kvpilot.model_fetch")


class FetchError(RuntimeError):
    """The model could not be put into the cache; the cache is left without a marker."""


@dataclass(frozen=True, slots=True)
class HfUri:
    """A parsed ``hf://org/name[/path/file.gguf][@revision]``."""

    repo_id: str
    revision: str | None = None
    file: str | None = None

    def patterns(self, tokenizer_only: bool = False) -> tuple[str, ...]:
        """The repository files to fetch (``huggingface_hub`` allow-patterns)."""
        if tokenizer_only:
            return TOKENIZER_PATTERNS
        return (self.file,) if self.file else ALLOW_PATTERNS   # a GGUF file holds config and tokenizer


def parse_hf_uri(uri: str) -> HfUri:
    """``hf://org/name[/file.gguf][@rev]`` -> ``HfUri``; ValueError otherwise."""
    match = HF_URI.match(uri)
    if match is None:
        raise ValueError(f"not an hf://org/name[/path/file.gguf][@revision] URI: {uri!r}")
    return HfUri(match["repo"], match["rev"], match["file"])


@dataclass(frozen=True, slots=True)
class Snapshot:
    """One commit of a repository and the files of it that the engine needs."""

    commit: str
    files: tuple[CachedFile, ...]


class Source(Protocol):
    """Where snapshots come from (the Hub; tests point it at a fake Hub on loopback)."""

    def snapshot(self, repo_id: str, revision: str) -> Snapshot: ...

    def download(self, repo_id: str, commit: str, dest: Path) -> None: ...


def _unreachable(exc: BaseException) -> bool:
    """A connection problem or a Hub outage (not: no such repo / revision, no access)."""
    names = {cls.__name__ for cls in type(exc).__mro__}
    if names & {"ConnectError", "ConnectTimeout", "TimeoutException", "ConnectionError", "NetworkError",
                "OfflineModeIsEnabled"}:
        return True
    response = getattr(exc, "response", None)
    return "HfHubHTTPError" in names and getattr(response, "status_code", 0) >= 500


class HubSource:
    """The Hugging Face Hub through ``huggingface_hub``.

    Args:
        endpoint: the Hub's URL (None: ``HF_ENDPOINT`` or huggingface.co).
        token: an access token (None: ``HF_TOKEN``).
        patterns: the files wanted (allow-patterns; default: weights, configs, tokenizer).
    """

    def __init__(self, endpoint: str | None = None, token: str | None = None,
                 patterns: tuple[str, ...] = ALLOW_PATTERNS) -> None:
        self.endpoint, self.token, self.patterns = endpoint, token, list(patterns)

    def snapshot(self, repo_id: str, revision: str) -> Snapshot:
        from huggingface_hub import HfApi  # lazy: only the init container needs it
        from huggingface_hub.utils import filter_repo_objects

        info = HfApi(endpoint=self.endpoint, token=self.token).model_info(
            repo_id, revision=revision, files_metadata=True)
        files = [CachedFile(s.rfilename, int(s.size or 0), s.lfs.sha256 if s.lfs else (s.blob_id or ""))
                 for s in info.siblings or ()]
        wanted = filter_repo_objects(files, allow_patterns=self.patterns, key=lambda f: f.path)
        return Snapshot(info.sha, tuple(wanted))

    def download(self, repo_id: str, commit: str, dest: Path) -> None:
        from huggingface_hub import snapshot_download

        snapshot_download(repo_id, revision=commit, local_dir=dest, allow_patterns=self.patterns,
                          endpoint=self.endpoint, token=self.token)


@dataclass(frozen=True, slots=True)
class FetchResult:
    """``downloaded`` is False when the cache already held the snapshot."""

    marker: Marker
    downloaded: bool


def check_names(dest: Path, files: tuple[CachedFile, ...]) -> None:
    """Refuse a snapshot whose file names leave ``dest`` or touch its hidden top-level entries.

    Raises:
        FetchError: naming the first such file.
    """
    root = dest.resolve()
    for f in files:
        parts = f.path.split("/")
        bad = (not f.path or "\\" in f.path or "\0" in f.path or f.path.startswith("/")
               or any(p in ("", ".", "..") for p in parts) or parts[0].startswith("."))
        if not bad:
            target = (dest / f.path).resolve()
            bad = target == root or root not in target.parents
        if bad:
            raise FetchError(f"the snapshot lists a file name that leaves the cache directory or "
                             f"touches its own entries: {f.path!r}; nothing was changed")


def _valid(dest: Path, marker: Marker | None, repo_id: str, commit: str | None,
           checksum: str | None) -> bool:
    return (marker is not None and marker.repo_id == repo_id and (commit is None or marker.commit == commit)
            and (checksum is None or marker.checksum == checksum) and not damaged_files(dest, marker.files))


def _download(source: Source, repo_id: str, snap: Snapshot, dest: Path) -> None:
    """Download until every file has its listed size (one retry for stubborn files)."""
    for attempt in (1, 2):
        for path in damaged_files(dest, snap.files):  # wrong-size leftovers would be kept as they are
            (dest / path).unlink(missing_ok=True)
        source.download(repo_id, snap.commit, dest)
        bad = damaged_files(dest, snap.files)
        if not bad:
            return
        logger.warning("attempt %d: %d file(s) incomplete after the download: %s", attempt, len(bad),
                       ", ".join(bad[:5]))
    raise FetchError(f"{repo_id}@{snap.commit}: files still incomplete after a retry: {', '.join(bad)}")


def fetch(source: Source, repo_id: str, revision: str | None, dest: Path) -> FetchResult:
    """Make ``dest`` a complete copy of ``repo_id`` at ``revision``, downloading only what it lacks.

    Args:
        source: where snapshots come from.
        repo_id / revision: the model (revision None: ``main``).
        dest: the cache directory (created if needed).
    Raises:
        FetchError (or the source's error): the cache then has no marker.
    """
    revision = revision or DEFAULT_REVISION
    dest.mkdir(parents=True, exist_ok=True)
    with cache_lock(dest):
        marker = read_marker(dest)
        if COMMIT.match(revision) and _valid(dest, marker, repo_id, revision, None):
            return FetchResult(marker, downloaded=False)  # an immutable revision: no Hub call at all
        try:
            snap = source.snapshot(repo_id, revision)
        except Exception as exc:
            if _unreachable(exc) and marker is not None and marker.revision == revision and \
                    _valid(dest, marker, repo_id, None, None):
                logger.warning("the Hub is unreachable (%s); using the cached %s@%s = %s", exc, repo_id,
                               revision, marker.commit)
                return FetchResult(marker, downloaded=False)
            raise
        check_names(dest, snap.files)
        if _valid(dest, marker, repo_id, snap.commit, files_checksum(snap.files)):
            return FetchResult(marker, downloaded=False)
        remove_marker(dest)  # from here on the directory must not look complete
        stale = prune(dest, snap.files)
        if marker is not None:  # content that changed goes before its replacement arrives
            digests = {f.path: f.digest for f in marker.files}
            for f in snap.files:
                if digests.get(f.path, f.digest) != f.digest:
                    (dest / f.path).unlink(missing_ok=True)
                    stale.append(f.path)
        if stale:
            logger.info("removed %d file(s) of another revision: %s", len(stale), ", ".join(stale[:5]))
        _download(source, repo_id, snap, dest)
        complete = Marker(repo_id, revision, snap.commit, snap.files)
        write_marker(dest, complete)
        return FetchResult(complete, downloaded=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, prog="python -m kvpilot.operator.model_fetch",
                                     description="Download a Hugging Face model into a cache directory "
                                                 "(nothing when the cache already holds it).")
    parser.add_argument("--uri", required=True, help="hf://org/name[/path/file.gguf][@revision]")
    parser.add_argument("--dest", required=True, help="the cache directory")
    parser.add_argument("--tokenizer-only", action="store_true",
                        help="fetch the repository's tokenizer files only")
    args = parser.parse_args(argv)
    try:
        uri = parse_hf_uri(args.uri)
    except ValueError as exc:
        parser.error(str(exc))
    if uri.file and args.tokenizer_only:
        parser.error("--tokenizer-only takes a repository, not a file")
    repo_id, revision = uri.repo_id, uri.revision
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    try:
        result = fetch(HubSource(patterns=uri.patterns(args.tokenizer_only)), repo_id, revision,
                       Path(args.dest))
    except FetchError as exc:
        print(f"model fetch failed: {exc}", file=sys.stderr, flush=True)
        return 1
    m = result.marker
    verb = "downloaded" if result.downloaded else "cache hit, nothing downloaded:"
    print(f"{verb} {repo_id}@{m.revision} = {m.commit} ({len(m.files)} files, {m.num_bytes:,} bytes) "
          f"in {args.dest}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
