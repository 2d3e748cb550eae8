"""Baseline: transformers.Trainer on the same model, data and hyper-parameters. Launched with torchrun.

usage: torchrun --nproc_per_node 2 bench/baselines/trainer_run.py OUT.json EPOCHS BATCH LR MAX_LENGTH OUTPUT_DIR
"""

import json
import sys

import numpy as np
import torch
from common import LABELS, demo_data
from transformers import AutoModelForSequenceClassification, Trainer, TrainingArguments

from ddp_utils.demo import demo_model_path


def accuracy(eval_prediction):
    logits, labels = eval_prediction
    return {"accuracy": float((np.argmax(logits, axis=-1) == labels).mean())}


def main():
    out, epochs, batch_size, lr, max_length, output_dir = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]), int(sys.argv[5]), sys.argv[6]
    tokenized, tokenizer, collate = demo_data(max_length)
    model = AutoModelForSequenceClassification.from_pretrained(demo_model_path(), num_labels=len(LABELS))
    args = TrainingArguments(
        output_dir=output_dir, per_device_train_batch_size=batch_size, per_device_eval_batch_size=32,
        learning_rate=lr, num_train_epochs=epochs, warmup_steps=0.1,  # a float: a ratio of the steps (transformers 5)
        weight_decay=0.01, max_grad_norm=1.0,
        eval_strategy="epoch", save_strategy="no", logging_strategy="epoch", report_to=[], seed=42,
        use_cpu=not torch.cuda.is_available(), dataloader_num_workers=0, disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=tokenized["train"], eval_dataset=tokenized["validation"],
                      data_collator=collate, compute_metrics=accuracy)
    result = trainer.train()
    eval_time = sum(entry.get("eval_runtime", 0.0) for entry in trainer.state.log_history)
    final = [entry for entry in trainer.state.log_history if "eval_accuracy" in entry][-1]
    if trainer.is_world_process_zero():
        with open(out, "w") as handle:
            json.dump({"train_samples": epochs * len(tokenized["train"]), "train_time_s": result.metrics["train_runtime"] - eval_time,
                       "eval_accuracy": final["eval_accuracy"]}, handle)


if __name__ == "__main__":
    main()
