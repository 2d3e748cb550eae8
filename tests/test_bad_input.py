"""Bad input: a clear error naming the problem and the fix, on every rank, a non-zero exit of the
whole launch within 60 s, and no output directory left behind."""

import os

import pytest

from conftest import REPO, assert_fails_cleanly, launch, refused_in_process, train_args, write_examples

TRAIN = REPO / "scripts" / "train.py"


def header_only(path):
    path.write_text("text,label\n")
    return path


def empty(path):
    path.write_text("")
    return path


def garbage_json(path):
    path.write_text('{"text": "unterminated\n')
    return path


# name -> (how to change the arguments, words the error must contain)
CASES = {
    "missing_text_column": (lambda a, d, m: a + ["--text_column", "review"], "has no column 'review'"),
    "missing_label_column": (lambda a, d, m: a + ["--label_column", "rating"], "has no column 'rating'"),
    "empty_training_file": (lambda a, d, m: swap(a, "--train_file", empty(d / "train.csv")), "is empty"),
    "training_file_without_rows": (
        lambda a, d, m: swap(a, "--train_file", header_only(d / "train.csv")),
        "holds no examples",
    ),
    "missing_file": (lambda a, d, m: swap(a, "--train_file", d / "nope.csv"), "does not exist"),
    "unparsable_file": (lambda a, d, m: swap(a, "--train_file", garbage_json(d / "train.json")), "could not be parsed"),
    "unseen_validation_label": (
        lambda a, d, m: swap(
            a,
            "--validation_file",
            write_examples(d / "val.csv", 9, seed=3, labels=("positive", "neutral", "sarcastic")),
        ),
        "['sarcastic'] never occur in the training data",
    ),
    "model_path_missing": (
        lambda a, d, m: swap(a, "--model_name_or_path", d / "no-such-model"),
        "neither a local model directory",
    ),
    "max_length_too_long": (lambda a, d, m: swap(a, "--max_length", 100), "above this model's limit of 64"),
    # Refused while parsing the options, before the ranks have met: every rank must still report it.
    "unknown_option": (  # a Trainer user's option: argparse's own error becomes the one line too
        lambda a, d, m: a + ["--evaluation_strategy", "steps"],
        "unrecognized arguments: --evaluation_strategy steps (--evaluation_strategy: every epoch ends with an "
        "evaluation; --eval_steps N adds one every N optimizer steps); train.py --help lists the options",
    ),
    "unknown_tracker": (
        lambda a, d, m: a + ["--report_to", "neptune"],
        "--report_to 'neptune' is not a tracker this project supports",
    ),
}


def swap(args, flag, value):
    args = list(args)
    args[args.index(flag) + 1] = value
    return args


# Launched: refused while parsing, before the ranks have met; and by the main process's data check.
LAUNCHED = ("unknown_option", "missing_text_column")


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_fails_fast_on_every_rank(case, tiny_model, tiny_data, tmp_path):
    change, expected = CASES[case]
    output_dir = tmp_path / "out"
    args = change(train_args(tiny_model, tiny_data, output_dir, "--max_train_steps", 2), tmp_path, tiny_model)
    if case not in LAUNCHED:
        return refused_in_process("train", args, expected)
    result = launch(TRAIN, *args, num_processes=2, timeout=120, real_launcher=True)
    assert_fails_cleanly(result, expected, output_dir)


@pytest.mark.fast
def test_output_dir_of_another_run_is_refused_and_left_alone(tiny_model, tiny_data, tmp_path):
    output_dir = tmp_path / "previous-run"
    output_dir.mkdir()
    (output_dir / "metrics.json").write_text('{"eval_accuracy": 0.9}')
    result = launch(
        TRAIN, *train_args(tiny_model, tiny_data, output_dir, "--max_train_steps", 2), num_processes=2, timeout=120
    )
    assert result.returncode != 0 and result.seconds < 60
    for rank in (0, 1):
        assert f"[rank {rank}] error:" in result.output
    assert "already holds files from another run; pass --overwrite_output_dir" in result.output
    assert (
        os.listdir(output_dir) == ["metrics.json"]
        and (output_dir / "metrics.json").read_text() == '{"eval_accuracy": 0.9}'
    )
    # Resumed from another directory's checkpoint, the run would have set that run's later checkpoints aside
    other = tmp_path / "other-run" / "checkpoint-2"
    other.mkdir(parents=True)
    args = train_args(tiny_model, tiny_data, output_dir, "--max_train_steps", 2, "--resume_from_checkpoint", other)
    result = launch(TRAIN, *args, num_processes=2, timeout=120)
    assert result.returncode != 0 and result.seconds < 60
    for rank in (0, 1):
        assert f"[rank {rank}] error:" in result.output
    assert f"and --resume_from_checkpoint '{other}' lies outside it" in result.output
    assert os.listdir(output_dir) == ["metrics.json"]
