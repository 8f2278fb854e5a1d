"""What log-probabilities, penalties and logit_bias cost a decode step: whole steps (graphs on
where the device has them) of the same batch and context, plain greedy rows against rows that
ask for each, in one process on one engine.

    python profiling/bench_sampling_extras.py --model llama-3.1-8b --layers 4 \\
        --batches 1,8,64 --contexts 8192 --out sampling_extras.json

These run eagerly after the step's graph (helix/runtime/logprobs.py, penalties.py): per step,
logprobs a log_softmax + top-k over [B, V] fp32, penalties the output counts [B, V], the
processed logits and the argmax (or draw) again. Prints step ms per mode and its ratio to the
plain step; --out writes the records (helix sweep's fields, plus "mode" and "sampling").
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from profiling import bench_args  # noqa: E402

MODES = {"plain": {},
         "logprobs": {"logprobs": 5},
         "penalties": {"repetition_penalty": 1.1, "frequency_penalty": 0.5,
                       "presence_penalty": 0.5},
         "logit_bias": {"logit_bias": {t: 1.0 for t in range(0, 1000, 10)}},
         "all": {"logprobs": 5, "repetition_penalty": 1.1, "frequency_penalty": 0.5,
                 "logit_bias": {t: 1.0 for t in range(0, 1000, 10)}}}


def measure(model: str, layers: int | None, batches: list[int], contexts: list[int],
            modes: list[str], device: str, steps: int) -> list[dict]:
    from helix.config import Layout
    from helix.sweep import Sweep, open_llm, run_point
    runtime = {"device": device, "dtype": "bfloat16" if device == "cuda" else "float32"}
    if layers:
        runtime["layers"] = layers
    sweep = Sweep("sampling-extras", (model,), (Layout(),), tuple(batches), tuple(contexts),
                  runtime, decode_steps=steps)
    records = []
    with open_llm(sweep, model, Layout()) as llm:
        for b in batches:
            for c in contexts:
                for mode in modes:
                    rec = run_point(sweep, llm, model, Layout(), b, c, sampling=MODES[mode])
                    rec.update(mode=mode, sampling={k: (len(v) if isinstance(v, dict) else v)
                                                    for k, v in MODES[mode].items()})
                    records.append(rec)
    return records


def table(records: list[dict]) -> str:
    plain = {(r["batch"], r["context"]): r["step_ms_median"] for r in records
             if r["mode"] == "plain"}
    lines = ["batch  context  mode        step ms   x plain"]
    for r in records:
        base = plain.get((r["batch"], r["context"]))
        ratio = f"{r['step_ms_median'] / base:7.3f}" if base else "      -"
        lines.append(f"{r['batch']:5d}  {r['context']:7d}  {r['mode']:10s} "
                     f"{r['step_ms_median']:8.3f}  {ratio}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = bench_args.parser(__doc__)
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--contexts", default="8192")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--steps", type=int, default=32, help="timed decode steps a point")
    args = ap.parse_args(argv)
    modes = args.modes.split(",")
    bad = [m for m in modes if m not in MODES]
    if bad:
        print(f"bench_sampling_extras: unknown mode {bad[0]!r}: pick from {', '.join(MODES)}",
              file=sys.stderr)
        return 2
    records = measure(args.model, args.layers, [int(b) for b in args.batches.split(",")],
                      [int(c) for c in args.contexts.split(",")], modes, args.device,
                      args.steps)
    return bench_args.finish(records, args.out, table(records))


if __name__ == "__main__":
    sys.exit(main())
