"""``kvpilot bench overhead``: the engine's per-step host overhead on a near-zero model.

A micro Qwen3 model (2 layers, hidden 64, vocabulary 1,024, float32, built on the fly
in a temporary directory with the demo model's tokenizer) makes the model's forward
almost free, so what a step costs is the engine's own work around it: scheduling,
building the batch's inputs, sampling, detokenizing, stop checks and outputs. For each
batch size the engine runs that many requests at once (``--prompt-len`` prompt tokens,
``--output-len`` output tokens each, ``ignore_eos``) the way ``LLM.generate`` does, on
one torch thread by default, and prints the mean milliseconds per decode step (every
running request computing one token), the part of it inside the model's forward
(including the logits) and the share of the step spent outside it.

On a GPU an 8B model's decode step takes tens of milliseconds; the host work measured
here has to stay a small fraction of that.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

MICRO_CONFIG = {
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 1024,
    "max_window_layers": 2,
}


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("overhead", help="engine host overhead per step on a near-zero model",
                              description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch-sizes", default="16,64,256", help="comma-separated (default: %(default)s)")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--threads", type=int, default=1, help="torch threads (default: %(default)s)")
    p.add_argument("--output-kind", choices=("final", "delta", "cumulative"), default="final",
                   help="outputs the engine builds: final (as LLM.generate, default), delta "
                        "(as the server streams), cumulative (every step, everything)")
    p.add_argument("--attention-backends", default="auto",
                   help="comma-separated --attention-backend values, each measured at every batch "
                        "size, alternating (e.g. cpu,torch: the C++ decode kernel against the "
                        "pure-torch path side by side; default: %(default)s)")
    p.add_argument("--kv-events", choices=("off", "on", "off,on"), default="off",
                   help="publish KV-cache events (a ZeroMQ socket on loopback nobody reads); "
                        "off,on measures both side by side, alternating (default: %(default)s)")
    p.add_argument("--explain-prefix-misses", choices=("off", "on", "off,on"), default="on",
                   help="classify each request's prefix-cache miss at admission (the engine's "
                        "default: on); off,on measures both side by side, alternating")
    p.add_argument("--repeats", type=int, default=1,
                   help="runs per batch size; the fastest is reported (noisy machines)")
    p.add_argument("--json-out", default=None, help="also write the results to this JSON file")
    p.set_defaults(func=run)


@dataclass(slots=True)
class OverheadResult:
    batch_size: int
    attention_backend: str      # the engine's, as selected (auto resolved)
    decode_steps: int
    ms_per_step: float          # mean wall time of a decode step
    forward_ms_per_step: float  # of which inside the model's forward + logits
    outside_share: float | None  # 1 - forward / step (CPU only)
    output_tokens_per_s: float  # whole run, prefill included
    kv_events: bool = False     # publishing KV-cache events (--kv-events-config)
    explain_misses: bool = True  # prefix-miss reasons (--explain-prefix-misses)


def write_micro_model(directory: Path) -> Path:
    """Write the micro model's checkpoint (demo tokenizer, tiny random weights) into ``directory``."""
    import shutil

    from safetensors.torch import save_file

    from kvpilot.engine.model.models import demo

    source = demo.ensure_demo_model()
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(source / name, directory / name)
    config = {**demo.demo_config(), **MICRO_CONFIG}
    weights = demo.demo_weights(config=config)
    save_file({k: v.float() for k, v in weights.items()}, str(directory / "model.safetensors"),
              metadata={"format": "pt"})
    config.update(torch_dtype="float32", dtype="float32")
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return directory


class _StepProbe:
    """Spots full decode steps (from the scheduler's output) and times the model's eager
    forward and logits (a CUDA-graph replay is not a forward call: not timed)."""

    def __init__(self, engine) -> None:
        self.forward_s = 0.0
        self.decode_seqs = 0            # sequences of the last step if it was all decode, else 0
        scheduler, model = engine.scheduler, engine.runner.model
        self._schedule, self._forward, self._logits = scheduler.schedule, model.forward, model.compute_logits
        scheduler.schedule, model.forward, model.compute_logits = self.schedule, self.forward, self.logits

    def schedule(self):
        out = self._schedule()
        n = len(out.scheduled)
        self.decode_seqs = n if n and out.num_scheduled_tokens == n else 0
        return out

    def _timed(self, fn, *args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            self.forward_s += time.perf_counter() - start

    def forward(self, *args, **kwargs):
        return self._timed(self._forward, *args, **kwargs)

    def logits(self, hidden, metadata=None):
        return self._timed(self._logits, hidden, metadata)


def measure(model_dir: str, batch_size: int, prompt_len: int = 64, output_len: int = 128,
            output_kind: str = "final", device: str = "auto", enforce_eager: bool = False,
            dtype: str = "float32", num_gpu_blocks: int | None = None,
            attention_backend: str = "auto", kv_events: bool = False,
            explain_misses: bool = True) -> OverheadResult:
    """One engine, ``batch_size`` requests at once; mean decode step and forward times.

    The forward share is measured on CPU only (on CUDA kernels run asynchronously and
    decode steps may replay CUDA graphs): ``forward_ms_per_step`` is 0 there.
    """
    from kvpilot.engine import LLMEngine, SamplingParams
    from kvpilot.engine.engine_args import EngineArgs
    from kvpilot.engine.kv_events import KVEventsConfig
    from kvpilot.engine.sampling_params import RequestOutputKind

    max_len = prompt_len + output_len
    blocks = num_gpu_blocks or batch_size * -(-max_len // 16) + 16
    # Events to a loopback port nobody reads: the publishing is what is measured.
    events = (KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://127.0.0.1:*")
              if kv_events else None)
    engine = LLMEngine(EngineArgs(model=model_dir, max_model_len=max_len + 16, max_num_seqs=batch_size,
                                  num_gpu_blocks=blocks, enable_prefix_caching=True, dtype=dtype,
                                  device=device, enforce_eager=enforce_eager,
                                  attention_backend=attention_backend, kv_events_config=events,
                                  explain_prefix_misses=explain_misses))
    on_cpu = engine.runner.device.type == "cpu"
    kind = {"final": RequestOutputKind.FINAL_ONLY, "delta": RequestOutputKind.DELTA,
            "cumulative": RequestOutputKind.CUMULATIVE}[output_kind]
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True, output_kind=kind)
    warm = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    for i in range(min(batch_size, 8)):   # warm-up, not measured
        engine.add_request(f"warm-{i}", [100 + i] * prompt_len, warm)
    while engine.has_unfinished_requests():
        engine.step()
    probe = _StepProbe(engine)
    for i in range(batch_size):
        prompt = [(7 * i + 13 * j) % 1000 + 10 for j in range(prompt_len)]
        engine.add_request(f"r{i}", prompt, params)
    step_ms, forward_ms = [], []
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        before, t0 = probe.forward_s, time.perf_counter()
        engine.step()
        elapsed = time.perf_counter() - t0
        if probe.decode_seqs == batch_size:
            step_ms.append(elapsed * 1000)
            forward_ms.append((probe.forward_s - before) * 1000 if on_cpu else 0.0)
    total = time.perf_counter() - start
    engine.close()
    step, fwd = statistics.fmean(step_ms), statistics.fmean(forward_ms)
    return OverheadResult(batch_size, engine.runner.backend.name, len(step_ms), step, fwd,
                          1 - fwd / step if on_cpu else None, batch_size * output_len / total,
                          kv_events, explain_misses)


def format_row(r: OverheadResult) -> str:
    """One line of the table (the outside share is "-" where it is not measured: CUDA)."""
    outside = "-" if r.outside_share is None else f"{r.outside_share:.0%}"
    events = "  KV events on" if r.kv_events else ""
    explain = "" if r.explain_misses else "  miss reasons off"
    return (f"{r.batch_size:>6}{r.attention_backend:>11}{r.ms_per_step:>10.2f}"
            f"{r.forward_ms_per_step:>12.2f}{outside:>9}{r.output_tokens_per_s:>10.0f}{events}{explain}")


def run(args: argparse.Namespace) -> int:
    import torch

    torch.set_num_threads(args.threads)
    sizes = [int(x) for x in args.batch_sizes.split(",")]
    results = []
    with tempfile.TemporaryDirectory(prefix="kvpilot-micro-") as tmp:
        model_dir = str(write_micro_model(Path(tmp)))
        print(f"micro model: Qwen3, {MICRO_CONFIG['num_hidden_layers']} layers, hidden "
              f"{MICRO_CONFIG['hidden_size']}, vocab {MICRO_CONFIG['vocab_size']}, float32; "
              f"{args.prompt_len} prompt + {args.output_len} output tokens per request; "
              f"{args.output_kind} outputs; threads={torch.get_num_threads()}")
        variants = [(b, e == "on", x == "on") for b in args.attention_backends.split(",")
                    for e in args.kv_events.split(",") for x in args.explain_prefix_misses.split(",")]
        print(f"{'batch':>6}{'attention':>11}{'ms/step':>10}{'forward ms':>12}{'outside':>9}{'tok/s':>10}")
        for size in sizes:
            runs: dict[tuple[str, bool, bool], list[OverheadResult]] = {v: [] for v in variants}
            for _ in range(args.repeats):   # variants alternate: a noisy moment hits each alike
                for backend, events, explain in variants:
                    runs[backend, events, explain].append(measure(
                        model_dir, size, args.prompt_len, args.output_len, args.output_kind,
                        attention_backend=backend, kv_events=events, explain_misses=explain))
            for variant in variants:
                best = min(runs[variant], key=lambda r: r.ms_per_step)
                results.append(best)
                print(format_row(best), flush=True)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps([asdict(r) for r in results], indent=2))
    return 0
