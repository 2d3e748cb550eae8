"""Options that other trainers name otherwise (TRL, transformers.Trainer, axolotl), answered with ours in the one line
that refuses them. No communication."""

from __future__ import annotations

import argparse

# Their names: ours for the same thing (the first of these the script has), or where that setting lives here. The
# scripts take no abbreviation (`add_training_args`), so a name that begins one of ours is answered here too.
OTHER_NAMES = {
    **dict.fromkeys(
        ("--max_seq_length", "--max_length", "--sequence_len", "--seq_len"), ("--block_size", "--max_length")
    ),
    "--lr": ("--learning_rate",),
    **dict.fromkeys(("--num_epochs", "--epochs"), ("--num_train_epochs",)),
    **dict.fromkeys(("--batch_size", "--micro_batch_size", "--train_batch_size"), ("--per_device_train_batch_size",)),
    "--eval_batch_size": ("--per_device_eval_batch_size",),
    "--max_steps": ("--max_train_steps",),
    "--save_steps": ("--checkpointing_steps",),
    **dict.fromkeys(("--evaluation_strategy", "--eval_strategy"), "every epoch ends with an evaluation; --eval_steps N "
                    "adds one every N optimizer steps"),
    "--lora_rank": ("--lora_r",),
    "--model": ("--model_name_or_path",),
    "--compile": ("--torch_compile",),
    "--gradient_accumulation": ("--gradient_accumulation_steps",),
    "--dataset_text_field": ("--text_column",),
    "--base_model": ("--model_name_or_path",),
    **dict.fromkeys(("--bf16", "--fp16", "--mixed_precision"), "mixed precision is the launch config's: accelerate "
                    "launch --mixed_precision bf16, or accelerate config"),
    **dict.fromkeys(("--deepspeed", "--fsdp"), "sharding is the launch config's: accelerate launch --config_file "
                    "accelerate_configs/<one of them>.yaml"),
    "--local_rank": "accelerate launch starts the processes: leave it out",
}  # fmt: skip


def option_hint(parser: argparse.ArgumentParser, message: str) -> str:
    """For argparse's `message` about options it does not know: " (...)" naming ours for each that another trainer
    names so, or that is ours spelled with dashes; "" for the others."""
    if not message.startswith("unrecognized arguments:"):
        return ""
    given = [word for word in message.split(":", 1)[1].split() if word.startswith("--")]
    ours, hints = parser._option_string_actions, []  # every option string the script takes
    for name in (word.split("=", 1)[0] for word in given):
        underscored = "--" + name[2:].replace("-", "_")
        other = OTHER_NAMES.get(name) or OTHER_NAMES.get(underscored)
        if isinstance(other, str):
            hints.append(f"{name}: {other}")
        elif other and any(option in ours for option in other):
            hints.append(f"{name} is {next(option for option in other if option in ours)} here")
        elif underscored in ours:
            hints.append(f"{name} is {underscored} here")
    return f" ({'; '.join(hints)})" if hints else ""
