"""The model options of the scripts that train a pretrained model: LoRA and QLoRA, gradient checkpointing, and the
causal-LM scripts' own (the GGUF source, the block size, compilation), with their checks. Every rank parses; no
communication."""

from __future__ import annotations

import argparse

from ..core.errors import UsageError
from .args import check_schedule, json_object


def add_lora_args(p, text: bool = True) -> None:
    """Add the LoRA and QLoRA options (train.py's, train_image.py's and the causal-LM scripts') to `p`, a parser or a
    group. Without `text` (images): no --load_in_4bit and no --lora_last_layers, which only text models have here."""
    p.add_argument("--lora_r", type=int, default=0, help="LoRA rank; 0 trains all weights")
    if text:
        p.add_argument("--load_in_4bit", action="store_true", help="QLoRA: the base model in 4-bit NF4 (bitsandbytes)")
    p.add_argument(
        "--lora_alpha", type=float, default=16, help="LoRA scaling numerator (the update is scaled by alpha / r)"
    )
    p.add_argument(
        "--lora_dropout", type=float, help="dropout on the LoRA input (default 0.05; 0 on fused MoE experts)"
    )
    p.add_argument(
        "--lora_target_modules", default="all-linear", help="comma-separated module names to adapt, or 'all-linear'"
    )
    if text:
        p.add_argument(
            "--lora_last_layers",
            type=int,
            default=0,
            help="adapt only the last N layers (of each stack: BART's, T5's): the backward stops below them (0: all)",
        )
    else:
        p.set_defaults(load_in_4bit=False, lora_last_layers=0)
    p.add_argument(
        "--merge_lora", action="store_true", help="also save the LoRA-merged full model in output_dir/merged"
    )


def add_gradient_checkpointing_arg(p) -> None:
    """Add --gradient_checkpointing (training.activation_checkpointing.checkpoint_if_asked) to `p`."""
    p.add_argument("--gradient_checkpointing", action="store_true", help="recompute activations: less memory, slower")


def check_lora_options(args) -> None:
    """Refuse LoRA and QLoRA option values that cannot work together, naming the option. Every rank calls it while
    parsing; no communication."""
    from ..language_models.lora import check_lora_args
    from ..language_models.quantized import check_4bit_args

    check_lora_args(args)
    check_4bit_args(args)


def add_causal_lm_args(parser: argparse.ArgumentParser) -> None:
    """Add the model options of the causal-LM scripts (train_sft.py, train_clm.py) to `parser`:
    the GGUF source, the block size, LoRA, gradient checkpointing and compilation."""
    p = parser.add_argument_group("causal language model")
    p.add_argument(
        "--gguf_file", default=None, help="a GGUF file in --model_name_or_path to fine-tune (dequantized once, cached)"
    )
    p.add_argument(
        "--gguf_cache_dir",
        default=None,
        help="where dequantized GGUF models are kept (default: <HF_HOME>/dequantized-gguf)",
    )
    p.add_argument(
        "--block_size",
        type=int,
        default=None,
        help="tokens per sequence (default: the model's context, at most 1024; GRPO's prompt and answer: all of it)",
    )
    p.add_argument(
        "--chat_template_kwargs",
        default=None,
        help="JSON keyword arguments of the chat template, e.g. '{\"enable_thinking\": false}' for Qwen3",
    )
    add_lora_args(p)
    add_gradient_checkpointing_arg(p)
    p.add_argument("--torch_compile", action="store_true", help="compile the model with torch.compile (inductor)")


def check_causal_lm_args(args) -> None:
    """Refuse causal-LM option values that cannot work, naming the option; set the default learning
    rate (2e-4 with LoRA, 2e-5 for full fine-tuning). Every rank calls it while parsing."""
    if args.block_size is not None and args.block_size < 2:  # train_clm.py trained on nothing and reported a loss of 0
        raise UsageError(
            f"--block_size must be at least 2 (a block of N tokens learns N - 1 next ones), got {args.block_size}"
        )
    check_lora_options(args)
    if args.chat_template_kwargs is not None:
        example = '{"enable_thinking": false}'
        args.chat_template_kwargs = json_object(args.chat_template_kwargs, "--chat_template_kwargs", example)
    if args.learning_rate is None:
        args.learning_rate = 2e-4 if args.lora_r else 2e-5
    check_schedule(args)  # again, against the rate now known (polynomial's lr_end)
