"""Launched by the tests: runs a training script unchanged under a DeepSpeed launch config
(accelerate_configs/deepspeed_zero*.yaml) on CPU processes over gloo, as the GPU run would.

Accelerate 1.15 turns its DeepSpeed path on only when `cpu=False`: on a machine without GPUs it keeps
MULTI_CPU and ignores the plugin the launcher asked for (and ddp_utils refuses such a launch in one
line). This harness changes that decision and nothing else: after `Accelerator.__init__` it joins
DeepSpeed's communication layer to the gloo group already formed, and sets the state as
`AcceleratorState` does on a GPU (the distributed type, the plugin built from the launcher's
environment with the mixed precision set, no autocast of its own: DeepSpeed's engine casts the
model). From there on the script runs Accelerate's `_prepare_deepspeed` and DeepSpeed's own engine
on its CPU accelerator: ZeRO-2's partitioned gradients and optimizer state, ZeRO-3's `zero.Init` and
parameter all-gathers, its bf16 optimizer with fp32 master weights, its checkpoints, and the
16-bit weights gathered for the save. Only the device (CPU) and the collectives' backend (gloo, not
NCCL) differ from a GPU run. DeepSpeed's shared-memory all-reduce for CPU inference is not built
(a C++ build of 30 s; training does not use it). FP16_INIT_SCALE_POWER sets the fp16 loss scaler's
first scale, 2 to that power (DeepSpeed's default: 16), so that the first steps overflow.

usage: deepspeed_on_cpu.py SCRIPT <script arguments>   (SCRIPT: train, train_sft, ...; or a path to a .py file)
       launch it with --config_file accelerate_configs/deepspeed_zero3.yaml --num_processes N
"""

import os
import runpy
import sys

import deepspeed.ops
from accelerate import Accelerator
from accelerate.state import PartialState
from accelerate.utils import DeepSpeedPlugin, DistributedType
from deepspeed.accelerator import get_accelerator

deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # the CPU inference all-reduce: not needed here
# DeepSpeed's CPU accelerator refuses fp16 where oneDNN lacks fp16 kernels (this machine); torch computes it anyway,
# and its loss scaler (what `--mixed_precision fp16` under DeepSpeed tests) does not depend on the device.
get_accelerator().is_fp16_supported = lambda: True
original_init = Accelerator.__init__


def init_with_deepspeed(self, *args, **kwargs):
    original_init(self, *args, **kwargs)
    asked = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
    if asked and self.distributed_type != DistributedType.DEEPSPEED:
        from deepspeed import comm

        comm.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)  # wraps the gloo group formed
        plugin = kwargs.get("deepspeed_plugin") or DeepSpeedPlugin()  # read from the launcher's env
        plugin.set_mixed_precision(self.state._mixed_precision)
        if self.state._mixed_precision == "fp16" and os.environ.get("FP16_INIT_SCALE_POWER"):  # DeepSpeed's: 16
            plugin.deepspeed_config["fp16"]["initial_scale_power"] = int(os.environ["FP16_INIT_SCALE_POWER"])
        plugin.select(_from_accelerator_state=True)
        self.state.deepspeed_plugins = plugin
        self.state.distributed_type = DistributedType.DEEPSPEED
        PartialState._shared_state["distributed_type"] = DistributedType.DEEPSPEED
        self.state._mixed_precision = "no"  # as AcceleratorState under DeepSpeed: its config holds the precision
        self.native_amp, self.scaler = False, None


Accelerator.__init__ = init_with_deepspeed
script = sys.argv[1]
if not script.endswith(".py"):
    script = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", f"{script}.py")
sys.argv = [script, *sys.argv[2:]]
runpy.run_path(script, run_name="__main__")
