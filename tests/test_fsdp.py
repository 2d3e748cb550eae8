"""FSDP2 as accelerate_configs/fsdp.yaml asks for it, on 2 CPU processes over gloo, every script
unchanged (tests/launched/fsdp_on_cpu.py: Accelerate's own FSDP2 path, turned on where it would
not turn it on itself; docs/design.md says what that changes). What users rely on:

- FSDP trains the same model as DDP, and as 1 process with accumulation, with dropout on (each
  micro-batch's masks drawn from its place in the global step): equal to 1e-6;
- a run killed while saving, or preempted by SIGTERM (exit 75), resumes bit for bit; a damaged
  shard is found by the manifest and `latest` falls back; a resume on 1 process reshards (DCP);
- the saved model reloads with `from_pretrained` and `pipeline`, a LoRA adapter with peft, and
  `--merge_lora`'s model without it; generation during evaluation answers every prompt;
- fp16's loss scaler (FSDP2 takes torch's plain GradScaler) skips the steps that overflow;
- only rank 0 reads the weights (`fsdp_cpu_ram_efficient_loading`), the others receive them.

The configs run in fp32 (`--mixed_precision no`) to compare with DDP exactly, except one DPO run,
which keeps fsdp.yaml's bf16, and the fp16 run."""

import json
import os
import shutil

import numpy as np
import pytest
import torch
from model_families import HYBRIDS, save_multimodal, tiny_model
from safetensors.numpy import load_file

from conftest import (
    AUDIT_HOOK_DIR,
    CPU_CONFIG,
    REPO,
    assert_generation_config_kept,
    dpo_args,
    launch,
    make_tiny_causal_lm,
    make_tiny_model,
    save_another_base,
    sft_args,
    train_args,
    with_instruct_generation_config,
    write_text_corpus,
)
from ddp_utils.checkpoints.preemption import PREEMPTED_FILE
from ddp_utils.core.errors import EXIT_PREEMPTED

FSDP_CONFIG = REPO / "accelerate_configs" / "fsdp.yaml"
ON_CPU = REPO / "tests" / "launched" / "fsdp_on_cpu.py"
HOOKS = {"PYTHONPATH": os.pathsep.join([str(AUDIT_HOOK_DIR), str(REPO)])}
ATOL = 1e-6  # FSDP against DDP: the same sums, reduced in another order (measured: 0.0 here)


def fsdp(script, *args, num_processes=2, precision="no", env=None, config=FSDP_CONFIG):
    """`accelerate launch --config_file accelerate_configs/fsdp.yaml` of scripts/<script>.py on CPU."""
    launcher = ["--config_file", config, "--num_processes", num_processes, "--mixed_precision", precision]
    return launch(ON_CPU, script, *args, launcher_args=[str(a) for a in launcher], env=env)


def ddp(script, *args, num_processes=2):
    launcher = ["--config_file", CPU_CONFIG, "--num_processes", num_processes]
    return launch(REPO / "scripts" / f"{script}.py", *args, launcher_args=[str(a) for a in launcher])


def ok(result):
    assert result.returncode == 0, result.output[-4000:]
    return result


def weights(output_dir, name="model.safetensors"):
    return load_file(str(output_dir / name))


def assert_close(output_dir, reference_dir, atol=ATOL, name="model.safetensors"):
    ours, reference = weights(output_dir, name), weights(reference_dir, name)
    assert sorted(ours) == sorted(reference)
    worst = max(float(np.abs(ours[key].astype(np.float64) - reference[key]).max()) for key in reference)
    assert worst <= atol, f"{output_dir.name} is {worst:.2e} from {reference_dir.name} (tolerance {atol})"


def assert_identical(output_dir, reference_dir):
    ours, reference = weights(output_dir), weights(reference_dir)
    different = [key for key in reference if not np.array_equal(ours[key], reference[key])]
    assert different == [], f"not bit for bit the uninterrupted run: {different[:5]}"


# --- scripts/train.py: a tiny BERT with dropout 0.1, 60 examples, a global batch of 8 -------------


@pytest.fixture(scope="module")
def dropout_bert(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("bert-dropout"), dropout=0.1)


def classifier(model, data, output_dir, *extra):
    return train_args(
        model, data, output_dir, "--max_train_steps", 6, "--seed", 7, "--report_to", "none", *extra
    )  # fmt: skip


TWO_BY_FOUR = ["--per_device_train_batch_size", 4]
ONE_BY_FOUR_BY_TWO = ["--per_device_train_batch_size", 4, "--gradient_accumulation_steps", 2]


@pytest.fixture(scope="module")
def fsdp_classifier(dropout_bert, tiny_data, tmp_path_factory):
    """train.py under FSDP on 2 processes, a checkpoint every 3 steps (at steps 3 and 6)."""
    output_dir = tmp_path_factory.mktemp("fsdp") / "run"
    ok(fsdp("train", *classifier(dropout_bert, tiny_data, output_dir, *TWO_BY_FOUR, "--checkpointing_steps", 3)))
    return output_dir


def test_fsdp_trains_what_one_process_with_accumulation_trains_with_dropout(
    fsdp_classifier, dropout_bert, tiny_data, tmp_path
):
    """The guarantee users read in the README, under the config they pick first for big models.
    Before the fixes: train.py crashed inside fully_shard (BERT's embeddings wrapped twice); with
    that fixed, rank 1 trained its new head's bias twice per step and never its weight; and each
    rank drew its own dropout masks (0.026 apart from 1 process after 6 steps)."""
    one = ok(ddp("train", *classifier(dropout_bert, tiny_data, tmp_path / "one", *ONE_BY_FOUR_BY_TWO), num_processes=1))
    assert "1 process(es), MULTI_CPU" in one.output
    metrics = json.loads((fsdp_classifier / "metrics.json").read_text())
    assert (metrics["distributed_type"], metrics["world_size"], metrics["optimizer_steps"]) == ("FSDP", 2, 6)
    assert_close(fsdp_classifier, tmp_path / "one")


def test_oom_backoff_keeps_each_micro_batchs_dropout_masks(fsdp_classifier, dropout_bert, tiny_data, tmp_path):
    """With --oom_backoff and no out-of-memory error, 1 process x 4 x 2 still trains what the FSDP
    run (equal to 1 process without the option) trains: before, the back-off read every micro-batch
    ahead, so all of them drew from the last one's seed."""
    args = classifier(dropout_bert, tiny_data, tmp_path / "backoff", *ONE_BY_FOUR_BY_TWO, "--oom_backoff")
    ok(ddp("train", *args, num_processes=1))
    assert_close(tmp_path / "backoff", fsdp_classifier)


def test_fsdp_trains_what_ddp_trains_and_the_model_reloads(fsdp_classifier, dropout_bert, tiny_data, tmp_path):
    from transformers import AutoModelForSequenceClassification, pipeline

    ok(ddp("train", *classifier(dropout_bert, tiny_data, tmp_path / "ddp", *TWO_BY_FOUR)))
    assert_close(fsdp_classifier, tmp_path / "ddp")
    model = AutoModelForSequenceClassification.from_pretrained(fsdp_classifier)
    saved = weights(fsdp_classifier)
    assert torch.equal(model.classifier.weight, torch.from_numpy(saved["classifier.weight"]))
    classify = pipeline("text-classification", model=str(fsdp_classifier), device="cpu")
    assert classify("a great film")[0]["label"] in {"negative", "neutral", "positive"}


def test_fsdp_checkpoints_resume_bit_for_bit_after_a_kill_and_a_damaged_shard(
    fsdp_classifier, dropout_bert, tiny_data, tmp_path
):
    """SIGKILL while the checkpoint of step 6 is written: checkpoint-3 (sharded: every rank's
    .distcp files, in the manifest) is the newest whole one, and the resumed run ends bit for bit
    where the uninterrupted one did. Then a copy of the uninterrupted run with one of rank 1's
    shards of checkpoint-6 damaged (same size): `latest` finds it and falls back to checkpoint-3."""
    run = tmp_path / "killed"
    args = classifier(dropout_bert, tiny_data, run, *TWO_BY_FOUR, "--checkpointing_steps", 3)
    killed = fsdp("train", *args, env={**HOOKS, "CRASH_ON_WRITE": ".tmp-checkpoint-6/"})
    assert killed.returncode != 0 and not (run / "checkpoint-6").exists()
    manifest = json.loads((run / "checkpoint-3" / "manifest.json").read_text())["files"]
    for rank in (0, 1):
        assert f"pytorch_model_fsdp_0/__{rank}_0.distcp" in manifest and f"optimizer_0/__{rank}_0.distcp" in manifest
    ok(fsdp("train", *args, "--resume_from_checkpoint", "latest"))
    assert_identical(run, fsdp_classifier)

    damaged = tmp_path / "damaged"
    shutil.copytree(fsdp_classifier, damaged)
    (damaged / "model.safetensors").unlink()
    shard = damaged / "checkpoint-6" / "pytorch_model_fsdp_0" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[-100:] = bytes(100)  # the end of rank 1's shard: its weights
    shard.write_bytes(bytes(data))
    args = classifier(dropout_bert, tiny_data, damaged, *TWO_BY_FOUR, "--checkpointing_steps", 3)
    resumed = ok(fsdp("train", *args, "--resume_from_checkpoint", "latest"))
    assert "checkpoint-6' is damaged" in resumed.output and "skipped, an older one is used" in resumed.output
    assert_identical(damaged, fsdp_classifier)


def test_a_two_process_fsdp_checkpoint_resumes_on_one_process(fsdp_classifier, dropout_bert, tiny_data, tmp_path):
    """Elastic resume with DCP resharding: checkpoint-3 of 2 processes x 4 continued on 1 process x
    4 x 2 (the same global batch and micro-batches, so the same dropout masks)."""
    run = tmp_path / "one"
    run.mkdir()
    shutil.copytree(fsdp_classifier / "checkpoint-3", run / "checkpoint-3")
    args = classifier(dropout_bert, tiny_data, run, *ONE_BY_FOUR_BY_TWO, "--checkpointing_steps", 3)
    resumed = ok(fsdp("train", *args, "--resume_from_checkpoint", "latest", num_processes=1))
    assert "resumed elastically from 2 processes x 4 x 1 onto 1 process x 4 x 2" in resumed.output
    assert "dropout masks" not in resumed.output
    assert_close(run, fsdp_classifier)


def test_sigterm_under_fsdp_saves_together_exits_75_and_resumes_exactly(
    fsdp_classifier, dropout_bert, tiny_data, tmp_path
):
    run = tmp_path / "preempted"
    args = classifier(dropout_bert, tiny_data, run, *TWO_BY_FOUR, "--checkpointing_steps", 3)
    preempt = {**HOOKS, "SIGTERM_ON_WRITE": ".tmp-checkpoint-3/", "SIGTERM_TARGET": "workers"}
    stopped = fsdp("train", *args, env=preempt)
    assert stopped.returncode != 0
    assert stopped.output.count(f"exitcode  : {EXIT_PREEMPTED}") == 2, stopped.output[-3000:]
    assert os.path.basename(json.loads((run / PREEMPTED_FILE).read_text())["checkpoint"]) == "checkpoint-4"
    ok(fsdp("train", *args, "--resume_from_checkpoint", "latest"))
    assert_identical(run, fsdp_classifier)


def test_only_rank_0_reads_the_weights_and_the_others_receive_them(tiny_model, tmp_path):
    """fsdp.yaml's `fsdp_cpu_ram_efficient_loading`: transformers 5 read the whole checkpoint on
    every rank. Now rank 1 holds no weight before `prepare`, in rank 0's dtypes (here bf16, as the
    checkpoint), each parameter is in its optimizer once (meta parameters all had address 0), and
    the gathered weights are the checkpoint's, with rank 0's new head."""
    from transformers import BertModel

    checkpoint = tmp_path / "bf16"  # a base model: the classifier's head is new, missing from the checkpoint
    BertModel.from_pretrained(tiny_model).to(torch.bfloat16).save_pretrained(checkpoint)
    report = tmp_path / "loading.json"
    ok(fsdp(REPO / "tests" / "launched" / "fsdp_loading.py", checkpoint, report))  # a model class, not an Auto one
    rank0, rank1 = (json.loads(report.with_name(f"loading.json.rank{r}").read_text()) for r in (0, 1))
    assert all(rank0["loaded_before_prepare"].values())
    assert not any(rank1["loaded_before_prepare"].values()), "rank 1 read no weights"
    assert rank1["dtypes"] == rank0["dtypes"] and set(rank0["dtypes"].values()) == {"torch.bfloat16"}
    for seen in (rank0, rank1):
        assert seen["distinct_optimizer_parameters"] == seen["optimizer_parameters"] == seen["model_parameters"]
    assert sorted(rank0["full"]) == sorted(rank0["before"])
    different = [name for name, value in rank0["before"].items() if rank0["full"][name] != value]
    assert different == [], f"the shards do not hold rank 0's weights: {different[:5]}"


def test_fp16_under_fsdp_skips_the_steps_that_overflow_with_fsdp2s_loss_scaler(dropout_bert, tiny_data, tmp_path):
    """fp16 as on a GPU (tests/launched/fp16_scaler.py: autocast and torch's GradScaler, which is
    what Accelerate gives FSDP2): the first scale, 2**40, overflows and is divided by 32 until it
    settles at 2**15, as under DDP; the overflowed steps are skipped and the run goes on."""
    scaler = {"FP16_INIT_SCALE": str(2.0**40), "FP16_BACKOFF_FACTOR": str(1 / 32)}
    args = train_args(
        dropout_bert, tiny_data, tmp_path / "fp16", "--max_train_steps", 40, "--num_train_epochs", 6,
        "--lr_scheduler_type", "constant", "--logging_steps", 10, "--report_to", "none", *TWO_BY_FOUR,
    )  # fmt: skip
    ok(fsdp(REPO / "tests" / "launched" / "fp16_scaler.py", "train", *args, precision="fp16", env=scaler))
    metrics = json.loads((tmp_path / "fp16" / "metrics.json").read_text())
    assert (metrics["distributed_type"], metrics["mixed_precision"]) == ("FSDP", "fp16")
    assert metrics["optimizer_steps"] == 40 and metrics["optimizer_steps_skipped"] == 5
    records = [json.loads(line) for line in (tmp_path / "fp16" / "train_log.jsonl").read_text().splitlines()]
    assert {r["train/loss_scale"] for r in records if "train/loss_scale" in r} == {2.0**15}
    assert all(np.isfinite(w).all() for w in weights(tmp_path / "fp16").values())


# --- the LLM scripts: a tiny Llama --------------------------------------------------------------


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_tiny_causal_lm(tmp_path_factory.mktemp("llama"))


SFT_STEPS = ["--max_train_steps", 4, "--report_to", "none"]


def test_sft_with_lora_under_fsdp_trains_as_one_process_and_saves_what_reloads(llama, sft_data, tmp_path):
    """LoRA with its default dropout (0.05), generation during evaluation, the adapter and
    --merge_lora's full model (merged from the gathered weights on rank 0; it was refused), saved after checkpoints
    that leave the frozen base out: the merged model holds it, and its base's generation_config.json (a copy built
    from config.json had lost an instruct model's EOS ids and sampling defaults)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, pipeline

    instruct = with_instruct_generation_config(llama, tmp_path / "instruct")
    lora = ["--lora_r", 4, "--merge_lora", *SFT_STEPS, "--checkpointing_steps", 2]  # the saves after a checkpoint's
    sharded = ok(fsdp("train_sft", *sft_args(instruct, sft_data, tmp_path / "fsdp", *lora, *TWO_BY_TWO)))
    ok(ddp("train_sft", *sft_args(instruct, sft_data, tmp_path / "one", *lora, *ONE_BY_TWO_BY_TWO), num_processes=1))
    assert "2 process(es), FSDP" in sharded.output
    assert_close(tmp_path / "fsdp", tmp_path / "one", name="adapter_model.safetensors")
    predictions = [json.loads(line) for line in (tmp_path / "fsdp" / "predictions.jsonl").read_text().splitlines()]
    assert len(predictions) == 7, "every validation prompt answered once"

    ids = torch.tensor([[1, 27, 18, 40, 41, 42]])
    with torch.no_grad():
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "fsdp" / "merged").eval()(input_ids=ids).logits
        adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(llama), tmp_path / "fsdp").eval()
        assert torch.allclose(merged, adapted(input_ids=ids).logits, atol=1e-4)
        base = AutoModelForCausalLM.from_pretrained(llama).eval()(input_ids=ids).logits
    assert not torch.allclose(merged, base, atol=1e-3), "the adapter learned something"
    assert_generation_config_kept(tmp_path / "fsdp" / "merged")
    generate = pipeline("text-generation", model=str(tmp_path / "fsdp" / "merged"), device="cpu")
    assert generate("good film", max_new_tokens=3, do_sample=False)[0]["generated_text"].startswith("good film")


TWO_BY_TWO = ["--per_device_train_batch_size", 2]
ONE_BY_TWO_BY_TWO = ["--per_device_train_batch_size", 2, "--gradient_accumulation_steps", 2]


# Other answers to `accelerate config`'s FSDP questions than accelerate_configs/fsdp.yaml's: the line each changes.
CONFIG_ANSWERS = {
    "activation checkpointing": ("fsdp_activation_checkpointing: false", "fsdp_activation_checkpointing: true"),
    # offloaded to host memory on a GPU; on CPU processes, where the activations are in host memory, not
    "and its offload": (
        "fsdp_activation_checkpointing: false",
        "fsdp_activation_checkpointing: true\n  fsdp_activation_checkpointing_offload: true",
    ),
    "no wrap": ("TRANSFORMER_BASED_WRAP", "NO_WRAP"),
    "no reshard after forward": ("fsdp_reshard_after_forward: true", "fsdp_reshard_after_forward: false"),
}


def fsdp_config_with(tmp_path, before: str, after: str):
    """accelerate_configs/fsdp.yaml with `before` (a line of it, or part of one) written as `after`."""
    config = FSDP_CONFIG.read_text()
    assert before in config
    (tmp_path / "fsdp_answered.yaml").write_text(config.replace(before, after))
    return tmp_path / "fsdp_answered.yaml"


def answered(tmp_path, answer):
    """accelerate_configs/fsdp.yaml with one of CONFIG_ANSWERS, as `accelerate config` writes it."""
    return fsdp_config_with(tmp_path, *CONFIG_ANSWERS[answer])


@pytest.mark.parametrize("answer", list(CONFIG_ANSWERS))
def test_other_answers_to_accelerate_config_train_the_same_model_bit_for_bit(
    answer, fsdp_classifier, dropout_bert, tiny_data, tmp_path
):
    """Before the fix, Accelerate's activation checkpointing recomputed each layer with other dropout masks than its
    forward pass drew: BERT (dropout 0.1) ended 0.031 from the run without it. transformers' checkpointing does it
    now. Each answer trains what fsdp.yaml trains, bit for bit (measured 0.0)."""
    args = classifier(dropout_bert, tiny_data, tmp_path / "run", *TWO_BY_FOUR, "--checkpointing_steps", 3)
    run = ok(fsdp("train", *args, config=answered(tmp_path, answer)))
    assert_identical(tmp_path / "run", fsdp_classifier)
    checkpointed = "fsdp_activation_checkpointing checkpoints each layer as --gradient_checkpointing does"
    assert (checkpointed in run.output) == ("checkpointing" in answer or "offload" in answer)


def test_the_configs_activation_checkpointing_saves_the_lora_adapter_that_plain_fsdp_saves(llama, sft_data, tmp_path):
    """Before the fix, Accelerate's checkpoint wrapper renamed the wrapped layers' weights, and a LoRA run saved an
    empty adapter and reported success. The same adapter as without it now, LoRA's dropout (0.05) on."""
    lora = ["--lora_r", 4, *SFT_STEPS]
    config = answered(tmp_path, "activation checkpointing")
    ok(fsdp("train_sft", *sft_args(llama, sft_data, tmp_path / "lora", *lora, *TWO_BY_TWO), config=config))
    ok(fsdp("train_sft", *sft_args(llama, sft_data, tmp_path / "plain", *lora, *TWO_BY_TWO)))
    assert len(weights(tmp_path / "lora", "adapter_model.safetensors")) == 28  # 7 projections x 2 layers x A, B
    assert_close(tmp_path / "lora", tmp_path / "plain", atol=0.0, name="adapter_model.safetensors")


def test_a_size_based_wrap_config_is_refused_in_one_line(dropout_bert, tiny_data, tmp_path):
    """`accelerate config` offers SIZE_BASED_WRAP. Under FSDP2 Accelerate's size policy picks the ModuleList that
    holds the layers, and torch's fully_shard refused it inside `prepare`, a traceback on each rank."""
    config = fsdp_config_with(tmp_path, "TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP\n  fsdp_min_num_params: 2000")
    result = fsdp("train", *classifier(dropout_bert, tiny_data, tmp_path / "run"), config=config)
    assert result.returncode != 0 and result.seconds < 60
    expected = "error: the launch config's fsdp_auto_wrap_policy SIZE_BASED_WRAP picks bert.encoder.layer (ModuleList"
    for rank in (0, 1):
        assert f"[rank {rank}] {expected}" in result.output, result.output[-3000:]
    assert "Traceback" not in result.output


def test_the_frozen_weights_digest_of_uneven_shards_is_the_digest_of_the_whole_model(tmp_path):
    """The digest that a resume matches the frozen base against is sampled from every rank's shard under FSDP and
    put together: on 3 processes, whose blocks of rows are unequal and one of them empty, it equals the digest of
    the same model whole on one process; so it does sharded by columns (gathered whole) and under HSDP (3 replicas:
    the same places from every rank, counted once)."""
    ok(launch(ON_CPU.parent / "frozen_digest_on_shards.py", tmp_path, num_processes=3))
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(3)]
    assert len(ranks) == 3 and all(rank["sharded"] == rank["whole"] == ranks[0]["whole"] for rank in ranks)
    assert sorted(rank["sharded_shards"]["3.weight"][0] for rank in ranks) == [0, 1, 1], "a rank holds no row"
    assert all(rank["by_columns"] == rank["hsdp"] == rank["whole"] for rank in ranks), "columns, and HSDP's replicas"
    assert all(rank["by_columns_shards"]["3.weight"] == [2, 1] for rank in ranks), "a column each"
    assert all(rank["hsdp_shards"]["0.weight"] == [101, 7] for rank in ranks), "every rank a whole replica"


@pytest.mark.parametrize("state_dict_type", ["SHARDED_STATE_DICT", "FULL_STATE_DICT"])
def test_a_lora_checkpoint_under_fsdp_holds_the_adapter_and_resumes_bit_for_bit_on_any_layout(
    state_dict_type, llama, sft_data, tmp_path
):
    """Each rank wrote its shard of every weight into each LoRA checkpoint, the frozen base included (for a 70B
    base in bf16, 140 GB a checkpoint). Now the trained weights only, as under DDP and
    DeepSpeed, with fsdp.yaml's sharded checkpoints and with whole ones: a run killed while it saved resumes bit
    for bit (LoRA's dropout on); its checkpoint resumes on 1 process (the frozen weights' digest, sampled from
    every rank's shards, the same on any layout); a resume on another base of the same shapes is refused on every
    rank in one line."""
    from torch.distributed.checkpoint import FileSystemReader

    config = fsdp_config_with(tmp_path, "SHARDED_STATE_DICT", state_dict_type)
    steps = ["--lora_r", 4, "--max_train_steps", 4, "--checkpointing_steps", 2, "--eval_max_new_tokens", 0,
             "--report_to", "none"]  # fmt: skip
    whole = tmp_path / "whole"
    ok(fsdp("train_sft", *sft_args(llama, sft_data, whole, *steps, *TWO_BY_TWO), config=config))
    if state_dict_type == "FULL_STATE_DICT":  # gathered to rank 0, which writes it
        names = sorted(torch.load(whole / "checkpoint-2" / "pytorch_model_fsdp.bin"))
    else:
        names = sorted(
            FileSystemReader(str(whole / "checkpoint-2" / "pytorch_model_fsdp_0")).read_metadata().state_dict_metadata
        )
    assert names and all(".lora_A." in name or ".lora_B." in name for name in names), names[:4]
    assert len(names) == 4 * 7, "each layer's 7 linear layers, A and B; none of the base's"

    killed = tmp_path / "killed"
    args = sft_args(llama, sft_data, killed, *steps, *TWO_BY_TWO)
    crashed = fsdp("train_sft", *args, env={**HOOKS, "CRASH_ON_WRITE": ".tmp-checkpoint-4/"}, config=config)
    assert crashed.returncode != 0 and not (killed / "checkpoint-4").exists()
    ok(fsdp("train_sft", *args, "--resume_from_checkpoint", "latest", config=config))
    ours, theirs = (weights(run, "adapter_model.safetensors") for run in (killed, whole))
    assert [key for key in theirs if not np.array_equal(ours[key], theirs[key])] == [], "not bit for bit"

    one = tmp_path / "one"
    shutil.copytree(whole / "checkpoint-2", one / "checkpoint-2")
    args = sft_args(llama, sft_data, one, *steps, *ONE_BY_TWO_BY_TWO, "--resume_from_checkpoint", "latest")
    resumed = ok(fsdp("train_sft", *args, num_processes=1, config=config))
    assert "resumed elastically from 2 processes x 2 x 1 onto 1 process x 2 x 2" in resumed.output
    assert_close(one, whole, name="adapter_model.safetensors")

    other = save_another_base(llama, tmp_path / "other-base")
    refused = tmp_path / "refused"
    shutil.copytree(whole / "checkpoint-2", refused / "checkpoint-2")
    args = sft_args(other, sft_data, refused, *steps, *TWO_BY_TWO, "--resume_from_checkpoint", "latest")
    run = fsdp("train_sft", *args, config=config)
    expected = "was trained on other frozen weights than this run's model has (another base model or dtype)"
    assert run.returncode != 0 and all(f"[rank {rank}] error: checkpoint" in run.output for rank in (0, 1))
    assert expected in run.output and not (refused / "checkpoint-4").exists()


def test_full_sft_and_raw_text_under_fsdp_train_what_ddp_trains(llama, sft_data, tmp_path):
    ok(fsdp("train_sft", *sft_args(llama, sft_data, tmp_path / "sft-fsdp", *SFT_STEPS, *TWO_BY_TWO)))
    ok(ddp("train_sft", *sft_args(llama, sft_data, tmp_path / "sft-ddp", *SFT_STEPS, *TWO_BY_TWO)))
    assert_close(tmp_path / "sft-fsdp", tmp_path / "sft-ddp")

    corpus = write_text_corpus(tmp_path / "corpus.txt")
    clm = [
        "--model_name_or_path", llama, "--train_file", corpus, "--validation_split_percentage", 20, "--block_size", 16,
        "--learning_rate", 1e-2, "--warmup_ratio", 0.0, "--checkpointing_steps", "no", "--report_to", "none",
        "--max_train_steps", 3, *TWO_BY_TWO, "--per_device_eval_batch_size", 2,
    ]  # fmt: skip
    sharded = ok(fsdp("train_clm", *clm, "--output_dir", tmp_path / "clm-fsdp"))
    ok(ddp("train_clm", *clm, "--output_dir", tmp_path / "clm-ddp"))
    assert_close(tmp_path / "clm-fsdp", tmp_path / "clm-ddp")
    ours, theirs = (json.loads((tmp_path / d / "metrics.json").read_text()) for d in ("clm-fsdp", "clm-ddp"))
    assert ours["eval_perplexity"] == pytest.approx(theirs["eval_perplexity"], rel=1e-5)
    assert "sample generation skipped: with sharded weights" in sharded.output


def test_gemma3_whole_with_its_tied_lm_head_trains_under_fsdp_what_ddp_trains(llama, sft_data, tmp_path):
    """Gemma 3's whole model (4B and up: a vision tower beside the language model, its LM head tied to the input
    embeddings, as in every Gemma, Llama 3.2 1B and 3B, Qwen2.5 up to 3B, SmolLM2) failed twice in `prepare`:
    Accelerate wraps each class of `_no_split_modules`, and Gemma 3's names SiglipTextEmbeddings, of a text tower
    it does not hold ("Could not find the transformer layer class"); then, on the rank that builds the model empty,
    the LM head had a weight of its own ("FSDP2 mapping failed (missing: ['lm_head.weight'])"). The saved model has
    DDP's names: the tied weight once, not gathered twice. Its checkpoints leave out the frozen vision tower, and a
    run resumed from one ends bit for bit where the uninterrupted one did."""
    from torch.distributed.checkpoint import FileSystemReader

    model = save_multimodal("gemma3", llama, tmp_path / "gemma3")
    every_2 = [*SFT_STEPS, *TWO_BY_TWO, "--checkpointing_steps", 2]
    ok(fsdp("train_sft", *sft_args(model, sft_data, tmp_path / "fsdp", *every_2)))
    ok(ddp("train_sft", *sft_args(model, sft_data, tmp_path / "ddp", *SFT_STEPS, *TWO_BY_TWO)))
    assert_close(tmp_path / "fsdp", tmp_path / "ddp")
    assert "lm_head.weight" not in weights(tmp_path / "fsdp")

    checkpoint = tmp_path / "fsdp" / "checkpoint-2"
    saved = FileSystemReader(str(checkpoint / "pytorch_model_fsdp_0")).read_metadata().state_dict_metadata
    assert saved and not [name for name in saved if ".vision_tower." in name or ".multi_modal_projector." in name]
    shutil.copytree(checkpoint, tmp_path / "resumed" / "checkpoint-2")
    ok(
        fsdp(
            "train_sft",
            *sft_args(model, sft_data, tmp_path / "resumed", *every_2, "--resume_from_checkpoint", "latest"),
        )
    )
    assert_identical(tmp_path / "resumed", tmp_path / "fsdp")


def test_lora_on_an_moe_with_fused_experts_under_fsdp_trains_what_ddp_trains(llama, sft_data, tmp_path):
    """peft adapts transformers 5's fused experts (Qwen3-MoE's 3-D parameters) through torch's parametrizations,
    which FSDP2 shards as DTensors: the adapters on the experts and the router train as under DDP."""
    from model_families import FUSED_MOE, save_with_tokenizer

    moe = save_with_tokenizer(FUSED_MOE, llama, tmp_path / "qwen3-moe")
    lora = ["--lora_r", 4, *SFT_STEPS, *TWO_BY_TWO]
    ok(fsdp("train_sft", *sft_args(moe, sft_data, tmp_path / "fsdp", *lora)))
    ok(ddp("train_sft", *sft_args(moe, sft_data, tmp_path / "ddp", *lora)))
    assert_close(tmp_path / "fsdp", tmp_path / "ddp", name="adapter_model.safetensors")  # measured 0.0
    assert [key for key in weights(tmp_path / "fsdp", "adapter_model.safetensors") if ".mlp.experts." in key]


def test_grpo_on_a_hybrid_under_fsdp_samples_and_trains_what_ddp_trains(llama, tmp_path):
    """GRPO with LoRA on Bamba (Mamba-2 layers beside attention), its zero-shot evaluation the first pass: before,
    `generate` entered the model below FSDP2's root, whose own weights (the final norm) stayed sharded ("aten.mul.Tensor
    got mixed torch.Tensor and DTensor")."""
    from test_grpo import grpo_args, write_prompts
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(llama)
    config_class, model_class, extra = HYBRIDS["bamba"]
    tiny_model(config_class, model_class, {**extra, "vocab_size": len(tokenizer)}).save_pretrained(tmp_path / "bamba")
    tokenizer.save_pretrained(tmp_path / "bamba")
    prompts = write_prompts(tmp_path)
    ok(fsdp("train_grpo", *grpo_args(tmp_path / "bamba", prompts, tmp_path / "fsdp", "--max_train_steps", 2)))
    ok(ddp("train_grpo", *grpo_args(tmp_path / "bamba", prompts, tmp_path / "ddp", "--max_train_steps", 2)))
    assert_close(tmp_path / "fsdp", tmp_path / "ddp", name="adapter_model.safetensors")  # measured 0.0


def test_dpo_under_fsdp_trains_what_ddp_trains_and_runs_in_the_configs_bf16(llama, pairs, tmp_path):
    """LoRA with the adapters off as the reference: the same adapter as DDP (fp32); with the reference precomputed
    too (it stopped at its first step: the frozen digest's read had fixed the size of a gathered weight's storage).
    Then a full fine-tune with the precomputed reference as fsdp.yaml ships it (bf16); both models reload."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    steps = ["--max_train_steps", 3, *TWO_BY_TWO]
    ok(fsdp("train_dpo", *dpo_args(llama, pairs, tmp_path / "lora", "--lora_r", 4, *steps)))
    ok(ddp("train_dpo", *dpo_args(llama, pairs, tmp_path / "lora-ddp", "--lora_r", 4, *steps)))
    assert_close(tmp_path / "lora", tmp_path / "lora-ddp", name="adapter_model.safetensors")
    PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(llama), tmp_path / "lora")
    # Its reference precomputed: the base's log-probs as the adapters off give them, summed in other batches.
    precomputed = dpo_args(llama, pairs, tmp_path / "lora-pre", "--lora_r", 4, "--precompute_reference", *steps)
    ok(fsdp("train_dpo", *precomputed))
    assert_close(tmp_path / "lora-pre", tmp_path / "lora-ddp", atol=1e-5, name="adapter_model.safetensors")
    full = dpo_args(llama, pairs, tmp_path / "full", "--precompute_reference", *steps)
    ok(fsdp("train_dpo", *full, precision="bf16"))
    metrics = json.loads((tmp_path / "full" / "metrics.json").read_text())
    assert (metrics["distributed_type"], metrics["mixed_precision"]) == ("FSDP", "bf16")
    assert 0.0 <= metrics["eval_reward_accuracy"] <= 1.0
    AutoModelForCausalLM.from_pretrained(tmp_path / "full")


def test_torch_compile_under_fsdp_compiles_each_layer_unbroken_and_trains_what_eager_trains(llama, tmp_path):
    """Compiled whole, FSDP2's hooks at every layer broke the graph (10 breaks, 11 graphs, 8 frames left uncompiled
    in these 3 steps); compiled by regions (compile_by_regions, in place after prepare), none. Dynamo's
    eager backend: the graphs and breaks inductor would get, nothing compiled. With --gradient_checkpointing (each
    layer's checkpoint inside its compiled region) and LoRA's default dropout, AOTAutograd (what inductor compiles)
    reuses the forward's dropout masks in the recomputation and trains what eager trains; dynamo's eager backend
    draws new ones (measured: 7.8e-4 apart), so that run uses aot_eager."""
    from conftest import write_text_corpus

    corpus = write_text_corpus(tmp_path / "train.txt")
    args = [
        "--model_name_or_path", llama, "--train_file", corpus, "--validation_file", corpus, "--block_size", 16,
        "--max_train_steps", 3, "--per_device_train_batch_size", 2, "--lora_r", 8, "--report_to", "none",
    ]  # fmt: skip
    compiling = {"TORCH_COMPILE_OVERRIDE_BACKENDS": ">=0:eager"}
    ok(fsdp("train_clm", *args, "--output_dir", tmp_path / "compiled", "--torch_compile", env=compiling))
    checkpointed = ["--output_dir", tmp_path / "checkpointed", "--torch_compile", "--gradient_checkpointing"]
    ok(fsdp("train_clm", *args, *checkpointed, env={"TORCH_COMPILE_OVERRIDE_BACKENDS": ">=0:aot_eager"}))
    ok(fsdp("train_clm", *args, "--output_dir", tmp_path / "eager"))
    for run in ("compiled", "checkpointed"):
        counted = json.loads((tmp_path / run / "metrics.json").read_text())
        assert (counted["graph_breaks"], counted["frames_left_eager"]) == (0, 0), run
        assert counted["compiled_graphs"] > 0
        assert_close(tmp_path / run, tmp_path / "eager", name="adapter_model.safetensors")


def test_a_model_compiled_layer_by_layer_generates_eagerly_and_stays_compiled(tmp_path, sft_data):
    """Each layer's cache update reads its own `layer_idx`, which dynamo specialises: generating through layers
    compiled one by one made each layer a variant, and a 20-layer Llama reached dynamo's recompile limit (16) in the
    zero-shot evaluation, its layer then running uncompiled in training too (frames_left_eager 1). Generation now
    runs eagerly there (`generation_context`)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    small = make_tiny_causal_lm(tmp_path / "small", chat_template=True)
    config = AutoConfig.from_pretrained(small)
    config.num_hidden_layers = 20  # more layers than dynamo's recompile limit (configure_compile: 16)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "deep")
    AutoTokenizer.from_pretrained(small).save_pretrained(tmp_path / "deep")
    steps = ["--max_train_steps", 3, "--per_device_train_batch_size", 2, "--lora_r", 8, "--torch_compile",
             "--eval_max_new_tokens", 4, "--report_to", "none"]  # fmt: skip
    run = ok(
        fsdp("train_sft", *sft_args(tmp_path / "deep", sft_data, tmp_path / "run", *steps),
             env={"TORCH_COMPILE_OVERRIDE_BACKENDS": ">=0:eager"})
    )  # fmt: skip
    counted = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert (counted["graph_breaks"], counted["frames_left_eager"]) == (0, 0)
    assert "recompile_limit" not in run.output
    assert (tmp_path / "run" / "predictions_zero_shot.jsonl").exists()  # the zero-shot evaluation generated


# --- scripts/train_image.py: a ResNet (BatchNorm: every rank reads it) ---------------------------


def test_image_classifier_with_batchnorm_under_fsdp_trains_what_ddp_trains(tmp_path):
    from test_image import image_args, make_tiny_resnet, write_image_folder

    model = make_tiny_resnet(tmp_path / "resnet")
    images = {
        "train": write_image_folder(tmp_path / "train", {"dark": 8, "bright": 8, "striped": 8}, seed=1),
        "validation": write_image_folder(tmp_path / "validation", {"dark": 3, "bright": 3, "striped": 3}, seed=2),
    }
    extra = ["--num_train_epochs", 1, "--per_device_train_batch_size", 4]
    sharded = ok(fsdp("train_image", *image_args(model, images, tmp_path / "fsdp", *extra)))
    ok(ddp("train_image", *image_args(model, images, tmp_path / "ddp", *extra)))
    assert "every rank read the weights" in sharded.output  # Accelerate cannot send BatchNorm's statistics
    assert_close(tmp_path / "fsdp", tmp_path / "ddp", atol=1e-5)
    # transformers cannot checkpoint a ResNet (Accelerate's wrapper would update BatchNorm's statistics twice a step)
    refused = fsdp("train_image", *image_args(model, images, tmp_path / "checkpointed", *extra),
                   config=answered(tmp_path, "activation checkpointing"))  # fmt: skip
    assert refused.returncode != 0 and refused.seconds < 60
    expected = "fsdp_activation_checkpointing: ResNetForImageClassification cannot recompute its activations in"
    for rank in (0, 1):
        assert f"[rank {rank}] error: the launch config's {expected}" in refused.output, refused.output[-3000:]


@pytest.mark.fast
def test_the_configs_activation_checkpointing_recomputes_each_layer_in_the_backward_pass(tmp_path):
    """What `fix_fsdp2_preparation` calls for fsdp_activation_checkpointing (with its offload, which a CPU has no
    use for) on a LoRA model: every decoder layer runs twice per step, the embeddings' grad hooks are gone, and
    the adapter's names are the model's own."""
    from accelerate import PartialState
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from ddp_utils.training.activation_checkpointing import checkpoint_for_fsdp

    PartialState(cpu=True)  # ddp_utils logs through Accelerate's logger
    model = AutoModelForCausalLM.from_pretrained(make_tiny_causal_lm(tmp_path / "llama"))
    model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    names = sorted(name for name, _ in model.named_parameters())
    calls = []
    for layer in model.get_base_model().model.layers:  # each layer's MLP counts its calls (the recomputation
        mlp_forward = layer.mlp.forward  # runs no module hooks again)

        def counted(*args, _forward=mlp_forward, **kwargs):
            calls.append(1)
            return _forward(*args, **kwargs)

        layer.mlp.forward = counted
    checkpoint_for_fsdp(model, offload=True)
    assert model.get_base_model().is_activation_checkpointing
    assert not getattr(model.get_base_model(), "_require_grads_hooks", None)  # non-reentrant: none needed
    model.train()
    model(input_ids=torch.tensor([[1, 5, 9, 13]]), labels=torch.tensor([[1, 5, 9, 13]])).loss.backward()
    assert len(calls) == 2 * len(model.get_base_model().model.layers)  # forward, then recomputed in backward
    assert sorted(name for name, _ in model.named_parameters()) == names


@pytest.mark.fast
def test_an_fsdp1_launch_config_is_warned_of_as_never_run(caplog):
    """A config from an older `accelerate config` leaves fsdp_version out, which is FSDP1. Its path in Accelerate does
    not run on CPU processes (measured: its plugin asks for a GPU; FSDP1 then refuses the CPU device), so nothing
    here has run it: said at the start, with the line that moves to FSDP2."""
    import logging
    from argparse import Namespace

    from accelerate import PartialState

    from ddp_utils.training.fsdp import fix_fsdp2_preparation

    PartialState(cpu=True)  # ddp_utils logs through Accelerate's logger
    expected = "this launch config runs FSDP1 (fsdp_version 1, the default where the config leaves it out)"
    fsdp2 = Namespace(fsdp_version=2, set_auto_wrap_policy=None, auto_wrap_policy=None)  # wrapped, no warning
    for plugin, warned in ((Namespace(fsdp_version=1), True), (Namespace(), True), (None, False), (fsdp2, False)):
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            fix_fsdp2_preparation(Namespace(state=Namespace(fsdp_plugin=plugin)))
        assert (expected in caplog.text) is warned, (plugin, caplog.text)
