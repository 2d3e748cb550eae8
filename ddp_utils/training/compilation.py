"""torch.compile: Accelerate's plugin and dynamo's settings for a compiled model (--torch_compile), and what it
traced in this process (for metrics.json and for --compile_generation's warning)."""

from __future__ import annotations

COUNTS = ("compiled_graphs", "graph_breaks", "frames_left_eager", "cudagraph_skips")  # `compile_counts`' keys


def dynamo_plugin(backend: str | None):
    """Accelerate's plugin for torch.compile with `backend` (a script's --torch_compile; "no": none; None: the launch
    config's, as train.py and train_image.py take it), with torch.compile's own default for shapes: a call is
    compiled static, and a size that changes is made dynamic in the one recompile that follows. No communication.

    `accelerate launch` exports ACCELERATE_DYNAMO_USE_DYNAMIC=False unless told --dynamo_use_dynamic, and the plugin
    passed that on as torch.compile(dynamic=False): every new padded length was compiled anew (a 6-step SFT epoch: 9
    graphs, against 4), and past the recompile limit ran uncompiled. So False, which the launcher writes whether or
    not anyone asked, is read as the default; static shapes cannot be asked for here. True (dynamic from the first
    call) is kept: fewer graphs where lengths vary, each costlier to trace (on the CPU no faster in all; on a GPU the
    GPU check's steps 3 and 11 measure the default, bench/README.md)."""
    from accelerate.utils import TorchDynamoPlugin

    plugin = TorchDynamoPlugin(backend=backend)
    if not plugin.dynamic:  # read from the launcher's variable as Accelerate reads it
        plugin.dynamic = None
    return plugin


def configure_compile() -> None:
    """Dynamo's settings for a compiled model (--torch_compile, or the launch config's compilation), set before it is
    compiled. No communication.

    - Operators whose output's shape depends on the data (`nonzero`) are traced: the LM head runs only where a target
      is predicted (`logits_to_keep` as a boolean mask), and without this each call broke the graph there, and the
      graphs after the break were specialised to every new length. A 2-layer Llama's SFT step with LoRA: 3 breaks and
      15 recompiles in 3 steps, against none and 1 (CPU, dynamo's eager and aot_eager backends). Inductor lowers the
      mask's indexing to ATen's own kernels, as eager runs them.
    - More recompiles are allowed than dynamo's 8 per function: the model's call has several legitimate variants,
      each compiled for its first length and then dynamic. DPO's: the policy and the reference (adapters off, no
      gradients), each static then dynamic, and evaluation with the adapters on and off, 6 graphs (5 recompiles) in
      the GPU check's dry run; an evaluation batch of one record is one more (dynamo specialises a size of 1). Past
      the limit dynamo runs each new variant uncompiled, with one warning. Each recompile costs compile time.
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
