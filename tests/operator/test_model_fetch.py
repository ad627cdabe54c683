"""The model-download init container against a fake Hugging Face Hub on loopback.

Oracles: the real ``huggingface_hub`` client talking HTTP to ``fake_hub`` (which counts the
bytes it sends), the source files' sha256, and the real ``python -m
kvpilot.operator.model_fetch`` process killed mid-transfer as a pod would be.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from kvpilot.operator.model_cache import MARKER, read_marker
from kvpilot.operator.model_fetch import FetchError, HfUri, HubSource, fetch, parse_hf_uri

from support.fake_hub import HubFile as FakeHubFile
from support.fake_hub import HubServer
from support.harness import free_port, wait_for

REPO = "kvpilot-test/tiny-model"
WEIGHTS = "model.safetensors"


def _checkpoint(directory: Path, seed: int = 0, mib: float = 4.0) -> Path:
    """A small checkpoint: safetensors weights, configs, and files the fetcher must skip."""
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    n = int(mib * (1 << 20)) // 4
    save_file({"embed.weight": rng.standard_normal(n, dtype=np.float32)}, str(directory / WEIGHTS))
    (directory / "config.json").write_text(json.dumps({"model_type": "qwen3", "seed": seed}))
    (directory / "tokenizer.json").write_text(json.dumps({"vocab": [f"t{i}" for i in range(2000)]}))
    (directory / "pytorch_model.bin").write_bytes(b"\0" * 1000)   # a duplicate format: not fetched
    (directory / "README.md").write_text("# tiny\n")                 # not needed by the engine
    return directory


def _wanted(source: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in source.iterdir()
            if p.suffix in (".safetensors", ".json")}


def _contents(dest: Path) -> dict[str, str]:
    return {p.relative_to(dest).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in dest.rglob("*") if p.is_file() and not p.relative_to(dest).parts[0].startswith(".")}


def _size(source: Path, names) -> int:
    return sum((source / n).stat().st_size for n in names)


@pytest.fixture
def hub(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))  # no token or cache of the user's
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    monkeypatch.delenv("HF_TOKEN", raising=False)
    with HubServer() as server:
        yield server


def _fetch_process(hub: HubServer, dest: Path, tmp_path: Path, revision: str = "") -> subprocess.Popen:
    """``python -m kvpilot.operator.model_fetch`` as the init container runs it."""
    env = {**os.environ, "HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "hf-home"), "PYTHONSAFEPATH": "1",
           "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
    uri = f"hf://{REPO}" + (f"@{revision}" if revision else "")
    return subprocess.Popen([sys.executable, "-m", "kvpilot.operator.model_fetch", "--uri", uri,
                             "--dest", str(dest)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def test_first_start_downloads_and_the_second_downloads_nothing(hub, tmp_path):
    source = _checkpoint(tmp_path / "src")
    commit = hub.hub.publish(REPO, source)
    dest = tmp_path / "cache" / "model"
    first = fetch(HubSource(hub.url), REPO, None, dest)
    first_bytes = hub.hub.file_bytes
    assert first.downloaded and first.marker.commit == commit
    assert _contents(dest) == _wanted(source)  # byte-identical, and no *.bin / README
    assert first_bytes == _size(source, _wanted(source))
    hub.hub.reset()
    second = fetch(HubSource(hub.url), REPO, None, dest)
    assert not second.downloaded and second.marker == first.marker
    assert hub.hub.file_bytes == 0 and hub.hub.resolve_gets() == []
    assert hub.hub.requests == [("GET", f"/api/models/{REPO}/revision/main")]  # resolving "main" only
    hub.hub.reset()
    pinned = fetch(HubSource(hub.url), REPO, commit, dest)
    assert not pinned.downloaded and hub.hub.requests == []  # a commit is immutable: no call at all
    print(f"bytes fetched: first start {first_bytes:,}, second start {0:,}")


def test_a_new_revision_fetches_only_changed_files_and_drops_stale_ones(hub, tmp_path):
    source = _checkpoint(tmp_path / "src")
    hub.hub.publish(REPO, source)
    dest = tmp_path / "cache" / "model"
    fetch(HubSource(hub.url), REPO, None, dest)
    (source / "config.json").write_text(json.dumps({"model_type": "qwen3", "rope_theta": 1e6}))
    (source / "tokenizer.json").unlink()
    (source / "generation_config.json").write_text("{}")
    hub.hub.publish(REPO, source)
    hub.hub.reset()
    result = fetch(HubSource(hub.url), REPO, None, dest)
    assert result.downloaded
    assert _contents(dest) == _wanted(source)  # tokenizer.json of the old revision is gone
    assert hub.hub.file_bytes == _size(source, ["config.json", "generation_config.json"])  # weights kept


def test_a_truncated_file_in_the_cache_is_detected_and_fetched_again(hub, tmp_path):
    source = _checkpoint(tmp_path / "src")
    hub.hub.publish(REPO, source)
    dest = tmp_path / "cache" / "model"
    fetch(HubSource(hub.url), REPO, None, dest)
    size = (dest / WEIGHTS).stat().st_size
    with open(dest / WEIGHTS, "r+b") as f:  # e.g. a node that lost power mid-write
        f.truncate(size // 2)
    hub.hub.reset()
    result = fetch(HubSource(hub.url), REPO, None, dest)
    assert result.downloaded and _contents(dest) == _wanted(source)
    assert hub.hub.file_bytes == size and hub.hub.resolve_gets() == [f"/{REPO}/resolve/{result.marker.commit}/{WEIGHTS}"]


def test_a_truncated_transfer_is_detected_and_redone(hub, tmp_path):
    source = _checkpoint(tmp_path / "src")
    hub.hub.publish(REPO, source)
    size = (source / WEIGHTS).stat().st_size
    hub.hub.truncate[WEIGHTS] = size // 3  # the connection drops after a third of the weights
    dest = tmp_path / "cache" / "model"
    result = fetch(HubSource(hub.url), REPO, None, dest)
    assert result.downloaded and _contents(dest) == _wanted(source)
    transfers = [p for p in hub.hub.resolve_gets() if p.endswith(WEIGHTS)]
    assert len(transfers) == 2  # the cut transfer and its resumption
    print(f"truncated transfer: {hub.hub.file_bytes:,} bytes in total for {_size(source, _wanted(source)):,}")


def test_a_killed_download_never_leaves_a_cache_that_looks_complete(hub, tmp_path):
    old = _checkpoint(tmp_path / "v1", seed=1)
    hub.hub.publish(REPO, old)
    dest = tmp_path / "cache" / "model"
    fetch(HubSource(hub.url), REPO, None, dest)
    assert read_marker(dest) is not None
    new = _checkpoint(tmp_path / "v2", seed=2)
    commit = hub.hub.publish(REPO, new)
    size = (new / WEIGHTS).stat().st_size
    hub.hub.stall[WEIGHTS] = size // 2
    hub.hub.reset()
    proc = _fetch_process(hub, dest, tmp_path)
    try:
        wait_for(lambda: hub.hub.file_bytes >= size // 2, 30, 0.05, "half of the new weights sent")
    finally:
        proc.send_signal(signal.SIGKILL)  # the pod is deleted mid-download
        proc.wait(10)
    assert not (dest / MARKER).exists() and read_marker(dest) is None
    del hub.hub.stall[WEIGHTS]
    hub.hub.reset()
    done = _fetch_process(hub, dest, tmp_path)
    out, _ = done.communicate(timeout=60)
    assert done.returncode == 0, out
    assert f"downloaded {REPO}@main = {commit}" in out
    assert _contents(dest) == _wanted(new) and read_marker(dest).commit == commit
    print(f"after the kill: {hub.hub.file_bytes:,} bytes fetched to complete {_size(new, _wanted(new)):,}")


def test_replicas_sharing_a_cache_download_it_once(hub, tmp_path):
    source = _checkpoint(tmp_path / "src")
    hub.hub.publish(REPO, source)
    dest = tmp_path / "shared" / "model"
    procs = [_fetch_process(hub, dest, tmp_path) for _ in range(2)]
    outs = [p.communicate(timeout=60)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    last = sorted(o.strip().splitlines()[-1].split()[0] for o in outs)
    assert last == ["cache", "downloaded"], outs  # one waited for the other, then found it complete
    assert hub.hub.file_bytes == _size(source, _wanted(source))


def test_an_unreachable_hub_falls_back_to_the_cached_revision(hub, tmp_path):
    source = _checkpoint(tmp_path / "src")
    hub.hub.publish(REPO, source)
    dest = tmp_path / "cache" / "model"
    fetch(HubSource(hub.url), REPO, None, dest)
    down = HubSource(f"http://127.0.0.1:{free_port()}")  # nothing listens there
    assert not fetch(down, REPO, None, dest).downloaded
    with pytest.raises(Exception):  # noqa: B017 - the client's connection error
        fetch(down, REPO, None, tmp_path / "empty" / "model")
    with pytest.raises(Exception, match="Invalid rev id"):  # noqa: B017 - not found is not "unreachable"
        fetch(HubSource(hub.url), REPO, "no-such-branch", dest)


def test_a_tampered_marker_does_not_count(hub, tmp_path):
    source = _checkpoint(tmp_path / "src")
    hub.hub.publish(REPO, source)
    dest = tmp_path / "cache" / "model"
    fetch(HubSource(hub.url), REPO, None, dest)
    data = json.loads((dest / MARKER).read_text())
    data["files"][0]["size"] += 1
    (dest / MARKER).write_text(json.dumps(data))
    assert read_marker(dest) is None  # the file-list checksum no longer matches
    hub.hub.reset()
    assert fetch(HubSource(hub.url), REPO, None, dest).downloaded
    assert hub.hub.file_bytes == 0  # the files themselves were intact: huggingface_hub kept them
    assert read_marker(dest) is not None


@pytest.mark.parametrize("name", ["../victim.json", "ABSOLUTE", "sub/../../victim.json", ".kvpilot-model.json",
                                  "link/victim.json"])
def test_a_file_name_that_leaves_the_cache_is_refused_and_nothing_is_touched(hub, tmp_path, name):
    """A malicious mirror lists names outside the cache directory: before the fix the stale-file
    clean-up deleted them (``dest / "../victim.json"``, ``dest / "/etc/x"`` is ``/etc/x``)."""
    source = _checkpoint(tmp_path / "src")
    commit = hub.hub.publish(REPO, source)
    dest = tmp_path / "cache" / "model"
    victim = tmp_path / "cache" / "victim.json"
    victim.parent.mkdir(parents=True)
    victim.write_text('{"precious": true}')
    if name == "ABSOLUTE":
        name = str(victim)
    if name.startswith("link/"):  # a folder in the cache that is a symlink to outside it
        dest.mkdir(parents=True)
        (dest / "link").symlink_to(victim.parent, target_is_directory=True)
    hub.hub.commits[(REPO, commit)][name] = FakeHubFile(b'{"evil": 1}', lfs=False)
    with pytest.raises(FetchError, match="leaves the cache directory"):
        fetch(HubSource(hub.url), REPO, None, dest)
    assert victim.read_text() == '{"precious": true}'
    assert hub.hub.file_bytes == 0  # refused before any download
    assert not (dest / MARKER).exists()


def test_repository_code_is_never_fetched(hub, tmp_path):
    source = _checkpoint(tmp_path / "src")
    (source / "modeling_evil.py").write_text("import os\nos.system('id')\n")
    hub.hub.publish(REPO, source)
    dest = tmp_path / "cache" / "model"
    result = fetch(HubSource(hub.url), REPO, None, dest)
    assert "modeling_evil.py" not in {f.path for f in result.marker.files}
    assert not (dest / "modeling_evil.py").exists() and _contents(dest) == _wanted(source)


def test_uri_parsing_and_errors():
    assert parse_hf_uri("hf://Qwen/Qwen3-0.6B") == HfUri("Qwen/Qwen3-0.6B", None)
    assert parse_hf_uri("hf://org/name@v1.2") == HfUri("org/name", "v1.2")
    assert parse_hf_uri("hf://org/name/q/m-Q4_0.gguf@v1.2") == HfUri("org/name", "v1.2", "q/m-Q4_0.gguf")
    for bad in ("s3://bucket/x", "hf://org/name/config.json", "hf://org/name/../m.gguf"):
        with pytest.raises(ValueError, match="not an hf://"):
            parse_hf_uri(bad)
    assert issubclass(FetchError, RuntimeError)
