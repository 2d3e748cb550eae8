"""LoRA through `peft`: which modules get adapters (all linear layers by default, or the last N
layers only, so the backward pass stops below them), with errors that name the fix; every rank
calls `add_lora` on its own model, before `accelerator.prepare`. Saving and merging: lora_merge.py."""

from __future__ import annotations

import functools
import inspect
import re
import warnings

import torch
from accelerate.logging import get_logger

from ..core.errors import UsageError
from ..core.sharded import weight_count
from ..training.activation_checkpointing import drop_input_require_grads
from .multimodal import parts_text_never_runs, text_config
from .weight_reads import fetch_adapted_parameters_under_zero3, weights_read_directly

logger = get_logger(__name__)


def check_lora_args(args) -> None:
    """Refuse LoRA options that cannot work together, while parsing (every rank, no communication)."""
    if args.lora_r < 0:
        raise UsageError(f"--lora_r must be 0 (no LoRA) or positive, got {args.lora_r}")
    if args.merge_lora and not args.lora_r:
        raise UsageError("--merge_lora needs LoRA: give --lora_r as well")
    if args.lora_last_layers < 0 or (args.lora_last_layers and not args.lora_r):
        raise UsageError(
            f"--lora_last_layers takes a positive number of layers, with --lora_r (got {args.lora_last_layers})"
        )


def linear_modules(model) -> dict:
    """{full name: module} of the model's linear layers, GPT-2's Conv1D included."""
    from transformers.pytorch_utils import Conv1D  # GPT-2's linear layers

    return {name: module for name, module in model.named_modules() if isinstance(module, (torch.nn.Linear, Conv1D))}


def linear_module_names(model, outside=(), exclude=None) -> list[str]:
    """The names (last part) of the model's linear layers, GPT-2's Conv1D included, except `exclude` and those in
    the modules named in `outside`."""
    linears = {name: module for name, module in linear_modules(model).items() if module is not exclude}
    kept = [name for name in linears if not any(name == part or name.startswith(f"{part}.") for part in outside)]
    return sorted({name.rsplit(".", 1)[-1] for name in kept})


def linears_used_by_weight(model) -> dict[str, str]:
    """{full name: the class that uses it} for the linear layers whose weight the module holding them uses
    directly, without calling them (`weight_reads.WEIGHT_READ`): peft's adapter wraps the call, so an adapter there
    never runs and never trains, and under DDP the run stopped at its second step, waiting for its gradient
    (Jamba's dt_proj). No communication."""
    linears, found = linear_modules(model), {}
    for parent_name, parent in model.named_modules():
        for name in weights_read_directly(type(parent)):
            full = f"{parent_name}.{name}".lstrip(".")
            if full in linears:
                found[full] = type(parent).__name__
    return found


@functools.cache
def _returns_several(linear_class) -> bool:
    """Whether the forward of `linear_class`, a subclass of torch's Linear, returns several values."""
    import ast
    import textwrap

    for cls in linear_class.__mro__:
        if cls is torch.nn.Linear:
            return False
        if "forward" in cls.__dict__:
            try:
                tree = ast.parse(textwrap.dedent(inspect.getsource(cls.forward)))
            except (OSError, TypeError, SyntaxError):  # defined where its source cannot be read
                return False
            return any(isinstance(node, ast.Return) and isinstance(node.value, ast.Tuple) for node in ast.walk(tree))
    return False


def linears_returning_several(model) -> dict[str, str]:
    """{full name: its class} for the linear layers whose own forward returns several values: Llama 4's and
    PhiMoE's routers (their scores and choices). peft's adapter adds its output to the layer's, and failed there
    ("'tuple' object has no attribute 'dtype'"). No communication."""
    linears = linear_modules(model)
    return {name: type(module).__name__ for name, module in linears.items() if _returns_several(type(module))}


LORA_DROPOUT = 0.05  # --lora_dropout when not given, on models whose adapters can take dropout


def moe_weights_adapted(lora, model) -> list[str]:
    """The MoE weights that peft adapts as parameters with the LoRA config `lora`: transformers 5 keeps an MoE's
    experts (Mixtral's, Qwen3-MoE's, DeepSeek V3's, ...) as 3-D parameters, and peft maps the linear layers of the
    experts and router that transformers 4 had onto them (`target_parameters`), which take no dropout
    ("lora.ParamWrapper does not work with lora_dropout != 0"). Read from peft's own mapping, on a copy of `lora`.
    No communication."""
    import copy

    from peft.utils.transformers_weight_conversion import (
        convert_peft_config_for_transformers,
        get_model_conversion_mapping,
    )

    probe = copy.deepcopy(lora)
    convert_peft_config_for_transformers(probe, model=model, conversions=get_model_conversion_mapping(model))
    return sorted(getattr(probe, "target_parameters", None) or [])


def _last_two(name: str) -> str:
    return ".".join(name.split(".")[-2:])  # "model.layers.0.mamba.dt_proj" -> "mamba.dt_proj"


class CastOutsideAutocast:
    """A LoRA layer's `cast_input_dtype_enabled` (peft casts the layer's input to its adapters' dtype, fp32 here,
    where it is true): true only outside autocast. Under autocast the adapters' matmul casts the input straight back
    to bf16, the same values: on a bf16 base two launches a layer forward and two backward for nothing, 6% of a LoRA
    forward and backward's operators (bench/README.md). Outside it (no mixed precision) the cast is needed."""

    def __init__(self):
        accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
        self.device_types = ("cpu",) + ((accelerator.type,) if accelerator is not None else ())

    def __bool__(self) -> bool:
        return not any(torch.is_autocast_enabled(device_type) for device_type in self.device_types)


def refuse_convolutions_of_their_own(model) -> None:
    """Refuse adapters on convolutions whose class computes otherwise than torch's Conv2d (BiT's weight-standardized,
    padded ones): peft's adapter adds a plain convolution of the layer's input beside it, which neither matched the
    output's shape nor what merging into the weight computes. No communication."""
    from peft.tuners.lora import LoraLayer

    for name, module in model.named_modules():
        base = getattr(module, "base_layer", None) if isinstance(module, LoraLayer) else None
        if isinstance(base, torch.nn.Conv2d) and type(base).forward is not torch.nn.Conv2d.forward:
            raise UsageError(
                f"--lora_target_modules: {name.removeprefix('base_model.model.')} is a {type(base).__name__}, which "
                "computes otherwise than a plain convolution, so a LoRA adapter cannot follow it; name other modules, "
                "or train the model whole, without --lora_r"
            )


def wrap_in_peft(model, lora_config):
    """peft's `get_peft_model(model, lora_config)`, without the FutureWarning it gives on every call (it reads
    transformers' deprecated `is_gradient_checkpointing`). No communication."""
    from peft import get_peft_model

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)
        return get_peft_model(model, lora_config)


def add_lora(model, args, task_type: str = "CAUSAL_LM", whole: tuple = ()):
    """`model` with LoRA adapters (--lora_r, --lora_alpha, --lora_dropout, --lora_target_modules,
    --lora_last_layers); only the adapters train, and the modules named in `whole` (a classifier's new head, peft's
    modules_to_save), which get no adapter. A target module the model does not have, or more layers than it has,
    is a UsageError that lists what it has."""
    try:
        from peft import LoraConfig
    except ImportError:
        raise UsageError("--lora_r needs the peft package: pip install -r requirements.txt") from None
    targets = args.lora_target_modules
    if targets != "all-linear":
        targets = [m.strip() for m in targets.split(",")]
    output, linears = model.get_output_embeddings(), linear_modules(model)  # the output layer is never adapted
    bypassed = {  # {full name: why no adapter can train there}
        **{name: f"whose weight {user} uses directly instead of calling the layer"
           for name, user in linears_used_by_weight(model).items() if linears[name] is not output},
        **{name: f"a {kind} whose output is several values, to which an adapter cannot add its own"
           for name, kind in linears_returning_several(model).items()},
    }  # fmt: skip
    # Named as peft matches: the full path, or its end after a dot (dt_proj, mamba.dt_proj, ...).
    named = [] if targets == "all-linear" else [(t, n) for t in targets for n in bypassed if f".{n}".endswith(f".{t}")]
    if named:
        target, name = named[0]
        raise UsageError(
            f"--lora_target_modules names {target}, {bypassed[name]} ({name}): no adapter can train there; leave it out"
        )
    if targets == "all-linear" and bypassed:  # every other linear layer, by its name and its parent's in the layer
        # (peft applies --lora_last_layers only to names it matches at the end of a module's path, not full paths)
        left = {_last_two(name) for name in bypassed}
        targets = sorted({_last_two(n) for n, module in linears.items() if module is not output} - left)
        for name, reason in sorted({(name.rsplit(".", 1)[-1], why) for name, why in bypassed.items()}):
            logger.info(f"LoRA leaves out {name}, {reason}: no adapter can train there")
    if args.lora_last_layers and targets == "all-linear":  # peft takes layer numbers only with named modules
        targets = linear_module_names(model, whole, exclude=output)
    layers = text_config(model.config).num_hidden_layers if args.lora_last_layers else 0  # a text model's
    if args.lora_last_layers > layers:
        raise UsageError(
            f"--lora_last_layers {args.lora_last_layers} is more than this model's {layers} layers; "
            f"give at most {layers}"
        )
    last_layers = list(range(layers - args.lora_last_layers, layers)) if args.lora_last_layers else None
    # A tower that text never runs: its adapters would never train (an image classifier's is what runs)
    reads_text = getattr(model, "main_input_name", "input_ids") != "pixel_values"
    untouched = [*(parts_text_never_runs(model) if reads_text else ()), *whole]
    lora = LoraConfig(
        r=args.lora_r,
        lora_alpha=args.lora_alpha,
        lora_dropout=LORA_DROPOUT if args.lora_dropout is None else args.lora_dropout,
        target_modules=targets,
        task_type=task_type,
        layers_to_transform=last_layers,
        modules_to_save=list(whole) or None,
        exclude_modules="|".join(re.escape(name) + r"(\..*)?" for name in untouched) or None,  # peft: fullmatch
    )
    names = linear_module_names(model, untouched)  # before peft, which changes the model in place when it fails
    if targets == "all-linear" and not names:  # PoolFormer, BiT: convolutions only, besides the head
        convolutions = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Conv2d)}
        raise UsageError(
            f"--lora_target_modules 'all-linear' finds no linear layer in {type(model).__name__}'s body (a "
            f"convolutional network): name its convolutions, {sorted(convolutions)[:8]}, for peft's Conv2d adapters, "
            "or train it whole, without --lora_r"
        )
    experts = moe_weights_adapted(lora, model) if lora.lora_dropout else []
    if experts and args.lora_dropout is not None:
        raise UsageError(
            f"--lora_dropout {args.lora_dropout}: peft adapts {type(model).__name__}'s MoE weights "
            f"({', '.join(experts)}) as parameters, which take no dropout; give --lora_dropout 0, or leave the experts "
            f"out with --lora_target_modules naming others of {names}"
        )
    if experts:
        logger.warning(
            f"LoRA without dropout (its default, {LORA_DROPOUT}, elsewhere): peft adapts {type(model).__name__}'s MoE "
            f"weights ({', '.join(experts)}) as parameters, which take no dropout; --lora_target_modules "
            f"naming others of {names} leaves the experts out and keeps dropout"
        )
        lora.lora_dropout = 0.0
    args.lora_dropout = lora.lora_dropout  # what the adapters have, for training_args.json and the model card
    # The adapters' initial weights come from the run's seed, whatever loading drew: building Gemma 3's whole model
    # draws random numbers inside ZeRO-3's zero.Init, and on FSDP's ranks that build it empty, which DDP's loading
    # does not (lora_A 0.35 apart from DDP's). Where loading draws none (DDP, Llama), the state is this one already.
    torch.manual_seed(args.seed)
    try:
        model = wrap_in_peft(model, lora)
    except ValueError as exc:
        reason = str(exc).splitlines()[0][:160]
        if args.lora_last_layers and "No modules were targeted" in reason:  # ALBERT: one layer shared by the depth
            raise UsageError(
                f"--lora_last_layers {args.lora_last_layers} with --lora_target_modules {args.lora_target_modules!r} "
                f"adapts nothing in {type(model).__name__}: no layer it names lies in the last "
                f"{args.lora_last_layers} numbered layers (ALBERT shares one layer across its depth); its linear "
                f"layers are {names}: name them, or drop --lora_last_layers"
            ) from None
        raise UsageError(
            f"--lora_target_modules {args.lora_target_modules!r} does not fit this model ({reason}); "
            f"its linear layers are {names}"
        ) from None
    refuse_convolutions_of_their_own(model)
    fetch_adapted_parameters_under_zero3(model)
    drop_input_require_grads(model.get_base_model())  # with --gradient_checkpointing peft hooks the embeddings again
    from peft.tuners.tuners_utils import BaseTunerLayer

    outside_autocast = CastOutsideAutocast()  # peft reads it at each call: no cast where autocast casts anyway
    for module in model.modules():
        if isinstance(module, BaseTunerLayer):
            module.cast_input_dtype_enabled = outside_autocast
    sizes = [(weight_count(p), p.requires_grad) for p in model.parameters()]
    trainable = sum(size for size, requires_grad in sizes if requires_grad)
    logger.info(f"LoRA r={args.lora_r}: {trainable:,} trainable of {sum(size for size, _ in sizes):,} parameters")
    from peft.utils import ModulesToSaveWrapper

    for name, module in model.named_modules():  # what peft trains whole: `whole`, and a classifier's head by its name
        if isinstance(module, ModulesToSaveWrapper):
            name = name.removeprefix("base_model.model.")
            why = "it holds weights the checkpoint lacks" if name in whole else "peft trains a classifier's head so"
            logger.info(f"LoRA: {name} trains whole, with no adapter ({why})")
    return model
