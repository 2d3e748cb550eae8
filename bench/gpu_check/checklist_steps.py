"""The checklist's steps as data: their titles (STEPS), the LLM cases of steps 2 and 13 (our options and TRL's
best settings for each), the size of each step's work on a GPU and in the dry run (Sizes), the GPUs' dense bf16
peaks that MFU divides by, and the paths in the repository the runs use."""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent.parent
BENCH = REPO / "bench"
CONFIGS = REPO / "accelerate_configs"
CHECKLIST = Path(__file__).resolve().parent / "checklist.py"  # the command; run again with --helper for torch's work
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
    "15": "train.py --gradient_checkpointing on the LLM classifier's LoRA: the memory it saves, the speed it costs",
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


class Sizes:
    """The work of each step: the demos' own on a GPU; a few records and steps in the dry run."""

    def __init__(self, dry_run: bool):
        # 32 samples (the first with all 3 labels): bf16 is emulated without avx512_bf16 (1.5 samples/s here)
        self.cls = ["--max_train_samples", "32", "--max_eval_samples", "8"] if dry_run else []
        self.cls_epochs, self.cls_max_length = (1, 32) if dry_run else (3, 128)
        self.checkpointed_batch = 8 if dry_run else 32  # step 15: activations most of the LLM classifier's memory
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
