"""GRPO's pieces: completions sampled the same way on any layout, rewards from plain Python
functions, group-normalised advantages, and the clipped loss, normalised exactly over the whole step.

The same run on any layout: each completion is sampled from its own generator, seeded by (seed, step, the
prompt's place in the data, the sample's number), through the Gumbel-max trick in a logits processor
(`SeededSampling`). 1 process, N processes, and 1 process with accumulation draw the same completions for the
same prompts, whatever else shares their batch; transformers' sampling draws from one generator per process.
"""

from __future__ import annotations

import contextlib
import hashlib
import math

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.logging import get_logger

from ..core.errors import UsageError
from ..core.ranks import fail_together
from ..core.sharded import is_sharded
from ..data.dataloaders import SAMPLE_WEIGHT
from ..data.evaluation import check_metric_for_best_model
from ..data.raw_data import RECORD_COLUMN
from ..data.record_names import record_name
from ..training.compilation import generation_context
from ..training.exact_loss import INPUT_TOKENS
from ..training.fsdp import root_ready_for_generation
from .cache_rows import cache_of, counts_its_tokens, empty_cache, forget_rope_deltas, repeat_rows
from .generation import (
    GENERATION_SCORES,
    are_labels,
    only_this_config,
    sampling_precision,
    settle_accuracy_metric,
    stop_token_ids,
)
from .group_scoring import completion_logps, one_row_per_prompt
from .lora_merge import merged_for_generation
from .pair_scoring import ONE_ROW
from .weight_reads import weights_read_whole

logger = get_logger(__name__)

LOSS_TYPES = ("token", "sequence")  # DAPO's and TRL's default: a mean over tokens; the original GRPO's: over answers
LOSS_WEIGHT = "loss_weight"  # per rollout row: its completion tokens (token loss), or 1 (sequence loss); 0 for fillers


def decode_completions(tokenizer, rollouts: list[dict]) -> list[str]:
    """The completions of `rollouts` as text, their stop token and padding left out."""
    return [
        tokenizer.decode(ids[mask.bool()], skip_special_tokens=True)
        for rollout in rollouts
        for ids, mask in zip(rollout["completion_ids"], rollout["completion_mask"])
    ]


def sample_seed(seed: int, step: int, prompt: int, sample: int) -> int:
    """The seed of one completion: (run seed, optimizer step, the prompt's place in the data, the sample)."""
    digest = hashlib.blake2b(f"{seed}/{step}/{prompt}/{sample}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


class SeededSampling:
    """A logits processor that turns greedy decoding into sampling with temperature and top-p, each row drawing
    from its own generator: argmax(log p + Gumbel noise) is a sample from p. So a row's draws do not depend on the
    rows beside it. The generators live where the logits are (a device without generators of its own: the CPU):
    on a GPU the draws are CUDA's numbers for each seed, not the CPU's, made there with no copy from the host and
    no CPU thread drawing (it took 109 ms a token for 128 samples of Qwen's 151,936-token vocabulary)."""

    def __init__(self, seeds: list[int], temperature: float, top_p: float):
        self.seeds, self.generators = seeds, None  # made at the first call, on the logits' device
        self.temperature, self.top_p = temperature, top_p

    def __call__(self, input_ids, scores):
        logps = torch.log_softmax(scores.float() / self.temperature, dim=-1)
        if self.top_p < 1.0:  # keep the smallest set of tokens whose probability reaches top_p
            sorted_logps, order = logps.sort(dim=-1, descending=True)
            before = sorted_logps.exp().cumsum(dim=-1) - sorted_logps.exp()  # the mass of the tokens ranked above
            dropped = torch.zeros_like(logps, dtype=torch.bool).scatter(-1, order, before >= self.top_p)
            logps = logps.masked_fill(dropped, -math.inf)
        if self.generators is None:
            try:
                self.generators = [torch.Generator(logps.device).manual_seed(seed) for seed in self.seeds]
            except RuntimeError:  # no generator on this device type
                self.generators = [torch.Generator().manual_seed(seed) for seed in self.seeds]
        uniform = torch.empty(logps.shape, device=self.generators[0].device)
        for row, generator in zip(uniform, self.generators):
            row.uniform_(generator=generator)  # as torch.rand(vocabulary, generator=generator), in place
        uniform = uniform.to(logps.device)  # no copy where they were made
        return logps - torch.log(-torch.log(uniform.clamp(min=1e-20, max=1 - 1e-7)))


class EndedStaysEnded:
    """A logits processor for the samples whose first token, drawn before `generate`, was a stop token: it
    draws that token again, so `generate` counts them finished after its first step (it does not read its
    input's last token) instead of decoding them to the maximum length."""

    def __init__(self, ended: torch.Tensor, stop: int):
        self.ended, self.stop = ended, stop

    def __call__(self, input_ids, scores):
        forced = torch.full_like(scores[:1], -math.inf)
        forced[:, self.stop] = 0.0
        return torch.where(self.ended[:, None].to(scores.device), forced, scores)


def sample_completions(accelerator: Accelerator, model, batch: dict, tokenizer, args, step: int, decoding=None) -> dict:
    """`args.num_generations` completions for each prompt of `batch`, at most `args.max_completion_length`
    tokens, sampled by (seed, step, prompt, sample) (`SeededSampling`). Each prompt is computed once: its cache
    is copied to its samples, and its last position's logits give their first tokens (in `sampling_precision`:
    with LoRA on fp32 weights, fp32). With `decoding` (a `StaticDecoding`: --compile_generation) the samples'
    cache is its static one and `generate` compiles its one-token step. Returns the rollout rows: prompt and
    completion ids, the completion mask (up to and with the stop token), whether each was cut at the maximum, and
    the prompt's index and sample weight, each repeated per sample. All ranks call this (with sharded weights
    generation steps them together)."""
    from transformers import GenerationConfig

    generator = accelerator.unwrap_model(model, keep_torch_compile=False)  # by regions: generated eagerly (below)
    root_ready_for_generation(generator)  # under FSDP2, an all-gather
    group = args.num_generations
    stops = stop_token_ids(tokenizer, generator.generation_config)
    config = GenerationConfig(
        max_new_tokens=max(args.max_completion_length - 1, 1),  # after the first token, drawn before `generate`
        do_sample=False,  # the sampling is SeededSampling's
        eos_token_id=stops,
        pad_token_id=tokenizer.pad_token_id,
        use_cache=True,
    )
    prompts, mask = batch["input_ids"], batch["attention_mask"]
    seeds = [sample_seed(args.seed, step, int(i), k) for i in batch["index"].tolist() for k in range(group)]
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    sampling = SeededSampling(seeds, args.temperature, args.top_p)
    was_training = generator.training
    generator.eval()
    try:  # one precision context for the whole call: autocast casts trainable weights once in it (its cache)
        # The layers --torch_compile compiled run uncompiled here; --compile_generation's step compiles its own.
        plain = generation_context(generator)
        # LoRA merged while sampling (fewer launches), but not into --compile_generation's graphs: their weights stay.
        merged = merged_for_generation(accelerator, generator) if decoding is None else contextlib.nullcontext()
        with torch.no_grad(), merged, sampling_precision(accelerator, generator), plain, weights_read_whole(generator):
            cache = empty_cache(generator)
            filled = generator(  # the prompts once: their cache and their last token's logits
                input_ids=prompts,
                attention_mask=mask,
                position_ids=positions,
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=1,
            )
            cache, logits = cache_of(filled, cache), filled.logits[:, -1]
            forget_rope_deltas(generator)  # Qwen-VL's, from the last `generate`
            if decoding is not None:  # each prompt's rows repeated into the static cache that the compiled step reads
                cache = decoding.filled_from(cache, group)
                config.compile_config = decoding.compile_config
            elif counts_its_tokens(cache, prompts.shape[1]):
                repeat_rows(generator, cache, len(prompts), group)
            else:  # `generate` reads the prompts again
                cache = None
            # Each sample's first token drawn here, from its prompt's logits, so that `generate` starts after it: one
            # forward pass fewer than letting it compute the prompt's last token again (on a GPU launches cost).
            first = sampling(None, logits.repeat_interleave(group, dim=0)).argmax(dim=-1, keepdim=True)
            first = first.to(prompts.device)
            output = torch.cat([prompts.repeat_interleave(group, dim=0), first], dim=1)
            ended = torch.isin(first[:, 0], torch.tensor(stops, device=first.device))
            processors = [sampling, *([EndedStaysEnded(ended, stops[0])] if bool(ended.any()) else [])]
            if args.max_completion_length > 1:  # the same on every rank: with sharded weights they generate together
                with only_this_config(generator):
                    output = generator.generate(
                        input_ids=output,
                        attention_mask=torch.cat([mask.repeat_interleave(group, dim=0), torch.ones_like(first)], 1),
                        past_key_values=cache,
                        generation_config=config,
                        logits_processor=processors,
                        synced_gpus=accelerator.num_processes > 1 and is_sharded(accelerator),
                    )
                if decoding is not None:
                    decoding.warn_once()  # where the decoding step did not compile into one graph
    finally:
        generator.train(was_training)
    completions = output[:, prompts.shape[1] :]
    is_stop = torch.isin(completions, torch.tensor(stops, device=completions.device))
    ended = is_stop.any(dim=1)
    first_stop = torch.where(ended, is_stop.int().argmax(dim=1), completions.shape[1] - 1)
    places = torch.arange(completions.shape[1], device=completions.device)
    completion_mask = (places[None] <= first_stop[:, None]).long()
    return {
        "prompt_ids": prompts.repeat_interleave(group, dim=0),
        "prompt_mask": mask.repeat_interleave(group, dim=0),
        "completion_ids": completions.masked_fill(completion_mask == 0, tokenizer.pad_token_id),
        "completion_mask": completion_mask,
        "truncated": ~ended,
        "index": batch["index"].repeat_interleave(group),
        SAMPLE_WEIGHT: batch[SAMPLE_WEIGHT].repeat_interleave(group),
    }


def score_completions(accelerator: Accelerator, rewards: dict, completions: list[str], records: list[dict]):
    """All ranks call this (one gather): each reward function of `rewards` ({function: weight}) on this rank's
    completions and their records. Returns (per function rewards (completions, functions), their weighted sum).
    A function that raises, returns NaN or returns the wrong number of values ends the run on every rank, in
    one line that names the function (and the completion and its record where one value is wrong: the record by
    its row in the training file where a held-out share numbered it, `raw_data.RECORD_COLUMN`, which the functions
    do not see)."""
    numbers = [record.get(RECORD_COLUMN) for record in records]
    records = [{key: value for key, value in record.items() if key != RECORD_COLUMN} for record in records]
    values, problem = np.zeros((len(completions), len(rewards))), None
    for j, function in enumerate(rewards):
        name = getattr(function, "__name__", repr(function))
        try:
            found = list(function(completions, records))
        except Exception as exc:  # the user's code: any error, reported with its place
            found, problem = None, f"reward function {name} raised {type(exc).__name__}: {exc}"
        if found is not None and len(found) != len(completions):
            problem = f"reward function {name} returned {len(found)} values for {len(completions)} completions"
        elif found is not None:
            try:
                values[:, j] = np.asarray(found, dtype=np.float64)
            except (TypeError, ValueError):
                problem = f"reward function {name} returned values that are not numbers ({found[:3]}...)"
            bad = np.flatnonzero(~np.isfinite(values[:, j]))
            if problem is None and len(bad):
                i = int(bad[0])
                problem = f"reward function {name} returned {values[i, j]} for the completion {completions[i]!r}"
                problem += f" of {record_name('train', numbers[i])}" if numbers[i] is not None else ""
        if problem:
            problem += "; fix it in the DATA section, it must return one finite number per completion"
            break
    fail_together(accelerator, problem)
    weights = np.asarray(list(rewards.values()), dtype=np.float64)
    return values, values @ weights


def group_advantages(rewards: torch.Tensor, group: int, scale: bool) -> torch.Tensor:
    """Each completion's reward less its group's mean (the group: its prompt's samples, together), divided by
    the group's standard deviation (+1e-4) when `scale` (GRPO), not (Dr. GRPO). No communication."""
    grouped = rewards.view(-1, group)
    advantages = grouped - grouped.mean(dim=1, keepdim=True)
    if scale:
        advantages = advantages / (grouped.std(dim=1, keepdim=True) + 1e-4)
    return advantages.reshape(-1)


def grpo_losses(logps, old_logps, ref_logps, rollout: dict, args) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(the loss of each row, its weight in the step's mean, sums for the log) of one micro-batch of rollouts:
    the clipped ratio to the old policy times the advantage, less `beta` times the KL to the reference (k3),
    averaged over each completion's tokens (--loss_type sequence) or kept per token (token: the weight is then
    the row's tokens, and `global_mean_loss` divides by the step's). No communication."""
    mask = rollout["completion_mask"].float()
    advantages = rollout["advantages"][:, None]
    ratio = torch.exp(logps - old_logps)
    clipped = torch.clamp(ratio, 1 - args.epsilon, 1 + args.epsilon_high)
    token_loss = -torch.minimum(ratio * advantages, clipped * advantages)
    kl = torch.zeros_like(logps)
    if ref_logps is not None:
        kl = torch.exp(ref_logps - logps) - (ref_logps - logps) - 1
        token_loss = token_loss + args.beta * kl
    losses = (token_loss * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)  # each completion's mean
    weights = rollout[LOSS_WEIGHT]  # its tokens (the step's mean over tokens), or 1 (over completions)
    sample_weight = rollout[SAMPLE_WEIGHT]
    was_clipped = ((ratio * advantages) > (clipped * advantages)).float() * mask
    real = mask * sample_weight[:, None]
    sums = {"clipped": ((was_clipped * real).sum(), real.sum()), "kl": ((kl * real).sum(), real.sum())}
    return losses, weights, sums


def reference_logps(accelerator: Accelerator, model, rollout: dict, layout: str, temperature: float) -> torch.Tensor:
    """The completion tokens' log-probs under the reference: the same model with its LoRA adapters off (never
    a second model). No communication beyond the model's own forward pass."""
    with torch.no_grad(), accelerator.unwrap_model(model).disable_adapter():
        return completion_logps(model, rollout, layout, temperature)


def finish_rollouts(
    rollouts: list[dict], advantages: torch.Tensor, args, layout: str, pad_token_id: int, multiple: int | None = None
) -> None:
    """Add to each rollout micro-batch its advantages, its rows' weights in the step's loss (LOSS_WEIGHT), their
    tokens (for the throughput), and in the one-row layout its rows [prompt, completion 1, ..., completion G]
    (`group_scoring`), their length padded to a multiple of `multiple` if given. No communication."""
    start = 0
    for rollout in rollouts:
        rows, tokens = len(rollout["index"]), rollout["completion_mask"].sum(dim=1).float()
        rollout["advantages"] = advantages[start : start + rows].to(tokens.device)
        weight = rollout[SAMPLE_WEIGHT].to(tokens.device)
        rollout[LOSS_WEIGHT] = tokens * weight if args.loss_type == "token" else weight
        prompt_tokens = rollout["prompt_mask"].sum(dim=1).float()
        # The tokens the model reads: in one row per prompt, each completion carries a G-th of its prompt.
        rollout[INPUT_TOKENS] = tokens + (prompt_tokens / args.num_generations if layout == ONE_ROW else prompt_tokens)
        if layout == ONE_ROW:
            rollout["rows"] = one_row_per_prompt(rollout, args.num_generations, pad_token_id, multiple)
        start += rows


def check_grpo_args(args) -> None:
    """The GRPO options, each checked with the fix in one line. Every rank calls it while parsing."""
    if args.num_generations < 2:
        raise UsageError(
            f"--num_generations must be at least 2 (a group's samples are compared), got {args.num_generations}"
        )
    if args.max_completion_length < 1:
        raise UsageError(f"--max_completion_length must be at least 1, got {args.max_completion_length}")
    if not args.temperature > 0 or not 0 < args.top_p <= 1:
        raise UsageError(f"--temperature must be > 0 and --top_p in (0, 1], got {args.temperature} and {args.top_p}")
    if args.num_iterations < 1:
        raise UsageError(f"--num_iterations must be at least 1, got {args.num_iterations}")
    if args.beta < 0:
        raise UsageError(f"--beta must be 0 or more, got {args.beta}")
    if getattr(args, "oom_backoff", False):
        raise UsageError("--oom_backoff does not split GRPO's steps yet; lower --per_device_train_batch_size instead")
    if args.beta > 0 and not args.lora_r:
        raise UsageError(
            "--beta > 0 needs a reference model: with LoRA (--lora_r) it is the model with its adapters off; "
            "without, a second copy of the model would double its memory, which this script does not do"
        )
    # Evaluation scores the greedy answers alone: accuracy by default, settled with the data (`settle_grpo_metric`).
    args.metric_for_best_model_by_default = args.metric_for_best_model is None
    scores = GENERATION_SCORES if args.eval_max_new_tokens else ()
    check_metric_for_best_model(args, scores, default="eval_accuracy" if scores else None)


def settle_grpo_metric(args, references: list | None) -> None:
    """--metric_for_best_model once the held-out prompts are read (`references`: their "answer" column, None without
    one): accuracy needs answers that are labels (`generation.settle_accuracy_metric`); by default, answers that are
    not labels rank nothing (a worked solution's exact match can stay 0, and the first checkpoint would win every
    tie); with no answers to score nothing is ranked, and a metric asked for is refused. Every rank calls it with the
    same data; no communication."""
    by_default = args.metric_for_best_model_by_default
    if references is not None and not (by_default and not are_labels(references)):
        return settle_accuracy_metric(args, references)
    if args.metric_for_best_model and not by_default:
        raise UsageError(
            f"--metric_for_best_model {args.metric_for_best_model.removeprefix('eval_')} scores the greedy answers to "
            "the held-out prompts against their 'answer' column, which these prompts lack: add one, or leave it out"
        )
    if references is not None and args.metric_for_best_model:
        logger.info(
            "checkpoints are not ranked: the held-out answers are not labels, and an exact match of whole answers can "
            "stay 0; --metric_for_best_model exact_match ranks by it"
        )
    args.metric_for_best_model = None  # the last checkpoints are kept, none ranked
