"""What a text classifier's tokenizer, config and data must agree on, whatever the family it comes from: the pad token
and the side it pads (a decoder LLM's head reads each example's last token that is not padding, and most LLMs have no
pad token, or one their config does not name), how many tokens an input may hold, and the EOS tokens BART's and T5's
heads read. Found by running scripts/train.py on 19 families (tests/test_families_classifiers.py). Nothing here
communicates."""

from __future__ import annotations

import numpy as np
from accelerate.logging import get_logger

from ..core.errors import UsageError

logger = get_logger(__name__)


def pad_for_classification(tokenizer, config, model_name_or_path: str) -> None:
    """Give `tokenizer` a pad token where it has none (the one its config names, else its EOS (not an encoder-decoder's:
    its head counts them), else its separator or unknown token) and make it pad on the right (on the left for XLNet,
    whose head reads the last position), both saved with the model so that its users pad as training did; and give
    `config` (its text part) that pad token's id, which a decoder's head reads to find each example's last real token.
    Before, Llama, Mistral and
    GPT-2 stopped at the first batch ("Asking to pad but the tokenizer does not have a padding token"), and Qwen and
    Pythia, whose tokenizers pad but whose configs name no pad token, too ("Cannot handle batch sizes > 1 if no
    padding token is defined"). Any rank may call it."""
    text = config.get_text_config()
    named = getattr(text, "pad_token_id", None)
    if tokenizer.pad_token is None and named is not None and 0 <= named < len(tokenizer):
        tokenizer.pad_token = tokenizer.convert_ids_to_tokens(named)  # the checkpoint's own pad token
        logger.info(f"the tokenizer has no pad token: padding with {tokenizer.pad_token!r}, its config's, saved so")
    if tokenizer.pad_token is None:
        # An encoder-decoder's head counts EOS tokens, padding included: padding with EOS would break it.
        eos = None if getattr(config, "is_encoder_decoder", False) else tokenizer.eos_token
        borrowed = eos or tokenizer.sep_token or tokenizer.unk_token
        if borrowed is None:
            raise UsageError(
                f"the tokenizer of {model_name_or_path!r} has no pad token, nor an EOS, separator or unknown token to "
                "pad with; add one (tokenizer.pad_token = ...) and save it with the model"
            )
        # Safe for a classifier: padding is masked by position, and the head reads the last token that is not
        # padding (an EOS the tokenizer ends each text with is skipped alike in training and in use).
        logger.warning(f"the tokenizer has no pad token: padding with {borrowed!r}, and saved so")
        tokenizer.pad_token = borrowed
    # Decoder heads read the last token that is not padding, encoders mask it, on either side; but a model with
    # absolute positions (GPT-2, BERT, BART, ...) reads a left-padded example at other positions than alone. XLNet's
    # head reads position -1 whatever the mask: it pads on the left.
    side = "left" if getattr(text, "summary_type", None) == "last" else "right"
    if tokenizer.padding_side != side:  # Llama 2's, Mistral's, Gemma's and Phi-3's tokenizers pad on the left
        logger.info(f"padding on the {side}, not on the {tokenizer.padding_side} as the tokenizer says; saved so")
        tokenizer.padding_side = side
    pad, vocabulary = tokenizer.pad_token_id, getattr(text, "vocab_size", None)
    if vocabulary and pad is not None and pad >= vocabulary:  # an IndexError in the embeddings at the first batch
        raise UsageError(
            f"the tokenizer's pad token {tokenizer.pad_token!r} has id {pad}, outside the model's vocabulary of "
            f"{vocabulary}; pad with a token the model has (tokenizer.pad_token = tokenizer.eos_token), or resize the "
            "model's embeddings (model.resize_token_embeddings(len(tokenizer))) and save both"
        )
    if named != pad:
        if named is not None:  # the tokenizer pads the batches: the head must skip what it pads with
            logger.warning(f"the config names pad token id {named}, the tokenizer pads with {pad}: set to {pad}")
        text.pad_token_id = pad


def classify_without_kv_cache(config) -> None:
    """A classifier reads each text in one pass: turn off the KV cache a decoder's config asks for (`use_cache`, in
    it and in its text part). With it on, every forward pass, in training and in evaluation, built a cache holding
    each layer's keys and values until the pass ended, at the activations' peak, which a grouped-query model keeps
    nowhere else; and --gradient_checkpointing had transformers turn it off with a warning. Saved so; any rank may
    call it."""
    for part in (config, config.get_text_config()):  # the same object where the model has one config
        if getattr(part, "use_cache", False):
            part.use_cache = False


def max_input_length(tokenizer, config, trust_remote_code: bool = False) -> int | None:
    """The most tokens the model takes: what its tokenizer says, else its position embeddings' count, else None
    (relative positions only, as T5's: no limit). Before, a T5 whose tokenizer gives no limit (T5 v1.1's, mT5's)
    failed with an AttributeError on max_position_embeddings."""
    if tokenizer.model_max_length < 100_000:  # a tokenizer without a limit says 10**30
        return tokenizer.model_max_length
    positions = getattr(config.get_text_config(), "max_position_embeddings", None)
    if not positions or positions <= 0:  # XLNet's config says -1
        return None
    return min(positions, _positions_past_padding(config, trust_remote_code) or positions)


def _positions_past_padding(config, trust_remote_code: bool) -> int | None:
    """RoBERTa's family (XLM-R, CamemBERT, MPNet, Longformer, ESM) numbers positions from its pad token's id + 1:
    of RoBERTa's 514 position embeddings, 512 are a text's. Taken as the limit, 514 tokens indexed past the table
    (on a GPU, a device-side assert). Found on a skeleton built on the meta device; None where no position table
    skips a padding index (BERT's; BART's is larger than its config says)."""
    import torch
    from transformers import AutoModelForSequenceClassification

    try:
        with torch.device("meta"):  # buffers too: a model's own mask of max_position squared costs nothing here
            skeleton = AutoModelForSequenceClassification.from_config(config, trust_remote_code=trust_remote_code)
    except Exception:  # noqa: BLE001 - a family without a classifier class: the config's count, as before
        return None
    tables = [
        module.num_embeddings - (module.padding_idx + 1)
        for name, module in skeleton.named_modules()
        if isinstance(module, torch.nn.Embedding) and "position" in name and module.padding_idx is not None
    ]
    return min(tables) if tables else None


def check_eos_tokens(tokenized, config, tokenizer) -> None:
    """Refuse in one line, naming an example, data that an encoder-decoder's classification head (BART's, T5's,
    mBART's, ...) cannot read: it reads each example's last EOS token, and needs as many in every example. A text that
    holds the EOS token's own text ("</s>", as in HTML's <s>...</s>) has one more, and the run stopped at the first
    batch that mixed it with others ("All examples must have the same number of <eos> tokens."). Any rank may call
    it; read with Arrow, not row by row."""
    import pyarrow.compute as pc

    eos = getattr(config, "eos_token_id", None)
    if not getattr(config, "is_encoder_decoder", False) or not isinstance(eos, int):
        return
    token = tokenizer.convert_ids_to_tokens(eos)
    found = {}
    for split in tokenized:
        parts = []
        for chunk in tokenized[split].with_format("arrow")["input_ids"].chunks:  # a chunk at a time: memory stays low
            rows, flat = pc.list_parent_indices(chunk).to_numpy(), pc.list_flatten(chunk).to_numpy()
            parts.append(np.bincount(rows[flat == eos], minlength=len(chunk)))
        found[split] = np.concatenate(parts) if parts else np.zeros(0, dtype=int)
    usual = np.bincount(found["train"]).argmax()
    if usual == 0:  # T5's head: "Each example must contain at least one <eos> token."
        raise UsageError(
            f"the tokenizer ends the examples without the EOS token {token!r} (id {eos}, the config's eos_token_id), "
            "which this model's head reads; use the tokenizer the model was trained with"
        )
    for split, counts in found.items():
        odd = np.flatnonzero(counts != usual)
        if len(odd):
            text = tokenizer.decode(tokenized[split][int(odd[0])]["input_ids"])
            shown = text[:100] + ("..." if len(text) > 100 else "")
            which = "they" if counts[odd[0]] > usual else "most examples"  # text joined with </s> by hand
            raise UsageError(
                f"{len(odd)} example(s) of the {split} data hold {counts[odd[0]]} EOS tokens {token!r} where most hold "
                f"{usual}, as {shown!r}; this model's head reads each example's last one, and needs as many in each: "
                f"{which} hold {token!r} in their text; remove it in the DATA section "
                f"(row[column].replace({token!r}, ' '))"
            )
