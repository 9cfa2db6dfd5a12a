"""The schema of report.json (pydantic). Bump FORMAT_VERSION on any incompatible change."""
from __future__ import annotations

from typing import Optional

from pydantic import BaseModel, ConfigDict

FORMAT_VERSION = 2


class _M(BaseModel):
    model_config = ConfigDict(extra="forbid")


class KLBin(_M):
    start: int  # first predicted position of the bin
    kl_mean: float


class PositionBucket(_M):
    """Quality of the predictions of tokens at positions [start, end) of a window (and the key
    clipping of the compressed keys stored there)."""

    start: int
    end: int
    tokens: int
    kl_mean: float
    ppl_baseline: float
    ppl_compressed: float
    ppl_delta_rel: float
    key_clip_rate: Optional[float] = None  # compressed key elements at these positions that saturate


class Quality(_M):
    """Compressed vs unquantized cache, same model, same held-out tokens (one-pass, decode-equivalent)."""

    semantics: str  # which attention semantics these numbers use
    tokens: int
    ppl_baseline: float
    ppl_compressed: float
    ppl_delta: float
    ppl_delta_rel: float
    kl_mean: float  # mean KL(fp16 || compressed) of next-token distributions, nats
    kl_se: float = 0.0  # standard error of kl_mean (std of the per-token KL / sqrt(tokens)); older reports lack it
    kl_p99: float
    kl_max: float
    top1_agree: float  # fraction of positions with the same argmax
    key_clip_rate: float  # fraction of compressed key elements outside the fitted range (saturated)
    value_clip_rate: float = 0.0  # native formats: V elements saturating the per-tensor scale
    kl_by_position: list[KLBin]
    by_position: list[PositionBucket] = []  # 0-1K, 1K-2K, 2K-4K, 4K-8K, ... (the buckets the windows reach)
    attn_rel_error_per_layer: list[float]  # ||o_hat - o|| / ||o|| of each layer's attention output


class MemoryBreakdown(_M):
    key_payload: float = 0
    key_outliers: float = 0
    value_payload: float = 0
    value_meta: float = 0
    sinks: float = 0
    window: float = 0
    fp16_tokens: float = 0
    block_scales: float = 0  # NVFP4: one FP8 scale per 16 elements of K and of V
    key_meta: float = 0  # token-grouped keys: fp16 scale + min per channel per group of tokens; per-token keys: a scale per token


class Memory(_M):
    context: int  # sequence length at which sinks/window are amortised
    bytes_per_token_fp16: float
    bytes_per_token_compressed: float
    compression_ratio: float
    breakdown_per_token: MemoryBreakdown
    static_bytes: int  # per model, not per sequence (key scales, zero points, outlier indices)
    bits_per_element: float  # compressed bytes per token * 8 / (2 * layers * kv_heads * head_dim)


class GateResult(_M):
    name: str
    threshold: float
    value: Optional[float]  # None: not measured
    status: str  # pass | fail | inconclusive | not measured
    ci_low: Optional[float] = None  # paired 95% interval of a drop gate
    ci_high: Optional[float] = None
    n: Optional[int] = None

    @property
    def passed(self) -> bool:
        return self.status == "pass"


class SideQuality(_M):
    """One side of the cache compressed alone (the other read as the fp16 cache holds it): same windows, same baseline."""

    kl_mean: float
    kl_se: float
    kl_p99: float
    ppl_delta_rel: float
    top1_agree: float


class ErrorAttribution(_M):
    """eval.attribute: where a format's error comes from. The two KLs need not add up to the format's own
    (errors interact), but the larger side is where bits buy the most."""

    keys_only: SideQuality
    values_only: SideQuality


class FormatResult(_M):
    """One validated format: what it is, its numbers, its gates and verdict."""

    name: str
    tier: str  # custom | native | baseline
    role: str  # primary | trtllm (fallback written to trtllm_ckpt) | hf (FP8 fallback written to hf_ckpt) | compare:<name> (eval.compare, not shipped)
    kv: dict
    quality: Quality
    memory: Memory
    tasks: Optional[dict] = None
    gates: list[GateResult] = []
    verdict: str = "pass"  # pass | fail | inconclusive
    verdict_basis: list[str] = []  # the gates the verdict rests on (measured ones)
    fit: dict = {}
    attribution: Optional[ErrorAttribution] = None  # eval.attribute=true only


class Report(_M):
    format_version: int = FORMAT_VERSION
    kind: str = "kvcompress.report"
    model: dict
    kv: dict
    eval: dict
    quality: Quality
    memory: Memory
    planner: dict  # {run_model: ..., llama70b: ...}
    scalebook: dict
    provenance: dict
    verified: dict  # what this run verified and what it did not
    tasks: Optional[dict] = None  # long-context retrieval and exact-reproduction tasks
    gates: list[GateResult] = []
    verdict: str = "pass"  # pass | fail | inconclusive (over measured gates; no gates: pass, stated in notes)
    verdict_basis: list[str] = []
    fallbacks: list[FormatResult] = []  # the native formats export writes, validated on the same windows
    attribution: Optional[ErrorAttribution] = None  # the primary format's, eval.attribute=true only
    self_check: dict = {}  # the evaluation path with nothing compressed vs the model's own forward
    export: Optional[dict] = None
    tune: Optional[dict] = None  # kv=auto: the search record of the tune stage (tune.json)
    notes: list[str] = []
    runtime_s: Optional[float] = None
    stage_times_s: dict = {}
    validated_books: dict = {}  # {role: {file, sha256, kv}}: the ScaleBook files validate measured; export ships only these
