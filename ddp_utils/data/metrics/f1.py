"""F1 score, macro-averaged over classes by default. A local `evaluate` module (no Hub).

`average`: "macro" (unweighted mean over the classes present in references or predictions),
"micro", or "binary" (F1 of `pos_label`). A class with no true and no predicted example is
left out of the macro mean; one with a zero denominator scores 0, as scikit-learn does.
"""

import datasets
import evaluate
import numpy as np


class F1(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description="F1 = 2 * precision * recall / (precision + recall).",
            citation="",
            inputs_description="predictions, references: integer class ids; average: macro | micro | binary",
            features=datasets.Features({"predictions": datasets.Value("int64"), "references": datasets.Value("int64")}),
        )

    def _compute(self, predictions, references, average="macro", pos_label=1):
        if average not in ("macro", "micro", "binary"):
            raise ValueError(f"average must be 'macro', 'micro' or 'binary', not {average!r}")
        predictions, references = np.asarray(predictions), np.asarray(references)
        if average == "micro":  # single-label: micro F1 equals accuracy
            return {"f1": float((predictions == references).mean()) if len(references) else 0.0}
        classes = [pos_label] if average == "binary" else np.union1d(predictions, references)
        scores = []
        for label in classes:
            true_pos = np.sum((predictions == label) & (references == label))
            denominator = np.sum(predictions == label) + np.sum(references == label)
            scores.append(2.0 * true_pos / denominator if denominator else 0.0)
        return {"f1": float(np.mean(scores)) if scores else 0.0}
