"""Launched by the tests: the frozen weights' digest of a model sharded by torch's `fully_shard` (FSDP2, gloo),
on any number of processes, against the digest of the same model whole. The weights' first dims (101, 5, 2)
do not divide evenly among 3 processes: the ranks hold blocks of unequal rows, and one rank none of the 2-row
weight. Each rank writes what it found to OUTPUT_DIR/rank<N>.json.

usage: frozen_digest_on_shards.py OUTPUT_DIR
"""

import json
import os
import sys

import torch
from torch.distributed.fsdp import fully_shard

from ddp_utils.checkpoints.frozen_weights import frozen_digest
from ddp_utils.lifecycle.start import make_accelerator


def main():
    accelerator = make_accelerator(seed=0)  # the gloo process group
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Embedding(101, 7), torch.nn.Linear(7, 5), torch.nn.Linear(5, 3), torch.nn.Linear(3, 2)
    )
    model.requires_grad_(False)
    model[2].requires_grad_(True)  # one trained layer among the frozen ones
    whole = frozen_digest(model)
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    shards = {name: list(p.to_local().shape) for name, p in model.named_parameters()}
    found = {"whole": whole, "sharded": frozen_digest(model), "shards": shards}
    with open(os.path.join(sys.argv[1], f"rank{accelerator.process_index}.json"), "w") as handle:
        json.dump(found, handle)


if __name__ == "__main__":
    main()
