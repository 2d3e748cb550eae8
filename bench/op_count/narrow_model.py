#!/usr/bin/env python
"""A model directory for counting operators (`side_by_side.py --count_ops`) fast on a CPU: the demo LLM's
architecture (SmolLM2-135M-Instruct: its 30 layers, its vocabulary, 3 query heads to each key-value head) at a
width of 192 instead of 576, weights drawn at random (seed 0), with the demo's tokenizer and chat template. A
model dispatches the same operators at any width, and random weights draw no stop token: every sample runs to its
maximum length, as in the GPU check's runs with `--llm_shape`.

    python bench/op_count/narrow_model.py outputs/narrow_llm
    python bench/bench_grpo.py --processes 1 --config single_gpu.yaml --model outputs/narrow_llm --bf16 --count_ops
"""

import shutil
import sys
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_sft import demo_model_dir  # noqa: E402


def main():
    if len(sys.argv) != 2:
        raise SystemExit("usage: python bench/op_count/narrow_model.py OUTPUT_DIR")
    out, demo = Path(sys.argv[1]), Path(demo_model_dir())
    config = AutoConfig.from_pretrained(demo)
    width = {"hidden_size": 192, "intermediate_size": 384, "head_dim": 64}  # the demo's: 576, 1536, 64
    config.update({**width, "num_attention_heads": 3, "num_key_value_heads": 1})  # its 3:1 heads kept
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(out)
    AutoTokenizer.from_pretrained(demo).save_pretrained(out)
    for path in demo.iterdir():  # the generation config and the chat template, as the demo has them
        if path.name.startswith("generation") or path.suffix == ".jinja":
            shutil.copy(path, out / path.name)
    print(out)


if __name__ == "__main__":
    main()
