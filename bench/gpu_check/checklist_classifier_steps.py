"""The steps of scripts/train.py as a classifier: step 1 (the demo against transformers.Trainer), step 14 (the LLM as
a classifier: full fine-tuning, LoRA and QLoRA, each saved classifier reloaded) and step 15 (its LoRA with and without
--gradient_checkpointing)."""

from __future__ import annotations

import shutil
import sys

from checklist_figures import (
    CHECKPOINTING_NOTE,
    CHECKPOINTING_TOLERANCE,
    CLASSIFIER_NOTE,
    classifier_figures,
    same_training,
)
from checklist_runner import Runner, StepFailed
from checklist_steps import BENCH
from checklist_util import f, none_low, ratio, ratio_of, read_json


class ClassifierSteps(Runner):
    def step_1(self) -> None:
        """scripts/train.py's demo against transformers.Trainer (random batches, and grouped by length),
        both in bf16 on one process, the same work: the demo model and reviews, batch 8, max length 128,
        lr 1e-4 with 10% warm-up, 3 epochs, no checkpoints."""
        s, work = self.sizes, self.results / "step1"
        work.mkdir(exist_ok=True)
        common = ["--max_length", s.cls_max_length, "--seed", 42, *s.cls]
        command, _ = self.accelerate(
            "single_gpu.yaml",
            "train.py",
            "--num_train_epochs",
            s.cls_epochs,
            "--per_device_train_batch_size",
            8,
            "--learning_rate",
            "1e-4",
            "--checkpointing_steps",
            "no",
            "--output_dir",
            work / "ours",
            "--overwrite_output_dir",
            *common,
        )
        runs = {"ours": self.launch("ours", command, work / "ours" / "metrics.json")}
        for name, sampling in (("trainer", "random"), ("trainer_grouped", "group_by_length")):
            if self.dry_run and name == "trainer_grouped":
                reason = "dry run: the same script as trainer, with --sampling group_by_length"
                self.step_record["runs"][name] = {"name": name, "status": "skipped", "reason": reason}
                continue
            out = work / f"{name}.json"
            command = [
                sys.executable,
                BENCH / "baselines" / "trainer_run.py",
                "--out",
                out,
                "--epochs",
                s.cls_epochs,
                "--batch_size",
                8,
                "--lr",
                "1e-4",
                "--output_dir",
                work / f"{name}_out",
                "--sampling",
                sampling,
                "--bf16",
                *common,
            ]
            runs[name] = self.launch(name, command, out)
        rows = {}
        for name, run in runs.items():
            if run["status"] != "ok":
                continue
            if name == "ours":
                data = read_json(work / "ours" / "metrics.json")
                figures = {
                    "samples_per_s": data["train_samples_per_second"],
                    "peak_gpu_memory_mib": max(data.get("peak_gpu_memory_mb_per_rank") or [None], key=none_low),
                    "accuracy": data.get("eval_accuracy"),
                    "padded_per_real": 1 + data.get("train_padding_waste", 0.0),
                    "mixed_precision": data.get("mixed_precision"),
                }
            else:
                data = read_json(work / f"{name}.json")
                figures = {
                    "samples_per_s": data["train_samples"] / data["train_time_s"],
                    "peak_gpu_memory_mib": data.get("peak_gpu_memory_mb"),
                    "accuracy": data.get("eval_accuracy"),
                    "padded_per_real": (data["padded_tokens"] + data["real_tokens"]) / max(data["real_tokens"], 1),
                    "mixed_precision": data.get("mixed_precision"),
                }
            run["figures"] = rows[name] = figures
        for base in ("trainer", "trainer_grouped"):
            if "ours" in rows and base in rows:
                self.step_record["figures"][f"ours_x_{base}"] = (
                    rows["ours"]["samples_per_s"] / rows[base]["samples_per_s"]
                )
        self.table(
            [
                "run",
                "samples/s",
                "× Trainer",
                "× Trainer grouped",
                "peak GPU MiB",
                "accuracy",
                "padded/real",
                "precision",
            ],
            [
                [
                    name,
                    f(r["samples_per_s"], 2),
                    ratio(r, rows.get("trainer"), "samples_per_s"),
                    ratio(r, rows.get("trainer_grouped"), "samples_per_s"),
                    f(r["peak_gpu_memory_mib"], 0),
                    f(r["accuracy"], 4),
                    f(r["padded_per_real"], 3),
                    r["mixed_precision"],
                ]
                for name, r in rows.items()
            ],
        )
        self.step_record["figures"]["target"] = "ours ≥ 1.2× the Trainer's samples/s in bf16"
        half = ((self.data.get("environment") or {}).get("payload") or {}).get("half") or {}
        for name, change in half.items():  # payload.py: carried in float16 to fit one device call
            self.note(
                f"{name} was carried with its float32 weights in float16 and is float32 again (each weight within "
                f"{change['max_rel_error']:.1e} of itself, relative): ours and the Trainer start from these weights"
            )

    def step_14(self) -> None:
        """scripts/train.py with the LLM as a classifier (its causal LM's body, a new score head) on step 1's work
        (the demo's reviews, batch 8, max length 128, 3 epochs, no checkpoints) at the script's default learning
        rates (1e-4 whole, 5e-4 with LoRA): full fine-tuning, LoRA r16 (adapters on the body, the new head whole) and
        QLoRA (the same on a 4-bit NF4 base, the head kept out of 4-bit): samples/s, peak GPU memory, accuracy, what
        is saved; LoRA against full, QLoRA against LoRA. The adapters are merged (--merge_lora: QLoRA's merge reads
        the base again unquantized) and each saved classifier reloads."""
        s, work, llm = self.sizes, self.results / "step14", self.llm()
        self.step_record["figures"]["model"] = llm["facts"]["classifier"]  # no LM head, and not the chat records
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir()
        common = ["--model_name_or_path", llm["model_dir"], "--num_train_epochs", s.cls_epochs]
        common += ["--per_device_train_batch_size", 8, "--max_length", s.cls_max_length, "--seed", 42, *s.cls]
        common += ["--checkpointing_steps", "no", "--overwrite_output_dir"]
        cases = {"full": [], "lora": ["--lora_r", 16, "--merge_lora"]}
        cases["qlora"] = [*cases["lora"], "--load_in_4bit"]
        if not self.env_has("bitsandbytes"):  # the dry run without requirements-dev.txt's bitsandbytes
            del cases["qlora"]
            reason = "bitsandbytes is not installed here (requirements-dev.txt; the payload's qlora set)"
            self.step_record["runs"]["qlora"] = {"name": "qlora", "status": "skipped", "reason": reason}
        rows, saved = {}, []
        for case, options in cases.items():
            out = work / case
            command, _ = self.accelerate("single_gpu.yaml", "train.py", *common, *options, "--output_dir", out)
            run = self.launch(case, command, out / "metrics.json")
            if run["status"] != "ok":
                continue
            run["figures"] = rows[case] = classifier_figures(out, (self.results / run["log"]).read_text())
            saved.append(out / "merged" if options else out)
        if saved:
            reloaded = self.helper("reload", *saved)
            for case, directory in zip(rows, saved):
                rows[case]["reloads"] = reloaded[str(directory)]["summary"]
                if not reloaded[str(directory)]["ok"]:
                    self.step_record["runs"][case].update(status="failed", error=reloaded[str(directory)]["problem"])
        figures = self.step_record["figures"]
        for a, b in (("lora", "full"), ("qlora", "lora"), ("qlora", "full")):
            if a in rows and b in rows:
                figures[f"{a}_x_{b}_samples_per_s"] = ratio_of(rows[a]["samples_per_s"], rows[b]["samples_per_s"])
                figures[f"{a}_x_{b}_peak_gpu_memory"] = ratio_of(
                    rows[a]["peak_gpu_memory_mib"], rows[b]["peak_gpu_memory_mib"]
                )
        figures.update({f"{case}_accuracy": row["accuracy"] for case, row in rows.items()})
        columns = ["run", "samples/s", "× full", "peak GPU MiB", "× full", "peak RSS MiB", "accuracy", "trainable"]
        self.table(
            [*columns, "saved MiB", "reloads"],
            [
                [
                    case,
                    f(r["samples_per_s"], 2),
                    ratio(r, rows.get("full"), "samples_per_s"),
                    f(r["peak_gpu_memory_mib"], 0),
                    ratio(r, rows.get("full"), "peak_gpu_memory_mib"),
                    f(r["peak_rss_mib"], 0),
                    f(r["accuracy"], 4),
                    r["trainable"],
                    f(r["saved_mib"], 1),
                    r.get("reloads"),
                ]
                for case, r in rows.items()
            ],
        )
        self.note(CLASSIFIER_NOTE)

    def step_15(self) -> None:
        """--gradient_checkpointing in scripts/train.py: the LLM as a classifier with LoRA r16 (the case it is for: a
        model whose activations outgrow the GPU), with and without it, on step 1's reviews at batch 32, so that the
        activations are most of the memory: samples/s, peak GPU memory, and the same training (the loss and gradient
        norm at each logged step, the evaluation's loss, the saved adapters: recomputed activations must give the
        gradients stored ones give)."""
        s, work, llm = self.sizes, self.results / "step15", self.llm()
        self.step_record["figures"]["model"] = llm["facts"]["classifier"]
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir()
        common = ["--model_name_or_path", llm["model_dir"], "--num_train_epochs", s.cls_epochs, "--lora_r", 16]
        common += ["--per_device_train_batch_size", s.checkpointed_batch, "--max_length", s.cls_max_length]
        common += ["--seed", 42, *s.cls, "--checkpointing_steps", "no", "--overwrite_output_dir"]
        rows = {}
        for case, options in (("lora", []), ("lora_gc", ["--gradient_checkpointing"])):
            out = work / case
            command, _ = self.accelerate("single_gpu.yaml", "train.py", *common, *options, "--output_dir", out)
            run = self.launch(case, command, out / "metrics.json")
            if run["status"] == "ok":
                run["figures"] = rows[case] = classifier_figures(out, (self.results / run["log"]).read_text())
        if set(rows) != {"lora", "lora_gc"}:
            return
        plain, checkpointed, figures = rows["lora"], rows["lora_gc"], self.step_record["figures"]
        figures["gc_x_plain_samples_per_s"] = ratio_of(checkpointed["samples_per_s"], plain["samples_per_s"])
        figures["gc_x_plain_peak_gpu_memory"] = ratio_of(
            checkpointed["peak_gpu_memory_mib"], plain["peak_gpu_memory_mib"]
        )
        if plain["peak_gpu_memory_mib"] is not None and checkpointed["peak_gpu_memory_mib"] is not None:
            figures["gc_saves_gpu_mib"] = plain["peak_gpu_memory_mib"] - checkpointed["peak_gpu_memory_mib"]
        figures.update(same_training(work / "lora", work / "lora_gc"))
        self.table(
            ["run", "samples/s", "× plain", "peak GPU MiB", "× plain", "peak RSS MiB", "eval loss", "accuracy"],
            [
                [
                    case,
                    f(r["samples_per_s"], 2),
                    ratio(r, plain, "samples_per_s"),
                    f(r["peak_gpu_memory_mib"], 0),
                    ratio(r, plain, "peak_gpu_memory_mib"),
                    f(r["peak_rss_mib"], 0),
                    f(r["eval_loss"], 5),
                    f(r["accuracy"], 4),
                ]
                for case, r in rows.items()
            ],
        )
        self.note(CHECKPOINTING_NOTE)
        # The same seed, batches and dropout masks: only rounding may differ (a NaN or a missing figure fails too)
        checked = ("train_loss_max_relative_change", "grad_norm_max_relative_change", "eval_loss_relative_change")
        apart = {name: figures.get(name) for name in checked}
        within = all(change is not None and change <= CHECKPOINTING_TOLERANCE for change in apart.values())  # not NaN
        if not (figures["logged_steps"] and within):
            raise StepFailed(
                f"--gradient_checkpointing changed the training, or it could not be compared: over "
                f"{figures['logged_steps']} logged steps, {', '.join(f'{k} {v}' for k, v in apart.items())} "
                f"(at most {CHECKPOINTING_TOLERANCE:.0%} allowed)"
            )
        if figures.get("gc_saves_gpu_mib") is not None and figures["gc_saves_gpu_mib"] <= 0:
            raise StepFailed(
                f"--gradient_checkpointing saved no GPU memory ({checkpointed['peak_gpu_memory_mib']:.0f} MiB at its "
                f"peak against {plain['peak_gpu_memory_mib']:.0f} without it): were the decoder layers checkpointed?"
            )
