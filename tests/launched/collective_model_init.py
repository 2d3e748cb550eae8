"""Launched by the tests: runs a training script unchanged, but makes building a `transformers`
model a collective, as it is under DeepSpeed ZeRO-3 (`zero3_init_flag: true`: the model is built
inside `deepspeed.zero.Init`, whose parameter partitioning and broadcasts are collectives). Every
`PreTrainedModel.post_init` does an all-reduce first, so a model built on the main process alone
(inside `load_on_main_first`, while the others wait in a broadcast) fails within --ddp_timeout
instead of training.

usage: collective_model_init.py SCRIPT.py <script arguments>
"""

import os
import runpy
import sys

import torch
from transformers import PreTrainedModel

original_post_init = PreTrainedModel.post_init


def collective_post_init(self):
    if torch.distributed.is_initialized():
        flag = torch.ones(1, device="cpu")  # from_pretrained builds under a meta-device context
        torch.distributed.all_reduce(flag)  # every rank must be building a model at this moment
        assert flag.item() == torch.distributed.get_world_size(), f"a model was built on {flag.item():.0f} ranks only"
    return original_post_init(self)


PreTrainedModel.post_init = collective_post_init
script = os.path.abspath(sys.argv[1])
sys.argv = [script, *sys.argv[2:]]
runpy.run_path(script, run_name="__main__")
