"""A short captured greedy decode of a tiny preset on the GPU, for tests that compare two
ways of running the same step (PDL modes, fused or separate launches)."""

from helix import LLM, Layout, RuntimeConfig, SamplingParams

PROMPTS = ([5, 17, 42, 3], [7, 8], [11, 12, 13])


def captured_decode(model: str, new_tokens: int = 6, prompts=PROMPTS, graph_eager=False):
    """-> (each request's tokens, the logits of every step), bf16, graph buckets 1 / 2 / 4;
    graph_eager: the same bucketed steps run without capture."""
    rt = RuntimeConfig(device="cuda", dtype="bfloat16", page_size=16, max_batch=4,
                       graph_buckets=(1, 2, 4), attention_backend="triton",
                       graph_eager=graph_eager)
    with LLM(model, Layout(), rt) as llm:
        ids = [llm.add_request(p, SamplingParams(max_new_tokens=new_tokens, ignore_eos=True))
               for p in prompts]
        logits = []
        while llm.has_unfinished():
            llm.step()
            logits.append(llm.engine.last_logits.clone())
        return [llm.outputs[i] for i in ids], logits
