"""The custom tier as a TensorRT-LLM network: a Llama decoder (Mixtral, Qwen2-MoE, Qwen3-MoE: with an expert MLP) whose attention is the two kvcompress
plugins (KvcAppend writes the new token into the packed cache, KvcDecodeAttention reads it).

One description, two backends:
* `TrtGraph` adds TensorRT layers to the `INetworkDefinition` of a TensorRT-LLM 1.2.1 `Network`
  (`build_engine`, then `generate` runs the engine with `tensorrt_llm.runtime.Session`). NOT RUN
  where kvcompress is developed (no GPU, no TensorRT); every TensorRT-LLM and TensorRT name it uses
  is checked against the pinned sources by `scripts/check_trtllm_api.py` (result in
  `export/TRTLLM_API_CHECK.md`).
* `kvcompress.targets.network_oracle.TorchGraph` runs the same `decoder_step` eagerly on CPU with the
  plugins replaced by the reference numerics: the tests and every custom-tier export check it against
  `CompressedCache` decoding (the validated path), so the graph's wiring is verified here.

The engine runs one token per sequence per call (a generation step). The plugin owns a contiguous
per-sequence cache: 9 buffers per layer (10 for the grouped family, kv=wf4; layout of
`kvcompress.kernels.layout.PackedKV`), engine inputs
`past.<layer>.<buffer>` and outputs `present.<layer>.<buffer>` (KvcAppend's outputs, aliased to its
inputs), bound to the same device memory, plus `lens` [B] (tokens cached before this one; the
network adds 1 for the attention read) and `input_ids` [B]. Prompts are fed one token per step.
A per-layer format (kv=auto) gives each layer its own variant (network.json `layers`): that layer's
buffers have its variant's shapes and its plugins are the ones registered under the variant's
namespace (kvcompress.<variant>, all in one plugin library).

Tensor parallelism (build_engine --tp N, `shard`): rank r's engine holds the r-th N-th of the attention heads (query
and kv heads, contiguous, so its query heads read exactly its kv heads: query head h reads kv head h // G) with their
plugin constants and cache buffers, and the r-th N-th of the MLP's intermediate columns (each expert's, and the shared
expert's); the attention output projection and the MLP's down projection leave partial sums that an all-reduce adds
across the ranks (TensorRT-LLM's AllReduce plugin, NCCL strategy). Embeddings, norms, routers and lm_head are
replicated. N above the kv heads (a multiple of them dividing the query heads) replicates the kv heads: the N / H_kv
ranks of kv head c each hold it (its projections, plugin constants and cache) and the query projection of its whole
group, so the decode plugin runs with the G its kernels were compiled for; each rank then keeps its own N-th of the
query heads (a gather on the head axis, `W["att_heads"]`) for its N-th of the output projection's columns. The engines run one process per rank (mpirun -n N). The CPU oracle runs the ranks as threads with a summing
barrier in place of NCCL (network_oracle.oracle_step(tp=N)).

This file is copied into the plugin bundle next to build_engine.py; it imports only numpy at
module level (torch, tensorrt, tensorrt_llm, safetensors inside the functions that need them).
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

PINNED_TRTLLM = "1.2.1"
PINNED_TRT = "10.13.3"
NAMESPACE = "kvcompress"
CACHE = ("sink_k", "sink_v", "win_k", "win_v", "k_payload", "k_outliers", "v_payload", "v_scale", "v_min")
# the grouped family (kv.key.group_tokens, e.g. kv=wf4): no static key parameters; a scale and min per key channel and group
CACHE_GROUPED = ("sink_k", "sink_v", "win_k", "win_v", "k_payload", "k_gscale", "k_gmin", "v_payload", "v_scale", "v_min")
# the per-token family (kv.key.granularity=token, e.g. kv=rot8k_int4v): each token's key scales instead of outlier channels
CACHE_PER_TOKEN = ("sink_k", "sink_v", "win_k", "win_v", "k_payload", "k_scale", "v_payload", "v_scale", "v_min")
SPEC_FILE = "network.json"
PARAMS_FILE = "plugin_params.safetensors"
# the export's network check, kept for the GPU host: the tokens it fed and the validated decoding's distribution at each step
# (CompressedCache through transformers), coarsened to the reference's top CHECK_TOP_K tokens plus one bucket for the rest
CHECK_FILE = "network_check.safetensors"
CHECK_TOP_K = 256


class WeightsMismatch(ValueError):
    """The HF directory given to the network does not fit it (or its network.json): build_engine.py reports it in one line."""


def grouped(v: dict) -> bool:
    """The variant is the grouped family (KvcAppend/KvcDecodeAttention built with KVC_GT > 0)."""
    return bool(v.get("key_group_tokens"))


def per_token(v: dict) -> bool:
    """The variant is the per-token family (plugins built with KVC_KGROUP > 0)."""
    return bool(v.get("key_group"))


def row_width(D: int, bits: int) -> int:
    """Elements of one stored row (kvcompress.reference.row_width; this module ships standalone): fp16 rows of D
    halves, codes of 4..8 bits D * bits / 8 bytes (int4 nibbles, or 5..7 bits as nibbles plus bit planes)."""
    return D if bits == 16 else D * bits // 8


def cache_names(v: dict) -> tuple[str, ...]:
    """The cache buffers of a layer running variant v, in the plugins' input order."""
    return CACHE_GROUPED if grouped(v) else CACHE_PER_TOKEN if per_token(v) else CACHE


def cache_tails(v: dict, H: int, D: int, cap: int) -> dict[str, tuple[tuple[int, int, int], str]]:
    """Per-sequence shape [H, rows, cols] and dtype of each cache buffer (PackedKV.empty's layout)."""
    kd, vd = row_width(D, v["key_bits"]), row_width(D, v["value_bits"])
    ng = D // v["group"]
    ns, w, n_out = v["n_sink"], v["window"], v["n_out"]
    fp16 = {"sink_k": ((H, ns, D), "float16"), "sink_v": ((H, ns, D), "float16"), "win_k": ((H, w, D), "float16"), "win_v": ((H, w, D), "float16")}
    if grouped(v):  # cap holds whole key groups; k_payload rows are D * mean bits / 8 bytes (reference.pack_key_codes)
        capg = cap // v["key_group_tokens"]
        return fp16 | {
            "k_payload": ((H, cap, D * v["key_bits"] // 8), "uint8"), "k_gscale": ((H, capg, D), "float16"), "k_gmin": ((H, capg, D), "float16"),
            "v_payload": ((H, cap, vd), "int8" if v["value_symmetric"] and v["value_bits"] == 8 else "uint8"), "v_scale": ((H, cap, ng), "float16"),
            "v_min": ((H, cap, ng), "uint8" if v["value_coded_min"] else "float16"),
        }
    hp_store = v["key_bits"] == 16  # an fp16 layer of a per-layer format: fp16 rows in the store (v_scale/v_min: one unused row per head)
    vrows = 1 if hp_store else cap
    vopt = {"v_payload": ((H, cap, vd), "float16" if hp_store else "int8" if v.get("value_symmetric") and v["value_bits"] == 8 else "uint8"),
            "v_scale": ((H, vrows, ng), "float16"), "v_min": ((H, vrows, ng), "uint8" if v.get("value_coded_min") else "float16")}
    if per_token(v):
        return fp16 | {"k_payload": ((H, cap, kd), "uint8" if v["key_bits"] < 8 else "int8"), "k_scale": ((H, cap, D // v["key_group"]), "float16")} | vopt
    return fp16 | {
        "k_payload": ((H, cap, kd), "float16" if hp_store else "uint8" if v["key_bits"] == 4 else "int8"), "k_outliers": ((H, cap, n_out), "float16"),
        "v_payload": ((H, cap, vd), "float16" if hp_store else "uint8"), "v_scale": ((H, vrows, ng), "float16"), "v_min": ((H, vrows, ng), "float16"),
    }


def token_bytes(v: dict, D: int) -> int:
    """Bytes of one compressed token per head that the decode kernel reads (its split planning)."""
    vd = row_width(D, v["value_bits"])
    if grouped(v):
        vmin = 0 if v["value_symmetric"] else 1 if v["value_coded_min"] else 2
        return D * v["key_bits"] // 8 + -(-4 * D // v["key_group_tokens"]) + vd + (D // v["group"]) * (2 + vmin)  # key scale + min per group, amortised
    kd = row_width(D, v["key_bits"]) * (2 if v["key_bits"] == 16 else 1)  # bytes
    if v["value_bits"] == 16:  # an fp16 layer: fp16 keys and values, nothing else read
        return kd + 2 * D
    if per_token(v):
        vmin = 0 if v["value_symmetric"] else 1 if v["value_coded_min"] else 2
        return kd + 2 * (D // v["key_group"]) + vd + (D // v["group"]) * (2 + vmin)
    return kd + vd + 4 * (D // v["group"]) + 2 * v["n_out"]


def layer_variant(spec: dict, i: int) -> dict:
    """The variant layer i runs: the bundle's one variant, or the layer's own (per-layer formats)."""
    return spec["layers"][i] if spec.get("layers") else spec["variant"]


def store_capacity(spec: dict, max_seq_len: int) -> int:
    """Compressed-store slots for sequences of up to max_seq_len tokens (the rest are sinks and window;
    the same in every layer)."""
    v = layer_variant(spec, 0)
    n = max(1, max_seq_len - v["n_sink"] - v["window"])
    gt = v.get("key_group_tokens") or 1
    return -(-n // gt) * gt  # the grouped family stores whole key groups


# plugin_params with one row per kv head (axis 1 of [L, H_kv, ...]): each rank takes its heads' rows
HEAD_PARAMS = ("k_scale", "k_zero", "k_zero_masked", "outlier_idx", "k_bits", "k_offsets")
# load_hf_weights' names -> the axis a rank takes its part of (dense / mixture-of-experts layers); any other name is replicated
SPLIT_AXIS = {"wq": 0, "wk": 0, "wv": 0, "bq": 1, "bk": 1, "bv": 1, "wo": 1, "wg": 0, "wu": 0, "wd": 1, "sg": 0, "su": 0, "sd": 1}
SPLIT_AXIS_MOE = SPLIT_AXIS | {"wg": 1, "wu": 1, "wd": 2}  # experts [E, I, hidden] and [E, hidden, I]: each expert's columns
# the attention input projections a rank takes whole per kv head when tp > n_kv_heads (the kv head's query group with it)
REPLICATED_KV = ("wq", "wk", "wv", "bq", "bk", "bv")
# the HF tensors a rank holds a part of (engine_memory's count): attention projections and MLP / expert projections
SPLIT_TENSORS = re.compile(r"\.(q_proj|k_proj|v_proj|o_proj|qkv_proj|gate_proj|up_proj|down_proj|gate_up_proj|w1|w2|w3)\.(weight|bias)$"
                           r"|\.experts\.(gate_up_proj|down_proj)$")
# a mixture-of-experts router: a float32 constant of the graph (the routing logits in float32, _moe_mlp)
ROUTER = re.compile(r"\.(block_sparse_moe\.gate|mlp\.gate)\.weight$")
# ... of which a rank holds its kv heads' part, whole kv heads (min(tp, n_kv_heads)-th) when tp replicates them
KV_INPUT_TENSORS = re.compile(r"\.(q_proj|k_proj|v_proj|qkv_proj)\.(weight|bias)$")


def tp_allowed(n_heads: int, n_kv_heads: int, tp: int) -> bool:
    """A tensor-parallel size the custom tier can split the attention in: whole kv heads per rank (tp divides the kv
    heads), or replicated kv heads with whole query heads per rank (tp a multiple of the kv heads dividing the query heads)."""
    return tp >= 1 and (n_kv_heads % tp == 0 or (tp % n_kv_heads == 0 and n_heads % tp == 0))


def check_tp(spec: dict, tp: int) -> None:
    """Refuse a tensor-parallel size the attention cannot be split in (tp_allowed), naming the sizes that can."""
    h, hkv = spec["arch"]["n_heads"], spec["arch"]["n_kv_heads"]
    if not tp_allowed(h, hkv, tp):
        ok = ", ".join(str(n) for n in range(1, h + 1) if tp_allowed(h, hkv, n))
        raise WeightsMismatch(f"--tp {tp} splits neither the model's {hkv} kv heads (a divisor of {hkv}) nor its {h} query heads over "
                              f"replicated kv heads (a multiple of {hkv} dividing {h}); allowed: {ok}")


def kv_heads_per_rank(spec: dict, tp: int) -> int:
    """The kv heads one rank of a tp-way engine holds (and caches): n_kv_heads / tp, one when they are replicated."""
    return max(1, spec["arch"]["n_kv_heads"] // tp)


def default_splits(spec: dict, tp: int = 1) -> int:
    """The decode plugin's split count for a rank of a tp-way engine: network.json's splits_by_tp (the export's plan for a
    rank's n_kv_heads / tp heads, one 8K sequence), else its splits."""
    return int((spec.get("splits_by_tp") or {}).get(str(tp)) or spec["splits"])


def shard(W: dict[str, np.ndarray], P: dict[str, np.ndarray], spec: dict, tp: int, rank: int) -> tuple[dict, dict]:
    """Rank `rank`'s part of the weights (load_hf_weights' names) and plugin constants for tensor parallelism over tp
    ranks: the SPLIT_AXIS tensors cut in tp equal parts along their axis (query / kv heads, intermediate columns), the
    rest shared (the same arrays); HEAD_PARAMS cut along their kv-head axis. tp above the kv heads (rep = tp / n_kv_heads
    ranks per kv head): the query, key and value projections and HEAD_PARAMS are kv head rank // rep's (its whole query
    group), the output projection's columns the rank's own tp-th of the query heads, which W["att_heads"] (int32 indices
    into the group's heads) picks from the attention's output."""
    if tp == 1:
        return W, P
    check_tp(spec, tp)
    hkv, G = spec["arch"]["n_kv_heads"], spec["arch"]["n_heads"] // spec["arch"]["n_kv_heads"]
    rep = max(1, tp // hkv)
    axes = SPLIT_AXIS_MOE if spec["arch"].get("moe") else SPLIT_AXIS
    out = {}
    for name, arr in W.items():
        short = name.rsplit(".", 1)[-1] if "." in name else None
        axis = axes.get(short) if short else None
        if axis is None:
            out[name] = arr
            continue
        parts, part = (hkv, rank // rep) if rep > 1 and short in REPLICATED_KV else (tp, rank)
        if arr.shape[axis] % parts:
            raise WeightsMismatch(f"{name} has {arr.shape[axis]} rows along its split axis {axis}, not divisible by --tp {tp}")
        out[name] = np.ascontiguousarray(np.split(arr, parts, axis=axis)[part])
    if rep > 1:
        own = G // rep
        out["att_heads"] = np.arange((rank % rep) * own, (rank % rep + 1) * own, dtype=np.int32)
    parts, part = (hkv, rank // rep) if rep > 1 else (tp, rank)
    return out, {n: np.ascontiguousarray(np.split(a, parts, axis=1)[part]) if n in HEAD_PARAMS else a for n, a in P.items()}


FP8_METADATA = ("_scale_inv", "_scale")  # an FP8 checkpoint's scale tensors: read to dequantize the weights, not constants of the network


def _safetensors_header(path: Path) -> dict:
    """A .safetensors file's JSON header (each tensor's dtype, shape and offsets), without reading a tensor."""
    with open(path, "rb") as f:
        return json.loads(f.read(int.from_bytes(f.read(8), "little")))


def _reader(name: str):
    """kvcompress.models.<name> (a weight format's reader: fp8_weights, int_weights, nvfp4_weights), or in the bundle the
    <name>.py copied beside this file (targets.bundle.WEIGHT_READERS)."""
    import importlib

    try:
        return importlib.import_module(f"kvcompress.models.{name}")
    except ImportError:
        return importlib.import_module(name)


def _quantization_config(hf_dir: Path) -> dict:
    """config.json's quantization_config of an HF directory ({} without one)."""
    cfg = Path(hf_dir) / "config.json"
    return (json.loads(cfg.read_text()).get("quantization_config") or {}) if cfg.is_file() else {}


def dense_shapes(shapes: dict, hf_dir: Path) -> dict:
    """Tensor shapes with each pack-quantized weight (`<m>.weight_packed` int32 [out, words] and its parts) as the weight
    `<m>.weight` [out, in] the loader makes of it (in = words * 32 / bits, the config's code width), its parts left out."""
    iw = _reader("int_weights")
    packed = [k for k in shapes if k.endswith(".weight_packed")]
    qweights = [k for k in shapes if k.endswith(".qweight")]
    if not packed and not qweights:
        return shapes
    q = _quantization_config(hf_dir)
    b = iw.config_bits(q) or 4
    if qweights:  # GPTQ [in * b / 32, out], AWQ [in, out / 8] -> [out, in] (out: the scales' columns)
        awq = iw.layout(q) == "awq"
        drop = {k.removesuffix("qweight") + p for k in qweights for p in iw.GPTQ_PARTS}
        return {k: s for k, s in shapes.items() if k not in drop} | {
            k.removesuffix("qweight") + "weight": [shapes[k.removesuffix("qweight") + "scales"][1], shapes[k][0] if awq else shapes[k][0] * 32 // b]
            for k in qweights}
    out = {k: s for k, s in shapes.items() if not iw.is_part(k)}
    return out | {k.removesuffix("_packed"): [shapes[k][0], shapes[k][1] * 32 // b] for k in packed}


def engine_memory(spec: dict, hf_dir: Path, max_batch: int, max_seq_len: int, tp: int = 1) -> dict:
    """Device bytes the custom-tier engine needs at least on each of its tp GPUs:
    weights: every text-decoder tensor of the HF directory as an fp16 constant (2 bytes per element whatever its stored
    dtype: load_hf_weights casts bf16 and dequantizes FP8 to fp16; FP8 scale tensors are not constants; a tied head
    counted once; a mixture of experts' routers 4 bytes, float32), read from the safetensors headers, the projections a rank holds a tp-th of (SPLIT_TENSORS) divided by tp
    (the query, key and value projections by min(tp, n_kv_heads): a rank above the kv heads holds its kv head's whole group);
    cache: the past buffers of max_batch sequences of max_seq_len tokens (engine_io at tp; present aliases past).
    TensorRT's activations and workspace come on top."""
    headers = {}
    for f in sorted(Path(hf_dir).glob("*.safetensors")):
        headers |= {k: v for k, v in _safetensors_header(f).items() if k != "__metadata__"}
    nvfp4 = _reader("nvfp4_weights")
    nv = nvfp4.packed_names(headers)  # NVFP4 codes [out, in / 2]: the [out, in] weight, its scales dropped
    drop = {p for parts in nv.values() for p in nvfp4.stored(parts)}
    drop |= {p for parts in _reader("int_weights").int8_names(headers).values() for p in parts.values() if p}  # int8 weights' scales
    shapes = {k: v["shape"] for k, v in headers.items() if k not in drop} | {k: nvfp4.shape(headers[p["codes"]]["shape"]) for k, p in nv.items()}
    shapes = text_decoder_tensors(dense_shapes(shapes, hf_dir))  # a multimodal checkpoint: its text decoder's tensors
    kv_tp = min(tp, spec["arch"]["n_kv_heads"])

    def part(k: str) -> int:
        return (kv_tp if KV_INPUT_TENSORS.search(k) else tp) if SPLIT_TENSORS.search(k) else 1

    weights = sum(int(np.prod(s)) // part(k) * (4 if ROUTER.search(k) else 2) for k, s in shapes.items() if not k.endswith(FP8_METADATA))
    per_seq = sum(int(np.prod(tail)) * np.dtype(dt).itemsize for tail, dt in engine_io(spec, store_capacity(spec, max_seq_len), tp).values())
    return {"weights_bytes": weights, "cache_bytes": per_seq * max_batch, "max_batch": max_batch, "max_seq_len": max_seq_len, "tp": tp}


def fewest_gpus(spec: dict, hf_dir: Path, max_seq_len: int, gpu_bytes: float, sizes=(1, 2, 4, 8)) -> dict:
    """engine_memory of one sequence at the smallest tensor-parallel size in `sizes` (those the attention splits in,
    tp_allowed) whose per-GPU weights and cache fit gpu_bytes, with "fits": True; else at the largest such size, "fits": False."""
    for tp in (t for t in sizes if tp_allowed(spec["arch"]["n_heads"], spec["arch"]["n_kv_heads"], t)):
        mem = engine_memory(spec, hf_dir, 1, max_seq_len, tp)
        if mem["weights_bytes"] + mem["cache_bytes"] <= gpu_bytes:
            return mem | {"fits": True}
    return mem | {"fits": False}


def size(n: float) -> str:
    """Bytes as GB (1e9) from 1 GB up, else MB."""
    return f"{n / 1e9:.1f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


def memory_line(mem: dict) -> str:
    """engine_memory in one line."""
    tp = mem.get("tp", 1)
    where = "on one GPU" if tp == 1 else f"on each of {tp} GPUs (tensor parallel)"
    return f"fp16 weights {size(mem['weights_bytes'])} + cache {size(mem['cache_bytes'])} ({mem['max_batch']} sequence{'s' if mem['max_batch'] != 1 else ''} x {mem['max_seq_len']} tokens) {where}"


def rope_tables(inv_freq: np.ndarray, n_pos: int, scale: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin [n_pos, D] float32 for GPT-NeoX rotation (channel pairs (d, d + D/2)), times `scale` (YaRN's
    attention scaling, network.json rope_scale; 1 otherwise)."""
    ang = np.arange(n_pos, dtype=np.float64)[:, None] * np.asarray(inv_freq, np.float64)[None, :]
    ang = np.concatenate([ang, ang], axis=1)
    return (np.cos(ang) * scale).astype(np.float32), (np.sin(ang) * scale).astype(np.float32)


def rotate_half_matrix(D: int) -> np.ndarray:
    """R [1, D, D] with x @ R = concat(-x[D/2:], x[:D/2]) (exact: entries 0 and +-1)."""
    R = np.zeros((D, D), np.float32)
    h = D // 2
    R[np.arange(h) + h, np.arange(h)] = -1.0
    R[np.arange(h), np.arange(h) + h] = 1.0
    return R[None]


def load_spec(bundle: Path) -> dict:
    p = Path(bundle) / SPEC_FILE
    if not p.is_file():
        raise FileNotFoundError(f"{p} is missing: --bundle must be an export's plugin_bundle/ (custom tier)")
    return json.loads(p.read_text())


def check_max_seq_len(spec: dict, max_seq_len: int) -> None:
    """Refuse an engine whose sequences outrun the positions the asymmetric static keys' ranges hold at
    (network.json key_max_position, kv.key.max_position): past it, slow RoPE pairs can leave their range and clip."""
    lim = spec.get("key_max_position")
    if lim and max_seq_len > lim:
        raise WeightsMismatch(f"--max-seq-len {max_seq_len} exceeds {lim}, the positions this bundle's asymmetric keys were fitted to hold at "
                              f"(kv.key.max_position); build with --max-seq-len <= {lim} or re-export with kv.key.max_position={max_seq_len}")


# A multimodal checkpoint's text decoder (Mistral3ForConditionalGeneration, Gemma3ForConditionalGeneration) under the text
# model's names, stored -> text model. Defined here because this file runs alone on the GPU host; kvcompress.models.multimodal
# reads the same mapping from here.
TEXT_DECODER_KEYS = ((r"^model\.language_model\.", "model."), (r"^language_model\.model\.", "model."),
                     (r"^language_model\.lm_head\.", "lm_head."), (r"^lm_head\.", "lm_head."))


def text_decoder_name(stored: str) -> str | None:
    """The text model's name of a stored tensor, or None for a tensor outside the text decoder (vision tower, projector)."""
    for pattern, repl in TEXT_DECODER_KEYS:
        if re.match(pattern, stored):
            return re.sub(pattern, repl, stored, count=1)
    return None


def text_decoder_tensors(raw: dict) -> dict:
    """`raw` itself for a text model's checkpoint; for a multimodal one, its text decoder's tensors under the text model's
    names (text_decoder_name), the vision tower's and projector's left out."""
    if "model.embed_tokens.weight" in raw:
        return raw
    return {n: v for k, v in raw.items() if (n := text_decoder_name(k)) is not None} or raw


def dequantize_fp8(raw: dict, hf_dir: Path) -> dict:
    """An FP8-weight checkpoint's float8 tensors as float32 values w * scale (their `_scale_inv` / `_scale` tensors dropped;
    fp8_weights.py, copied beside this file in the bundle; block size from config.json's quantization_config)."""
    import torch

    if not any(t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) for t in raw.values()):
        return raw
    fp8 = _reader("fp8_weights")
    FLOAT8, dequantize, scale_name = fp8.FLOAT8, fp8.dequantize, fp8.scale_name
    cfg = Path(hf_dir) / "config.json"
    block = (json.loads(cfg.read_text()).get("quantization_config") or {}).get("weight_block_size") if cfg.is_file() else None
    out = {}
    for k, t in raw.items():
        if t.dtype in FLOAT8:
            sk = scale_name(raw, k)
            if sk is None:
                raise WeightsMismatch(f"{hf_dir}: {k} is {t.dtype} without a {k}_scale_inv or {k}_scale beside it")
            out[k] = dequantize(t, raw[sk], list(t.shape), 0, block)
        elif not (k.endswith(("_scale_inv", "_scale")) and k.rsplit("_scale", 1)[0] in raw and raw[k.rsplit("_scale", 1)[0]].dtype in FLOAT8):
            out[k] = t
    return out


def dequantize_nvfp4(raw: dict, hf_dir: Path) -> dict:
    """An NVFP4 checkpoint's weights (Model Optimizer's or compressed-tensors' layout) as float32 values (nvfp4_weights.py,
    copied beside this file in the bundle), their codes' other names, scales and input scales dropped; any other checkpoint
    as it is. Before dequantize_fp8: the block scales are float8 tensors that are not weights."""
    nv = _reader("nvfp4_weights")
    layers = nv.packed_names(raw)
    if not layers:
        return raw
    drop = {p for parts in layers.values() for p in nv.stored(parts)}
    out = {k: t for k, t in raw.items() if k not in drop}
    for name, parts in layers.items():
        try:
            out[name] = nv.read(parts, lambda k, lo=None, hi=None: raw[k])
        except ValueError as e:
            raise WeightsMismatch(f"{hf_dir}: {name}: {e}") from None
    return out


def dequantize_packed(raw: dict, hf_dir: Path) -> dict:
    """An integer checkpoint's weights (compressed-tensors pack-quantized and int-quantized int8, GPTQ, AWQ GEMM) as their values, `<m>.weight` =
    (q - z) * s in float32 (int_weights.py, copied beside this file in the bundle), their packed parts dropped; any
    other checkpoint as it is."""
    int_weights = _reader("int_weights")
    packed = int_weights.packed_names(raw)
    q = _quantization_config(hf_dir)
    fmt, bits = int_weights.layout(q), int_weights.config_bits(q)
    if fmt in ("gptq", "gptq_v2", "awq"):  # GPTQ's and AWQ's qweight / qzeros / scales (g_idx)
        layers = int_weights.qweight_names(raw)
        out = {k: t for k, t in raw.items() if not (int_weights.is_qweight_part(k) and k.rsplit(".", 1)[0] + ".weight" in layers)}
        for name, parts in layers.items():
            try:
                if bits is None:
                    raise ValueError(f"its quantization_config ({fmt}) states no bits")
                out[name] = int_weights.dequantize_layer(fmt, parts, raw.__getitem__, bits)
            except ValueError as e:
                raise WeightsMismatch(f"{hf_dir}: {e}") from None
        return out
    int8 = int_weights.int8_names(raw) if fmt == "pack-quantized" else {}
    if int8:  # int8 codes under the weight's own name beside their scale (zero points, g_idx)
        try:
            raw = {k: t for k, t in raw.items() if k not in {p for parts in int8.values() for p in parts.values()}} | {
                name: int_weights.read_int8(parts, name, list(raw[name].shape), lambda k, lo=None, hi=None: raw[k]) for name, parts in int8.items()}
        except ValueError as e:
            raise WeightsMismatch(f"{hf_dir}: {e}") from None
    if not packed:
        return raw
    out = {k: t for k, t in raw.items() if not int_weights.is_part(k)}
    for name, parts in packed.items():
        if parts["weight_scale"] is None or parts["weight_shape"] is None:
            raise WeightsMismatch(f"{hf_dir}: {parts['weight_packed']} has no weight_scale or weight_shape beside it")
        opt = {p: raw[parts[p]] if parts[p] else None for p in ("weight_zero_point", "weight_g_idx")}
        out[name] = int_weights.dequantize(raw[parts["weight_packed"]], raw[parts["weight_scale"]], raw[parts["weight_shape"]].tolist(),
                                           opt["weight_zero_point"], opt["weight_g_idx"], bits)
    return out


def load_hf_weights(hf_dir: Path, spec: dict, params: dict | None = None) -> dict[str, np.ndarray]:
    """The Llama-layer weights of an HF directory (*.safetensors; Llama, Mistral, Qwen2 with its q/k/v biases, Qwen3 with its
    per-head q/k norms, Phi-3/Phi-4 with fused q/k/v and gate/up, split here) as fp16
    numpy arrays under short names; with network.json's value_rotation, the plugin_params' v_rotation folded into
    W_v and W_o."""
    import torch  # bf16 checkpoints: numpy cannot read them
    from safetensors.torch import load_file

    files = sorted(Path(hf_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {hf_dir}")
    raw = {}
    for f in files:
        raw.update(load_file(str(f)))
    raw = text_decoder_tensors(dequantize_packed(dequantize_fp8(dequantize_nvfp4(raw, hf_dir), hf_dir), hf_dir))
    a = spec["arch"]
    p = "model."
    for name in [n for n in raw if n.endswith(("self_attn.qkv_proj.weight", "mlp.gate_up_proj.weight"))]:  # Phi-3/Phi-4: fused rows q|k|v, gate|up
        w = raw.pop(name)
        if "qkv_proj" in name:
            nq, nkv = a["n_heads"] * a["head_dim"], a["n_kv_heads"] * a["head_dim"]
            parts = dict(zip(("q_proj", "k_proj", "v_proj"), torch.split(w, [nq, nkv, nkv])))
        else:
            parts = dict(zip(("gate_proj", "up_proj"), torch.chunk(w, 2)))
        raw |= {name.replace(name.split(".")[-2], k): t for k, t in parts.items()}
    if p + "embed_tokens.weight" not in raw:
        raise WeightsMismatch(f"{hf_dir}: not a Llama checkpoint (no model.embed_tokens.weight)")

    def get(name):
        return raw[name].to(dtype=torch.float16).numpy()

    moe = a.get("moe")

    w = {"embed": get(p + "embed_tokens.weight"), "norm": get(p + "norm.weight")[None]}
    w["lm_head"] = get("lm_head.weight") if "lm_head.weight" in raw else w["embed"]
    for i in range(a["n_layers"]):
        t = f"{p}layers.{i}."
        w |= {f"{i}.ln1": get(t + "input_layernorm.weight")[None], f"{i}.ln2": get(t + "post_attention_layernorm.weight")[None],
              f"{i}.wq": get(t + "self_attn.q_proj.weight"), f"{i}.wk": get(t + "self_attn.k_proj.weight"),
              f"{i}.wv": get(t + "self_attn.v_proj.weight"), f"{i}.wo": get(t + "self_attn.o_proj.weight")}
        experts = _expert_weights(raw, t, moe["num_experts"]) if moe else None
        has_moe = f"{t}block_sparse_moe.gate.weight" in raw or f"{t}mlp.gate.weight" in raw  # a router (a dense MLP's is gate_proj)
        if has_moe != bool(moe):
            raise WeightsMismatch(f"{hf_dir}: network.json {'has' if moe else 'has no'} mixture-of-experts block but layer {i} "
                                  f"{'has' if has_moe else 'has no'} expert tensors (Mixtral's block_sparse_moe, Qwen-MoE's mlp.gate and mlp.experts)")
        if moe and experts is None:
            raise WeightsMismatch(f"{hf_dir}: layer {i} lacks the gate, up or down weights of some of its {moe['num_experts']} experts (network.json moe)")
        if moe:
            w |= {f"{i}.{n}": a for n, a in experts.items()}
            if bool(moe.get("shared_expert")) != (f"{t}mlp.shared_expert_gate.weight" in raw):
                raise WeightsMismatch(f"{hf_dir}: network.json {'has' if moe.get('shared_expert') else 'has no'} shared expert but layer {i} "
                                      f"{'has no' if moe.get('shared_expert') else 'has a'} mlp.shared_expert_gate (Qwen2-MoE's)")
            if moe.get("shared_expert"):  # Qwen2-MoE: the shared expert's gate, up, down and its sigmoid gate's [1, hidden] row
                s = f"{t}mlp.shared_expert."
                missing = [n for n in ("gate_proj", "up_proj", "down_proj") if f"{s}{n}.weight" not in raw]
                if missing:
                    raise WeightsMismatch(f"{hf_dir}: network.json has a shared expert but layer {i} lacks its {', '.join(missing)} weights")
                w |= {f"{i}.sg": get(s + "gate_proj.weight"), f"{i}.su": get(s + "up_proj.weight"), f"{i}.sd": get(s + "down_proj.weight"),
                      f"{i}.sgate": get(f"{t}mlp.shared_expert_gate.weight")}
        else:
            w |= {f"{i}.wg": get(t + "mlp.gate_proj.weight"), f"{i}.wu": get(t + "mlp.up_proj.weight"), f"{i}.wd": get(t + "mlp.down_proj.weight")}
        if f"{t}self_attn.o_proj.bias" in raw:
            raise WeightsMismatch(f"{hf_dir}: an output-projection bias is not in this network (Llama, Mistral, Qwen2, Qwen3)")
        for n in "qkv":  # Qwen2's q/k/v biases (folded with the weights)
            if f"{t}self_attn.{n}_proj.bias" in raw:
                w[f"{i}.b{n}"] = get(f"{t}self_attn.{n}_proj.bias")[None]
        if f"{t}self_attn.k_norm.weight" in raw:  # Qwen3's per-head q/k norms (the key fold lives in their weights)
            qn, kn = get(f"{t}self_attn.q_norm.weight"), get(f"{t}self_attn.k_norm.weight")
            if qn.size != a["head_dim"] or kn.size != a["head_dim"]:
                raise WeightsMismatch(f"{hf_dir}: q/k norm weights of {qn.size}/{kn.size} values; this network takes one [head_dim] weight for every head (Qwen3)")
            w[f"{i}.qn"], w[f"{i}.kn"] = qn, kn
        if spec.get("value_rotation", "none") != "none" and layer_variant(spec, i)["value_bits"] != 16:  # fp16 layers store values as they are
            if params is None or "v_rotation" not in params:
                raise WeightsMismatch(f"network.json says value_rotation={spec['value_rotation']} but plugin_params has no v_rotation")
            _fold_value_rotation(w, raw, t, i, a, params["v_rotation"])
    return w


def _expert_weights(raw: dict, t: str, E: int) -> dict[str, np.ndarray] | None:
    """Layer t's router (float32 [E, hidden]) and its experts' gate, up, down ([E, out, in] fp16) from the checkpoint as
    stored: Mixtral's block_sparse_moe.gate and experts.{e}.w1 (gate), w3 (up), w2 (down); Qwen-MoE's mlp.gate and
    mlp.experts.{e}.gate_proj, up_proj, down_proj; or transformers' fused mlp.experts.gate_up_proj (rows gate | up per
    expert) and down_proj. None when the layer has not all of one of these."""
    import torch

    layouts = ((f"{t}block_sparse_moe.", "gate.weight", ("w1", "w3", "w2")), (f"{t}mlp.", "gate.weight", ("gate_proj", "up_proj", "down_proj")))
    for base, router, names in layouts:
        keys = [[f"{base}experts.{e}.{n}.weight" for e in range(E)] for n in names]
        if base + router in raw and all(k in raw for ks in keys for k in ks):
            g, u, d = (np.stack([raw[k].to(torch.float16).numpy() for k in ks]) for ks in keys)
            return {"wr": raw[base + router].float().numpy(), "wg": g, "wu": u, "wd": d}
    fused = (f"{t}mlp.experts.gate_up_proj", f"{t}mlp.experts.down_proj", f"{t}mlp.gate.weight")
    if all(k in raw for k in fused) and raw[fused[0]].shape[0] == E:
        g, u = (x.to(torch.float16).numpy() for x in raw[fused[0]].chunk(2, dim=1))
        return {"wr": raw[fused[2]].float().numpy(), "wg": g, "wu": u, "wd": raw[fused[1]].to(torch.float16).numpy()}
    return None


def _fold_value_rotation(w: dict, raw: dict, t: str, i: int, a: dict, R: np.ndarray) -> None:
    """The values' rotation folded into the weights (kv.value.rotate beside static keys; R = plugin_params
    v_rotation [D, D], orthogonal, v -> v @ R): each kv head's v = x W_v^T becomes v R (W_v_h' = R^T W_v_h, its
    bias b_h R), and each query head's columns of W_o become W_o_h R, so o = (attn R) (W_o R)^T = attn W_o^T:
    the same output, the cache holding the rotated values. float32 from the checkpoint's weights, fp16 once."""
    D, HKV = a["head_dim"], a["n_kv_heads"]
    R = np.asarray(R, np.float32)
    f32 = lambda name: raw[name].float().numpy()  # noqa: E731  (bf16 checkpoints: through torch)
    wv = f32(f"{t}self_attn.v_proj.weight").reshape(HKV, D, -1)  # [HKV, D, hidden]
    w[f"{i}.wv"] = np.einsum("dc,hdk->hck", R, wv).reshape(HKV * D, -1).astype(np.float16)
    if f"{t}self_attn.v_proj.bias" in raw:
        w[f"{i}.bv"] = (f32(f"{t}self_attn.v_proj.bias").reshape(HKV, D) @ R).reshape(1, -1).astype(np.float16)
    wo = f32(f"{t}self_attn.o_proj.weight")  # [hidden, H*D]
    w[f"{i}.wo"] = (wo.reshape(wo.shape[0], -1, D) @ R).reshape(wo.shape).astype(np.float16)


def load_plugin_params(bundle: Path) -> dict[str, np.ndarray]:
    """Per-layer plugin constants written by the export: k_scale, k_zero, k_zero_masked [L, H, D] fp32, outlier_idx [L, H, N] int32;
    for the grouped family k_bits, k_offsets [L, H, D] int32 (each key channel's width and bit offset in a row); for the
    per-token family q_rotation [D, D] fp32 (x @ q_rotation is the keys' Hadamard basis; the identity without rotation); for the
    static family with kv.value.rotate, v_rotation [D, D] fp32 (v @ v_rotation is what the cache stores; load_hf_weights folds it)."""
    from safetensors.numpy import load_file

    return load_file(str(Path(bundle) / PARAMS_FILE))


def _rms_norm(g, x, w, eps: float, rank: int = 2):
    """Llama RMSNorm over the last axis of a rank-`rank` x: fp32 statistics, the normalised row cast back to fp16,
    times the fp16 weight. The constants take x's rank (TensorRT's elementwise layers broadcast only from 1)."""
    x32 = g.cast(x, "float32")
    var = g.mean_last(g.mul(x32, x32))
    r = g.div(x32, g.sqrt(g.add(var, g.const(np.full((1,) * rank, eps, np.float32)))))
    return g.mul(g.cast(r, "float16"), g.const(np.asarray(w).reshape((1,) * (rank - 1) + (-1,))))


def _rope(g, x, cos, sin, R):
    """x [B, H, D] fp16 -> x cos + rotate_half(x) sin, in fp32, back to fp16."""
    x32 = g.cast(x, "float32")
    return g.cast(g.add(g.mul(x32, cos), g.mul(g.matmul(x32, R), sin)), "float16")


def _proj(g, h, W, i: int, n: str):
    """h @ W_n^T (+ the bias where the checkpoint has one: Qwen2's q/k/v), fp16."""
    y = g.matmul(h, g.const(W[f"{i}.w{n}"]), transpose_b=True)
    return g.add(y, g.const(W[f"{i}.b{n}"])) if f"{i}.b{n}" in W else y


def _silu_gate(g, gate, up):
    """SiLU(gate) * up, the gated MLP's hidden activation."""
    return g.mul(g.mul(gate, g.sigmoid(gate)), up)


def _mlp(g, h, W, i: int):
    """Llama's gated SiLU MLP of h [B, hidden] fp16."""
    gate = g.matmul(h, g.const(W[f"{i}.wg"]), transpose_b=True)
    up = g.matmul(h, g.const(W[f"{i}.wu"]), transpose_b=True)
    return g.matmul(_silu_gate(g, gate, up), g.const(W[f"{i}.wd"]), transpose_b=True)


def _moe_mlp(g, h, W, i: int, hidden: int, k: int, renormalize: bool = True):
    """The mixture-of-experts MLP of h [B, hidden] fp16 (Mixtral, Qwen2-MoE, Qwen3-MoE): router logits in float32 (h @ W_r^T),
    the top k per token and their weights: renormalize (Mixtral; Qwen3-MoE with norm_topk_prob; network.json
    moe.normalization_mode 1) the softmax of the top k logits (= the softmax over all experts renormalised over the
    top k); otherwise (mode 0) the top k of the softmax over all experts, as they are. The weights are spread over
    the E experts as a dense routing row (0 for the experts not chosen: a gather of the identity's rows, one-hot,
    weighted). Every expert's gated MLP runs on every token, from the weights as stored (gate and up of all experts
    in one matrix multiply each, down as one batched multiply over the experts), and the routing row sums them:
    out = sum_e route_e expert_e(h), where an expert not chosen adds exactly 0. A step reads each expert's weights
    once, whatever the batch (a per-token gather of the chosen experts' weights would copy k of them per token);
    it computes E / k times the chosen experts' work, which TensorRT-LLM's MoE plugin does not. With a shared expert
    (Qwen2-MoE, network.json moe.shared_expert; weights sg/su/sd and the gate row sgate) every token adds that gated MLP
    times sigmoid(h . w_gate), as TensorRT-LLM's SharedMoE."""
    E, inter = W[f"{i}.wg"].shape[:2]
    logits = g.matmul(g.cast(h, "float32"), g.const(W[f"{i}.wr"]), transpose_b=True)  # [B, E]
    if renormalize:
        top, idx = g.topk_last(logits, k)  # [B, k]
        top = g.softmax_last(top)
    else:  # the softmax is monotone: its top k are the logits' top k
        top, idx = g.topk_last(g.softmax_last(logits), k)
    onehot = g.gather(g.const(np.eye(E, dtype=np.float16)), idx)  # [B, k, E]
    route = g.matmul(g.cast(g.reshape(top, (0, 1, k)), "float16"), onehot)  # [B, 1, E]
    shared = None
    if f"{i}.sg" in W:  # Qwen2-MoE: a shared expert every token runs, times sigmoid(h . w_gate) (one logit per token)
        s = g.matmul(_silu_gate(g, g.matmul(h, g.const(W[f"{i}.sg"]), transpose_b=True), g.matmul(h, g.const(W[f"{i}.su"]), transpose_b=True)),
                     g.const(W[f"{i}.sd"]), transpose_b=True)  # [B, hidden]
        shared = g.mul(s, g.sigmoid(g.matmul(h, g.const(W[f"{i}.sgate"]), transpose_b=True)))  # [B, 1] broadcast over hidden
    gate, up = (g.matmul(h, g.const(W[f"{i}.{n}"].reshape(E * inter, hidden)), transpose_b=True) for n in ("wg", "wu"))  # [B, E * I]
    act = g.reshape(_silu_gate(g, gate, up), (0, E, 1, inter))
    y = g.matmul(act, g.const(W[f"{i}.wd"][None]), transpose_b=True)  # [B, E, 1, hidden]
    out = g.reshape(g.matmul(route, g.reshape(y, (0, E, hidden))), (0, hidden))
    return out if shared is None else g.add(out, shared)


def _reduce(g, x, tp: int):
    """x summed over the tp ranks (tensor parallelism: each rank's output projection gives a partial sum); x itself at tp 1."""
    return g.allreduce(x, tp) if tp > 1 else x


def decoder_step(g, spec: dict, W: dict[str, np.ndarray], P: dict[str, np.ndarray], ids, lens, past: list[list], cap: int, splits: int, n_pos: int,
                 tp: int = 1):
    """One generation step: ids [B] int32, lens [B] int32 (tokens cached before this one), past[layer] =
    the layer's cache buffers (cache_names). Returns (logits [B, V] float32, present[layer] = KvcAppend's 9 outputs).
    tp > 1: one rank's step, W and P its part (`shard`), past its heads' buffers; g.allreduce adds the ranks' partial
    sums after the attention's and the MLP's output projections."""
    a = spec["arch"]
    HKV, D, L = kv_heads_per_rank(spec, tp), a["head_dim"], a["n_layers"]
    H = HKV * (a["n_heads"] // a["n_kv_heads"])  # the query heads of its kv heads (a whole group when tp replicates them)
    eps = float(a["rms_eps"])
    cos_t, sin_t = rope_tables(np.asarray(spec["rope_inv_freq"], np.float32), n_pos, float(spec.get("rope_scale", 1.0)))
    R = g.const(rotate_half_matrix(D))
    x = g.gather(g.const(W["embed"]), ids)  # [B, hidden]
    cos = g.reshape(g.gather(g.const(cos_t), lens), (0, 1, D))
    sin = g.reshape(g.gather(g.const(sin_t), lens), (0, 1, D))
    lens1 = g.add(lens, g.const(np.ones((1,), np.int32)))  # the attention reads the new token too
    present = []
    for i in range(L):
        v = layer_variant(spec, i)
        ns = v.get("namespace", NAMESPACE)
        h = _rms_norm(g, x, W[f"{i}.ln1"], eps)
        q, k, vv = (_proj(g, h, W, i, n) for n in "qkv")
        q, k = g.reshape(q, (0, H, D)), g.reshape(k, (0, HKV, D))
        if f"{i}.kn" in W:  # Qwen3: RMSNorm of each head's q and k (one [D] weight for every head) before RoPE
            q, k = _rms_norm(g, q, W[f"{i}.qn"], eps, 3), _rms_norm(g, k, W[f"{i}.kn"], eps, 3)
        q, k = _rope(g, q, cos, sin, R), _rope(g, k, cos, sin, R)
        vv = g.reshape(vv, (0, HKV, D))
        if grouped(v):  # the per-channel key widths and their bit offsets (plugin_params k_bits, k_offsets)
            wr = rd = [g.const(P[n][i]) for n in ("k_bits", "k_offsets")]
        elif per_token(v):  # no key parameters; the decode also reads the query in the keys' basis (plugin_params q_rotation)
            wr = []
            rd = [g.cast(g.matmul(g.cast(q, "float32"), g.const(P["q_rotation"][None])), "float16") if v.get("key_rotate") else q]
        else:
            ks, kz, kzm = (g.const(P[n][i]) for n in ("k_scale", "k_zero", "k_zero_masked"))
            idx = g.const(np.ascontiguousarray(P["outlier_idx"][i][:, : v["n_out"]]))  # padded to the most outliers of any layer
            wr, rd = [ks, kz, idx], [ks, kzm, idx]
        new = g.plugin("KvcAppend", [k, vv, *wr, *past[i], lens], {"H": HKV, "D": D, "cap": cap}, len(cache_names(v)), ns)
        att = g.plugin("KvcDecodeAttention", [q, *rd, *new, lens1],
                       {"H": HKV, "G": H // HKV, "D": D, "splits": splits, "cap": cap, "sm_scale": float(D) ** -0.5}, 1, ns)[0]
        att = g.cast(att, "float16")
        if "att_heads" in W:  # replicated kv heads: the rank's own query heads of the group, for its columns of wo
            att = g.gather(att, g.const(W["att_heads"]), axis=1)
        att = g.reshape(att, (0, W[f"{i}.wo"].shape[1]))
        x = g.add(x, _reduce(g, g.matmul(att, g.const(W[f"{i}.wo"]), transpose_b=True), tp))
        h = _rms_norm(g, x, W[f"{i}.ln2"], eps)
        moe = a.get("moe")
        x = g.add(x, _reduce(g, _moe_mlp(g, h, W, i, a["hidden"], moe["top_k"], moe.get("normalization_mode", 1) == 1) if moe else _mlp(g, h, W, i), tp))
        present.append(new)
    x = _rms_norm(g, x, W["norm"], eps)
    return g.cast(g.matmul(x, g.const(W["lm_head"]), transpose_b=True), "float32"), present


# --------------------------------------------------------------------------------------------------
# TensorRT backend (runs only where tensorrt and tensorrt_llm==1.2.1 are installed; not run here)

class TrtGraph:
    """decoder_step's ops as TensorRT layers on the INetworkDefinition of a TensorRT-LLM Network."""

    def __init__(self, trt_network, registry, network=None):
        import tensorrt as trt

        self.trt, self.net, self.registry, self.keep = trt, trt_network, registry, []
        self.network = network  # TensorRT-LLM's Network (its functional ops, here the all-reduce, add layers to it)

    def _dtype(self, name: str):
        return {"float16": self.trt.float16, "float32": self.trt.float32, "int32": self.trt.int32}[name]

    def const(self, arr: np.ndarray):
        arr = np.ascontiguousarray(arr)
        self.keep.append(arr)  # TensorRT reads the weights at build time; keep them alive until then
        return self.net.add_constant(arr.shape, self.trt.Weights(arr)).get_output(0)

    def gather(self, table, idx, axis: int = 0):
        return self.net.add_gather(table, idx, axis).get_output(0)

    def matmul(self, a, b, transpose_b: bool = False):
        op = self.trt.MatrixOperation
        return self.net.add_matrix_multiply(a, op.NONE, b, op.TRANSPOSE if transpose_b else op.NONE).get_output(0)

    def _ew(self, a, b, op):
        return self.net.add_elementwise(a, b, op).get_output(0)

    def add(self, a, b):
        return self._ew(a, b, self.trt.ElementWiseOperation.SUM)

    def mul(self, a, b):
        return self._ew(a, b, self.trt.ElementWiseOperation.PROD)

    def div(self, a, b):
        return self._ew(a, b, self.trt.ElementWiseOperation.DIV)

    def cast(self, x, dtype: str):
        return self.net.add_cast(x, self._dtype(dtype)).get_output(0)

    def reshape(self, x, dims):
        layer = self.net.add_shuffle(x)
        layer.reshape_dims = tuple(dims)  # 0 copies the input's dimension
        return layer.get_output(0)

    def mean_last(self, x):
        return self.net.add_reduce(x, self.trt.ReduceOperation.AVG, 1 << (len(x.shape) - 1), True).get_output(0)

    def sqrt(self, x):
        return self.net.add_unary(x, self.trt.UnaryOperation.SQRT).get_output(0)

    def sigmoid(self, x):
        return self.net.add_activation(x, self.trt.ActivationType.SIGMOID).get_output(0)

    def softmax_last(self, x):
        layer = self.net.add_softmax(x)
        layer.axes = 1 << (len(x.shape) - 1)  # ISoftMaxLayer's default axis is not the last one
        return layer.get_output(0)

    def topk_last(self, x, k: int):
        layer = self.net.add_topk(x, self.trt.TopKOperation.MAX, k, 1 << (len(x.shape) - 1))
        return layer.get_output(0), layer.get_output(1)  # values, int32 indices

    def plugin(self, name: str, inputs: list, fields: dict, n_out: int, namespace: str = NAMESPACE):
        trt = self.trt
        creator = self.registry.get_creator(name, "1", namespace)
        if creator is None:
            raise RuntimeError(f"plugin {namespace}::{name} v1 is not registered: load the bundle's libkvcompress_trt.so first (--plugin-lib)")
        pf = [trt.PluginField(k, np.array([val], np.float32 if isinstance(val, float) else np.int32),
                              trt.PluginFieldType.FLOAT32 if isinstance(val, float) else trt.PluginFieldType.INT32) for k, val in fields.items()]
        plugin = creator.create_plugin(name, trt.PluginFieldCollection(pf), trt.TensorRTPhase.BUILD)
        layer = self.net.add_plugin_v3(inputs, [], plugin)
        return [layer.get_output(j) for j in range(n_out)]

    def allreduce(self, x, tp: int):
        """x summed over ranks 0..tp-1: TensorRT-LLM's allreduce (its AllReduce plugin; the NCCL strategy takes no
        workspace input; the sum in the network's plugin_config.nccl_plugin dtype, set to float16 by build_engine)."""
        from tensorrt_llm.functional import AllReduceParams, AllReduceStrategy, Tensor, allreduce

        t = Tensor(trt_tensor=x, network=self.network, is_network_input=False)
        return allreduce(t, list(range(tp)), AllReduceParams(strategy=AllReduceStrategy.NCCL)).trt_tensor

    def output(self, name: str, x):
        x.name = name
        self.net.mark_output(x)


def engine_io(spec: dict, cap: int, tp: int = 1) -> dict[str, tuple[tuple, str]]:
    """Engine inputs with their per-sequence shapes (after the batch dimension) and dtypes (one rank's at tp > 1: its kv heads)."""
    a = spec["arch"]
    io = {"input_ids": ((), "int32"), "lens": ((), "int32")}
    for i in range(a["n_layers"]):
        for c, (tail, dt) in cache_tails(layer_variant(spec, i), kv_heads_per_rank(spec, tp), a["head_dim"], cap).items():
            io[f"past.{i}.{c}"] = (tail, dt)
    return io


def build_engine(bundle: Path, hf_dir: Path, plugin_lib: Path, out: Path, max_batch: int, max_seq_len: int, splits: int | None = None,
                 tp: int = 1) -> Path:
    """Build the custom-tier engine with TensorRT-LLM's Builder; writes out/rank<r>.engine for each of the tp ranks (one
    process builds them in turn: the AllReduce plugin needs no communicator to build) and out/config.json."""
    import ctypes
    from collections import OrderedDict

    import tensorrt as trt
    from tensorrt_llm.builder import Builder
    from tensorrt_llm.functional import Tensor
    from tensorrt_llm.network import net_guard

    spec = load_spec(bundle)
    check_max_seq_len(spec, max_seq_len)
    check_tp(spec, tp)
    P = load_plugin_params(bundle)
    W = load_hf_weights(hf_dir, spec, P)
    cap = store_capacity(spec, max_seq_len)
    splits = splits or default_splits(spec, tp)
    ctypes.CDLL(str(plugin_lib), mode=ctypes.RTLD_GLOBAL)  # the library's static registrar adds both creators
    builder = Builder()
    dt = {"float16": trt.float16, "int32": trt.int32, "int8": trt.int8, "uint8": trt.uint8}
    opt = max(1, max_batch // 2)
    out.mkdir(parents=True, exist_ok=True)
    for rank in range(tp):
        Wr, Pr = shard(W, P, spec, tp, rank)
        network = builder.create_network()
        if tp > 1:
            network.plugin_config.nccl_plugin = "float16"  # the all-reduce's dtype (the residual stream's)
        with net_guard(network):
            g = TrtGraph(network.trt_network, trt.get_plugin_registry(), network)
            inputs = {}
            for name, (tail, dtype) in engine_io(spec, cap, tp).items():
                dims = OrderedDict([("batch_size", [[1, opt, max_batch]])] + [(f"{name}.{j}", [n]) for j, n in enumerate(tail)])
                inputs[name] = Tensor(name=name, dtype=dt[dtype], shape=[-1, *tail], dim_range=dims).trt_tensor
            past = [[inputs[f"past.{i}.{c}"] for c in cache_names(layer_variant(spec, i))] for i in range(spec["arch"]["n_layers"])]
            logits, present = decoder_step(g, spec, Wr, Pr, inputs["input_ids"], inputs["lens"], past, cap, splits, max_seq_len, tp)
            g.output("logits", logits)
            for i, bufs in enumerate(present):
                for c, t in zip(cache_names(layer_variant(spec, i)), bufs):
                    g.output(f"present.{i}.{c}", t)
        config = builder.create_builder_config(precision="float16", strongly_typed=True)
        config.trt_builder_config.set_preview_feature(trt.PreviewFeature.ALIASED_PLUGIN_IO_10_03, True)  # KvcAppend writes in place
        engine = builder.build_engine(network, config)
        if engine is None:
            raise RuntimeError(f"TensorRT-LLM's Builder.build_engine returned no engine for rank {rank} (see the TensorRT log above)")
        (out / f"rank{rank}.engine").write_bytes(bytes(engine))
        del g, network, engine  # the rank's weight constants
    (out / "config.json").write_text(json.dumps({"kvcompress_custom_tier": spec, "max_batch": max_batch, "max_seq_len": max_seq_len,
                                                 "cap": cap, "splits": splits, "tp": tp, "hf_dir": str(hf_dir), "plugin_lib": str(plugin_lib),
                                                 "bundle": str(Path(bundle).resolve())}, indent=2))
    return out


def generate(engine_dir: Path, prompts: list[str], max_new_tokens: int) -> list[str]:
    """Greedy generation with the custom-tier engine: the prompt is fed one token per step (the engine
    has generation steps only), then tokens are generated; past and present share the cache buffers."""
    from transformers import AutoTokenizer

    cfg = json.loads((Path(engine_dir) / "config.json").read_text())
    tok = AutoTokenizer.from_pretrained(cfg["hf_dir"])
    seqs = [tok.encode(p) for p in prompts]
    if max(map(len, seqs)) + max_new_tokens > cfg["max_seq_len"]:
        raise ValueError(f"{max(map(len, seqs)) + max_new_tokens} tokens exceed the engine's max_seq_len {cfg['max_seq_len']}")
    out_ids, _ = greedy_loop(engine_step(engine_dir, len(seqs)), seqs, max_new_tokens)
    return [tok.decode(o[len(s):]) for o, s in zip(out_ids, seqs)]


def check_engine(engine_dir: Path, check_file: Path | None = None) -> dict:
    """The engine against the validated decoding: the export's network-check tokens (CHECK_FILE in the bundle the engine
    was built from) fed one per step through the engine, compared as check_against_reference does with the CPU oracle."""
    cfg = json.loads((Path(engine_dir) / "config.json").read_text())
    path = Path(check_file) if check_file else Path(cfg["bundle"]) / CHECK_FILE
    n = len(load_check(path)[0]) - 1
    if n > cfg["max_seq_len"]:
        raise ValueError(f"{path} feeds {n} tokens, more than the engine's max_seq_len {cfg['max_seq_len']}: rebuild with --max-seq-len >= {n}")
    return check_against_reference(engine_step(engine_dir, 1), path)


def engine_rank(cfg: dict) -> int:
    """This process's rank for an engine of cfg["tp"] ranks: 0 at tp 1; else the MPI rank (tensorrt_llm._utils), refused
    unless the world is the engine's tp (the AllReduce plugin's NCCL communicator spans the MPI world)."""
    tp = cfg.get("tp", 1)
    if tp == 1:
        return 0
    from tensorrt_llm._utils import mpi_rank, mpi_world_size

    if mpi_world_size() != tp:
        raise ValueError(f"the engine has {tp} tensor-parallel ranks: run this under mpirun -n {tp} (MPI world size here: {mpi_world_size()})")
    return mpi_rank()


def engine_step(engine_dir: Path, B: int):
    """step(ids [B], lens [B]) -> logits [B, V] float32 (torch, CPU) on a built custom-tier engine with B sequences; the
    cache buffers are allocated zeroed and bound as past and present alike. A tensor-parallel engine: this process's
    rank (engine_rank) on GPU rank mod the GPUs it sees; every rank returns the same logits (after the last all-reduce)."""
    cfg = json.loads((Path(engine_dir) / "config.json").read_text())
    spec, cap, tp = cfg["kvcompress_custom_tier"], cfg["cap"], cfg.get("tp", 1)
    if B > cfg["max_batch"]:
        raise ValueError(f"{B} sequences exceed the engine's max_batch {cfg['max_batch']}")
    rank = engine_rank(cfg)
    import ctypes

    import tensorrt as trt
    import torch
    from tensorrt_llm.runtime.session import Session, TensorInfo

    if tp > 1:
        torch.cuda.set_device(rank % torch.cuda.device_count())
    ctypes.CDLL(cfg["plugin_lib"], mode=ctypes.RTLD_GLOBAL)
    session = Session.from_serialized_engine((Path(engine_dir) / f"rank{rank}.engine").read_bytes())
    tdt = {"float16": torch.float16, "int32": torch.int32, "int8": torch.int8, "uint8": torch.uint8}
    bufs = {n: torch.zeros((B, *tail), dtype=tdt[d], device="cuda") for n, (tail, d) in engine_io(spec, cap, tp).items()}
    trt_dt = {torch.float16: trt.float16, torch.int32: trt.int32, torch.int8: trt.int8, torch.uint8: trt.uint8}
    session.infer_shapes([TensorInfo(n, trt_dt[t.dtype], tuple(t.shape)) for n, t in bufs.items()])
    logits = torch.empty(B, spec["arch"]["vocab_size"], dtype=torch.float32, device="cuda")
    outputs = {"logits": logits} | {n.replace("past.", "present.", 1): t for n, t in bufs.items() if n.startswith("past.")}
    stream = torch.cuda.current_stream()

    def step(ids: list[int], lens: list[int]):
        bufs["input_ids"].copy_(torch.tensor(ids, dtype=torch.int32))
        bufs["lens"].copy_(torch.tensor(lens, dtype=torch.int32))
        if not session.run(bufs, outputs, stream.cuda_stream):
            raise RuntimeError("TensorRT enqueue failed")
        stream.synchronize()
        return logits.float().cpu()

    return step


def coarsen(logits, top_k: int | None = None) -> dict:
    """The validated decoding's log-probabilities at each step (logits [T, V] torch), in float64, kept as the top_k tokens'
    (`idx`, `logp`) and the log of the remaining tokens' mass (`rest`; -inf when top_k covers the vocabulary): what
    CHECK_FILE stores."""
    import torch

    lp = torch.log_softmax(logits.double(), -1)
    logp, idx = lp.topk(min(top_k or CHECK_TOP_K, lp.shape[-1]), -1)
    return {"idx": idx.to(torch.int32), "logp": logp, "rest": _rest(lp, idx)}


def _rest(lp, idx):
    """log of the probability mass outside idx, per row (a sum over the other tokens, not 1 minus the top's)."""
    import torch

    others = torch.ones_like(lp, dtype=torch.bool).scatter_(-1, idx.long(), False)
    return torch.logsumexp(lp.masked_fill(~others, float("-inf")), -1)


def coarse_kl(ref: dict, logits):
    """Per-step KL(reference || got) over the reference's top-k tokens and one bucket for the rest (logits [T, V] torch),
    in float64. Merging tokens into one bucket never raises a KL (the log-sum inequality), so this is at most the full KL
    and, with the rest's mass small, close to it: a distribution that passes here cannot be far off the full one on the
    tokens the reference considers likely."""
    import torch

    lq = torch.log_softmax(logits.double(), -1)
    q_top = lq.gather(-1, ref["idx"].long())
    p_rest = ref["rest"].double().exp()
    rest = torch.where(p_rest > 0, p_rest * (ref["rest"].double() - _rest(lq, ref["idx"])), torch.zeros_like(p_rest))
    return (ref["logp"].double().exp() * (ref["logp"].double() - q_top)).sum(-1) + rest


def save_check(path: Path, ids: list[int], ref: dict, meta: dict) -> None:
    """CHECK_FILE: ids [T + 1] int32 (fed one per step; the last is the final step's prediction), the coarsened reference
    [T, ...], and meta (tolerance, the CPU oracle's own coarse KL) in the safetensors header."""
    import torch
    from safetensors.torch import save_file

    tensors = {"ids": torch.tensor(ids, dtype=torch.int32), "idx": ref["idx"].contiguous(), "logp": ref["logp"].double().contiguous(),
               "rest": ref["rest"].double().contiguous()}
    tmp = Path(path).with_suffix(".tmp")
    save_file(tensors, str(tmp), metadata={k: json.dumps(v) for k, v in meta.items()})
    tmp.replace(path)


def load_check(path: Path) -> tuple[list[int], dict, dict]:
    """(ids, reference, meta) of a CHECK_FILE."""
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        t = {k: f.get_tensor(k) for k in f.keys()}
        meta = {k: json.loads(v) for k, v in (f.metadata() or {}).items()}
    return t["ids"].tolist(), {k: t[k] for k in ("idx", "logp", "rest")}, meta


def check_against_reference(step, path: Path) -> dict:
    """Feed CHECK_FILE's tokens through step(ids [1], lens [1]) -> logits [1, V] one per call (the engine's generation steps,
    the prompt crossing the fp16 window into the compressed store) and compare each step's distribution with the
    validated decoding's: mean and max coarse KL, top-1 agreement, pass = mean KL <= the export's tolerance."""
    import torch

    ids, ref, meta = load_check(path)
    got = step([ids[0]], [0]).float().reshape(1, -1)
    if int(ref["idx"].max()) >= got.shape[-1]:
        raise ValueError(f"{path} holds token ids up to {int(ref['idx'].max())}, past the engine's vocabulary of {got.shape[-1]}: "
                         f"give the network_check.safetensors of the export this engine was built from")
    got = torch.cat([got] + [step([tok], [t]).float().reshape(1, -1) for t, tok in enumerate(ids[:-1]) if t > 0])
    kl = coarse_kl(ref, got)
    tol = float(meta["kl_tolerance"])
    out = {"tokens": len(ids) - 1, "kl_mean": float(kl.mean()), "kl_max": float(kl.max()),
           "top1_agreement": float((got.argmax(-1) == ref["idx"][:, 0].long()).float().mean()), "kl_tolerance": tol,
           "cpu_oracle_kl_mean": meta.get("oracle_kl_mean")}
    return out | {"pass": out["kl_mean"] <= tol}


def greedy_loop(step, seqs: list[list[int]], max_new_tokens: int):
    """Drive a one-token-per-sequence step function: step(ids [B], lens [B]) -> logits [B, V] (torch).
    Each sequence feeds its prompt one token per step, then its own greedy tokens. Returns (the token
    lists, prompt + generated; per-step logits [steps, B, V]). Sequences that finish early keep
    stepping on their last token; those steps' outputs are ignored."""
    import torch

    out = [list(s) for s in seqs]
    pos = [0] * len(seqs)
    history = []
    for _ in range(max(map(len, seqs)) + max_new_tokens - 1):
        feed = [o[p] if p < len(o) else o[-1] for o, p in zip(out, pos)]
        logits = step(feed, list(pos))
        history.append(logits)
        top = logits.argmax(-1).tolist()
        for b, o in enumerate(out):
            if pos[b] == len(o) - 1 and len(o) < len(seqs[b]) + max_new_tokens:
                o.append(int(top[b]))
            pos[b] += 1
    return out, torch.stack(history)
