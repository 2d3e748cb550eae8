"""The runner every step runs on (`Runner`): a run's environment, each run launched, timed and recorded (`launch`,
`accelerate`, `sft_command`), a step's record with its failure caught (`run_step`), the results saved after every
run (`save`). The steps themselves are in checklist_*_steps.py, subclasses of it."""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import subprocess
import sys
import time
import traceback
from pathlib import Path

from checklist_plan import needs_llm, run_estimate_s
from checklist_report import write_results
from checklist_steps import (
    BENCH,
    CHECKLIST,
    CONFIGS,
    DEEPSPEED_ON_CPU,
    DEFAULT_SITE,
    FSDP_ON_CPU,
    PEAK_BF16,
    REPO,
    SITE_MARKER,
    STEPS,
    Sizes,
)
from checklist_util import error_line, free_port, now
from checklist_warm import WarmLauncher


class StepFailed(Exception):
    pass


class Skip(Exception):
    pass


class Runner:
    """What every step runs on; a subclass adds the steps, `step_<id>` (checklist.py's Checklist has them all)."""

    def __init__(self, args):
        self.args, self.dry_run = args, args.dry_run
        self.llm_shape = getattr(args, "llm_shape", None)  # the LLM's config and tokenizer: its weights drawn at random
        self.sizes = Sizes(self.dry_run)
        self.results = Path(args.results).resolve()
        self.logs = self.results / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.json_path, self.md_path = self.results / "gpu_check.json", self.results / "gpu_check.md"
        self.deadline = time.monotonic() + args.budget_s if args.budget_s else None
        self.site = self.find_site(args.site)
        self.copy_to = Path(args.copy_to) if args.copy_to else None
        self.data = json.loads(self.json_path.read_text()) if self.json_path.exists() and not args.fresh else {}
        if self.data.get("dry_run", self.dry_run) != self.dry_run:
            self.data = {}  # never mix a dry run's figures with a GPU run's
        self.data.update(dry_run=self.dry_run, schema=1)
        self.warm: WarmLauncher | None = None  # started at the first launch where --warm_launcher asks for it
        self.data.setdefault("steps", {})
        self.data.setdefault("calls", []).append(
            {"started": now(), "steps": args.steps, "argv": sys.argv[1:], "site": str(self.site) if self.site else None}
        )
        self.step_record: dict | None = None
        self._llm: dict | None = None

    # --- environment ------------------------------------------------------------------------------

    def find_site(self, site: str | None) -> Path | None:
        """The folder payload.py install filled with the carried wheels (put first on every run's path)."""
        path = Path(site) if site else DEFAULT_SITE
        if site or (path / SITE_MARKER).exists():
            return path
        return None

    def env(self, extra: dict | None = None) -> dict:
        """Every run's environment: offline, the carried wheels first on the path, then this repository
        (not an editable install of another checkout), the benchmarks and their baselines."""
        env = dict(os.environ)
        path = [str(self.site)] if self.site else []
        path += [str(REPO), str(BENCH), str(BENCH / "baselines")]
        if env.get("PYTHONPATH"):
            path.append(env["PYTHONPATH"])
        env.update(
            PYTHONPATH=os.pathsep.join(path),
            HF_HUB_OFFLINE="1",
            HF_DATASETS_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            TOKENIZERS_PARALLELISM="false",
            PYTHONUNBUFFERED="1",
            HF_HOME=str(self.results / "hf_home"),  # the dequantized GGUF is kept here between calls
        )
        if self.dry_run:
            env["OMP_NUM_THREADS"] = "1"  # the 2-core CI machine
        env.update(extra or {})
        return env

    def helper(self, name: str, *args, timeout: int = 600) -> dict:
        """Work that needs torch, in a subprocess of this file (`--helper`): returns its JSON."""
        out = self.results / f"helper-{name}.json"
        out.unlink(missing_ok=True)
        log = self.logs / f"helper-{name}.log"
        command = [
            sys.executable,
            str(CHECKLIST),
            "--helper",
            name,
            "--helper_out",
            str(out),
            *map(str, args),
        ]
        if self.dry_run:
            command.append("--dry_run")
        with open(log, "w") as handle:
            done = subprocess.run(
                command, cwd=REPO, env=self.env(), stdout=handle, stderr=subprocess.STDOUT, timeout=timeout
            )
        if done.returncode != 0 or not out.exists():
            raise StepFailed(f"helper {name}: {error_line(log.read_text(errors='replace'), done.returncode)}")
        return json.loads(out.read_text())

    def environment(self, steps: list[str]) -> None:
        """The machine's facts, and (when an LLM step is to run) the LLM's model, data and MFU facts, in one
        helper process (each one costs an import of torch and transformers)."""
        args = []
        if any(needs_llm(step) for step in steps):
            args = ["--llm", self.results / "llm", self.sizes.llm_train, self.sizes.llm_eval]
            if self.llm_shape:
                args += ["--llm_shape", Path(self.llm_shape).resolve()]
        try:
            found = self.helper("env", *args)
            self.data["environment"], self._llm = found["environment"], found.get("llm")
        except Exception as exc:  # recorded; the steps still run (an LLM step then fails on its own)
            self.data["environment"], self._llm = {"error": str(exc)}, None
            self._llm_error = str(exc)
        self.save()

    # --- runs -------------------------------------------------------------------------------------

    def time_left(self) -> float | None:
        return None if self.deadline is None else self.deadline - time.monotonic()

    def launch(
        self,
        name: str,
        command: list,
        result_file: Path | None = None,
        timeout: int | None = None,
        expect_error: str | None = None,
        env: dict | None = None,
    ) -> dict:
        """Run one command of this step; record it (command, wall time, status, error line, log). A run
        that would not fit in what is left of --budget_s is skipped and said so."""
        record = {"name": name, "command": shlex.join(map(str, command))}
        self.step_record["runs"][name] = record
        left = self.time_left()
        estimate_s = run_estimate_s(self.step_record["id"], name)
        if left is not None and left < estimate_s:  # stopped: the step is still to run (run_step)
            record.update(
                status="skipped",
                stopped=True,
                reason=f"{left:.0f} s left of --budget_s, this run takes about {estimate_s:.0f} s",
            )
            self.save()
            return record
        timeout = timeout or self.sizes.timeout
        budget_ends_it = left is not None and left - 5 < timeout
        if budget_ends_it:
            timeout = int(left - 5)
        log = self.logs / f"{self.step_record['id']}-{name}.log"
        record["log"] = str(log.relative_to(self.results))
        if result_file is not None:
            Path(result_file).unlink(missing_ok=True)
        print(f"  {name}: {record['command']}", flush=True)
        warm = self.warm_launcher()  # started before the clock: its imports are no run's time
        start = time.monotonic()
        with open(log, "w") as handle:
            handle.write(record["command"] + "\n\n")
            handle.flush()
            rc = warm.run(command, env or {}, handle.fileno(), timeout) if warm else "cold"
            if warm:
                record["warm"] = rc != "cold"
            if rc == "cold":
                rc = self.run_cold(command, env, handle, timeout)
        record["wall_s"] = round(time.monotonic() - start, 2)
        text = log.read_text(errors="replace")
        if rc is None and budget_ends_it:  # not a failure of the run: this call's time ran out
            record.update(
                status="skipped",
                stopped=True,
                reason=f"stopped after {timeout} s, at the end of --budget_s: run it again",
            )
        elif rc is None:
            record.update(status="failed", error=f"timed out after {timeout} s; last line: {error_line(text, 0)}")
        elif rc != 0:
            record.update(status="failed", error=error_line(text, rc))
        elif result_file is not None and not Path(result_file).exists():
            record.update(
                status="failed", error=f"exit 0 but no {Path(result_file).name}; last line: {error_line(text, 0)}"
            )
        else:
            record["status"] = "ok"
        if record["status"] == "failed" and expect_error and self.dry_run:
            record["expected_in_dry_run"] = expect_error in record["error"]
        print(
            f"    {record['status']} in {record['wall_s']:.1f} s"
            + (f": {record.get('error')}" if record.get("error") else ""),
            flush=True,
        )
        self.save()
        return record

    def run_cold(self, command: list, env: dict | None, handle, timeout: float) -> int | None:
        """`command` in a fresh process, writing to `handle`: its exit code, or None past `timeout` (then killed)."""
        process = subprocess.Popen(
            [str(c) for c in command],
            cwd=REPO,
            env=self.env(env),
            stdout=handle,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            return process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, 9)  # the launcher and its workers
            process.wait()
            return None

    def warm_launcher(self) -> WarmLauncher | None:
        """The dry run's warm launcher (checklist_warm.py) where --warm_launcher asks for it, started with every run's
        environment at its first use, and again where it has died; None otherwise, or where it does not start (the
        runs then go cold, and the step says so)."""
        if not getattr(self.args, "warm_launcher", False):
            return None
        if self.warm is not None and not self.warm.alive():
            self.warm.stop()
            self.warm = None
        if self.warm is None:
            try:
                self.warm = WarmLauncher(self.env())
            except Exception as error:
                self.note(f"dry run: the warm launcher did not start ({error}); runs launched cold")
                self.args.warm_launcher = False
        return self.warm

    def accelerate(self, config: str, script: str, *args, processes: int = 1) -> tuple[list, str]:
        """`accelerate launch` with a repository config. In the dry run, fsdp.yaml runs through
        tests/launched/fsdp_on_cpu.py (Accelerate's own FSDP2 path on CPU processes, as the test suite
        runs it), and a DeepSpeed config through tests/launched/deepspeed_on_cpu.py (Accelerate's DeepSpeed path
        and DeepSpeed's engine on CPU processes), or where deepspeed is not installed, cpu_2proc.yaml; the step
        records which."""
        used, target = config, [REPO / "scripts" / script]
        if self.dry_run and config.startswith("fsdp"):
            target = [FSDP_ON_CPU, REPO / "scripts" / script]
            self.note(f"dry run: accelerate_configs/{config} through tests/launched/fsdp_on_cpu.py (FSDP2 on CPU)")
        elif self.dry_run and config.startswith("deepspeed") and importlib.util.find_spec("deepspeed"):
            target = [DEEPSPEED_ON_CPU, REPO / "scripts" / script]
            self.note(f"dry run: accelerate_configs/{config} through tests/launched/deepspeed_on_cpu.py (on CPU)")
        elif self.dry_run and config.startswith("deepspeed"):
            used = "cpu_2proc.yaml"
            self.note(f"dry run: accelerate_configs/{config} replaced by cpu_2proc.yaml (deepspeed is not installed)")
        command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", CONFIGS / used]
        command += ["--num_processes", processes, "--main_process_port", free_port(), *target, *args]
        return command, used

    def note(self, text: str) -> None:
        notes = self.step_record.setdefault("notes", [])
        if text not in notes:
            notes.append(text)

    # --- a step, and what the steps share: the LLM, our SFT's command -----------------------------

    def run_step(self, step: str) -> None:
        record = {"id": step, "title": STEPS[step], "started": now(), "runs": {}, "figures": {}}
        self.step_record = self.data["steps"][step] = record
        print(f"step {step}: {STEPS[step]}", flush=True)
        start = time.monotonic()
        try:
            getattr(self, "step_" + step)()
            failed = [r for r in record["runs"].values() if r.get("status") == "failed"]
            if failed:
                record.update(status="failed", error="; ".join(f"{r['name']}: {r['error']}" for r in failed))
                if self.dry_run and all(r.get("expected_in_dry_run") for r in failed):
                    record["expected_in_dry_run"] = True
            elif record["runs"] and all(r.get("status") == "skipped" for r in record["runs"].values()):
                record.update(
                    status="skipped", reason="; ".join(f"{r['name']}: {r['reason']}" for r in record["runs"].values())
                )
            elif stopped := [r for r in record["runs"].values() if r.get("stopped")]:
                # a run cut at the budget, or not started for it, leaves the step's figures unmeasured: the step is
                # still to run (session 4's step 3 read "ok" with its eager run alone)
                record.update(status="skipped", reason="; ".join(f"{r['name']}: {r['reason']}" for r in stopped))
            else:
                record["status"] = "ok"
        except StepFailed as exc:
            record.update(status="failed", error=str(exc))
        except Skip as exc:
            record.update(status="skipped", reason=str(exc))
        except Exception as exc:  # a bug in this step must not cost the others
            record.update(
                status="failed", error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc()[-3000:]
            )
        record["wall_s"] = round(time.monotonic() - start, 2)
        print(f"  -> {record['status']} in {record['wall_s']:.1f} s", flush=True)
        self.save()

    def llm(self) -> dict:
        """The LLM's model directory, data files and the facts MFU needs (made once per call, by `environment`)."""
        if not self._llm:
            raise StepFailed(
                f"the LLM could not be prepared: {getattr(self, '_llm_error', 'no LLM step was asked for')}"
            )
        self.step_record["figures"].setdefault("model", self._llm["facts"]["summary"])
        return self._llm

    def sft_command(
        self,
        out: Path,
        *extra,
        config: str = "single_gpu.yaml",
        eval_samples: int | None = None,
        zero_shot: bool = False,
    ) -> tuple[list, str]:
        """scripts/train_sft.py on the step-2 work: the demo's chat records from files both trainers read,
        block 256, bf16 through the launch config, the demo's generation settings; no checkpoints."""
        s, llm = self.sizes, self.llm()
        model = ["--model_name_or_path", llm["gguf_dir"], "--gguf_file", llm["gguf_file"]] if self.dry_run else []
        if self.llm_shape:
            model = ["--model_name_or_path", llm["model_dir"]]
        args = [
            *model,
            "--train_file",
            llm["train_file"],
            "--validation_file",
            llm["validation_file"],
            "--block_size",
            s.block_size,
            "--per_device_train_batch_size",
            s.llm_batch,
            "--num_train_epochs",
            s.llm_epochs,
            "--per_device_eval_batch_size",
            32,
            "--eval_max_new_tokens",
            8,
            "--no-eval_perplexity",
            "--logging_steps",
            5,
            "--seed",
            42,
            "--output_dir",
            out,
            "--overwrite_output_dir",
            *([] if zero_shot else ["--skip_zero_shot"]),
            *(["--max_eval_samples", eval_samples] if eval_samples else []),
            *map(str, extra),
        ]
        if "--checkpointing_steps" not in args:
            args += ["--checkpointing_steps", "no"]
        return self.accelerate(config, "train_sft.py", *args)

    # --- helpers of the steps ---------------------------------------------------------------------------

    def env_has(self, package: str) -> bool:
        return bool(self.data.get("environment", {}).get("packages", {}).get(package))

    def peak(self) -> float | None:
        gpu = (self.data.get("environment", {}).get("gpu") or {}).get("name") or ""
        return next((peak for name, peak in PEAK_BF16 if name in gpu), None)

    def table(self, columns: list, rows: list) -> None:
        self.step_record["table"] = {"columns": columns, "rows": rows}

    # --- results ----------------------------------------------------------------------------------

    def save(self) -> None:
        self.data["updated"] = now()
        self.data["steps"] = {step: self.data["steps"][step] for step in STEPS if step in self.data["steps"]}
        write_results(self.results, self.data, self.copy_to)
