"""Release gates: thresholds from eval.gates evaluated on the report's numbers."""
from __future__ import annotations

from kvcompress.report_schema import GateResult


def gate_value(name: str, quality: dict, tasks: dict | None) -> float | None:
    if name in ("ppl_delta_rel", "kl_mean", "kl_p99"):
        return quality[name]
    if name == "top1_disagree":
        return 1.0 - quality["top1_agree"]
    if tasks is None:
        return None
    pair = {"retrieval_drop": ("retrieval_fp16", "retrieval_compressed"), "exact_match_drop": ("exact_fp16", "exact_compressed")}[name]
    base, comp = tasks.get(pair[0]), tasks.get(pair[1])
    return None if base is None or comp is None else base - comp


def evaluate_gates(gates, quality: dict, tasks: dict | None) -> tuple[list[GateResult], str]:
    results = []
    for g in gates:
        v = gate_value(g.name, quality, tasks)
        results.append(GateResult(name=g.name, threshold=g.max, value=v, passed=v is not None and v <= g.max))
    return results, "pass" if all(r.passed for r in results) else "fail"
