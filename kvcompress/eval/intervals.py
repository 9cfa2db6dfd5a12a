"""Confidence intervals for task accuracies and paired drops (95%, z = 1.96).

* accuracy: Wilson score interval.
* paired drop (fp16 correct - compressed correct on the same samples): Agresti & Min (2005),
  "Simple improved confidence intervals for comparing matched proportions": add 0.5 to each cell
  of the 2x2 table, then a Wald interval on the difference of the discordant proportions.
"""
from __future__ import annotations

import math

Z = 1.96


def wilson(k: int, n: int) -> tuple[float, float]:
    if n == 0:
        return (0.0, 1.0)
    p = k / n
    den = 1 + Z * Z / n
    c = (p + Z * Z / (2 * n)) / den
    h = Z * math.sqrt(p * (1 - p) / n + Z * Z / (4 * n * n)) / den
    return (max(0.0, c - h), min(1.0, c + h))


def paired_drop(base: list[bool], comp: list[bool]) -> dict:
    """Drop = mean(base) - mean(comp) over paired samples, with the Agresti-Min interval."""
    n = len(base)
    b = sum(1 for x, y in zip(base, comp) if x and not y)  # fp16 right, compressed wrong
    c = sum(1 for x, y in zip(base, comp) if y and not x)  # compressed right, fp16 wrong
    b2, c2, n2 = b + 0.5, c + 0.5, n + 2.0
    d = (b2 - c2) / n2
    se = math.sqrt(max(0.0, (b2 + c2) - (b2 - c2) ** 2 / n2)) / n2
    return {"n": n, "drop": (b - c) / n if n else None, "ci_low": d - Z * se, "ci_high": d + Z * se, "discordant": [b, c]}
