"""Counts the operators each optimizer step dispatches, in any Python process started with this folder first on
PYTHONPATH and OPS_PER_STEP_DIR set (`side_by_side.py --count_ops` does both): ours and TRL's trainers alike,
with nothing changed in either. On a GPU each operator is a kernel launch or more (views are none), and a small
model's step is bound by those launches: the counts compare two contenders' steps as a GPU runs them.

Each process writes OPS_PER_STEP_DIR/ops-<pid>.json: the operators counted up to the end of each optimizer step.
The counting runs each operator through Python: the run's speed means nothing while it counts. On the path first,
this file hides any other sitecustomize, and every process imports torch, the launchers too (they count no step).
A benchmark's tool, never a training run's."""

import os

if os.environ.get("OPS_PER_STEP_DIR"):
    import json
    from pathlib import Path

    from torch.optim.optimizer import register_optimizer_step_post_hook
    from torch.utils._python_dispatch import TorchDispatchMode

    class _OperatorCount(TorchDispatchMode):
        ops = 0

        by_name = {}  # the operators of the step under way, by name: which ones a step spends

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not func.is_view:
                _OperatorCount.ops += 1
                name = str(func.overloadpacket)
                _OperatorCount.by_name[name] = _OperatorCount.by_name.get(name, 0) + 1
            return func(*args, **(kwargs or {}))

    _ends = []  # the operators counted when each optimizer step ended
    _steps_by_name = []  # each step's operators by name, most first
    _out = Path(os.environ["OPS_PER_STEP_DIR"]) / f"ops-{os.getpid()}.json"

    def _step_ended(optimizer, args, kwargs):
        if _ends and _ends[-1] == _OperatorCount.ops:  # one entry per step, whatever the number of optimizers
            return
        _ends.append(_OperatorCount.ops)
        _steps_by_name.append(dict(sorted(_OperatorCount.by_name.items(), key=lambda kv: -kv[1])))
        _OperatorCount.by_name = {}
        # Written at every step: the scripts end with os._exit, which skips atexit.
        _out.parent.mkdir(parents=True, exist_ok=True)
        _out.write_text(json.dumps({"step_ends": _ends, "by_name": _steps_by_name}))

    register_optimizer_step_post_hook(_step_ended)
    _OperatorCount().__enter__()  # for the whole process, this thread (autograd's CPU work runs on it too)
