"""The SFT steps on the LLM: ours against TRL's SFTTrainer case by case (steps 2a and 2b), --torch_compile against
eager (step 3), QLoRA against TRL and against our LoRA (step 13)."""

from __future__ import annotations

import sys
from pathlib import Path

from checklist_figures import MFU_NOTE, QLORA_NOTE, TRL_DIFFERS, graph_breaks, row_of, sft_figures, steady
from checklist_runner import Runner, StepFailed
from checklist_steps import BENCH, DRY_RUN_CASES, LLM_CASES
from checklist_util import f, ratio_of, read_json


class LLMSteps(Runner):
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
