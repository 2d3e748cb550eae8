"""Accelerate's FSDP2 path, made to work on every model the scripts take, and its RAM-efficient
loading made true. Measured with Accelerate 1.15, transformers 5.23 and torch 2.13 on CPU processes
(tests/launched/fsdp_on_cpu.py), each a silent fault or a crash on a GPU too:

- Per-layer wrapping shards one unit per class of the model's `_no_split_modules`, and Accelerate
  then shards the input embeddings as a unit of their own. Where a wrapped class already holds them
  (BERT's `BertEmbeddings`, RoBERTa's, ...) `fully_shard` fails inside torch ("Invariant
  encountered: value was None"). `fix_fsdp2_preparation` leaves such a class out. (The separate
  embeddings unit came with huggingface/accelerate#4015; no issue found for this crash.)
- Accelerate maps the optimizer's parameters onto the sharded ones by their storage address. A
  parameter on the meta device has address 0, so on the ranks that do not read the weights two
  such parameters (a new classification head's weight and bias) became one in the optimizer: one
  trained twice per step and the other never, and the checkpoint save then failed on those ranks
  (KeyError in torch's `get_optimizer_state_dict`) while rank 0 waited in it. Each meta parameter
  now gets an address of its own (`_distinct_addresses`). Upstream: huggingface/accelerate#3930.
- Accelerate asks the model for its input embeddings; a ResNet raises NotImplementedError instead.
- Per-layer wrapping failed ("Could not find the transformer layer class") where `_no_split_modules` names a
  class the model does not hold: Gemma 3's whole model (4B and up) names SiglipTextEmbeddings, of a SigLIP text
  tower it lacks. Only the classes it holds are wrapped.
- `fsdp_cpu_ram_efficient_loading` (our config's default) promises that only rank 0 reads the
  weights; transformers 5 reads them on every rank and leaves only the missing ones on the meta
  device (huggingface/transformers#43749). `load_pretrained` builds the model empty on the other
  ranks; Accelerate's preparation then sends them rank 0's weights. Not for a model with persistent
  buffers (BatchNorm's statistics): Accelerate's sending fails on them ("'Tensor' object has no
  attribute 'device_mesh'", huggingface/accelerate#3898), so every rank reads such a model, and the
  option is turned off for it. Built empty, a model whose LM head shares the input embeddings' weight (Gemma,
  Llama 3.2 1B and 3B, Qwen2.5 up to 3B, SmolLM2) had them apart on those ranks, and Accelerate's preparation
  failed there ("FSDP2 mapping failed (missing: ['lm_head.weight'])"); they share as on rank 0 (`share_as`).
- T5's and BART's classifiers failed in `prepare` ("Parameter 'transformer.shared.weight' is shared with a parameter
  already managed by another FSDP group"): transformers 5 gives their encoder's and decoder's embeddings modules of
  their own, tied to the input embeddings by the weight, which Accelerate shards as a unit of its own. They are made
  that one module, as in transformers 4.
- `fsdp_auto_wrap_policy: SIZE_BASED_WRAP` crashed in `prepare` ("fully_shard does not support containers that do
  not implement forward: ModuleList") wherever the list of layers is over its minimum size: refused in one line.
- `fsdp_activation_checkpointing` recomputed each layer with other dropout masks, and a LoRA run saved an empty
  adapter: transformers' own checkpointing does it instead (`activation_checkpointing.py`).

`make_accelerator` calls `fix_fsdp2_preparation` once; the scripts load their model with `load_pretrained`.
"""

from __future__ import annotations

import contextlib
import os

import torch
from accelerate.logging import get_logger
from accelerate.state import PartialState

from ..core.errors import UsageError
from .activation_checkpointing import checkpoint_for_fsdp
from .pretrained import build_from_config, keep_used_weight_conversions, shared_weights
from .zero3_loading import loading_context

logger = get_logger(__name__)


def fix_fsdp2_preparation(accelerator) -> None:
    """Under FSDP2, fix what Accelerate 1.15 gets wrong while it shards a model in `prepare` (see the module's
    docstring): meta parameters get distinct addresses; a model without input embeddings answers None; modules that
    share the input embeddings' weight become that one module; a model with persistent buffers is not sent from rank
    0 (every rank read it); and a wrapped class that holds the input embeddings is left out of the wrapped ones, so
    the embeddings become their own unit (as Accelerate shards them anyway) and the rest of that module joins the
    root's: the same computation, the all-gathers grouped otherwise; the config's activation checkpointing is done
    by transformers (`activation_checkpointing.py`); SIZE_BASED_WRAP that would pick a ModuleList is refused. Under
    FSDP1, a warning: it has never run here. Any rank may call it; every rank does. No communication."""
    plugin = getattr(accelerator.state, "fsdp_plugin", None)  # the state has no such attribute outside FSDP
    if plugin is not None and getattr(plugin, "fsdp_version", 1) != 2:
        # Older `accelerate config` files leave fsdp_version out, which is 1. Accelerate's FSDP1 path does not run on
        # CPU processes (its plugin asks for a GPU; FSDP1 refuses Accelerate's CPU device), so no test has run it.
        logger.warning(
            "this launch config runs FSDP1 (fsdp_version 1, the default where the config leaves it out), which has "
            "never run with these scripts; set fsdp_version: 2 in it, as accelerate_configs/fsdp.yaml does"
        )
    if plugin is None or getattr(plugin, "fsdp_version", 1) != 2:
        return
    set_policy = plugin.set_auto_wrap_policy

    # Accelerate's FSDP2 preparation calls this first, with the model, before it maps the optimizer's
    # parameters: the one place to act before sharding without a line in every script.
    def set_auto_wrap_policy(model):
        _refuse_containers_by_size(plugin, model)
        _distinct_addresses(model)
        _answer_input_embeddings(model)
        _one_module_for_the_input_embeddings(model)
        if plugin.activation_checkpointing:  # transformers' checkpointing instead of Accelerate's wrapper
            checkpoint_for_fsdp(model, offload=plugin.activation_checkpointing_offload)
            plugin.activation_checkpointing = plugin.activation_checkpointing_offload = False
        if plugin.cpu_ram_efficient_loading and persistent_buffers(model):
            logger.info(
                "FSDP2: this model has persistent buffers (BatchNorm statistics), which Accelerate's RAM-efficient "
                "loading cannot send: every rank read the weights"
            )
            plugin.cpu_ram_efficient_loading = False
        names = plugin.transformer_cls_names_to_wrap
        if names is None:  # the model's own list, which may name classes it does not hold
            names = sorted(set(getattr(model, "_no_split_modules", None) or []) & classes_in(model))
            plugin.transformer_cls_names_to_wrap = names
        holders = classes_holding_input_embeddings(model)
        if names and holders & set(names):
            logger.info(
                f"FSDP2: {', '.join(sorted(holders & set(names)))} not sharded as a unit: it holds the input "
                "embeddings, which Accelerate shards on their own"
            )
            plugin.transformer_cls_names_to_wrap = [name for name in names if name not in holders]
        set_policy(model)

    plugin.set_auto_wrap_policy = set_auto_wrap_policy


def root_ready_for_generation(model) -> None:
    """All ranks call this (an all-gather under FSDP2), before `generate` on `model`; elsewhere it does nothing.
    `generate` enters the model below FSDP2's root (peft's and transformers' `generate` call the inner model), so
    the root's own parameters (a final norm) were never gathered: where nothing had run through the root before
    (a Bamba, Jamba or Qwen 3.5 run whose first pass is the zero-shot generation), generation failed ("aten.mul.Tensor
    got mixed torch.Tensor and DTensor"). The root is initialised as FSDP2's root and its parameters gathered; its
    next forward pass finds them so, as FSDP2 leaves a root's after its forward."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule):
        model._get_fsdp_state()._lazy_init()  # as the root's first forward pass would (torch 2.13, pinned)
        model.unshard()


def classes_in(model) -> set[str]:
    """The class names of `model`'s modules."""
    return {type(module).__name__ for module in model.modules()}


def classes_holding_input_embeddings(model) -> set[str]:
    """The class names of the modules above the model's input embeddings (not the model itself)."""
    try:
        embeddings = model.get_input_embeddings()
    except (AttributeError, NotImplementedError):  # models without token embeddings (vision)
        return set()
    if embeddings is None:
        return set()
    holders = set()
    for name, module in model.named_modules():
        if name and module is not embeddings and any(child is embeddings for child in module.modules()):
            holders.add(type(module).__name__)
    return holders


def _refuse_containers_by_size(plugin, model) -> None:
    """Under SIZE_BASED_WRAP, Accelerate's policy picks every module over `fsdp_min_num_params` parameters: a
    ModuleList holding the layers too, which torch's fully_shard refuses (it has no forward), in a traceback inside
    `prepare`. Refused in one line instead, with the fix."""
    from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy

    if plugin.auto_wrap_policy is not size_based_auto_wrap_policy or plugin.min_num_params <= 0:
        return  # Accelerate takes a minimum of 0 as no wrapping
    for name, module in model.named_modules():
        size = sum(parameter.numel() for parameter in module.parameters())
        if name and type(module).forward is torch.nn.Module.forward and size > plugin.min_num_params:
            raise UsageError(
                f"the launch config's fsdp_auto_wrap_policy SIZE_BASED_WRAP picks {name} ({type(module).__name__}, "
                f"{size:,} parameters), which FSDP2 cannot shard as a unit; use TRANSFORMER_BASED_WRAP, as "
                f"accelerate_configs/fsdp.yaml does, or raise fsdp_min_num_params above {size}"
            )


def _answer_input_embeddings(model) -> None:
    """Accelerate asks every model for its input embeddings while sharding it; a model without any
    (ResNet: "get_input_embeddings not auto-handled") raises instead of answering None."""
    try:
        model.get_input_embeddings()
    except NotImplementedError:
        model.get_input_embeddings = lambda: None


def _one_module_for_the_input_embeddings(model) -> None:
    """Make each module that holds the input embeddings' weight under another name the input embeddings' module itself,
    as transformers 4 had them. Transformers 5 gives T5's and BART's encoder and decoder `embed_tokens` modules of
    their own, tied to `shared` by the weight; Accelerate shards the input embeddings as a unit of their own, and torch
    then refused the weight the root saw too ("Parameter 'transformer.shared.weight' is shared with a parameter already
    managed by another FSDP group"): T5 and BART classifiers stopped in `prepare`. One module, called by the encoder
    and the decoder, computes the same; a tied LM head is left to Accelerate, which groups it with the embeddings."""
    try:
        embeddings = model.get_input_embeddings()
    except (AttributeError, NotImplementedError):
        return
    weight = getattr(embeddings, "weight", None)
    if weight is None:
        return
    head = getattr(model, "get_output_embeddings", lambda: None)()
    scale = getattr(embeddings, "embed_scale", None)
    for name, module in list(model.named_modules()):
        same = type(module) is type(embeddings) and getattr(module, "weight", None) is weight
        same = same and module.extra_repr() == embeddings.extra_repr()  # size, padding index
        if name and module is not embeddings and module is not head and same and _equal(module, scale):
            owner, _, attribute = name.rpartition(".")
            setattr(model.get_submodule(owner), attribute, embeddings)


def _equal(module, scale) -> bool:
    """Whether `module` scales its embeddings as `scale` (BART's `embed_scale`, a float; Gemma's, a tensor) says."""
    own = getattr(module, "embed_scale", None)
    if isinstance(own, torch.Tensor) or isinstance(scale, torch.Tensor):
        return isinstance(own, torch.Tensor) and isinstance(scale, torch.Tensor) and torch.equal(own, scale)
    return own == scale


def _distinct_addresses(model) -> None:
    """Give each meta-device parameter of `model` an address of its own, as Accelerate reads it (it
    sets `data_ptr` on tensors the same way) to map the optimizer's parameters onto the sharded ones:
    a meta tensor's is 0 for all. The parameters are replaced by the sharded ones right after."""
    for parameter in model.parameters():
        if parameter.is_meta:
            parameter.data_ptr = lambda unique=id(parameter): unique


def ram_efficient_loading() -> bool:
    """Whether the launch asks for FSDP with `fsdp_cpu_ram_efficient_loading` (only rank 0 reads
    the weights; Accelerate sends them to the others while sharding)."""

    def flag(name):
        return os.environ.get(name, "false").lower() in ("1", "true")

    return flag("ACCELERATE_USE_FSDP") and flag("FSDP_CPU_RAM_EFFICIENT_LOADING")


def load_pretrained(model_class, model_name_or_path: str, **kwargs):
    """All ranks call this (it broadcasts once under FSDP's RAM-efficient loading, and under ZeRO-3 when
    `ignore_mismatched_sizes` is asked): the model of `model_class.from_pretrained(model_name_or_path, **kwargs)`.

    Under `fsdp_cpu_ram_efficient_loading`, only the main process reads the weights: the other
    ranks build the model from the main process's config with empty (meta) weights in its dtypes,
    and receive the weights while Accelerate shards the model in `prepare`. Each rank then holds
    one copy's worth of CPU memory in all, not one copy each. Elsewhere, every rank loads it; so
    does every rank of a model with persistent buffers (BatchNorm's statistics), which Accelerate
    1.15 cannot send (see `fix_fsdp2_preparation`). Under DeepSpeed ZeRO-3 a checkpoint with a head of
    another shape is loaded whole (`zero3_loading.loading_context`), and the model keeps only the key
    renamings its loading applied (`keep_used_weight_conversions`), for `save_pretrained`."""
    state = PartialState()
    if not ram_efficient_loading() or state.num_processes == 1:  # DDP, DeepSpeed (ZeRO-3: inside zero.Init)
        with loading_context(model_class, model_name_or_path, kwargs):  # ZeRO-3 with a head of another shape
            return keep_used_weight_conversions(_loaded(model_class, model_name_or_path, kwargs))
    from accelerate import init_empty_weights
    from accelerate.utils import broadcast_object_list

    main = [None]
    if state.is_main_process:
        model = _loaded(model_class, model_name_or_path, kwargs)
        dtypes = {name: value.dtype for name, value in model.state_dict().items()}
        main = [
            {"dtypes": dtypes, "config": model.config.to_dict(), "every_rank_reads": bool(persistent_buffers(model)),
             "shared": shared_weights(model), "new": model.weights_not_in_checkpoint}
        ]  # fmt: skip
    broadcast_object_list(main, from_process=0)  # the broadcast of the weights needs the same dtypes everywhere
    if state.is_main_process:
        return model
    if main[0]["every_rank_reads"]:
        with _environment(FSDP_CPU_RAM_EFFICIENT_LOADING="false"):  # else transformers leaves a new head on meta
            return _loaded(model_class, model_name_or_path, kwargs)
    config = kwargs.get("config")
    if config is None:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(model_name_or_path, trust_remote_code=kwargs.get("trust_remote_code"))
    config = type(config).from_dict(main[0]["config"])  # as the main process's loading left it (a new head's labels)
    with init_empty_weights(include_buffers=False):  # buffers computed as usual (rotary frequencies, ...)
        model = build_from_config(model_class, config, kwargs)
    share_as(model, main[0]["shared"])  # init_empty_weights gave a tied LM head a meta weight of its own
    dtypes = main[0]["dtypes"]
    for name, value in model.state_dict(keep_vars=True).items():
        if name in dtypes and value.dtype != dtypes[name]:
            value.data = value.data.to(dtypes[name])
    model.weights_not_in_checkpoint = main[0]["new"]
    return model


def _loaded(model_class, model_name_or_path: str, kwargs: dict):
    """`model_class.from_pretrained`, the model remembering which of its weights the checkpoint did not hold (a new
    head; a pooler a masked LM's checkpoint lacks) or held in another shape, drawn at random at loading: LoRA trains
    them whole (`classifier_lora`), or the saved adapter would lack them. No communication."""
    model, info = model_class.from_pretrained(model_name_or_path, output_loading_info=True, **kwargs)
    mismatched = {key if isinstance(key, str) else key[0] for key in info.get("mismatched_keys", ())}
    model.weights_not_in_checkpoint = sorted({*info.get("missing_keys", ()), *mismatched})
    return model


def share_as(model, shared: dict[str, str]) -> None:
    """Make `model`'s parameters shared as `shared` (`shared_weights` of the main process's model) says, and no
    others: there, transformers ties the LM head to the input embeddings unless the checkpoint holds a head of its
    own, and the ranks must hold the same parameters for Accelerate to map and send them. No communication."""
    here = shared_weights(model)
    for name in [name for name in here if name not in shared] + list(shared):
        owner, _, attribute = name.rpartition(".")
        if name in shared:
            weight = model.get_parameter(shared[name])
        else:  # shared here, not there: a weight of its own
            held = model.get_parameter(name)
            weight = torch.nn.Parameter(torch.empty_like(held), requires_grad=held.requires_grad)
        setattr(model.get_submodule(owner), attribute, weight)


def persistent_buffers(model) -> list[str]:
    """The names of the buffers that `model.state_dict()` holds (BatchNorm's running statistics)."""
    saved = set(model.state_dict())
    return [name for name, _ in model.named_buffers() if name in saved]


@contextlib.contextmanager
def _environment(**values):
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
