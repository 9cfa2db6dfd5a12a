"""Release gates: thresholds from eval.gates evaluated on one format's measured numbers.

ppl/KL/top-1 gates compare a point estimate with the threshold. The drop gates compare fp16 and
compressed on the same task samples (paired): pass when the upper end of the 95% interval of the
drop is within the threshold, fail when its lower end is above it, otherwise "inconclusive". A
gate whose metric was not measured is "not measured" and takes no part in the verdict; the
verdict names the gates it rests on.
"""
from __future__ import annotations

from kvcompress.report_schema import GateResult

DROP_GATES = {"retrieval_drop": "retrieval", "exact_match_drop": "exact_copy"}


def evaluate_gate(g, quality: dict, tasks: dict | None) -> GateResult:
    if g.name in DROP_GATES:
        grp = (tasks or {}).get(DROP_GATES[g.name])
        if not grp:
            return GateResult(name=g.name, threshold=g.max, value=None, status="not measured")
        d = grp["drop"]
        status = "pass" if d["ci_high"] <= g.max else ("fail" if d["ci_low"] > g.max else "inconclusive")
        return GateResult(name=g.name, threshold=g.max, value=d["drop"], ci_low=d["ci_low"], ci_high=d["ci_high"], n=d["n"], status=status)
    v = 1.0 - quality["top1_agree"] if g.name == "top1_disagree" else quality[g.name]
    return GateResult(name=g.name, threshold=g.max, value=v, status="pass" if v <= g.max else "fail")


def evaluate_gates(gates, quality: dict, tasks: dict | None) -> tuple[list[GateResult], str, list[str]]:
    """(gate results, verdict, gates the verdict rests on). Verdict: fail > inconclusive > pass."""
    results = [evaluate_gate(g, quality, tasks) for g in gates]
    basis = [r.name for r in results if r.status != "not measured"]
    statuses = {r.status for r in results}
    verdict = "fail" if "fail" in statuses else ("inconclusive" if "inconclusive" in statuses else "pass")
    return results, verdict, basis
