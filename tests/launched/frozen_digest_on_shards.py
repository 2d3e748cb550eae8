"""Launched by the tests: the frozen weights' digest of a model sharded by torch's `fully_shard` (FSDP2, gloo),
on any number of processes, against the digest of the same model whole. The weights' first dims (101, 5, 2)
do not divide evenly among 3 processes: the ranks hold blocks of unequal rows, and one rank none of the 2-row
weight. Two more layouts of the same model: sharded by columns where they divide evenly (FSDP2's
rule: the 2x3 weight; the digest gathers such a weight whole), and HSDP
on a mesh of 3 replicas of 1 shard (each rank holds every row; the digest counts each place once). Each rank writes
what it found to OUTPUT_DIR/rank<N>.json.

usage: frozen_digest_on_shards.py OUTPUT_DIR
"""

import json
import os
import sys

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Shard

from ddp_utils.checkpoints.frozen_weights import frozen_digest
from ddp_utils.lifecycle.start import make_accelerator


def main():
    accelerator = make_accelerator(seed=0)  # the gloo process group
    whole = frozen_digest(build())
    found = {"whole": whole}
    world = accelerator.num_processes
    replicas = init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard"))
    layouts = {
        "sharded": {},
        "by_columns": {"shard_placement_fn": lambda p: Shard(int(p.dim() > 1 and p.shape[1] % world == 0))},
        "hsdp": {"mesh": replicas},
    }
    for layout, options in layouts.items():
        model = build()
        for layer in model:
            fully_shard(layer, **options)
        fully_shard(model, **options)
        found[layout] = frozen_digest(model)
        found[f"{layout}_shards"] = {name: list(p.to_local().shape) for name, p in model.named_parameters()}
    with open(os.path.join(sys.argv[1], f"rank{accelerator.process_index}.json"), "w") as handle:
        json.dump(found, handle)


def build():
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Embedding(101, 7), torch.nn.Linear(7, 5), torch.nn.Linear(5, 3), torch.nn.Linear(3, 2)
    )
    model.requires_grad_(False)
    model[2].requires_grad_(True)  # one trained layer among the frozen ones
    return model


if __name__ == "__main__":
    main()
