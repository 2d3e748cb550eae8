"""Loaded at start-up by every process of a bench/bench_scale.py launch (its PYTHONPATH holds this
folder): on rank 0 of the training processes, the first step any optimizer takes writes the wall
clock to FIRST_STEP_FILE (the training scripts and the Trainer alike)."""

import os

if os.environ.get("FIRST_STEP_FILE") and os.environ.get("RANK") == "0":  # the launcher itself has no RANK
    import time

    from torch.optim.optimizer import register_optimizer_step_post_hook

    def _record_first_step(optimizer, args, kwargs):
        path = os.environ.pop("FIRST_STEP_FILE", None)
        if path:
            with open(path, "w") as handle:
                handle.write(repr(time.time()))

    register_optimizer_step_post_hook(_record_first_step)
