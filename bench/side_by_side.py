"""The loop bench_dpo.py and bench_grpo.py share: run each contender in turn, read its figures, and print
one Markdown table with each run's speed and memory as ratios to its TRL peer."""

import importlib.util
import json
import os
import shutil
import statistics
from pathlib import Path


def add_side_by_side_args(p, names: dict, workdir: Path) -> None:
    """The options every side-by-side benchmark takes: the seed, bf16, the processes and launch config, the
    model, a JSON of the figures, --only, the working folder."""
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--bf16", action="store_true", help="both in bf16 (on a GPU; ours through its launch option)")
    p.add_argument("--processes", type=int, default=2, help="processes of each run (the GPU check: 1)")
    p.add_argument("--config", default="cpu_2proc.yaml", help="ours' launch config in accelerate_configs/")
    p.add_argument("--model", default=None, help="a local model directory (default: the demo LLM, dequantized)")
    p.add_argument("--json", default=None, help="also write the figures to this JSON file")
    p.add_argument("--only", nargs="*", default=None, choices=list(names), help="run only these contenders")
    p.add_argument("--workdir", default=str(workdir), help="where runs write")
    p.add_argument("--count_ops", action="store_true", help="count each step's operators (speeds then mean nothing)")
    p.add_argument("--profile", action="store_true", help="profile 5 steps of each run: GPU busy share, host split")


def peak_gpu_mib(data: dict) -> float | None:
    """A run's peak GPU memory: TRL's JSON holds one figure (`peak_gpu_memory_mb`), ours' metrics.json one per
    process (`peak_gpu_memory_mb_per_rank`, found missing from the first GPU run's table); None on a CPU."""
    per_rank = [value for value in data.get("peak_gpu_memory_mb_per_rank") or [] if value is not None]
    return data.get("peak_gpu_memory_mb") or (max(per_rank) if per_rank else None)


def train_log(run_dir: Path) -> list[dict]:
    """One of our runs' train_log.jsonl: a record per logged window."""
    return [json.loads(line) for line in open(run_dir / "train_log.jsonl")]


def ours_log_figures(log: list[dict], data: dict) -> dict:
    """From one of our runs (its `train_log` and metrics.json): the steady speed (samples/s, the median of the later
    half of its logged windows: after a compilation) and what torch.compile compiled, where it did."""
    from ddp_utils.training.compilation import COUNTS

    speeds = [record["train/samples_per_second"] for record in log if "train/samples_per_second" in record]
    return {
        "steady_per_s": statistics.median(speeds[len(speeds) // 2 :]) if speeds else None,
        **{count: data[count] for count in COUNTS if count in data},
    }


def run_contenders(args, commands: dict, names: dict, figures, workdir: Path, env: dict) -> dict:
    """Run `commands` (key -> (results file, command)) one at a time; skip those not in --only, and TRL's
    when trl is not installed; add `figures(key, results)` (a dict with "per_s", "gpu_mib", "steps")."""
    from bench_train import run_one  # here: the GPU check reads this file's figures without psutil

    results, have_trl = {}, importlib.util.find_spec("trl") is not None
    env = {k: v for k, v in env.items() if k != "STEP_PROFILE_NO_CUDNN_ATTENTION"}  # one contender's switch alone
    if args.count_ops and args.profile:  # each is a sitecustomize first on the path: one hides the other
        raise SystemExit("--count_ops and --profile cannot run together: give one")
    for key, (result_file, command) in commands.items():
        if (args.only and key not in args.only) or (key.startswith("trl") and not have_trl):
            print(f"skipped: {names[key]}" + ("" if have_trl else " (trl is not installed)"), flush=True)
            continue
        print(f"running {names[key]} ...", flush=True)
        ops_dir, profile_dir = workdir / "ops" / key, workdir / "profile" / key
        run_env = env
        if args.count_ops:  # op_count/sitecustomize.py counts in every process the run starts
            run_env = with_sitecustomize(env, "op_count", "OPS_PER_STEP_DIR", ops_dir)
        if args.profile:  # step_profile/sitecustomize.py profiles steps 4 to 8 in every process the run starts
            run_env = with_sitecustomize(env, "step_profile", "STEP_PROFILE_DIR", profile_dir)
        result = run_one(command, result_file, workdir / f"{key}.log", run_env)
        if result["data"].get("world_size") != args.processes:
            raise SystemExit(f"{names[key]} trained on {result['data'].get('world_size')} process(es); see its log")
        result.update(figures(key, result["data"]))
        if args.count_ops:
            result["ops_per_step"] = ops_per_step(ops_dir)
        if args.profile:
            result["profile"] = slowest_profile(profile_dir)
        results[key] = result
        if args.json:  # after each contender: a run stopped later (the GPU check's budget) keeps what finished
            figures_only = {key: {k: v for k, v in r.items() if k != "data"} for key, r in results.items()}
            Path(args.json).write_text(json.dumps(figures_only, indent=1))
        gpu = f", peak GPU {result['gpu_mib']:.0f} MiB" if result["gpu_mib"] else ""
        print(
            f"  {result['per_s']:.3f}/s, wall {result['wall_s']:.1f} s, "
            f"peak RSS {result['peak_rss_mib']:.0f} MiB{gpu}, steps {result['steps']}, {result['exit']}",
            flush=True,
        )
    return results


def with_sitecustomize(env: dict, folder: str, variable: str, out_dir: Path) -> dict:
    """`env` with bench/<folder>/sitecustomize.py first on the path and `variable` naming `out_dir` (emptied) for
    what it writes: it then runs in every process the run starts."""
    shutil.rmtree(out_dir, ignore_errors=True)
    paths = [str(Path(__file__).resolve().parent / folder), env.get("PYTHONPATH")]
    return {**env, variable: str(out_dir), "PYTHONPATH": os.pathsep.join(filter(None, paths))}


def ops_per_step(ops_dir: Path) -> int | None:
    """The median operators of a step, on the process that counted the most: each step's from the end of the one
    before (the first step, with the set-up before it, left out); None with fewer than 3 steps."""
    per_process = []
    for path in ops_dir.glob("ops-*.json"):
        ends = json.loads(path.read_text())["step_ends"]
        steps = [b - a for a, b in zip(ends, ends[1:])]
        if len(steps) >= 2:
            per_process.append(round(statistics.median(steps)))
    return max(per_process) if per_process else None


def slowest_profile(profile_dir: Path) -> dict | None:
    """The profile (step_profile/sitecustomize.py) of the process whose profiled steps took longest; None where no
    process reached the end of its profiled steps (a run of fewer than 8 steps)."""
    profiles = [json.loads(path.read_text()) for path in profile_dir.glob("profile-*.json")]
    return max(profiles, key=lambda profile: profile["step_s"]) if profiles else None


def top_host_operator(profile: dict) -> str:
    """The profile's operator that took the most host time, with its calls' longest and median (milliseconds)."""
    if not profile["host_top"]:
        return "-"
    row = profile["host_top"][0]
    if "longest_call_s" not in row:  # a profile written before these were
        return row["name"]
    longest, median = row["longest_call_s"] * 1e3, row["median_call_s"] * 1e3
    return f"{row['name']} (longest call {longest:.2f} ms, median {median:.2f} ms)"


def print_side_by_side(results: dict, names: dict, baseline: dict, unit: str) -> None:
    """The Markdown table: each run's `unit`/s and peak memory, and their ratios to `baseline[key]`'s."""
    print(
        f"| run | {unit}/s | × TRL | wall time (s) | peak RSS / process (MiB) | peak GPU memory (MiB) | × TRL "
        "| steps | exit |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for key, r in results.items():
        base = results.get(baseline[key])
        speed = f"{r['per_s'] / base['per_s']:.2f}" if base else "-"
        gpu = f"{r['gpu_mib']:.0f}" if r["gpu_mib"] else "-"
        memory = f"{r['gpu_mib'] / base['gpu_mib']:.2f}" if base and r["gpu_mib"] and base["gpu_mib"] else "-"
        if base and not r["gpu_mib"]:
            memory = f"{r['peak_rss_mib'] / base['peak_rss_mib']:.2f} (RSS)"
        print(
            f"| {names[key]} | {r['per_s']:.3f} | {speed} | {r['wall_s']:.1f} | {r['peak_rss_mib']:.0f} "
            f"| {gpu} | {memory} | {r['steps']} | {r['exit']} |"
        )
    if any("ops_per_step" in r for r in results.values()):
        print("\nOperators per optimizer step (on a GPU: kernel launches; the speeds above are slowed by the count):")
        print("\n| run | operators / step | × TRL |\n|---|---:|---:|")
        for key, r in results.items():
            base = results.get(baseline[key], {}).get("ops_per_step")
            ops = r.get("ops_per_step")
            ratio = f"{ops / base:.2f}" if ops and base else "-"
            print(f"| {names[key]} | {ops:,} | {ratio} |" if ops else f"| {names[key]} | - | - |")
    if any(r.get("profile") for r in results.values()):
        first, count = int(os.environ.get("PROFILE_FIRST_STEP", "3")), int(os.environ.get("PROFILE_STEPS", "5"))
        print(
            f"\nProfiled steps {first + 1} to {first + count} (torch.profiler; they run slower than the others): where "
            "each step's time goes (host in operators: the GPU waits included)"
        )
        print(
            "\n| run | s / step | GPU busy share | launches / step | GPU waits / step (s) | host in operators (s) "
            "| host outside them (s) | in `generate` (s) | top host operator |"
        )
        print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
        for key, r in results.items():
            p = r.get("profile")
            if not p:
                print(f"| {names[key]} |" + " - |" * 8)
                continue
            busy = f"{p['gpu_busy_share']:.0%}" if p["gpu_busy_s"] is not None else "-"  # none on a CPU
            waits = f"{p.get('syncs', 0):,.0f} ({p.get('sync_wait_s', 0):.4f})"
            generate = f"{p['generate_s']:.4f}" if p.get("generate_s") is not None else "-"
            top = top_host_operator(p)
            print(
                f"| {names[key]} | {p['step_s']:.4f} | {busy} | {p['launches']:,.0f} | {waits} "
                f"| {p.get('host_in_operators_s', 0):.4f} | {p.get('host_outside_operators_s', 0):.4f} | {generate} "
                f"| {top} |"
            )
