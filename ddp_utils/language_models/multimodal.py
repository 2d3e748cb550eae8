"""A checkpoint that also reads images or audio, fine-tuned on text: Gemma 3 (4B and up), Gemma 4 and
Phi-4-multimodal, which transformers loads whole as causal LMs, and the models it loads whole only as image-and-text
ones (Llama 4, Llama 3.2 Vision, Qwen 3.5, Mistral Small 3.x, Qwen2.5-VL, ...). Text never runs their vision or audio
towers and projectors: they stay as loaded, frozen, with no LoRA adapter, and are saved with the rest and the image
processor, so the result still reads images. Which Auto class loads such a checkpoint whole:
`training.pretrained.causal_lm_class`.

Before, Gemma 3's 4B checkpoint stopped at `add_lora` (its config has no `num_hidden_layers` at the top), LoRA's
`all-linear` put adapters on the vision tower, which never trained and under DDP stopped the run at its second
step, waiting for their gradients, and Mistral 3 and Qwen-VL checkpoints were refused with a list of 200 classes."""

from __future__ import annotations

from accelerate.logging import get_logger

from ..core.sharded import weight_count

logger = get_logger(__name__)


def text_config(config):
    """The configuration of the language model inside `config`'s (its `text_config`), or `config` itself."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _text_parameters(model) -> set[int]:
    """The ids of the parameters that text runs: the decoder's, the input embeddings' and the LM head's, except
    the towers inside the decoder (`_towers_inside_the_decoder`)."""
    decoder = (model.get_decoder() if hasattr(model, "get_decoder") else model) or model
    parts = (decoder, model.get_input_embeddings(), model.get_output_embeddings())
    text = {id(p) for part in parts if part is not None for p in part.parameters()}
    return text - _towers_inside_the_decoder(decoder, model.config)


def _towers_inside_the_decoder(decoder, config) -> set[int]:
    """The ids of the parameters of the decoder's children that hold a vision or audio tower (a module built from
    `config`'s vision or audio config) and neither the input embeddings nor a decoder layer: Phi-4-multimodal's
    `embed_tokens_extend`, its towers and their projections, which run only beside an image or a sound (it reads
    them through LoRA adapters of its repository, too, which a fine-tune's output does not hold)."""
    towers = {id(c) for c in (getattr(config, "vision_config", None), getattr(config, "audio_config", None)) if c}
    embeddings = decoder.get_input_embeddings() if hasattr(decoder, "get_input_embeddings") else None
    text = {
        id(p) for part in (embeddings, getattr(decoder, "layers", None)) if part is not None for p in part.parameters()
    }
    found = set()
    for child in decoder.children():
        held = {id(p) for p in child.parameters()}
        if not held & text and any(id(getattr(module, "config", None)) in towers for module in child.modules()):
            found |= held
    return found


# Decoder layers that text never runs, inside the decoder: Llama 3.2 Vision's (Mllama) cross-attention layers, and
# IDEFICS's gated ones, attend to the image and are skipped without one.
IMAGE_ONLY_LAYERS = frozenset({"MllamaCrossAttentionDecoderLayer", "IdeficsGatedCrossAttentionLayer"})


def reads_images_or_audio(config) -> bool:
    """Whether `config` describes a model with a vision or audio tower (a `vision_config` or `audio_config`)."""
    return any(getattr(config, name, None) is not None for name in ("vision_config", "audio_config"))


def parts_text_never_runs(model) -> list[str]:
    """The names of the largest modules and parameters of a model that also reads images or audio that text never
    runs: its vision and audio towers and their projectors (none of their parameters is the decoder's, the input
    embeddings' or the LM head's), and the decoder layers that only an image runs (`IMAGE_ONLY_LAYERS`). Empty for a
    model whose config names no vision or audio tower. No communication."""
    if not reads_images_or_audio(getattr(model, "config", None)):
        return []
    text, parts = _text_parameters(model), []

    def visit(prefix: str, module) -> None:
        for name, p in module.named_parameters(prefix=prefix.rstrip("."), recurse=False):
            if id(p) not in text:
                parts.append(name)
        for name, child in module.named_children():
            held = [id(p) for p in child.parameters()]
            if held and not any(p in text for p in held):
                parts.append(prefix + name)
            elif any(p not in text for p in held):  # some of both: look inside
                visit(f"{prefix}{name}.", child)

    visit("", model)
    for name, module in model.named_modules():  # Mllama's: run only beside an image
        if type(module).__name__ in IMAGE_ONLY_LAYERS and not any(name.startswith(f"{part}.") for part in parts):
            parts.append(name)
    return parts


def freeze_parts_text_never_runs(model) -> list[str]:
    """Freeze what text never runs in `model` (`parts_text_never_runs`), logged by name: under DDP a parameter
    that takes no gradient stopped the run at its second step, and the optimizer would hold a state for each.
    Returns the parts' names. Every rank calls it on its own model; no communication."""
    parts = parts_text_never_runs(model)
    if not parts:
        return parts
    frozen, parameters = 0, dict(model.named_parameters())
    for name in parts:
        held = [parameters[name]] if name in parameters else model.get_submodule(name).parameters()
        for p in held:
            p.requires_grad_(False)
            frozen += weight_count(p)  # ZeRO-3: partitioned; QLoRA: packed
    logger.info(
        f"{type(model).__name__} also reads images or audio: text never runs {parts}, kept as loaded and frozen "
        f"({frozen:,} parameters) and saved with the model"
    )
    return parts


def image_processors(model, args) -> tuple:
    """(the processor that prepares images for the checkpoint the run started from,) to save beside the model
    so that it still reads images, where `model` also reads them and the checkpoint has one (AutoProcessor);
    else (). Saved before the tokenizer, which then overwrites the tokenizer's files with the run's own (its pad
    token). An image classifier's own processor is the script's to save: (). The main process calls it; no
    communication."""
    if getattr(model, "main_input_name", "") == "pixel_values" or not parts_text_never_runs(model):
        return ()
    from transformers import AutoProcessor, PreTrainedTokenizerBase

    source = getattr(args, "source_model", None) or args.model_name_or_path
    try:
        processor = AutoProcessor.from_pretrained(source, trust_remote_code=getattr(args, "trust_remote_code", False))
    except Exception as exc:  # a checkpoint with no processor; the model is saved all the same
        logger.warning(f"no image processor saved with the model ({str(exc).splitlines()[0][:160]})")
        return ()
    return () if isinstance(processor, PreTrainedTokenizerBase) else (processor,)
