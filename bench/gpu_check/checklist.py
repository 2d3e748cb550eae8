#!/usr/bin/env python
"""The GPU checklist (issue 24): every step timed, every failure caught and recorded, so one broken
step does not cost the others; every figure in one JSON file and a Markdown table.

    make gpu-check                                  # all steps, here with the project's .venv
    make gpu-check PYTHON=python3 STEPS=1,2a        # on the GPU machine: its python3, some steps per call
    make gpu-check DRY_RUN=1                        # on a CPU: every step with tiny sizes (what CI runs)
    python bench/gpu_check/checklist.py --steps 4,5,6 --budget_s 540
    python bench/gpu_check/checklist.py --plan      # the device calls (CALLS) with their estimated seconds

Steps (bench/gpu_check/README.md says what each measures and how):

  1   scripts/train.py demo in bf16 (single_gpu.yaml) against transformers.Trainer in bf16
  2a  scripts/train_sft.py on the default LLM, LoRA: plain, gradient checkpointing, packing; each against
      TRL's SFTTrainer with its best settings for the case
  2b  the same, full fine-tuning: plain, gradient checkpointing
  3   --torch_compile on the LLM: compile time, speed-up, recompiles and graph breaks
  4   accelerate_configs/fsdp.yaml on one GPU: speed, GPU memory, and the saved model reloads (its
      correctness, resume included, is tested on CPU processes: tests/test_fsdp.py)
  5   DeepSpeed ZeRO-2 and ZeRO-3 with one process (skipped, with why, where deepspeed cannot be imported)
  6   scripts/train_image.py --sync_batchnorm on one GPU
  7   fp16: the image demo and the LoRA SFT with the loss scaler's first scale at 2**40, so that the first
      steps overflow and are skipped: both must finish, with the skipped steps counted
  8   bench/bench_manifest.py: a checkpoint of several GB saved and resumed, with and without the manifest
  9   bench/bench_dpo.py: train_dpo.py against TRL's DPOTrainer, both references
  10  bench/bench_grpo.py: train_grpo.py against TRL's GRPOTrainer, no vLLM on either side
  11  bench/bench_dpo.py: train_dpo.py with --torch_compile against TRL's DPOTrainer
  12  bench/bench_grpo.py --profile: where a GRPO step's time goes, ours (also without cuDNN attention) and TRL's
  13  QLoRA: step 2a's plain LoRA case with --load_in_4bit against TRL's SFTTrainer on the same 4-bit base, and
      against our plain LoRA run (the memory the 4-bit base saves, the speed it costs)
  14  scripts/train.py with the LLM as a classifier: full fine-tuning, LoRA and QLoRA (--lora_r, --load_in_4bit) on
      step 1's work: samples/s, peak GPU memory, accuracy; the merged classifiers reload

Results accumulate in --results (default outputs/gpu_check): gpu_check.json (a step run again replaces
its record), gpu_check.md and logs/. With --copy_to (default: $OUT, set on the GPU machine) they are
copied there after every run, so a call stopped at its time limit still brings back what it did.

The runner itself imports only the standard library: each run is a subprocess, and so is every piece
of work that needs torch (this file with --helper), so a broken import breaks one step, not the run.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shlex
import shutil
import socket
import statistics
import subprocess
import sys
import tarfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent.parent
BENCH = REPO / "bench"
CONFIGS = REPO / "accelerate_configs"
SITE_MARKER = ".gpu_check_installed.json"  # written by payload.py install
DEFAULT_SITE = Path(os.environ.get("GPU_CHECK_SITE", "/tmp/gpu_check_site"))
STEPS = {
    "1": "train.py demo in bf16 against transformers.Trainer",
    "2a": "SFT on the default LLM, LoRA (plain, gradient checkpointing, packing) against TRL",
    "2b": "SFT on the default LLM, full fine-tuning (plain, gradient checkpointing) against TRL",
    "3": "--torch_compile on the LLM: compile time and speed-up",
    "4": "FSDP (fsdp.yaml) on one GPU: speed and GPU memory; the saved model reloads",
    "5": "DeepSpeed ZeRO-2 and ZeRO-3, one process",
    "6": "train_image.py --sync_batchnorm on one GPU",
    "7": "fp16 with its loss scaler: the image demo and the LoRA SFT start at a scale that overflows, and finish",
    "8": "a checkpoint of several GB: the save and the resume, with and without the manifest",
    "9": "train_dpo.py (LoRA) against TRL's DPOTrainer, both references: pairs/s and peak GPU memory",
    "10": "train_grpo.py (LoRA) against TRL's GRPOTrainer, no vLLM: prompts/s, peak GPU memory, generation's share",
    "11": "train_dpo.py --torch_compile (LoRA, adapters off) against TRL's DPOTrainer: pairs/s, compilations",
    "12": "GRPO profiled, ours (also without cuDNN attention) and TRL's: where a step's time goes",
    "13": "QLoRA (--load_in_4bit) on 2a's plain LoRA case against TRL on the same 4-bit base, and against our LoRA",
    "14": "train.py with the LLM as a classifier: full fine-tuning, LoRA and QLoRA: samples/s, GPU memory, accuracy",
}
FP16_SCALER = REPO / "tests" / "launched" / "fp16_scaler.py"  # a script run with torch's GradScaler, first scale set
FSDP_ON_CPU = REPO / "tests" / "launched" / "fsdp_on_cpu.py"  # a script run under FSDP2 on CPU processes
DEEPSPEED_ON_CPU = REPO / "tests" / "launched" / "deepspeed_on_cpu.py"  # the same under DeepSpeed ZeRO
# Dense bf16 peaks (no sparsity) that MFU divides by, by GPU name. H100 SXM (HBM3) and H200: 989 TFLOP/s.
PEAK_BF16 = [("H100 PCIe", 756e12), ("H100", 989e12), ("H200", 989e12), ("A100", 312e12)]
# The LLM cases of steps 2 and 13: (step, our options, TRL's best settings for the same case).
LORA = ["--lora_r", "16", "--lora_alpha", "16", "--lora_dropout", "0.0", "--learning_rate", "1e-3"]
FULL = ["--lora_r", "0", "--learning_rate", "2e-5"]
TRL_LORA = ["--lora_r", "16", "--lora_alpha", "16", "--lora_dropout", "0.0", "--lr", "1e-3"]
TRL_FULL = ["--full", "--lr", "2e-5"]
LLM_CASES = {
    "lora": ("2a", LORA, [*TRL_LORA, "--padding_free"]),
    "lora_gc": ("2a", [*LORA, "--gradient_checkpointing"], [*TRL_LORA, "--padding_free", "--gradient_checkpointing"]),
    "lora_packed": ("2a", [*LORA, "--packing"], [*TRL_LORA, "--packing"]),
    "full": ("2b", FULL, [*TRL_FULL, "--padding_free"]),
    "full_gc": ("2b", [*FULL, "--gradient_checkpointing"], [*TRL_FULL, "--padding_free", "--gradient_checkpointing"]),
    # QLoRA: the plain LoRA case on a 4-bit base, both sides with the same BitsAndBytesConfig
    "qlora": ("13", [*LORA, "--load_in_4bit"], [*TRL_LORA, "--padding_free", "--load_in_4bit"]),
}
# between them: LoRA, full, packing, checkpointing, the 4-bit base (CI time)
DRY_RUN_CASES = {"lora_packed", "full_gc", "qlora"}

# What each run takes on the GPU, for --budget_s and the call plan (--plan): STARTUP_SCALE x its wall time in the
# CPU dry run plus the real work's seconds on the GPU. A dry run is nearly all start-up (Python, imports, the
# launcher, loading model and data, saving): CPU work the GPU machine does too, there with a CUDA torch, CUDA's
# start and the real models, hence the 1.5. The work is estimated from its size (eager steps are launch-bound:
# ~15 ms a step of MiniLM, ~60 ms of the 135M LLM, ~20 ms a generated token), to be checked against call 1's runs.
# (step, run): (dry-run wall s, measured 2026-11-25 with --jobs 1 on 2 busy cores; GPU work s, estimated).
STARTUP_SCALE = 1.5
RUN_S = {
    ("env", "plain"): (3.0, 0),  # the machine's facts: one import of torch and the packages
    ("env", "llm"): (35.0, 0),  # the same and the LLM: the real GGUF dequantized (measured at real size), data
    ("env", "llm_cached"): (11.6, 0),  # the dequantized GGUF kept in hf_home by an earlier call of this machine
    ("1", "ours"): (11.7, 10),  # 225 steps of MiniLM, batch 8, evaluated on 379 reviews each epoch
    ("1", "trainer"): (12.1, 10),
    ("1", "trainer_grouped"): (12.1, 10),  # not in the dry run: trainer's
    ("2a", "lora"): (9.0, 15),  # 75 steps, generation on the 379 records twice (zero-shot too)
    ("2a", "lora_gc"): (9.0, 12),  # lora and lora_gc are not in the dry run: lora_packed's start-up
    ("2a", "lora_packed"): (9.0, 8),
    ("2a", "trl"): (9.0, 20),  # no trl in the dry run: ours' start-up; TRL's imports and data preparation
    ("2b", "full"): (6.3, 10),
    ("2b", "full_gc"): (6.3, 40),  # not yet run on the GPU: full's there (39 s) and a third more for recomputation
    ("2b", "trl"): (6.3, 25),
    ("3", "eager"): (9.0, 10),  # only when step 2a's lora run is not there (a machine started afresh)
    # inductor by regions (one layer compiled for all 30), forward and backward, a variant for the first layer (its
    # input needs no gradient), a recompile for new lengths and one for the epoch's last batch; compiled whole it
    # took 119 s, 216 s and over 90 s for those three on session 3's H100, and was stopped at 438 s
    ("3", "compiled"): (18.9, 200),
    ("4", "train"): (12.4, 40),  # with the reload helper; 20 steps, 2 sharded checkpoints, 64 prompts
    ("5", "zero2"): (10.7, 60),  # with a reload; DeepSpeed's start, 20 steps, 64 prompts, the save
    ("5", "zero3"): (9.4, 60),  # both through tests/launched/deepspeed_on_cpu.py since 2026-11-26
    ("6", "plain"): (11.3, 15),  # 10 epochs of 1,437 digits; the dry run runs it as step 7's image run
    ("6", "sync_batchnorm"): (11.3, 15),  # the dry run stops at the CPU's refusal: taken as plain's
    ("7", "image"): (11.3, 15),
    ("7", "lora"): (8.0, 12),
    ("8", "manifest"): (7.8, 200),  # 8 GB: two saves and two resumes, 3 times: ~100 GB through the disk
    # Steps 9 and 10 run the prepared LLM (the dry run's tiny one: 19.7 s and 18.2 s on 2 busy cores); with the real
    # 135M model a run started in 29 s here, and the pairs' or prompts' preparation took 10 s.
    ("9", "bench_dpo"): (126.0, 90),  # 4 runs: 10 s of preparation and 29 s a run
    ("10", "bench_grpo"): (68.0, 120),  # 2 runs; on the GPU 91 steps of 16 samples of 8 tokens each
    # 2 runs of 300 pairs: TRL (step 9's 600 took about 90 s) and ours compiled, its 75 steps and inductor's
    # compilations (the dry run traces 6 graphs: the policy and the reference without gradients, each for its first
    # length and then dynamic, and evaluation with the adapters on and off), taken at 50 s each
    ("11", "bench_dpo"): (30.0, 400),
    # 12 steps of each of 3 contenders, steps 4 to 8 under torch.profiler: session 4 measured 264 s for two (ours 112
    # s, TRL's 143, the prompts' preparation 9); the third, ours without cuDNN's attention, taken as ours'
    ("12", "bench_grpo"): (11.0, 360),
    # Step 13 (dry run measured 2026-12-07, --jobs 1 on 2 busy cores; TRL's with trl 1.16.0 put on the path, as CI
    # has none). The work: 2a's lora on session 1's H200 (GPU_S: 65 s, 22 of them training, 9.5 the zero-shot
    # evaluation, which step 13 does not run), with a 4-bit base a third more training (bitsandbytes dequantizes each
    # of the 210 linear layers' weights in every forward and backward pass: launches, on a launch-bound step), about
    # 2 s more evaluation, 3 s of quantizing at load; TRL's from its lora_trl (61 s, 38 training) in the same way.
    ("13", "qlora"): (5.7, 61),
    ("13", "trl"): (6.3, 71),
    ("13", "lora"): (6.3, 46),  # the LoRA reference: 2a's lora less its zero-shot evaluation
    # Step 14 (dry run measured 2026-12-07, --jobs 1): the LLM as train.py's classifier on step 1's work, 225 steps of
    # 8 reviews of up to 128 tokens, 3 evaluations of 379. Taken as 2b's full run's pace (80 ms a step on session 1's
    # H200, launch-bound) with the model's save; LoRA's adapters add launches and its merge a save; QLoRA dequantizes
    # each linear layer's weights in every pass and its merge reads the base again; the reload: 3 models of 135M.
    ("14", "full"): (9.0, 30),
    ("14", "lora"): (9.1, 35),
    ("14", "qlora"): (9.1, 50),
    ("14", "reload"): (4.6, 10),
}
# Each run's wall seconds on the first GPU session (an H200, 2026-11-26; the LLM's weights drawn at random, the
# runs as the steps make them): they replace RUN_S's estimates, which were 1.1 to 3 times too short for the LLM.
GPU_S = {
    ("env", "llm_shape"): 16.5,
    ("1", "ours"): 31.9,
    ("1", "trainer"): 29.7,
    ("1", "trainer_grouped"): 36.4,
    ("2a", "lora"): 65.4,  # with the zero-shot evaluation: 379 answers generated twice
    ("2a", "lora_trl"): 61.2,
    ("2a", "lora_gc"): 77.7,
    ("2a", "lora_gc_trl"): 66.5,
    ("2a", "lora_packed"): 47.3,
    ("2a", "lora_packed_trl"): 30.7,
    ("2b", "full"): 39.0,
    ("2b", "full_trl"): 34.8,
    ("4", "train"): 55.0,  # with the reload
    ("7", "image"): 30.5,
    ("7", "lora"): 66.6,
    # Session 2 (a second H200, 2026-11-26): the steps' whole wall time, from their records.
    ("9", "bench_dpo"): 370.3,  # 4 runs; 279 s estimated
    # Its runs: 146.6 s and 111.8 s (94.7 s and 91.0 s on session 1's machine); since then a third, ours with
    # --compile_generation, taken as ours' run and a minute more for inductor's compilation (not yet run on a GPU).
    # Session 3 (an H100, 2026-11-27): its three runs, the third with --compile_generation (76, 90 and 112 s).
    ("10", "bench_grpo"): 284.4,
    # Session 4 (an H200, 2026-11-28): step 3's runs, its compiled one by regions. Its step 12 (GRPO's and DPO's
    # benchmarks then, two contenders each: 264 s and 152 s against 223 estimated for both, probably the profiler's
    # traces, read at the end of each run) has three GRPO contenders since: RUN_S.
    ("3", "eager"): 41.5,  # 36.4 s on session 3's H100
    ("3", "compiled"): 120.2,  # 79 s of it compiling; compiled whole (session 3) it was stopped at 438 s
}
# The device calls still to make (README "The device calls"), session by session: a session has 15 device minutes
# and one machine start; the machine goes back 30 s after a call. `carry`: the payload's parts and folders (payload.py's
# sets: step1 and llm_shape in one part each, llm in two); `shape`: the LLM steps run with --llm_shape (the demo LLM's
# architecture, its weights drawn at random). Session 1 (2026-11-26) ran steps 1, 2a, 4 and 7, 2b's first case,
# and step 10's runs (the call ended before their record); session 2 (2026-11-26) ran steps 10 and 9; session 3
# (2026-11-27) step 10, and step 3 until its compiled run, compiled whole, was stopped; session 4 (2026-11-28) steps
# 12 and 3 (bench/gpu_check/README.md). `qlora`: bitsandbytes alone, installed beside `llm` (STEP_ADDS).
CALLS = [
    # Step 12 again: session 4's profile found ours' GRPO paying 0.49 s a step in cuDNN attention's host code. GRPO's
    # rows now pad to a multiple of 8, the profile gives each operator's longest and median call (a graph built per
    # new length, or a cost of every call?), and a third run goes without cuDNN's attention (what it costs a step).
    # Then 2b's checkpointing case, never run.
    {"session": 5, "carry": ["llm_shape-1", "llm_shape"], "install": True, "shape": True, "steps": ["12"]},
    {"session": 5, "carry": ["llm_shape"], "install": False, "shape": True, "steps": ["2b"]},  # its full_gc case
    # DPO with --torch_compile: step 9 found its step launch-bound, 1.31x TRL against a target of 1.5x.
    {"session": 6, "carry": ["llm_shape-1", "llm_shape"], "install": True, "shape": True, "steps": ["11"]},
    {"session": 7, "carry": ["llm_shape-1", "llm_shape"], "install": True, "shape": True, "steps": ["5", "8", "6"]},
    # The demo LLM's own weights: generation accuracy on a GPU (two calls carry them).
    {"session": 8, "carry": ["llm-1"], "install": False, "shape": False, "steps": []},
    {"session": 8, "carry": ["llm-2"], "install": True, "shape": False, "steps": ["2a", "4"]},
    # QLoRA (step 13) on the demo LLM's own weights: the accuracy it keeps against our LoRA's is what the 4-bit base
    # trades for its memory. bitsandbytes (the qlora set, 41 MiB) fits no call beside a part of the LLM's set.
    {"session": 9, "carry": ["llm-1"], "install": False, "shape": False, "steps": []},
    {"session": 9, "carry": ["qlora-1"], "install": False, "shape": False, "steps": []},
    # train.py's LoRA and QLoRA (step 14) on the same call: the LLM as a classifier, its accuracy on the real weights
    {"session": 9, "carry": ["llm-2"], "install": True, "shape": False, "steps": ["13", "14"]},
]
SESSION_S = 900  # a session's device time
# Which of payload.py's sets a step can run with (any one of them installed); the other steps run the LLM.
STEP_SETS = {"1": ("step1",), "6": ("step1", "llm", "llm_shape"), "8": ("step1", "llm", "llm_shape")}
# The sets a step needs as well, installed beside its LLM's: bitsandbytes (41 MiB) fits no call with an LLM set's part
STEP_ADDS = {"13": "qlora", "14": "qlora"}


def needs_llm(step: str) -> bool:
    """Whether a step runs the LLM that the environment helper prepares (steps 2 to 5, 7 and 9 to 13)."""
    return step not in STEP_SETS


def step_sets(step: str, llm_shape: bool) -> tuple:
    """The sets a step can run with: an LLM step needs the demo LLM (`llm`), or with --llm_shape any set
    with peft and trl (`llm_shape`, or `llm`)."""
    return STEP_SETS.get(step, ("llm", "llm_shape") if llm_shape else ("llm",))


def sets_missing(step: str, llm_shape: bool, installed: set) -> str | None:
    """What a step lacks of the payload where the sets `installed` are: one of its sets (step_sets), then the set it
    needs as well (STEP_ADDS); None when it can run."""
    sets = step_sets(step, llm_shape)
    if not installed.intersection(sets):
        return " or ".join(sets)
    return STEP_ADDS[step] if step in STEP_ADDS and STEP_ADDS[step] not in installed else None


# The seconds of a call around the checklist: the machine's start (first call), the pause before a later call, the
# transfers, payload.py's receive, probe and install (1.9 s for step 1's set on this machine), a margin at the end.
CALL_S = {"start": 90, "gap": 20, "transfer": 10, "receive": 5, "probe": 5, "install": 15, "margin": 30}


class Sizes:
    """The work of each step: the demos' own on a GPU; a few records and steps in the dry run."""

    def __init__(self, dry_run: bool):
        # 32 samples (the first with all 3 labels): bf16 is emulated without avx512_bf16 (1.5 samples/s here)
        self.cls = ["--max_train_samples", "32", "--max_eval_samples", "8"] if dry_run else []
        self.cls_epochs, self.cls_max_length = (1, 32) if dry_run else (3, 128)
        self.llm_train, self.llm_eval = (16, 8) if dry_run else (600, 379)  # the demo's records, all of them
        self.llm_batch, self.llm_epochs = (4, 1) if dry_run else (16, 2)
        self.block_size = 256
        self.sharded_steps, self.checkpoint_every, self.sharded_eval = (4, 2, 4) if dry_run else (20, 10, 64)
        self.image = (
            ["--max_train_samples", "64", "--max_eval_samples", "32", "--num_train_epochs", "1"] if dry_run else []
        )
        self.timeout = 420  # a hang guard: the dry run shares 2 cores with the rest of the suite
        self.fp16_llm = ["--max_train_samples", "16", "--max_eval_samples", "8"] if dry_run else []
        self.checkpoint_gb, self.checkpoint_repeats = (0.05, 1) if dry_run else (8, 3)
        self.dpo = ["--train_pairs", "4", "--only", "ours"] if dry_run else ["--train_pairs", "600", "--bf16"]
        # step 11: ours compiled against TRL on half step 9's pairs, so that the compilations fit one call (the dry
        # run: the compiled run alone, traced only)
        gpu_dpo = ["--train_pairs", "300", "--bf16", "--only", "trl", "ours_compiled"]
        self.dpo_compiled = ["--train_pairs", "8", "--only", "ours_compiled"] if dry_run else gpu_dpo
        tiny_grpo = ["--train_prompts", "4", "--only", "ours", "ours_compiled", "--num_generations", "2"]
        tiny_grpo += ["--max_completion_length", "4"]
        self.grpo = tiny_grpo if dry_run else ["--train_prompts", "182", "--bf16"]  # the demo's prompts, all of them
        # step 12: 12 steps of each contender, steps 4 to 8 profiled (the dry run: 3 of ours', 2 and 3 profiled)
        profiled = ["--profile", "--only", "ours", "ours_no_cudnn_attention"]
        if dry_run:
            self.grpo_profiled = ["--train_prompts", "6", "--num_generations", "2", "--max_completion_length", "4"]
            self.grpo_profiled += profiled
        else:
            self.grpo_profiled = ["--train_prompts", "24", "--bf16", *profiled, "trl"]
        self.profile_window = {"PROFILE_FIRST_STEP": "1", "PROFILE_STEPS": "2"} if dry_run else {}
        # Dynamo traces every frame, and finds every graph break, in the first step; on 2 CPU cores each further
        # step costs 5 to 10 s of CI (the second recompiles for its new length: the GPU run counts recompiles).
        self.compiled = ["--max_train_steps", "1"] if dry_run else []


class StepFailed(Exception):
    pass


class Checklist:
    def __init__(self, args):
        self.args, self.dry_run = args, args.dry_run
        self.llm_shape = getattr(args, "llm_shape", None)  # the LLM's config and tokenizer: its weights drawn at random
        self.sizes = Sizes(self.dry_run)
        self.results = Path(args.results).resolve()
        self.logs = self.results / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.json_path, self.md_path = self.results / "gpu_check.json", self.results / "gpu_check.md"
        self.deadline = time.monotonic() + args.budget_s if args.budget_s else None
        self.site = self.find_site(args.site)
        self.copy_to = Path(args.copy_to) if args.copy_to else None
        self.data = json.loads(self.json_path.read_text()) if self.json_path.exists() and not args.fresh else {}
        if self.data.get("dry_run", self.dry_run) != self.dry_run:
            self.data = {}  # never mix a dry run's figures with a GPU run's
        self.data.update(dry_run=self.dry_run, schema=1)
        self.data.setdefault("steps", {})
        self.data.setdefault("calls", []).append(
            {"started": now(), "steps": args.steps, "argv": sys.argv[1:], "site": str(self.site) if self.site else None}
        )
        self.step_record: dict | None = None
        self._llm: dict | None = None

    # --- environment ------------------------------------------------------------------------------

    def find_site(self, site: str | None) -> Path | None:
        """The folder payload.py install filled with the carried wheels (put first on every run's path)."""
        path = Path(site) if site else DEFAULT_SITE
        if site or (path / SITE_MARKER).exists():
            return path
        return None

    def env(self, extra: dict | None = None) -> dict:
        """Every run's environment: offline, the carried wheels first on the path, then this repository
        (not an editable install of another checkout), the benchmarks and their baselines."""
        env = dict(os.environ)
        path = [str(self.site)] if self.site else []
        path += [str(REPO), str(BENCH), str(BENCH / "baselines")]
        if env.get("PYTHONPATH"):
            path.append(env["PYTHONPATH"])
        env.update(
            PYTHONPATH=os.pathsep.join(path),
            HF_HUB_OFFLINE="1",
            HF_DATASETS_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            TOKENIZERS_PARALLELISM="false",
            PYTHONUNBUFFERED="1",
            HF_HOME=str(self.results / "hf_home"),  # the dequantized GGUF is kept here between calls
        )
        if self.dry_run:
            env["OMP_NUM_THREADS"] = "1"  # the 2-core CI machine
        env.update(extra or {})
        return env

    def helper(self, name: str, *args, timeout: int = 600) -> dict:
        """Work that needs torch, in a subprocess of this file (`--helper`): returns its JSON."""
        out = self.results / f"helper-{name}.json"
        out.unlink(missing_ok=True)
        log = self.logs / f"helper-{name}.log"
        command = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--helper",
            name,
            "--helper_out",
            str(out),
            *map(str, args),
        ]
        if self.dry_run:
            command.append("--dry_run")
        with open(log, "w") as handle:
            done = subprocess.run(
                command, cwd=REPO, env=self.env(), stdout=handle, stderr=subprocess.STDOUT, timeout=timeout
            )
        if done.returncode != 0 or not out.exists():
            raise StepFailed(f"helper {name}: {error_line(log.read_text(errors='replace'), done.returncode)}")
        return json.loads(out.read_text())

    def environment(self, steps: list[str]) -> None:
        """The machine's facts, and (when an LLM step is to run) the LLM's model, data and MFU facts, in one
        helper process (each one costs an import of torch and transformers)."""
        args = []
        if any(needs_llm(step) for step in steps):
            args = ["--llm", self.results / "llm", self.sizes.llm_train, self.sizes.llm_eval]
            if self.llm_shape:
                args += ["--llm_shape", Path(self.llm_shape).resolve()]
        try:
            found = self.helper("env", *args)
            self.data["environment"], self._llm = found["environment"], found.get("llm")
        except Exception as exc:  # recorded; the steps still run (an LLM step then fails on its own)
            self.data["environment"], self._llm = {"error": str(exc)}, None
            self._llm_error = str(exc)
        self.save()

    # --- runs -------------------------------------------------------------------------------------

    def time_left(self) -> float | None:
        return None if self.deadline is None else self.deadline - time.monotonic()

    def launch(
        self,
        name: str,
        command: list,
        result_file: Path | None = None,
        timeout: int | None = None,
        expect_error: str | None = None,
        env: dict | None = None,
    ) -> dict:
        """Run one command of this step; record it (command, wall time, status, error line, log). A run
        that would not fit in what is left of --budget_s is skipped and said so."""
        record = {"name": name, "command": shlex.join(map(str, command))}
        self.step_record["runs"][name] = record
        left = self.time_left()
        estimate_s = run_estimate_s(self.step_record["id"], name)
        if left is not None and left < estimate_s:  # stopped: the step is still to run (run_step)
            record.update(
                status="skipped",
                stopped=True,
                reason=f"{left:.0f} s left of --budget_s, this run takes about {estimate_s:.0f} s",
            )
            self.save()
            return record
        timeout = timeout or self.sizes.timeout
        budget_ends_it = left is not None and left - 5 < timeout
        if budget_ends_it:
            timeout = int(left - 5)
        log = self.logs / f"{self.step_record['id']}-{name}.log"
        record["log"] = str(log.relative_to(self.results))
        if result_file is not None:
            Path(result_file).unlink(missing_ok=True)
        print(f"  {name}: {record['command']}", flush=True)
        start = time.monotonic()
        with open(log, "w") as handle:
            handle.write(record["command"] + "\n\n")
            handle.flush()
            process = subprocess.Popen(
                [str(c) for c in command],
                cwd=REPO,
                env=self.env(env),
                stdout=handle,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            try:
                rc = process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, 9)  # the launcher and its workers
                process.wait()
                rc = None
        record["wall_s"] = round(time.monotonic() - start, 2)
        text = log.read_text(errors="replace")
        if rc is None and budget_ends_it:  # not a failure of the run: this call's time ran out
            record.update(
                status="skipped",
                stopped=True,
                reason=f"stopped after {timeout} s, at the end of --budget_s: run it again",
            )
        elif rc is None:
            record.update(status="failed", error=f"timed out after {timeout} s; last line: {error_line(text, 0)}")
        elif rc != 0:
            record.update(status="failed", error=error_line(text, rc))
        elif result_file is not None and not Path(result_file).exists():
            record.update(
                status="failed", error=f"exit 0 but no {Path(result_file).name}; last line: {error_line(text, 0)}"
            )
        else:
            record["status"] = "ok"
        if record["status"] == "failed" and expect_error and self.dry_run:
            record["expected_in_dry_run"] = expect_error in record["error"]
        print(
            f"    {record['status']} in {record['wall_s']:.1f} s"
            + (f": {record.get('error')}" if record.get("error") else ""),
            flush=True,
        )
        self.save()
        return record

    def accelerate(self, config: str, script: str, *args, processes: int = 1) -> tuple[list, str]:
        """`accelerate launch` with a repository config. In the dry run, fsdp.yaml runs through
        tests/launched/fsdp_on_cpu.py (Accelerate's own FSDP2 path on CPU processes, as the test suite
        runs it), and a DeepSpeed config through tests/launched/deepspeed_on_cpu.py (Accelerate's DeepSpeed path
        and DeepSpeed's engine on CPU processes), or where deepspeed is not installed, cpu_2proc.yaml; the step
        records which."""
        used, target = config, [REPO / "scripts" / script]
        if self.dry_run and config.startswith("fsdp"):
            target = [FSDP_ON_CPU, REPO / "scripts" / script]
            self.note(f"dry run: accelerate_configs/{config} through tests/launched/fsdp_on_cpu.py (FSDP2 on CPU)")
        elif self.dry_run and config.startswith("deepspeed") and importlib.util.find_spec("deepspeed"):
            target = [DEEPSPEED_ON_CPU, REPO / "scripts" / script]
            self.note(f"dry run: accelerate_configs/{config} through tests/launched/deepspeed_on_cpu.py (on CPU)")
        elif self.dry_run and config.startswith("deepspeed"):
            used = "cpu_2proc.yaml"
            self.note(f"dry run: accelerate_configs/{config} replaced by cpu_2proc.yaml (deepspeed is not installed)")
        command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", CONFIGS / used]
        command += ["--num_processes", processes, "--main_process_port", free_port(), *target, *args]
        return command, used

    def note(self, text: str) -> None:
        notes = self.step_record.setdefault("notes", [])
        if text not in notes:
            notes.append(text)

    # --- steps ------------------------------------------------------------------------------------

    def run_step(self, step: str) -> None:
        record = {"id": step, "title": STEPS[step], "started": now(), "runs": {}, "figures": {}}
        self.step_record = self.data["steps"][step] = record
        print(f"step {step}: {STEPS[step]}", flush=True)
        start = time.monotonic()
        try:
            getattr(self, "step_" + step)()
            failed = [r for r in record["runs"].values() if r.get("status") == "failed"]
            if failed:
                record.update(status="failed", error="; ".join(f"{r['name']}: {r['error']}" for r in failed))
                if self.dry_run and all(r.get("expected_in_dry_run") for r in failed):
                    record["expected_in_dry_run"] = True
            elif record["runs"] and all(r.get("status") == "skipped" for r in record["runs"].values()):
                record.update(
                    status="skipped", reason="; ".join(f"{r['name']}: {r['reason']}" for r in record["runs"].values())
                )
            elif stopped := [r for r in record["runs"].values() if r.get("stopped")]:
                # a run cut at the budget, or not started for it, leaves the step's figures unmeasured: the step is
                # still to run (session 4's step 3 read "ok" with its eager run alone)
                record.update(status="skipped", reason="; ".join(f"{r['name']}: {r['reason']}" for r in stopped))
            else:
                record["status"] = "ok"
        except StepFailed as exc:
            record.update(status="failed", error=str(exc))
        except Skip as exc:
            record.update(status="skipped", reason=str(exc))
        except Exception as exc:  # a bug in this step must not cost the others
            record.update(
                status="failed", error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc()[-3000:]
            )
        record["wall_s"] = round(time.monotonic() - start, 2)
        print(f"  -> {record['status']} in {record['wall_s']:.1f} s", flush=True)
        self.save()

    def step_1(self) -> None:
        """scripts/train.py's demo against transformers.Trainer (random batches, and grouped by length),
        both in bf16 on one process, the same work: the demo model and reviews, batch 8, max length 128,
        lr 1e-4 with 10% warm-up, 3 epochs, no checkpoints."""
        s, work = self.sizes, self.results / "step1"
        work.mkdir(exist_ok=True)
        common = ["--max_length", s.cls_max_length, "--seed", 42, *s.cls]
        command, _ = self.accelerate(
            "single_gpu.yaml",
            "train.py",
            "--num_train_epochs",
            s.cls_epochs,
            "--per_device_train_batch_size",
            8,
            "--learning_rate",
            "1e-4",
            "--checkpointing_steps",
            "no",
            "--output_dir",
            work / "ours",
            "--overwrite_output_dir",
            *common,
        )
        runs = {"ours": self.launch("ours", command, work / "ours" / "metrics.json")}
        for name, sampling in (("trainer", "random"), ("trainer_grouped", "group_by_length")):
            if self.dry_run and name == "trainer_grouped":
                reason = "dry run: the same script as trainer, with --sampling group_by_length"
                self.step_record["runs"][name] = {"name": name, "status": "skipped", "reason": reason}
                continue
            out = work / f"{name}.json"
            command = [
                sys.executable,
                BENCH / "baselines" / "trainer_run.py",
                "--out",
                out,
                "--epochs",
                s.cls_epochs,
                "--batch_size",
                8,
                "--lr",
                "1e-4",
                "--output_dir",
                work / f"{name}_out",
                "--sampling",
                sampling,
                "--bf16",
                *common,
            ]
            runs[name] = self.launch(name, command, out)
        rows = {}
        for name, run in runs.items():
            if run["status"] != "ok":
                continue
            if name == "ours":
                data = read_json(work / "ours" / "metrics.json")
                figures = {
                    "samples_per_s": data["train_samples_per_second"],
                    "peak_gpu_memory_mib": max(data.get("peak_gpu_memory_mb_per_rank") or [None], key=none_low),
                    "accuracy": data.get("eval_accuracy"),
                    "padded_per_real": 1 + data.get("train_padding_waste", 0.0),
                    "mixed_precision": data.get("mixed_precision"),
                }
            else:
                data = read_json(work / f"{name}.json")
                figures = {
                    "samples_per_s": data["train_samples"] / data["train_time_s"],
                    "peak_gpu_memory_mib": data.get("peak_gpu_memory_mb"),
                    "accuracy": data.get("eval_accuracy"),
                    "padded_per_real": (data["padded_tokens"] + data["real_tokens"]) / max(data["real_tokens"], 1),
                    "mixed_precision": data.get("mixed_precision"),
                }
            run["figures"] = rows[name] = figures
        for base in ("trainer", "trainer_grouped"):
            if "ours" in rows and base in rows:
                self.step_record["figures"][f"ours_x_{base}"] = (
                    rows["ours"]["samples_per_s"] / rows[base]["samples_per_s"]
                )
        self.table(
            [
                "run",
                "samples/s",
                "× Trainer",
                "× Trainer grouped",
                "peak GPU MiB",
                "accuracy",
                "padded/real",
                "precision",
            ],
            [
                [
                    name,
                    f(r["samples_per_s"], 2),
                    ratio(r, rows.get("trainer"), "samples_per_s"),
                    ratio(r, rows.get("trainer_grouped"), "samples_per_s"),
                    f(r["peak_gpu_memory_mib"], 0),
                    f(r["accuracy"], 4),
                    f(r["padded_per_real"], 3),
                    r["mixed_precision"],
                ]
                for name, r in rows.items()
            ],
        )
        self.step_record["figures"]["target"] = "ours ≥ 1.2× the Trainer's samples/s in bf16"
        half = ((self.data.get("environment") or {}).get("payload") or {}).get("half") or {}
        for name, change in half.items():  # payload.py: carried in float16 to fit one device call
            self.note(
                f"{name} was carried with its float32 weights in float16 and is float32 again (each weight within "
                f"{change['max_rel_error']:.1e} of itself, relative): ours and the Trainer start from these weights"
            )

    def llm(self) -> dict:
        """The LLM's model directory, data files and the facts MFU needs (made once per call, by `environment`)."""
        if not self._llm:
            raise StepFailed(
                f"the LLM could not be prepared: {getattr(self, '_llm_error', 'no LLM step was asked for')}"
            )
        self.step_record["figures"].setdefault("model", self._llm["facts"]["summary"])
        return self._llm

    def sft_command(
        self,
        out: Path,
        *extra,
        config: str = "single_gpu.yaml",
        eval_samples: int | None = None,
        zero_shot: bool = False,
    ) -> tuple[list, str]:
        """scripts/train_sft.py on the step-2 work: the demo's chat records from files both trainers read,
        block 256, bf16 through the launch config, the demo's generation settings; no checkpoints."""
        s, llm = self.sizes, self.llm()
        model = ["--model_name_or_path", llm["gguf_dir"], "--gguf_file", llm["gguf_file"]] if self.dry_run else []
        if self.llm_shape:
            model = ["--model_name_or_path", llm["model_dir"]]
        args = [
            *model,
            "--train_file",
            llm["train_file"],
            "--validation_file",
            llm["validation_file"],
            "--block_size",
            s.block_size,
            "--per_device_train_batch_size",
            s.llm_batch,
            "--num_train_epochs",
            s.llm_epochs,
            "--per_device_eval_batch_size",
            32,
            "--eval_max_new_tokens",
            8,
            "--no-eval_perplexity",
            "--logging_steps",
            5,
            "--seed",
            42,
            "--output_dir",
            out,
            "--overwrite_output_dir",
            *([] if zero_shot else ["--skip_zero_shot"]),
            *(["--max_eval_samples", eval_samples] if eval_samples else []),
            *map(str, extra),
        ]
        if "--checkpointing_steps" not in args:
            args += ["--checkpointing_steps", "no"]
        return self.accelerate(config, "train_sft.py", *args)

    def trl_command(self, out: Path, case_args: list) -> list:
        s, llm = self.sizes, self.llm()
        return [
            sys.executable,
            BENCH / "baselines" / "trl_sft_run.py",
            "--out",
            out,
            "--epochs",
            s.llm_epochs,
            "--batch_size",
            s.llm_batch,
            "--max_length",
            s.block_size,
            "--seed",
            42,
            "--model",
            llm["model_dir"],
            "--train_file",
            llm["train_file"],
            "--output_dir",
            out.with_suffix(""),
            "--bf16",
            "--prompt_completion",
            *case_args,
        ]

    def step_llm(self, step: str) -> None:
        """Our SFT against TRL's SFTTrainer, case by case, on the same records, model, batch, epochs,
        learning rate and schedule, both in bf16 on one process."""
        work, llm = self.results / "step2", self.llm()
        work.mkdir(exist_ok=True)
        have_trl = self.env_has("trl")
        if not have_trl:
            self.note("trl is not installed here: TRL's runs are skipped (on the GPU machine it comes in the payload)")
        rows = []
        for case, (case_step, ours_args, trl_args) in LLM_CASES.items():
            if case_step != step:
                continue
            if self.dry_run and case not in DRY_RUN_CASES:
                self.step_record["runs"][case] = {
                    "name": case,
                    "status": "skipped",
                    "reason": f"dry run: its options are covered by {', '.join(sorted(DRY_RUN_CASES))}",
                }
                continue
            if self.dry_run and "--load_in_4bit" in ours_args and not self.env_has("bitsandbytes"):
                # requirements-dev.txt installs it; on the GPU machine the payload's qlora set does (--require_site)
                reason = "bitsandbytes is not installed here (requirements-dev.txt)"
                self.step_record["runs"][case] = {"name": case, "status": "skipped", "reason": reason}
                continue
            command, _ = self.sft_command(work / case, *ours_args, zero_shot=case == "lora")
            ours = self.launch(case, command, work / case / "metrics.json")
            if ours["status"] == "ok":
                ours["figures"] = sft_figures(
                    read_json(work / case / "metrics.json"), llm["facts"], self.peak(), "ours", case
                )
                rows.append([case, "ours", *row_of(ours["figures"], None)])
            name = f"{case}_trl"
            if not have_trl:
                self.step_record["runs"][name] = {"name": name, "status": "skipped", "reason": "trl is not installed"}
                continue
            trl = self.launch(name, self.trl_command(work / f"{name}.json", trl_args), work / f"{name}.json")
            if trl["status"] == "ok":
                trl["figures"] = sft_figures(read_json(work / f"{name}.json"), llm["facts"], self.peak(), "trl", case)
                base = ours.get("figures")
                if base:
                    base["x_trl"] = base["records_per_s"] / trl["figures"]["records_per_s"]
                    self.step_record["figures"][f"{case}_ours_x_trl"] = base["x_trl"]
                    rows[-1] = [case, "ours", *row_of(base, trl["figures"])]
                rows.append([case, "TRL SFTTrainer", *row_of(trl["figures"], None)])
        self.table(
            [
                "case",
                "trainer",
                "target tokens/s",
                "input tokens/s",
                "records/s",
                "× TRL",
                "MFU",
                "peak GPU MiB",
                "accuracy",
                "padded/real",
                "train s",
            ],
            rows,
        )
        self.step_record["figures"]["target"] = "ours ≥ 1.2× TRL's target tokens/s (= records/s: the same records)"
        self.note(MFU_NOTE)
        self.note(TRL_DIFFERS)

    def step_2a(self) -> None:
        self.step_llm("2a")

    def step_2b(self) -> None:
        self.step_llm("2b")

    def step_13(self) -> None:
        """QLoRA: step 2a's plain LoRA case with --load_in_4bit (the base's linear layers in 4-bit NF4, double
        quantized, by bitsandbytes) against TRL's SFTTrainer with the same BitsAndBytesConfig, as step_llm runs
        each case; then against our plain LoRA run of the same work: the peak GPU memory the 4-bit base saves, the
        target tokens/s it costs, the accuracy. That run is made here, beside it: step 2a's may come from another
        call's GPU, and its peak memory holds the zero-shot evaluation, which neither run here makes."""
        self.step_llm("13")
        record, llm = self.step_record, self.llm()
        qlora = record["runs"].get("qlora", {}).get("figures")
        work = self.results / "step13" / "lora"
        command, _ = self.sft_command(work, *LLM_CASES["lora"][1])
        run = self.launch("lora", command, work / "metrics.json")
        lora = None
        if run["status"] == "ok":
            metrics = read_json(work / "metrics.json")
            lora = run["figures"] = sft_figures(metrics, llm["facts"], self.peak(), "ours", "lora")
        if lora:
            record["table"]["rows"].append(["lora (reference)", "ours", *row_of(lora, None)])
        if qlora and lora:
            memory = (qlora["peak_gpu_memory_mib"], lora["peak_gpu_memory_mib"])
            record["figures"].update(
                qlora_x_lora_target_tokens_per_s=ratio_of(qlora["target_tokens_per_s"], lora["target_tokens_per_s"]),
                qlora_x_lora_peak_gpu_memory=ratio_of(*memory),
                qlora_saves_gpu_mib=memory[1] - memory[0] if None not in memory else None,
                qlora_accuracy=qlora["accuracy"],
                lora_accuracy=lora["accuracy"],
            )
        self.note(QLORA_NOTE)

    def step_14(self) -> None:
        """scripts/train.py with the LLM as a classifier (its causal LM's body, a new score head) on step 1's work
        (the demo's reviews, batch 8, max length 128, 3 epochs, no checkpoints) at the script's default learning
        rates (1e-4 whole, 5e-4 with LoRA): full fine-tuning, LoRA r16 (adapters on the body, the new head whole) and
        QLoRA (the same on a 4-bit NF4 base, the head kept out of 4-bit): samples/s, peak GPU memory, accuracy, what
        is saved; LoRA against full, QLoRA against LoRA. The adapters are merged (--merge_lora: QLoRA's merge reads
        the base again unquantized) and each saved classifier reloads."""
        s, work, llm = self.sizes, self.results / "step14", self.llm()
        self.step_record["figures"]["model"] = llm["facts"]["model"]  # its chat records are not this step's work
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir()
        common = ["--model_name_or_path", llm["model_dir"], "--num_train_epochs", s.cls_epochs]
        common += ["--per_device_train_batch_size", 8, "--max_length", s.cls_max_length, "--seed", 42, *s.cls]
        common += ["--checkpointing_steps", "no", "--overwrite_output_dir"]
        cases = {"full": [], "lora": ["--lora_r", 16, "--merge_lora"]}
        cases["qlora"] = [*cases["lora"], "--load_in_4bit"]
        if not self.env_has("bitsandbytes"):  # the dry run without requirements-dev.txt's bitsandbytes
            del cases["qlora"]
            reason = "bitsandbytes is not installed here (requirements-dev.txt; the payload's qlora set)"
            self.step_record["runs"]["qlora"] = {"name": "qlora", "status": "skipped", "reason": reason}
        rows, saved = {}, []
        for case, options in cases.items():
            out = work / case
            command, _ = self.accelerate("single_gpu.yaml", "train.py", *common, *options, "--output_dir", out)
            run = self.launch(case, command, out / "metrics.json")
            if run["status"] != "ok":
                continue
            run["figures"] = rows[case] = classifier_figures(out, (self.results / run["log"]).read_text())
            saved.append(out / "merged" if options else out)
        if saved:
            reloaded = self.helper("reload", *saved)
            for case, directory in zip(rows, saved):
                rows[case]["reloads"] = reloaded[str(directory)]["summary"]
                if not reloaded[str(directory)]["ok"]:
                    self.step_record["runs"][case].update(status="failed", error=reloaded[str(directory)]["problem"])
        figures = self.step_record["figures"]
        for a, b in (("lora", "full"), ("qlora", "lora"), ("qlora", "full")):
            if a in rows and b in rows:
                figures[f"{a}_x_{b}_samples_per_s"] = ratio_of(rows[a]["samples_per_s"], rows[b]["samples_per_s"])
                figures[f"{a}_x_{b}_peak_gpu_memory"] = ratio_of(
                    rows[a]["peak_gpu_memory_mib"], rows[b]["peak_gpu_memory_mib"]
                )
        figures.update({f"{case}_accuracy": row["accuracy"] for case, row in rows.items()})
        columns = ["run", "samples/s", "× full", "peak GPU MiB", "× full", "peak RSS MiB", "accuracy", "trainable"]
        self.table(
            [*columns, "saved MiB", "reloads"],
            [
                [
                    case,
                    f(r["samples_per_s"], 2),
                    ratio(r, rows.get("full"), "samples_per_s"),
                    f(r["peak_gpu_memory_mib"], 0),
                    ratio(r, rows.get("full"), "peak_gpu_memory_mib"),
                    f(r["peak_rss_mib"], 0),
                    f(r["accuracy"], 4),
                    r["trainable"],
                    f(r["saved_mib"], 1),
                    r.get("reloads"),
                ]
                for case, r in rows.items()
            ],
        )
        self.note(CLASSIFIER_NOTE)

    def step_3(self) -> None:
        """--torch_compile on the LoRA case (in the dry run, LoRA with packing): compile time (training time
        above the compiled steady state) and speed-up (steady-state tokens/s, compiled over eager), against
        step 2a's eager run of the same case."""
        work = self.results / "step3"
        work.mkdir(exist_ok=True)
        case = "lora_packed" if self.dry_run else "lora"  # the dry run's step 2a runs lora_packed only
        ours_args = LLM_CASES[case][1]
        eager_dir = self.results / "step2" / case
        earlier = self.data["steps"].get("2a", {}).get("runs", {}).get(case, {})
        if earlier.get("status") == "ok" and (eager_dir / "metrics.json").exists():
            self.note(f"eager reference: step 2a's {case} run (the same work)")
        else:
            eager_dir = work / "eager"
            command, _ = self.sft_command(eager_dir, *ours_args, "--eval_max_new_tokens", 0)
            if self.launch("eager", command, eager_dir / "metrics.json")["status"] != "ok":
                raise StepFailed("the eager reference run failed")
        command, _ = self.sft_command(
            work / "compiled", *ours_args, "--torch_compile", "--eval_max_new_tokens", 0, *self.sizes.compiled
        )
        env = {"TORCH_LOGS": "recompiles,graph_breaks"}
        if self.dry_run:
            # Inductor's C++ build of even a tiny model takes minutes on 2 cores. Dynamo's eager backend traces the
            # same graphs, so their breaks and recompiles show, and runs them uncompiled. The scripts compile with
            # backend="inductor" whatever ACCELERATE_DYNAMO_BACKEND says; torch's per-graph backend override (for
            # bisecting, since torch 2.11) applies to every graph from the first.
            env["TORCH_COMPILE_OVERRIDE_BACKENDS"] = ">=0:eager"
            self.note(
                "dry run: TORCH_COMPILE_OVERRIDE_BACKENDS='>=0:eager': dynamo traces the model, nothing is compiled"
            )
        run = self.launch("compiled", command, work / "compiled" / "metrics.json", env=env, timeout=600)
        if run["status"] != "ok":
            return
        eager, compiled = steady(eager_dir), steady(work / "compiled")
        compiled_metrics = read_json(work / "compiled" / "metrics.json")
        log = (self.results / run["log"]).read_text(errors="replace")
        figures = {
            "eager_steady_tokens_per_s": eager["steady_tokens_per_s"],
            "compiled_steady_tokens_per_s": compiled["steady_tokens_per_s"],
            "speed_up_steady": ratio_of(compiled["steady_tokens_per_s"], eager["steady_tokens_per_s"]),
            "eager_train_s": eager["train_s"],
            "compiled_train_s": compiled["train_s"],
            "speed_up_end_to_end": ratio_of(eager["train_s"], compiled["train_s"]),
            "compile_s": compiled["train_s"] - compiled["tokens"] / compiled["steady_tokens_per_s"]
            if compiled["steady_tokens_per_s"]
            else None,
            "recompiles": log.count("Recompiling function"),
            **{k: compiled_metrics.get(k) for k in ("compiled_graphs", "traced_operators")},
            **graph_breaks(log),
        }
        run["figures"] = figures
        self.step_record["figures"].update(figures)
        rows = [[k, v if isinstance(v, int) else f(v, 3)] for k, v in figures.items() if k != "graph_break_places"]
        rows += [[f"graph breaks at {place}", count] for place, count in figures["graph_break_places"].items()]
        self.table(["figure", "value"], rows)
        self.note(
            "compile_s: the compiled run's training time minus its tokens at the compiled steady speed (median "
            "tokens/s of the logged windows of the second half: compilation and recompiles for new shapes)"
        )
        self.note(
            "graph_breaks: the breaks dynamo logged (TORCH_LOGS=graph_breaks), each frame it compiled and broke, a "
            "recompile's again; the code between breaks runs eagerly, so the speed-up is that of the pieces"
        )

    def step_4(self) -> None:
        """FSDP (fsdp.yaml: FSDP2, full shard per layer, bf16) on one GPU: full fine-tuning for N steps
        with a checkpoint every N/2 (a sharded save on the GPU), its speed and peak GPU memory; the saved
        model reloads with from_pretrained. What a CPU shows (the same model as DDP, exact and elastic
        resume, LoRA, merging, every script) is tested on CPU processes: tests/test_fsdp.py."""
        s, work = self.sizes, self.results / "step4"
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir()
        steps = ["--max_train_steps", s.sharded_steps, "--checkpointing_steps", s.checkpoint_every]
        command, _ = self.sft_command(work / "run", *FULL, *steps, config="fsdp.yaml", eval_samples=s.sharded_eval)
        first = self.launch("train", command, work / "run" / "metrics.json")
        if first["status"] != "ok":
            raise StepFailed(f"train: {first['error']}")
        data = read_json(work / "run" / "metrics.json")
        first["figures"] = sft_figures(data, self.llm()["facts"], self.peak(), "ours", "full")
        reloaded = self.helper("reload", work / "run", "--reference", work / "run")
        reload = reloaded[str(work / "run")]
        self.step_record["runs"]["reload"] = {
            "name": "reload",
            "status": "ok" if reload["ok"] else "failed",
            "figures": reload,
            **({} if reload["ok"] else {"error": reload["problem"]}),
        }
        self.step_record["figures"].update({"train": first["figures"], "reload": reload})
        t = first["figures"]
        self.table(
            ["check", "result"],
            [
                [
                    "trains (target tokens/s, MFU, peak GPU MiB)",
                    f"{f(t['target_tokens_per_s'], 0)}, {f(t['mfu'], 4)}, {f(t['peak_gpu_memory_mib'], 0)}",
                ],
                ["accuracy on the eval prompts (generation under FSDP)", f(t["accuracy"], 4)],
                ["saved model reloads with from_pretrained", reload.get("summary")],
            ],
        )

    def step_5(self) -> None:
        """DeepSpeed ZeRO-2 and ZeRO-3 (the repository's configs, bf16) with one process: full fine-tuning for
        N steps, generation on a few eval prompts, the saved model reloaded."""
        s, work = self.sizes, self.results / "step5"
        work.mkdir(exist_ok=True)
        environment = self.data.get("environment", {})
        if not (environment.get("packages") or {}).get("deepspeed"):
            why = environment.get("deepspeed_import_error") or (
                (environment.get("payload") or {}).get("skipped_wheels") or {}
            ).get("deepspeed")
            reason = f"deepspeed cannot be imported here{f' ({why})' if why else ''}"
            if not self.dry_run:
                raise Skip(reason)
            self.note(f"on the GPU machine this step would be skipped: {reason}")
        rows, on_cpu_2proc = [], self.dry_run and not importlib.util.find_spec("deepspeed")
        for stage in (2, 3):
            name = f"zero{stage}"
            if on_cpu_2proc and stage == 3:
                self.step_record["runs"][name] = {
                    "name": name,
                    "status": "skipped",
                    "reason": "dry run: without deepspeed both stages run the same cpu_2proc.yaml command",
                }
                continue
            steps = ["--max_train_steps", s.sharded_steps]
            command, _ = self.sft_command(
                work / name, *FULL, *steps, config=f"deepspeed_zero{stage}.yaml", eval_samples=s.sharded_eval
            )
            run = self.launch(name, command, work / name / "metrics.json")
            if run["status"] != "ok":
                continue
            figures = sft_figures(
                read_json(work / name / "metrics.json"), self.llm()["facts"], self.peak(), "ours", "full"
            )
            if on_cpu_2proc:  # the same helper as step 4's, on a CPU run that is no ZeRO run
                figures["reload"] = {"summary": "not checked in the dry run"}
            else:
                figures["reload"] = self.helper("reload", work / name)[str(work / name)]
            run["figures"] = figures
            rows.append(
                [
                    name,
                    f(figures["target_tokens_per_s"], 0),
                    f(figures["mfu"], 4),
                    f(figures["peak_gpu_memory_mib"], 0),
                    f(figures["accuracy"], 4),
                    figures["reload"].get("summary"),
                ]
            )
        self.table(["stage", "target tokens/s", "MFU", "peak GPU MiB", "accuracy", "saved model reloads"], rows)

    def step_6(self) -> None:
        """train_image.py's demo on one GPU (single_gpu.yaml, bf16), plain and with --sync_batchnorm. On one
        process torch's SyncBatchNorm computes plain BatchNorm (it syncs only in a world of more than one
        process): this checks the conversion, the GPU guard and the training, not the all-reduce."""
        s, work = self.sizes, self.results / "step6"
        work.mkdir(exist_ok=True)
        rows = []
        for name, extra in (("plain", []), ("sync_batchnorm", ["--sync_batchnorm"])):
            if self.dry_run and name == "plain":  # the same command as step 7's image run, but for its fp16
                reason = "dry run: step 7 runs it"
                self.step_record["runs"][name] = {"name": name, "status": "skipped", "reason": reason}
                continue
            command, _ = self.accelerate(
                "single_gpu.yaml",
                "train_image.py",
                "--output_dir",
                work / name,
                "--overwrite_output_dir",
                "--checkpointing_steps",
                "no",
                "--seed",
                42,
                *s.image,
                *extra,
            )
            run = self.launch(
                name,
                command,
                work / name / "metrics.json",
                expect_error="--sync_batchnorm needs GPUs" if extra else None,
            )
            if run["status"] != "ok":
                continue
            data = read_json(work / name / "metrics.json")
            log = (self.results / run["log"]).read_text(errors="replace")
            converted = re.search(r"--sync_batchnorm: (\d+) BatchNorm layers", log)
            run["figures"] = figures = {
                "images_per_s": data["train_samples_per_second"],
                "accuracy": data.get("eval_accuracy"),
                "peak_gpu_memory_mib": max(data.get("peak_gpu_memory_mb_per_rank") or [None], key=none_low),
                "batchnorm_layers_converted": int(converted.group(1)) if converted else 0,
            }
            rows.append(
                [
                    name,
                    f(figures["images_per_s"], 0),
                    f(figures["accuracy"], 4),
                    f(figures["peak_gpu_memory_mib"], 0),
                    figures["batchnorm_layers_converted"],
                ]
            )
        self.table(["run", "images/s", "accuracy", "peak GPU MiB", "BatchNorm layers converted"], rows)

    def step_7(self) -> None:
        """fp16 as users run it on a GPU: autocast to float16 and torch's loss scaler, here with a first
        scale of 2**40 (tests/launched/fp16_scaler.py) so that the first steps overflow and are skipped
        while the scale comes down. The image demo and the LoRA SFT of step 2 must both finish, counting
        the skipped steps; before the fix the first skipped step stopped every fp16 run."""
        s, work = self.sizes, self.results / "step7"
        work.mkdir(exist_ok=True)
        image, _ = self.accelerate(
            "single_gpu.yaml", "train_image.py", "--output_dir", work / "image", "--overwrite_output_dir", "--seed", 42
        )
        image += ["--checkpointing_steps", "no", *s.image]
        sft, _ = self.sft_command(work / "lora", *LORA, *s.fp16_llm)
        rows = []
        for name, command in (("image", image), ("lora", sft)):
            run = self.launch(name, fp16(command), work / name / "metrics.json", env={"FP16_INIT_SCALE": str(2.0**40)})
            if run["status"] != "ok":
                continue
            data = read_json(work / name / "metrics.json")
            records = read_jsonl(work / name / "train_log.jsonl")
            scales = [r["train/loss_scale"] for r in records if "train/loss_scale" in r]
            run["figures"] = figures = {
                "steps": data["optimizer_steps"],
                "skipped_steps": data.get("optimizer_steps_skipped"),
                "final_loss_scale": scales[-1] if scales else None,
                "accuracy": data.get("eval_accuracy"),
                "samples_per_s": data["train_samples_per_second"],
            }
            rows.append([name, *(f(figures[k], 4) if k == "accuracy" else cell(figures[k]) for k in figures)])
        self.table(["run", "steps", "skipped (overflows)", "final loss scale", "accuracy", "samples/s"], rows)

    def step_8(self) -> None:
        """bench/bench_manifest.py on the machine's own disk: a checkpoint of several GB (a model of linear
        layers and its AdamW moments, on the GPU) saved with the manifest (each rank hashes the files it
        wrote while they are flushed) and without checksums, and resumed with the check (sizes, then
        checksums) and without, with the page cache dropped where the machine lets us."""
        s, work = self.sizes, self.results / "step8"
        work.mkdir(exist_ok=True)
        out = work / "bench_manifest.json"
        command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", CONFIGS / "single_gpu.yaml"]
        command += ["--num_processes", 1, "--main_process_port", free_port(), BENCH / "bench_manifest.py"]
        command += ["--size_gb", s.checkpoint_gb, "--repeats", s.checkpoint_repeats, "--dir", work, "--json", out]
        if not self.dry_run and os.access("/proc/sys/vm/drop_caches", os.W_OK):
            command.append("--cold")
        run = self.launch("manifest", command, out)
        if run["status"] == "ok":
            run["figures"] = figures = read_json(out)
            self.step_record["figures"].update(
                manifest_adds_to_a_save=figures["manifest_adds_to_a_save"],
                check_adds_to_a_resume=figures["check_adds_to_a_resume"],
            )
            self.table(["what", "seconds"], [[k, f(v, 2)] for k, v in figures["seconds"].items()])
        self.step_record["figures"]["target"] = "the manifest adds at most 5% to a save"

    def step_9(self) -> None:
        """bench/bench_dpo.py on one GPU, in bf16: ours (LoRA, the reference with the adapters off, and
        precomputed) against TRL's DPOTrainer with the same reference, on the DPO demo's 600 pairs, batch 4."""
        figures = self.side_by_side("9", "bench_dpo", self.sizes.dpo, "pairs")
        for ours, trl in (("ours", "trl"), ("ours_precomputed", "trl_precomputed")):
            if ours in figures and trl in figures:
                self.step_record["figures"][f"{ours}_x_trl"] = figures[ours]["per_s"] / figures[trl]["per_s"]
        self.step_record["figures"]["target"] = "ours ≥ 1.5× TRL's pairs/s, with less peak memory"

    def step_10(self) -> None:
        """bench/bench_grpo.py on one GPU, in bf16: ours (LoRA, G 8, 8 new tokens, no reference), and ours with
        --compile_generation (decoding in CUDA graphs), against TRL's GRPOTrainer with the same settings and
        rewards, all generating with the policy (no vLLM). The compiled run's prompts/s include its compilation;
        its steady figure (the later half of its logged windows) does not."""
        figures = self.side_by_side("10", "bench_grpo", self.sizes.grpo, "prompts")
        self.record_compiled_against_trl(figures)
        for ours in ("ours", "ours_compiled"):
            if ours in figures:
                self.step_record["figures"][f"{ours}_generation_share"] = figures[ours].get("generation_share")
        self.step_record["figures"]["target"] = "ours ≥ 1.5× TRL's prompts/s, without vLLM on either side"

    def step_11(self) -> None:
        """bench/bench_dpo.py on one GPU, in bf16: ours with --torch_compile (inductor; LoRA, the reference as the
        adapters off), whose fewer launches are what step 9 found its step lacking, against TRL's DPOTrainer, on 300
        of step 9's pairs. The compiled run's pairs/s include its compilations; its steady figure does not. The dry
        run traces the compiled run with dynamo's eager backend."""
        env = None
        if self.dry_run:  # as step 3: inductor's C++ build would take minutes on 2 cores
            env = {"TORCH_COMPILE_OVERRIDE_BACKENDS": ">=0:eager"}
            self.note(
                "dry run: TORCH_COMPILE_OVERRIDE_BACKENDS='>=0:eager': dynamo traces the model, nothing is compiled"
            )
        figures = self.side_by_side("11", "bench_dpo", self.sizes.dpo_compiled, "pairs", env=env)
        self.record_compiled_against_trl(figures)
        record = self.step_record["figures"]
        if "ours_compiled" in figures and "trl" in figures:  # without the compilations, against TRL's whole loop
            record["ours_compiled_steady_x_trl"] = ratio_of(
                figures["ours_compiled"].get("steady_per_s"), figures["trl"]["per_s"]
            )
        record["target"] = "ours ≥ 1.5× TRL's pairs/s"

    def step_12(self) -> None:
        """bench/bench_grpo.py --profile on one GPU, in bf16: ours, ours with cuDNN's attention off, and TRL's
        trainer, 12 steps each, steps 4 to 8 under torch.profiler (bench/step_profile/): where a step's time goes.
        Session 4 profiled GRPO and DPO (ours' and TRL's): DPO's steps the same operators as TRL's, and ours' GRPO
        spending 0.49 s a step in cuDNN attention's host code against TRL's 0.095; since then GRPO's rows pad to a
        multiple of 8, and the run without cuDNN's attention measures what it costs. Each profile: the step's
        seconds, the GPU's busy share, kernel launches and waits for the GPU, the host's seconds inside and outside
        torch's operators and inside `generate`, and the top operators, each with its longest and median call."""
        sys.path.insert(0, str(REPO / "bench"))
        from side_by_side import top_host_operator

        record, rows, bench = self.step_record["figures"], [], "bench_grpo"
        figures = self.side_by_side("12", bench, self.sizes.grpo_profiled, "prompts", self.sizes.profile_window, bench)
        for name, run in figures.items():
            profile = run.get("profile")
            if not profile:
                self.note(f"{bench} {name}: no profile (fewer steps than its profiled window)")
                continue
            record[f"{bench}_{name}"] = profile
            rows.append([f"{bench} {name}", f(profile["step_s"], 4), f(profile["gpu_busy_share"], 3)])
            rows[-1] += [f(profile["launches"], 0), f(profile["syncs"], 0), f(profile["sync_wait_s"], 4)]
            rows[-1] += [f(profile[key], 4) for key in ("host_in_operators_s", "host_outside_operators_s")]
            rows[-1] += [f(profile["generate_s"], 4), top_host_operator(profile)]
        ours, trl = record.get(f"{bench}_ours"), record.get(f"{bench}_trl")
        without = record.get(f"{bench}_ours_no_cudnn_attention")
        if ours and trl:
            record[f"{bench}_ours_x_trl_step_time"] = ours["step_s"] / trl["step_s"]
        if without and (without.get("cudnn_attention") or any("_cudnn_att" in r["name"] for r in without["host_top"])):
            self.note(f"{bench} ours_no_cudnn_attention: cuDNN's attention still ran (the switch did not take)")
        elif ours and without:
            record[f"{bench}_no_cudnn_attention_x_ours_step_time"] = without["step_s"] / ours["step_s"]
        columns = ["run", "s / step", "GPU busy share", "launches", "GPU waits", "waiting s"]
        columns += ["host in operators s", "host outside s", "in generate s", "top host operator"]
        self.table(columns, rows)

    def record_compiled_against_trl(self, figures: dict) -> None:
        """Steps 10 and 11: ours and ours compiled × TRL, their steady speeds, compiled ÷ eager (steady), and what
        the compiled run compiled (did it compile, into how many graphs, unbroken?)."""
        record = self.step_record["figures"]
        for ours in ("ours", "ours_compiled"):
            if ours in figures and "trl" in figures:
                record[f"{ours}_x_trl"] = figures[ours]["per_s"] / figures["trl"]["per_s"]
            if ours in figures:
                record[f"{ours}_steady_per_s"] = figures[ours].get("steady_per_s")
        for key in compile_count_names():
            if key in figures.get("ours_compiled", {}):
                record[f"ours_compiled_{key}"] = figures["ours_compiled"][key]
        if "ours" in figures and "ours_compiled" in figures:
            record["compiled_x_eager_steady"] = ratio_of(
                figures["ours_compiled"].get("steady_per_s"), figures["ours"].get("steady_per_s")
            )

    def side_by_side(
        self, step: str, bench: str, sizes: list, unit: str, env: dict | None = None, subdir: str = ""
    ) -> dict:
        """bench/<bench>.py (ours against TRL) with one process and single_gpu.yaml on the prepared LLM: its
        figures by contender ({} if it failed), and the step's table. `subdir`: a folder of the step's own for
        this bench (a step that runs two)."""
        work = self.results / f"step{step}" / subdir
        work.mkdir(parents=True, exist_ok=True)
        out = work / f"{bench}.json"
        command = [sys.executable, BENCH / f"{bench}.py", "--processes", 1, "--config", "single_gpu.yaml"]
        command += ["--workdir", work, "--json", out, "--model", self.llm()["model_dir"], *sizes]
        run = self.launch(bench, command, out, timeout=None if self.dry_run else 600, env=env)
        if not out.exists():  # removed before the run: what is there, its contenders that finished wrote
            return {}
        run["figures"] = figures = read_json(out)
        if run["status"] != "ok":
            self.note(f"{bench} {run['status']}: the figures of the contenders that finished ({', '.join(figures)})")
        rows = [
            [name, f(r["per_s"], 3), f(r.get("gpu_mib"), 0), f(r["peak_rss_mib"], 0), r["steps"]]
            for name, r in figures.items()
        ]
        self.table(["run", f"{unit}/s", "peak GPU MiB", "peak RSS MiB", "steps"], rows)
        return figures

    # --- helpers of the steps ---------------------------------------------------------------------------

    def env_has(self, package: str) -> bool:
        return bool(self.data.get("environment", {}).get("packages", {}).get(package))

    def peak(self) -> float | None:
        gpu = (self.data.get("environment", {}).get("gpu") or {}).get("name") or ""
        return next((peak for name, peak in PEAK_BF16 if name in gpu), None)

    def table(self, columns: list, rows: list) -> None:
        self.step_record["table"] = {"columns": columns, "rows": rows}

    # --- results ----------------------------------------------------------------------------------

    def save(self) -> None:
        self.data["updated"] = now()
        self.data["steps"] = {step: self.data["steps"][step] for step in STEPS if step in self.data["steps"]}
        write_results(self.results, self.data, self.copy_to)


def fp16(command: list) -> list:
    """An `accelerate launch` command of a script made fp16 with the loss scaler: the launch asks for
    fp16, and the script runs through tests/launched/fp16_scaler.py (FP16_INIT_SCALE: its first scale)."""
    at = next(i for i, part in enumerate(command) if str(part).startswith(str(REPO / "scripts")))
    script = Path(str(command[at])).stem
    port = command.index("--main_process_port")
    return [*command[:port], "--mixed_precision", "fp16", *command[port:at], FP16_SCALER, script, *command[at + 1 :]]


def write_results(results: Path, data: dict, copy_to: Path | None) -> None:
    """gpu_check.json and gpu_check.md in `results`; with `copy_to` ($OUT on the GPU machine) also there,
    with every log (logs/, lanes/*/logs/, and the side-by-side steps' runs: their logs and ours' train_log.jsonl,
    whose records hold what the step's table does not, such as GRPO's generation share step by step) in
    gpu_check_logs.tar.gz."""
    write_atomic(results / "gpu_check.json", json.dumps(data, indent=2, default=str) + "\n")
    write_atomic(results / "gpu_check.md", markdown(data))
    if not copy_to:
        return
    try:
        copy_to.mkdir(parents=True, exist_ok=True)
        shutil.copy(results / "gpu_check.json", copy_to / "gpu_check.json")
        shutil.copy(results / "gpu_check.md", copy_to / "gpu_check.md")
        with tarfile.open(copy_to / "gpu_check_logs.tar.gz", "w:gz") as tar:
            logs = []
            for where in (results, *results.glob("lanes/*")):  # the dry run's lanes hold their steps' folders
                logs += [*where.glob("logs/*.log"), *where.glob("step*/*.log"), *where.glob("step*/*/train_log.jsonl")]
            for log in sorted(logs):
                tar.add(log, arcname=str(log.relative_to(results)))
    except OSError as exc:
        print(f"could not copy the results to {copy_to}: {exc}", flush=True)


class Skip(Exception):
    pass


MFU_NOTE = (
    "MFU = model FLOPs of the work / training seconds / the GPU's dense bf16 peak (H100 SXM and H200: 989 TFLOP/s). "
    "Model FLOPs, counted from the model (not the kernels): per real input token 2 FLOPs per weight of the "
    "transformer layers' linear maps (P), at each target position 2 per weight of the LM head (V×d; the loss needs "
    "no logits elsewhere), and causal attention 2·layers·d_attn·L per token (L: its record's length, from the "
    "records' token counts). Full fine-tuning: 3× that forward (the backward computes gradients of the inputs and of "
    "the weights). LoRA: the frozen weights need only the gradients of their inputs, so 2× the forward of the "
    "linear maps and the head, 3× the attention, plus 6 per LoRA weight per token. Gradient checkpointing's "
    "recomputed forward is not counted (MFU, not hardware FLOPs utilisation). TRL's MFU counts its own loss "
    "positions as targets; its LM head at the other positions is work outside the model FLOPs."
)
QLORA_NOTE = (
    "QLoRA on both sides: bitsandbytes' BitsAndBytesConfig(load_in_4bit, nf4, double quantization, computing in "
    "bf16), quantized on the GPU it trains on; LoRA r16 on every linear layer. TRL casts the adapters to bf16 on a "
    "quantized base (its QLoRA choice); ours trains them in fp32, as its plain LoRA. qlora_x_lora: ours on the "
    "4-bit base over ours on the full-precision base, the same work (below 1: the speed the dequantization costs); "
    "qlora_saves_gpu_mib: the peak GPU memory it saves. MFU counts LoRA's model FLOPs (dequantizing is outside them)."
)
CLASSIFIER_NOTE = (
    "The LLM as train.py's classifier (AutoModelForSequenceClassification: its body, a new score head reading the "
    "last token that is not padding): full fine-tuning at train.py's default 1e-4, LoRA r16 (alpha 16, dropout "
    "0.05, every linear layer of the body; the score head trains whole) and QLoRA (the same on a 4-bit NF4 base, "
    "double quantized, computing in bf16; the head not quantized) at its default 5e-4; bf16 autocast with fp32 "
    "trainable weights. samples/s: training alone (metrics.json's train_runtime_s); peak GPU memory: the run's "
    "whole peak, evaluation included. saved MiB: the adapter, or the whole model; merged/ is not counted."
)
TRL_DIFFERS = (
    "What differs from TRL: TRL's loss covers the completion's tokens as its chat template renders them (the "
    "answer, <|im_end|> and the newline after it; ours stops at <|im_end|>); TRL computes the LM head at every "
    "position (in chunks, its fused head) and per-step token accuracy and entropy metrics with host syncs; ours "
    "runs the head at target positions only. TRL without packing is padding-free (each batch one flattened "
    "sequence, block-diagonal attention from position_ids); ours pads each length-grouped batch to a multiple of "
    "8. Both: bf16 autocast with fp32 trainable weights, fused AdamW, one process, no DDP."
)


# --- figures ----------------------------------------------------------------------------------------


def sft_figures(data: dict, facts: dict, peak: float | None, who: str, case: str) -> dict:
    """Throughput, MFU, memory and accuracy of one SFT run (ours: metrics.json; TRL: its results JSON)."""
    if who == "ours":
        seconds, records = data["train_runtime_s"], data["train_samples_seen"]
        if case.endswith("_packed"):  # ours counts packed rows as its samples: the records are what both train
            records = (facts["records"] - data.get("train_records_dropped", 0)) * data["epochs"]
        tokens, targets = data["train_tokens_seen"], data["train_target_tokens_seen"]
        memory = max(data.get("peak_gpu_memory_mb_per_rank") or [None], key=none_low)
        padded = 1 + data.get("train_padding_waste", 0.0)
    else:
        seconds, records = data["train_time_s"], data["train_samples"]
        tokens, targets = data["real_tokens"], data["target_tokens"]
        memory = data.get("peak_gpu_memory_mb")
        padded = (data["padded_tokens"] + data["real_tokens"]) / max(data["real_tokens"], 1)
    # QLoRA's model FLOPs are LoRA's: dequantizing the 4-bit weights in each pass is work outside them
    flops = model_flops(facts, tokens, targets, lora="lora" in case)
    return {
        "train_s": seconds,
        "records_per_s": records / seconds,
        "input_tokens_per_s": tokens / seconds,
        "target_tokens_per_s": targets / seconds,
        "model_tflop_per_s": flops / seconds / 1e12,
        "mfu": flops / seconds / peak if peak else None,
        "peak_gpu_memory_mib": memory,
        "accuracy": data.get("eval_accuracy"),
        "zero_shot_accuracy": data.get("zero_shot_accuracy"),
        "padded_per_real": padded,
        "records": records,
        "input_tokens": tokens,
        "target_tokens": targets,
    }


def classifier_figures(out: Path, log: str) -> dict:
    """One train.py run of step 14: its metrics.json, the weights it trained (its log's LoRA line) and saved."""
    data = read_json(out / "metrics.json")
    lora = re.search(r"LoRA r=\d+: ([\d,]+) trainable of ([\d,]+) parameters", log)
    files = [*out.glob("*.safetensors")]  # the adapter, or the whole model (merged/ is not counted)
    return {
        "samples_per_s": data["train_samples_per_second"],
        "train_s": data["train_runtime_s"],
        "peak_gpu_memory_mib": max(data.get("peak_gpu_memory_mb_per_rank") or [None], key=none_low),
        "peak_rss_mib": max(data.get("peak_memory_mb_per_rank") or [None], key=none_low),
        "accuracy": data.get("eval_accuracy"),
        "f1": data.get("eval_f1"),
        "trainable": f"{lora.group(1)} of {lora.group(2)}" if lora else "all",
        "saved_mib": sum(path.stat().st_size for path in files) / 2**20,
        "mixed_precision": data.get("mixed_precision"),
    }


def model_flops(facts: dict, tokens: float, targets: float, lora: bool) -> float:
    """Model FLOPs of training on `tokens` real input tokens with `targets` loss positions (see MFU_NOTE)."""
    linear = 2 * facts["linear_params"] * tokens
    head = 2 * facts["head_params"] * targets
    # Per layer, a token attending to n earlier ones: n·d multiply-adds for the scores, n·d for the weighted sum.
    attention = 4 * facts["layers"] * facts["attention_width"] * facts["mean_tokens_attended"] * tokens
    if not lora:
        return 3 * (linear + head + attention)
    return 2 * (linear + head) + 3 * attention + 6 * facts["lora_params"] * tokens


def row_of(figures: dict, trl: dict | None) -> list:
    return [
        f(figures["target_tokens_per_s"], 0),
        f(figures["input_tokens_per_s"], 0),
        f(figures["records_per_s"], 2),
        f(figures["records_per_s"] / trl["records_per_s"], 3) if trl else "-",
        f(figures["mfu"], 4),
        f(figures["peak_gpu_memory_mib"], 0),
        f(figures["accuracy"], 4)
        + (
            f" (zero-shot {figures['zero_shot_accuracy']:.4f})" if figures.get("zero_shot_accuracy") is not None else ""
        ),
        f(figures["padded_per_real"], 3),
        f(figures["train_s"], 1),
    ]


def steady(run_dir: Path) -> dict:
    """A run's training seconds and tokens, and its steady-state tokens/s: the median over the logged
    windows of the second half of training."""
    data = read_json(run_dir / "metrics.json")
    speeds = [
        r["train/tokens_per_second"] for r in read_jsonl(run_dir / "train_log.jsonl") if "train/tokens_per_second" in r
    ]
    late = speeds[len(speeds) // 2 :] or speeds
    return {
        "train_s": data["train_runtime_s"],
        "tokens": data["train_tokens_seen"],
        "steady_tokens_per_s": statistics.median(late) if late else None,
    }


def graph_breaks(log: str) -> dict:
    """The graph breaks dynamo logged (TORCH_LOGS=graph_breaks), so that a speed-up measured on a fragmented
    graph says so: how many (each frame dynamo compiled and broke, a recompile's again: what torch's own
    counter counts), and how many at each place, "file:line: the operator or reason"."""
    places: dict[str, int] = {}
    lines = [line.split("[__graph_breaks]", 1)[-1].strip() for line in log.splitlines()]
    for at, line in enumerate(lines):
        found = re.match(r"Graph break .*in user code at (\S+):(\d+)", line)
        if not found:
            continue
        why = ""
        for text in lines[at + 1 : at + 12]:  # the first break's operator, or else its reason
            if text.startswith("Developer debug context:"):
                why = text.removeprefix("Developer debug context:").strip()
                break
            if text.startswith("Graph Break Reason:") and not why:
                why = text.removeprefix("Graph Break Reason:").strip()
        place = f"{Path(found.group(1)).name}:{found.group(2)}: {why[:120] or 'no reason logged'}"
        places[place] = places.get(place, 0) + 1
    return {"graph_breaks": sum(places.values()), "graph_break_places": places}


def last_loss(run_dir: Path) -> float | None:
    losses = [r["train/loss"] for r in read_jsonl(run_dir / "train_log.jsonl") if "train/loss" in r]
    return losses[-1] if losses else None


# --- the call plan ----------------------------------------------------------------------------------


def run_estimate_s(step: str, run: str) -> float:
    """A run's seconds on the GPU: measured there (GPU_S), else RUN_S's estimate: the dry run's wall time scaled,
    plus the work; TRL's runs share one."""
    if (step, run) in GPU_S:
        return GPU_S[(step, run)]
    dry, work = RUN_S.get((step, "trl") if run.endswith("_trl") else (step, run), (30.0, 60))
    return STARTUP_SCALE * dry + work


def gpu_runs(step: str) -> list[str]:
    """The runs a step makes on the GPU: each of its LLM cases', ours and TRL's, and its other runs in RUN_S but step
    3's eager one (made only on a machine without step 2a's). Step 13's LoRA reference is counted: its session does
    not run step 2a."""
    cases = [name for case, (s, _, _) in LLM_CASES.items() if s == step for name in (case, f"{case}_trl")]
    return cases + [run for (s, run) in RUN_S if s == step and run not in (*cases, "trl", "eager")]


def plan() -> list[dict]:
    """CALLS as device calls: the command, what it carries, --budget_s (600 s less what comes before the
    checklist and a margin), and the estimated seconds of the checklist and of the device time (a session's
    first call with the machine's start, each later one with the pause before it: back to back)."""
    rows, session, llm_ready = [], None, False
    for number, call in enumerate(CALLS, 1):
        first = call["session"] != session
        session, llm_ready = call["session"], llm_ready and not first
        payload = "python3 bench/gpu_check/payload.py"
        parts = [name for name in call["carry"] if name != "llm_shape"]  # the shape is a folder: nothing to receive
        commands = [f"{payload} receive"] if parts else []
        commands += [f"{payload} probe"] if first else []
        commands += [f"{payload} install"] if call["install"] else []
        before = sum(CALL_S[name] for name, used in (("receive", parts), ("probe", first)) if used)
        before += CALL_S["install"] if call["install"] else 0
        budget = 600 - CALL_S["margin"] - before
        steps, step_s, checklist_s = call["steps"], {}, 0.0
        if steps:
            shape = " --llm_shape .gpu_payload/llm_shape" if call["shape"] else ""
            commands.append(
                f"python3 bench/gpu_check/checklist.py --steps {','.join(steps)} --budget_s {budget} --require_site"
                + shape
            )
            llm = any(needs_llm(step) for step in steps)
            env = ("llm_shape" if call["shape"] else "llm_cached" if llm_ready else "llm") if llm else "plain"
            llm_ready |= llm
            step_s = {step: sum(run_estimate_s(step, run) for run in gpu_runs(step)) for step in steps}
            checklist_s = run_estimate_s("env", env) + sum(step_s.values())
        device_s = CALL_S["start" if first else "gap"] + CALL_S["transfer"] + before + checklist_s
        carry = [".gpu_payload/manifest.json"] if call["carry"] else []
        rows.append(
            {
                "call": number,
                "session": session,
                "command": "export PYTHONUNBUFFERED=1; " + " && ".join(commands),
                "carry": carry + [f".gpu_payload/{name}" for name in call["carry"]],
                "timeout_s": 600,
                "budget_s": budget,
                "step_s": step_s,
                "checklist_s": checklist_s,
                "device_s": device_s,
            }
        )
    return rows


def plan_markdown(rows: list[dict]) -> str:
    lines = [
        "| session | # | command | carry | timeout_s | steps: estimated s | device min (session) |",
        "|---:|---|---|---|---:|---|---:|",
    ]
    total, session = 0.0, None
    for row in rows:
        total = row["device_s"] + (total if row["session"] == session else 0.0)
        session = row["session"]
        carry = ", ".join(f"`{path}`" for path in row["carry"]) or "none"
        steps = ", ".join(f"{step}: {seconds:.0f}" for step, seconds in row["step_s"].items()) or "none: it carries"
        checklist = f" (checklist {row['checklist_s']:.0f} of {row['budget_s']})" if row["step_s"] else ""
        lines.append(
            f"| {row['session']} | {row['call']} | `{row['command']}` | {carry} | {row['timeout_s']} "
            f"| {steps}{checklist} | {row['device_s'] / 60:.1f} ({total / 60:.1f}) |"
        )
    return "\n".join(lines) + "\n"


# --- markdown ---------------------------------------------------------------------------------------


def markdown(data: dict) -> str:
    env = data.get("environment", {})
    gpu = env.get("gpu") or {}
    lines = [
        "# GPU check" + (" (dry run: CPU, tiny sizes; the figures mean nothing)" if data.get("dry_run") else ""),
        "",
    ]
    lines += [
        f"- updated {data.get('updated')}; calls: "
        + "; ".join(f"{c['started']} steps {c['steps']}" for c in data.get("calls", [])),
        f"- GPU: {gpu['name']}; driver {gpu.get('driver')}; {gpu.get('memory')}"
        if gpu
        else "- GPU: none (no CUDA device)",
        f"- python {env.get('python')}; torch {env.get('torch')} (CUDA {env.get('cuda')}, cuDNN {env.get('cudnn')})",
    ]
    if env.get("error"):
        lines.append(f"- environment not read: {env['error']}")
    differs = env.get("differs_from_requirements") or []
    if differs:
        lines += [
            "",
            "Versions that differ from requirements*.txt:",
            "",
            "| package | required | found here |",
            "|---|---|---|",
        ]
        lines += [f"| {d['name']} | {d['required']} | {d['found']} |" for d in differs]
    unmet = (env.get("payload") or {}).get("unmet_requirements") or []
    if unmet:
        lines += ["", "Requirements of the carried packages not met here: " + "; ".join(unmet)]
    lines += ["", "| step | what | status | wall (s) | headline |", "|---|---|---|---:|---|"]
    for step in STEPS:
        record = data.get("steps", {}).get(step)
        if record is None:
            lines.append(f"| {step} | {STEPS[step]} | not run | | |")
            continue
        status = record.get("status", "?")
        if status == "failed":
            status += f": {record.get('error', '')}" + (
                " (expected in the dry run)" if record.get("expected_in_dry_run") else ""
            )
        elif status == "skipped":
            status += f": {record.get('reason', '')}"
        lines.append(
            f"| {step} | {record['title']} | {cell(status)} | {f(record.get('wall_s'), 1)} | {cell(headline(record))} |"
        )
    for step in STEPS:
        record = data.get("steps", {}).get(step)
        if record is None:
            continue
        lines += ["", f"## Step {step}: {record['title']}", ""]
        table = record.get("table")
        if table and table["rows"]:
            lines += ["| " + " | ".join(table["columns"]) + " |", "|" + "---|" * len(table["columns"])]
            lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in table["rows"]]
            lines.append("")
        lines += ["| run | status | wall (s) | command |", "|---|---|---:|---|"]
        for run in record.get("runs", {}).values():
            status = run.get("status", "?") + (
                f": {run.get('error') or run.get('reason')}" if run.get("status") != "ok" else ""
            )
            lines.append(
                f"| {run['name']} | {cell(status)} | {f(run.get('wall_s'), 1)} | `{cell(run.get('command', ''))}` |"
            )
        for note in record.get("notes", []):
            lines += ["", f"- {note}"]
    return "\n".join(lines) + "\n"


def headline(record: dict) -> str:
    figures = record.get("figures", {})
    parts = []
    for key, value in figures.items():
        if isinstance(value, float) and ("_x_" in key or key.startswith("speed_up") or key == "compile_s"):
            parts.append(f"{key} {value:.3f}")
        elif key == "graph_breaks":
            parts.append(f"{key} {value}")
    return ", ".join(parts)


def cell(value) -> str:
    return str(value if value is not None else "").replace("|", "\\|").replace("\n", " ")


# --- helpers run as subprocesses (they import torch) --------------------------------------------------


def helper_env(args) -> dict:
    """The machine (`machine`), and with --llm the LLM's preparation (`helper_llm_prep`)."""
    found = {"environment": machine()}
    if args.llm:
        found["llm"] = helper_llm_prep(args)
    return found


def machine() -> dict:
    """The machine: GPU, driver, torch, CUDA, every package of requirements*.txt and what differs."""
    import importlib.metadata as metadata
    import platform

    import torch

    info = {
        "python": platform.python_version(),
        "executable": sys.executable,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.cuda.is_available() else None,
        "gpu": None,
        "platform": platform.platform(),
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info["gpu"] = {
            "name": props.name,
            "memory": f"{props.total_memory / 2**30:.1f} GiB",
            "capability": f"{props.major}.{props.minor}",
            "count": torch.cuda.device_count(),
        }
        smi = shutil.which("nvidia-smi")
        if smi:
            done = subprocess.run(
                [smi, "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True, text=True
            )
            info["gpu"]["driver"] = (
                done.stdout.strip().splitlines()[0] if done.returncode == 0 and done.stdout.strip() else None
            )
    required = {}
    for name in ("requirements.txt", "requirements-demo.txt", "bench/requirements-bench.txt"):  # not the dev tools
        for line in (REPO / name).read_text().splitlines():
            line = line.split("#")[0].strip()
            match = re.match(r"^([A-Za-z0-9_.\-]+)\s*([<>=!~].*)?$", line)
            if match and not line.startswith("-"):
                required[match.group(1)] = (match.group(2) or "").strip()
    extra = ["huggingface_hub", "tokenizers", "pyarrow", "fsspec", "triton", "deepspeed", "pydantic", "trl"]
    extra.append("bitsandbytes")  # step 13 (QLoRA); on the GPU machine from the payload's qlora set
    packages = {}
    for name in [*required, *extra]:
        try:
            packages[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            packages[name] = None
    try:
        import deepspeed  # noqa: F401
    except Exception as exc:  # recorded, not raised: step 5 reads it
        if packages.get("deepspeed"):
            packages["deepspeed"] = None
            info["deepspeed_import_error"] = f"{type(exc).__name__}: {exc}"[:300]
    info["packages"] = packages
    info["differs_from_requirements"] = [
        {"name": name, "required": spec or "(any)", "found": packages.get(name)}
        for name, spec in required.items()
        if not version_meets(packages.get(name), spec)
    ]
    site = os.environ.get("PYTHONPATH", "").split(os.pathsep)[0]
    marker = Path(site, SITE_MARKER) if site else None
    info["payload"] = json.loads(marker.read_text()) if marker and marker.exists() else None
    return info


def version_meets(found: str | None, spec: str) -> bool:
    if found is None:
        return False
    if not spec:
        return True
    try:
        from packaging.specifiers import SpecifierSet

        return SpecifierSet(spec).contains(found, prereleases=True)
    except ImportError:
        return spec == f"=={found}"


def helper_llm_prep(args) -> dict:
    """The LLM of steps 2 to 5, dequantized once into <HF_HOME>/dequantized-gguf (the demo's GGUF on a GPU,
    a tiny Llama written as GGUF in the dry run), the chat records both trainers read (bench_sft's, the
    demo's own), and the facts MFU needs: the model's weights by kind, and the records' token counts."""
    import torch
    from accelerate import PartialState
    from bench_sft import write_chat_data
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from ddp_utils.data.demo import demo_llm_gguf
    from ddp_utils.language_models.gguf import dequantized_gguf

    work, train_records, eval_records = Path(args.llm[0]), int(args.llm[1]), int(args.llm[2])
    work.mkdir(parents=True, exist_ok=True)
    PartialState()  # ddp_utils logs through Accelerate's logger
    if args.llm_shape:  # the demo LLM's architecture and tokenizer, its weights drawn at random: speed figures only
        model_dir, gguf_dir, gguf_file = random_weights_llm(Path(args.llm_shape), work / "random-weights"), None, None
    elif args.dry_run:
        sys.path.insert(0, str(REPO / "tests"))
        from conftest import make_tiny_gguf

        path = work / "tiny-gguf" / "tiny.Q.gguf"
        if not path.exists():  # made once: its dequantized copy is cached by the file's path, size and time
            path, _ = make_tiny_gguf(path.parent)
        gguf_dir, gguf_file = str(path.parent), path.name
    else:
        gguf_dir, gguf_file = demo_llm_gguf()
    if not args.llm_shape:
        model_dir = dequantized_gguf(gguf_dir, gguf_file)
    files = write_chat_data(work, train_records, eval_records)
    if (
        args.dry_run
    ):  # the tiny model's tokenizer is byte-level with a 256-token context: short reviews, so nothing is cut
        for path in files.values():
            records = [json.loads(line) for line in path.read_text().splitlines()]
            for record in records:
                turn = record["messages"][1]
                review, question = turn["content"].rsplit("\n\n", 1)
                turn["content"] = f"{review[-80:]}\n\n{question}"
            path.write_text("".join(json.dumps(record) + "\n" for record in records))
    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    head = model.get_output_embeddings()
    linears = [m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and m is not head]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    lengths = []
    for line in files["train"].read_text().splitlines():
        ids = tokenizer.apply_chat_template(json.loads(line)["messages"], tokenize=True)
        lengths.append(len(ids["input_ids"] if hasattr(ids, "keys") else ids))  # transformers 5: a BatchEncoding
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    facts = {
        "linear_params": sum(m.in_features * m.out_features for m in linears),
        "head_params": head.in_features * head.out_features,
        "lora_params": 16 * sum(m.in_features + m.out_features for m in linears),  # r 16 on every linear map
        "layers": config.num_hidden_layers,
        "attention_width": heads * head_dim,
        # Each token attends to ~L/2 tokens of its record (causal): 4·d·L/2 FLOPs per layer, with L weighted by
        # the tokens of each record: sum(L²)/sum(L).
        "mean_tokens_attended": sum(n * n for n in lengths) / max(sum(lengths), 1) / 2,
        "records": len(lengths),
        "max_record_tokens": max(lengths, default=0),
        "records_over_256_tokens": sum(n > 256 for n in lengths),
        "mean_record_tokens": sum(lengths) / max(len(lengths), 1),
        "total_params": sum(p.numel() for p in model.parameters()),
    }
    facts["weights"] = "random (--llm_shape): speed figures only, no accuracy" if args.llm_shape else "the demo's"
    facts["model"] = (
        ("WEIGHTS DRAWN AT RANDOM, " if args.llm_shape else "")
        + f"{config.model_type}, {facts['total_params'] / 1e6:.1f}M parameters ({facts['linear_params'] / 1e6:.1f}M in "
        f"the layers' linear maps, LM head {facts['head_params'] / 1e6:.1f}M)"
    )
    facts["summary"] = (
        f"{facts['model']}, {len(lengths)} records of {facts['mean_record_tokens']:.0f} tokens on average (longest "
        f"{facts['max_record_tokens']})"
    )
    return {
        "model_dir": model_dir,
        "gguf_dir": gguf_dir,
        "gguf_file": gguf_file,
        "train_file": str(files["train"]),
        "validation_file": str(files["validation"]),
        "facts": facts,
    }


def random_weights_llm(shape: Path, target: Path) -> str:
    """A model directory of the LLM whose config and tokenizer are in `shape`, with weights drawn at random
    (seed 0, the architecture's own initialization, float32 as the dequantized demo's): the real model's training
    speed and memory (the same shapes, the same kernels) in a call that cannot carry its weights; its generation
    runs every answer to its maximum length (no stop token is drawn), its accuracy means nothing."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if (target / "config.json").exists():
        return str(target)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(shape), dtype=torch.float32)
    staging = target.with_name(target.name + ".staging")
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging)
    for path in shape.iterdir():
        if path.name != "config.json":
            shutil.copy2(path, staging / path.name)
    staging.rename(target)
    return str(target)


def helper_reload(args) -> dict:
    """Each saved model (args.rest, the keys of the answer) loads with from_pretrained (a causal LM, or a sequence
    classifier as its config names it), with every weight found, and computes finite logits; each one other than
    --reference gets the largest difference of its weights from it."""
    return {directory: reload_one(Path(directory), args.reference) for directory in args.rest}


def reload_one(directory: Path, reference: str | None) -> dict:
    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    architectures = AutoConfig.from_pretrained(directory).architectures or []
    classifier = any(name.endswith("ForSequenceClassification") for name in architectures)
    auto = AutoModelForSequenceClassification if classifier else AutoModelForCausalLM
    model, info = auto.from_pretrained(directory, output_loading_info=True)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    with torch.no_grad():
        finite = bool(torch.isfinite(model(**tokenizer("The review says", return_tensors="pt")).logits).all())
    problems = {
        k: list(v)[:5] for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys")
    }
    problem = "; ".join(f"{k}: {v}" for k, v in problems.items()) or ("" if finite else "non-finite logits")
    result = {
        "ok": not problem,
        "parameters": sum(p.numel() for p in model.parameters()),
        "dtype": str(next(model.parameters()).dtype),
        "files": sorted(p.name for p in directory.glob("*.safetensors")),
        "problem": problem,
    }
    if reference and Path(reference).resolve() != directory.resolve():
        mine, theirs = {}, {}
        for target, folder in ((mine, directory), (theirs, Path(reference))):
            for file in sorted(folder.glob("*.safetensors")):
                target.update(load_file(file))
        common = sorted(set(mine) & set(theirs))
        diffs = [float((mine[k].float() - theirs[k].float()).abs().max()) for k in common]
        result.update(max_abs_diff=max(diffs, default=None), tensors_compared=len(common))
    result["summary"] = (
        f"yes: {result['parameters'] / 1e6:.1f}M parameters, {result['dtype']}" if result["ok"] else f"no: {problem}"
    )
    return result


HELPERS = {"env": helper_env, "reload": helper_reload}


# --- small things -------------------------------------------------------------------------------------


def error_line(text: str, rc: int | None) -> str:
    """The line that says why a run failed: our scripts' one-line error ("[rank 0] error: ..."), else the
    last exception line of a traceback, else the last line printed."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for line in reversed(lines):
        if re.search(r"\berror: ", line) and line.startswith("[rank"):
            return line[:400]
    for line in reversed(lines):
        if re.match(r"^[\w.]*(Error|Exception|Interrupt|Exit)\b.*", line) and "ChildFailedError" not in line:
            return line[:400]
    return (f"exit {rc}: " if rc else "") + (lines[-1][:400] if lines else "no output")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def read_json(path: Path) -> dict:
    return json.loads(Path(path).read_text())


def read_jsonl(path: Path) -> list[dict]:
    path = Path(path)
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def now() -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S")


def f(value, digits: int) -> str:
    if value is None:
        return "-"
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return f"{value:,.{digits}f}"
    return str(value)


def none_low(value):
    return -1 if value is None else value


def ratio(row: dict, base: dict | None, key: str) -> str:
    return f(row[key] / base[key], 3) if base and base.get(key) else "-"


def compile_count_names() -> tuple:
    """ddp_utils' compile counts (`compilation.COUNTS`), read from their file: the runner imports only the standard
    library, and on the GPU machine neither the package (not on this process's path) nor torch is importable here."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("compilation", REPO / "ddp_utils" / "training" / "compilation.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.COUNTS


def ratio_of(a, b):
    return a / b if a is not None and b else None


def parse_steps(text: str) -> list[str]:
    steps = []
    for item in [s.strip() for s in text.split(",") if s.strip()]:
        if item == "all":
            steps += list(STEPS)
        elif item == "2":
            steps += ["2a", "2b"]
        elif item in STEPS:
            steps.append(item)
        else:
            raise SystemExit(f"--steps: unknown step {item!r}; the steps are {', '.join(STEPS)} (2 = 2a,2b), or all")
    return list(dict.fromkeys(steps))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", default="all", help="comma-separated: 1,2a,2b,3,...,14 (2 = 2a,2b), or all")
    p.add_argument("--dry_run", action="store_true", help="a CPU, tiny sizes: checks the checklist, not the GPU")
    p.add_argument("--results", default=None, help="where the JSON, Markdown and logs go (default outputs/gpu_check)")
    p.add_argument("--budget_s", type=float, default=None, help="start no run that would end after this many seconds")
    p.add_argument("--copy_to", default=os.environ.get("OUT"), help="copy the results here after every run ($OUT)")
    p.add_argument(
        "--site", default=None, help="the wheels payload.py installed (default /tmp/gpu_check_site if there)"
    )
    p.add_argument(
        "--jobs", type=int, default=None, help="dry run only: steps side by side in 2 processes (its default)"
    )
    p.add_argument(
        "--require_site", action="store_true", help="stop at once unless payload.py install has run on this machine"
    )
    p.add_argument("--fresh", action="store_true", help="start a new JSON instead of adding to the one in --results")
    p.add_argument("--report", nargs="*", default=None, help="merge these gpu_check.json files into --results, render")
    p.add_argument("--plan", action="store_true", help="print the device calls (CALLS) with their estimated times")
    p.add_argument("--helper", default=None, help=argparse.SUPPRESS)
    p.add_argument("--helper_out", default=None, help=argparse.SUPPRESS)
    p.add_argument("--reference", default=None, help=argparse.SUPPRESS)
    p.add_argument(
        "--llm_shape",
        default=None,
        help="the LLM steps on the demo LLM's shape (config, tokenizer: payload.py's llm_shape) with random weights",
    )
    p.add_argument("--llm", nargs=3, default=None, help=argparse.SUPPRESS)
    p.add_argument("rest", nargs="*", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.helper:
        write_atomic(Path(args.helper_out), json.dumps(HELPERS[args.helper](args), indent=2, default=str) + "\n")
        return 0
    if args.plan:
        print(plan_markdown(plan()), end="")
        return 0
    args.results = args.results or str(REPO / "outputs" / ("gpu_check_dry_run" if args.dry_run else "gpu_check"))
    if args.report is not None:
        return report(args)
    steps = parse_steps(args.steps)
    if args.jobs is None:
        args.jobs = 2 if args.dry_run else 1
    if args.jobs > 1 and not args.dry_run:
        raise SystemExit(
            "--jobs: only the dry run runs steps side by side; on a GPU they would share it and time nothing"
        )
    if args.jobs > 1:
        return run_lanes(args, steps)
    marker = Path(args.site or DEFAULT_SITE) / SITE_MARKER
    if args.require_site and not marker.exists():
        raise SystemExit(
            f"the carried wheels are not installed here ({args.site or DEFAULT_SITE} has no {SITE_MARKER}): the "
            "machine was started afresh, so send the payload again and install it (bench/gpu_check/README.md)"
        )
    not_ready = {}
    if args.require_site:  # a step whose set is not installed here would only fail on an import
        installed = set(read_json(marker).get("sets", []))
        for step in steps:
            missing = sets_missing(step, bool(args.llm_shape), installed)
            if missing:
                not_ready[step] = (
                    f"not run: it needs the payload's set {missing}, and this machine has "
                    f"{', '.join(sorted(installed)) or 'none'} (started afresh? bench/gpu_check/README.md)"
                )
                print(f"step {step}: {not_ready[step]}", flush=True)
        steps = [step for step in steps if step not in not_ready]
    checklist = Checklist(args)
    print(
        f"GPU check{' (dry run)' if args.dry_run else ''}: steps {', '.join(steps) or 'none'}; "
        f"results in {checklist.results}" + (f"; wheels from {checklist.site}" if checklist.site else ""),
        flush=True,
    )
    call = checklist.data["calls"][-1]
    call["not_run"] = not_ready
    start = time.monotonic()
    checklist.environment(steps)
    call["environment_s"] = round(time.monotonic() - start, 2)
    for step in steps:
        checklist.run_step(step)
    call["wall_s"] = round(time.monotonic() - start, 2)
    checklist.save()
    records = [checklist.data["steps"][s] for s in steps]
    unexpected = [r["id"] for r in records if r["status"] == "failed" and not r.get("expected_in_dry_run")]
    unexpected += list(not_ready)
    print(
        f"done: {checklist.md_path}" + (f"; failed or not run: {', '.join(unexpected)}" if unexpected else ""),
        flush=True,
    )
    return 1 if unexpected else 0


# The dry run's two lanes: steps 3 and 13 read step 2a's run, so they share its lane; about equal halves on a CPU
# (measured 2026-12-07 in tests/test_gpu_check.py, seconds in the two lanes at once: 1 21, 2a 9, 3 10, 5 30, 8 7,
# 12 26, 13 19 against 2b 10, 4 14, 6 7, 7 21, 9 13, 10 24, 11 21, 14 33; the lanes 129 s and 150 s with step 9 in the
# second; earlier that day, before step 14, the whole dry run took 91 s on a quicker machine).
LANES = [("1", "2a", "3", "5", "8", "9", "12", "13"), ("2b", "4", "6", "7", "10", "11", "14")]


def run_lanes(args, steps: list[str]) -> int:
    """The dry run on a 2-core machine: its steps in two processes of this file at once (each with its own
    results in lanes/N), then merged into one JSON and one table. CI's time, not the figures', is what counts."""
    results = Path(args.results).resolve()
    shutil.rmtree(results / "lanes", ignore_errors=True)
    started, processes = now(), []
    for index, lane in enumerate(LANES):
        mine = [step for step in steps if step in lane]
        if not mine:
            continue
        command = [sys.executable, str(Path(__file__).resolve()), "--dry_run", "--jobs", "1", "--fresh"]
        command += ["--steps", ",".join(mine), "--results", str(results / "lanes" / str(index))]
        if args.site:
            command += ["--site", args.site]
        env = {key: value for key, value in os.environ.items() if key != "OUT"}
        output = results / "lanes" / f"output-{index}.log"  # two lanes printing at once would interleave
        output.parent.mkdir(parents=True, exist_ok=True)
        print(f"lane {index}: steps {','.join(mine)} (its output: {output})", flush=True)
        with open(output, "w") as handle:
            processes.append(
                (index, subprocess.Popen(command, cwd=REPO, env=env, stdout=handle, stderr=subprocess.STDOUT))
            )
    merged: dict = {"dry_run": True, "schema": 1, "steps": {}, "lanes": {}}
    merged["calls"] = [{"started": started, "steps": args.steps, "argv": sys.argv[1:], "lanes": len(processes)}]
    for index, process in processes:
        rc = process.wait()
        lane_json = results / "lanes" / str(index) / "gpu_check.json"
        merged["lanes"][str(index)] = {"steps": [s for s in steps if s in LANES[index]], "exit": rc}
        data = read_json(lane_json) if lane_json.exists() else {"steps": {}}
        for step in (s for s in steps if s in LANES[index] and s not in data["steps"]):
            output = (results / "lanes" / f"output-{index}.log").read_text(errors="replace")
            error = f"its lane ended (exit {rc}) before this step: {error_line(output, rc)}"
            merged["steps"][step] = {"id": step, "title": STEPS[step], "status": "failed", "runs": {}, "error": error}
        merged.setdefault("environment", data.get("environment"))
        for step, record in data["steps"].items():
            for run in record.get("runs", {}).values():
                if run.get("log"):
                    run["log"] = f"lanes/{index}/{run['log']}"
            merged["steps"][step] = record
    merged["steps"] = {step: merged["steps"][step] for step in STEPS if step in merged["steps"]}
    merged["updated"] = now()
    write_results(results, merged, Path(args.copy_to) if args.copy_to else None)
    for record in merged["steps"].values():
        why = record.get("error") or record.get("reason") or ""
        print(f"step {record['id']}: {record['status']} in {f(record.get('wall_s'), 1)} s {why}".rstrip(), flush=True)
    unexpected = [
        r["id"] for r in merged["steps"].values() if r["status"] == "failed" and not r.get("expected_in_dry_run")
    ]
    print(
        f"done: {results / 'gpu_check.md'}" + (f"; failed: {', '.join(unexpected)}" if unexpected else ""), flush=True
    )
    return 1 if unexpected else 0


def report(args) -> int:
    """Merge the JSON files several calls brought back (later steps win) and write the Markdown."""
    results = Path(args.results)
    results.mkdir(parents=True, exist_ok=True)
    merged: dict = {}
    for name in args.report:
        data = read_json(Path(name))
        steps = {**merged.get("steps", {}), **data.get("steps", {})}
        calls = merged.get("calls", []) + data.get("calls", [])  # a warm machine's JSON holds its earlier calls too
        calls = list({(c.get("started"), str(c.get("argv"))): c for c in calls}.values())
        merged = {**merged, **data, "steps": steps, "calls": calls}
    merged["updated"] = now()
    write_atomic(results / "gpu_check.json", json.dumps(merged, indent=2, default=str) + "\n")
    write_atomic(results / "gpu_check.md", markdown(merged))
    print(results / "gpu_check.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
