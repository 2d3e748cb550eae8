"""The figures' arithmetic: an SFT run's throughput and MFU (`sft_figures`, `model_flops`), a classifier run's
figures (`classifier_figures`), a run's steady speed, the graph breaks in dynamo's log, a table row of an SFT run;
and the notes that say, in each step's record, what the figures mean."""

from __future__ import annotations

import array
import math
import re
import statistics
from pathlib import Path

from checklist_util import f, none_low, read_json, read_jsonl, safetensors_header

MFU_NOTE = (
    "MFU = model FLOPs of the work / training seconds / the GPU's dense bf16 peak (H100 SXM and H200: 989 TFLOP/s). "
    "Model FLOPs, counted from the model (not the kernels): per real input token 2 FLOPs per weight of the "
    "transformer layers' linear maps (P), at each target position 2 per weight of the LM head (V×d; the loss needs "
    "no logits elsewhere), and causal attention 2·layers·d_attn·L per token (L: its record's length, from the "
    "records' token counts). Full fine-tuning: 3× that forward (the backward computes gradients of the inputs and of "
    "the weights). LoRA: the frozen weights need only the gradients of their inputs, so 2× the forward of the "
    "linear maps and the head, 3× the attention, plus 6 per LoRA weight per token. Gradient checkpointing's "
    "recomputed forward is not counted (MFU, not hardware FLOPs utilisation). TRL's MFU counts its own loss "
    "positions as targets; its LM head at the other positions is work outside the model FLOPs."
)
QLORA_NOTE = (
    "QLoRA on both sides: bitsandbytes' BitsAndBytesConfig(load_in_4bit, nf4, double quantization, computing in "
    "bf16), quantized on the GPU it trains on; LoRA r16 on every linear layer. TRL casts the adapters to bf16 on a "
    "quantized base (its QLoRA choice); ours trains them in fp32, as its plain LoRA. qlora_x_lora: ours on the "
    "4-bit base over ours on the full-precision base, the same work (below 1: the speed the dequantization costs); "
    "qlora_saves_gpu_mib: the peak GPU memory it saves. MFU counts LoRA's model FLOPs (dequantizing is outside them)."
)
CLASSIFIER_NOTE = (
    "The LLM as train.py's classifier (AutoModelForSequenceClassification: its body, a new score head reading the "
    "last token that is not padding): full fine-tuning at train.py's default 1e-4, LoRA r16 (alpha 16, dropout "
    "0.05, every linear layer of the body; the score head trains whole) and QLoRA (the same on a 4-bit NF4 base, "
    "double quantized, computing in bf16; the head not quantized) at its default 5e-4; bf16 autocast with fp32 "
    "trainable weights. samples/s: training alone (metrics.json's train_runtime_s); peak GPU memory: the run's "
    "whole peak, evaluation included. saved MiB: the adapter, or the whole model; merged/ is not counted."
)
CHECKPOINTING_NOTE = (
    "Step 15: the LLM as train.py's classifier, LoRA r16 at its default 5e-4, batch 32 (the activations most of "
    "the memory), with and without --gradient_checkpointing (transformers' non-reentrant checkpointing of each "
    "decoder layer: its activations recomputed in the backward pass). The same seed, batches and dropout masks "
    "(recomputation replays the masks), so the two runs train the same model up to the GPU's rounding: the "
    "training loss and gradient norm at every logged step, and the evaluation's loss after training, must agree "
    "within 2%; the saved adapters' distance is reported. peak GPU memory: the run's whole peak."
)
CHECKPOINTING_TOLERANCE = 0.02  # relative: bf16 kernels that accumulate in another order (atomics) over 57 steps
TRL_DIFFERS = (
    "What differs from TRL: TRL's loss covers the completion's tokens as its chat template renders them (the "
    "answer, <|im_end|> and the newline after it; ours stops at <|im_end|>); TRL computes the LM head at every "
    "position (in chunks, its fused head) and per-step token accuracy and entropy metrics with host syncs; ours "
    "runs the head at target positions only. TRL without packing is padding-free (each batch one flattened "
    "sequence, block-diagonal attention from position_ids); ours pads each length-grouped batch to a multiple of "
    "8. Both: bf16 autocast with fp32 trainable weights, fused AdamW, one process, no DDP."
)


def sft_figures(data: dict, facts: dict, peak: float | None, who: str, case: str) -> dict:
    """Throughput, MFU, memory and accuracy of one SFT run (ours: metrics.json; TRL: its results JSON)."""
    if who == "ours":
        seconds, records = data["train_runtime_s"], data["train_samples_seen"]
        if case.endswith("_packed"):  # ours counts packed rows as its samples: the records are what both train
            records = (facts["records"] - data.get("train_records_dropped", 0)) * data["epochs"]
        tokens, targets = data["train_tokens_seen"], data["train_target_tokens_seen"]
        memory = max(data.get("peak_gpu_memory_mb_per_rank") or [None], key=none_low)
        padded = 1 + data.get("train_padding_waste", 0.0)
    else:
        seconds, records = data["train_time_s"], data["train_samples"]
        tokens, targets = data["real_tokens"], data["target_tokens"]
        memory = data.get("peak_gpu_memory_mb")
        padded = (data["padded_tokens"] + data["real_tokens"]) / max(data["real_tokens"], 1)
    # QLoRA's model FLOPs are LoRA's: dequantizing the 4-bit weights in each pass is work outside them
    flops = model_flops(facts, tokens, targets, lora="lora" in case)
    return {
        "train_s": seconds,
        "records_per_s": records / seconds,
        "input_tokens_per_s": tokens / seconds,
        "target_tokens_per_s": targets / seconds,
        "model_tflop_per_s": flops / seconds / 1e12,
        "mfu": flops / seconds / peak if peak else None,
        "peak_gpu_memory_mib": memory,
        "accuracy": data.get("eval_accuracy"),
        "zero_shot_accuracy": data.get("zero_shot_accuracy"),
        "padded_per_real": padded,
        "records": records,
        "input_tokens": tokens,
        "target_tokens": targets,
    }


def classifier_figures(out: Path, log: str) -> dict:
    """One train.py run of step 14 or 15: its metrics.json, the weights it trained (its log's LoRA line) and saved."""
    data = read_json(out / "metrics.json")
    lora = re.search(r"LoRA r=\d+: ([\d,]+) trainable of ([\d,]+) parameters", log)
    files = [*out.glob("*.safetensors")]  # the adapter, or the whole model (merged/ is not counted)
    return {
        "samples_per_s": data["train_samples_per_second"],
        "train_s": data["train_runtime_s"],
        "peak_gpu_memory_mib": max(data.get("peak_gpu_memory_mb_per_rank") or [None], key=none_low),
        "peak_rss_mib": max(data.get("peak_memory_mb_per_rank") or [None], key=none_low),
        "accuracy": data.get("eval_accuracy"),
        "eval_loss": data.get("eval_loss"),
        "f1": data.get("eval_f1"),
        "trainable": f"{lora.group(1)} of {lora.group(2)}" if lora else "all",
        "saved_mib": sum(path.stat().st_size for path in files) / 2**20,
        "mixed_precision": data.get("mixed_precision"),
    }


def same_training(plain: Path, checkpointed: Path) -> dict:
    """How far apart two train.py runs of the same work trained (step 15): the largest relative difference of the
    training loss and of the gradient norm over the steps both logged (train_log.jsonl), of the evaluation's loss
    after training, and of the float32 weights both saved (the adapter and the head: their distance over the plain
    run's norm). NaN where a value is not finite, so that no comparison passes it."""

    def relative(a, b) -> float:
        if not (math.isfinite(a) and math.isfinite(b)):
            return math.nan
        return abs(a - b) / max(abs(b), 1e-12)

    logs = [
        {record["step"]: record for record in read_jsonl(out / "train_log.jsonl") if "train/loss" in record}
        for out in (plain, checkpointed)
    ]
    steps = sorted(set(logs[0]) & set(logs[1]))
    drift = {"logged_steps": len(steps)}
    for key, name in (("train/loss", "train_loss"), ("train/grad_norm", "grad_norm")):
        changes = [relative(logs[1][s][key], logs[0][s][key]) for s in steps if key in logs[0][s] and key in logs[1][s]]
        drift[f"{name}_max_relative_change"] = max(changes, key=lambda c: (math.isnan(c), c), default=None)
    losses = [read_json(out / "metrics.json").get("eval_loss") for out in (plain, checkpointed)]
    drift["eval_loss_relative_change"] = None if None in losses else relative(losses[1], losses[0])
    weights = [float32_tensors(out / "adapter_model.safetensors") for out in (plain, checkpointed)]
    common = sorted(set(weights[0]) & set(weights[1]))
    if common:
        apart = sum((a - b) ** 2 for name in common for a, b in zip(weights[1][name], weights[0][name]))
        norm = sum(b**2 for name in common for b in weights[0][name])
        drift["saved_weights_relative_difference"] = math.sqrt(apart / max(norm, 1e-30))
    return drift


def float32_tensors(path: Path) -> dict:
    """The float32 tensors of a safetensors file, flat, read with the standard library (the runner imports no torch):
    an 8-byte little-endian header length, the JSON header, the data (little-endian: this machine's order)."""
    if not path.exists():
        return {}
    data = path.read_bytes()
    header, start = safetensors_header(data)
    body = data[start:]
    tensors = {}
    for name, entry in header.items():
        if name != "__metadata__" and entry["dtype"] == "F32":
            start, end = entry["data_offsets"]
            tensors[name] = array.array("f", body[start:end])
    return tensors


def model_flops(facts: dict, tokens: float, targets: float, lora: bool) -> float:
    """Model FLOPs of training on `tokens` real input tokens with `targets` loss positions (see MFU_NOTE)."""
    linear = 2 * facts["linear_params"] * tokens
    head = 2 * facts["head_params"] * targets
    # Per layer, a token attending to n earlier ones: n·d multiply-adds for the scores, n·d for the weighted sum.
    attention = 4 * facts["layers"] * facts["attention_width"] * facts["mean_tokens_attended"] * tokens
    if not lora:
        return 3 * (linear + head + attention)
    return 2 * (linear + head) + 3 * attention + 6 * facts["lora_params"] * tokens


def row_of(figures: dict, trl: dict | None) -> list:
    return [
        f(figures["target_tokens_per_s"], 0),
        f(figures["input_tokens_per_s"], 0),
        f(figures["records_per_s"], 2),
        f(figures["records_per_s"] / trl["records_per_s"], 3) if trl else "-",
        f(figures["mfu"], 4),
        f(figures["peak_gpu_memory_mib"], 0),
        f(figures["accuracy"], 4)
        + (
            f" (zero-shot {figures['zero_shot_accuracy']:.4f})" if figures.get("zero_shot_accuracy") is not None else ""
        ),
        f(figures["padded_per_real"], 3),
        f(figures["train_s"], 1),
    ]


def steady(run_dir: Path) -> dict:
    """A run's training seconds and tokens, and its steady-state tokens/s: the median over the logged
    windows of the second half of training."""
    data = read_json(run_dir / "metrics.json")
    speeds = [
        r["train/tokens_per_second"] for r in read_jsonl(run_dir / "train_log.jsonl") if "train/tokens_per_second" in r
    ]
    late = speeds[len(speeds) // 2 :] or speeds
    return {
        "train_s": data["train_runtime_s"],
        "tokens": data["train_tokens_seen"],
        "steady_tokens_per_s": statistics.median(late) if late else None,
    }


def graph_breaks(log: str) -> dict:
    """The graph breaks dynamo logged (TORCH_LOGS=graph_breaks), so that a speed-up measured on a fragmented
    graph says so: how many (each frame dynamo compiled and broke, a recompile's again: what torch's own
    counter counts), and how many at each place, "file:line: the operator or reason"."""
    places: dict[str, int] = {}
    lines = [line.split("[__graph_breaks]", 1)[-1].strip() for line in log.splitlines()]
    for at, line in enumerate(lines):
        found = re.match(r"Graph break .*in user code at (\S+):(\d+)", line)
        if not found:
            continue
        why = ""
        for text in lines[at + 1 : at + 12]:  # the first break's operator, or else its reason
            if text.startswith("Developer debug context:"):
                why = text.removeprefix("Developer debug context:").strip()
                break
            if text.startswith("Graph Break Reason:") and not why:
                why = text.removeprefix("Graph Break Reason:").strip()
        place = f"{Path(found.group(1)).name}:{found.group(2)}: {why[:120] or 'no reason logged'}"
        places[place] = places.get(place, 0) + 1
    return {"graph_breaks": sum(places.values()), "graph_break_places": places}
