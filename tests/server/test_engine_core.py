"""The engine core in its own process (the default of ``kvpilot serve``).

The rest of ``tests/server`` runs against the session's server, whose engine core is
such a process; here: what crosses the channel equals what the engine produced (frames
whole and in order, however large), a killed core fails requests and /health at once, and the core never outlives the
server, whether it stops cleanly or is killed.
"""

from __future__ import annotations

import os
import random
import re
import signal
import socket
import threading
import time

import httpx
import pytest
import zmq

from kvpilot.engine import SamplingParams
from kvpilot.engine.bench.server_process import launch_server
from kvpilot.engine.runtime.messages import Dead, StepReport
from kvpilot.engine.runtime.zmq_channel import (
    FRAME_HEADER,
    RECEIVE_CHUNK_BYTES,
    CoreEnd,
    CoreSpec,
    FrameReader,
    decode_message,
    encode_message,
)

DETECTION_LIMIT_S = 5.0
SMALL = ["--model", "demo", "--device", "cpu", "--kv-cache-memory-bytes", "8Mi", "--max-model-len", "1024",
         "--max-num-seqs", "4", "--served-model-name", "core", "--uvicorn-log-level", "warning"]


def _core_pid(server) -> int:
    match = re.search(r"engine core process started \(pid (\d+)\)", server.log_path.read_text())
    assert match, server.log_tail()
    return int(match.group(1))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (exited, not yet reaped by its parent) counts as gone
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while _alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_step_outputs_cross_the_channel_unchanged(offline_llm):
    engine = offline_llm.llm_engine
    params = SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=5, logprobs=2, stop=["zz"],
                            ignore_eos=True)
    engine.add_request("wire", [11, 12, 13, 14], params)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert outputs and outputs[-1].finished
    stats = engine.get_stats()
    report = decode_message(encode_message(StepReport(outputs, stats, None, 0)))
    assert report.stats == stats and report.stats.generation_tokens >= 10   # cumulative: a shared engine
    decoded = report.outputs
    for out in decoded:   # the prompt stays on the API side; its client attaches the ids
        assert out.prompt_token_ids is None
        out.prompt_token_ids = [11, 12, 13, 14]
    assert decoded == outputs



def test_frames_come_back_whole_however_the_stream_is_cut():
    rng = random.Random(3)
    frames = [b"", b"x", bytes(range(256)) * 40, rng.randbytes(3 << 20), b"tail"]
    stream = b"".join(FRAME_HEADER.pack(len(f)) + f for f in frames)
    for cut_sizes in ([1], [7, 13], [RECEIVE_CHUNK_BYTES], [len(stream)]):
        reader, got, at = FrameReader(), [], 0
        while at < len(stream):
            size = rng.choice(cut_sizes)
            got += reader.feed(stream[at:at + size])
            at += size
        assert got == frames
        assert reader.feed(b"") == []   # nothing held back


def test_core_messages_larger_than_the_socket_buffers_arrive_in_order(tmp_path):
    """The core's end writes from two threads (the loop's ``send`` and ``send_dead``) into
    one socket; the frames neither interleave nor tear, the large ones included."""
    context = zmq.Context()
    api_end, core_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    read_fd, write_fd = os.pipe()
    try:
        channel = CoreEnd(context, CoreSpec(None, f"ipc://{tmp_path}/commands", core_end.detach(), 0), read_fd)
        big = [Dead("m" * (5 << 20)), Dead("n" * (3 << 20))]
        small = [Dead(f"dead {i}") for i in range(200)]
        writers = [threading.Thread(target=lambda: [channel.send(m) for m in big]),
                   threading.Thread(target=lambda: [channel.send_dead(m) for m in small])]
        for w in writers:
            w.start()
        reader, got = FrameReader(), []
        while len(got) < len(big) + len(small):
            data = api_end.recv(RECEIVE_CHUNK_BYTES)
            assert data, "the core's end closed early"
            got += [decode_message(f) for f in reader.feed(data)]
        for w in writers:
            w.join()
        assert [m for m in got if len(m.message) > 1000] == big
        assert [m for m in got if len(m.message) <= 1000] == small
        channel.close()
    finally:
        api_end.close()
        os.close(read_fd)
        os.close(write_fd)
        context.destroy(linger=0)


@pytest.mark.slow
def test_a_killed_core_fails_requests_and_health_at_once(tmp_path, kill_mid_generation):
    with launch_server(SMALL, log_path=tmp_path / "serve.log", timeout=300) as server, \
            httpx.Client(base_url=server.base_url, timeout=60) as http:
        pid = _core_pid(server)
        death = kill_mid_generation(http, "core", lambda: os.kill(pid, signal.SIGKILL), DETECTION_LIMIT_S)
        # in-flight requests: a generic 500 with their request id; why, in the log and /health
        assert "the engine failed while serving this request (request id" in death.stream_error
        assert death.health.status_code == 503 and "SIGKILL" in death.health.json()["error"]["message"]
        assert death.plain.status_code == 500
        assert "(request id" in death.plain.json()["error"]["message"]
        assert "SIGKILL" not in death.plain.text
        assert f"the engine core process (pid {pid}) was killed by SIGKILL" in server.log_tail(200)
        assert death.refused.status_code == 503 and "SIGKILL" in death.refused.json()["error"]["message"]
        assert death.stream_failed_s < DETECTION_LIMIT_S and death.health_failed_s < DETECTION_LIMIT_S


@pytest.mark.slow
@pytest.mark.parametrize("stop", ["SIGTERM", "SIGKILL"])
def test_the_core_never_outlives_the_server(tmp_path, stop):
    server = launch_server(SMALL, log_path=tmp_path / "serve.log", timeout=300)
    try:
        pid = _core_pid(server)
        assert _alive(pid)
        server.process.send_signal(getattr(signal, stop))
        server.process.wait(30)
        assert _wait_gone(pid, 15), f"the core (pid {pid}) outlived the server:\n{server.log_tail()}"
    finally:
        server.stop()


@pytest.mark.slow
def test_the_core_never_outlives_a_server_killed_while_it_starts(tmp_path, monkeypatch):
    """A core still building its engine (here: waiting on the CPU kernels' build locks, which
    this test holds) reads no lifeline yet; killing its server with SIGKILL must end it too
    (the parent-death signal it arms first)."""
    import subprocess
    import sys

    from support.kernel_locks import holding_every_kernel_build

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "kernels"))
    monkeypatch.delenv("KVPILOT_PREBUILT_KERNELS", raising=False)
    log = tmp_path / "serve.log"
    with holding_every_kernel_build():
        with log.open("wb") as out:
            server = subprocess.Popen([sys.executable, "-m", "kvpilot.engine.cli.main", "serve", *SMALL,
                                       "--port", "0"], stdout=out, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 180
            while f"is being built by pid {os.getpid()} on " not in log.read_text(errors="replace"):
                assert server.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
                time.sleep(0.2)
            core = _core_pid(type("Launched", (), {"log_path": log, "log_tail": lambda self: ""})())
            assert _alive(core)
            server.kill()
            server.wait(30)
            assert _wait_gone(core, 10), f"the starting core (pid {core}) outlived its killed server"
        finally:
            if server.poll() is None:
                server.kill()
                server.wait(30)
