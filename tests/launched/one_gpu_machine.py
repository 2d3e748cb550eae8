"""Launched by the tests: runs a training script unchanged on a machine that, to torch, has one CUDA GPU (none is
touched: the launch guard must refuse more processes than GPUs before Accelerate gives each process its device).

usage: one_gpu_machine.py SCRIPT <script arguments>   (SCRIPT: train, train_sft, ...; launch it with 2 processes)
"""

import os
import runpy
import sys

import torch

torch.cuda.is_available = lambda: True
torch.cuda.device_count = lambda: 1
script = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", f"{sys.argv[1]}.py")
sys.argv = [script, *sys.argv[2:]]
runpy.run_path(script, run_name="__main__")
