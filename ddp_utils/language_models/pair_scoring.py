"""How a preference pair is scored: both answers' log-probabilities in one forward pass (`pair_logps`),
from a batch of `pair_batches.PairCollator` in one of two layouts, and which layout a model can
take (`choose_pair_layout`):

- **one row** per pair, [prompt, chosen, rejected]: the prompt is computed once. The rejected answer
  does not attend to the chosen one (a 4D mask) and its positions restart after the prompt, so an
  attention layer sees each answer as if alone. Sliding-window layers get the same mask cut to
  their window, by position (transformers 5 takes one mask per layer type).
- **two rows** per pair, [prompt, chosen] and [prompt, rejected] (TRL's layout): the prompt twice, but
  exact for any model. Taken where one row is not exact: recurrent and state-space layers (Mamba
  hybrids, RecurrentGemma, LFM2) carry the chosen answer's state into the rejected one, and ALiBi
  (MPT) biases by the place in the row, not the position; an attention that takes no custom mask
  (flash, flex); a window of another kind than sliding (chunked).

The config decides where it names such layers; else a probe, as `causal_lm.packing_is_masked` does for
packing: a small pair scored both ways.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from accelerate import Accelerator
from accelerate.logging import get_logger

from ..core.ranks import from_main_process
from .causal_lm import IGNORE_INDEX
from .multimodal import text_config

logger = get_logger(__name__)

ONE_ROW, TWO_ROWS = "one row", "two rows"


class PairLogps(NamedTuple):
    """Per pair: the summed log-probabilities of its chosen and rejected answer, and their tokens."""

    chosen: torch.Tensor
    rejected: torch.Tensor
    chosen_tokens: torch.Tensor
    rejected_tokens: torch.Tensor


def pair_logps(model, batch: dict) -> PairLogps:
    """The answers' log-probs of a `PairCollator` batch: one forward pass over its rows, the LM head
    run only at the positions that predict an answer token. Leaves `batch` as it was. No
    communication (the model's forward pass may gather FSDP shards, on every rank alike)."""
    chosen, rejected = batch["chosen_targets"], batch["rejected_targets"]
    keep = (chosen != IGNORE_INDEX) | (rejected != IGNORE_INDEX)
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    if inputs["attention_mask"].dim() == 4:  # one row per pair: its own mask (B, 1, L, L) and positions
        inputs["position_ids"] = batch["position_ids"]
        inputs["attention_mask"] = masks_for(model, batch["attention_mask"], batch["position_ids"])
    logits = model(**inputs, use_cache=False, logits_to_keep=keep).logits.float()  # (positions kept, vocab)
    normaliser = logits.logsumexp(dim=-1)
    rows = keep.nonzero()[:, 0]

    def side(targets):  # per row: the summed log-probs of this side's tokens, and their count
        wanted = targets[keep]
        real = wanted != IGNORE_INDEX
        token_logps = (torch.take_along_dim(logits, wanted.clamp(min=0)[:, None], dim=1)[:, 0] - normaliser) * real
        zeros = torch.zeros(len(targets), device=logits.device)
        sums, counts = zeros.index_add(0, rows, token_logps), zeros.index_add(0, rows, real.float())
        if len(targets) == 2 * len(batch["index"]):  # two rows per pair: each side's tokens are in one of them
            return sums.view(2, -1).sum(0), counts.view(2, -1).sum(0)
        return sums, counts

    (chosen_logps, chosen_tokens), (rejected_logps, rejected_tokens) = side(chosen), side(rejected)
    return PairLogps(chosen_logps, rejected_logps, chosen_tokens, rejected_tokens)


def attention_of(model) -> str:
    inner = getattr(model, "module", model)  # under DDP or DeepSpeed
    return getattr(getattr(inner, "config", None), "_attn_implementation", None) or "sdpa"


def _text_config(model):
    return text_config(getattr(model, "module", model).config)  # under DDP or DeepSpeed


def masks_for(model, mask: torch.Tensor, positions: torch.Tensor):
    """The one-row mask as `model` takes it: additive for eager attention, and for a model with
    sliding-window layers a mask per layer type, the sliding one cut to the window by position (a
    key at most `window - 1` positions before the query), as transformers builds it for a sequence
    alone. No communication."""
    text = _text_config(model)
    types = set(getattr(text, "layer_types", None) or [])
    masks = {"full_attention": mask}
    if "sliding_attention" in types:
        reach = positions[:, :, None] - positions[:, None, :]  # query position - key position
        masks["sliding_attention"] = mask & (reach < text.sliding_window)[:, None]
    if attention_of(model) == "eager":  # eager attention adds the mask to its scores
        masks = {
            kind: torch.zeros(m.shape, device=m.device).masked_fill(~m, torch.finfo(torch.float32).min)
            for kind, m in masks.items()
        }
    return masks if len(masks) > 1 else masks["full_attention"]


ATTENTION_KINDS = {"full_attention", "sliding_attention", "chunked_attention", "attention", "global", "local"}


def _one_row_problem(model, block_size: int) -> str | None:
    """Why one row per pair cannot be exact for `model` from its configuration alone, or None: an
    attention that takes no custom mask; layers that are not attention (a state-space or recurrent
    kind named in the config); ALiBi; a window of another kind than sliding."""
    attention = attention_of(model)
    if attention not in ("sdpa", "eager"):
        return f"its attention ({attention!r}) takes no custom attention mask"
    text = _text_config(model)
    kinds = set()
    for name in ("layer_types", "block_types", "layers_block_type"):
        value = getattr(text, name, None)
        kinds.update(value if isinstance(value, (list, tuple)) else [])
    stateful = sorted(str(kind) for kind in kinds - ATTENTION_KINDS)
    if stateful:
        return f"it has layers that carry state along the row ({', '.join(stateful)})"
    attn_config = getattr(text, "attn_config", None)
    if getattr(text, "alibi", False) or getattr(attn_config, "alibi", False) or text.model_type in ("bloom", "mpt"):
        return "its ALiBi biases attention by the place in the row, not by position"
    window = getattr(text, "sliding_window", None) or getattr(text, "attention_chunk_size", None)
    types = set(getattr(text, "layer_types", None) or ([] if not window else ["windowed"]))
    if window and 2 * block_size > window and not types <= {"full_attention", "sliding_attention"}:
        return f"it attends within windows of {window} tokens of a kind other than sliding ({sorted(types)})"
    return None


def one_row_is_exact(model) -> bool | None:
    """Does one row per pair give each answer's log-prob as two rows do? A pair of 4, 6 and 5 tokens
    scored both ways, in evaluation mode, on this rank's weights. None when this rank holds no whole
    weights (meta tensors under FSDP's RAM-efficient loading; DeepSpeed ZeRO-3 partitions). A model
    that does not take the mask (an error) is not exact. No communication."""
    from .pair_batches import PairCollator

    if any(p.is_meta or hasattr(p, "ds_id") for p in model.parameters()):
        return None
    row = {"prompt_ids": [3, 4, 5, 6], "chosen_ids": [7, 8, 9, 10, 11, 12], "rejected_ids": [13, 14, 15, 16, 17]}
    row["index"] = 0
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        longer = {**row, "prompt_ids": row["prompt_ids"] + [18] * 5, "index": 1}  # its rows as long as the one row
        with torch.no_grad():
            scores = []
            for two_rows, rows in ((False, [row]), (True, [row]), (True, [row, longer])):
                batch = {k: v.to(device) for k, v in PairCollator(0, two_rows=two_rows)(rows).items()}
                scores.append(pair_logps(model, batch))
    except (RuntimeError, TypeError, ValueError):
        return False
    finally:
        model.train(was_training)
    one, two, padded = scores
    low_precision = next(model.parameters()).dtype != torch.float32
    # fp32's rounding depends on the matrix shapes on some CPUs (3.5e-4 on SmolLM2's sum of 6 log-probs of -137,
    # on an AMD EPYC): the same two rows padded to the one row's length measure it, and the tolerance allows twice
    # that. The leaks measured on hybrid models were 2e-5 and up per answer.
    noise = max((padded.chosen[:1] - two.chosen).abs().item(), (padded.rejected[:1] - two.rejected).abs().item())
    if not low_precision and noise > 1e-3:  # scores that move with the batch's padding: no layout is trusted as exact
        return False
    tolerance = (2e-2 if low_precision else 1e-5) + 2 * noise
    return bool(
        torch.allclose(one.chosen, two.chosen, atol=tolerance, rtol=0)
        and torch.allclose(one.rejected, two.rejected, atol=tolerance, rtol=0)
    )


def choose_pair_layout(accelerator: Accelerator, model, block_size: int) -> str:
    """All ranks call this (one broadcast), before `prepare`: ONE_ROW where it is exact for `model`,
    else TWO_ROWS, said once in the log with the reason. The main process decides, from the config and
    the probe (it holds the weights under FSDP's RAM-efficient loading), and every rank takes its
    answer; under ZeRO-3, where no rank holds them, one row stays, with a warning."""
    layout, reason = from_main_process(accelerator, _decide_pair_layout, model, block_size)
    if layout == ONE_ROW and reason:
        logger.warning(reason)
    elif layout == TWO_ROWS:
        model_type = getattr(_text_config(model), "model_type", type(model).__name__)
        logger.info(f"{model_type}: {reason}; each answer gets a row of its own, its prompt computed again for each")
    return layout


def _decide_pair_layout(model, block_size: int) -> tuple[str, str | None]:
    problem = _one_row_problem(model, block_size)
    if problem is not None:
        return TWO_ROWS, problem
    exact = one_row_is_exact(model)
    if exact is None:
        return ONE_ROW, (
            "no rank holds whole weights (DeepSpeed ZeRO-3), so the check that one row per pair scores each answer "
            "as if alone was skipped; attention-only models (Llama, Qwen, Mistral, Gemma, ...) pass it"
        )
    if exact:
        return ONE_ROW, None
    return TWO_ROWS, "the chosen answer reaches the rejected one in a shared row (the probe)"
