"""Launched by the tests: which training rows (token ids and labels) each rank draws in two
epochs of scripts/train_clm.py's data path: its own data loading, tokenizing, blocks or packing,
collator, and ddp_utils' dataloader and step plan.

usage: count_tokens.py OUT.json [train_clm.py arguments]
"""

import importlib.util
import json
import sys
from pathlib import Path

from accelerate.utils import gather_object

import ddp_utils
from ddp_utils.launch import make_accelerator
from ddp_utils.lm import TARGET_TOKENS

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "train_clm.py"


def main():
    spec = importlib.util.spec_from_file_location("train_clm", SCRIPT)
    train_clm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train_clm)
    out, args = sys.argv[1], train_clm.parse_args(sys.argv[2:])
    accelerator = make_accelerator(seed=args.seed, gradient_accumulation_steps=args.gradient_accumulation_steps)
    tokenized, tokenizer, _, report, _, _ = ddp_utils.load_on_main_first(accelerator, train_clm.prepare_data, args)
    collate = train_clm.CausalLMCollator(tokenizer.pad_token_id)
    loader = ddp_utils.make_train_dataloader(
        tokenized["train"], batch_size=args.per_device_train_batch_size, accelerator=accelerator, collate_fn=collate)
    plan = ddp_utils.StepPlan(accelerator, args, loader, unit="target_tokens")
    loader = accelerator.prepare(loader)
    epochs = []
    for epoch in range(2):
        rows = []
        for micro_batches in plan.optimizer_steps(loader, epoch):
            ddp_utils.count_step(accelerator, micro_batches, TARGET_TOKENS)  # as the script does: every rank, every step
            for batch in micro_batches:
                for i in range(len(batch["input_ids"])):
                    if batch[TARGET_TOKENS][i] > 0:  # a real row, not a filler that evens out the shards
                        rows.append({"input_ids": batch["input_ids"][i].tolist(), "labels": batch["labels"][i].tolist()})
        epochs.append(gather_object([rows]))
    raw = train_clm.check_and_split(train_clm.load_raw_datasets(args), args)  # the same split, to compare against
    if accelerator.is_main_process:
        record = {"epochs": epochs, "report": report}
        if args.data_mode == "text":
            record["train_text"] = list(raw["train"][args.text_column])
        else:
            record["train_records"] = [{"prompt": r[args.prompt_column], "completion": r[args.completion_column]} for r in raw["train"]]
        Path(out).write_text(json.dumps(record))
    accelerator.end_training()


if __name__ == "__main__":
    ddp_utils.run(main)
