"""The model card: README.md in the output directory, as the Hub shows it, with the metadata it
reads (base model, library, datasets, tags, language, task) and what a reader of the model wants:
the task, the data, the hyper-parameters, the hardware, the scores (and the zero-shot ones where
the run measured them) and how to load it. It does not replace report/, which has the curves."""

from __future__ import annotations

import json
import os
from fnmatch import fnmatch

from ..core.redact import loggable_args
from .hub import PREDICTIONS, hub_repo_id

# What the saved model is, from its own files: config.json's architecture, or a LoRA adapter.
_TASKS = {
    "ForSequenceClassification": "text-classification",
    "ForImageClassification": "image-classification",
    "ForCausalLM": "text-generation",
    "ForConditionalGeneration": "image-text-to-text",  # a model that also reads images, trained on text (Gemma 3)
}
_HYPER_PARAMETERS = (
    "learning_rate",
    "lr_scheduler_type",
    "warmup_ratio",
    "warmup_steps",
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "global_batch_size",
    "weight_decay",
    "max_grad_norm",
    "seed",
    "max_length",
    "block_size",
    "lora_r",
    "load_in_4bit",
    "lora_alpha",
    "lora_dropout",
    "lora_target_modules",
    "packing",
    "loss_on",
    "loss_type",
    "beta",
    "sft_weight",
    "num_generations",
    "max_completion_length",
    "temperature",
    "top_p",
    "epsilon",
    "epsilon_high",
    "num_iterations",
)


def saved_task(output_dir: str, base_architecture: str | None = None) -> tuple[str | None, bool]:
    """(the pipeline task of the model saved in `output_dir`, whether it is a LoRA adapter): from its config's
    architecture, or for an adapter its base's (`base_architecture`; text generation if unknown). A model that
    also reads images is an image-and-text one where its image processor was saved with it: its pipeline needs
    it, and the checkpoint may not have had one."""
    adapter = os.path.isfile(os.path.join(output_dir, "adapter_config.json"))
    architecture = base_architecture or ""
    if not adapter or os.path.isfile(os.path.join(output_dir, "config.json")):  # a classifier's adapter has its own
        try:
            with open(os.path.join(output_dir, "config.json")) as handle:
                architecture = (json.load(handle).get("architectures") or [""])[0]
        except (OSError, ValueError):
            return None, False
    # `in`: DeiT's and LeViT's distilled classifiers are ...ForImageClassificationWithTeacher
    task = next((task for kind, task in _TASKS.items() if kind in architecture), None)
    reads_images = any(
        os.path.isfile(os.path.join(output_dir, name)) for name in ("processor_config.json", "preprocessor_config.json")
    )
    if (task == "image-text-to-text" and not reads_images) or (adapter and task is None):
        task = "text-generation"
    return task, adapter


def _is_hub_id(name: str | None) -> bool:
    return bool(name) and not os.path.exists(os.path.expanduser(name)) and name.count("/") == 1


def base_model(args) -> tuple[str | None, str | None]:
    """(the Hub id of the model the run started from, or None; how the card names it, or None for a
    model trained from scratch). A demo's packaged model is named by its Hub id, not by the path
    of the package that ships it; a local directory by its path, with no id."""
    from ..data.demo import demo_hub_id

    if getattr(args, "demo_model", False) or args.model_name_or_path is None:  # built from a config: no weights
        return None, None
    source = getattr(args, "source_model", None) or args.model_name_or_path  # a GGUF file's directory, not its copy
    hub_id = demo_hub_id(source, getattr(args, "gguf_file", None)) or (source if _is_hub_id(source) else None)
    return hub_id, hub_id or source


def write_model_card(args, metrics: dict) -> str:
    """Write <output_dir>/README.md, the model card of the saved model, from the run's options
    (secrets redacted) and its `metrics`; returns its path. The main process calls it, after
    the model is saved."""
    from huggingface_hub import ModelCard, ModelCardData

    output_dir = args.output_dir
    is_adapter = os.path.isfile(os.path.join(output_dir, "adapter_config.json"))
    base_config = _base_config(args) if is_adapter else None  # what loads an adapter's base, and what it is
    task, adapter = saved_task(output_dir, (getattr(base_config, "architectures", None) or [None])[0])
    hub_id, base = base_model(args)
    dataset = getattr(args, "dataset_name", None)
    data = ModelCardData(
        base_model=hub_id,
        library_name="peft" if adapter else "transformers",
        datasets=[dataset] if dataset else None,
        language=args.language,
        pipeline_tag=task,
        tags=[
            "ddp-finetune",
            *(["lora"] if adapter else []),
            *(["qlora"] if getattr(args, "load_in_4bit", False) else []),
            *([task] if task else []),
        ],
    )
    repo = hub_repo_id(args)
    remote_code = bool(getattr(args, "trust_remote_code", False))  # the run needed it: so does loading the model
    options = loggable_args(args)
    hyper = [f"| `{name}` | {options[name]} |" for name in _HYPER_PARAMETERS if options.get(name) not in (None, False)]
    scores = [
        f"| {name.removeprefix('eval_')} | {_value(value)} |"
        for name, value in metrics.items()
        if name.startswith("eval_") and isinstance(value, (int, float))
    ]
    zero_shot = [
        f"| {name.removeprefix('zero_shot_')} | {_value(value)} |"
        for name, value in metrics.items()
        if name.startswith(("zero_shot_", "before_training_")) and isinstance(value, (int, float))
    ]
    source = f"`{base}`" + (f" (GGUF file `{args.gguf_file}`, dequantized)" if getattr(args, "gguf_file", None) else "")
    made = "A LoRA adapter for" if adapter else "A fine-tune of"
    origin = f"{made} {source}" if base else "A model trained from scratch (its weights drawn at random)"
    data_source = (
        getattr(args, "train_file", None) or getattr(args, "train_dir", None) or dataset or "the offline demo data"
    )
    lines = [
        f"# {repo}",
        "",
        f"{origin}, trained with `{os.path.basename(_script())}` of ddp-finetune for {task or 'its task'}.",
        "",
        "## Training",
        "",
        f"- Data: `{data_source}`"
        + (f" ({args.dataset_config_name})" if getattr(args, "dataset_config_name", None) else "")
        + f"; {metrics.get('train_samples_seen', 0):,} examples seen in "
        f"{metrics.get('optimizer_steps', 0)} optimizer steps, {metrics.get('epochs_trained', 0):g} epoch(s).",
        f"- Hardware: {metrics.get('world_size', '?')} process(es), {metrics.get('distributed_type', '?')}, mixed "
        f"precision {metrics.get('mixed_precision', '?')}; {metrics.get('train_runtime_s', 0):.0f} s of training.",
        *(
            [f"- Rewards (GRPO): {', '.join(f'`{name}` x {weight:g}' for name, weight in metrics['rewards'].items())}."]
            if isinstance(metrics.get("rewards"), dict)
            else []
        ),
        "",
        "| hyper-parameter | value |",
        "|---|---|",
        *hyper,
    ]
    if scores:
        lines += ["", "## Evaluation", "", "| metric | value |", "|---|---|", *scores]
    if zero_shot:
        lines += ["", "Before training (the same evaluation):", "", "| metric | value |", "|---|---|", *zero_shot]
    if metrics.get("best_checkpoint"):
        lines += [
            "",
            f"The best checkpoint by `{metrics['metric_for_best_model']}` "
            f"({_value(metrics['best_metric'])}) was `{os.path.basename(metrics['best_checkpoint'])}`.",
        ]
    predictions = sorted(name for name in os.listdir(output_dir) if fnmatch(name, PREDICTIONS))
    if predictions:
        shared = (
            "--push_predictions uploads them with the model"
            if getattr(args, "push_predictions", False)
            else "--push_to_hub leaves them out, unless --push_predictions"
        )
        lines += [
            "",
            f"The answers to the validation prompts ({', '.join(f'`{name}`' for name in predictions)}: each prompt "
            f"with its reference answer) hold the validation data: {shared}.",
        ]
    lines += [
        "",
        "## How to load it",
        "",
        "```python",
        *_how_to_load(
            task, adapter, repo, _adapter_base_class(task, base_config) if adapter else None, base, remote_code
        ),
        "```",
        "",
        "Curves, throughput and memory: `report/README.md`. Every option of the run: `training_args.json`.",
        "",
    ]
    card = ModelCard(f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(lines))  # the metadata block the Hub reads
    path = os.path.join(output_dir, "README.md")
    with open(path, "w") as handle:
        handle.write(str(card))
    return path


def _base_config(args):
    """The configuration of the run's base model, or None where it cannot be read (a model built from a config)."""
    from ..training.pretrained import load_model_config

    source = getattr(args, "source_model", None) or args.model_name_or_path
    try:
        return load_model_config(source, getattr(args, "trust_remote_code", False)) if source else None
    except Exception:  # a card is written after a finished run: it says less rather than fail
        return None


def _base_auto_class(base_config) -> str:
    """The transformers Auto class that loads the run's base model whole (`causal_lm_class`)."""
    from ..training.pretrained import causal_lm_class

    try:
        return causal_lm_class(base_config).__name__ if base_config is not None else "AutoModelForCausalLM"
    except Exception:  # a card is written after a finished run: it names the usual class rather than fail
        return "AutoModelForCausalLM"


CLASSIFIER_CLASSES = {"text-classification": "AutoModelForSequenceClassification",
                      "image-classification": "AutoModelForImageClassification"}  # fmt: skip


def _adapter_base_class(task: str | None, base_config) -> str:
    """The transformers Auto class that loads an adapter's base: a classifier's, or the causal LM's."""
    return CLASSIFIER_CLASSES.get(task) or _base_auto_class(base_config)


def _how_to_load(
    task: str | None, adapter: bool, repo: str, base_class: str | None, base: str | None, remote_code: bool
) -> list[str]:
    """The card's code that loads the saved model: a pipeline, or the base and the adapter; with the model's own
    code where the run needed it (--trust_remote_code)."""
    remote = ", trust_remote_code=True" if remote_code else ""
    if adapter and base and base_class in CLASSIFIER_CLASSES.values():  # the labels: the adapter's config
        inputs = "AutoTokenizer" if base_class == "AutoModelForSequenceClassification" else "AutoImageProcessor"
        name = "tokenizer" if inputs == "AutoTokenizer" else "image_processor"
        return [
            "from peft import PeftModel",
            f"from transformers import AutoConfig, {base_class}, {inputs}",
            "",
            f'config = AutoConfig.from_pretrained("{repo}"{remote})  # the labels, which the base model lacks',
            f'base = {base_class}.from_pretrained("{base}", config=config, ignore_mismatched_sizes=True{remote})',
            f'model = PeftModel.from_pretrained(base, "{repo}")',
            f'{name} = {inputs}.from_pretrained("{repo}"{remote})',
        ]
    if adapter and base and base_class not in (None, "AutoModelForCausalLM"):  # peft's Auto class: causal LMs only
        return [
            "from peft import PeftModel",
            f"from transformers import {base_class}, AutoTokenizer",
            "",
            f'base = {base_class}.from_pretrained("{base}"{remote})',
            f'model = PeftModel.from_pretrained(base, "{repo}")',
            f'tokenizer = AutoTokenizer.from_pretrained("{repo}"{remote})',
        ]
    if adapter:
        return [
            "from peft import AutoPeftModelForCausalLM",
            "from transformers import AutoTokenizer",
            "",
            f'model = AutoPeftModelForCausalLM.from_pretrained("{repo}"{remote})  # the base model, then this adapter',
            f'tokenizer = AutoTokenizer.from_pretrained("{repo}"{remote})',
        ]
    return [
        "from transformers import pipeline",
        "",
        f'model = pipeline("{task or "text-classification"}", model="{repo}"{remote})',
    ]


def _value(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _script() -> str:
    import sys

    return sys.argv[0] or "a ddp-finetune script"
