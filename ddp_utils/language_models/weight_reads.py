"""Modules whose code reads a layer's weight directly instead of calling the layer: Mamba's mixers
(`self.dt_proj.weight @ ...`; on a GPU their fused kernels take the weights of x_proj, out_proj and conv1d), the
Gated DeltaNet of Qwen 3.5 and Qwen3-Next and Bamba's mixer in generation (`self.conv1d.weight.squeeze(1)`),
LongCat-Flash's router. Two things break there: peft's adapter, which wraps the layer's call, never runs (`lora`
leaves such layers out), and DeepSpeed ZeRO-3, which gathers a layer's weight when the layer is called, hands the
code an empty partition (`weights_read_whole`, around generation). peft's own wrapper around an adapted parameter (an
MoE's experts) reads its adapter's weights the same way (`fetch_adapted_parameters_under_zero3`)."""

from __future__ import annotations

import contextlib
import functools
import inspect
import re

# A layer's weight read by the code of the module that holds it, instead of calling the layer: Mamba's mixers
# (`self.dt_proj.weight @ ...`, `self.conv1d.weight.squeeze(1)`), LongCat-Flash's router
# (`F.linear(x, self.classifier.weight.type(...))`). Not a use: a read of what describes the
# weight (its dtype, device, shape...), an assignment to it, an initialisation, an isinstance or getattr test, and
# a slice (Bloom's, only with `slow_but_exact`, would leave its attention's output out of every Bloom's LoRA).
WEIGHT_READ = re.compile(r"self\.(\w+)\.weight\b(?!\s*=[^=])(?!\s*\[)(?:\.(\w+))?")
DESCRIBES = {"dtype", "device", "shape", "size", "ndim", "dim", "numel", "nelement", "element_size", "data",
             "requires_grad", "is_meta", "_is_hf_initialized"}  # fmt: skip
NOT_A_USE = re.compile(r"^\s*(?:(?:torch\.)?(?:nn\.)?init\.\w+\(|.*\b(?:isinstance|getattr|hasattr)\(self\.)")


@functools.cache
def weights_read_directly(module_class) -> frozenset[str]:
    """The attribute names whose weight the code of `module_class` and its bases reads (`WEIGHT_READ`, less what
    is `NOT_A_USE`): a model's own code, its remote code included, not torch's or transformers' shared classes
    (PreTrainedModel, GenerationMixin: a second's reading, and no layer of theirs)."""
    names = set()
    for cls in module_class.__mro__:
        shared = cls.__module__.startswith(("torch.", "transformers.")) and ".models." not in cls.__module__
        if shared or cls is object:
            continue
        try:
            lines = inspect.getsource(cls).splitlines()
        except (OSError, TypeError):  # defined where its source cannot be read
            continue
        for line in lines:
            if not NOT_A_USE.match(line):
                names.update(name for name, attribute in WEIGHT_READ.findall(line) if attribute not in DESCRIBES)
    return frozenset(names)


def modules_reading_weights(model) -> dict[str, list[str]]:
    """{class name: the attributes it reads the weight of} for the classes of `model`'s modules whose code reads the
    weight of one of their own layers directly (`weights_read_directly`). No communication."""
    found = {}
    for module in model.modules():
        held = {name for name, child in module.named_children() if getattr(child, "weight", None) is not None}
        read = sorted(held & weights_read_directly(type(module)))
        if read:
            found[type(module).__name__] = read
    return found


@contextlib.contextmanager
def weights_read_whole(model):
    """All ranks call this, around generation (each module's gather is a collective, which every rank reaches in
    step: `synced_gpus`): under DeepSpeed ZeRO-3, each module whose code reads its layers' weights directly
    (`modules_reading_weights`) is gathered whole while it runs, one at a time; elsewhere nothing. ZeRO-3 gathers a
    weight when its layer is called: read without the call, it was this rank's partition, and GRPO on Bamba, Qwen 3.5,
    Qwen3-Next, Falcon-H1 or Zamba2 stopped in its first generation ("Dimension out of range"). Only while
    generating: DeepSpeed's leaf modules, which gathered such modules whole for training too, broke its backward
    pass ("The size of tensor a (0) must match the size of tensor b (4)": SFT of each of them under ZeRO-3)."""
    from transformers.integrations import is_deepspeed_zero3_enabled

    reads = modules_reading_weights(model) if is_deepspeed_zero3_enabled() else {}
    if not reads:
        yield
        return
    import deepspeed

    handles, gathering = [], {}

    def gather(module, args):  # all of it: its code reads biases and norms' weights too (Qwen3-Next's, conv1d's)
        gathering[module] = deepspeed.zero.GatheredParameters(list(module.parameters()))
        gathering[module].__enter__()

    def release(module, args, output):
        gathering.pop(module).__exit__(None, None, None)

    for module in model.modules():
        if type(module).__name__ in reads:
            handles += [module.register_forward_pre_hook(gather), module.register_forward_hook(release)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def fetch_adapted_parameters_under_zero3(model) -> None:
    """Under DeepSpeed ZeRO-3, have the parameters of each peft wrapper that adapts a parameter (an MoE's experts and
    router: `moe_weights_adapted`) gathered when the wrapper runs, its adapter's and the adapted one; elsewhere
    nothing. ZeRO-3 gathers a layer's own parameters when the layer is called, and the wrapper calls neither its
    adapter's layers (it reads their weights) nor leaves the adapted parameter in its layer (it moves it into a
    parametrization while the layer runs): the routers and experts of Qwen3-Next and MiniMax read empty partitions
    in generation ("size mismatch, got input (16), mat (16x32), vec (0)"). Every rank calls it on its own model,
    after building it; no communication."""
    from transformers.integrations import is_deepspeed_zero3_enabled

    if not is_deepspeed_zero3_enabled():
        return
    from deepspeed.runtime.zero.partition_parameters import register_external_parameter

    for module in model.modules():
        if getattr(module, "parameter_name", None) and hasattr(module, "get_base_layer"):  # peft's ParamWrapper
            for parameter in module.parameters():
                register_external_parameter(module, parameter)
