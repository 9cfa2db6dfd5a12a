"""Bytes one decode step moves through global memory, derived from the kernels' loop structure.

decode_split_kernel runs one program per (sequence, kv head, split). A program reads its query
rows (the G query heads of the kv head: GQA shares every K/V byte among them, so each cache byte
is read once per kv head, not once per query head), the kv head's static key scale and zero
(fp32 [D] each) and outlier index; its main loop reads each compressed token of its share once
(key payload, fp16 outliers, value payload, value scale and min); the last split also reads the
fp16 sinks and window. Each program writes its partials (max, sum, acc[D]) in fp32; the reduce
kernel reads them and writes the fp32 output. Nothing else touches global memory.

`format_bytes` is the reference byte accounting of the same cache (kvcompress.reference); the
audit and tests compare the two.
"""
from __future__ import annotations

from dataclasses import dataclass

from kvcompress import reference as ref


@dataclass(frozen=True)
class DecodeShape:
    batch: int
    n_q_heads: int
    n_kv_heads: int
    head_dim: int
    context: int


@dataclass(frozen=True)
class CacheFormat:
    name: str
    key_bits: int  # 16 = the fp16 cache (a plain attention read)
    value_bits: int
    group: int
    n_sink: int
    window: int
    n_out: int = 0
    key_group: int = 0  # > 0: per-token key scales (one fp16 per key_group channels), no static key parameters
    value_symmetric: bool = False  # symmetric values: a scale per group, no min
    rotate: bool = False  # per-token family: keys and values Hadamard-rotated (kv=rot4, kv=rot8k_int4v); grouped family: values
    coded_min: bool = False  # the values' min a uint8 code per group (kv.value.min=code): 3 bytes per group
    key_group_tokens: int = 0  # > 0: the grouped family (kv=wf4): an fp16 scale and min per key channel per group of this many tokens

    def family(self) -> dict:
        """The per-token or grouped family's layout options (PackedKV.empty / aot.Variant keywords)."""
        if self.key_group_tokens:
            return dict(key_group_tokens=self.key_group_tokens, value_symmetric=self.value_symmetric, value_rotate=self.rotate,
                        value_coded_min=self.coded_min)
        return dict(key_group=self.key_group, key_rotate=self.rotate, value_symmetric=self.value_symmetric, value_rotate=self.rotate,
                    value_coded_min=self.coded_min)

    def block_t(self, head_dim: int) -> int:
        """The decode kernel's token tile for this format (kvcompress.kernels.plan)."""
        from kvcompress.kernels import plan

        return plan.block_t(head_dim, self.value_bits, plan.decode_warps(head_dim, bool(self.key_group or self.key_group_tokens)), self.key_group_tokens)

    def token_bytes(self, head_dim: int) -> float:
        """Bytes of one compressed token of one kv head (payload + per-token metadata)."""
        return head_dim * (self.key_bits + self.value_bits) / 8 + self.meta_bytes(head_dim)

    def meta_bytes(self, head_dim: int) -> float:
        """Per-token metadata of one kv head: fp16 outliers, value scale (and min), per-token key scales;
        the grouped family's key scale and min per group, amortised over its tokens."""
        key_groups = 4 * head_dim / self.key_group_tokens if self.key_group_tokens else 0
        return self.n_out * 2 + self.token_meta_bytes(head_dim) + key_groups

    def token_meta_bytes(self, head_dim: int) -> int:
        """Metadata stored with each compressed token: the value scale (and min), per-token key scales."""
        key_meta = (head_dim // self.key_group) * 2 if self.key_group else 0
        n_groups = head_dim // self.group
        return key_meta + (n_groups * (2 + 1) if self.coded_min else n_groups * 2 * (1 if self.value_symmetric else 2))


FP16 = CacheFormat("fp16", 16, 16, 1, 0, 0)


def decode_bytes(shape: DecodeShape, fmt: CacheFormat, splits: int) -> dict[str, float]:
    """Global-memory bytes of one decode step of one layer, by component."""
    B, Hq, H, D = shape.batch, shape.n_q_heads, shape.n_kv_heads, shape.head_dim
    G, bh = Hq // H, shape.batch * shape.n_kv_heads
    if fmt.key_bits == 16:  # an fp16 cache read by a fused attention kernel: K, V, query, output
        return {"fp16_kv": bh * shape.context * 2 * D * 2, "query": B * Hq * D * 2, "output": B * Hq * D * 2}
    ns, nc, nw = ref.region_sizes(shape.context, fmt.n_sink, fmt.window)
    programs = bh * splits
    # the grouped family: each key group's scale and min once from HBM (its tiles re-read them from cache)
    key_groups = bh * -(-nc // fmt.key_group_tokens) * 4 * D if fmt.key_group_tokens else 0
    return {
        "key_payload": bh * nc * D * fmt.key_bits / 8,
        "key_outliers": bh * nc * fmt.n_out * 2,
        "value_payload": bh * nc * D * fmt.value_bits / 8,
        "value_meta": bh * nc * fmt.token_meta_bytes(D) + key_groups,  # value scale (and min), per-token key scales, key groups' scale and min
        "sinks": bh * ns * 2 * D * 2,
        "window": bh * nw * 2 * D * 2,
        "query": programs * G * (D + fmt.n_out) * 2,
        "key_params": 0 if fmt.key_group else programs * (2 * D * 4 + fmt.n_out * 4),
        "lens": programs * 4,
        "partials": programs * G * (D + 2) * 4 + B * Hq * splits * (D + 2) * 4,  # written by the splits, read by the reduce
        "output": B * Hq * D * 4,
    }


def format_bytes(shape: DecodeShape, fmt: CacheFormat) -> int:
    """The reference byte accounting of one layer's cache at shape.context tokens (no static part)."""
    if fmt.key_bits == 16:
        return shape.batch * shape.n_kv_heads * shape.context * 2 * shape.head_dim * 2
    b = ref.cache_nbytes(n_layers=1, n_kv_heads=shape.n_kv_heads, head_dim=shape.head_dim, key_bits=fmt.key_bits,
                         value_bits=fmt.value_bits, value_group=fmt.group, outlier_channels=fmt.n_out,
                         sink_tokens=fmt.n_sink, window=fmt.window, n_tokens=shape.context, batch=shape.batch,
                         key_token_group=fmt.key_group, value_symmetric=fmt.value_symmetric, value_coded_min=fmt.coded_min,
                         key_group_tokens=fmt.key_group_tokens)
    return sum(v for k, v in b.items() if k != "static")


def main_loop_bytes(fmt: CacheFormat, head_dim: int, block: int) -> dict[str, float]:
    """What one main-loop iteration of one program reads: BLOCK_T compressed tokens."""
    D = head_dim
    return {"payload": block * D * (fmt.key_bits + fmt.value_bits) / 8, "metadata": block * fmt.meta_bytes(D)}


# ---------------------------------------------------------------- the rows predict_decode.py and bench_decode_attention.py print
# Llama-3.1 shapes (config.json of meta-llama/Llama-3.1-70B / -8B): layers, query heads, kv heads, head dim
MODELS = {"llama3.1-70b": (80, 64, 8, 128), "llama3.1-8b": (32, 32, 8, 128)}
CONTEXTS = (4096, 32768, 131072)
# the custom-tier formats with compiled head-dim-128 variants (kvcompress.kernels.aot VARIANTS): name -> CacheFormat
FORMATS = {
    "int8k_int4v": CacheFormat("int8k_int4v", 8, 4, 32, 4, 128, 0),
    "int8": CacheFormat("int8", 8, 8, 128, 4, 128, 0),
    "int4": CacheFormat("int4", 4, 4, 32, 4, 128, 2),
    "rot4": CacheFormat("rot4", 4, 4, 128, 4, 128, 0, key_group=128, value_symmetric=True, rotate=True),
    "rot8k_int4v": CacheFormat("rot8k_int4v", 8, 4, 32, 4, 128, 0, key_group=128, rotate=True, coded_min=True),
    "rot7k_int5v": CacheFormat("rot7k_int5v", 7, 5, 32, 4, 128, 0, key_group=128, rotate=True, coded_min=True),
    # mean 4 (5, 6, 3) key bits (water-filled widths are a runtime table: the bytes are those of a uniform 4)
    "wf4": CacheFormat("wf4", 4, 4, 128, 4, 128, 0, value_symmetric=True, rotate=True, key_group_tokens=128),
    "wf5": CacheFormat("wf5", 5, 5, 128, 4, 128, 0, value_symmetric=True, rotate=True, key_group_tokens=128),
    "wf6": CacheFormat("wf6", 6, 6, 128, 4, 128, 0, value_symmetric=True, rotate=True, key_group_tokens=128),
    "wf3": CacheFormat("wf3", 3, 3, 128, 4, 128, 0, value_symmetric=True, rotate=True, key_group_tokens=128),
}
ROW_COLUMNS = ("model", "gpu", "context", "batch", "format", "splits", "kvc_us", "fp16_us", "speedup")
