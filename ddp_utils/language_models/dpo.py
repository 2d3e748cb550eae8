"""Preference losses (DPO, IPO, SimPO) from the log-probabilities of each pair's two answers, the
frozen reference's log-probs without a second model in memory, and the preference evaluation.

Both answers of a pair are scored in one forward pass (`pair_scoring.pair_logps`), with logits only
where an answer token is predicted.
"""

from __future__ import annotations

import hashlib
import json
import os

import numpy as np
import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.logging import get_logger

from ..core.errors import UsageError
from ..data.dataloaders import make_eval_dataloader
from ..data.evaluation import gather_for_eval
from .pair_scoring import ONE_ROW, TWO_ROWS, PairLogps, attention_of, pair_logps

logger = get_logger(__name__)

LOSSES = ("sigmoid", "ipo", "simpo")  # DPO (Rafailov et al. 2023), IPO (Azar et al. 2023), SimPO (Meng et al. 2024)
# What `evaluate_preferences` gives that --metric_for_best_model can rank by.
PREFERENCE_SCORES = (
    "eval_loss",
    "eval_reward_accuracy",
    "eval_reward_margin",
    "eval_chosen_preferred",
    "eval_chosen_logps",
    "eval_rejected_logps",
)


def preference_losses(policy: PairLogps, reference, args) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, chosen reward, rejected reward) per pair, for --loss_type with --beta:

    - sigmoid (DPO): -log sigmoid(beta * ((pc - rc) - (pr - rr))), rewards beta * (p - r);
    - ipo: ((pc - rc) / nc - (pr - rr) / nr - 1 / (2 beta))^2, on log-probs per token;
    - simpo (no reference): -log sigmoid(beta * (pc / nc - pr / nr) - --simpo_gamma), rewards beta * p / n;

    where p, r are the policy's and the reference's summed log-probs of an answer (`reference`: a
    (chosen, rejected) pair of tensors, None for simpo) and n its tokens. --sft_weight adds that
    weight times the chosen answer's mean negative log-likelihood per token (RPO)."""
    chosen_tokens, rejected_tokens = policy.chosen_tokens.clamp(min=1), policy.rejected_tokens.clamp(min=1)
    if args.loss_type == "simpo":
        chosen_reward = args.beta * policy.chosen / chosen_tokens
        rejected_reward = args.beta * policy.rejected / rejected_tokens
        losses = -F.logsigmoid(chosen_reward - rejected_reward - args.simpo_gamma)
    elif args.loss_type == "ipo":
        chosen_ratio = (policy.chosen - reference[0]) / chosen_tokens
        rejected_ratio = (policy.rejected - reference[1]) / rejected_tokens
        losses = (chosen_ratio - rejected_ratio - 1 / (2 * args.beta)) ** 2
        chosen_reward, rejected_reward = args.beta * chosen_ratio, args.beta * rejected_ratio
    else:
        chosen_reward = args.beta * (policy.chosen - reference[0])
        rejected_reward = args.beta * (policy.rejected - reference[1])
        losses = -F.logsigmoid(chosen_reward - rejected_reward)
    if args.sft_weight:
        losses = losses - args.sft_weight * policy.chosen / chosen_tokens
    return losses, chosen_reward.detach(), rejected_reward.detach()


SIMPO_BETA = 2.0  # SimPO's paper: beta 2 to 2.5, with gamma / beta about 0.5 (DPO's 0.1 would aim at 5 nats a token)
SIMPO_GAMMA_PER_BETA = 0.5


def check_dpo_args(args) -> None:
    """Refuse DPO option values that cannot work, naming the option, and fill --beta and --simpo_gamma
    when not given: 0.1 for DPO and IPO; for SimPO its paper's beta 2.0 and gamma = 0.5 x beta. Every
    rank calls it while parsing."""
    if args.beta is None:
        args.beta = SIMPO_BETA if args.loss_type == "simpo" else 0.1
    if args.simpo_gamma is None:
        args.simpo_gamma = SIMPO_GAMMA_PER_BETA * args.beta
    if args.beta <= 0:
        raise UsageError(f"--beta must be positive, got {args.beta}")
    if args.sft_weight < 0:
        raise UsageError(f"--sft_weight must be 0 (none) or positive, got {args.sft_weight}")
    if args.precompute_reference and args.loss_type == "simpo":
        raise UsageError("--loss_type simpo has no reference model: drop --precompute_reference")


def disable_dropout(model) -> int:
    """Turn dropout off in `model` (TRL's `disable_dropout`, on by default there too): every
    `nn.Dropout` (LoRA's included) and the attention modules' own dropout rates. The loss compares the
    policy with its reference, and with the adapters off the reference is the same model in training
    mode: with dropout, each draws its own masks, so the first step's DPO loss is not log 2 and the
    reference is not frozen. Returns how many were turned off. No communication."""
    turned_off = 0
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout) and module.p > 0:
            module.p, turned_off = 0.0, turned_off + 1
        for name in ("attention_dropout", "attn_dropout", "dropout"):  # floats read in forward (Llama, Qwen, ...)
            rate = getattr(module, name, None)
            if isinstance(rate, float) and rate > 0:
                setattr(module, name, 0.0)
                turned_off += 1
    return turned_off


class Reference:
    """The frozen reference model's log-probs of a batch's answers, never from a second model in
    memory: with LoRA, the same model with its adapters turned off ("adapters off"); else (or with
    --precompute_reference) the log-probs computed once before training, looked up by each pair's
    index ("precomputed", `precompute_reference`); none for SimPO."""

    def __init__(self, kind: str | None, tables: dict[str, torch.Tensor] | None = None, adapters=None):
        self.kind, self.tables, self.adapters = kind, tables or {}, adapters  # adapters: the peft model

    @torch.no_grad()
    def __call__(self, model, batch: dict, split: str = "train"):
        """(chosen, rejected) summed log-probs of the reference, or None. `model` is the prepared
        model: with the adapters off, its own forward pass (DDP's, without gradients, syncs nothing;
        FSDP gathers its shards on every rank alike). No other communication."""
        if self.kind is None:
            return None
        if self.kind == "precomputed":
            table = self.tables[split][batch["index"].to(self.tables[split].device)]
            return table[:, 0], table[:, 1]
        with self.adapters.disable_adapter():  # peft: the frozen base weights, untouched by training
            logps = pair_logps(model, batch)
        return logps.chosen, logps.rejected


def make_reference(accelerator: Accelerator, args, model, tokenized, collate_fn, eval_dataloader, config) -> Reference:
    """All ranks call this (after `accelerator.prepare`, before a checkpoint is loaded into the
    model): the run's `Reference`. Precomputed log-probs are read from the cache when every rank
    finds them there (`reference_cache_key`), else computed by `precompute_reference` over the
    training pairs (in evaluation order) and `eval_dataloader`, and written to the cache by each
    node's main process."""
    if args.loss_type == "simpo":
        logger.info("reference: none (SimPO is reference-free)")
        return Reference(None)
    if args.lora_r and not args.precompute_reference:
        logger.info("reference: the model with its LoRA adapters turned off (no second copy in memory)")
        return Reference("adapters off", adapters=accelerator.unwrap_model(model, keep_torch_compile=False))
    layout = TWO_ROWS if getattr(collate_fn, "two_rows", False) else ONE_ROW  # the float sums differ a little
    key = reference_cache_key(args, config, tokenized, accelerator, model, layout)
    path = None
    if key:
        import datasets

        path = os.path.join(datasets.config.HF_DATASETS_CACHE, "reference_logps", f"{key}.npz")
    sizes = {"train": len(tokenized["train"]), "validation": len(tokenized["validation"])}
    tables = _read_tables(path, sizes)
    found = torch.tensor(float(tables is not None), device=accelerator.device)
    if accelerator.reduce(found, reduction="sum").item() == accelerator.num_processes:  # all ranks: every rank has it
        logger.info(f"reference: the log-probs precomputed by an earlier launch ({path})")
        return Reference("precomputed", {split: table.to(accelerator.device) for split, table in tables.items()})
    train_order = accelerator.prepare(make_eval_dataloader(tokenized["train"], args, collate_fn, "length"))
    tables = precompute_reference(accelerator, model, {"train": train_order, "validation": eval_dataloader})
    if path and accelerator.is_local_main_process:
        import tempfile

        os.makedirs(os.path.dirname(path), exist_ok=True)
        handle, partial = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".partial.npz")
        with os.fdopen(handle, "wb") as file:
            np.savez(file, **{split: table.cpu().numpy() for split, table in tables.items()})
        os.replace(partial, path)  # whole or absent: a launch killed while writing leaves no half file
    where = f"cached in {path}" if path else "not cached: the tokenized data has no fingerprint"
    logger.info(f"reference: the model's log-probs before training, computed once ({where})")
    return Reference("precomputed", tables)


def _read_tables(path: str | None, sizes: dict[str, int]) -> dict[str, torch.Tensor] | None:
    """The cached tables at `path`, if there and of the right shapes (one row per pair), else None."""
    if not path or not os.path.isfile(path):
        return None
    try:
        with np.load(path) as saved:
            tables = {split: torch.from_numpy(saved[split]) for split in sizes}
    except (OSError, ValueError, KeyError):
        return None
    return tables if all(tables[split].shape == (rows, 2) for split, rows in sizes.items()) else None


def precompute_reference(accelerator: Accelerator, model, dataloaders: dict) -> dict[str, torch.Tensor]:
    """All ranks call this (a gather per batch): {split: (pairs, 2) tensor of the model's chosen
    and rejected log-probs, row i for the pair of index i}, every pair computed exactly once over
    all ranks. The model must still hold its starting weights."""

    def logps(model, batch):
        result = pair_logps(model, batch)
        return {"index": batch["index"], "chosen": result.chosen, "rejected": result.rejected}

    tables = {}
    for split, dataloader in dataloaders.items():
        gathered = gather_for_eval(accelerator, model, dataloader, logps)
        order = _each_pair_once(gathered["index"], len(dataloader.dataset), "the reference pass")
        table = np.stack([gathered["chosen"][order], gathered["rejected"][order]], axis=1)
        tables[split] = torch.from_numpy(table.astype(np.float32)).to(accelerator.device)
    return tables


def reference_cache_key(args, config, tokenized, accelerator: Accelerator, model, layout: str = ONE_ROW) -> str | None:
    """The name the precomputed reference log-probs are cached under: a hash of the tokenized
    data (its `datasets` fingerprints: the records, the tokenizer, the block size), the model (its
    name, Hub revision, the size and time of each of its local weight files, its weights' dtype and
    its attention), and how it computes (the precision, the distributed type, the pair layout). None when a split
    has no fingerprint. No communication."""
    fingerprints = {split: getattr(data, "_fingerprint", None) for split, data in tokenized.items()}
    if not all(fingerprints.values()):
        return None
    files, source = [], args.model_name_or_path
    if os.path.isdir(source):
        source = os.path.abspath(source)
        for name in sorted(os.listdir(source)):
            if name.endswith((".safetensors", ".bin", ".pt", ".gguf")):
                stat = os.stat(os.path.join(source, name))
                files.append((name, stat.st_size, stat.st_mtime_ns))
    identity = {
        "data": fingerprints,
        "model": source,
        "revision": getattr(config, "_commit_hash", None),
        "files": files,
        "dtype": str(next(model.parameters()).dtype),
        "attention": attention_of(model),
        "precision": accelerator.mixed_precision,
        "distributed": accelerator.distributed_type.value,
        "layout": layout,
        "version": 2,  # raise it when what pair_logps computes from the same rows changes (2: the pair layout)
    }
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:32]


def _each_pair_once(index: np.ndarray, pairs: int, what: str) -> np.ndarray:
    order = np.argsort(index, kind="stable")
    if not np.array_equal(index[order], np.arange(pairs)):
        raise RuntimeError(f"{what} scored {len(index)} pairs, not each of {pairs} once")
    return order


def evaluate_preferences(accelerator: Accelerator, model, dataloader, reference: Reference, args) -> dict:
    """All ranks call this (a gather per batch): over every validation pair, once each, the mean
    loss, the reward accuracy (the chosen answer's reward above the rejected one's) and margin,
    how often the model gives the chosen answer the higher log-prob (`chosen_preferred`: before
    training, with LoRA's zero update, every reward is 0 and only this tells), and the mean
    log-probs of both sides."""

    def scores(model, batch):
        policy = pair_logps(model, batch)
        losses, chosen_reward, rejected_reward = preference_losses(policy, reference(model, batch, "validation"), args)
        return {
            "index": batch["index"],
            "loss": losses,
            "margin": chosen_reward - rejected_reward,
            "chosen": policy.chosen,
            "rejected": policy.rejected,
        }

    results = gather_for_eval(accelerator, model, dataloader, scores)
    _each_pair_once(results["index"], len(dataloader.dataset), "the evaluation")
    return {
        "eval_loss": float(results["loss"].mean()),
        "eval_reward_accuracy": float((results["margin"] > 0).mean()),
        "eval_reward_margin": float(results["margin"].mean()),
        "eval_chosen_preferred": float((results["chosen"] > results["rejected"]).mean()),
        "eval_chosen_logps": float(results["chosen"].mean()),
        "eval_rejected_logps": float(results["rejected"].mean()),
        "eval_pairs": len(results["index"]),
    }
