"""Accuracy as a local `evaluate` module: `evaluate.load(<this file's folder>)` works offline."""

import datasets
import evaluate


class Accuracy(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description="Fraction of predictions equal to the references.",
            citation="",
            inputs_description="predictions: list of int; references: list of int",
            features=datasets.Features({"predictions": datasets.Value("int64"), "references": datasets.Value("int64")}),
        )

    def _compute(self, predictions, references):
        if not references:
            raise ValueError("accuracy needs at least one reference")
        correct = sum(int(p == r) for p, r in zip(predictions, references))
        return {"accuracy": correct / len(references)}
