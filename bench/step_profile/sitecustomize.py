"""Profiles a window of optimizer steps with torch.profiler, in any Python process started with this folder first on
PYTHONPATH and STEP_PROFILE_DIR set (`side_by_side.py --profile` does both): ours and TRL's trainers alike, with
nothing changed in either. Steps PROFILE_FIRST_STEP + 1 to PROFILE_FIRST_STEP + PROFILE_STEPS are profiled (after
3 and for 5 by default: the first steps compile and warm up).

Each process writes STEP_PROFILE_DIR/profile-<pid>.json: the window's seconds a step; the seconds a step the GPU ran
kernels and copies (none on a CPU), and so the share of the step it was busy; the kernel launches a step; and the
operators that took the most time on the host and on the device. A GPU busy for a small share of the step waits on
the host (launches, Python): that is the measured cause a launch-bound step needs. The profiled steps run slower
than the others. On the path first, this file hides any other sitecustomize (op_count's too). A benchmark's tool,
never a training run's."""

import os

if os.environ.get("STEP_PROFILE_DIR"):
    import json
    import time
    from pathlib import Path

    import torch
    from torch.autograd import DeviceType
    from torch.optim.optimizer import register_optimizer_step_post_hook

    _first, _count = int(os.environ.get("PROFILE_FIRST_STEP", "3")), int(os.environ.get("PROFILE_STEPS", "5"))
    _out = Path(os.environ["STEP_PROFILE_DIR"]) / f"profile-{os.getpid()}.json"
    _state = {"steps": 0, "profiler": None, "start": 0.0}
    _LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")

    def _sync() -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def _top(averages, key: str, rows: int = 15) -> list:
        """The operators that took the most `key` time (microseconds in the profile), per step."""
        ranked = sorted((e for e in averages if getattr(e, key) > 0), key=lambda e: -getattr(e, key))[:rows]
        return [{"name": e.key, "s": getattr(e, key) / 1e6 / _count, "calls": e.count / _count} for e in ranked]

    def _write(seconds: float, profiler) -> None:
        events, averages = profiler.events(), profiler.key_averages()
        device = [e for e in events if e.device_type == DeviceType.CUDA]
        busy = sum(e.time_range.elapsed_us() for e in device) / 1e6 / _count if device else None
        step = seconds / _count
        summary = {
            "steps": _count,
            "step_s": step,
            "gpu_busy_s": busy,
            "gpu_busy_share": busy / step if busy is not None else None,
            "launches": sum(e.count for e in averages if e.key in _LAUNCHES) / _count,
            "host_top": _top(averages, "self_cpu_time_total"),
            "device_top": _top(averages, "self_device_time_total") if device else [],
        }
        _out.parent.mkdir(parents=True, exist_ok=True)
        _out.write_text(json.dumps(summary, indent=1))  # now: the scripts end with os._exit, which skips atexit

    def _step_ended(optimizer, args, kwargs):
        _state["steps"] += 1
        if _state["steps"] == _first:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            _sync()
            _state["profiler"] = torch.profiler.profile(activities=activities)
            _state["profiler"].__enter__()
            _state["start"] = time.perf_counter()
        elif _state["steps"] == _first + _count and _state["profiler"] is not None:
            _sync()
            seconds, profiler = time.perf_counter() - _state["start"], _state["profiler"]
            profiler.__exit__(None, None, None)
            _state["profiler"] = None
            _write(seconds, profiler)

    register_optimizer_step_post_hook(_step_ended)
