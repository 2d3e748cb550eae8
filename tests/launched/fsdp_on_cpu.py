"""Launched by the tests: runs a training script unchanged under an FSDP launch config
(accelerate_configs/fsdp.yaml) on CPU processes over gloo, as the GPU run would.

Accelerate 1.15 turns its FSDP path on only for GPU-like distributed types: with cpu=True it keeps
MULTI_CPU and ignores the FSDP plugin the launcher asked for (and ddp_utils refuses such a launch
in one line). This harness changes that decision and nothing else: after `Accelerator.__init__`
it sets the state's distributed type to FSDP and gives it the plugin built from the launcher's
environment, exactly as `AcceleratorState` does on a GPU. From there on the script runs
Accelerate's own FSDP2 code: `fully_shard` per layer, DTensor parameters, the sharded optimizer
state, `torch.distributed.checkpoint`, the full state dict gathered to rank 0. Only the device
(CPU) and the collectives' backend (gloo, not NCCL) differ from a GPU run.

usage: fsdp_on_cpu.py SCRIPT <script arguments>   (SCRIPT: train, train_sft, ...; or a path to a .py file)
       launch it with --config_file accelerate_configs/fsdp.yaml --num_processes N
"""

import os
import runpy
import sys

from accelerate import Accelerator
from accelerate.state import PartialState
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

original_init = Accelerator.__init__


def init_with_fsdp(self, *args, **kwargs):
    original_init(self, *args, **kwargs)
    asked = os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
    if asked and self.distributed_type != DistributedType.FSDP:
        plugin = kwargs.get("fsdp_plugin") or FullyShardedDataParallelPlugin()  # read from the launcher's env
        if self.state.mixed_precision != "no":
            plugin.set_mixed_precision(self.state.mixed_precision)
        self.state.fsdp_plugin = plugin
        self.state.distributed_type = DistributedType.FSDP
        PartialState._shared_state["distributed_type"] = DistributedType.FSDP


Accelerator.__init__ = init_with_fsdp
script = sys.argv[1]
if not script.endswith(".py"):
    script = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", f"{script}.py")
sys.argv = [script, *sys.argv[2:]]
sys.path[0] = os.path.dirname(os.path.abspath(script))  # as `python script.py` has it: its own directory first
runpy.run_path(script, run_name="__main__")
