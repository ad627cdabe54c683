"""A minimal Hugging Face Hub on loopback, for the model-fetch tests.

Serves directories published as commits of a model repository through the part of the
Hub's HTTP API that ``huggingface_hub`` uses to download a snapshot:

- ``GET /api/models/{repo}/revision/{rev}[?blobs=true]``: the commit and its files (size,
  git blob id, LFS sha256), as ``HfApi.model_info`` reads them;
- ``GET /api/models/{repo}/tree/{rev}``: the file listing ``snapshot_download`` reads;
- ``HEAD`` / ``GET /{repo}/resolve/{rev}/{path}``: metadata headers (``X-Repo-Commit``,
  ``ETag`` / ``X-Linked-Etag``, sizes) and the bytes, with ``Range`` for resumed downloads.

``*.safetensors`` files are served as LFS files (the Hub stores weights in LFS). Every
resolve ``GET`` adds the body bytes it sent to ``file_bytes``, so a test measures what a
client downloaded at the server. Faults per file path: ``truncate`` (the next transfer
sends that many bytes, then closes the connection) and ``stall`` (every transfer sends that
many bytes, then hangs until ``released``).
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

CHUNK = 64 * 1024


@dataclass
class HubFile:
    data: bytes
    lfs: bool

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.data).hexdigest()

    @property
    def pointer(self) -> bytes:
        return f"version https://git-lfs.github.com/spec/v1\noid sha256:{self.sha256}\nsize {len(self.data)}\n".encode()

    @property
    def blob_id(self) -> str:
        """The git blob id: of the LFS pointer for LFS files, of the content otherwise."""
        stored = self.pointer if self.lfs else self.data
        return hashlib.sha1(b"blob %d\0" % len(stored) + stored).hexdigest()

    @property
    def etag(self) -> str:
        return self.sha256 if self.lfs else self.blob_id


@dataclass
class FakeHub:
    """The Hub's state and counters (served by ``serve``)."""

    refs: dict[tuple[str, str], str] = field(default_factory=dict)          # (repo, ref) -> commit
    commits: dict[tuple[str, str], dict[str, HubFile]] = field(default_factory=dict)
    file_bytes: int = 0                    # body bytes sent by resolve GETs
    requests: list[tuple[str, str]] = field(default_factory=list)          # (method, path)
    truncate: dict[str, int] = field(default_factory=dict)
    stall: dict[str, int] = field(default_factory=dict)
    released: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def publish(self, repo_id: str, directory: Path, ref: str = "main") -> str:
        """Publish ``directory``'s files as a new commit of ``repo_id`` at ``ref``; its hash."""
        files = {p.relative_to(directory).as_posix(): HubFile(p.read_bytes(), p.suffix == ".safetensors")
                 for p in sorted(directory.rglob("*")) if p.is_file()}
        commit = hashlib.sha1(json.dumps({k: f.etag for k, f in files.items()}, sort_keys=True).encode()
                              + repo_id.encode()).hexdigest()
        self.commits[(repo_id, commit)] = files
        self.refs[(repo_id, ref)] = commit
        return commit

    def resolve(self, repo_id: str, rev: str) -> str | None:
        if (repo_id, rev) in self.commits:
            return rev
        return self.refs.get((repo_id, rev))

    def reset(self) -> None:
        with self.lock:
            self.file_bytes, self.requests[:] = 0, []

    def resolve_gets(self) -> list[str]:
        return [p for m, p in self.requests if m == "GET" and "/resolve/" in p]


API = re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+)/(?P<what>revision|tree)/(?P<rev>[^/]+)(?P<rest>/.*)?$")
RESOLVE = re.compile(r"^/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<path>.+)$")


def _handler(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:  # quiet
            pass

        def _json(self, status: int, data, headers: dict | None = None) -> None:
            body = json.dumps(data).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def _not_found(self, code: str, message: str) -> None:
            self._json(404, {"error": message}, {"X-Error-Code": code, "X-Error-Message": message})

        def do_HEAD(self) -> None:
            self._route()

        def do_GET(self) -> None:
            self._route()

        def _route(self) -> None:
            path = unquote(urlsplit(self.path).path)
            with hub.lock:
                hub.requests.append((self.command, path))
            if m := API.match(path):
                return self._api(m["repo"], m["what"], m["rev"])
            if m := RESOLVE.match(path):
                return self._resolve(m["repo"], m["rev"], m["path"])
            self._not_found("EntryNotFound", f"no route {path}")

        def _api(self, repo_id: str, what: str, rev: str) -> None:
            if not any(r == repo_id for r, _ in hub.refs):
                return self._not_found("RepoNotFound", f"Repository {repo_id} not found")
            commit = hub.resolve(repo_id, rev)
            if commit is None:
                return self._not_found("RevisionNotFound", f"Invalid rev id: {rev}")
            files = hub.commits[(repo_id, commit)]
            if what == "revision":
                siblings = [{"rfilename": name, "size": len(f.data), "blobId": f.blob_id,
                             **({"lfs": {"sha256": f.sha256, "size": len(f.data), "pointerSize": len(f.pointer)}}
                                if f.lfs else {})} for name, f in files.items()]
                return self._json(200, {"id": repo_id, "modelId": repo_id, "sha": commit, "private": False,
                                        "siblings": siblings})
            entries = [{"type": "file", "path": name, "size": len(f.data), "oid": f.blob_id,
                        **({"lfs": {"oid": f.sha256, "size": len(f.data), "pointerSize": len(f.pointer)}}
                           if f.lfs else {})} for name, f in files.items()]
            self._json(200, entries)

        def _resolve(self, repo_id: str, rev: str, name: str) -> None:
            commit = hub.resolve(repo_id, rev)
            f = hub.commits.get((repo_id, commit or ""), {}).get(name)
            if f is None:
                return self._not_found("EntryNotFound", f"{name} not found at {rev}")
            start = 0
            if rng := re.match(r"bytes=(\d+)-$", self.headers.get("Range", "")):
                start = min(int(rng[1]), len(f.data))
            self.send_response(206 if start else 200)
            self.send_header("X-Repo-Commit", commit)
            self.send_header("ETag", f'"{f.etag}"')
            if f.lfs:
                self.send_header("X-Linked-Etag", f'"{f.sha256}"')
                self.send_header("X-Linked-Size", str(len(f.data)))
            self.send_header("Accept-Ranges", "bytes")
            self.send_header("Content-Length", str(len(f.data) - start))
            if start:
                self.send_header("Content-Range", f"bytes {start}-{len(f.data) - 1}/{len(f.data)}")
            self.end_headers()
            if self.command == "HEAD":
                return
            body = f.data[start:]
            with hub.lock:
                cut = hub.truncate.pop(name, hub.stall.get(name))
            limit = len(body) if cut is None else max(0, min(len(body), cut - start))
            for i in range(0, limit, CHUNK):
                chunk = body[i:min(i + CHUNK, limit)]
                self.wfile.write(chunk)
                with hub.lock:
                    hub.file_bytes += len(chunk)
            self.wfile.flush()
            if name in hub.stall and limit < len(body):
                hub.released.wait(60)  # a hung transfer: the client is killed meanwhile
            if limit < len(body):
                self.close_connection = True  # the rest never comes: a truncated body

    return Handler


class HubServer:
    """``FakeHub`` served on 127.0.0.1 from a background thread (a context manager)."""

    def __init__(self, hub: FakeHub | None = None) -> None:
        self.hub = hub or FakeHub()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self.hub))
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, name="fake-hub", daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> HubServer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.hub.released.set()
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)
