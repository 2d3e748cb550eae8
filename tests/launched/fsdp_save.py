"""Launched by the tests: FSDP2 on CPU (gloo), as far as this machine allows. Accelerate 1.15 runs
FSDP on GPUs only, so the model is sharded here with torch's own `fully_shard` (one unit per
transformer layer, as accelerate_configs/fsdp.yaml asks), trained a few steps, and saved the way
`ddp_utils.save_model` saves under FSDP2: the full state dict that `accelerator.get_state_dict`
gathers (the same `get_model_state_dict` options), written by `ddp_utils.results.output.write_pretrained`.

usage: fsdp_save.py TINY_BERT_DIR OUTPUT_DIR
"""

import json
import sys
from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import fully_shard
from transformers import AutoModelForSequenceClassification

import ddp_utils
from ddp_utils.lifecycle.start import make_accelerator
from ddp_utils.results.output import write_pretrained


def main():
    model_dir, output_dir = sys.argv[1], Path(sys.argv[2])
    accelerator = make_accelerator(seed=0)  # the gloo process group
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=3)
    for layer in model.bert.encoder.layer:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(accelerator.process_index)
    for _ in range(3):
        loss = model(
            input_ids=torch.randint(5, 30, (4, 8), generator=generator), labels=torch.tensor([0, 1, 2, 0])
        ).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    # What saving model.state_dict() would write: this rank's shards only.
    local = {
        name: tuple(value.to_local().shape) for name, value in model.state_dict().items() if hasattr(value, "to_local")
    }
    # The full parameters, for the test to compare the saved file with (every rank takes part).
    full = {name: param.full_tensor().tolist() for name, param in model.named_parameters()}
    state_dict = get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, cpu_offload=True)
    )
    if accelerator.is_main_process:
        write_pretrained(model, state_dict, str(output_dir))
        (output_dir.parent / "fsdp_reference.json").write_text(json.dumps({"full": full, "rank0_shards": local}))
    else:
        assert not state_dict, "the full state dict is gathered on the main process only"
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    ddp_utils.run(main)
