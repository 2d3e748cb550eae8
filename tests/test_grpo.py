"""scripts/train_grpo.py: the advantages and both losses against hand computations, completions sampled by
(seed, step, prompt, sample) whatever shares their batch, reward functions' faults as one line, N processes
and accumulation training the same model as one big batch, and an exact resume."""

import contextlib
import json
import math
import os
import random
import re
from argparse import Namespace

import numpy as np
import pytest
import torch
from model_families import HYBRIDS, TEXT_FAMILIES, save_with_tokenizer, tiny_model
from safetensors.numpy import load_file

from conftest import AUDIT_HOOK_DIR, FILLER, REPO, WORDS, launch, load_script, make_tiny_causal_lm, refused_in_process
from ddp_utils import SAMPLE_WEIGHT
from ddp_utils.core.errors import RunFailed, UsageError
from ddp_utils.language_models.grpo import (
    LOSS_WEIGHT,
    SeededSampling,
    finish_rollouts,
    group_advantages,
    grpo_losses,
    sample_completions,
    score_completions,
)
from ddp_utils.language_models.grpo_data import PromptCollator, asked_prompt
from ddp_utils.language_models.pair_scoring import TWO_ROWS
from ddp_utils.training.exact_loss import global_mean_loss

TRAIN_GRPO = REPO / "scripts" / "train_grpo.py"


@pytest.fixture(scope="module")
def chat_lm(tmp_path_factory):
    return make_tiny_causal_lm(tmp_path_factory.mktemp("grpo-lm"), chat_template=True)


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    return write_prompts(tmp_path_factory.mktemp("grpo-data"))


def write_prompts(directory):
    """Short reviews in the tiny vocabulary, their label the answer: what the script's demo rewards read."""
    rng = random.Random(0)
    files = {}
    for split, count in (("train", 16), ("validation", 6)):
        files[split] = directory / f"{split}.jsonl"
        with open(files[split], "w") as handle:
            for _ in range(count):
                label = rng.choice(sorted(WORDS))
                text = " ".join(rng.choices(FILLER, k=rng.randint(2, 5)) + [rng.choice(WORDS[label])])
                handle.write(json.dumps({"prompt": text, "answer": label}) + "\n")
    return files


def grpo_args(model, data, output_dir, *extra):
    return [
        "--model_name_or_path", model, "--train_file", data["train"], "--validation_file", data["validation"],
        "--output_dir", output_dir, "--learning_rate", 5e-2, "--warmup_ratio", 0.0, "--lora_r", 4,
        "--num_generations", 4, "--max_completion_length", 5, "--eval_max_new_tokens", 3,
        "--per_device_eval_batch_size", 2, "--checkpointing_steps", "no", "--report_to", "none",
        "--logging_steps", 1, *extra,
    ]  # fmt: skip


@pytest.mark.fast
@pytest.mark.parametrize("scale", [True, False])
def test_advantages_are_each_reward_against_its_own_group(scale):
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0, 0.0, 3.0, 0.0, 1.0])
    advantages = group_advantages(rewards, 4, scale)
    expected = []
    for group in rewards.view(3, 4).tolist():
        mean, std = np.mean(group), np.std(group, ddof=1)
        expected += [(r - mean) / (std + 1e-4) if scale else r - mean for r in group]
    np.testing.assert_allclose(advantages.numpy(), expected, rtol=1e-6)
    assert advantages[4:8].abs().max() == 0, "a group whose rewards are all equal gives no signal"


def rollout(rng, rows, length, weights=None):
    mask = torch.ones(rows, length, dtype=torch.long)
    for i in range(rows):
        mask[i, rng.randint(1, length) :] = 0  # completions of different lengths
    return {
        "index": torch.arange(rows),
        "prompt_mask": torch.ones(rows, 3, dtype=torch.long),
        "completion_mask": mask,
        SAMPLE_WEIGHT: torch.tensor(weights or [1.0] * rows),
    }


@pytest.mark.fast
@pytest.mark.parametrize("loss_type", ["token", "sequence"])
@pytest.mark.parametrize("beta", [0.0, 0.1])
def test_each_loss_over_two_micro_batches_equals_its_hand_computation(loss_type, beta):
    """The step's loss is the mean over all its completion tokens (token) or over its completions (sequence),
    however the micro-batches split them; a filler completion (weight 0) counts for nothing; the ratio is
    clipped at 1 - epsilon and 1 + epsilon_high, and beta adds the k3 estimate of the KL to the reference."""
    rng, generator = random.Random(1), torch.Generator().manual_seed(1)
    args = Namespace(epsilon=0.2, epsilon_high=0.28, beta=beta, loss_type=loss_type, num_generations=4)
    rollouts = [rollout(rng, 4, 6), rollout(rng, 4, 6, weights=[1.0, 1.0, 0.0, 0.0])]
    advantages = torch.randn(8, generator=generator)
    finish_rollouts(rollouts, advantages, args, TWO_ROWS, pad_token_id=0)
    step_weight = sum(r[LOSS_WEIGHT].sum() for r in rollouts)
    accelerator = Namespace(num_processes=1, gradient_accumulation_steps=1)
    total, hand_terms = 0.0, []
    for r in rollouts:
        logps = torch.randn(4, 6, generator=generator) * 0.3 - 2
        old = logps + torch.randn(4, 6, generator=generator) * 0.3  # ratios spread past both clips
        ref = logps + torch.randn(4, 6, generator=generator) * 0.5 if beta else None
        losses, weights, _ = grpo_losses(logps, old, ref, r, args)
        total += global_mean_loss(losses, weights, step_weight, accelerator).item()
        for i in range(4):
            if r[SAMPLE_WEIGHT][i] == 0:
                continue
            terms = []
            for t in range(int(r["completion_mask"][i].sum())):
                ratio, a = math.exp(logps[i, t] - old[i, t]), r["advantages"][i].item()
                term = -min(ratio * a, min(max(ratio, 0.8), 1.28) * a)
                if beta:
                    d = (ref[i, t] - logps[i, t]).item()
                    term += beta * (math.exp(d) - d - 1)
                terms.append(term)
            hand_terms.append(terms)
    if loss_type == "token":
        expected = sum(map(sum, hand_terms)) / sum(map(len, hand_terms))
    else:
        expected = np.mean([np.mean(terms) for terms in hand_terms])
    assert total == pytest.approx(expected, rel=1e-5)


@pytest.mark.fast
def test_top_p_samples_only_the_nucleus_and_in_its_proportions():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    counts = np.zeros(4)
    for seed in range(4000):
        counts[int(SeededSampling([seed], 1.0, 0.7)(None, logits).argmax())] += 1
    assert counts[2:].sum() == 0, "tokens past the top 70% of the mass are never drawn"
    np.testing.assert_allclose(counts[:2] / counts.sum(), [0.5 / 0.8, 0.3 / 0.8], atol=0.03)
    counts = np.zeros(4)
    for seed in range(4000):
        counts[int(SeededSampling([seed], 1.0, 1.0)(None, logits).argmax())] += 1
    np.testing.assert_allclose(counts / counts.sum(), [0.5, 0.3, 0.15, 0.05], atol=0.03)


@pytest.mark.fast
def test_a_prompts_samples_depend_on_the_seed_step_and_prompt_alone_not_on_its_batch(chat_lm):
    from accelerate import Accelerator
    from transformers import AutoModelForCausalLM

    from ddp_utils.language_models.causal_lm import load_tokenizer

    accelerator = Accelerator(cpu=True)
    tokenizer = load_tokenizer(str(chat_lm))
    model = AutoModelForCausalLM.from_pretrained(chat_lm)
    texts = {3: "the movie was good", 7: "a film is not bad really", 9: "okay"}
    rows = {i: {"input_ids": tokenizer(t)["input_ids"], "index": i} for i, t in texts.items()}
    collate = PromptCollator(tokenizer.pad_token_id)
    args = Namespace(num_generations=4, max_completion_length=6, seed=5, temperature=1.0, top_p=1.0)

    def samples(indices, step=0):
        out = sample_completions(accelerator, model, collate([rows[i] for i in indices]), tokenizer, args, step)
        ids = out["completion_ids"].masked_fill(out["completion_mask"] == 0, -1)
        return {i: ids[k * 4 : (k + 1) * 4].tolist() for k, i in enumerate(indices)}

    alone = samples([7])[7]
    assert samples([3, 7, 9])[7] == alone and samples([9, 7])[7] == alone, "the batch changed a prompt's samples"
    assert len({tuple(s) for s in alone}) > 1, "a group's samples differ from each other"
    assert samples([7], step=1)[7] != alone, "each step samples anew"


def stop_first(rows):
    """A SeededSampling that draws the stop token for `rows` on its first call (each sample's first token, drawn
    before `generate`) and samples as usual after."""
    from ddp_utils.language_models import grpo

    class StopFirst(grpo.SeededSampling):
        calls = 0

        def __call__(self, input_ids, scores):
            out = super().__call__(input_ids, scores)
            if StopFirst.calls == 0:
                out[rows] = -math.inf
                out[rows, StopFirst.stop] = 0.0
            StopFirst.calls += 1
            return out

    return StopFirst


@pytest.mark.fast
def test_a_sample_that_ends_at_its_first_token_is_one_token_long_and_does_not_keep_generation_going(
    chat_lm, monkeypatch
):
    """Each sample's first token is drawn before `generate`, which does not read its input's last token: a
    sample that drew a stop token must still count as ended, and with every sample ended generation stops at
    once. With --max_completion_length 1 `generate` is not called at all."""
    from accelerate import Accelerator
    from transformers import AutoModelForCausalLM

    from ddp_utils.language_models import grpo
    from ddp_utils.language_models.causal_lm import load_tokenizer

    accelerator, tokenizer = Accelerator(cpu=True), load_tokenizer(str(chat_lm))
    model = AutoModelForCausalLM.from_pretrained(chat_lm).eval()
    batch = PromptCollator(tokenizer.pad_token_id)(
        [{"input_ids": tokenizer("the movie was good")["input_ids"], "index": 0}]
    )
    args = Namespace(num_generations=3, max_completion_length=6, seed=0, temperature=1.0, top_p=1.0)
    eos = tokenizer.eos_token_id

    sampler = stop_first([0])
    sampler.stop = eos
    monkeypatch.setattr(grpo, "SeededSampling", sampler)
    out = sample_completions(accelerator, model, batch, tokenizer, args, step=0)
    assert out["completion_ids"][0, 0] == eos and out["completion_mask"][0].sum() == 1 and not out["truncated"][0]

    sampler = stop_first([0, 1, 2])
    sampler.stop = eos
    monkeypatch.setattr(grpo, "SeededSampling", sampler)
    out = sample_completions(accelerator, model, batch, tokenizer, args, step=0)
    assert out["completion_ids"].shape[1] <= 2, "every sample had ended: generation goes no further"
    assert out["completion_mask"].sum(dim=1).tolist() == [1, 1, 1]

    monkeypatch.setattr(grpo, "SeededSampling", SeededSampling)
    monkeypatch.setattr(model, "generate", lambda *a, **k: pytest.fail("one token needs no generate"))
    out = sample_completions(
        accelerator, model, batch, tokenizer, Namespace(**{**vars(args), "max_completion_length": 1}), 0
    )
    assert out["completion_ids"].shape == (3, 1) and out["completion_mask"].tolist() == [[1], [1], [1]]


@pytest.fixture
def fresh_accelerator_state():
    """Accelerate's process-wide state let go before and after: an Accelerator with other settings than the
    earlier tests' may be made."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


@pytest.mark.fast
@pytest.mark.parametrize(
    "lora, compiled, sampled_in",
    [(False, False, torch.bfloat16), (True, False, torch.float32), (True, True, torch.float32)],
    ids=["full", "lora", "lora-compiled"],
)
def test_lora_on_fp32_weights_samples_in_fp32_and_training_keeps_the_runs_autocast(
    chat_lm, monkeypatch, fresh_accelerator_state, lora, compiled, sampled_in
):
    """Under the run's bf16 autocast LoRA's frozen fp32 weights are cast again at each new token: on the GPU a
    third more launches than TRL's LoRA sampling, which skips the autocast (bench_sampling.py --count_ops --bf16).
    So LoRA samples from the fp32 weights, compiled too (by regions, in place, as the scripts compile); full
    fine-tuning keeps the autocast, which casts its trainable weights once per call. The model's forward is the
    run's autocast again afterwards, also after a fault in generation."""
    from accelerate import Accelerator
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from ddp_utils.language_models.causal_lm import load_tokenizer
    from ddp_utils.training.compilation import compile_by_regions

    counters = torch._dynamo.utils.counters
    accelerator = Accelerator(cpu=True, mixed_precision="bf16")
    tokenizer = load_tokenizer(str(chat_lm))
    model = AutoModelForCausalLM.from_pretrained(chat_lm, dtype=torch.float32)
    if lora:
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=4, target_modules="all-linear"))
    model = accelerator.prepare(model)
    inner = accelerator.unwrap_model(model)
    compile_by_regions(inner, "eager" if compiled else "no")  # as start_training compiles, after prepare
    assert compiled == any(getattr(m, "_compiled_call_impl", None) is not None for m in inner.modules())
    dtypes = []
    inner.get_output_embeddings().register_forward_hook(lambda module, inputs, output: dtypes.append(output.dtype))
    batch = PromptCollator(tokenizer.pad_token_id)(
        [{"input_ids": tokenizer("the movie was good")["input_ids"], "index": 0}]
    )
    args = Namespace(num_generations=2, max_completion_length=4, seed=0, temperature=1.0, top_p=1.0)

    torch._dynamo.reset()
    traced = counters["stats"]["unique_graphs"]  # dynamo's counters outlive its reset
    sample_completions(accelerator, model, batch, tokenizer, args, step=0)
    assert len(dtypes) >= 2 and set(dtypes) == {sampled_in}, dtypes  # the prompts' pass and each new token
    assert counters["stats"]["unique_graphs"] == traced, "sampling traced the compiled layers"
    dtypes.clear()
    inner(input_ids=batch["input_ids"])
    assert dtypes == [torch.bfloat16], "the training forward lost the run's autocast"
    assert (counters["stats"]["unique_graphs"] > traced) == compiled, "the training forward ran compiled again"

    def fault(*args, **kwargs):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(inner.get_base_model() if lora else inner, "generate", fault)
    with pytest.raises(RuntimeError, match="out of memory"):
        sample_completions(accelerator, model, batch, tokenizer, args, step=0)
    dtypes.clear()
    inner(input_ids=batch["input_ids"])
    assert dtypes == [torch.bfloat16], "a fault in generation left the forward without the run's autocast"
    torch._dynamo.reset()


def lora_model(chat_lm, dtype=torch.float32, **lora):
    """The chat LM with LoRA on every linear layer, its B drawn at random: a trained adapter, not a zero one."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(chat_lm, dtype=dtype)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, **{"target_modules": "all-linear", **lora}))
    torch.manual_seed(1)
    for name, parameter in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(parameter, std=0.2)
    return model


@pytest.mark.fast
def test_lora_merged_while_sampling_draws_the_same_samples_and_leaves_the_base_weights_bit_for_bit(
    chat_lm, monkeypatch, fresh_accelerator_state
):
    """LoRA is merged while GRPO samples (on a GPU 43% fewer launches: bench/README.md): the adapters' layers do
    not run, the samples are those of the unmerged model, and the base weights are the same tensors, bit for
    bit, afterwards, also after a fault in generation (peft's unmerge would subtract, which rounds)."""
    from accelerate import Accelerator

    from ddp_utils.language_models import grpo
    from ddp_utils.language_models.causal_lm import load_tokenizer

    accelerator = Accelerator(cpu=True, mixed_precision="bf16")
    tokenizer = load_tokenizer(str(chat_lm))
    model = accelerator.prepare(lora_model(chat_lm))
    inner = accelerator.unwrap_model(model)
    base = {name: p for name, p in inner.named_parameters() if not p.requires_grad}
    before = {name: (p.data_ptr(), p.detach().clone()) for name, p in base.items()}
    adapter_calls = []
    for name, module in inner.named_modules():
        if name.endswith("lora_A.default"):
            module.register_forward_hook(lambda *_: adapter_calls.append(1))
    prompts = ["the movie was good", "a dull and slow film that I did not like at all"]
    batch = PromptCollator(tokenizer.pad_token_id)(
        [{"input_ids": tokenizer(text)["input_ids"], "index": i} for i, text in enumerate(prompts)]
    )
    args = Namespace(num_generations=4, max_completion_length=8, seed=0, temperature=1.0, top_p=1.0)

    merged = sample_completions(accelerator, model, batch, tokenizer, args, step=3)
    assert adapter_calls == [], "the adapters ran while sampling: LoRA was not merged"
    with monkeypatch.context() as patch:
        patch.setattr(grpo, "merged_for_generation", lambda *_: contextlib.nullcontext())
        unmerged = sample_completions(accelerator, model, batch, tokenizer, args, step=3)
    assert adapter_calls, "the unmerged model ran without its adapters"
    assert torch.equal(merged["completion_ids"], unmerged["completion_ids"])
    assert any(int(m.sum()) > 2 for m in merged["completion_mask"]), "too short to compare"

    def fault(*args, **kwargs):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(inner.get_base_model(), "generate", fault)
    with pytest.raises(RuntimeError, match="out of memory"):
        sample_completions(accelerator, model, batch, tokenizer, args, step=3)
    for name, parameter in base.items():
        pointer, values = before[name]
        assert parameter.data_ptr() == pointer and torch.equal(parameter, values), f"{name} changed"
    assert not any(getattr(m, "merged_adapters", None) for m in inner.modules()), "a layer is left merged"


@pytest.mark.fast
@pytest.mark.parametrize(
    "dtype, lora, gpu_room, merged",
    [
        (torch.float32, {}, None, 14),  # every linear layer of both layers (7 each)
        (torch.bfloat16, {}, None, 0),  # a young adapter's small update would round away in bf16
        (torch.float32, {"use_dora": True}, None, 0),  # not plain LoRA
        (torch.float32, {"target_modules": ["q_proj", "lm_head"]}, None, 2),  # the head tied to the embeddings
        (torch.float32, {}, 0, 14),  # on a GPU whose memory is 8 times the copies': room
        (torch.float32, {}, -1, 0),  # a byte less: none merged
    ],
    ids=["fp32", "bf16", "dora", "tied", "gpu-room", "gpu-no-room"],
)
def test_only_lora_layers_that_compute_the_same_merged_are_merged(
    chat_lm, fresh_accelerator_state, monkeypatch, dtype, lora, gpu_room, merged
):
    from accelerate import Accelerator

    from ddp_utils.language_models.lora_merge import MERGED_SHARE, mergeable_lora_layers

    model = lora_model(chat_lm, dtype, **lora)
    if "lm_head" in str(lora):  # the chat LM's head is its own: tie it, as Gemma's and Qwen's small models are
        assert not model.config.tie_word_embeddings
        model.get_base_model().lm_head.base_layer.weight = model.get_base_model().model.embed_tokens.weight
    accelerator = Accelerator(cpu=True)
    if gpu_room is not None:  # on a GPU of 8 times the size of the merged copies, + gpu_room bytes
        copies = sum(m.get_base_layer().weight.nbytes for m in model.modules() if hasattr(m, "lora_A"))
        memory = Namespace(total_memory=MERGED_SHARE * copies + gpu_room)
        monkeypatch.setattr(type(accelerator), "device", property(lambda self: torch.device("cuda", 0)))
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: memory)
    assert len(mergeable_lora_layers(accelerator, model)) == merged


def lora_family_model(family: str, base_dtype=torch.float32):
    """A tiny model of `family` with LoRA set up as the scripts do, its frozen base in `base_dtype`, the adapters in
    fp32 (as `train_in_fp32` leaves them), lora_B drawn so that the adapters count."""
    from ddp_utils.language_models.lora import add_lora

    settings = Namespace(lora_target_modules="all-linear", lora_r=4, lora_alpha=8, lora_dropout=0.0,
                         lora_last_layers=0, seed=0)  # fmt: skip
    config_class, model_class, extra = HYBRIDS.get(family) or TEXT_FAMILIES[family]
    model = add_lora(tiny_model(config_class, model_class, {**extra, "pad_token_id": 0}).to(base_dtype), settings)
    for name, parameter in model.named_parameters():
        if parameter.requires_grad:
            parameter.data = parameter.data.float()
        if "lora_B" in name:
            torch.nn.init.normal_(parameter, std=0.2)
    return model


@pytest.mark.parametrize("family", [*HYBRIDS, *TEXT_FAMILIES])
def test_lora_on_a_bf16_base_trains_the_same_without_peft_input_casts_in_every_family(family, fresh_accelerator_state):
    """Every family users bring, on a bf16 base with fp32 adapters under autocast: the adapters take their bf16
    input as it is (`lora.CastOutsideAutocast`), not cast to fp32 and back, and the loss and gradients are bit for
    bit those of peft's own casts (tests/test_sft.py counts the casts saved)."""
    from accelerate import Accelerator
    from peft.tuners.tuners_utils import BaseTunerLayer

    Accelerator(cpu=True)  # add_lora logs
    model = lora_family_model(family, torch.bfloat16)
    layers = [module for module in model.modules() if isinstance(module, BaseTunerLayer)]
    ours = [layer.cast_input_dtype_enabled for layer in layers]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert layers and not any(ours), "every LoRA layer takes its input as it is under autocast"
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    results = []
    for cast in (True, False):  # peft's own casts, then ours
        for layer, own in zip(layers, ours):
            layer.cast_input_dtype_enabled = True if cast else own
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=ids).logits.float().square().mean()
        loss.backward()
        results.append([loss.detach(), *(p.grad.clone() for p in model.parameters() if p.requires_grad)])
    assert all(torch.equal(a, b) for a, b in zip(*results)), "not bit for bit"


@pytest.mark.parametrize("family", [*HYBRIDS, *TEXT_FAMILIES])
def test_lora_merged_for_generation_computes_what_the_adapters_do_in_every_family(family, fresh_accelerator_state):
    """Every family users bring, LoRA set up as the scripts do (GPT-2's Conv1D layers, fused QKV, MoE experts,
    the mixers of the hybrids): merged while generating, the logits are the adapters', and the base weights are
    left bit for bit."""
    from accelerate import Accelerator

    from ddp_utils.language_models.lora_merge import mergeable_lora_layers, merged_for_generation

    accelerator = Accelerator(cpu=True)  # add_lora logs
    model = lora_family_model(family).eval()
    assert mergeable_lora_layers(accelerator, model), "no layer merged"
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        adapters = model(input_ids=ids).logits
        with merged_for_generation(accelerator, model):
            merged = model(input_ids=ids).logits
    torch.testing.assert_close(merged, adapters, rtol=1e-4, atol=1e-5)
    assert [name for name, p in model.named_parameters() if not torch.equal(p, before[name])] == []


# (model, LoRA, the run's precision). MPT samples the same too, from 13 graphs: its modeling code breaks the graph.
GEMMA3_SLIDING = dict(
    num_key_value_heads=1, head_dim=16, sliding_window=13, layer_types=["sliding_attention", "full_attention"]
)
COMPILED_FAMILIES = {
    "llama, LoRA, bf16": (None, True, "bf16"),  # the chat LM: LoRA on fp32 weights samples in fp32, outside autocast
    # Full fine-tuning, sampled under the run's autocast; the longest prompts and their answers pass the window.
    "gemma3, sliding and full layers": (("Gemma3TextConfig", "Gemma3ForCausalLM", GEMMA3_SLIDING), False, "bf16"),
}


@pytest.mark.fast
@pytest.mark.parametrize("family", list(COMPILED_FAMILIES))
def test_compiled_decoding_draws_the_same_samples_in_one_graph_per_batch_shape(
    chat_lm, fresh_accelerator_state, family
):
    """--compile_generation (a static cache; on a CPU dynamo traces the step, on a GPU inductor makes it a CUDA
    graph): the same completions as plain decoding, for batches of prompts of every length; one graph per number of
    rows, none again when the prompts' lengths change or an earlier shape comes back, and no graph break."""
    from accelerate import Accelerator
    from peft import LoraConfig, get_peft_model
    from torch._dynamo.utils import counters
    from transformers import AutoModelForCausalLM

    from ddp_utils.language_models.causal_lm import load_tokenizer
    from ddp_utils.language_models.static_decoding import StaticDecoding

    spec, lora, precision = COMPILED_FAMILIES[family]
    accelerator = Accelerator(cpu=True, mixed_precision=precision)
    tokenizer = load_tokenizer(str(chat_lm))
    if spec is None:
        model = AutoModelForCausalLM.from_pretrained(chat_lm, dtype=torch.float32)
    else:
        model = tiny_model(spec[0], spec[1], {**spec[2], "vocab_size": len(tokenizer)})
    if lora:
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=4, target_modules="all-linear"))
    args = Namespace(num_generations=4, max_completion_length=6, seed=5, temperature=1.0, top_p=1.0)
    decoding = StaticDecoding(accelerator, model, 12, args.max_completion_length)
    model = accelerator.prepare(model)
    texts = ["the movie was good", "a film is not bad really great", "okay", "bad bad film the movie was not good"]
    rows = [{"input_ids": tokenizer(t)["input_ids"], "index": i} for i, t in enumerate(texts)]
    collate = PromptCollator(tokenizer.pad_token_id)
    graphs, breaks = counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())
    for step, batch in enumerate([[0, 1], [2, 3], [1], [3, 0]]):  # 8 rows, 8 rows of other lengths, 4, 8 again
        prompts = collate([rows[i] for i in batch])
        plain = sample_completions(accelerator, model, prompts, tokenizer, args, step)
        compiled = sample_completions(accelerator, model, prompts, tokenizer, args, step, decoding)
        for key in ("completion_ids", "completion_mask"):
            assert torch.equal(compiled[key], plain[key]), (step, key)
    assert counters["stats"]["unique_graphs"] - graphs == 2, "one graph for 8 rows, one for 4"
    assert sum(counters["graph_break"].values()) == breaks, dict(counters["graph_break"])


def test_a_decoding_step_that_breaks_the_graph_samples_the_same_and_is_warned_of(
    chat_lm, fresh_accelerator_state, caplog
):
    """MPT's modeling code breaks the graph (`Tensor.item()`), so its step compiles in pieces, each a sync and
    a CUDA graph of its own: the samples are the same, and the run says once that the option gains less."""
    from accelerate import Accelerator

    from ddp_utils.language_models.causal_lm import load_tokenizer
    from ddp_utils.language_models.static_decoding import StaticDecoding

    accelerator = Accelerator(cpu=True)
    tokenizer = load_tokenizer(str(chat_lm))
    model = tiny_model(*HYBRIDS["mpt (ALiBi)"][:2], {**HYBRIDS["mpt (ALiBi)"][2], "vocab_size": len(tokenizer)})
    args = Namespace(num_generations=2, max_completion_length=4, seed=5, temperature=1.0, top_p=1.0)
    decoding = StaticDecoding(accelerator, model, 12, args.max_completion_length)
    prompts = PromptCollator(tokenizer.pad_token_id)(
        [{"input_ids": tokenizer("the movie was good")["input_ids"], "index": 0}]
    )
    with caplog.at_level("WARNING"):
        compiled = sample_completions(accelerator, model, prompts, tokenizer, args, 0, decoding)
        sample_completions(accelerator, model, prompts, tokenizer, args, 1, decoding)
    plain = sample_completions(accelerator, model, prompts, tokenizer, args, 0)
    assert torch.equal(compiled["completion_ids"], plain["completion_ids"])
    warnings = [r.getMessage() for r in caplog.records if "--compile_generation" in r.getMessage()]
    assert len(warnings) == 1 and "gains less or nothing" in warnings[0], warnings
    assert int(re.search(r"with (\d+) graph break", warnings[0]).group(1)) > 0, warnings


@pytest.mark.fast
@pytest.mark.parametrize(
    "family, sharded, expected",
    [
        ("lfm2", False, "and lfm2 has LinearAttentionLayer layers, which it cannot copy: leave it off for this model"),
        ("gemma3, window 16", False, "sliding window (16 tokens) to hold a whole prompt (--max_prompt_length 16)"),
        ("qwen3 (attention only)", True, "--compile_generation needs the whole model on every process"),
    ],
)  # fmt: skip
def test_what_compiled_decoding_cannot_run_is_refused_before_training_in_one_line(family, sharded, expected):
    from accelerate.utils import DistributedType

    from ddp_utils.language_models.static_decoding import StaticDecoding

    gemma = ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(num_key_value_heads=1, head_dim=16, sliding_window=16))
    model = tiny_model(*(gemma if family.startswith("gemma3") else HYBRIDS[family]))
    kind = DistributedType.FSDP if sharded else DistributedType.NO
    with pytest.raises(UsageError, match=re.escape(expected)):
        StaticDecoding(Namespace(distributed_type=kind, device=torch.device("cpu")), model, 16, 4)


@pytest.mark.fast
@pytest.mark.parametrize("family", ["bamba", "jamba", "lfm2", "recurrent_gemma", "minimax", "qwen3 (attention only)"])
def test_a_prompts_cache_repeated_for_its_samples_continues_as_the_repeated_prompts_would(family):
    """GRPO fills the cache with each prompt once and repeats its rows for the prompt's samples (`repeat_rows`). On
    every family with state-space, convolution or recurrent layers transformers' `batch_repeat_interleave` failed
    ("'LinearAttentionLayer' object has no attribute ..."), and GRPO stopped at its first sampling; RecurrentGemma
    keeps its states in its layers, which started again from zeros for the repeated rows (0.08 apart); MiniMax keeps
    its lightning attention's beside its cache's layers, in a cache class of its own, and refused the one GRPO built.
    The repeated cache must continue as a cache filled with the prompts repeated does: the same next-token logits."""
    from model_families import MINIMAX

    from ddp_utils.language_models.cache_rows import cache_of, empty_cache, repeat_rows

    model = tiny_model(*(MINIMAX if family == "minimax" else HYBRIDS[family]))
    prompts, group = torch.tensor([[1, 5, 9, 3, 7], [1, 7, 2, 8, 4]]), 3
    step = torch.tensor([[4], [6], [10]]).repeat(2, 1)  # each sample's own next token
    with torch.no_grad():
        cache = empty_cache(model)  # as GRPO fills it
        cache = cache_of(model(input_ids=prompts, past_key_values=cache, use_cache=True), cache)
        repeat_rows(model, cache, len(prompts), group)
        continued = model(input_ids=step, past_key_values=cache, use_cache=True).logits[:, -1]
        filled = empty_cache(model)
        filled = cache_of(
            model(input_ids=prompts.repeat_interleave(group, dim=0), past_key_values=filled, use_cache=True), filled
        )
        expected = model(input_ids=step, past_key_values=filled, use_cache=True).logits[:, -1]
    torch.testing.assert_close(continued, expected, atol=1e-6, rtol=0)  # measured: 1.8e-7 at most


@pytest.mark.fast
@pytest.mark.parametrize(
    "reward, expected",
    [
        (lambda c, r: [r_["missing"] for r_ in r], "reward function <lambda> raised KeyError: 'missing'"),
        (lambda c, r: [1.0], "reward function <lambda> returned 1 values for 3 completions"),
        (lambda c, r: [1.0, float("nan"), 0.0], "reward function <lambda> returned nan for the completion 'b'"),
        (lambda c, r: ["x", "y", "z"], "reward function <lambda> returned values that are not numbers"),
    ],
)
def test_a_reward_functions_fault_ends_the_run_in_one_line_naming_it(reward, expected):
    from accelerate import Accelerator

    with pytest.raises(RunFailed) as failed:
        score_completions(Accelerator(cpu=True), {reward: 1.0}, ["a", "b", "c"], [{"index": i} for i in range(3)])
    assert expected in str(failed.value) and "\n" not in str(failed.value), str(failed.value)


@pytest.mark.fast
def test_reward_functions_never_see_the_record_numbering_which_names_a_bad_value():
    """A held-out share numbers the training records (`RECORD_COLUMN`) for the messages: the reward functions get
    the records as the file has them, with or without a validation file, and a bad value names its record's row."""
    from accelerate import Accelerator

    from ddp_utils.data.raw_data import RECORD_COLUMN

    seen = []

    def reward(completions, records):
        seen.extend(records)
        return [float("nan") if record["answer"] == "b" else 1.0 for record in records]

    records = [{"answer": "a", RECORD_COLUMN: 12}, {"answer": "b", RECORD_COLUMN: 7}]
    with pytest.raises(RunFailed, match=r"returned nan for the completion 'y' of train record 7; fix it"):
        score_completions(Accelerator(cpu=True), {reward: 1.0}, ["x", "y"], records)
    assert seen == [{"answer": "a"}, {"answer": "b"}]


@pytest.mark.fast
def test_rewards_are_weighted_and_summed():
    from accelerate import Accelerator

    def length(completions, records):
        return [len(c) for c in completions]

    def first(completions, records):
        return [float(r["first"]) for r in records]

    values, total = score_completions(
        Accelerator(cpu=True), {length: 0.5, first: 2.0}, ["ab", "c"], [{"first": 1}, {"first": 0}]
    )
    np.testing.assert_array_equal(values, [[2, 1], [1, 0]])
    np.testing.assert_array_equal(total, [3.0, 0.5])


LAYOUTS = {
    "one_process_batch_2B": (1, ["--per_device_train_batch_size", 4]),
    "two_processes_batch_B": (2, ["--per_device_train_batch_size", 2]),
    "one_process_batch_B_accumulating_2": (1, ["--per_device_train_batch_size", 2, "--gradient_accumulation_steps", 2]),
    "two_processes_batch_B_compiled": (2, ["--per_device_train_batch_size", 2, "--compile_generation"]),
}


@pytest.fixture(scope="module")
def grpo_runs(chat_lm, prompts, tmp_path_factory):
    base, runs = tmp_path_factory.mktemp("grpo-runs"), {}
    for name, (num_processes, extra) in LAYOUTS.items():
        output_dir = base / name
        result = launch(TRAIN_GRPO, *grpo_args(chat_lm, prompts, output_dir, *extra), num_processes=num_processes)
        assert result.returncode == 0, result.output[-4000:]
        log = [json.loads(line) for line in (output_dir / "train_log.jsonl").read_text().splitlines()]
        runs[name] = {"dir": output_dir, "log": [r for r in log if "train/loss" in r]}
        runs[name]["metrics"] = json.loads((output_dir / "metrics.json").read_text())
    return runs


def test_two_processes_and_accumulation_sample_and_train_the_same_model_as_one_big_batch(grpo_runs):
    """With the defaults users run (LoRA dropout 0.05 included): every layout samples the same completions
    (the same rewards and lengths at every step); 2 processes and 1 with accumulation, whose per-device batch
    is the same and so draw the same dropout masks, end with the same adapter weights."""
    reference = grpo_runs["one_process_batch_B_accumulating_2"]
    sampled = ["train/reward/right_word", "train/reward/short_answer", "train/completion_length"]
    assert any(step["train/no_signal_groups"] < 1 for step in reference["log"]), "no group ever had a signal"
    for name in ("two_processes_batch_B", "one_process_batch_2B"):
        run = grpo_runs[name]
        assert len(run["log"]) == len(reference["log"]) == 4
        for ours, theirs in zip(run["log"], reference["log"]):
            for key in sampled:
                assert ours[key] == pytest.approx(theirs[key], abs=1e-9), f"{name}, step {ours['step']}: {key}"
        assert run["metrics"]["optimizer_steps"] == 4 and run["metrics"]["train_prompts_seen"] == 16
        assert 0 <= run["metrics"]["no_signal_groups"] < 1
    card = (reference["dir"] / "README.md").read_text()  # the model card names the rewards and the sampling
    assert "Rewards (GRPO): `right_word` x 1, `short_answer` x 0.5." in card and "| `num_generations` | 4 |" in card
    weights = load_file(str(reference["dir"] / "adapter_model.safetensors"))
    initial_b = [k for k in weights if "lora_B" in k]
    assert all(np.abs(weights[k]).max() > 0 for k in initial_b), "LoRA's B starts at zero: training moved it"
    other = load_file(str(grpo_runs["two_processes_batch_B"]["dir"] / "adapter_model.safetensors"))
    for key in weights:
        np.testing.assert_allclose(other[key], weights[key], rtol=1e-4, atol=1e-5, err_msg=key)


def test_compiled_decoding_trains_the_same_model_bit_for_bit(grpo_runs):
    """--compile_generation changes how the samples are decoded, not which: the same samples train the same
    adapter, to the bit (the training passes are the same code)."""
    plain, compiled = (grpo_runs[name] for name in ("two_processes_batch_B", "two_processes_batch_B_compiled"))
    assert [step["train/completion_length"] for step in compiled["log"]] == [
        step["train/completion_length"] for step in plain["log"]
    ]
    theirs, ours = (load_file(str(run["dir"] / "adapter_model.safetensors")) for run in (plain, compiled))
    assert [key for key in theirs if not np.array_equal(ours[key], theirs[key])] == [], "not bit for bit"
    # ...and it did compile: one graph per batch shape (a step's 2 prompts; evaluation is not compiled), no break.
    assert compiled["metrics"]["compiled_graphs"] == 1 and compiled["metrics"]["graph_breaks"] == 0
    assert "compiled_graphs" not in plain["metrics"]


def test_compiled_training_and_compiled_decoding_together_sample_and_train_what_eager_does(
    grpo_runs, chat_lm, prompts, tmp_path
):
    """--torch_compile (the layers by regions, set aside while sampling) with --compile_generation (the decoding
    step compiled whole): each compiles its own graphs, neither disturbs the other, and the run samples the same
    completions and trains the same adapter as eager (aot_eager here: autograd traced as inductor would be)."""
    output_dir = tmp_path / "run"
    args = grpo_args(chat_lm, prompts, output_dir, *LAYOUTS["two_processes_batch_B_compiled"][1], "--torch_compile")
    env = {"TORCH_COMPILE_OVERRIDE_BACKENDS": ">=0:aot_eager"}  # inductor's C++ build: minutes on 2 cores
    result = launch(TRAIN_GRPO, *args, num_processes=2, env=env)
    assert result.returncode == 0, result.output[-4000:]
    plain = grpo_runs["two_processes_batch_B"]
    log = [json.loads(line) for line in (output_dir / "train_log.jsonl").read_text().splitlines()]
    log = [step for step in log if "train/loss" in step]
    sampled = ["train/reward/right_word", "train/reward/short_answer", "train/completion_length"]
    assert len(log) == len(plain["log"]) == 4
    for ours, theirs in zip(log, plain["log"]):  # the same completions: their rewards and lengths, step by step
        assert [ours[key] for key in sampled] == pytest.approx([theirs[key] for key in sampled], abs=1e-9)
    metrics = json.loads((output_dir / "metrics.json").read_text())
    decoding = grpo_runs["two_processes_batch_B_compiled"]["metrics"]["compiled_graphs"]  # 1: the decoding step
    assert metrics["graph_breaks"] == 0 and metrics["compiled_graphs"] > decoding, metrics  # and the regions
    theirs = load_file(str(plain["dir"] / "adapter_model.safetensors"))
    ours = load_file(str(output_dir / "adapter_model.safetensors"))
    for key in theirs:
        np.testing.assert_allclose(ours[key], theirs[key], rtol=1e-4, atol=1e-6, err_msg=key)


@pytest.mark.fast
def test_a_resumed_run_without_signal_says_since_when(caplog):
    from types import SimpleNamespace

    from accelerate import PartialState

    from ddp_utils.language_models.grpo_log import learning_signal

    PartialState(cpu=True)
    log = SimpleNamespace(run_means={"no_signal_groups": torch.tensor([6.0, 6.0])}, first_step=3)
    assert learning_signal(log) == {"no_signal_groups": 1.0, "no_signal_from_step": 3}
    assert "in each of the 6 groups since the resume at step 3, every answer got the same reward, so these" in (
        caplog.text
    )
    log = SimpleNamespace(run_means={"no_signal_groups": torch.tensor([2.0, 6.0])}, first_step=0)
    assert learning_signal(log) == {"no_signal_groups": pytest.approx(1 / 3)}


def test_a_run_whose_groups_never_differ_in_reward_says_it_learned_nothing(chat_lm, prompts, tmp_path):
    """A reward the model never earns (an answer it never gives) and one-token answers (all equally short): no
    group ever has a signal, every gradient is 0, and the run saved the model it started from as a success."""
    files = {}
    for split, path in prompts.items():  # answers that are not the demo's labels: right_word is 0 for all
        records = [{**json.loads(line), "answer": "unheard"} for line in path.read_text().splitlines()]
        files[split] = tmp_path / f"{split}.jsonl"
        files[split].write_text("".join(json.dumps(record) + "\n" for record in records))
    args = grpo_args(chat_lm, files, tmp_path / "run", "--max_train_steps", 2, "--skip_zero_shot")
    args[args.index("--max_completion_length") + 1] = 1
    result = launch(TRAIN_GRPO, *args, num_processes=2)
    assert result.returncode == 0, result.output[-3000:]
    assert "no signal: in each of the 32 groups sampled, every answer got the same reward" in result.output  # 2 x 16
    assert json.loads((tmp_path / "run" / "metrics.json").read_text())["no_signal_groups"] == 1.0


def test_a_run_preempted_mid_epoch_resumes_bit_for_bit(grpo_runs, chat_lm, prompts, tmp_path):
    output_dir = tmp_path / "run"
    args = grpo_args(chat_lm, prompts, output_dir, *LAYOUTS["two_processes_batch_B"][1])
    args[args.index("--checkpointing_steps") + 1] = 1
    hooks = {"PYTHONPATH": os.pathsep.join([str(AUDIT_HOOK_DIR), str(REPO)])}
    # SIGTERM while the checkpoint of step 1 is written: the ranks save after step 2 and exit.
    stopped = launch(TRAIN_GRPO, *args, num_processes=2, env={**hooks, "SIGTERM_ON_WRITE": ".tmp-checkpoint-1/"})
    assert stopped.returncode != 0 and "checkpoint-2" in os.listdir(output_dir), stopped.output[-3000:]
    resumed = launch(TRAIN_GRPO, *args, "--resume_from_checkpoint", "latest", num_processes=2)
    assert resumed.returncode == 0, resumed.output[-4000:]
    reference = load_file(str(grpo_runs["two_processes_batch_B"]["dir"] / "adapter_model.safetensors"))
    ours = load_file(str(output_dir / "adapter_model.safetensors"))
    assert [k for k in reference if not np.array_equal(ours[k], reference[k])] == [], "not bit for bit"
    metrics = json.loads((output_dir / "metrics.json").read_text())  # the epoch's checkpoint ranked by default
    assert metrics["metric_for_best_model"] == "eval_accuracy" and metrics["best_step"] == 4, metrics


@pytest.mark.fast
def test_a_prompt_and_its_longest_answer_fit_the_whole_context_or_the_block_size_given():
    from accelerate import PartialState

    from ddp_utils.language_models.grpo_data import fit_prompts_in_block

    PartialState(cpu=True)  # the cut is said through Accelerate's logger

    def fitted(context, evaluated=True, **given):
        options = dict(max_prompt_length=512, max_completion_length=1024, eval_max_new_tokens=8, block_size=None)
        args = Namespace(**{**options, **given})
        fit_prompts_in_block(args, context, evaluated)
        return args.max_prompt_length

    assert fitted(8192) == 512, "the whole context, not the 1024 the other scripts' --block_size defaults to"
    assert fitted(8192, block_size=1200) == 176
    assert fitted(64, max_completion_length=5, eval_max_new_tokens=40, evaluated=False) == 59, "no evaluation"
    with pytest.raises(UsageError, match="answers of 40 tokens .* leave no room for a prompt in 32 tokens"):
        fitted(32, max_completion_length=5, eval_max_new_tokens=40)


@pytest.mark.fast
def test_the_script_fits_prompts_in_the_whole_context_counting_only_the_answers_it_generates(chat_lm, tmp_path):
    """train_grpo.py's own call: a model of 2048 positions takes a prompt of 512 and answers of 1500 (--block_size's
    default of at most 1024 refused them), and --eval_max_new_tokens counts only where the evaluation generates
    (records with an "answer")."""
    from accelerate import PartialState

    PartialState(cpu=True)
    llama = ("LlamaConfig", "LlamaForCausalLM", dict(max_position_embeddings=2048))
    model = save_with_tokenizer(llama, chat_lm, tmp_path / "long")
    script = load_script("train_grpo")
    for answers, expected in ((False, 512), (True, 248)):
        data = tmp_path / f"answers_{answers}.jsonl"
        record = {"prompt": "the film was good", **({"answer": "positive"} if answers else {})}
        data.write_text("".join(json.dumps(record) + "\n" for _ in range(4)))
        lengths = ["--max_completion_length", 1500, "--eval_max_new_tokens", 1800]
        args = script.parse_args(map(str, grpo_args(model, {"train": data, "validation": data}, tmp_path, *lengths)))
        script.prepare_data(args)
        assert args.max_prompt_length == expected, answers


@pytest.mark.fast
def test_a_long_prompt_keeps_bos_its_system_turn_and_its_newest_turn(tmp_path, caplog):
    """Cut from the left, a prompt lost BOS and the system turn, which says how to answer (the format the rewards
    read); it now loses its oldest turns after them, as SFT's cuts do, and so does plain text after BOS."""
    import datasets
    from accelerate import PartialState
    from chat_templates import make_family_tokenizer
    from transformers import AutoTokenizer

    from ddp_utils.language_models.chat import render
    from ddp_utils.language_models.grpo_data import tokenize_prompts

    PartialState(cpu=True)  # the warning that counts the cuts is logged
    llama = make_family_tokenizer("llama3", tmp_path / "llama3")
    system = {"role": "system", "content": "reply with one word positive negative or neutral"}
    old = [{"role": "user", "content": "the film was good " * 8}, {"role": "assistant", "content": "positive"}]
    turns = [system, *old, {"role": "user", "content": "what do you think of this movie"}]
    text = render(llama, turns, generation_prompt=True)
    whole = llama(text, add_special_tokens=False)["input_ids"]
    head = llama(render(llama, [system], generation_prompt=False), add_special_tokens=False)["input_ids"]
    newest = llama(text[text.rfind("<|start_header_id|>user") :], add_special_tokens=False)["input_ids"]
    texts = [{"prompt": "the film was good " * 20 + "what do you think"}, {"prompt": "good"}]
    raw = datasets.DatasetDict(
        {"train": datasets.Dataset.from_list([{"prompt": turns}]), "validation": datasets.Dataset.from_list(texts)}
    )
    llama = AutoTokenizer.from_pretrained(tmp_path / "llama3", add_bos_token=True)  # as Llama's own: plain text too
    rows = tokenize_prompts(raw, llama, len(whole) - 10, use_chat_template=False)
    assert rows["train"].column_names == ["input_ids", "index", "length"]
    (cut,), (plain, short) = rows["train"]["input_ids"], rows["validation"]["input_ids"]
    assert len(cut) == len(whole) - 10 and cut[: len(head)] == head, "BOS and the system turn stay"
    assert cut[-len(newest) :] == newest == whole[-len(newest) :], "the question and the generation prompt stay"
    assert plain[0] == llama.bos_token_id and llama.decode(plain[-4:]) == "what do you think"
    assert len(plain) == len(whole) - 10 and short == llama("good")["input_ids"]
    assert f"train: 1 of 1 prompts were longer than {len(whole) - 10} tokens (--max_prompt_length, or what" in (
        caplog.text
    )
    assert "and lost 10 tokens: their oldest turns" in caplog.text
    assert "validation: 1 of 2 prompts were longer" in caplog.text


def test_prompts_are_cut_so_that_prompt_and_answer_fit_the_context_of_learned_positions(chat_lm, tmp_path):
    """A prompt of 30 words and its answer past GPT-2's 24 positions: sampling read past its table of positions
    (an IndexError here, a device-side assert on a GPU), --block_size took no part. The prompts are now cut to
    leave room for the longest answer, and the cuts counted."""
    gpt2 = ("GPT2Config", "GPT2LMHeadModel", dict(n_embd=32, n_layer=2, n_head=2, n_positions=24))
    model = save_with_tokenizer(gpt2, chat_lm, tmp_path / "gpt2")
    rng = random.Random(0)
    data = tmp_path / "long.jsonl"
    with open(data, "w") as handle:
        for _ in range(8):
            label = rng.choice(sorted(WORDS))
            prompt = " ".join(rng.choices(FILLER, k=30) + [rng.choice(WORDS[label])])
            handle.write(json.dumps({"prompt": prompt, "answer": label}) + "\n")
    args = grpo_args(model, {"train": data, "validation": data}, tmp_path / "o", "--max_train_steps", 1)
    result = launch(TRAIN_GRPO, *args, num_processes=2)
    assert result.returncode == 0, result.output[-3000:]
    assert "prompts are cut to 19 tokens (--max_prompt_length 512), so that an answer of 5 fits in 24" in result.output
    assert (
        "train: 8 of 8 prompts were longer than 19 tokens (--max_prompt_length, or what --block_size" in result.output
    )
    assert json.loads((tmp_path / "o" / "training_args.json").read_text())["max_prompt_length"] == 19


def test_records_without_what_a_reward_reads_end_the_run_on_every_rank_in_one_line(chat_lm, prompts, tmp_path):
    data = tmp_path / "no_answer.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"the film was good {i}"}) + "\n" for i in range(8)))
    args = grpo_args(chat_lm, {"train": data, "validation": data}, tmp_path / "o", "--max_train_steps", 1)
    result = launch(TRAIN_GRPO, *args, num_processes=2)
    assert result.returncode != 0
    for rank in (0, 1):
        assert f"[rank {rank}] error: reward function right_word raised KeyError: 'answer'" in result.output, (
            result.output[-3000:]
        )


@pytest.mark.fast
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_one_row_per_prompt_scores_each_completion_as_a_row_of_its_own_does(chat_lm, attention):
    """[prompt, completion 1, ..., completion G] with its 4D mask and positions gives every completion token the
    log-prob that [prompt, completion] alone gives: completions of different lengths, prompts of two lengths; and
    the rows padded to a multiple of 8 give the same."""
    from transformers import AutoModelForCausalLM

    from ddp_utils.language_models.group_scoring import completion_logps, one_row_per_prompt

    model = AutoModelForCausalLM.from_pretrained(chat_lm, attn_implementation=attention).eval()
    generator, group, width = torch.Generator().manual_seed(3), 3, 5
    prompts = [[1, 10, 11, 12, 13], [1, 14, 15]]
    prompt_ids = torch.zeros(2, 5, dtype=torch.long)
    prompt_mask = torch.zeros(2, 5, dtype=torch.long)
    for p, ids in enumerate(prompts):  # left-padded, as generation gives them
        prompt_ids[p, 5 - len(ids) :], prompt_mask[p, 5 - len(ids) :] = torch.tensor(ids), 1
    completion_ids = torch.randint(5, 40, (2 * group, width), generator=generator)
    completion_mask = torch.zeros(2 * group, width, dtype=torch.long)
    for row, length in enumerate([5, 2, 1, 3, 5, 4]):
        completion_mask[row, :length] = 1
    rollout = {
        "prompt_ids": prompt_ids.repeat_interleave(group, dim=0),
        "prompt_mask": prompt_mask.repeat_interleave(group, dim=0),
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
    }
    rollout["rows"] = one_row_per_prompt(rollout, group, pad_token_id=0)
    assert rollout["rows"]["input_ids"].shape == (2, max(5 + 5 + 2 + 1, 3 + 3 + 5 + 4)), "each prompt once"
    with torch.no_grad():
        one_row = completion_logps(model, rollout)
        own_rows = completion_logps(model, rollout, TWO_ROWS)
    torch.testing.assert_close(one_row, own_rows, atol=1e-5, rtol=0)
    assert (one_row[completion_mask.bool()] < 0).all() and (one_row[~completion_mask.bool()] == 0).all()
    # Padded to a multiple of 8 (train_grpo.py under mixed precision): the same log-probs, from rows of 16.
    rollout["rows"] = one_row_per_prompt(rollout, group, pad_token_id=0, pad_to_multiple_of=8)
    assert rollout["rows"]["input_ids"].shape == (2, 16)
    with torch.no_grad():
        padded = completion_logps(model, rollout)
    torch.testing.assert_close(padded, one_row, atol=1e-6, rtol=0)


@pytest.mark.fast
@pytest.mark.parametrize(
    "extra, expected",
    [
        (["--num_generations", 1], "--num_generations must be at least 2"),
        (["--beta", 0.04], "--beta > 0 needs a reference model: with LoRA (--lora_r)"),
        (["--oom_backoff"], "--oom_backoff does not split GRPO's steps yet"),
        (["--top_p", 0], "--temperature must be > 0 and --top_p in (0, 1]"),
        (["--block_size", 5], "answers of 5 tokens (--max_completion_length, --eval_max_new_tokens) leave no room"),
    ],
)
def test_options_that_cannot_train_are_refused_with_the_fix(chat_lm, prompts, tmp_path, extra, expected):
    args = grpo_args(chat_lm, prompts, tmp_path / "o", *extra)
    if "--beta" in extra:
        args[args.index("--lora_r") + 1] = 0
    refused_in_process("train_grpo", args, expected)


@pytest.mark.fast
def test_checkpoints_are_ranked_by_the_greedy_answers_accuracy_or_exact_match_or_not_at_all(chat_lm, prompts, tmp_path):
    """--metric_for_best_model is checked against what GRPO's evaluation gives (it was taken as typed: `accuracy`
    ranked nothing, `eval_accuracy` kept the worst checkpoint): accuracy by default where the answers are labels,
    else nothing unless asked; without an 'answer' column nothing is ranked, and a metric asked for is refused."""
    from accelerate import PartialState

    PartialState(cpu=True)
    module = load_script("train_grpo")

    def settled(data, *extra):
        args = module.parse_args([str(a) for a in grpo_args(chat_lm, data, tmp_path / "o", *extra)])
        module.prepare_data(args)
        return args.metric_for_best_model, args.greater_is_better

    def with_answers(name, answer):  # the same prompts, their answers changed or left out
        files = {}
        for split, path in prompts.items():
            files[split] = tmp_path / f"{name}-{split}.jsonl"
            records = [json.loads(line) for line in path.read_text().splitlines()]
            files[split].write_text("".join(json.dumps(answer(r, n)) + "\n" for n, r in enumerate(records)))
        return files

    assert settled(prompts) == ("eval_accuracy", True)
    assert settled(prompts, "--metric_for_best_model", "exact_match") == ("eval_exact_match", True)
    expected = "'reward' is not a score of this script's evaluation, so no checkpoint would be ranked; it gives "
    refused_in_process("train_grpo", grpo_args(chat_lm, prompts, tmp_path, "--metric_for_best_model", "reward"),
                       expected + "exact_match, accuracy")  # fmt: skip
    no_eval = grpo_args(chat_lm, prompts, tmp_path, "--eval_max_new_tokens", 0, "--metric_for_best_model", "accuracy")
    refused_in_process("train_grpo", no_eval, "it gives no scores, with these options")
    free = with_answers("free", lambda record, n: {**record, "answer": f"{record['answer']} {n}"})  # not labels
    assert settled(free)[0] is None  # exact match of whole answers can stay 0: the first checkpoint would win
    assert settled(free, "--metric_for_best_model", "exact_match") == ("eval_exact_match", True)
    refused_in_process("train_grpo", grpo_args(chat_lm, free, tmp_path, "--metric_for_best_model", "accuracy"),
                       "these 6 answers hold 6 distinct ones; rank by exact_match instead")  # fmt: skip
    unanswered = with_answers("none", lambda record, n: {"prompt": record["prompt"]})
    assert settled(unanswered)[0] is None
    refused_in_process("train_grpo", grpo_args(chat_lm, unanswered, tmp_path, "--metric_for_best_model", "accuracy"),
                       "against their 'answer' column, which these prompts lack")  # fmt: skip


@pytest.mark.fast
@pytest.mark.parametrize(
    "answers, expected",
    [
        ([42, 7.0, 2.5, "x"], ["42", "7", "2.5", "x"]),  # a math set's numbers: the greedy answer "42" matches 42
        ([42, None, 1, 2], "validation record 1: its 'answer' is None; give each held-out prompt one answer"),
        ([42, float("nan"), 1, 2], "validation record 1: its 'answer' is nan"),
        (["a", ["a", "b"], "c", "d"], "validation record 1: its 'answer' is ['a', 'b']"),
    ],
)
def test_held_out_answers_that_are_numbers_are_scored_as_written_and_missing_ones_are_refused(
    chat_lm, prompts, tmp_path, answers, expected
):
    """Numbers in the "answer" column (GSM8K's and MATH's final answers, as users store them) ended the run with a
    TypeError at the first evaluation, after the model had loaded."""
    files = {"train": prompts["train"], "validation": tmp_path / "validation.jsonl"}
    records = [{"prompt": f"what is {n} plus one", "answer": answer} for n, answer in enumerate(answers)]
    files["validation"].write_text("".join(json.dumps(record) + "\n" for record in records))
    if isinstance(expected, str):
        return refused_in_process("train_grpo", grpo_args(chat_lm, files, tmp_path), expected)
    from accelerate import PartialState

    PartialState(cpu=True)
    module = load_script("train_grpo")
    args = module.parse_args([str(a) for a in grpo_args(chat_lm, files, tmp_path / "o")])
    tokenized = module.prepare_data(args)[0]
    assert tokenized["validation"]["reference"] == expected
    assert args.metric_for_best_model is None  # four distinct answers in four are not labels: nothing ranked


USER = [{"role": "user", "content": "What is 6 x 7?"}]
CALL = {
    "role": "assistant",
    "content": "",
    "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {}}}],
}  # noqa: E501


@pytest.mark.fast
@pytest.mark.parametrize(
    "prompt, asked",
    [
        ("What is 6 x 7?", "What is 6 x 7?"),
        ("[INST] What is 6 x 7? [/INST]", "[INST] What is 6 x 7? [/INST]"),  # text, though it starts with "["
        (json.dumps(USER), USER),  # a CSV's cell of JSON turns
        ([{"from": "human", "value": "What is 6 x 7?"}], USER),  # ShareGPT
        ([{"role": "user", "content": [{"type": "text", "text": "What is 6 x 7?"}]}], USER),  # content parts
        ([{"role": "system", "content": "", "name": None}, *USER], [{"role": "system", "content": ""}, *USER]),
        ([{"role": "system", "content": "Write a haiku."}], [{"role": "system", "content": "Write a haiku."}]),
        ([*USER, CALL, {"role": "tool", "content": {"x": 1}}], [*USER, CALL, {"role": "tool", "content": '{"x": 1}'}]),
    ],
    ids=["text", "inst-text", "json-cell", "sharegpt", "parts", "nulls", "system-only", "agent"],
)  # fmt: skip
def test_prompts_in_the_shapes_users_bring_are_asked_as_text_or_turns(prompt, asked):
    """JSON turns in a CSV cell were asked as their JSON text, content parts as a Python repr, ShareGPT's turns
    ended in a raw KeyError."""
    assert asked_prompt(prompt, 3, "train") == asked


@pytest.mark.fast
@pytest.mark.parametrize(
    "prompt, expected",
    [
        ("  ", "train record 3: its prompt is empty; fill it or drop the record"),
        ([], "train record 3: its prompt is '[]' (list); give text or a list of chat turns"),
        ({"text": "hi"}, "train record 3: its prompt is \"{'text': 'hi'}\" (dict)"),
        ([{"role": "user"}], "train record 3: its prompt's turns must each have a 'role'"),
        ([{"role": "user", "content": " "}], "train record 3: its prompt's turns are empty"),
        ([*USER, {"role": "assistant", "content": "42"}], "ends with an assistant turn, the answer GRPO samples"),
        ([*USER, CALL], "train record 3: its prompt ends with a tool call; add the tool's result after it"),
        ([{"role": "user", "content": [{"type": "image"}]}], "holds a part of type 'image'"),
    ],
    ids=["blank", "no-turns", "dict", "no-content", "empty-turn", "answered", "awaits-result", "image"],
)  # fmt: skip
def test_prompts_that_ask_nothing_or_hold_their_answer_are_refused_naming_the_record(prompt, expected):
    """An empty prompt trained on nothing and an empty list ended in a raw ValueError; a conversation that ends
    with the answer (SFT's messages renamed to prompt) put the answer in the prompt, without a word."""
    with pytest.raises(UsageError, match=re.escape(expected)):
        asked_prompt(prompt, 3, "train")


@pytest.mark.fast
def test_a_gsm8k_shaped_file_is_told_to_rename_its_question_column(chat_lm, prompts, tmp_path):
    """The fix read "Name the right one with GRPO": the script has no option for it, the DATA section renames."""
    files = {"train": tmp_path / "gsm8k.jsonl", "validation": prompts["validation"]}
    files["train"].write_text(json.dumps({"question": "What is 6 x 7?", "answer": "6 x 7 = 42\n#### 42"}) + "\n")
    expected = "no column 'prompt'; its columns are ['question', 'answer']. Rename yours to 'prompt' in the script's "
    expected += "DATA section: data.rename_columns({'question': 'prompt'})"
    refused_in_process("train_grpo", grpo_args(chat_lm, files, tmp_path), expected)


@pytest.mark.fast
def test_chat_turns_without_a_chat_template_are_refused_in_one_line(prompts, tmp_path):
    plain = make_tiny_causal_lm(tmp_path / "plain", chat_template=False)
    files = {"train": tmp_path / "train.jsonl", "validation": prompts["validation"]}
    files["train"].write_text("".join(json.dumps({"prompt": USER, "answer": "42"}) + "\n" for _ in range(8)))
    expected = "train record 0 has chat turns or tools, which only a chat template shows: use a tokenizer with a chat"
    refused_in_process("train_grpo", grpo_args(plain, files, tmp_path), expected)


@pytest.mark.fast
@pytest.mark.parametrize("family", ["llama", "minimax"])
def test_sampling_at_a_tiny_temperature_is_plain_greedy_generation_without_the_shared_cache(family, chat_lm, tmp_path):
    """The prompt's cache computed once and copied to its samples, and the positions of left-padded prompts,
    give what transformers' own greedy generation gives on the whole prompts. MiniMax keeps a cache class of its
    own, which refused the one GRPO built, and which counts no token where its first layer is a linear one: its
    samples are drawn by reading the prompts again."""
    from accelerate import Accelerator
    from model_families import MINIMAX, save_with_tokenizer
    from transformers import AutoModelForCausalLM

    from ddp_utils.language_models.causal_lm import load_tokenizer

    accelerator, tokenizer = Accelerator(cpu=True), load_tokenizer(str(chat_lm))
    path = chat_lm if family == "llama" else save_with_tokenizer(MINIMAX, chat_lm, tmp_path / family)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    texts = ["the movie was good", "a film is not bad really quite", "okay"]
    batch = PromptCollator(tokenizer.pad_token_id)(
        [{"input_ids": tokenizer(t)["input_ids"], "index": i} for i, t in enumerate(texts)]
    )
    args = Namespace(num_generations=2, max_completion_length=6, seed=0, temperature=1e-4, top_p=1.0)
    sampled = sample_completions(accelerator, model, batch, tokenizer, args, step=0)
    with torch.no_grad():
        greedy = model.generate(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], do_sample=False, max_new_tokens=6,
            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        )[:, batch["input_ids"].shape[1] :]  # fmt: skip
    for row in range(len(texts) * 2):
        length = int(sampled["completion_mask"][row].sum())
        assert sampled["completion_ids"][row, :length].tolist() == greedy[row // 2, :length].tolist(), row
