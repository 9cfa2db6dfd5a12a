"""tune (kv=auto): the most compact per-layer cache format that stays within the release gates.

1. Tuning windows come from the calibration text (`calib`), never the held-out text validate uses.
2. Every menu format is fitted once (uniform ScaleBooks from the profiled statistics).
3. Per-layer sensitivity (kvcompress.eval.sensitivity): KL and perplexity change when only that
   layer is compressed with each menu format, from the one-pass evaluation.
4. Assignments: a Lagrangian sweep (bytes + lambda * KL, layer by layer) gives the convex hull
   of predicted (bytes, KL) under the additive model; the most compact ones predicted within
   the gates x margin are checked end to end on the tuning windows (all layers compressed at
   once), with the uniform menu formats beside them; the most compact that passes every
   measurable gate x margin wins.
5. Window and sink sizes (tune.windows x tune.sinks) are then checked end to end the same way.

kv.layers=split (kv=rot_split, the per-token family) asks a different question at fixed bytes: how
to split key.bits + value.bits between each layer's keys and values (KVSpec.split_formats; every
candidate takes the same bytes). Each layer takes the candidate of least KL in step 3; that
assignment and every uniform candidate are checked end to end on the tuning windows, and the
lowest measured KL wins (tune_split).

kv.layers=budget (kv=int8k_budget, the static family) asks the same at the bytes of the spec's own format: each
layer takes one of KVSpec.budget_formats (the spec's value groups, halved or doubled, or 8-bit values) and the
total stays within the uniform format's bytes per token at the tuning context. The most accurate point of the
convex hull of step 4 within those bytes, or the uniform format if that predicts less, with any bytes left spent
on the single-layer changes of most KL per byte (fill_budget), is checked end to end beside the uniform format, and
the lower measured KL wins (tune_budget). With sliding-window layers the bytes are held within the uniform format's
at every context up to the tuning one (budget_contexts).

The chosen spec is fitted (kvcompress.stages.fit) and written as the run's ScaleBook; the
search record (tune.json) goes into the report. validate then measures the chosen format on the
held-out windows and the report says whether it passed there.
"""
from __future__ import annotations

import logging
import math
import time

from kvcompress.config import NO_TUNE_GATE, TUNE_GATES, kv_preset
from kvcompress.data import load_texts, token_windows
from kvcompress.errors import UserError
from kvcompress.eval.sensitivity import layer_sensitivity
from kvcompress.scalebook import ScaleBook
from kvcompress.spec import KVSpec, LayerFormat, mixed_spec
from kvcompress.stages.fit import assemble, fit, uniform_spec
from kvcompress.stats import KVStats

log = logging.getLogger("kvcompress")
FP16 = LayerFormat(key_bits=16, value_bits=16)


def spec_bytes(spec: KVSpec, geom, context: int) -> float:
    """Per-sequence cache bytes per token at `context` (the report's accounting, static scales excluded)."""
    from kvcompress.stages.validate import memory_summary

    return memory_summary(spec, geom, context).bytes_per_token_compressed


def layer_bytes(spec: KVSpec, f: LayerFormat, geom, context: int, layer: int = 0) -> float:
    """Per-token cache bytes of one layer in format f (window and sinks amortised at `context`; a
    sliding-window layer holds at most its window)."""
    return spec_bytes(uniform_spec(spec, f), geom.layer(layer), context)


def hull(cost: list[list[float]], kl: list[list[float]]) -> list[tuple[int, ...]]:
    """Assignments (an option index per layer) on the lower convex hull of (sum cost, sum kl):
    for each lambda, every layer picks argmin cost + lambda * kl; lambda swept over every
    breakpoint. Ordered from the most compact to the most accurate."""
    L = len(cost)
    lams = {0.0, math.inf}
    for i in range(L):
        for a in range(len(cost[i])):
            for b in range(len(cost[i])):
                dk = kl[i][a] - kl[i][b]
                if dk > 0 and cost[i][b] > cost[i][a]:
                    lams.add((cost[i][b] - cost[i][a]) / dk)
    cuts = sorted(lams)
    probes = [0.0] + [(a + b) / 2 for a, b in zip(cuts, cuts[1:]) if math.isfinite(b)] + [cuts[-2] * 2 + 1 if len(cuts) > 1 else 1.0]
    out: list[tuple[int, ...]] = []
    for lam in probes:
        pick = tuple(min(range(len(cost[i])), key=lambda o: (cost[i][o] + lam * kl[i][o], kl[i][o])) for i in range(L))
        if pick not in out:
            out.append(pick)
    return out


def gate_limits(gates, margin: float) -> dict[str, float]:
    """{metric: margin * max} for the gates the tuning windows can measure."""
    return {g.name: margin * g.max for g in gates if g.name in TUNE_GATES}


def gate_values(q: dict) -> dict[str, float]:
    return {"ppl_delta_rel": q["ppl_delta_rel"], "kl_mean": q["kl_mean"], "kl_p99": q["kl_p99"], "top1_disagree": 1.0 - q["top1_agree"]}


def passes(q: dict, limits: dict[str, float]) -> bool:
    v = gate_values(q)
    return all(v[k] <= lim for k, lim in limits.items())


def _measure(lm, books: dict[str, ScaleBook], windows, progress: bool) -> dict[str, dict]:
    from kvcompress.stages.validate import evaluate_quality

    res, _ = evaluate_quality(lm, books, windows, 1, progress=progress)
    return {n: q for n, (q, _e) in res.items()}


def _point(name: str, kind: str, spec: KVSpec, geom, context: int, fp16_bpt: float, q: dict | None, limits, predicted=None) -> dict:
    from kvcompress.stages.validate import memory_summary

    m = memory_summary(spec, geom, context)
    bpt = m.bytes_per_token_compressed
    p = {"name": name, "kind": kind, "bytes_per_token": bpt, "bits_per_element": m.bits_per_element, "vs_fp16": fp16_bpt / bpt,
         "window": spec.window, "sink_tokens": spec.sink_tokens,
         "layers": [f.label for f in spec.layer_formats(geom.n_layers)]}
    if predicted is not None:
        p["predicted"] = predicted
    if q is not None:
        p["measured"] = {**gate_values(q), "ppl_delta_rel": q["ppl_delta_rel"], "top1_agree": q["top1_agree"]}
        p["passes"] = passes(q, limits)
    return p


def _windows(lm, cfg, calib_cfg):
    texts = load_texts(calib_cfg)
    return texts, token_windows(lm.tokenizer, texts, cfg.n_windows, cfg.seq_len, seed=cfg.seed)


def _record(mode: str, objective: str, cfg, eval_cfg, limits, texts, windows, context: int, menu, sens, final: KVSpec, chosen_name,
            geom, times: tuple[float, float]) -> dict:
    """The fields of the search record (tune.json) both modes share."""
    t_sens, t0 = times
    bpt = spec_bytes(final, geom, context)
    return {
        "mode": mode,
        "objective": objective,
        "context": context,
        "margin": cfg.margin,
        "limits": limits,
        "gates_not_tuned": [g.name for g in eval_cfg.gates if g.name not in TUNE_GATES],
        "tuning_text": {"origin": texts.origin, "sha256": texts.sha256, "n_windows": int(windows.shape[0]), "seq_len": int(windows.shape[1]), "seed": cfg.seed},
        "sensitivity": {f.label: [{"kl_mean": r["kl_mean"], "ppl_delta_rel": r["ppl_delta_rel"]} for r in sens[f.label]] for f in menu},
        "chosen": {"name": chosen_name, "layers": [f.label for f in final.layers], "window": final.window, "sink_tokens": final.sink_tokens,
                   "bytes_per_token": bpt, "vs_int8k_int4v": bpt / spec_bytes(kv_preset("int8k_int4v"), geom, context)},
        "native_fallback": "native_int8 (trtllm_ckpt: TensorRT-LLM's INT8 KV cache; no native format holds per-layer formats)",
        "times_s": {"sensitivity": round(t_sens, 1), "total": round(time.time() - t0, 1)},
    }


def _start(lm, cfg, eval_cfg) -> tuple[float, object, int, int, dict[str, float]]:
    """Every search's setting: (start time, geometry, layers, the byte-accounting context, gates x margin)."""
    geom = lm.geometry
    return time.time(), geom, geom.n_layers, cfg.context or geom.max_position, gate_limits(eval_cfg.gates, cfg.margin)


def _predicted(sens: dict, formats) -> dict:
    """The additive model's KL and compounded perplexity change of one format per layer (sensitivity of each alone)."""
    return {"kl_mean": sum(sens[f.label][i]["kl_mean"] for i, f in enumerate(formats)),
            "ppl_delta_rel": math.expm1(sum(math.log1p(sens[f.label][i]["ppl_delta_rel"]) for i, f in enumerate(formats)))}


def _lowest_measured(lm, stats: KVStats, spec: KVSpec, specs: dict[str, KVSpec], uniform: dict, pred: dict, windows, context: int,
                     limits, progress: bool) -> tuple[ScaleBook, KVSpec, list[dict], dict]:
    """The fixed-bytes searches' last step: `specs` (the searched assignment, the only name without a "uniform:" prefix,
    and uniform formats) measured end to end on the tuning windows; the lowest KL wins, a tie going to the searched one.
    Returns (the winner fitted as `spec.name`, its spec, the points, the winning point)."""
    geom = lm.geometry
    fp16_bpt = spec_bytes(uniform_spec(spec, FP16), geom, context)
    measured = _measure(lm, {n: (assemble(s, uniform) if s.is_mixed else uniform[s.layer_formats(1)[0]]) for n, s in specs.items()}, windows, progress)
    points = [_point(n, "uniform" if n.startswith("uniform:") else "searched", s, geom, context, fp16_bpt, measured[n], limits,
                     None if n.startswith("uniform:") else pred) for n, s in specs.items()]
    best = min(points, key=lambda p: (p["measured"]["kl_mean"], p["kind"] != "searched"))
    for p in points:
        p["chosen"] = p is best
    final = mixed_spec(spec, specs[best["name"]].layer_formats(geom.n_layers), name=spec.name)
    return fit(stats, final), final, points, best


def tune_split(lm, stats: KVStats, spec: KVSpec, cfg, eval_cfg, calib_cfg, progress: bool = True) -> tuple[ScaleBook, dict]:
    """kv.layers=split: (ScaleBook of the chosen per-layer split, the search record); see the module doc."""
    t0, geom, L, context, limits = _start(lm, cfg, eval_cfg)
    menu = list(spec.split_formats())
    for f in menu:
        uniform_spec(spec, f).check_geometry(geom.head_dim)
    texts, windows = _windows(lm, cfg, calib_cfg)
    log.info("tune: the key/value split of %d bits per element, %d candidates x %d layers on %d x %d calibration tokens",
             spec.key.bits + spec.value.bits, len(menu), L, *windows.shape)
    uniform = {f: fit(stats, uniform_spec(spec, f)) for f in menu}
    t_sens = time.time()
    sens = layer_sensitivity(lm, windows, {f.label: b for f, b in uniform.items()}, progress)
    t_sens = time.time() - t_sens
    pick = [min(menu, key=lambda f: sens[f.label][i]["kl_mean"]) for i in range(L)]
    specs = {"split": mixed_spec(spec, pick, name="split")} | {f"uniform:{f.label}": uniform_spec(spec, f) for f in menu}
    book, final, points, best = _lowest_measured(lm, stats, spec, specs, uniform, _predicted(sens, pick), windows, context, limits, progress)
    record = _record("split", (f"Objective: the lowest KL at the same bytes: each layer splits {spec.key.bits + spec.value.bits} bits per element "
                               "between its keys and values; the per-layer picks of least sensitivity KL and every uniform split are measured end to end."),
                     cfg, eval_cfg, limits, texts, windows, context, menu, sens, final, best["name"], geom, (t_sens, t0))
    record |= {"menu": [f.label for f in menu], "layer_bytes_per_token": {f.label: [layer_bytes(spec, f, geom, context, i) for i in range(L)] for f in menu},
               "points": points}
    log.info("tune: chose %s (KL %.3e on the tuning windows; uniform %s); layers %s", best["name"], best["measured"]["kl_mean"],
             ", ".join(f"{p['name'][8:]} {p['measured']['kl_mean']:.3e}" for p in points if p["kind"] == "uniform"), " ".join(record["chosen"]["layers"]))
    return book, record


def budget_contexts(geom, context: int) -> list[int]:
    """The contexts at which a per-layer assignment must take no more bytes than the uniform format for it to take no
    more at any context up to `context`: `context` and every sliding window below it. Bytes per stored token differ
    between candidates, and a sliding layer stops storing more at its window, so the difference of total bytes from the
    uniform format is piecewise linear in the context with its corners there (and 0 before the first compressed token)."""
    return sorted({int(context), *(int(w) for w in geom.sliding_windows if 0 < w < context)})


def within_budgets(pick, costs: list[list[list[float]]], budgets: list[float]) -> bool:
    """Whether an assignment's bytes per token are within the budget at every context (costs[c][layer][option])."""
    return all(sum(row[o] for row, o in zip(cost, pick)) <= b * (1 + 1e-9) for cost, b in zip(costs, budgets))


def fill_budget(pick: list[int], costs: list[list[list[float]]], kl: list[list[float]], budgets: list[float]) -> list[int]:
    """`pick` (an option per layer, within the budgets) with the bytes left spent greedily: while some single-layer
    change stays within the budget at every context (costs[c][layer][option], budgets[c]; the last context is the
    serving one) and lowers the summed KL, take the one of most KL saved per byte added at the serving context (a change
    that adds none counts as the most)."""
    pick = list(pick)
    while True:
        best, score = None, 0.0
        for i, o in enumerate(pick):
            for a in range(len(kl[i])):
                gain, add = kl[i][o] - kl[i][a], costs[-1][i][a] - costs[-1][i][o]
                if gain <= 0:
                    continue
                r = gain / add if add > 0 else math.inf
                if r > score and within_budgets(pick[:i] + [a] + pick[i + 1:], costs, budgets):
                    best, score = (i, a), r
        if best is None:
            return pick
        pick[best[0]] = best[1]


def tune_budget(lm, stats: KVStats, spec: KVSpec, cfg, eval_cfg, calib_cfg, progress: bool = True) -> tuple[ScaleBook, dict]:
    """kv.layers=budget: (ScaleBook of the chosen per-layer formats, the search record); see the module doc."""
    t0, geom, L, context, limits = _start(lm, cfg, eval_cfg)
    own, *alt = spec.budget_formats()
    uniform_spec(spec, own).check_geometry(geom.head_dim)
    menu = [own]
    for f in alt:
        try:
            uniform_spec(spec, f).check_geometry(geom.head_dim)
            menu.append(f)
        except UserError as e:
            log.info("tune: candidate %s does not apply to this model (%s); left out", f.label, e)
    texts, windows = _windows(lm, cfg, calib_cfg)
    ctxs = budget_contexts(geom, context)
    costs = [[[layer_bytes(spec, f, geom, c, i) for f in menu] for i in range(L)] for c in ctxs]
    budgets = [sum(row[0] for row in cost) for cost in costs]
    cost, budget = costs[-1], budgets[-1]
    log.info("tune: %d value formats x %d layers within %s's %.1f bytes/token at %d tokens (and at %s), on %d x %d calibration tokens",
             len(menu), L, own.label, budget, context, ctxs[:-1] or "no shorter context", *windows.shape)
    uniform = {f: fit(stats, uniform_spec(spec, f)) for f in menu}
    t_sens = time.time()
    sens = layer_sensitivity(lm, windows, {f.label: b for f, b in uniform.items()}, progress)
    t_sens = time.time() - t_sens
    kl = [[sens[f.label][i]["kl_mean"] for f in menu] for i in range(L)]
    fits = [a for a in hull(cost, kl) if within_budgets(a, costs, budgets)]
    starts = [[0] * L] + ([list(fits[-1])] if fits else [])  # the uniform format is always within its own bytes
    pick = min((fill_budget(a, costs, kl, budgets) for a in starts), key=lambda a: sum(k[o] for k, o in zip(kl, a)))
    chosen_layers = [menu[o] for o in pick]
    specs = {"budget": mixed_spec(spec, chosen_layers, name="budget"), f"uniform:{own.label}": uniform_spec(spec, own)}
    book, final, points, best = _lowest_measured(lm, stats, spec, specs, uniform, _predicted(sens, chosen_layers), windows, context, limits, progress)
    record = _record("budget", (f"Objective: the lowest KL within {own.label}'s bytes per token: each layer takes one of {', '.join(f.label for f in menu)}; "
                                "the most accurate assignment predicted within those bytes is measured end to end beside the uniform format."),
                     cfg, eval_cfg, limits, texts, windows, context, menu, sens, final, best["name"], geom, (t_sens, t0))
    record |= {"menu": [f.label for f in menu], "budget_bytes_per_token": budget,
               "budget_checked_at": {str(c): {"budget": b, "chosen": sum(row[menu.index(f)] for row, f in zip(cost_c, final.layer_formats(L)))}
                                     for c, cost_c, b in zip(ctxs, costs, budgets)},
               "layer_bytes_per_token": {f.label: [c[o] for c in cost] for o, f in enumerate(menu)}, "points": points}
    log.info("tune: chose %s (KL %.3e on the tuning windows against uniform %s %.3e, %.1f of %.1f bytes/token); layers %s", best["name"],
             best["measured"]["kl_mean"], own.label, points[1]["measured"]["kl_mean"], record["chosen"]["bytes_per_token"], budget,
             " ".join(record["chosen"]["layers"]))
    return book, record


def applicable_menu(spec: KVSpec, menu: list[LayerFormat], head_dim: int, warn: bool = True) -> list[LayerFormat]:
    """The quantized formats of tune.menu that apply at head_dim (each left out is logged when `warn`); none is an error
    (the pipeline asks before profiling, with warn=False)."""
    out = []
    for f in dict.fromkeys(f for f in menu if not f.is_fp16):
        try:
            uniform_spec(spec, f).check_geometry(head_dim)
            out.append(f)
        except UserError as e:
            if warn:
                log.warning("tune: menu format %s does not apply to this model (%s); left out", f.label, e)
    if not out:
        raise UserError(f"tune.menu has no quantized format that applies to head_dim={head_dim} (fp16 is always allowed); "
                        "give at least one, e.g. {key_bits: 8, value_bits: 4, value_group: 32}")
    return out


def tune(lm, stats: KVStats, spec: KVSpec, cfg, eval_cfg, calib_cfg, progress: bool = True) -> tuple[ScaleBook, dict]:
    """(ScaleBook of the chosen per-layer spec, the search record). cfg: TuneConfig."""
    if spec.is_split:
        return tune_split(lm, stats, spec, cfg, eval_cfg, calib_cfg, progress)
    if spec.is_budget:
        return tune_budget(lm, stats, spec, cfg, eval_cfg, calib_cfg, progress)
    t0, geom, L, context, limits = _start(lm, cfg, eval_cfg)
    if not limits:  # RunConfig refuses it before any work; tune() called on its own as well
        raise UserError(NO_TUNE_GATE)
    menu = applicable_menu(spec, cfg.menu, geom.head_dim)
    texts, windows = _windows(lm, cfg, calib_cfg)
    log.info("tune: %d menu formats x %d layers on %d x %d calibration tokens; limits %s (gates x margin %.2f); bytes at %d tokens",
             len(menu), L, *windows.shape, limits, cfg.margin, context)
    books = {f.label: fit(stats, uniform_spec(spec, f)) for f in menu}
    uniform = {f: books[f.label] for f in menu}
    uniform[FP16] = fit(stats, uniform_spec(spec, FP16))
    t_sens = time.time()
    sens = layer_sensitivity(lm, windows, books, progress)
    t_sens = time.time() - t_sens
    options = [FP16, *menu]
    cost = [[layer_bytes(spec, f, geom, context, i) for f in options] for i in range(L)]
    kl = [[0.0] + [sens[f.label][i]["kl_mean"] for f in menu] for i in range(L)]
    dnll = [[0.0] + [math.log1p(sens[f.label][i]["ppl_delta_rel"]) for f in menu] for i in range(L)]
    assignments = hull(cost, kl)

    def predicted(a):
        return {"kl_mean": sum(kl[i][o] for i, o in enumerate(a)), "ppl_delta_rel": math.expm1(sum(dnll[i][o] for i, o in enumerate(a)))}

    def within(pred):
        return all(pred[k] <= limits[k] for k in ("kl_mean", "ppl_delta_rel") if k in limits)

    ok = [j for j, a in enumerate(assignments) if within(predicted(a))]
    first = ok[0] if ok else len(assignments) - 1
    picks = list(range(max(0, first - 2), min(len(assignments), first - 2 + cfg.max_checks)))
    fp16_bpt = spec_bytes(uniform_spec(spec, FP16), geom, context)
    specs = {f"auto#{j}": mixed_spec(spec, [options[o] for o in assignments[j]], name=f"auto#{j}") for j in picks}
    specs |= {f"uniform:{f.label}": uniform_spec(spec, f) for f in menu}
    to_measure = {n: (assemble(s, uniform) if s.is_mixed else uniform[s.layer_formats(1)[0]]) for n, s in specs.items()}
    measured = _measure(lm, to_measure, windows, progress)
    points = [_point(n, "uniform" if n.startswith("uniform:") else "searched", s, geom, context, fp16_bpt, measured[n], limits,
                     None if n.startswith("uniform:") else predicted(assignments[int(n[5:])])) for n, s in specs.items()]
    good = sorted((p for p in points if p["passes"]), key=lambda p: p["bytes_per_token"])
    if not good:
        chosen = mixed_spec(spec, [FP16] * L, name=spec.name)
        log.warning("tune: nothing in the menu passed the gates x margin on the tuning windows; every layer stays fp16")
    else:
        chosen = specs[good[0]["name"]]
    # window and sinks, end to end, on the chosen per-layer assignment
    alt = {}
    for w in cfg.windows:
        for s in cfg.sinks:
            if (w, s) != (chosen.window, chosen.sink_tokens) and chosen.is_mixed:
                alt[f"{good[0]['name'] if good else 'fp16'}+w{w}s{s}"] = mixed_spec(chosen, chosen.layers, window=w, sink_tokens=s)
    if alt and good:
        m2 = _measure(lm, {n: assemble(s, uniform) for n, s in alt.items()}, windows, progress)
        pts2 = [_point(n, "window/sinks", s, geom, context, fp16_bpt, m2[n], limits) for n, s in alt.items()]
        points += pts2
        better = sorted((p for p in pts2 if p["passes"] and p["bytes_per_token"] < good[0]["bytes_per_token"]), key=lambda p: p["bytes_per_token"])
        if better:
            chosen, good = alt[better[0]["name"]], [better[0], *good]
    final = mixed_spec(chosen, chosen.layer_formats(L), name=spec.name)
    book = fit(stats, final)
    chosen_name = good[0]["name"] if good else None
    for p in points:
        p["chosen"] = p["name"] == chosen_name
    record = _record("auto", "Objective: the fewest bytes per token within every measurable gate x margin.",
                     cfg, eval_cfg, limits, texts, windows, context, menu, sens, final, chosen_name, geom, (t_sens, t0))
    record |= {"menu": [f.label for f in options], "layer_bytes_per_token": {f.label: [c[o] for c in cost] for o, f in enumerate(options)},
               "hull_size": len(assignments), "points": points}
    log.info("tune: chose %s: %.1f bytes/token at %d tokens (%.3f x int8k_int4v); layers %s", chosen_name, record["chosen"]["bytes_per_token"],
             context, record["chosen"]["vs_int8k_int4v"], " ".join(record["chosen"]["layers"]))
    return book, record

