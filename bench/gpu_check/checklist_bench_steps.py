"""The steps that run a benchmark of bench/: the manifest's checkpoint (step 8), DPO and GRPO against TRL (steps
9 and 10), DPO compiled (step 11), GRPO profiled (step 12)."""

from __future__ import annotations

import os
import sys

from checklist_runner import Runner
from checklist_steps import BENCH, CONFIGS, REPO
from checklist_util import compile_count_names, f, free_port, ratio_of, read_json


class BenchSteps(Runner):
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
