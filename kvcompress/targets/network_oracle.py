"""CPU oracle of the custom-tier TensorRT-LLM network, and its check against the validated path.

`TorchGraph` runs `trtllm_network.decoder_step` -- the same function that adds the TensorRT layers --
eagerly with torch on CPU, the two plugins replaced by the acceptance kit's reference ops (the
numerics the kernels are tested against). `check_network` drives it with the same greedy loop the
engine's `generate` uses and compares its logits, step by step, with transformers' model decoding
token by token through `CompressedCache` (the path validate measures). Agreement shows the graph's
wiring -- RoPE convention, GQA head layout, append-then-read order, lens + 1, residuals, the MLP (Mixtral's
expert routing), tied embeddings -- is the validated model's; what it cannot show is TensorRT's own execution (not run here).
"""
from __future__ import annotations

import json
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from kvcompress import reference as ref
from kvcompress.kernels import ops
from kvcompress.targets import network_check as nc
from kvcompress.targets import trtllm_network as tn
from kvcompress.targets.acceptance import append_inputs, append_outputs, decode_inputs, reference_append, reference_output

DT = {"float16": torch.float16, "float32": torch.float32, "int32": torch.int32, "int8": torch.int8, "uint8": torch.uint8}


class TorchGraph:
    """decoder_step's ops, eagerly, in the dtypes the TensorRT network declares. `spec` (network.json):
    which variant each plugin namespace runs (the grouped family's value options are not in the buffers' shapes)."""

    def __init__(self, spec: dict | None = None, reduce=None):
        spec = spec or {}
        self.variants = {tn.NAMESPACE: spec.get("variant")} | {v["namespace"]: v for v in spec.get("layers") or []}
        self.reduce = reduce  # tensor parallelism: this rank's all-reduce (AllReduce.for_rank)

    def const(self, arr: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(arr))

    def gather(self, table, idx, axis: int = 0):  # IGatherLayer: table's axis replaced by idx's shape
        return table.index_select(axis, idx.long().flatten()).reshape(*table.shape[:axis], *idx.shape, *table.shape[axis + 1:])

    def matmul(self, a, b, transpose_b: bool = False):
        if a.dim() != b.dim() or a.dim() < 2:  # IMatrixMultiplyLayer: equal ranks >= 2, batch dims broadcast only from 1
            raise ValueError(f"TensorRT matrix multiply needs two inputs of the same rank >= 2; got {tuple(a.shape)} and {tuple(b.shape)}")
        if a.dtype != b.dtype:
            raise ValueError(f"TensorRT matrix multiply needs two inputs of one type; got {a.dtype} and {b.dtype}")
        b = b.transpose(-1, -2) if transpose_b else b
        if a.dtype == torch.float16:  # fp16 inputs, fp32 accumulation, fp16 result (as a GPU GEMM)
            return (a.float() @ b.float()).half()
        return a @ b

    @staticmethod
    def _same_rank(a, b):
        """IElementWiseLayer broadcasts only dimensions of length 1 between inputs of the same rank and type (no
        numpy-style rank or type promotion): a graph that relies on either would run here and fail in TensorRT."""
        if a.dim() != b.dim() or any(x != y and 1 not in (x, y) for x, y in zip(a.shape, b.shape)):
            raise ValueError(f"TensorRT elementwise needs inputs of the same rank, broadcast only from 1; got {tuple(a.shape)} and {tuple(b.shape)}")
        if a.dtype != b.dtype:  # no implicit promotion either (torch would promote fp16 * fp32 to fp32)
            raise ValueError(f"TensorRT elementwise needs inputs of one type; got {a.dtype} and {b.dtype}")

    def add(self, a, b):
        self._same_rank(a, b)
        return a + b

    def mul(self, a, b):
        self._same_rank(a, b)
        return a * b

    def div(self, a, b):
        self._same_rank(a, b)
        return a / b

    def cast(self, x, dtype: str):
        return x.to(DT[dtype])

    def reshape(self, x, dims):
        return x.reshape([x.shape[j] if d == 0 else d for j, d in enumerate(dims)])

    def mean_last(self, x):
        return x.mean(-1, keepdim=True)

    def sqrt(self, x):
        return x.sqrt()

    def sigmoid(self, x):
        return torch.sigmoid(x.float()).to(x.dtype)

    def softmax_last(self, x):
        return torch.softmax(x.float(), -1).to(x.dtype)

    def topk_last(self, x, k: int):
        v, i = torch.topk(x, k, dim=-1)  # ITopKLayer: values, int32 indices
        return v, i.to(torch.int32)

    def allreduce(self, x, tp: int):
        if self.reduce is None:
            raise RuntimeError(f"an all-reduce over {tp} ranks in a graph built without ranks (oracle_step(tp=...))")
        return self.reduce(x)

    def plugin(self, name: str, inputs: list, fields: dict, n_out: int, namespace: str = tn.NAMESPACE):
        # the reference ops read the static family's format from the buffers' shapes and dtypes, the grouped family's from its variant
        x = [t.numpy() for t in inputs]
        v = self.variants.get(namespace)
        if name == "KvcAppend":
            out = reference_append(dict(zip(append_inputs(v), x)), v)
            return [torch.from_numpy(out[k]) for k in append_outputs(v)]
        if name == "KvcDecodeAttention":
            return [torch.from_numpy(reference_output(dict(zip(decode_inputs(v), x)), fields["sm_scale"], v))]
        raise KeyError(name)


def plugin_params(book) -> dict[str, np.ndarray]:
    """The per-layer plugin constants of a ScaleBook (what the export writes to plugin_params.safetensors):
    the grouped family's key widths and bit offsets [L, H, D] int32, else the static key parameters."""
    L, D = book.geometry["n_layers"], book.geometry["head_dim"]
    if book.spec.key.group_tokens:
        bits = torch.stack([torch.as_tensor(book.key_bits(i)).expand(book.geometry["n_kv_heads"], D) for i in range(L)]).to(torch.int32)
        return {"k_bits": bits.contiguous().numpy(), "k_offsets": ref.bit_offsets(bits.long()).to(torch.int32).contiguous().numpy()}
    if book.spec.token_keys:  # the per-token family: the query's rotation into the keys' basis (rows: the rotated unit vectors)
        return {"q_rotation": ref.rotate(torch.eye(D), book.spec.key.rotate).float().contiguous().numpy()}
    H = book.geometry["n_kv_heads"]  # an fp16 layer of a per-layer format: scale 1, zero 0 (its kernels read none of them)
    per = [ops.kernel_key_params(ref.fp16_key_params(H, D) if book.layer_spec(i).is_baseline else book.key_params(i), "cpu")
           for i in range(book.geometry["n_layers"])]
    n_out = max(p[3].shape[-1] for p in per)  # per-layer formats: outlier counts differ; padded (a layer reads its first n_out)
    idx = [torch.nn.functional.pad(p[3], (0, n_out - p[3].shape[-1])) for p in per]
    out = {"k_scale": torch.stack([p[0] for p in per]).numpy(), "k_zero": torch.stack([p[1] for p in per]).numpy(),
           "k_zero_masked": torch.stack([p[2] for p in per]).numpy(), "outlier_idx": torch.stack(idx).numpy()}
    if book.spec.value_rotation_folded:  # the values' rotation (v -> v @ v_rotation), folded into W_v/W_o by the network
        out["v_rotation"] = ref.rotate(torch.eye(D), book.spec.value.rotate).float().contiguous().numpy()
    return out


def _variant_fields(v: dict) -> dict:
    out = {k: v[k] for k in ("name", "n_sink", "window", "key_bits", "value_bits", "group", "n_out")}
    if v.get("key_group_tokens"):  # the grouped family: its value options (the buffers' shapes do not show them)
        out |= {k: v[k] for k in ("key_group_tokens", "value_symmetric", "value_rotate", "value_coded_min")}
    elif v.get("key_group"):  # the per-token family: its key and value options
        out |= {k: v[k] for k in ("key_group", "key_rotate", "value_symmetric", "value_rotate", "value_coded_min")}
    return out


def key_max_position(book) -> int | None:
    """The positions a ScaleBook's asymmetric static keys hold at (fit_info key_max_position; per-layer books: the least
    of their formats'); None when no layer has such keys."""
    info = book.fit_info
    per = [f["key_max_position"] for f in info.get("per_format", {}).values() if "key_max_position" in f]
    if "key_max_position" in info:
        per.append(info["key_max_position"])
    return min(per) if per else None


def network_spec(book, variant: dict, hf_config, geom, identity: dict, splits: int, layers: list[dict] | None = None) -> dict:
    """network.json: what build_engine --tier custom needs besides the weights and the plugin constants.
    RoPE: the checkpoint's inverse frequencies with its scaling (the rule the TensorRT-LLM reader uses).
    layers (per-layer formats): each layer's variant, with the plugin namespace it registers in."""
    from kvcompress.targets.trtllm_ckpt import moe_block, num_experts, shared_expert_size, trtllm_config
    from kvcompress.targets.trtllm_reader import rope_inv_freq, rope_scale

    rc = trtllm_config(hf_config, geom, 1, "float16", None)
    shared = {"shared_expert": shared_expert_size(hf_config)} if shared_expert_size(hf_config) else {}  # Qwen2-MoE's gated shared expert
    moe = {"moe": moe_block(hf_config) | shared} if num_experts(hf_config) else {}
    inv = rope_inv_freq(geom.head_dim, rc["rotary_base"], rc["rotary_scaling"])
    scale = rope_scale(rc["rotary_scaling"])
    return {
        "arch": {"n_layers": hf_config.num_hidden_layers, "n_heads": hf_config.num_attention_heads,
                 "n_kv_heads": book.geometry["n_kv_heads"], "head_dim": book.geometry["head_dim"], "hidden": hf_config.hidden_size,
                 "vocab_size": hf_config.vocab_size, "rms_eps": float(hf_config.rms_norm_eps), "model_type": hf_config.model_type,
                 **moe},  # Mixtral, Qwen2/3-MoE: experts, top k, whether their softmax weights are renormalised (normalization_mode 1), a shared expert's size
        "rope_inv_freq": [float(f) for f in inv],
        **({"rope_scale": scale} if scale != 1.0 else {}),  # YaRN: the factor on cos and sin
        "variant": _variant_fields(variant),
        **({"layers": [{**_variant_fields(v), "namespace": v["namespace"]} for v in layers]} if layers else {}),
        "splits": splits,
        "format": book.spec.name,
        # int8k_int4v with kv.value.rotate=hadamard: the values' rotation lives in W_v/W_o (load_hf_weights folds plugin_params' v_rotation)
        "value_rotation": book.spec.value.rotate if book.spec.value_rotation_folded else "none",
        # asymmetric static keys: their ranges hold at positions below this (kv.key.max_position); build_engine refuses a longer max_seq_len
        **({"key_max_position": key_max_position(book)} if key_max_position(book) else {}),
        "weights": {"hf_dir": identity.get("weights_cache") or identity.get("path"), "identity": identity},
    }


def empty_past(spec: dict, B: int, cap: int, tp: int = 1) -> list[list[torch.Tensor]]:
    """The zeroed cache buffers of B sequences (one rank's heads at tp > 1)."""
    a = spec["arch"]
    out = []
    for i in range(a["n_layers"]):
        tails = tn.cache_tails(tn.layer_variant(spec, i), tn.kv_heads_per_rank(spec, tp), a["head_dim"], cap)
        out.append([torch.zeros((B, *tails[c][0]), dtype=DT[tails[c][1]]) for c in tn.cache_names(tn.layer_variant(spec, i))])
    return out


class AllReduce:
    """The oracle's stand-in for NCCL between its rank threads: each rank deposits its partial sum, waits for the others,
    and takes the sum, formed in float32 in rank order and rounded once to the partials' dtype (NCCL's own reduction
    order and fp16 rounding are not modelled: they differ from this by fp16 rounding)."""

    def __init__(self, tp: int):
        self.slots, self.barrier = [None] * tp, threading.Barrier(tp)

    def for_rank(self, rank: int):
        def reduce(x):
            self.slots[rank] = x
            self.barrier.wait()
            total = torch.stack([s.float() for s in self.slots]).sum(0).to(x.dtype)
            self.barrier.wait()  # every rank has read the slots before any deposits its next partial
            return total

        return reduce


def oracle_step(spec: dict, W: dict, P: dict, B: int, max_seq_len: int, splits: int = 1, tp: int = 1):
    """The engine's step(ids [B], lens [B]) -> logits [B, V] on the CPU oracle, with its own zeroed cache buffers.
    tp > 1: the tensor-parallel engine's tp ranks, each its part of W and P (trtllm_network.shard) and its heads' buffers,
    run as threads that meet at each all-reduce (AllReduce); the ranks' logits must agree, and rank 0's are returned."""
    cap = tn.store_capacity(spec, max_seq_len)
    parts = [tn.shard(W, P, spec, tp, r) for r in range(tp)]
    state = {"past": [empty_past(spec, B, cap, tp) for _ in range(tp)]}
    reducer = AllReduce(tp)
    graphs = [TorchGraph(spec, reducer.for_rank(r) if tp > 1 else None) for r in range(tp)]
    pool = ThreadPoolExecutor(tp, thread_name_prefix="oracle_rank") if tp > 1 else None

    def rank_step(r, ids, lens):
        try:
            with torch.no_grad():  # grad mode is per thread
                return tn.decoder_step(graphs[r], spec, *parts[r], ids, lens, state["past"][r], cap, splits, max_seq_len, tp)
        except BaseException:
            reducer.barrier.abort()  # the other ranks stop waiting at the all-reduce (BrokenBarrierError) instead of hanging
            raise

    def step(ids, lens):
        ids, lens = torch.tensor(ids, dtype=torch.int32), torch.tensor(lens, dtype=torch.int32)
        outs = [rank_step(0, ids, lens)] if tp == 1 else [f.result() for f in [pool.submit(rank_step, r, ids, lens) for r in range(tp)]]
        for r, (logits, _) in enumerate(outs[1:], 1):
            if not torch.equal(logits, outs[0][0]):
                raise RuntimeError(f"tensor-parallel rank {r}'s logits differ from rank 0's: the ranks' residual streams diverged")
        state["past"] = [present for _, present in outs]  # past and present are the same buffers on the engine
        return outs[0][0]

    if pool is not None:
        weakref.finalize(step, pool.shutdown, wait=False)
    return step


def oracle_generate(spec: dict, W: dict, P: dict, seqs: list[list[int]], max_new_tokens: int, max_seq_len: int, splits: int = 1, tp: int = 1):
    """The engine's greedy loop on the CPU oracle: (token lists, logits [steps, B, V])."""
    with torch.no_grad():
        return tn.greedy_loop(oracle_step(spec, W, P, len(seqs), max_seq_len, splits, tp), seqs, max_new_tokens)


@torch.no_grad()
def validated_logits(model, book, ids: list[int]) -> torch.Tensor:
    """transformers' model decoding `ids` one token per call through CompressedCache: logits [T, V]."""
    from kvcompress.cache import CompressedCache

    cache, out = CompressedCache(book), []
    for t, tok in enumerate(ids):
        o = model(input_ids=torch.tensor([[tok]]), cache=cache, use_cache=True, position_ids=torch.tensor([[t]]))
        out.append(o.logits[0, -1].float())
    return torch.stack(out)


def check_network(bundle: Path, hf_dir: Path, model, book, prompt_ids: list[int], max_new_tokens: int, kl_tolerance: float | None = None,
                  tp: int = 1) -> dict:
    """Oracle (the network graph, reference plugins, fp16 weights) vs CompressedCache decoding of the
    same tokens: per-step KL(validated || oracle), top-1 agreement, and whether the tokens crossed the
    window into the compressed store. With kl_tolerance (the export's), the tokens and the validated decoding's
    distributions are written to the bundle (trtllm_network.CHECK_FILE) for the engine's check on a GPU host. tp: the graph
    as tp tensor-parallel ranks (oracle_step)."""
    t0 = time.time()
    spec = tn.load_spec(bundle)
    P = tn.load_plugin_params(bundle)
    W = tn.load_hf_weights(hf_dir, spec, P)
    n = len(prompt_ids) + max_new_tokens
    toks, logits = oracle_generate(spec, W, P, [prompt_ids], max_new_tokens, max_seq_len=n + 1, tp=tp)
    ref_logits = validated_logits(model, book, toks[0][:-1])
    got = logits[:, 0]
    lp, lq = torch.log_softmax(ref_logits.double(), -1), torch.log_softmax(got.double(), -1)  # float64: KLs near 1e-7 on tiny models
    kl = (lp.exp() * (lp - lq)).sum(-1)
    v = tn.layer_variant(spec, 0)
    res = {"tokens": len(toks[0]) - 1, "crossed_into_store": len(toks[0]) - 1 > v["n_sink"] + v["window"],
           "kl_mean": float(kl.mean()), "kl_max": float(kl.max()), "top1_agreement": float((ref_logits.argmax(-1) == got.argmax(-1)).float().mean()),
           "max_abs_logit_diff": float((ref_logits - got).abs().max()), "seconds": round(time.time() - t0, 1)}
    if kl_tolerance is not None:  # kept for the GPU host: build_engine.py --tier custom --check compares the engine with it
        ref = nc.coarsen(ref_logits)
        nc.save_check(Path(bundle) / nc.CHECK_FILE, toks[0], ref,
                      {"kl_tolerance": kl_tolerance, "oracle_kl_mean": float(nc.coarse_kl(ref, got).mean()), "oracle_full_kl_mean": res["kl_mean"],
                       "top_k": int(ref["idx"].shape[-1])})  # as kept (the vocabulary caps it)
        res["check_file"] = nc.CHECK_FILE
    return res


def write_network_files(out: Path, spec: dict, params: dict[str, np.ndarray]) -> None:
    from safetensors.numpy import save_file

    out.mkdir(parents=True, exist_ok=True)
    save_file(params, str(out / tn.PARAMS_FILE))
    (out / tn.SPEC_FILE).write_text(json.dumps(spec, indent=2))
