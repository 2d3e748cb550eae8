"""In-process checks of ddp_utils pieces that need no second process."""

import json
import os

import numpy as np
import pytest

import ddp_utils
from ddp_utils import SAMPLE_WEIGHT, UsageError


def test_pad_to_even_shards_adds_weightless_fillers():
    import datasets

    dataset = datasets.Dataset.from_dict({"x": list(range(37))})
    padded = ddp_utils.pad_to_even_shards(dataset, 8)
    assert len(padded) == 40
    assert padded[SAMPLE_WEIGHT] == [1.0] * 37 + [0.0] * 3
    assert padded["x"][37:] == [0, 1, 2]
    assert len(ddp_utils.pad_to_even_shards(dataset.select(range(32)), 8)) == 32


@pytest.mark.parametrize("seed", range(5))
def test_local_f1_and_accuracy_modules_match_scikit_learn(seed):
    from sklearn.metrics import accuracy_score, f1_score

    rng = np.random.default_rng(seed)
    predictions, references = rng.integers(0, 4, 200), rng.integers(0, 3, 200)
    f1 = ddp_utils.load_metric("f1")
    assert f1.compute(predictions=predictions, references=references)["f1"] == pytest.approx(f1_score(references, predictions, average="macro"))
    accuracy = ddp_utils.load_metric("accuracy").compute(predictions=predictions, references=references)["accuracy"]
    assert accuracy == pytest.approx(accuracy_score(references, predictions))


def test_check_output_dir(tmp_path):
    ddp_utils.check_output_dir(str(tmp_path / "new"), overwrite=False)
    ddp_utils.check_output_dir(str(tmp_path), overwrite=False)  # exists but empty: fine
    (tmp_path / "model.safetensors").write_text("x")
    with pytest.raises(UsageError, match="--overwrite_output_dir"):
        ddp_utils.check_output_dir(str(tmp_path), overwrite=False)
    ddp_utils.check_output_dir(str(tmp_path), overwrite=True)
    with pytest.raises(UsageError, match="is a file"):
        ddp_utils.check_output_dir(str(tmp_path / "model.safetensors"), overwrite=True)


def test_write_json_is_atomic_and_main_only(tmp_path):
    class Main:
        is_main_process = True

    class Other:
        is_main_process = False

    ddp_utils.write_json(Other(), str(tmp_path / "a.json"), {"x": 1})
    assert not (tmp_path / "a.json").exists()
    ddp_utils.write_json(Main(), str(tmp_path / "a.json"), {"x": 1})
    assert json.loads((tmp_path / "a.json").read_text()) == {"x": 1}
    assert os.listdir(tmp_path) == ["a.json"], "no temporary file may be left behind"


def test_demo_data_is_the_documented_subset():
    data = ddp_utils.demo.load_demo_reviews()
    assert (len(data["train"]), len(data["validation"])) == (600, 379)
    labels = list(data["validation"]["label"])
    assert sorted(set(labels)) == ["negative", "neutral", "positive"]
    assert round(labels.count("positive") / len(labels), 3) == 0.654, "the majority-class baseline the README quotes"
    assert "&#039;" not in " ".join(data["train"]["text"]), "HTML entities are decoded"
