"""What the two causal-LM scripts (train_sft.py, train_clm.py) share: the model's source (a GGUF file
dequantized once), its tokenizer with the tokens training needs, the model with gradient
checkpointing and LoRA, the collator that pads token rows (blocks of text and packed examples
come from `token_blocks`) and counts target tokens, the loss at target tokens only, and
perplexity over all ranks.

Labels follow the `transformers` convention: `labels[i]` is the token at position i, predicted
from positions < i, and -100 marks a position that is not a target (prompt, padding, a filler
that evens out the shards, the first token of a packed sequence).
"""

from __future__ import annotations

import inspect
import math

import numpy as np
import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.logging import get_logger

from ..core.errors import UsageError
from ..core.ranks import refuse_together
from ..data.dataloaders import SAMPLE_WEIGHT
from ..data.evaluation import gather_for_eval
from ..training.activation_checkpointing import checkpoint_if_asked
from ..training.exact_loss import INPUT_TOKENS
from ..training.fsdp import load_pretrained
from ..training.pretrained import build_from_config, causal_lm_class, fetch_weights, load_model_config
from .multimodal import freeze_parts_text_never_runs, text_config
from .quantized import four_bit_loading, keep_4bit_backward_on_cpu

logger = get_logger(__name__)

IGNORE_INDEX = -100
TARGET_TOKENS = "target_tokens"  # per row: how many positions the loss counts (the step weight of a language model)


class CausalLMCollator:
    """Pad rows of `input_ids` / `labels` (and `position_ids` when packed) to the longest in the batch.

    - Padding gets label -100 and is masked out of attention (attention_mask 0, or for packed rows
      position_ids that start a separate sequence), so a pad token equal to EOS is harmless: the
      EOS that ends a response is still learned, only padding positions are ignored.
    - A filler row (sample_weight 0.0, added by `make_train_dataloader`) gets all labels -100.
    - `target_tokens` counts each row's targets, the weight `count_step` sums per step;
      packed rows (no attention_mask) also carry `input_tokens`, their length before padding.
    """

    def __init__(self, pad_token_id: int, pad_to_multiple_of: int | None = None):
        self.pad_token_id = pad_token_id
        self.pad_to_multiple_of = pad_to_multiple_of

    def __call__(self, rows: list[dict]) -> dict:
        length = max(len(row["input_ids"]) for row in rows)
        if self.pad_to_multiple_of:
            length = -(-length // self.pad_to_multiple_of) * self.pad_to_multiple_of
        packed = "position_ids" in rows[0]
        input_ids = torch.full((len(rows), length), self.pad_token_id, dtype=torch.long)
        labels = torch.full((len(rows), length), IGNORE_INDEX, dtype=torch.long)
        mask_or_positions = torch.zeros((len(rows), length), dtype=torch.long)
        for i, row in enumerate(rows):
            n = len(row["input_ids"])
            input_ids[i, :n] = torch.tensor(row["input_ids"])
            if row.get(SAMPLE_WEIGHT, 1.0) > 0:
                labels[i, :n] = torch.tensor(row["labels"])
            if packed:
                mask_or_positions[i, :n] = torch.tensor(row["position_ids"])
                mask_or_positions[i, n:] = torch.arange(length - n)  # padding: a sequence of its own
            else:
                mask_or_positions[i, :n] = 1
        batch = {
            "input_ids": input_ids,
            "labels": labels,
            "position_ids" if packed else "attention_mask": mask_or_positions,
        }
        batch[TARGET_TOKENS] = (labels[:, 1:] != IGNORE_INDEX).sum(dim=1)
        if packed:
            batch[INPUT_TOKENS] = torch.tensor([len(row["input_ids"]) for row in rows])
        return batch


def perplexity(loss_sums: np.ndarray, token_counts: np.ndarray) -> tuple[float, float]:
    """(token-weighted mean loss, perplexity) from per-example loss sums and target-token counts
    gathered from all ranks: exp(total loss / total tokens), not a mean of per-batch means."""
    mean_loss = float(np.sum(loss_sums, dtype=np.float64) / max(int(np.sum(token_counts)), 1))
    return mean_loss, math.exp(min(mean_loss, 700.0))


@torch.no_grad()
def packing_is_masked(model) -> bool | None:
    """Does `model` keep packed sequences apart? Compares a second sequence's logits packed
    behind a first one with its logits alone. Models that build their attention mask with
    `transformers`' `create_causal_mask` do; others would let packed examples attend to each
    other silently. No communication: a forward pass of 8 tokens on this rank's weights.

    None when this rank cannot tell because it holds no whole weights: meta tensors (under FSDP's
    CPU-RAM-efficient loading the main process has them) or DeepSpeed ZeRO-3 partitions (a forward
    pass outside the engine would fail on them). Share the answers with `refuse_together`.
    """
    if any(p.is_meta or hasattr(p, "ds_id") for p in model.parameters()):
        return None
    was_training = model.training
    model.eval()
    first, second = torch.arange(3, 7), torch.arange(7, 11)
    device = next(model.parameters()).device
    packed = model(
        input_ids=torch.cat([first, second])[None].to(device),
        use_cache=False,
        position_ids=torch.cat([torch.arange(4), torch.arange(4)])[None].to(device),
    ).logits[0, 4:]
    alone = model(input_ids=second[None].to(device), use_cache=False).logits[0]
    model.train(was_training)
    return torch.allclose(packed.float(), alone.float(), rtol=1e-3, atol=1e-3)


def load_config_and_tokenizer(args):
    """(the model's config, its tokenizer, the block size) for --model_name_or_path, a GGUF file
    in it dequantized first (`gguf.dequantized_gguf`; args.model_name_or_path then names the
    copy). The block size is --block_size, else the model's context up to 1024, and never above
    the context. Call it inside `load_on_main_first`: the main process converts and downloads,
    the others read the caches. No communication."""
    args.source_model = args.model_name_or_path  # before a GGUF file's copy replaces it: for the model card
    if args.gguf_file:
        from .gguf import dequantized_gguf

        args.model_name_or_path = dequantized_gguf(args.model_name_or_path, args.gguf_file, args.gguf_cache_dir)
    config = load_model_config(args.model_name_or_path, args.trust_remote_code)
    tokenizer = load_tokenizer(args.model_name_or_path, args.trust_remote_code)
    tokenizer.chat_template_kwargs = getattr(
        args, "chat_template_kwargs", None
    )  # every render of the run (chat.render)
    context = model_context(config, tokenizer)
    rows = getattr(text_config(config), "vocab_size", None)  # the embeddings' rows; checked before any weight is read
    past = [(kind, getattr(tokenizer, f"{kind}_token_id")) for kind in ("pad", "bos", "eos")]
    past = [(kind, token_id) for kind, token_id in past if rows and token_id is not None and token_id >= rows]
    if past:  # an IndexError at the first step, on a GPU a device-side assert
        kind, token_id = past[0]
        raise UsageError(
            f"the tokenizer gives its {kind} token the id {token_id}, past the model's {rows} embeddings: resize "
            "them to the tokenizer (model.resize_token_embeddings(len(tokenizer))) and save the model with it"
        )
    block_size = args.block_size or min(context, 1024)
    if block_size > context:
        raise UsageError(f"--block_size {block_size} is above this model's context of {context} tokens; lower it")
    fetch_weights(args.model_name_or_path)  # one download, after the checks; the ranks then build the model from it
    return config, tokenizer, block_size


def model_context(config, tokenizer) -> int:
    """The longest sequence the model takes: its positions, else what its tokenizer says."""
    return getattr(text_config(config), "max_position_embeddings", None) or tokenizer.model_max_length


def load_tokenizer(model_name_or_path: str, trust_remote_code: bool = False):
    """The tokenizer, with an end-of-sequence and a pad token (set, and said so, when missing)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_name_or_path, trust_remote_code=trust_remote_code)
    if tokenizer.eos_token is None:
        if tokenizer.sep_token is None:
            raise UsageError(
                f"the tokenizer of {model_name_or_path!r} has no end-of-sequence token; "
                "add one (tokenizer.eos_token = ...) and save it with the model"
            )
        logger.warning(f"the tokenizer has no EOS token: using its separator {tokenizer.sep_token!r} to end sequences")
        tokenizer.eos_token = tokenizer.sep_token
    if tokenizer.pad_token is None:
        # Safe here: padding is masked out by position (CausalLMCollator), never by token id,
        # so the EOS that ends each sequence is still learned.
        logger.warning(
            f"the tokenizer has no pad token: padding with EOS {tokenizer.eos_token!r} "
            "(padding is masked out of the loss)"
        )
        tokenizer.pad_token = tokenizer.eos_token
        tokenizer.borrowed_pad_token = True  # saved without it (output.write_pretrained): pad = eos is ours alone
    return tokenizer


def load_causal_lm(args, config, tokenizer):
    """All ranks call this, at the same time: under DeepSpeed ZeRO-3 building a model is a collective, and
    under FSDP only the main process reads the weights (`load_pretrained`). The model, with gradient
    checkpointing and LoRA (`lora.add_lora`) if asked; what text never runs in a model that also reads images is
    frozen (`multimodal`)."""
    model_class = causal_lm_class(config)
    quantized = getattr(args, "load_in_4bit", False)
    kept = layers_read_directly(model_class, config, args.trust_remote_code) if quantized else None
    model = load_pretrained(  # under FSDP, only rank 0 reads the weights; QLoRA: 4-bit on this rank's device
        model_class,
        args.model_name_or_path,
        config=config,
        trust_remote_code=args.trust_remote_code,
        **four_bit_loading(args, kept),
    )
    freeze_parts_text_never_runs(model)
    if quantized:
        keep_4bit_backward_on_cpu(model)
    model.config.pad_token_id = tokenizer.pad_token_id
    if "logits_to_keep" not in inspect.signature(model.forward).parameters:
        raise UsageError(
            f"{type(model).__name__} takes no logits_to_keep, which the loss needs to run the LM head only "
            "where a token is learned; use a transformers causal LM that does (Llama, Qwen, Mistral, Gemma, "
            "GPT-2, ...)"
        )
    checkpoint_if_asked(model, args)  # --gradient_checkpointing
    if args.lora_r:
        from .lora import add_lora

        model = add_lora(model, args)
    return model


def layers_read_directly(model_class, config, trust_remote_code: bool = False) -> list[str] | None:
    """For QLoRA: the layers to leave unquantized, where the model's code reads a linear layer's weight instead of
    calling it (Mamba's fused kernels read dt_proj's, Jamba's too) or a linear layer returns several values (Llama 4's
    router): 4-bit, the code would read packed bytes. With the output layer, as transformers leaves it; None where
    there are none (transformers' own choice then). Built on the meta device, no weight read. No communication."""
    from accelerate import init_empty_weights
    from transformers.quantizers.base import get_keys_to_not_convert

    from .lora import linears_returning_several, linears_used_by_weight

    with init_empty_weights(include_buffers=False):
        skeleton = build_from_config(model_class, config, {"trust_remote_code": trust_remote_code})
    read = sorted({*linears_used_by_weight(skeleton), *linears_returning_several(skeleton)})
    if not read:
        return None
    logger.info(f"QLoRA: {len(read)} linear layers stay unquantized, their weights read directly: {read[:3]}")
    return sorted({*get_keys_to_not_convert(skeleton), *read})


def causal_lm_loss(model, batch):
    """Per-token losses and weights, shape (batch, length): weight 1.0 where a token is a target
    (response or text; not prompt, padding or a filler row). Pops the labels and counts from `batch`."""
    batch.pop(TARGET_TOKENS, None), batch.pop(INPUT_TOKENS, None)
    labels = batch.pop("labels")
    targets = F.pad(labels, (0, 1), value=IGNORE_INDEX)[:, 1:]  # position i predicts token i + 1
    predicts = targets != IGNORE_INDEX
    # logits_to_keep: the LM head (a fifth of a small LLM's work) runs only where a target is
    # predicted, not on prompt or padding. use_cache=False: with a cache object, transformers
    # ignores packed position_ids and lets packed examples attend to each other (5.23).
    logits = model(**batch, use_cache=False, logits_to_keep=predicts).logits  # (targets in the batch, vocab)
    losses = torch.zeros(targets.shape, dtype=torch.float32, device=targets.device)
    losses[predicts] = F.cross_entropy(logits.float(), targets[predicts], reduction="none")
    return losses, predicts.float()


# What `evaluate_perplexity` gives that --metric_for_best_model can rank by (the others are counts).
PERPLEXITY_SCORES = ("eval_loss", "eval_perplexity")


def evaluate_perplexity(accelerator: Accelerator, model, eval_dataloader) -> dict:
    """All ranks call this (it gathers every rank's sums): perplexity over the whole eval set,
    from the loss sums and token counts of all ranks, added up."""

    def sums(model, batch):
        losses, weights = causal_lm_loss(model, batch)
        return {"loss_sum": (losses * weights).sum(dim=1), "tokens": weights.sum(dim=1)}

    results = gather_for_eval(accelerator, model, eval_dataloader, sums)
    mean_loss, ppl = perplexity(results["loss_sum"], results["tokens"])
    return {
        "eval_loss": mean_loss,
        "eval_perplexity": ppl,
        "eval_tokens": int(results["tokens"].sum()),
        "eval_sequences": len(results["tokens"]),
    }


def check_packing(accelerator: Accelerator, model) -> None:
    """All ranks call this (the ranks that hold the weights check; one gather shares the verdict):
    --packing refused, on every rank, for a model that lets packed examples attend to each other."""
    masked = packing_is_masked(model)
    if masked is None:
        logger.warning(
            "--packing: this rank holds no whole weights (DeepSpeed ZeRO-3), so the check that packed "
            "examples stay apart was skipped; models built on transformers' create_causal_mask (Llama, "
            "Qwen2, Mistral, ...) pass it"
        )
    refuse_together(
        accelerator,
        None
        if masked is not False
        else (
            f"{type(model).__name__} does not keep packed examples apart (its attention ignores the restarting "
            "position_ids); drop --packing"
        ),
    )
