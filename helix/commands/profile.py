"""`helix profile`: decode steps of one sweep point under the torch profiler.

    helix profile --model deepseek-v2-lite --batch 1 --context 32768 --steps 5 \\
        --attention-backend triton --out trace.json
    helix profile --sweep configs/sweeps/deepseek-v3-2gpu.yaml --point 3 --out trace.json

The point is set up as `helix sweep` sets one up (the same engine sizing; synthetic prefix:
`context` positions taken as written, no prefill), runs warm-up steps, times --steps steps
unprofiled, then profiles --steps steps on rank 0 and writes a Chrome trace (--out; opens in
Perfetto, ui.perfetto.dev, or chrome://tracing) and prints

  (a) per kernel: microseconds and calls per step, share of the step's device time;
  (b) per phase: the same summed by the innermost `helix.<phase>` range (record_function /
      torch profiler ranges; [indices] dropped, so the layers of a phase add up) around each
      kernel's launch.

Phases under CUDA graphs: ranges inside the captured step are recorded once, at capture; at
replay every kernel belongs to the cudaGraphLaunch. So with graphs on, `--phases auto` runs
--steps more steps EAGERLY on the same engine (the engine's graphs set aside), attributes their
kernels to ranges, and maps the phases onto the graph step's kernels by aligning the two kernel
name sequences (a replay runs the kernels the eager step launched, in order); kernels of the
graph that align with none are "(unattributed)". `--phases eager` profiles eager steps only
(the kernel table then shows eager timings), `--phases none` skips the table. With more than
one rank and graphs on, use --no-cuda-graphs for phases (rank 0 cannot leave its graphs while
the others replay theirs).

Under Nsight Systems the NVTX ranges show instead (helix/tracing.py; HELIX_PHASES=1 turns the
per-layer phase ranges on outside `helix profile`):
    nsys profile -t cuda,nvtx --cuda-graph-trace=node -o step \\
        helix profile --model deepseek-v2-lite --batch 1 --context 32768 --phases none
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import tempfile

import torch

from helix import tracing

from helix.commands import trace_tables as tt
from helix.errors import ConfigError

STEP_RANGE = "helix.step"


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("profile", help="profile decode steps of one sweep point "
                                              "(torch profiler: Chrome trace + kernel tables)")
    g = p.add_argument_group("point (as a sweep point; or --sweep FILE --point I)")
    g.add_argument("--model", default=None, help="preset name, preset YAML or checkpoint dir")
    g.add_argument("--sweep", default=None, help="sweep YAML: profile one of its points")
    g.add_argument("--point", type=int, default=0,
                   help="index into the sweep's points (model, layout, batch, context order)")
    g.add_argument("--layers", type=int, default=0, help="first n layers (0: all)")
    g.add_argument("--kvp", type=int, default=1)
    g.add_argument("--tpa", type=int, default=1)
    g.add_argument("--tpf", type=int, default=None)
    g.add_argument("--ep", type=int, default=1)
    g.add_argument("--kv-interleave", type=int, default=1)
    g.add_argument("--batch", type=int, default=1, help="requests decoding together")
    g.add_argument("--context", type=int, default=1024, help="KV positions per request")
    g.add_argument("--device", choices=["cpu", "cuda"], default=None)
    g.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None)
    g.add_argument("--attention-backend", choices=["torch", "triton", "flash-attn"],
                   default=None, help="default: triton on cuda, torch on cpu")
    g.add_argument("--page-size", type=int, default=64)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false")
    g = p.add_argument_group("profile")
    g.add_argument("--steps", type=int, default=5, help="profiled decode steps")
    g.add_argument("--warmup", type=int, default=3, help="decode steps before timing")
    g.add_argument("--out", default="helix-trace.json", help="Chrome trace (Perfetto)")
    g.add_argument("--json", default=None, help="write the tables here as JSON")
    g.add_argument("--phases", choices=["auto", "eager", "none"], default="auto")
    g.add_argument("--top", type=int, default=30, help="rows of the kernel table")
    p.set_defaults(func=run)


def _point(args):
    """-> (single-point Sweep, model, layout, batch, context)."""
    from helix.config import Layout, RuntimeConfig
    from helix.sweep import Sweep, load_sweep, points
    if args.steps < 1 or args.warmup < 0:
        raise ConfigError("--steps must be >= 1 and --warmup >= 0")
    extra = 3 * args.steps + 2              # timed, profiled and eager-phase steps (+ slack)
    if args.sweep:
        sweep = load_sweep(args.sweep)
        points = [(m, lay, b, c) for m in sweep.models for lay in sweep.layouts
                  for b, c in points(sweep)]
        if not 0 <= args.point < len(points):
            raise ConfigError(f"--point {args.point} is not among the {len(points)} points of "
                              f"{args.sweep}: give 0 .. {len(points) - 1}")
        model, layout, batch, context = points[args.point]
    else:
        if not args.model:
            raise ConfigError("give --model NAME (or --sweep FILE --point I)")
        device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        runtime = dict(device=device,
                       dtype=args.dtype or ("bfloat16" if device == "cuda" else "float32"),
                       layers=args.layers, cuda_graphs=args.cuda_graphs,
                       attention_backend=args.attention_backend or (
                           "triton" if device == "cuda" else "torch"),
                       page_size=args.page_size, seed=args.seed)
        RuntimeConfig(**runtime)
        if args.batch < 1 or args.context < 1:
            raise ConfigError("--batch and --context must be >= 1")
        layout = Layout(kvp=args.kvp, tpa=args.tpa, tpf=args.tpf, ep=args.ep,
                        kv_interleave=args.kv_interleave)
        sweep = Sweep(name="profile", models=(args.model,), layouts=(layout,),
                      batches=(args.batch,), contexts=(args.context,), runtime=runtime)
        model, batch, context = args.model, args.batch, args.context
    sweep = dataclasses.replace(sweep, models=(model,), layouts=(layout,), batches=(batch,),
                                contexts=(context,), max_batch_tokens=0,
                                warmup_steps=args.warmup, decode_steps=extra)
    return sweep, model, layout, batch, context


def _profiled(llm, steps: int, cuda: bool, trace: str | None):
    """Profile `steps` decode steps, each inside a STEP_RANGE range -> trace events."""
    from torch.profiler import ProfilerActivity, profile, record_function
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    if cuda:
        torch.cuda.synchronize()
    tracing.record_phases(True)                 # helix.<phase> ranges in the layers
    try:
        with profile(activities=acts) as prof:
            for _ in range(steps):
                with record_function(STEP_RANGE):
                    llm.step()
            if cuda:
                torch.cuda.synchronize()
    finally:
        tracing.record_phases(False)
    if trace is None:
        fd, path = tempfile.mkstemp(suffix=".json")
        os.close(fd)
    else:
        path = trace
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            data = json.load(f)
    finally:
        if trace is None:
            os.remove(path)
    return data["traceEvents"] if isinstance(data, dict) else data


def _ops_of_steps(events, steps):
    ops = tt.attribute(tt.device_ops(events), events, exclude=(STEP_RANGE,))
    per_step = tt.split_steps(ops, events, STEP_RANGE)
    return ops, per_step


def run(args) -> int:
    from helix.sweep import open_llm
    from helix.runtime.sampling import SamplingParams
    sweep, model, layout, batch, context = _point(args)
    cuda = sweep.runtime["device"] == "cuda"
    graphs_on = sweep.runtime["cuda_graphs"] and cuda
    phases = args.phases
    if phases == "auto" and graphs_on and layout.world_size > 1:
        phases = "none"
        print("phases: skipped (graphs on, several ranks): rerun with --no-cuda-graphs")
    steps = args.steps
    with open_llm(sweep, model, layout) as llm:
        g = torch.Generator().manual_seed(0)
        params = SamplingParams(max_new_tokens=args.warmup + sweep.decode_steps + 2,
                                ignore_eos=True)
        synthetic = sweep.prefill == "synthetic"
        for _ in range(batch):
            prompt = torch.randint(0, llm.cfg.vocab_size, (1 if synthetic else context,),
                                   generator=g)
            llm.add_request(prompt.tolist(), params,
                            synthetic_prefix=context - 1 if synthetic else 0)
        llm.step()                                              # prefill / first step
        for _ in range(args.warmup):
            llm.step()
        engine = llm.engine
        saved = engine.graphs
        if phases == "eager":
            engine.graphs = None                    # eager steps only (see the docstring)
        walls = [llm.step().seconds for _ in range(steps)]
        events = _profiled(llm, steps, cuda, args.out)
        ops, per_step = _ops_of_steps(events, steps)
        phase_src, matched = "eager" if phases == "eager" or not graphs_on else "graph", None
        if phases == "auto" and graphs_on and per_step:
            engine.graphs = None                    # eager steps for the phases, then back
            try:
                eager_events = _profiled(llm, steps, cuda, None)
            finally:
                engine.graphs = saved
            _, eager_steps = _ops_of_steps(eager_events, steps)
            src, total = eager_steps[-1], 0
            for step_ops in per_step:
                total += tt.transfer_phases(src, step_ops)
            matched = total / max(1, sum(len(s) for s in per_step))
            phase_src = "graph kernels, phases aligned from eager steps"
        engine.graphs = saved
    kernels = tt.kernel_table(ops, steps)
    critical = tt.critical_table(per_step)
    phase_rows = tt.phase_table(ops, steps) if phases != "none" else []
    device_us = sum(op.dur for op in ops) / steps
    summary = {
        "model": model, "layout": layout.as_dict(), "batch": batch, "context": context,
        "device": sweep.runtime["device"], "dtype": sweep.runtime["dtype"],
        "cuda_graphs": graphs_on and phases != "eager", "steps": steps,
        "step_ms_median": 1e3 * statistics.median(walls), "device_ms_per_step": device_us / 1e3,
        "ops_per_step": len(ops) / steps, "trace": args.out, "phase_source": phase_src,
        "phase_match_fraction": matched, "kernels": kernels, "critical": critical,
        "phases": phase_rows}
    what = "kernels" if cuda else "top-level CPU ops"
    print(f"{model} {layout.as_dict()} batch {batch} x {context}, {summary['dtype']}, "
          f"graphs {'on' if summary['cuda_graphs'] else 'off'}: "
          f"step {summary['step_ms_median']:.3f}"
          f" ms (unprofiled median), {what} {device_us / 1e3:.3f} ms and "
          f"{summary['ops_per_step']:.0f} per step; trace {args.out}")
    print(tt.format_table(kernels, f"\n(a) per kernel, over {steps} steps", "kernel",
                          top=args.top))
    if cuda:
        print(tt.format_table(critical, "\n(c) per kernel, time added to the step (its end after "
                              "the previous end; with PDL (a) counts waits)", "kernel",
                              top=args.top))
    if phase_rows:
        note = f"; {100 * matched:.0f} % of kernels aligned" if matched is not None else ""
        print(tt.format_table(phase_rows, f"\n(b) per phase ({phase_src}{note})", "phase"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
    return 0
