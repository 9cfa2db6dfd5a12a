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

This file is copied into the plugin bundle next to build_engine.py with the rest of the network's code (network_weights.py:
the HF weights as the network takes them; network_check.py: the export's check file and the step loops;
targets.bundle.NETWORK_FILES) and the weight readers; they import only numpy at module level (torch, tensorrt,
tensorrt_llm, safetensors inside the functions that need them).
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

# the rest of the network's code: in the package, its modules; in the plugin bundle (this file imported as a top-level
# module by build_engine.py), the files copied beside it (targets.bundle.NETWORK_FILES). The names below are also this
# module's, for build_engine.py and the export.
if __package__:
    from kvcompress.targets.network_check import CHECK_FILE, check_against_reference, greedy_loop, load_check
    from kvcompress.targets.network_weights import (FP8_METADATA, WeightsMismatch, weight_reader, safetensors_header, dense_shapes, layer_variant,
                                                    load_hf_weights, text_decoder_tensors)
else:
    from network_check import CHECK_FILE, check_against_reference, greedy_loop, load_check
    from network_weights import (FP8_METADATA, WeightsMismatch, weight_reader, safetensors_header, dense_shapes, layer_variant, load_hf_weights,
                                 text_decoder_tensors)

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
        headers |= {k: v for k, v in safetensors_header(f).items() if k != "__metadata__"}
    nvfp4 = weight_reader("nvfp4_weights")
    nv = nvfp4.packed_names(headers)  # NVFP4 codes [out, in / 2]: the [out, in] weight, its scales dropped
    drop = {p for parts in nv.values() for p in nvfp4.stored(parts)}
    drop |= {p for parts in weight_reader("int_weights").int8_names(headers).values() for p in parts.values() if p}  # int8 weights' scales
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


