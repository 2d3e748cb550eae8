"""The steps of a launch configuration or option on one GPU: FSDP (step 4), DeepSpeed ZeRO-2 and ZeRO-3 (step 5),
--sync_batchnorm (step 6), fp16 with its loss scaler (step 7)."""

from __future__ import annotations

import importlib.util
import re
import shutil
from pathlib import Path

from checklist_figures import sft_figures
from checklist_report import cell
from checklist_runner import Runner, Skip, StepFailed
from checklist_steps import FP16_SCALER, FULL, LORA, REPO
from checklist_util import f, none_low, read_json, read_jsonl


class ConfigSteps(Runner):
    def step_4(self) -> None:
        """FSDP (fsdp.yaml: FSDP2, full shard per layer, bf16) on one GPU: full fine-tuning for N steps
        with a checkpoint every N/2 (a sharded save on the GPU), its speed and peak GPU memory; the saved
        model reloads with from_pretrained. What a CPU shows (the same model as DDP, exact and elastic
        resume, LoRA, merging, every script) is tested on CPU processes: tests/test_fsdp.py."""
        s, work = self.sizes, self.results / "step4"
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir()
        steps = ["--max_train_steps", s.sharded_steps, "--checkpointing_steps", s.checkpoint_every]
        command, _ = self.sft_command(work / "run", *FULL, *steps, config="fsdp.yaml", eval_samples=s.sharded_eval)
        first = self.launch("train", command, work / "run" / "metrics.json")
        if first["status"] != "ok":
            raise StepFailed(f"train: {first['error']}")
        data = read_json(work / "run" / "metrics.json")
        first["figures"] = sft_figures(data, self.llm()["facts"], self.peak(), "ours", "full")
        reloaded = self.helper("reload", work / "run", "--reference", work / "run")
        reload = reloaded[str(work / "run")]
        self.step_record["runs"]["reload"] = {
            "name": "reload",
            "status": "ok" if reload["ok"] else "failed",
            "figures": reload,
            **({} if reload["ok"] else {"error": reload["problem"]}),
        }
        self.step_record["figures"].update({"train": first["figures"], "reload": reload})
        t = first["figures"]
        self.table(
            ["check", "result"],
            [
                [
                    "trains (target tokens/s, MFU, peak GPU MiB)",
                    f"{f(t['target_tokens_per_s'], 0)}, {f(t['mfu'], 4)}, {f(t['peak_gpu_memory_mib'], 0)}",
                ],
                ["accuracy on the eval prompts (generation under FSDP)", f(t["accuracy"], 4)],
                ["saved model reloads with from_pretrained", reload.get("summary")],
            ],
        )

    def step_5(self) -> None:
        """DeepSpeed ZeRO-2 and ZeRO-3 (the repository's configs, bf16) with one process: full fine-tuning for
        N steps, generation on a few eval prompts, the saved model reloaded."""
        s, work = self.sizes, self.results / "step5"
        work.mkdir(exist_ok=True)
        environment = self.data.get("environment", {})
        if not (environment.get("packages") or {}).get("deepspeed"):
            why = environment.get("deepspeed_import_error") or (
                (environment.get("payload") or {}).get("skipped_wheels") or {}
            ).get("deepspeed")
            reason = f"deepspeed cannot be imported here{f' ({why})' if why else ''}"
            if not self.dry_run:
                raise Skip(reason)
            self.note(f"on the GPU machine this step would be skipped: {reason}")
        trained, on_cpu_2proc = {}, self.dry_run and not importlib.util.find_spec("deepspeed")
        for stage in (2, 3):
            name = f"zero{stage}"
            if on_cpu_2proc and stage == 3:
                self.step_record["runs"][name] = {
                    "name": name,
                    "status": "skipped",
                    "reason": "dry run: without deepspeed both stages run the same cpu_2proc.yaml command",
                }
                continue
            steps = ["--max_train_steps", s.sharded_steps]
            command, _ = self.sft_command(
                work / name, *FULL, *steps, config=f"deepspeed_zero{stage}.yaml", eval_samples=s.sharded_eval
            )
            run = self.launch(name, command, work / name / "metrics.json")
            if run["status"] == "ok":
                trained[name] = run
        for name, run in trained.items():
            run["figures"] = sft_figures(
                read_json(work / name / "metrics.json"), self.llm()["facts"], self.peak(), "ours", "full"
            )
        # Both saved models in one helper (each helper process costs an import of torch and transformers); where it
        # fails as a whole, the trainings' figures stay and each reload says why.
        reloaded = {}
        if on_cpu_2proc:  # the same helper as step 4's, on a CPU run that is no ZeRO run
            reloaded = {str(work / name): {"summary": "not checked in the dry run"} for name in trained}
        elif trained:
            try:
                reloaded = self.helper("reload", *(work / name for name in trained))
            except Exception as exc:
                problem = f"the reload helper failed: {exc}"[:300]
                reloaded = {
                    str(work / name): {"ok": False, "problem": problem, "summary": f"no: {problem}"} for name in trained
                }
        rows = []
        for name, run in trained.items():
            figures = run["figures"]
            figures["reload"] = reloaded[str(work / name)]
            rows.append(
                [
                    name,
                    f(figures["target_tokens_per_s"], 0),
                    f(figures["mfu"], 4),
                    f(figures["peak_gpu_memory_mib"], 0),
                    f(figures["accuracy"], 4),
                    figures["reload"].get("summary"),
                ]
            )
        self.table(["stage", "target tokens/s", "MFU", "peak GPU MiB", "accuracy", "saved model reloads"], rows)
        broken = {
            name: reloaded[str(work / name)]["summary"]
            for name in trained
            if not reloaded[str(work / name)].get("ok", True)
        }
        if broken:  # a saved model that does not load is a failed step, as step 4's
            raise StepFailed("; ".join(f"{name}'s saved model: {summary}" for name, summary in broken.items()))

    def step_6(self) -> None:
        """train_image.py's demo on one GPU (single_gpu.yaml, bf16), plain and with --sync_batchnorm. On one
        process torch's SyncBatchNorm computes plain BatchNorm (it syncs only in a world of more than one
        process): this checks the conversion, the GPU guard and the training, not the all-reduce."""
        s, work = self.sizes, self.results / "step6"
        work.mkdir(exist_ok=True)
        rows = []
        for name, extra in (("plain", []), ("sync_batchnorm", ["--sync_batchnorm"])):
            if self.dry_run and name == "plain":  # the same command as step 7's image run, but for its fp16
                reason = "dry run: step 7 runs it"
                self.step_record["runs"][name] = {"name": name, "status": "skipped", "reason": reason}
                continue
            command, _ = self.accelerate(
                "single_gpu.yaml",
                "train_image.py",
                "--output_dir",
                work / name,
                "--overwrite_output_dir",
                "--checkpointing_steps",
                "no",
                "--seed",
                42,
                *s.image,
                *extra,
            )
            run = self.launch(
                name,
                command,
                work / name / "metrics.json",
                expect_error="--sync_batchnorm needs GPUs" if extra else None,
            )
            if run["status"] != "ok":
                continue
            data = read_json(work / name / "metrics.json")
            log = (self.results / run["log"]).read_text(errors="replace")
            converted = re.search(r"--sync_batchnorm: (\d+) BatchNorm layers", log)
            run["figures"] = figures = {
                "images_per_s": data["train_samples_per_second"],
                "accuracy": data.get("eval_accuracy"),
                "peak_gpu_memory_mib": max(data.get("peak_gpu_memory_mb_per_rank") or [None], key=none_low),
                "batchnorm_layers_converted": int(converted.group(1)) if converted else 0,
            }
            rows.append(
                [
                    name,
                    f(figures["images_per_s"], 0),
                    f(figures["accuracy"], 4),
                    f(figures["peak_gpu_memory_mib"], 0),
                    figures["batchnorm_layers_converted"],
                ]
            )
        self.table(["run", "images/s", "accuracy", "peak GPU MiB", "BatchNorm layers converted"], rows)

    def step_7(self) -> None:
        """fp16 as users run it on a GPU: autocast to float16 and torch's loss scaler, here with a first
        scale of 2**40 (tests/launched/fp16_scaler.py) so that the first steps overflow and are skipped
        while the scale comes down. The image demo and the LoRA SFT of step 2 must both finish, counting
        the skipped steps; before the fix the first skipped step stopped every fp16 run."""
        s, work = self.sizes, self.results / "step7"
        work.mkdir(exist_ok=True)
        image, _ = self.accelerate(
            "single_gpu.yaml", "train_image.py", "--output_dir", work / "image", "--overwrite_output_dir", "--seed", 42
        )
        image += ["--checkpointing_steps", "no", *s.image]
        sft, _ = self.sft_command(work / "lora", *LORA, *s.fp16_llm)
        rows = []
        for name, command in (("image", image), ("lora", sft)):
            run = self.launch(name, fp16(command), work / name / "metrics.json", env={"FP16_INIT_SCALE": str(2.0**40)})
            if run["status"] != "ok":
                continue
            data = read_json(work / name / "metrics.json")
            records = read_jsonl(work / name / "train_log.jsonl")
            scales = [r["train/loss_scale"] for r in records if "train/loss_scale" in r]
            run["figures"] = figures = {
                "steps": data["optimizer_steps"],
                "skipped_steps": data.get("optimizer_steps_skipped"),
                "final_loss_scale": scales[-1] if scales else None,
                "accuracy": data.get("eval_accuracy"),
                "samples_per_s": data["train_samples_per_second"],
            }
            rows.append([name, *(f(figures[k], 4) if k == "accuracy" else cell(figures[k]) for k in figures)])
        self.table(["run", "steps", "skipped (overflows)", "final loss scale", "accuracy", "samples/s"], rows)


def fp16(command: list) -> list:
    """An `accelerate launch` command of a script made fp16 with the loss scaler: the launch asks for
    fp16, and the script runs through tests/launched/fp16_scaler.py (FP16_INIT_SCALE: its first scale)."""
    at = next(i for i, part in enumerate(command) if str(part).startswith(str(REPO / "scripts")))
    script = Path(str(command[at])).stem
    port = command.index("--main_process_port")
    return [*command[:port], "--mixed_precision", "fp16", *command[port:at], FP16_SCALER, script, *command[at + 1 :]]
