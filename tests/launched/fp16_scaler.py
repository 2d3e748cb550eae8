"""Launched by the tests (and by the GPU checklist): runs a training script unchanged, with fp16
mixed precision as a GPU run has it: autocast to float16 and torch's dynamic loss scaler
(`GradScaler`), whose first scale is FP16_INIT_SCALE (default 2**40), so that the first steps
overflow and are skipped while the scale comes down, as at the start of every fp16 run and now
and then after it grows back; FP16_BACKOFF_FACTOR (default torch's 0.5) multiplies the scale
after each overflow. On a CPU, Accelerate would otherwise train fp16 in fp32 with no
scaler at all; on a GPU this only raises the first scale.

usage: fp16_scaler.py SCRIPT <script arguments>   (SCRIPT: train, train_sft, train_clm or train_image;
       launch it with --mixed_precision fp16)
"""

import os
import runpy
import sys

import torch
from accelerate import Accelerator

original_init = Accelerator.__init__


def init_with_a_scaler(self, *args, **kwargs):
    original_init(self, *args, **kwargs)
    if self.state.mixed_precision == "fp16" and self.distributed_type.value in ("NO", "MULTI_CPU", "MULTI_GPU", "FSDP"):
        self.native_amp = True  # autocast to fp16 around the forward pass, and unscale before clipping
        self.scaler = torch.amp.GradScaler(
            self.device.type,
            init_scale=float(os.environ.get("FP16_INIT_SCALE", 2**40)),
            backoff_factor=float(os.environ.get("FP16_BACKOFF_FACTOR", 0.5)),  # torch's: halve after an overflow
        )


Accelerator.__init__ = init_with_a_scaler
script = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", f"{sys.argv[1]}.py")
sys.argv = [script, *sys.argv[2:]]
runpy.run_path(script, run_name="__main__")
