"""The results of a run: `write_results` at the end (metrics.json, training_args.json and the
report in `<output_dir>/report/`: PNG plots of the logged curves, a confusion matrix for
classification, and a short summary, `README.md`, that shows them), and `plot_runs`, which draws
several runs' curves on shared axes.

Plots use matplotlib's Agg canvas directly, never pyplot, so no display or global backend is
touched; matplotlib is imported only when a picture is drawn, on the main process.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.logging import get_logger

from ..checkpoints.write_failure import agree_on_write
from ..core.files import write_json
from ..core.redact import loggable_args
from ..training.compilation import compile_counts
from ..training.training_log import describe, peak_memory_mb, read_train_log
from .after_the_run import after_every_rank
from .hub import push_to_hub
from .model_card import write_model_card

logger = get_logger(__name__)

REPORT_DIR = "report"
# Panels of the training figure, in order: logged key -> axis label (those the run logged are drawn).
TRAINING_PANELS = {
    "train/loss": "train loss",
    "train/learning_rate": "learning rate",
    "train/grad_norm": "gradient norm (before clipping)",
    "train/samples_per_second": "samples / s (all processes)",
    "train/tokens_per_second": "tokens / s (all processes)",
    "train/peak_memory_mb": "peak host memory, MB (max over processes)",
    "train/peak_gpu_memory_mb": "peak GPU memory, MB (max over processes)",
}
# Evaluation values that are counts, not scores: not plotted.
_EVAL_COUNTS = ("eval/examples", "eval/tokens", "eval/sequences")


def write_results(
    accelerator: Accelerator, args, plan, scores: dict, extra: dict | None = None, confusion=None
) -> dict:
    """All ranks call this at the end of training (it gathers each rank's peak memory): the main
    process writes metrics.json (the last evaluation's `scores`, the run's facts from `plan`, peak
    memory per rank and `extra`, what the script reports about its data), training_args.json
    (secrets redacted), report/ (plots and summary; with `confusion`, a `ConfusionMatrix` from
    the last evaluation, its picture too) and the model card, README.md; with --push_to_hub it
    queues the upload of the output directory (`hub.push_to_hub`), which the main process does once
    every rank has finished (`process_exit.run`). Returns the metrics, on every rank."""
    memory = peak_memory_mb(accelerator.device)
    per_rank = accelerator.gather(torch.tensor([list(memory.values())], device=accelerator.device)).cpu()
    facts = {
        **plan.facts(),
        **{f"{name}_per_rank": [round(v, 1) for v in per_rank[:, i].tolist()] for i, name in enumerate(memory)},
    }
    if getattr(args, "dynamo_backend", "no") != "no" or getattr(args, "compile_generation", False):  # start_run's
        facts.update(compile_counts())  # the main process's: graphs, breaks, functions left uncompiled, CUDA graphs
    metrics = {**scores, **facts, **(extra or {})}
    output_dir, error = args.output_dir, None
    if accelerator.is_main_process:  # fp16: the steps the loss scaler skipped, logged per window (resumes included)
        skipped = [
            record["train/skipped_steps"] for record in read_train_log(output_dir) if "train/skipped_steps" in record
        ]
        if skipped:
            metrics["optimizer_steps_skipped"] = sum(skipped)
    try:
        write_json(accelerator, f"{output_dir}/metrics.json", metrics)
        write_json(accelerator, f"{output_dir}/training_args.json", loggable_args(args))
        if accelerator.is_main_process:
            write_report(output_dir, summary_table(args, facts, extra), scores, confusion)
            write_model_card(args, metrics)  # README.md: what the Hub shows
    except Exception as exc:  # reported on every rank by agree_on_write
        error = exc
    agree_on_write(accelerator, error, f"the results to {output_dir!r}", output_dir)
    if getattr(args, "push_to_hub", False) and accelerator.is_main_process:
        # Not now: the other ranks would wait for the upload in a collective that --ddp_timeout ends.
        after_every_rank(f"uploading {output_dir} to the Hub", lambda: push_to_hub(args))
        nodes = accelerator.num_processes // int(os.environ.get("LOCAL_WORLD_SIZE", accelerator.num_processes))
        logger.info(
            "the upload to the Hub starts once every process has finished (ddp_utils.run does it)"
            + (
                f"; the launchers of the {nodes - 1} other node(s) wait for it at most 5 minutes (torchrun's exit "
                "barrier), then say 'Error waiting on exit barrier' and exit 0"
                if nodes > 1
                else ""
            )
        )
    logger.info(f"saved to {output_dir}: {describe(plan.facts())}; report in {output_dir}/report/README.md")
    return metrics


def _series(records: list[dict], key: str, x: str = "step"):
    rows = [(r[x], r[key]) for r in records if key in r and r[key] is not None and x in r]
    return [a for a, _ in rows], [b for _, b in rows]


def _figure(panels: int, width: float = 5.0, height: float = 3.2, fit_labels: bool = False):
    """A figure of `panels` axes, two per row, with fixed margins (`_fixed_margins`), or with
    `fit_labels` matplotlib's constrained layout, for tick labels of any length (the confusion
    matrix's label names)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    columns = min(panels, 2)
    rows = -(-panels // columns)
    figure = Figure(figsize=(width * columns, height * rows), dpi=100, layout="constrained" if fit_labels else None)
    FigureCanvasAgg(figure)
    if not fit_labels:
        _fixed_margins(figure, rows, columns)
    return figure, [figure.add_subplot(rows, columns, i + 1) for i in range(panels)]


def _fixed_margins(figure, rows: int, columns: int) -> None:
    """Margins in inches, wide enough for numeric tick labels, a title and an x label. Not a layout
    engine: the constrained layout measured half the cost of writing the report, which every run
    pays at its end."""
    width, height = figure.get_size_inches()
    left, right, top, bottom, gap = 0.75, 0.2, 0.35, 0.5, 0.8  # gap: the next column's y tick labels
    axes_width = (width - left - right - gap * (columns - 1)) / columns
    axes_height = (height - (top + bottom) * rows) / rows
    figure.subplots_adjust(
        left=left / width,
        right=1 - right / width,
        bottom=bottom / height,
        top=1 - top / height,
        wspace=gap / axes_width,
        hspace=(top + bottom) / axes_height,
    )


def eval_keys(records: list[dict]) -> list[str]:
    """The evaluation scores logged in `records` (not the counts), in first-seen order."""
    keys = dict.fromkeys(k for r in records for k in r if k.startswith("eval/") and k not in _EVAL_COUNTS)
    return list(keys)


def plot_training(records: list[dict], path: str) -> bool:
    """Loss, learning rate, gradient norm, throughput and memory against optimizer steps.
    Returns False (and writes nothing) when nothing was logged."""
    series = {key: _series(records, key) for key in TRAINING_PANELS}
    keys = [key for key in TRAINING_PANELS if series[key][0]]
    if not keys:
        return False
    figure, axes = _figure(len(keys))
    for key, ax in zip(keys, axes):
        steps, values = series[key]
        ax.plot(steps, values, marker="." if len(steps) < 30 else None)
        ax.set_title(TRAINING_PANELS[key], fontsize=10)
        ax.set_xlabel("optimizer step")
        ax.grid(alpha=0.3)
    figure.savefig(path)
    return True


def plot_eval(records: list[dict], path: str) -> bool:
    """Each evaluation score against epochs. Returns False when there was no evaluation."""
    from matplotlib.ticker import MaxNLocator

    keys = eval_keys(records)
    if not keys:
        return False
    figure, axes = _figure(len(keys), height=3.0)
    for key, ax in zip(keys, axes):
        ax.plot(*_series(records, key, x="epoch"), marker="o")
        ax.set_title(key, fontsize=10)
        ax.set_xlabel("epoch")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    figure.savefig(path)
    return True


def plot_confusion_matrix(counts: np.ndarray, label_names: list[str], path: str) -> None:
    """The confusion matrix as a heat map with the count in each cell."""
    size = max(4.0, 0.6 * len(label_names) + 2.5)
    figure, (ax,) = _figure(1, width=size, height=size, fit_labels=True)
    ax.imshow(counts, cmap="Blues")
    ticks = range(len(label_names))
    ax.set_xticks(ticks, label_names, rotation=45, ha="right")
    ax.set_yticks(ticks, label_names)
    ax.set_xlabel("predicted")
    ax.set_ylabel("true")
    ax.set_title(f"confusion matrix ({int(counts.sum())} evaluation examples)", fontsize=10)
    if len(label_names) <= 30:
        threshold = counts.max() / 2 if counts.size else 0
        for (i, j), value in np.ndenumerate(counts):
            ax.text(
                j, i, str(value), ha="center", va="center", fontsize=8, color="white" if value > threshold else "black"
            )
    figure.savefig(path)


def _duration(seconds: float) -> str:
    minutes, seconds = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min" if hours else f"{minutes} min {seconds:02d} s" if minutes else f"{seconds} s"


def _number(value) -> str:
    if isinstance(value, float):
        return f"{value:,.4g}" if abs(value) < 1e4 else f"{value:,.0f}"
    return f"{value:,}" if isinstance(value, int) else str(value)


def write_report(output_dir: str, summary: dict, final_scores: dict, confusion=None) -> list[str]:
    """Write `<output_dir>/report/`: training.png, eval.png, confusion_matrix.png (+ .json) when
    `confusion` (a `classification.ConfusionMatrix`) is given, and README.md with `summary` (a
    label -> text table) and the final
    scores, pointing at the pictures. Built in a staging directory and moved into place whole.
    The main process calls it; returns the names of the pictures written."""
    records = read_train_log(output_dir)
    staging = tempfile.mkdtemp(prefix=".staging-report-", dir=output_dir)
    try:
        pictures = {}
        if plot_training(records, os.path.join(staging, "training.png")):
            pictures["training.png"] = (
                "Training: loss, learning rate, gradient norm, throughput and memory per optimizer step"
            )
        if plot_eval(records, os.path.join(staging, "eval.png")):
            pictures["eval.png"] = "Evaluation after each epoch"
        if confusion is not None:
            plot_confusion_matrix(confusion.counts, confusion.labels, os.path.join(staging, "confusion_matrix.png"))
            with open(os.path.join(staging, "confusion_matrix.json"), "w") as handle:
                json.dump(
                    {
                        "labels": confusion.labels,
                        "counts": confusion.counts.tolist(),
                        "rows": "true label",
                        "columns": "predicted label",
                    },
                    handle,
                    indent=1,
                )
            pictures["confusion_matrix.png"] = (
                "Confusion matrix on the evaluation set (rows: true label; columns: predicted)"
            )
        lines = [f"# Run report: {os.path.basename(os.path.abspath(output_dir))}", "", "| | |", "|---|---|"]
        lines += [f"| {label} | {value} |" for label, value in summary.items()]
        if final_scores:
            lines += ["", "## Final evaluation", "", "| metric | value |", "|---|---|"]
            lines += [f"| {name} | {_number(value)} |" for name, value in final_scores.items()]
        for name, caption in pictures.items():
            lines += ["", f"## {caption}", "", f"![{caption}]({name})"]
        lines += [
            "",
            "Every logged value is in `../train_log.jsonl`; the TensorBoard events (if any) in `../runs/`.",
            "",
        ]
        with open(os.path.join(staging, "README.md"), "w") as handle:
            handle.write("\n".join(lines))
        target = os.path.join(output_dir, REPORT_DIR)
        if os.path.isdir(target):
            shutil.rmtree(target)
        os.replace(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return list(pictures)


def summary_table(args, facts: dict, extra: dict | None = None) -> dict:
    """The report's summary rows from the run's options, `StepPlan.facts()` and what the
    script reported about its data (`extra`: skipped images, dropped tokens, ...)."""
    dataset, config = getattr(args, "dataset_name", None), getattr(args, "dataset_config_name", None)
    data = (
        getattr(args, "train_file", None) or (f"{dataset} ({config})" if config else dataset) or "the offline demo data"
    )
    trained = [f"{facts['train_samples_seen']:,} samples"]
    if "train_tokens_seen" in facts:
        trained.append(f"{facts['train_tokens_seen']:,} tokens")
    if "train_target_tokens_seen" in facts:
        trained.append(f"{facts['train_target_tokens_seen']:,} target tokens")
    rows = {
        "model": f"`{args.model_name_or_path}`",
        "data": f"`{data}`",
        "processes": f"{facts['world_size']} ({facts['distributed_type']}, mixed precision {facts['mixed_precision']})",
        "optimizer steps": f"{facts['optimizer_steps']} ({facts['epochs']} epochs)",
        "trained on": ", ".join(trained),
        "wall time": f"{_duration(facts['wall_time_s'])} (training steps {_duration(facts['train_runtime_s'])})",
        "throughput": f"{facts['train_samples_per_second']:,.1f} samples/s"
        + (f", {facts['train_tokens_per_second']:,.0f} tokens/s" if "train_tokens_per_second" in facts else "")
        + " (all processes)",
        "peak memory per process": ", ".join(f"{value:,.0f} MB" for value in facts["peak_memory_mb_per_rank"])
        + " (host)",
    }
    if facts.get("peak_gpu_memory_mb_per_rank"):
        rows["peak GPU memory per process"] = ", ".join(
            f"{value:,.0f} MB" for value in facts["peak_gpu_memory_mb_per_rank"]
        )
    for name, value in (extra or {}).items():
        if isinstance(value, (int, float, str)):
            rows[name.replace("_", " ")] = _number(value)
    return rows


def plot_runs(
    output_dirs: list[str], path: str, keys: list[str] | None = None, names: list[str] | None = None
) -> list[str]:
    """Draw the curves of several runs on shared axes, one panel per logged key (default: train
    loss and every evaluation score any of them logged), one line per run, into the PNG `path`.
    Returns the keys drawn."""
    from matplotlib.ticker import MaxNLocator

    names = names or [os.path.basename(os.path.abspath(d)) for d in output_dirs]
    runs = [(name, read_train_log(d)) for name, d in zip(names, output_dirs)]
    if keys is None:
        keys = ["train/loss", *dict.fromkeys(k for _, records in runs for k in eval_keys(records))]
    keys = [k for k in keys if any(_series(records, k)[0] for _, records in runs)]
    if not keys:
        raise ValueError(f"none of {output_dirs} holds a train_log.jsonl with those values")
    figure, axes = _figure(len(keys))
    for key, ax in zip(keys, axes):
        x = "epoch" if key.startswith("eval/") else "step"
        for name, records in runs:
            xs, ys = _series(records, key, x=x)
            if xs:
                ax.plot(xs, ys, label=name, marker="o" if x == "epoch" else None)
        ax.set_title(key, fontsize=10)
        ax.set_xlabel("epoch" if x == "epoch" else "optimizer step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    figure.savefig(path)
    return keys
