"""A task score from generation: every eval prompt answered once, greedily, on any number of
processes, and the answers scored against the references."""

from __future__ import annotations

import contextlib
import copy
import re
import string

import numpy as np
import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.logging import get_logger

from ..core.errors import UsageError
from ..core.files import write_jsonl
from ..core.sharded import is_sharded
from ..data.classification import ConfusionMatrix
from ..data.evaluation import check_metric_for_best_model, gather_for_eval
from ..training.compilation import generation_context
from ..training.fsdp import root_ready_for_generation
from .cache_rows import cache_of, counts_its_tokens, empty_cache, forget_rope_deltas, repeat_rows
from .chat import plain_prompt_ids
from .lora_merge import merged_for_generation
from .multimodal import text_config
from .weight_reads import weights_read_whole

logger = get_logger(__name__)

NOT_A_LABEL = "(not a label)"
MAX_LABELS = 20  # references with at most this many distinct values, each seen twice on average, are labels
# What `score_by_generation` gives that --metric_for_best_model can rank by; accuracy only when the answers are labels.
GENERATION_SCORES = ("eval_exact_match", "eval_accuracy")


def shared_prefix_length(prompts: list[list[int]], config) -> int:
    """Tokens at the start of every prompt that are the same in all (a chat template's system turn,
    an instruction), at most all but the last token of the shortest prompt; 0 for a model whose
    attention is windowed or chunked (`config`: the model's), where the padding that
    `LeftPaddingCollator` puts after the prefix would use up the window. No communication."""
    text = text_config(config)
    if (
        getattr(text, "sliding_window", None)
        or getattr(text, "attention_chunk_size", None)
        or any(kind != "full_attention" for kind in getattr(text, "layer_types", None) or [])
    ):
        return 0
    shortest = min(prompts, key=len)
    length = 0
    while length < len(shortest) - 1 and all(prompt[length] == shortest[length] for prompt in prompts):
        length += 1
    return length


class LeftPaddingCollator:
    """Rows of `index` and `input_ids` (a prompt) into a batch padded on the left, as generation
    needs: every prompt ends where the answer starts.

    With `shared_prefix` (from `shared_prefix_length`), the padding goes after those first tokens
    instead: [prefix, padding, rest of the prompt]. The prefix then sits at the same positions in
    every row, so `generate_answers` computes it once; positions come from the attention mask, so
    the model sees each prompt as it would left-padded."""

    def __init__(self, pad_token_id: int, shared_prefix: int = 0):
        self.pad_token_id, self.shared_prefix = pad_token_id, shared_prefix

    def __call__(self, rows: list[dict]) -> dict:
        length = max(len(row["input_ids"]) for row in rows)
        input_ids = torch.full((len(rows), length), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(rows), length), dtype=torch.long)
        p = self.shared_prefix
        for i, row in enumerate(rows):
            ids = torch.tensor(row["input_ids"])
            input_ids[i, :p], attention_mask[i, :p] = ids[:p], 1
            input_ids[i, length - len(ids) + p :], attention_mask[i, length - len(ids) + p :] = ids[p:], 1
        return {
            "index": torch.tensor([row["index"] for row in rows]),
            "input_ids": input_ids,
            "attention_mask": attention_mask,
        }


def stop_token_ids(tokenizer, generation_config) -> list[int]:
    """Every token that ends an answer: the model's generation EOS (one or several), the tokenizer's
    EOS, and the chat template's end of turn, which training teaches (`chat.end_of_turn`) and which
    base models' EOS often is not. No communication."""
    from .chat import end_of_turn

    eos = generation_config.eos_token_id if generation_config is not None else None
    ids = [eos] if isinstance(eos, int) else list(eos or [])
    ids += [tokenizer.eos_token_id, end_of_turn(tokenizer)[0]]
    return sorted({i for i in ids if i is not None})


def greedy_config(max_new_tokens: int, stop_ids: list[int], tokenizer):
    """Greedy decoding and nothing else: no sampling, no penalty, no banned or forced token. Run it
    under `only_this_config`, since generate() fills every field left unset from the model's own
    generation_config (Qwen2.5-Instruct's repetition_penalty 1.05 was applied)."""
    from transformers import GenerationConfig

    return GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=False,
        num_beams=1,
        eos_token_id=stop_ids,
        pad_token_id=tokenizer.pad_token_id,
        use_cache=True,
    )


@contextlib.contextmanager
def only_this_config(model):
    """While generating: the model's own generation_config replaced by an empty one, so the fields our
    config leaves unset take transformers' defaults (off), not the checkpoint's sampling and penalties."""
    from transformers import GenerationConfig

    # peft's generate copies the wrapper's config onto its base model: both are swapped, and both restored
    models = [model] + ([model.get_base_model()] if hasattr(model, "get_base_model") else [])
    saved = [m.generation_config for m in models]
    for m in models:
        m.generation_config = GenerationConfig()
    try:
        yield
    finally:
        for m, config in zip(models, saved):
            m.generation_config = config


def sampling_precision(accelerator: Accelerator, model):
    """The context to sample in with `model` (unwrapped, not compiled): the run's autocast, except where it would
    cast frozen fp32 weights again at every new token (LoRA on fp32 weights; autocast caches only trainable ones):
    there, on a GPU a third more launches per token (bench/README.md "The GPU check, session 2"), so the weights'
    own dtype (`in_weights_dtype`), as TRL's LoRA sampling runs. Its KV cache is then fp32: twice a bf16 one."""
    frozen_fp32 = any(not p.requires_grad and p.dtype == torch.float32 for p in model.parameters())
    if accelerator.mixed_precision in ("bf16", "fp16") and frozen_fp32:
        return in_weights_dtype(model)
    return accelerator.autocast()


@contextlib.contextmanager
def in_weights_dtype(model):
    """`model` (unwrapped) runs in its weights' own dtype, without the mixed-precision autocast that Accelerate's
    `prepare` wraps its forward in (`unwrap_model` keeps it); prepare's forward is back on exit. peft's `generate`
    calls its base model and so skips the wrapper already."""
    patched, original = vars(model).get("forward"), vars(model).get("_original_forward")  # set by prepare
    if patched is None or original is None:
        yield
        return
    model.forward = original
    try:
        yield
    finally:
        model.forward = patched


def generate_answers(accelerator: Accelerator, model, dataloader, tokenizer, max_new_tokens: int) -> list[str]:
    """All ranks call this (a gather per batch): greedy answers of at most `max_new_tokens` tokens
    to every prompt of a prepared dataloader of `LeftPaddingCollator` batches, in the dataset's
    order, each prompt answered once whatever the number of processes (`gather_for_eval` drops
    the prompts Accelerate repeats to even out the ranks). Every rank generates for every batch;
    with sharded weights (FSDP, DeepSpeed) `synced_gpus` keeps the ranks stepping together until
    the last one has finished its answers.

    The collator's `shared_prefix` first tokens, the same in every prompt, are computed once per
    call and their cache copied into each batch's, so the prompt pass skips them (on the demo, 13
    of about 120 prompt tokens)."""
    generator = accelerator.unwrap_model(model)
    root_ready_for_generation(generator)  # under FSDP2, an all-gather
    config = greedy_config(max_new_tokens, stop_token_ids(tokenizer, generator.generation_config), tokenizer)
    synced = accelerator.num_processes > 1 and is_sharded(accelerator)

    shared_prefix = (
        dataloader.collate_fn.shared_prefix
    )  # where LeftPaddingCollator put the prompts' common first tokens
    prefix = prefix_ids = None  # the shared prefix's cache and tokens, from the first batch (eval mode, every rank)

    def answer(model, batch):
        nonlocal prefix, prefix_ids
        cache = None
        if shared_prefix:
            if prefix is None:
                prefix, prefix_ids = empty_cache(generator), batch["input_ids"][:1, :shared_prefix]
                with torch.no_grad(), accelerator.autocast():
                    filled = generator(input_ids=prefix_ids, past_key_values=prefix, use_cache=True, logits_to_keep=1)
                prefix = cache_of(filled, prefix)
            if not torch.equal(batch["input_ids"][:, :shared_prefix], prefix_ids.expand(len(batch["input_ids"]), -1)):
                raise RuntimeError(
                    f"LeftPaddingCollator(shared_prefix={shared_prefix}), but these prompts do not all start "
                    f"with the same {shared_prefix} tokens: take it from shared_prefix_length over all the prompts"
                )
            if counts_its_tokens(prefix, shared_prefix):  # else `generate` reads the prefix again
                cache = copy.deepcopy(prefix)
                repeat_rows(generator, cache, 1, len(batch["input_ids"]))
                forget_rope_deltas(generator)
        with accelerator.autocast(), only_this_config(generator):  # the run's precision; no field of the model's
            output = generator.generate(
                input_ids=batch["input_ids"],
                attention_mask=batch["attention_mask"],
                generation_config=config,
                synced_gpus=synced,
                past_key_values=cache,
            )
        new = output[:, batch["input_ids"].shape[1] :]
        return {
            "index": batch["index"],
            "answer_ids": F.pad(new, (0, max_new_tokens - new.shape[1]), value=tokenizer.pad_token_id),
        }

    # Eager where the model is compiled layer by layer (--torch_compile); under ZeRO-3 the weights Mamba's mixers
    # read gathered; LoRA merged while answering (fewer launches).
    with generation_context(generator), weights_read_whole(generator), merged_for_generation(accelerator, generator):
        results = gather_for_eval(accelerator, model, dataloader, answer)
    order = np.argsort(results["index"], kind="stable")
    if not np.array_equal(results["index"][order], np.arange(len(order))):
        raise RuntimeError(f"generation answered {len(order)} prompts, not each of {len(dataloader.dataset)} once")
    return [tokenizer.decode(results["answer_ids"][i], skip_special_tokens=True).strip() for i in order]


THINKING = re.compile(r"^\s*<think>.*?(</think>|$)", re.DOTALL)  # a reasoning block first (Qwen3), ended or cut off


def normalize_answer(text: str) -> str:
    """A leading thinking block dropped (a reasoning model's answer follows it; one cut off by the
    length limit leaves no answer), lower case, punctuation dropped, whitespace collapsed:
    "<think>...</think> Positive." == "positive"."""
    text = THINKING.sub("", text)
    text = text.lower().translate(str.maketrans("", "", string.punctuation))
    return re.sub(r"\s+", " ", text).strip()


def score_answers(answers: list[str], references: list[str]) -> tuple[dict, ConfusionMatrix | None]:
    """({exact_match, and accuracy when the references are labels}, the confusion matrix of the
    labels or None). References are labels when they take few distinct values (at most 20, each
    seen twice on average). Exact match compares whole normalized answers; accuracy reads the
    label an answer names (`answer_label`), and counts an answer that names none, or several,
    in a "(not a label)" column. No communication."""
    answers, references = [normalize_answer(a) for a in answers], [normalize_answer(r) for r in references]
    matches = [a == r for a, r in zip(answers, references)]
    scores = {"exact_match": float(np.mean(matches)), "examples": len(matches)}
    if not are_labels(references):
        return scores, None
    labels = sorted(set(references))
    names = labels + [NOT_A_LABEL]
    index = {name: i for i, name in enumerate(labels)}
    counts = np.zeros((len(names), len(names)), dtype=np.int64)
    for answer, reference in zip(answers, references):
        counts[index[reference], index.get(answer_label(answer, labels), len(labels))] += 1
    scores.update(accuracy=float(np.trace(counts) / len(references)), answers_not_a_label=int(counts[:, -1].sum()))
    return scores, ConfusionMatrix(counts, names)


def are_labels(references: list[str]) -> bool:
    """Whether the reference answers are labels (at most MAX_LABELS distinct normalized values,
    each seen twice on average), which `score_answers` then scores by accuracy too."""
    labels = {normalize_answer(reference) for reference in references}
    return len(labels) <= MAX_LABELS and 2 * len(labels) <= len(references)


def settle_sft_metric(args, demo: bool) -> None:
    """--metric_for_best_model for train_sft.py, checked against what its evaluation gives with these
    options: loss and perplexity (--eval_perplexity), exact match and accuracy of the generated
    answers (--eval_max_new_tokens). Not given: the demo's accuracy (its answers are labels), else
    the loss, else exact match, whichever these options score at every checkpoint. A generation
    score given while --eval_steps evaluations (which rank mid-epoch checkpoints) generate nothing
    is refused. Every rank calls it while parsing; no communication."""
    from .causal_lm import PERPLEXITY_SCORES

    perplexity = PERPLEXITY_SCORES if args.eval_perplexity else ()
    answers = GENERATION_SCORES if args.eval_max_new_tokens else ()
    mid_epoch = bool(args.eval_steps) and args.checkpointing_steps.isdigit() and not args.generate_at_eval_steps
    args.metric_for_best_model_by_default = args.metric_for_best_model is None
    if args.metric_for_best_model is None:
        ranked = perplexity + (() if mid_epoch else answers)  # the scores every ranked checkpoint has
        preferred = ["eval_accuracy"] if demo else []
        args.metric_for_best_model = next((m for m in [*preferred, *perplexity, *ranked] if m in ranked), None)
    check_metric_for_best_model(args, perplexity + answers)
    if args.metric_for_best_model in GENERATION_SCORES and mid_epoch:
        raise UsageError(
            f"--metric_for_best_model {args.metric_for_best_model} is scored by generation at each epoch's end only, "
            f"so the checkpoints every --checkpointing_steps {args.checkpointing_steps} would not be ranked; add "
            "--generate_at_eval_steps, or rank by loss"
        )


def settle_accuracy_metric(args, references: list[str]) -> None:
    """Ranking by accuracy needs validation answers that are labels (else the evaluation gives exact
    match only, and no checkpoint would be ranked): refused when --metric_for_best_model asked for
    it; as the script's default it becomes the loss (or exact match), said in the log. Every rank
    calls it with the same data; no communication."""

    if args.metric_for_best_model != "eval_accuracy" or are_labels(references):
        return
    distinct = len({normalize_answer(reference) for reference in references})
    if not getattr(args, "metric_for_best_model_by_default", False):
        raise UsageError(
            f"--metric_for_best_model accuracy needs validation answers that are labels (at most {MAX_LABELS} "
            f"distinct ones), and these {len(references)} answers hold {distinct} distinct ones; rank by exact_match"
            + (" or loss" if getattr(args, "eval_perplexity", False) else "")
            + " instead"
        )
    args.metric_for_best_model = "eval_loss" if getattr(args, "eval_perplexity", False) else "eval_exact_match"
    args.greater_is_better = None  # the default metric's default direction
    check_metric_for_best_model(args, [args.metric_for_best_model])
    logger.info(
        f"the validation answers are not labels ({distinct} distinct ones), so the checkpoints are ranked by "
        f"{args.metric_for_best_model}, not accuracy"
    )


def answer_label(answer: str, labels: list[str]) -> str | None:
    """The label a normalized answer gives: the answer itself if it is one, else the one label it
    names as a word ("this review is positive" -> "positive"), else None (none, or several)."""
    if answer in labels:
        return answer
    named = [label for label in labels if re.search(rf"(?<!\w){re.escape(label)}(?!\w)", answer)]
    return named[0] if len(named) == 1 else None


def make_generation_dataloader(prompts, batch_size: int, tokenizer, config):
    """The eval prompts (rows of index and input_ids, from `sft_data.tokenize_sft`) in batches for
    `generate_answers`, longest first; the tokens every prompt starts with (a system turn, say) are
    computed once per pass (`shared_prefix_length`). Prepare it with the Accelerator."""
    from ..data.dataloaders import longest_first

    collate = LeftPaddingCollator(
        tokenizer.pad_token_id, shared_prefix=shared_prefix_length(prompts["input_ids"], config)
    )
    columns = [c for c in prompts.column_names if c not in ("index", "input_ids")]
    return torch.utils.data.DataLoader(
        longest_first(prompts.remove_columns(columns)), batch_size=batch_size, collate_fn=collate
    )


def score_by_generation(
    accelerator: Accelerator, model, dataloader, tokenizer, prompts, max_new_tokens: int, path: str
):
    """All ranks call this (it gathers every rank's answers): greedy answers to every eval prompt,
    scored against the references of `prompts`; the main process writes prompt, reference and
    answer to the JSONL file `path`. Returns (scores named eval_*, the labels' confusion matrix or None)."""
    answers = generate_answers(accelerator, model, dataloader, tokenizer, max_new_tokens)
    references = prompts["reference"]
    scores, confusion = score_answers(answers, references)
    rows = [
        {"prompt": tokenizer.decode(ids), "reference": ref, "answer": answer}
        for ids, ref, answer in zip(prompts["input_ids"], references, answers)
    ]
    write_jsonl(accelerator, path, rows)
    return {f"eval_{key}": value for key, value in scores.items()}, confusion


def show_sample(accelerator: Accelerator, model, tokenizer, prompt: str, max_new_tokens: int) -> None:
    """A greedy continuation of `prompt` (its first tokens that fit the model's positions), printed by the main
    process, so the user sees what the model learned; a failure is a warning. Skipped where the weights are sharded
    (every rank would have to take part). Any rank may call it; no communication."""
    if not prompt or not accelerator.is_main_process:
        return
    if is_sharded(accelerator):
        logger.info("sample generation skipped: with sharded weights every rank would have to take part")
        return
    generator = accelerator.unwrap_model(model).eval()
    context = getattr(text_config(generator.config), "max_position_embeddings", None) or 1 << 30
    ids = plain_prompt_ids(tokenizer, prompt, separator="")[: max(context - max_new_tokens, 1)]  # learned positions
    input_ids = torch.tensor([ids], device=accelerator.device)
    try:  # the model is saved already: a sample that fails is said, and the run still succeeds
        with torch.no_grad(), accelerator.autocast(), generation_context(generator):
            output = generator.generate(
                input_ids=input_ids,
                attention_mask=torch.ones_like(input_ids),
                do_sample=False,
                no_repeat_ngram_size=3,
                max_new_tokens=max_new_tokens,
                pad_token_id=tokenizer.pad_token_id,
            )
    except Exception as error:
        logger.warning(f"the sample could not be generated ({type(error).__name__}: {str(error)[:120]}); skipped")
        return
    completion = tokenizer.decode(output[0, input_ids.shape[1] :], skip_special_tokens=True)
    print(f"\n--- sample ---\nprompt: {prompt}\nmodel:  {completion}\n--------------", flush=True)
