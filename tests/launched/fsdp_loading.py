"""Launched by the tests under tests/launched/fsdp_on_cpu.py with accelerate_configs/fsdp.yaml
(`fsdp_cpu_ram_efficient_loading: true`): loads BertForSequenceClassification with
`ddp_utils.load_pretrained` (a new head: missing from the checkpoint), prepares it with an
optimizer as the scripts do, takes one step, and writes what each rank saw to OUTPUT.rank<r> as JSON:

- before `prepare`: which parameters hold values (on the other ranks: none, so only rank 0 read
  the weights), and their dtypes;
- after it: the optimizer's parameters (each model parameter once), and the full weights gathered
  from the shards, to compare with rank 0's before `prepare` (the checkpoint's, and its new head).

usage: fsdp_loading.py MODEL_DIR OUTPUT
"""

import json
import sys

import torch
from transformers import BertForSequenceClassification

import ddp_utils


def main():
    model_dir, output = sys.argv[1], sys.argv[2]
    accelerator = ddp_utils.make_accelerator(seed=0)
    # A model class, not an Auto one: it has no from_config, only _from_config.
    model = ddp_utils.load_pretrained(BertForSequenceClassification, model_dir, num_labels=3)
    loaded = {name: not p.is_meta for name, p in model.named_parameters()}
    before = {name: p.float().tolist() for name, p in model.named_parameters()} if accelerator.is_main_process else None
    dtypes = {name: str(p.dtype) for name, p in model.named_parameters()}
    optimizer = ddp_utils.make_adamw(model, 1e-3, 0.0)
    model, optimizer = accelerator.prepare(model, optimizer)
    in_optimizer = [id(p) for group in optimizer.param_groups for p in group["params"]]
    full = accelerator.get_state_dict(model)  # all ranks: gathered on the main process
    loss = model(input_ids=torch.tensor([[2, 7, 8, 3]]), labels=torch.tensor([1])).loss
    accelerator.backward(loss)
    optimizer.step()  # the optimizer works on every parameter's shard
    report = {
        "loaded_before_prepare": loaded,
        "dtypes": dtypes,
        "optimizer_parameters": len(in_optimizer),
        "distinct_optimizer_parameters": len(set(in_optimizer)),
        "model_parameters": len(list(model.parameters())),
        "before": before,
        "full": {name: value.float().tolist() for name, value in full.items()} if accelerator.is_main_process else None,
    }
    with open(f"{output}.rank{accelerator.process_index}", "w") as handle:
        json.dump(report, handle)
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    ddp_utils.run(main)
