"""torch.compile: dynamo's settings for --torch_compile, and what it traced in this process (for metrics.json and
for --compile_generation's warning)."""

from __future__ import annotations

COUNTS = ("compiled_graphs", "graph_breaks", "frames_left_eager", "cudagraph_skips")  # `compile_counts`' keys


def dynamo_plugin(backend: str | None):
    """Accelerate's plugin for torch.compile with `backend` (a script's --torch_compile; "no": none; None: the launch
    config's), with torch's own default for shapes: a call is compiled static, and a size that changes is made
    dynamic in the one recompile that follows. No communication.

    `accelerate launch` exports ACCELERATE_DYNAMO_USE_DYNAMIC=False unless told --dynamo_use_dynamic, which the plugin
    passed on as torch.compile(dynamic=False): every new padded length was compiled anew (a 6-step SFT epoch: 9
    graphs, against 4), and past the recompile limit ran uncompiled. Dynamic from the first call (what
    --dynamo_use_dynamic asks, kept) compiles fewer graphs where lengths vary, but each costs more to trace: measured
    on the CPU, no faster in all (bench/README.md)."""
    import os

    from accelerate.utils import TorchDynamoPlugin

    plugin = TorchDynamoPlugin(backend=backend)
    if os.environ.get("ACCELERATE_DYNAMO_USE_DYNAMIC", "").lower() not in ("1", "true", "yes"):
        plugin.dynamic = None  # torch.compile's own default, as transformers' Trainer compiles
    return plugin


def configure_compile() -> None:
    """--torch_compile's dynamo settings, set before the model is compiled. No communication.

    - Operators whose output's shape depends on the data (`nonzero`) are traced: the LM head runs only where a target
      is predicted (`logits_to_keep` as a boolean mask), and without this each call broke the graph there, and the
      graphs after the break were specialised to every new length. A 2-layer Llama's SFT step with LoRA: 3 breaks and
      15 recompiles in 3 steps, against none and 1 (CPU, dynamo's eager and aot_eager backends). Inductor lowers the
      mask's indexing to ATen's own kernels, as eager runs them.
    - More recompiles are allowed than dynamo's 8 per function: the model's call has several legitimate variants
      (training and evaluation, with and without gradients, LoRA's adapters on and off for the reference), each
      compiled for its first shape and then for dynamic ones; an 8-step DPO run with evaluation used 7 of the 8, and
      past the limit dynamo runs each new variant uncompiled, with one warning. Each recompile costs compile time.
    """
    import torch._dynamo

    torch._dynamo.config.capture_dynamic_output_shape_ops = True
    torch._dynamo.config.recompile_limit = 16


def compile_counts() -> dict:
    """What dynamo traced (and inductor compiled) in this process so far, {} where nothing was: graphs, graph breaks,
    frames dynamo gave up on and ran uncompiled (where a break inside a loop lands, not counted as a break), and CUDA
    graphs skipped (`reduce-overhead` only: each skip runs that graph's kernels one by one). No communication."""
    from torch._dynamo.utils import counters

    graphs, breaks = counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())
    if not graphs and not breaks:
        return {}
    frames = counters["frames"]
    return dict(zip(COUNTS, (graphs, breaks, frames["total"] - frames["ok"], counters["inductor"]["cudagraph_skips"])))
