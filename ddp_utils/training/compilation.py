"""torch.compile: dynamo's settings for --torch_compile, and what it compiled in this process (for metrics.json
and for --compile_generation's warning)."""

from __future__ import annotations

COUNTS = ("compiled_graphs", "graph_breaks", "cudagraph_skips")  # `compile_counts`' keys


def configure_compile() -> None:
    """--torch_compile's dynamo settings, set before the model is compiled. No communication.

    - Operators whose output's shape depends on the data (`nonzero`) are traced: the LM head runs only where a target
      is predicted (`logits_to_keep` as a boolean mask), and without this each call broke the graph there, fell back
      to eager for the whole wrapping function and recompiled for every new shape. A 2-layer Llama's SFT step with
      LoRA: 3 breaks and 15 recompiles in 3 steps, against none and 1 (CPU, dynamo's eager and aot_eager backends).
    - More recompiles are allowed than dynamo's 8 per function: the model's call has that many legitimate variants
      before any new shape (training and evaluation, with and without gradients, LoRA's adapters on and off for the
      reference; with --compile_generation the decoding step's too). An 8-step DPO run with evaluation used all 8;
      past the limit dynamo runs each new variant uncompiled, with one warning.
    """
    import torch._dynamo

    torch._dynamo.config.capture_dynamic_output_shape_ops = True
    torch._dynamo.config.recompile_limit = 32


def compile_counts() -> dict:
    """What dynamo and inductor compiled in this process so far: graphs, graph breaks, and CUDA graphs skipped (each
    skip runs that graph's kernels one by one); {} where nothing was compiled. No communication."""
    from torch._dynamo.utils import counters

    graphs, breaks = counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())
    if not graphs and not breaks:
        return {}
    return dict(zip(COUNTS, (graphs, breaks, counters["inductor"]["cudagraph_skips"])))
