"""Tiny checkpoints of the families users bring to scripts/train.py, built from their configs (2 layers, hidden 32),
no Hub. Each is saved as its Hub checkpoints are, a masked LM, a causal LM or a seq2seq LM that train.py gives a new
classification head, with the kind of tokenizer those checkpoints have, built from the test words by the family's
own tokenizer class: WordPiece, byte-level BPE, SentencePiece's BPE or Unigram; a pad token or none (Llama, Mistral,
GPT-2), pad = EOS (Qwen2, Phi-3), a pad the config does not name (Qwen, GPT-NeoX), left padding (Llama 2's class:
Mistral, Phi-3, Gemma), the special tokens it adds (BOS; [CLS] ... [SEP]; <s> ... </s></s> ... </s>; T5's EOS)."""

from __future__ import annotations

from pathlib import Path

from conftest import FILLER, WORDS, _byte_level_alphabet

TEXT_WORDS = sorted({w for ws in WORDS.values() for w in ws} | set(FILLER))
LETTERS = sorted(set("".join(TEXT_WORDS)))


def _chains(pieces: list[str]) -> tuple[list[tuple[str, str]], list[str]]:
    """BPE merges that build each piece from its characters, left to right, and the tokens they make."""
    merges: dict = {}
    for piece in pieces:
        for i in range(1, len(piece)):
            merges.setdefault((piece[:i], piece[i]), piece[: i + 1])
    return list(merges), list(merges.values())


def wordpiece(cls, specials: list[str], **kwargs):
    return cls(vocab={t: i for i, t in enumerate(specials + TEXT_WORDS)}, **kwargs)


def byte_level_bpe(cls, specials: list[str], **kwargs):
    """GPT-2's byte-level BPE (RoBERTa, BART, GPT-2, GPT-NeoX, Qwen): every byte a token, merges to whole words."""
    merges, made = _chains(["\u0120" + w for w in TEXT_WORDS] + TEXT_WORDS)  # "Ġ": a word after a space
    vocab = {t: i for i, t in enumerate(dict.fromkeys(specials + _byte_level_alphabet() + made))}
    return cls(vocab=vocab, merges=merges, **kwargs)


def metaspace_bpe(cls, specials: list[str], **kwargs):
    """SentencePiece's BPE as Llama 2, Mistral, Phi-3 and Gemma have it: "▁" before each word (Gemma's first word
    has none), BOS added."""
    merges, made = _chains(["\u2581" + w for w in TEXT_WORDS] + TEXT_WORDS)
    vocab = {t: i for i, t in enumerate(dict.fromkeys(specials + ["\u2581"] + LETTERS + made))}
    return cls(vocab=vocab, merges=merges, add_bos_token=True, **kwargs)


def unigram(cls, specials: list[str], **kwargs):
    """SentencePiece's Unigram (XLM-R, ALBERT, T5, DeBERTa-v3): whole words likelier than their letters."""
    pieces = [(t, 0.0) for t in specials] + [("\u2581" + w, -2.0) for w in TEXT_WORDS]
    return cls(vocab=pieces + [("\u2581", -5.0)] + [(c, -10.0) for c in LETTERS], **kwargs)


def fast_byte_level(specials: list[str], single: str, pair: str, **kwargs):
    """A PreTrainedTokenizerFast over byte-level BPE with its own template (Llama 3's BOS; ModernBERT's [CLS] [SEP]),
    as those checkpoints ship a tokenizer.json and no tokenizer class of their own."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import GPT2Tokenizer, PreTrainedTokenizerFast

    vocab = byte_level_bpe(GPT2Tokenizer, specials).get_vocab()
    merges, _ = _chains(["\u0120" + w for w in TEXT_WORDS] + TEXT_WORDS)
    backend = Tokenizer(models.BPE(vocab, merges))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    used = {t for t in specials if t in single or t in pair}
    backend.post_processor = processors.TemplateProcessing(
        single=single, pair=pair, special_tokens=[(t, vocab[t]) for t in sorted(used)]
    )
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, **kwargs)
    others = [t for t in specials if t not in tokenizer.all_special_tokens]  # <|eot_id|>: special, never split
    tokenizer.add_special_tokens({"additional_special_tokens": others})
    return tokenizer


def _tokenizer(family: str):
    """The family's tokenizer (model_max_length 64 where its checkpoints give one; T5 v1.1's and mT5's give none)."""
    import transformers as t

    n = dict(model_max_length=64)
    if family in ("distilbert", "electra"):
        return wordpiece(
            t.DistilBertTokenizer if family == "distilbert" else t.BertTokenizer,
            ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"],
            **n,
        )
    if family == "mpnet":
        return wordpiece(t.MPNetTokenizer, ["<s>", "<pad>", "</s>", "<unk>", "[UNK]", "<mask>"], **n)
    if family in ("roberta", "bart"):
        return byte_level_bpe(t.RobertaTokenizer, ["<s>", "<pad>", "</s>", "<unk>", "<mask>"], **n)
    if family == "modernbert":
        return fast_byte_level(
            ["[UNK]", "[CLS]", "[SEP]", "[PAD]", "[MASK]"], "[CLS] $A [SEP]", "[CLS] $A [SEP] $B [SEP]",
            unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]", pad_token="[PAD]", mask_token="[MASK]",
            model_input_names=["input_ids", "attention_mask"], **n,
        )  # fmt: skip
    if family == "xlm_roberta":
        return unigram(t.XLMRobertaTokenizer, ["<s>", "<pad>", "</s>", "<unk>", "<mask>"], **n)
    if family == "albert":
        return unigram(t.AlbertTokenizer, ["<pad>", "<unk>", "[CLS]", "[SEP]", "[MASK]"], **n)
    if family == "deberta_v2":
        return unigram(t.DebertaV2Tokenizer, ["[PAD]", "[CLS]", "[SEP]", "[UNK]", "[MASK]"], **n)
    if family == "t5":
        return unigram(t.T5Tokenizer, ["<pad>", "</s>", "<unk>"], extra_ids=0)
    if family == "llama":  # Llama 3: tokenizer.json, BOS added, no pad, right padding
        return fast_byte_level(
            ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"], "<|begin_of_text|> $A",
            "<|begin_of_text|> $A <|begin_of_text|> $B", bos_token="<|begin_of_text|>", eos_token="<|end_of_text|>",
            model_max_length=131072, model_input_names=["input_ids", "attention_mask"],
        )  # fmt: skip
    if family == "mistral":  # Llama 2's class: BOS added, no pad, left padding
        return metaspace_bpe(t.LlamaTokenizer, ["<unk>", "<s>", "</s>"], padding_side="left", model_max_length=10**30)
    if family == "phi3":  # Llama 2's class, pad = EOS, as Phi-3's tokenizer_config gives it
        specials = ["<unk>", "<s>", "</s>", "<|endoftext|>", "<|end|>"]
        return metaspace_bpe(
            t.LlamaTokenizer, specials, eos_token="<|endoftext|>", pad_token="<|endoftext|>", padding_side="left", **n
        )
    if family in ("gemma2", "gemma3_text"):  # BOS added, a pad token of its own, left padding
        specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"]
        return metaspace_bpe(t.GemmaTokenizer, specials, padding_side="left", model_max_length=10**30)
    if family == "qwen2":  # Qwen2.5's base: pad = EOS = <|endoftext|>, no BOS
        specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
        return byte_level_bpe(t.Qwen2Tokenizer, specials, model_max_length=131072)
    if family == "qwen3":  # Qwen3's: EOS <|im_end|>, pad <|endoftext|>
        specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
        return byte_level_bpe(t.Qwen2Tokenizer, specials, eos_token="<|im_end|>", model_max_length=131072)
    if family == "gpt2":  # no pad token
        return byte_level_bpe(t.GPT2Tokenizer, ["<|endoftext|>"], model_max_length=1024)
    if family == "gpt_neox":  # Pythia's: a pad token <|padding|> its config does not name
        return byte_level_bpe(t.GPTNeoXTokenizer, ["<|endoftext|>", "<|padding|>"], model_max_length=10**30)
    raise KeyError(family)


ENCODER = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)
DECODER = dict(ENCODER, num_key_value_heads=2, max_position_embeddings=64)

# family: (config class, the checkpoint's model class, config entries beyond the sizes and the tokenizer's ids)
FAMILIES = {
    # encoders
    "modernbert": ("ModernBertConfig", "ModernBertForMaskedLM", dict(ENCODER, max_position_embeddings=64,
                   local_attention=16, classifier_pooling="mean")),
    "deberta_v2": ("DebertaV2Config", "DebertaV2ForMaskedLM", dict(ENCODER, max_position_embeddings=64,
                   relative_attention=True, position_buckets=32, pos_att_type=["p2c", "c2p"], max_relative_positions=-1,
                   position_biased_input=False, norm_rel_ebd="layer_norm", share_att_key=True, type_vocab_size=0)),
    "roberta": ("RobertaConfig", "RobertaForMaskedLM", dict(ENCODER, max_position_embeddings=66, type_vocab_size=1)),
    "xlm_roberta": ("XLMRobertaConfig", "XLMRobertaForMaskedLM", dict(ENCODER, max_position_embeddings=66,
                    type_vocab_size=1)),
    "distilbert": ("DistilBertConfig", "DistilBertForMaskedLM", dict(dim=32, n_layers=2, n_heads=2, hidden_dim=64,
                   max_position_embeddings=64)),
    "electra": ("ElectraConfig", "ElectraForPreTraining", dict(ENCODER, embedding_size=16, max_position_embeddings=64)),
    "albert": ("AlbertConfig", "AlbertForMaskedLM", dict(ENCODER, embedding_size=16, max_position_embeddings=64)),
    "mpnet": ("MPNetConfig", "MPNetForMaskedLM", dict(ENCODER, max_position_embeddings=66)),
    # decoder LLMs
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(DECODER, tie_word_embeddings=False)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(DECODER, tie_word_embeddings=True)),  # 0.5B to 3B tie
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(DECODER, head_dim=16, tie_word_embeddings=True)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(DECODER, sliding_window=None)),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(DECODER, head_dim=16, sliding_window=8)),
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(DECODER, head_dim=16, sliding_window=8)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(DECODER, original_max_position_embeddings=64)),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", dict(n_embd=32, n_layer=2, n_head=2, n_positions=64)),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", dict(DECODER, rotary_pct=0.25)),
    # encoder-decoders
    "bart": ("BartConfig", "BartForConditionalGeneration", dict(d_model=32, encoder_layers=2, decoder_layers=2,
             encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64,
             max_position_embeddings=64)),
    "t5": ("T5Config", "T5ForConditionalGeneration", dict(d_model=32, d_kv=16, d_ff=64, num_layers=2, num_heads=2,
           feed_forward_proj="gated-gelu", tie_word_embeddings=False)),  # T5 v1.1's and mT5's shape
}  # fmt: skip


def token_ids(tokenizer) -> dict:
    """The config's special token ids, as the family's checkpoints set them from their tokenizer."""
    return {f"{name}_token_id": tokenizer.convert_tokens_to_ids(token) for name, token in (
        ("bos", tokenizer.bos_token or tokenizer.cls_token), ("eos", tokenizer.eos_token or tokenizer.sep_token),
        ("pad", tokenizer.pad_token)) if token is not None}  # fmt: skip


def save_family(family: str, directory: Path) -> Path:
    """The family's tiny checkpoint and tokenizer, saved in `directory` (seeded: the same weights every time)."""
    import torch
    import transformers

    tokenizer = _tokenizer(family)
    config_class, model_class, extra = FAMILIES[family]
    ids = token_ids(tokenizer)
    if family in ("qwen2", "qwen3", "gpt_neox"):  # their checkpoints' configs name no pad token
        ids["pad_token_id"] = None
    if family == "modernbert":  # its [CLS] and [SEP]
        ids.update(cls_token_id=ids["bos_token_id"], sep_token_id=ids["eos_token_id"])
    if family in ("bart", "t5"):
        ids["decoder_start_token_id"] = ids["eos_token_id"] if family == "bart" else ids["pad_token_id"]
    if family == "t5":
        ids.pop("bos_token_id", None)
    config = getattr(transformers, config_class)(**extra, **ids, vocab_size=len(tokenizer))
    torch.manual_seed(0)
    getattr(transformers, model_class)(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory
