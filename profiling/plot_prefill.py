"""Plot profiling/results/prefill.json: the prefill attention paths against torch SDPA (a), and
time to first token against its FLOP floor, Helix and transformers (b, c).

    python profiling/plot_prefill.py profiling/results/prefill.json profiling/results/prefill.png
"""

from __future__ import annotations

import json
import sys


def main(src: str, dst: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    recs = json.load(open(src))["records"]
    if any(r.get("current") for r in recs):          # the latest runs (earlier ones: history)
        recs = [r for r in recs if r.get("current")]
    fig, (ka, kb) = plt.subplots(1, 2, figsize=(11, 4))
    gqa = sorted((r for r in recs if r.get("kernel") == "gqa"), key=lambda r: r["prompt_tokens"])
    xs = [r["prompt_tokens"] // 1024 for r in gqa]
    for key, label in (("triton_ms", "Triton kernel"), ("cudnn_ms", "cuDNN over pages"),
                       ("sdpa_ms", "torch SDPA (contiguous)")):
        ka.plot(xs, [r[key] for r in gqa], marker="o", label=label)
    ka.set(xscale="log", yscale="log", xlabel="prompt tokens (K)", ylabel="ms per layer",
           title="GQA prefill attention, Llama-3.1-8B shape")
    ka.legend()
    ttft = [r for r in recs if r.get("part") in ("b", "c") and r.get("ttft_s")]
    labels = [f"{r['engine']}\n{r['model']}\n{r['prompt_tokens'] // 1024}K" for r in ttft]
    kb.bar(range(len(ttft)), [r["ttft_s"] for r in ttft], label="time to first token")
    kb.bar(range(len(ttft)), [r["floor_s"] for r in ttft], width=0.4, label="FLOP floor")
    kb.set_xticks(range(len(ttft)), labels, fontsize=6)
    kb.set(yscale="log", ylabel="seconds", title="Whole-model prefill, one H200")
    kb.legend()
    fig.tight_layout()
    fig.savefig(dst, dpi=120)


if __name__ == "__main__":
    main(*sys.argv[1:3])
