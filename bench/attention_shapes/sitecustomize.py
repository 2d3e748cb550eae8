"""Logs the shape of every attention call that autograd records (the training passes, not generation), with the
optimizer step it belongs to, in any Python process started with this folder first on PYTHONPATH and
ATTENTION_SHAPES_DIR set: ours and TRL's trainers alike, with nothing changed in either. It tells how many
different lengths a run's training passes take, and in which steps a length is new: on a GPU, cuDNN's attention
builds a graph on the host for each new shape (bench/README.md, the GPU check's session 4). `lengths.py` beside it
reads what this writes:

    PYTHONPATH=bench/attention_shapes ATTENTION_SHAPES_DIR=outputs/shapes \\
        .venv/bin/python bench/bench_grpo.py --processes 1 --config single_gpu.yaml --model outputs/narrow_llm \\
        --train_prompts 24 --bf16 --only ours trl
    .venv/bin/python bench/attention_shapes/lengths.py outputs/shapes

Each process appends to ATTENTION_SHAPES_DIR/shapes-<pid>.jsonl. On the path first, this file hides any other
sitecustomize. A benchmark's tool, never a training run's."""

import os

if os.environ.get("ATTENTION_SHAPES_DIR"):
    import json
    from pathlib import Path

    import torch
    import torch.nn.functional as F
    from torch.optim.optimizer import register_optimizer_step_post_hook

    _out = Path(os.environ["ATTENTION_SHAPES_DIR"]) / f"shapes-{os.getpid()}.jsonl"
    _out.parent.mkdir(parents=True, exist_ok=True)
    _steps = [0]  # optimizer steps ended so far: the step a call belongs to is this + 1
    _attention = F.scaled_dot_product_attention

    def _logged(query, key, value, attn_mask=None, *args, **kwargs):
        if torch.is_grad_enabled():
            mask = None if attn_mask is None else list(attn_mask.shape)
            record = {"step": _steps[0] + 1, "query": list(query.shape), "key": list(key.shape), "mask": mask}
            with open(_out, "a") as handle:
                handle.write(json.dumps(record) + "\n")
        return _attention(query, key, value, attn_mask, *args, **kwargs)

    def _step_ended(optimizer, args, kwargs):
        _steps[0] += 1

    F.scaled_dot_product_attention = _logged  # transformers looks it up at each call
    register_optimizer_step_post_hook(_step_ended)
