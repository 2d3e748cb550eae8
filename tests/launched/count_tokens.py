"""Launched by the tests: which training rows (token ids and labels) each rank draws in two
epochs of a causal-LM script's data path (scripts/train_clm.py or train_sft.py): its own data
loading, tokenizing, blocks or packing, collator, and ddp_utils' dataloader and step plan.

usage: count_tokens.py SCRIPT OUT.json [script arguments]     (SCRIPT: train_clm or train_sft)
"""

import importlib.util
import json
import sys
from pathlib import Path

from accelerate.utils import gather_object

import ddp_utils
from ddp_utils.language_models.causal_lm import TARGET_TOKENS, CausalLMCollator
from ddp_utils.language_models.sft_formats import detect_format
from ddp_utils.lifecycle.start import make_accelerator


def main():
    name, out = sys.argv[1], sys.argv[2]
    spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parents[2] / "scripts" / f"{name}.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    args = script.parse_args(sys.argv[3:])
    accelerator = make_accelerator(seed=args.seed, gradient_accumulation_steps=args.gradient_accumulation_steps)
    tokenized, tokenizer, _, report, *_ = ddp_utils.load_on_main_first(accelerator, script.prepare_data, args)
    loader = ddp_utils.make_train_dataloader(
        tokenized["train"], args, accelerator, CausalLMCollator(tokenizer.pad_token_id)
    )
    plan = ddp_utils.StepPlan(accelerator, args, loader, unit="target_tokens")
    loader = accelerator.prepare(loader)
    epochs = []
    for epoch in range(2):
        rows = []
        for micro_batches in plan.optimizer_steps(loader, epoch):
            ddp_utils.count_step(
                accelerator, micro_batches, TARGET_TOKENS
            )  # as the script does: every rank, every step
            for batch in micro_batches:
                for i in range(len(batch["input_ids"])):
                    if batch[TARGET_TOKENS][i] > 0:  # a real row, not a filler that evens out the shards
                        rows.append(
                            {"input_ids": batch["input_ids"][i].tolist(), "labels": batch["labels"][i].tolist()}
                        )
        epochs.append(gather_object([rows]))
    # The same split, to compare against.
    raw = script.load_raw_datasets(args)
    text = name == "train_clm"
    columns = {args.text_column: ""} if text else detect_format(raw, args)[1]
    raw = ddp_utils.check_splits(
        raw,
        columns,
        "",
        hold_out_percentage=args.validation_split_percentage,
        seed=args.seed,
        blank="drop" if text else "refuse",
    )
    if accelerator.is_main_process:
        record = {"epochs": epochs, "report": report}
        if text:
            record["train_text"] = list(raw["train"][args.text_column])
        else:
            record["train_records"] = [
                {"prompt": r[args.prompt_column], "completion": r[args.completion_column]} for r in raw["train"]
            ]
        Path(out).write_text(json.dumps(record))
    accelerator.end_training()


if __name__ == "__main__":
    ddp_utils.run(main)
