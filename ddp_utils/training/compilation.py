"""torch.compile: Accelerate's plugin and dynamo's settings for a compiled model (--torch_compile), and what it
traced in this process (for metrics.json and for --compile_generation's warning)."""

from __future__ import annotations

import contextlib

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


def compile_by_regions(model, backend: str) -> None:
    """Compile `model` (the unwrapped one, after `accelerator.prepare`) by regions, in place, where `backend` (from
    `dynamo_plugin(...).backend`) is not "no": each member of a list of layers compiled on its own (one compilation
    serves every layer of a class), and each module beside the lists (embeddings, norms, the head) compiled whole;
    the forwards above them, which call them, run eagerly (`_compile_regions`). No communication; nothing is
    compiled until the first call.

    - Compiled whole, the compilation grew with the depth. On an H100 (the GPU check's step 3, session 3:
      SmolLM2-135M's 30 layers, SFT with LoRA) the first step took 119 s and the recompile for a new length 216 s,
      and the run (36 s uncompiled) had not finished after 438 s. On the CPU (inductor, cold caches, SFT with LoRA,
      6 steps): whole 84 s for 6 layers and 295 s for 24 (dynamic shapes from the first call); by regions 67 s and
      68 s. By regions on an H200 (step 3, session 4): 79 s of compilation, then 1.47x eager (bench/README.md).
    - In place, not wrapped: Accelerate's `compile_regions` (its path outside FSDP2 and DeepSpeed) copies the model
      and its DDP wrapper, and then `unwrap_model` returned the copied DDP, which has no `save_pretrained`; in place,
      the model, its wrappers and its parameter names stay as they are (`tests/test_sft.py`, `tests/test_train.py`).
    - Under FSDP2, compiled whole, the hooks at every layer broke the graph (the tests' 2-layer Llama with LoRA, 3
      CLM steps on 2 CPU processes: 10 breaks, 11 graphs, 8 frames left uncompiled); by regions none. After
      `fully_shard` or before is the same: a layer's hooks run inside its compiled call, which dynamo traces at the
      first call."""
    plugin = dynamo_plugin(backend)
    if plugin.backend.value != "NO":
        _compile_regions(model, plugin.to_kwargs())


def _compile_regions(module, compile_kwargs: dict) -> None:
    """`module.compile()` (in place) on the regions of `module`: the members of each non-empty `ModuleList` (a list
    of layers, never called itself), and every module with no such list below it. Accelerate's in-place
    `compile_regions_fsdp2` takes only lists of one class: a hybrid's (Jamba: attention and Mamba layers) became the
    whole model compiled, and a mixed list below other repeated blocks would have been compiled itself and never
    run. A `ModuleDict` on the way (never called either) is passed through; one with no list below stays inside
    the module that holds it (a LoRA layer's adapters), compiled with it."""
    import torch

    def holds_layers(candidate) -> bool:
        return any(isinstance(below, torch.nn.ModuleList) and len(below) for below in candidate.modules())

    if isinstance(module, torch.nn.ModuleList):
        for member in module.children():
            if isinstance(member, (torch.nn.ModuleList, torch.nn.ModuleDict)):
                _compile_regions(member, compile_kwargs)
            else:
                member.compile(**compile_kwargs)
    elif isinstance(module, torch.nn.ModuleDict) or holds_layers(module):
        for child in module.children():
            _compile_regions(child, compile_kwargs)
    else:
        module.compile(**compile_kwargs)


def configure_compile() -> None:
    """Dynamo's settings for a compiled model (--torch_compile, or the launch config's compilation), set before it is
    compiled. No communication.

    - Operators whose output's shape depends on the data (`nonzero`) are traced: the LM head runs only where a target
      is predicted (`logits_to_keep` as a boolean mask), and without this each call broke the graph there, and the
      graphs after the break were specialised to every new length. A 2-layer Llama's SFT step with LoRA: 3 breaks and
      15 recompiles in 3 steps, against none and 1 (CPU, dynamo's eager and aot_eager backends; the model compiled
      whole, then). By regions the mask is applied in the model's own forward, uncompiled; the setting still serves
      data-dependent operators inside a layer (a mixture of experts' routing).
    - More recompiles are allowed than dynamo's 8 per function (a layer class's forward, by regions): it has several
      legitimate variants, each compiled for its first length and then dynamic. The tests' SFT epoch: 6 for the
      layer (the first layer's input needs no gradient; evaluation without gradients; a batch of one record, as
      dynamo specialises a size of 1); DPO's add the reference (adapters off). Past the limit dynamo runs each new
      variant uncompiled, with one warning. Each recompile costs compile time.
    """
    import torch._dynamo

    torch._dynamo.config.capture_dynamic_output_shape_ops = True
    torch._dynamo.config.recompile_limit = 16


@contextlib.contextmanager
def generation_context(model):
    """The context to generate in: the regions of `model` that `compile_by_regions` compiled run uncompiled in it
    (their plain calls), and compiled again after it; elsewhere it changes nothing. No communication.

    Each layer's cache update reads its own `layer_idx`, which dynamo specialises, so while generating every layer
    was a variant of the one compiled layer: on 2 CPU processes under FSDP a 20-layer Llama reached dynamo's
    recompile limit in the zero-shot evaluation, and from then on its layer ran uncompiled, in training too. Not
    torch's `force_eager` stance, which would also stop --compile_generation's own compiled decoding step, while
    `generate`'s first step (its prefill) calls the model outside that step."""
    compiled = {m: m._compiled_call_impl for m in model.modules() if getattr(m, "_compiled_call_impl", None)}
    for module in compiled:
        module._compiled_call_impl = None  # nn.Module's own switch: `module.compile()` sets it
    try:
        yield
    finally:
        for module, call in compiled.items():
            module._compiled_call_impl = call


def sharded_compile_warning(accelerator) -> str | None:
    """The warning for a compiled model under DeepSpeed ZeRO-3, None elsewhere. No communication.

    ZeRO-3 gathers each layer's parameters in hooks around its forward and backward, which dynamo cannot trace
    through. Measured on 2 CPU processes (tests/launched/deepspeed_on_cpu.py, dynamo's eager backend, the tests'
    2-layer Llama with LoRA, 3 CLM steps, compiled by Accelerate then): ZeRO-3 75 graphs, 56 breaks and the
    recompile limit reached, whole or by regions (its hooks are on every module that holds parameters); ZeRO-2 and
    FSDP2 by regions 7 graphs, none. On a GPU each graph is an inductor compilation, and a model of 30 layers breaks
    more."""
    plugin = accelerator.state.deepspeed_plugin
    if plugin is None or plugin.zero_stage != 3:
        return None
    return (
        "torch.compile under DeepSpeed ZeRO-3: its gathering of each layer's parameters breaks the compiled graph "
        "at every layer (2 CPU processes, a 2-layer model: 56 breaks and 75 graphs in 3 steps, against none under "
        "ZeRO-2), so compiling takes long and, past dynamo's recompile limit, runs uncompiled; compile under "
        "deepspeed_zero2.yaml or fsdp.yaml, or train uncompiled"
    )


def compile_counts() -> dict:
    """What dynamo traced (and inductor compiled) in this process so far, {} where nothing was: graphs, graph breaks,
    frames dynamo gave up on and ran uncompiled (where a break inside a loop lands, not counted as a break), and CUDA
    graphs skipped (`reduce-overhead` only: each skip runs that graph's kernels one by one); and the operators the
    graphs hold (`traced_operators`), what the compiler compiles: its time grows with them. No communication."""
    from torch._dynamo.utils import counters

    graphs, breaks = counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())
    if not graphs and not breaks:
        return {}
    frames = counters["frames"]
    counts = (graphs, breaks, frames["total"] - frames["ok"], counters["inductor"]["cudagraph_skips"])
    return {**dict(zip(COUNTS, counts)), "traced_operators": counters["stats"]["calls_captured"]}
