"""Macro-averaged F1 as a local `evaluate` module: `evaluate.load(<this file's folder>)` works offline."""

import datasets
import evaluate


class F1(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description="F1 per class (harmonic mean of precision and recall), averaged over classes (macro).",
            citation="",
            inputs_description="predictions: list of int; references: list of int",
            features=datasets.Features({"predictions": datasets.Value("int64"), "references": datasets.Value("int64")}),
        )

    def _compute(self, predictions, references):
        if not references:
            raise ValueError("f1 needs at least one reference")
        labels = sorted(set(references) | set(predictions))
        scores = []
        for label in labels:
            tp = sum(1 for p, r in zip(predictions, references) if p == r == label)
            fp = sum(1 for p, r in zip(predictions, references) if p == label != r)
            fn = sum(1 for p, r in zip(predictions, references) if r == label != p)
            scores.append(2 * tp / (2 * tp + fp + fn) if tp else 0.0)
        return {"f1": sum(scores) / len(scores)}
