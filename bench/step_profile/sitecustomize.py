"""Profiles a window of optimizer steps with torch.profiler, in any Python process started with this folder first on
PYTHONPATH and STEP_PROFILE_DIR set (`side_by_side.py --profile` does both): ours and TRL's trainers alike, with
nothing changed in either. Steps PROFILE_FIRST_STEP + 1 to PROFILE_FIRST_STEP + PROFILE_STEPS are profiled (after
3 and for 5 by default: the first steps compile and warm up).

Each process writes STEP_PROFILE_DIR/profile-<pid>.json, a step's mean over the window:
- its seconds, and the seconds the GPU ran kernels, copies or fills (the union of their intervals; none on a CPU),
  so the share of the step it was busy;
- its kernel launches, and its waits for the GPU (stream, event and device synchronizations: an `.item()`, a copy
  from pageable memory) with the host seconds spent in them;
- the host seconds inside torch's operators (those no other operator called, the union of their spans on all
  threads: the dispatch, the launches, the CPU's own work and the waits above, which are inside operators too),
  and the rest of the step: Python and everything else outside them;
- the host seconds inside transformers' `generate` (its outermost call), where the process calls it (ours draws
  each sample's first token from its prompt's pass before `generate`; TRL's `generate` makes that pass too);
- the operators that took the most time on the host (each with its longest call and its median one) and on the
  device.
A GPU busy for a small share of the step waits on the host: the host's split then says whether operators (their
count) or Python between them is the cost, the measured cause a launch-bound step needs. The profiled steps run
slower than the others. With STEP_PROFILE_NO_CUDNN_ATTENTION=1 the process runs attention without cuDNN's kernels
(torch's flash or memory-efficient ones instead): what cuDNN's attention costs a step. On the path first, this file
hides any other sitecustomize (op_count's too). A benchmark's tool, never a training run's."""

import os

if os.environ.get("STEP_PROFILE_DIR"):
    import functools
    import json
    import sys
    import threading
    import time
    from pathlib import Path

    import torch
    from torch.autograd import DeviceType
    from torch.optim.optimizer import register_optimizer_step_post_hook

    if os.environ.get("STEP_PROFILE_NO_CUDNN_ATTENTION") == "1":  # bench_grpo.py's ours_no_cudnn_attention
        torch.backends.cuda.enable_cudnn_sdp(False)  # attention then runs on torch's other kernels
    _first, _count = int(os.environ.get("PROFILE_FIRST_STEP", "3")), int(os.environ.get("PROFILE_STEPS", "5"))
    _out = Path(os.environ["STEP_PROFILE_DIR"]) / f"profile-{os.getpid()}.json"
    _state = {"steps": 0, "profiler": None, "start": 0.0, "generate": None}
    _LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch")
    _SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
    _GENERATE = "transformers generate"  # the region _time_generate marks
    _CLOSING = "step_profile: the window's closing synchronize"  # this file's own wait: left out of the figures
    _depth = threading.local()

    def _sync() -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def _top(averages, key: str, rows: int = 15) -> list:
        """The operators that took the most `key` time (microseconds in the profile), per step."""
        ranked = sorted((e for e in averages if getattr(e, key) > 0), key=lambda e: -getattr(e, key))[:rows]
        return [{"name": e.key, "s": getattr(e, key) / 1e6 / _count, "calls": e.count / _count} for e in ranked]

    def _host_top(events, rows: int = 15) -> list:
        """The operators (and marked regions) that took the most host time of their own, per step, from `events`
        (the window's own: its closing synchronize left out, as everywhere here), each with its longest call and
        its median one: a cost paid once per new shape (a cuDNN graph built, a kernel tuned) is a few long calls
        among short ones, a cost of every call is not."""
        calls = {}
        for event in events:
            if event.device_type == DeviceType.CPU:
                calls.setdefault(event.name, []).append(event.self_cpu_time_total / 1e6)
        ranked = sorted((item for item in calls.items() if sum(item[1]) > 0), key=lambda item: -sum(item[1]))[:rows]
        return [
            {
                "name": name,
                "s": sum(seconds) / _count,
                "calls": len(seconds) / _count,
                "longest_call_s": max(seconds),
                "median_call_s": sorted(seconds)[len(seconds) // 2],
            }
            for name, seconds in ranked
        ]

    def _union_s(intervals: list) -> float:
        """The seconds covered by (start, end) microsecond intervals, overlaps once (kernels on several streams)."""
        total, reach = 0.0, None
        for start, end in sorted(intervals):
            if reach is None or start > reach:
                total, reach = total + (end - start), end
            elif end > reach:
                total, reach = total + (end - reach), end
        return total / 1e6

    def _outermost_op(event) -> bool:
        """An operator that no other operator called (a region marked with record_function is not an operator)."""
        if event.is_user_annotation or event.device_type != DeviceType.CPU:
            return False
        parent = event.cpu_parent
        while parent is not None and parent.is_user_annotation:
            parent = parent.cpu_parent
        return parent is None

    def _time_generate() -> None:
        """Mark transformers' `generate` (its outermost call: TRL's and ours go through it) as a profiled region."""
        generation = sys.modules.get("transformers.generation.utils")
        if generation is None or _state["generate"] is not None:
            return
        original = _state["generate"] = generation.GenerationMixin.generate

        @functools.wraps(original)
        def generate(*args, **kwargs):
            depth = getattr(_depth, "value", 0)
            _depth.value = depth + 1
            try:
                if depth:
                    return original(*args, **kwargs)
                with torch.profiler.record_function(_GENERATE):
                    return original(*args, **kwargs)
            finally:
                _depth.value = depth

        generation.GenerationMixin.generate = generate

    def _write(seconds: float, profiler) -> None:
        closing = [e.time_range for e in profiler.events() if e.name == _CLOSING and e.device_type == DeviceType.CPU]
        events = [  # the closing synchronize and what it called are this file's, not the step's
            e for e in profiler.events() if not any(c.start <= e.time_range.start <= c.end for c in closing)
        ]
        averages = profiler.key_averages()
        device = [e for e in events if e.device_type == DeviceType.CUDA and not e.is_user_annotation]
        busy = _union_s([(e.time_range.start, e.time_range.end) for e in device]) / _count if device else None
        host_ops = _union_s([(e.time_range.start, e.time_range.end) for e in events if _outermost_op(e)]) / _count
        syncs = [e for e in events if e.name in _SYNCS]
        generate = [e for e in events if e.name == _GENERATE and e.device_type == DeviceType.CPU]
        step = seconds / _count
        summary = {
            "steps": _count,
            "cudnn_attention": torch.backends.cuda.cudnn_sdp_enabled(),  # off in ours_no_cudnn_attention
            "step_s": step,
            "gpu_busy_s": busy,
            "gpu_busy_share": busy / step if busy is not None else None,
            "launches": sum(e.count for e in averages if e.key in _LAUNCHES) / _count,
            "syncs": len(syncs) / _count,
            "sync_wait_s": sum(e.time_range.elapsed_us() for e in syncs) / 1e6 / _count,
            "host_in_operators_s": host_ops,
            "host_outside_operators_s": step - host_ops,  # Python and all else
            "generate_s": sum(e.time_range.elapsed_us() for e in generate) / 1e6 / _count if generate else None,
            "host_top": _host_top(events),
            "device_top": _top(averages, "self_device_time_total") if device else [],
        }
        _out.parent.mkdir(parents=True, exist_ok=True)
        _out.write_text(json.dumps(summary, indent=1))  # now: the scripts end with os._exit, which skips atexit

    def _step_ended(optimizer, args, kwargs):
        _state["steps"] += 1
        if _state["steps"] == _first:
            _time_generate()  # by now transformers is imported where the process uses it
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            _sync()
            _state["profiler"] = torch.profiler.profile(activities=activities)
            _state["profiler"].__enter__()
            _state["start"] = time.perf_counter()
        elif _state["steps"] == _first + _count and _state["profiler"] is not None:
            with torch.profiler.record_function(_CLOSING):
                _sync()
            seconds, profiler = time.perf_counter() - _state["start"], _state["profiler"]
            profiler.__exit__(None, None, None)
            _state["profiler"] = None
            _write(seconds, profiler)

    register_optimizer_step_post_hook(_step_ended)
