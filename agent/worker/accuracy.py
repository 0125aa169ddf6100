"""The accuracy gate of a job: an engine's outputs against the goldens, judged by the job's
``gate`` (Polygraphy comparator, plus top-1 agreement and label accuracy for classifiers).
Pure logic on arrays already in memory; reading goldens and running engines is the job's.

Worker side: Python >= 3.6. numpy and the comparator are imported inside the functions.
"""

from typing import Any, Dict, List, Optional

from agent.errors import AgentError

# A model may have tens of thousands of outputs: the report names at most this many (the failed
# ones first, then the least accurate), with the count of the rest, so the worker's result or
# error line stays small whatever the model.
MAX_OUTPUTS_LISTED = 32


def _concat_outputs(iterations: List[Dict[str, Any]], name: str) -> Any:
    import numpy as np

    return np.concatenate([np.asarray(it[name]).reshape(-1, np.shape(it[name])[-1])
                           for it in iterations], axis=0)


def _is_classifier_output(array: Any) -> bool:
    return getattr(array, "ndim", 0) >= 2 and array.shape[-1] > 1


def accuracy_report(
    outputs: List[Dict[str, Any]],
    goldens: List[Dict[str, Any]],
    gate: Dict[str, Any],
    labels: Optional[Any] = None,
) -> Dict[str, Any]:
    """Compare ``outputs`` with ``goldens`` under the job's gate; the summary the job status
    carries (worst values over outputs and iterations) plus the comparator's full report."""
    from agent.precision.compare import compare_outputs
    from agent.precision.metrics import top1_agreement

    cmp = compare_outputs(outputs, goldens, atol=gate.get("atol"), rtol=gate.get("rtol"),
                          check_error_stat=gate.get("check_error_stat"),
                          error_quantile=gate.get("error_quantile"))
    results = cmp.to_dict()["results"]

    def worst(key: str, sub: str) -> Optional[float]:
        values = [r[key].get(sub) for r in results if r.get(key) and r[key].get(sub)
                  is not None]
        return max(values) if values else None

    def lowest(key: str) -> Optional[float]:
        values = [r.get(key) for r in results if r.get(key) is not None]
        return min(values) if values else None

    failed = cmp.failed_outputs()
    per_output = cmp.to_dict()["outputs"]
    report: Dict[str, Any] = {
        "passed": cmp.passed,
        "comparator_passed": cmp.passed,
        "failed_outputs": failed[:MAX_OUTPUTS_LISTED],
        "failed_output_count": len(failed),
        "max_abs_error": worst("absdiff", "max"),
        "max_rel_error": worst("reldiff", "max"),
        "mean_abs_error": worst("absdiff", "mean"),
        "sqnr_db": lowest("sqnr_db"),
        "cosine": lowest("cosine"),
        "top1_agreement": None,
        "iterations": cmp.iterations,
        "outputs": _listed_outputs(per_output, failed),
        "output_count": len(per_output),
    }
    first = goldens[0]
    classifier = [n for n in first if _is_classifier_output(first[n])]
    if classifier:
        name = classifier[0]
        out = _concat_outputs(outputs, name)
        gold = _concat_outputs(goldens, name)
        report["top1_output"] = name
        report["top1_agreement"] = top1_agreement(out, gold)
        if labels is not None:
            import numpy as np

            truth = np.asarray(labels).reshape(-1)
            if truth.shape[0] != out.shape[0]:
                raise AgentError("golden_mismatch", "labels hold {} entries; the goldens hold {} "
                                 "rows of {!r}".format(truth.shape[0], out.shape[0], name))
            report["label_accuracy"] = float(np.mean(np.argmax(out, axis=-1) == truth))
            report["golden_label_accuracy"] = float(np.mean(np.argmax(gold, axis=-1) == truth))
    min_top1 = gate.get("min_top1")
    if min_top1 is not None:
        if report["top1_agreement"] is None:
            raise AgentError("bad_argument", "gate.min_top1 needs a classifier output "
                             "([..., classes]); the goldens hold {}".format(
                                 {n: list(v.shape) for n, v in first.items()}))
        report["min_top1"] = float(min_top1)
        report["passed"] = report["passed"] and report["top1_agreement"] >= float(min_top1)
    return report


def _listed_outputs(per_output: Dict[str, Dict[str, Any]], failed: List[str]
                    ) -> Dict[str, Dict[str, Any]]:
    """At most MAX_OUTPUTS_LISTED outputs' figures: the failed ones first, then the lowest SQNR."""
    if len(per_output) <= MAX_OUTPUTS_LISTED:
        return per_output

    def sqnr(name: str) -> float:
        value = per_output[name].get("sqnr_db")
        return value if isinstance(value, (int, float)) else float("inf")

    first = failed[:MAX_OUTPUTS_LISTED]
    chosen = set(first)
    rest = sorted((n for n in per_output if n not in chosen), key=sqnr)
    names = first + rest[:MAX_OUTPUTS_LISTED - len(first)]
    return {n: per_output[n] for n in names}


def _named(names: List[str], count: int, shown: int = 8) -> str:
    text = ", ".join(names[:shown])
    return text + (" and {:,} more".format(count - shown) if count > shown else "")


def gate_failure(report: Dict[str, Any]) -> AgentError:
    why = []
    if not report["comparator_passed"]:
        why.append("output(s) {} outside atol/rtol (max abs error {}, max rel error {})".format(
            _named(report["failed_outputs"], report.get("failed_output_count",
                                                        len(report["failed_outputs"]))),
            report["max_abs_error"], report["max_rel_error"]))
    if report.get("min_top1") is not None and report["top1_agreement"] < report["min_top1"]:
        why.append("top-1 agreement {:.4f} below the required {:.4f}".format(
            report["top1_agreement"], report["min_top1"]))
    return AgentError("accuracy_gate_failed", "the engine fails the accuracy gate: " +
                      "; ".join(why), {"accuracy": report})
