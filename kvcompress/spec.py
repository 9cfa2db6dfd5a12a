"""The KV-cache quantization scheme: frozen, validated types (pydantic), nothing else.

`KVSpec` is what `conf/kv/<name>.yaml` describes. Every field has a closed set of
allowed values; a bad value fails with a message that names the key and what is allowed.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator

PLANE_BITS = (3, 5, 6, 7)  # code widths stored in bit planes (reference.pack_codes: 3 bits as three planes, 5..7 a nibble plus planes)
LOW_BITS = (3,)  # below 4 bits: the token-grouped family only (kv=wf3: water-filled keys at a mean of 3 bits, symmetric 3-bit values)
WATERFILL_MEANS = (3, 4, 5, 6)  # kv.key.bits of kv.key.alloc=waterfill: the mean width (each RoPE pair 1..8 bits); the means the kernels are tested at
GROUP_RANGE_TOKENS = (32, 64, 128)  # token-group sizes whose per-channel key ranges profile records (kv.key.alloc=waterfill)


class Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class KeySpec(Frozen):
    """Post-RoPE keys: static per-channel scale s[d] from calibration.

    q = clamp(round_half_even((k - z[d]) / s[d]), -Q, Q), Q = 2**(bits-1) - 1;  k_hat = q * s[d] + z[d]
    (z = 0 when symmetric).
    """

    # 5..7 (PLANE_BITS): kv.key.granularity=token (a nibble plus bit planes, reference.pack_codes) or token-grouped keys
    # (group_tokens > 0: the mean width of one bitstream per row, reference.pack_bits); 3 (LOW_BITS): the mean width of
    # water-filled token-grouped keys only (kv=wf3)
    bits: Literal[3, 4, 5, 6, 7, 8, 16] = 8
    # "token" (CompressedCache, validate, the Triton kernels and the custom-tier export): per-token symmetric scales computed at write
    # time over groups of group_size channels (0 = the whole head), usually after a rotation
    granularity: Literal["channel", "token"] = "channel"
    group_size: int = Field(0, ge=0)  # granularity=token only
    rotate: Literal["none", "hadamard"] = "none"  # granularity=token only: x @ H per head before quantizing (q gets the same)
    symmetric: bool = True
    # how the clipping range is chosen: see kvcompress/observers
    clip: Literal["minmax", "mse", "percentile"] = "mse"
    clip_percentile: float = Field(99.99, gt=50.0, le=100.0)
    # scale[d] == scale[d + D/2]: commutes with RoPE (needed for the exact export fold)
    tie_rope_pairs: bool = True
    # 0: the static per-channel scales above. G > 0: token-grouped keys (as KIVI, Liu et al. 2024): per-channel
    # asymmetric scales computed at write time over groups of G tokens aligned at the first compressed position
    # (fp16 scale and min per channel and group); in validate, CompressedCache, the Triton kernels and the custom-tier export
    group_tokens: int = Field(0, ge=0)
    # token-grouped keys only: "uniform" gives every channel `bits`; "waterfill" spends bits * D bits per token
    # unevenly, channel by channel (reference.waterfill_bits: RoPE pairs alike, 1..8 bits each), where the
    # calibration queries' energy times the channel's group range says the q.k score error is largest
    alloc: Literal["uniform", "waterfill"] = "uniform"
    # asymmetric static keys (the arc ranges, observers.base.arc_ranges): the positions 0..max_position-1 their ranges must
    # hold at; None = the model's max_position. Serving at a shorter context than the model's (e.g. 8K of Llama 3.1's
    # 128K) tightens the slow RoPE pairs' ranges; keys at later positions can clip (the export records the limit and the
    # custom-tier engine build refuses a longer --max-seq-len)
    max_position: Optional[int] = Field(None, ge=1)


class ValueSpec(Frozen):
    """Values: per-token scales computed at write time, in channel groups, asymmetric.

    scale = (max - min) / (2**bits - 1), q = clamp(round_half_even((v - min) / scale), 0, 2**bits - 1)
    """

    # 5..7 (PLANE_BITS): beside per-token or token-grouped keys, as the rotated formats and kv=wf5/wf6; 3 (LOW_BITS, three
    # bit planes): symmetric, beside token-grouped keys only (kv=wf3)
    bits: Literal[3, 4, 5, 6, 7, 8, 16] = 4
    granularity: Literal["token"] = "token"
    group_size: int = Field(32, ge=0)  # 0 = the whole head_dim is one group
    # symmetric=True: Triton kernels with per-token or token-grouped keys only (scale = amax / (2**(bits-1) - 1), no min).
    # rotate=hadamard: v @ H per head before quantizing, undone after attention; beside static per-channel keys
    # (int8k_int4v, asymmetric values, fp16 min) it ships folded into the weights (value_rotation_folded)
    symmetric: bool = False
    rotate: Literal["none", "hadamard"] = "none"
    # "code" (asymmetric values, per-token keys only): each group's min is a uint8 code, -w * scale / 16 for
    # 4-bit values (reference.value_meta_coded): 3 bytes per group instead of 4
    min: Literal["fp16", "code"] = "fp16"


class LayerFormat(Frozen):
    """One layer's format in a per-layer (mixed) kvcompress spec: what varies from layer to layer.

    key_bits == value_bits == 16: the layer stays fp16 (every token). Window, sinks, clipping
    method, symmetry and RoPE tying are the spec's, shared by all layers.
    """

    key_bits: Literal[4, 5, 6, 7, 8, 16]  # 5..7 (PLANE_BITS): in the per-token and token-grouped families only (KVSpec checks)
    value_bits: Literal[4, 5, 6, 7, 8, 16]
    value_group: int = Field(32, ge=0)  # 0 = the whole head_dim is one group
    outlier_channels: int = Field(0, ge=0)

    @model_validator(mode="after")
    def _consistent(self) -> "LayerFormat":
        if (self.key_bits == 16) != (self.value_bits == 16):
            raise ValueError(f"a layer format is fp16 (key_bits=value_bits=16) or quantized (4..8); got key_bits={self.key_bits} value_bits={self.value_bits}")
        return self

    @property
    def is_fp16(self) -> bool:
        return self.key_bits == 16

    @property
    def label(self) -> str:
        """Short name: fp16, k8v4, k4v4g64o2 (group shown when not 32, outliers when > 0)."""
        if self.is_fp16:
            return "fp16"
        g = "" if self.value_group == 32 else f"g{self.value_group}"
        o = f"o{self.outlier_channels}" if self.outlier_channels else ""
        return f"k{self.key_bits}v{self.value_bits}{g}{o}"


class KVSpec(Frozen):
    """A KV-cache format.

    format=kvcompress: the full format (per-channel keys, per-token values, window, sinks, outliers).
    format=native_int8 / native_fp8: TensorRT-LLM's own KV cache, simulated exactly: one scale per
    layer shared by K and V, no window, no sinks (key/value bits and groups are then unused).
    format=native_nvfp4: TensorRT-LLM's NVFP4 KV cache (FP4 e2m1 values, one FP8 e4m3 scale per 16
    contiguous channels computed on write, the per-layer scale as the global scale; Blackwell). With
    fold_keys (fold_values), per-channel key (value) factors tied across RoPE pairs are folded into
    W_q/W_k (W_v/W_o) first, so the single scale sees equalised channels. "auto" (the default) lets
    `fit` decide each fold and its strength by measuring the error on the calibration sample; the
    decision is recorded in the ScaleBook.
    """

    name: str
    format: Literal["kvcompress", "native_int8", "native_fp8", "native_nvfp4"] = "kvcompress"
    fold_keys: Union[bool, Literal["auto"]] = "auto"
    fold_values: Union[bool, Literal["auto"]] = "auto"
    fold_strength: Union[float, Literal["auto"]] = "auto"  # 0 = no migration, 1 = full equalisation
    # key pairs (fit.pair_transforms): also rotate each RoPE pair of W_q/W_k by its own angle (exact:
    # planar rotations commute with RoPE) and, for FP8, shrink it onto FP8's grid, each chosen per pair
    # on the calibration sample. "auto": native_fp8 only (the held-out KL of native_int8 measured
    # worse with it: INT8's error is not relative, so there is nothing to spread); true also allows
    # native_int8; native_nvfp4's 16-element blocks couple pairs, so it is not offered there.
    fold_pairs: Union[bool, Literal["auto"]] = "auto"
    # the serving context fold_pairs chooses angles and shrinks for (fit.pair_transforms): 0 (default)
    # scores each pair at the calibration windows' positions; N > 0 averages its score over the
    # positions up to N, where RoPE has turned the pair further. Measured on the embedded model it
    # trades quality at 1K for quality at 8K (docs/format.md, "Pair angles for long context")
    pair_context: int = Field(0, ge=0)
    # native formats: per-layer scale = amax * headroom / qmax. "auto": `fit` takes the largest
    # headroom whose error on the calibration sample stays within 1% of no headroom (free for FP8 and
    # NVFP4 until subnormals, costly for INT8), so held-out K/V beyond the calibrated amax don't saturate
    headroom: Union[float, Literal["auto"]] = "auto"
    key: KeySpec = KeySpec()
    value: ValueSpec = ValueSpec()
    window: int = Field(128, ge=0)  # most recent tokens kept in fp16
    sink_tokens: int = Field(4, ge=0)  # first tokens kept in fp16
    outlier_channels: int = Field(0, ge=0)  # key channels per kv-head kept in fp16 (0 = off)
    # per-layer formats (kvcompress format only): a tuple with one LayerFormat per layer overrides
    # key.bits, value.bits, value.group_size and outlier_channels layer by layer; "auto" (kv=auto):
    # the tune stage chooses them (the fewest bytes within the gates); "split" (kv=rot_split, the
    # per-token family): the tune stage chooses each layer's split of key.bits + value.bits between
    # keys and values (split_formats: the same bytes), the lowest KL; "budget" (kv=int8k_budget, the static family):
    # the tune stage spends the uniform format's bytes per token layer by layer over budget_formats (value groups
    # and value bits), the lowest KL within those bytes; None: the fields above apply to every layer
    layers: Union[Literal["auto", "split", "budget"], tuple[LayerFormat, ...], None] = None

    @model_validator(mode="after")
    def _consistent(self) -> "KVSpec":
        if self.layers is not None and (self.is_native or self.key.group_tokens):
            raise ValueError(f"kv.layers (per-layer formats) needs format=kvcompress without token-grouped keys; got format={self.format}, "
                             f"key.group_tokens={self.key.group_tokens}")
        if (self.key.bits == 16) != (self.value.bits == 16):
            raise ValueError("key.bits and value.bits must both be 16 (the fp16 baseline) or both be 3..8")
        if self.is_native and (self.window or self.sink_tokens or self.outlier_channels):
            raise ValueError(f"kv.format={self.format} has no window, sinks or outlier channels; set kv.window=0 kv.sink_tokens=0 kv.outlier_channels=0")
        if (self.fold_keys is True or self.fold_values is True) and not self.is_native:
            raise ValueError(f"kv.fold_keys / kv.fold_values apply to the native formats (native_int8, native_fp8, native_nvfp4) only; kv.format={self.format}")
        if self.key.group_tokens and (self.is_native or self.outlier_channels or self.window < self.key.group_tokens):
            raise ValueError(f"kv.key.group_tokens={self.key.group_tokens} (token-grouped keys) needs the kvcompress format, no outlier channels "
                             f"and kv.window >= group_tokens (a group is quantized once all its tokens left the window); got window={self.window}")
        if self.key.alloc == "waterfill" and (self.key.group_tokens not in GROUP_RANGE_TOKENS or self.key.bits not in WATERFILL_MEANS):
            raise ValueError(f"kv.key.alloc=waterfill needs token-grouped keys, kv.key.group_tokens in {list(GROUP_RANGE_TOKENS)} (the group "
                             f"sizes profile records ranges for), and kv.key.bits (the mean width) in {list(WATERFILL_MEANS)}; got "
                             f"group_tokens={self.key.group_tokens}, bits={self.key.bits}")
        if self.headroom != "auto" and not self.headroom >= 1.0:
            raise ValueError(f"kv.headroom={self.headroom} must be 'auto' or a number >= 1")
        low = [f"kv.{n}.bits={b}" for n, b in (("key", self.key.bits), ("value", self.value.bits)) if b in LOW_BITS]
        if low and not (self.key.group_tokens and self.key.alloc == "waterfill" and self.value.symmetric and not self.is_native):
            raise ValueError(f"{', '.join(low)}: 3-bit codes are in the token-grouped family with water-filled keys and symmetric values "
                             f"only (kv=wf3: kv.key.group_tokens > 0, kv.key.alloc=waterfill, kv.value.symmetric=true); got group_tokens="
                             f"{self.key.group_tokens}, alloc={self.key.alloc}, value.symmetric={self.value.symmetric}, format={self.format}")
        odd = [f"kv.{n}.bits={b}" for n, b in (("key", self.key.bits), ("value", self.value.bits)) if b in PLANE_BITS]
        if odd and not ((self.key.granularity == "token" or self.key.group_tokens) and not self.is_native):
            raise ValueError(f"{', '.join(odd)}: 5..7-bit codes are in the per-token family (kv.key.granularity=token) and the token-grouped "
                             f"family (kv.key.group_tokens > 0) only, format=kvcompress; allowed elsewhere: 4, 8 (16 = fp16); got "
                             f"granularity={self.key.granularity}, group_tokens={self.key.group_tokens}, format={self.format}")
        if self.key.rotate != "none" and self.key.granularity != "token":
            raise ValueError(f"kv.key.rotate={self.key.rotate} needs kv.key.granularity=token (static per-channel scales follow RoPE pairs, not a rotated basis)")
        if self.key.granularity == "token" and (not self.key.symmetric or self.key.group_tokens or self.outlier_channels):
            raise ValueError("kv.key.granularity=token is symmetric per token: needs kv.key.symmetric=true, kv.key.group_tokens=0, kv.outlier_channels=0")
        if self.value.min == "code" and (self.value.symmetric or self.key.granularity != "token" or self.is_native):
            raise ValueError("kv.value.min=code codes the asymmetric values' min in the per-token family: needs kv.value.symmetric=false "
                             f"and kv.key.granularity=token (format=kvcompress); got symmetric={self.value.symmetric}, granularity={self.key.granularity}, format={self.format}")
        if (self.validate_only or self.key.group_tokens) and (self.is_native or self.layers is not None):
            raise ValueError(f"kv={self.name}: the comparison-only key/value options (token-grouped keys, symmetric values beside "
                             f"static keys) need format=kvcompress without kv.layers")
        if self.layers == "split" and not self.token_keys:
            raise ValueError(f"kv.layers=split chooses each layer's key/value bit split, which needs the per-token family "
                             f"(kv.key.granularity=token, 5..7-bit codes); got granularity={self.key.granularity}")
        if self.key.max_position is not None and (self.key.symmetric or self.key.granularity != "channel" or self.key.group_tokens
                                                  or not self.key.tie_rope_pairs or self.key.clip == "percentile" or self.is_native):
            raise ValueError(f"kv.key.max_position={self.key.max_position} sets where asymmetric static keys' ranges hold: needs "
                             f"kv.key.symmetric=false, granularity=channel, tie_rope_pairs=true, clip minmax or mse, format=kvcompress "
                             f"(kv=int8k_asym_rotv); got symmetric={self.key.symmetric}, granularity={self.key.granularity}, clip={self.key.clip}")
        if self.layers == "budget" and (self.token_keys or self.key.bits not in (4, 8) or self.value.bits not in (4, 8)):
            raise ValueError(f"kv.layers=budget spends the bytes of the static family's format layer by layer (static per-channel keys, "
                             f"4- or 8-bit keys and values); got granularity={self.key.granularity}, key.bits={self.key.bits}, value.bits={self.value.bits}")
        if self.layers == "split" and not 8 <= self.key.bits + self.value.bits <= 16:
            raise ValueError(f"kv.layers=split splits kv.key.bits + kv.value.bits between keys and values (each 4..8): the sum must be "
                             f"8..16; got {self.key.bits} + {self.value.bits}")
        if self.is_mixed:
            for i, f in enumerate(self.layers):
                try:
                    _layer_spec(self, i)
                except ValueError as e:
                    raise ValueError(f"kv.layers[{i}]={f.label}: {_first_error(e)}") from None
        if self.value_rotation_folded and self.is_native:
            raise ValueError(f"kv={self.name}: kv.value.rotate needs format=kvcompress")
        if self.pair_context and not self.pairs_folded:
            raise ValueError(f"kv.pair_context={self.pair_context} sets the context kv.fold_pairs chooses its angles for, and this spec "
                             "folds no pairs; allowed: 0, or a context with native_fp8 (or native_int8 with kv.fold_pairs=true)")
        if self.fold_pairs is True and (self.format not in ("native_fp8", "native_int8") or self.fold_keys is False):
            raise ValueError(f"kv.fold_pairs=true rotates folded key pairs of native_fp8 or native_int8 and needs kv.fold_keys auto or true; "
                             f"got format={self.format}, fold_keys={self.fold_keys}")
        if self.fold_strength != "auto" and not 0.0 <= self.fold_strength <= 1.0:
            raise ValueError(f"kv.fold_strength={self.fold_strength} must be 'auto' or in [0, 1]")
        return self

    @property
    def validate_only(self) -> str:
        """Why the format is a comparison format (validated, in CompressedCache and the Triton kernels, but
        not in the TensorRT plugins or the export), or "" when it ships. The per-token family (kv=rot4,
        kv=rot8k_int4v) and the grouped family (kv=wf4) ship; rotated or symmetric values beside static
        per-channel keys do not (no kernel reads them)."""
        why = []
        if self.rotated_values and not (self.key.group_tokens or self.token_keys or self.value_rotation_folded):
            why.append(f"values symmetric={self.value.symmetric} rotate={self.value.rotate} min={self.value.min}")
        return ", ".join(why)

    @property
    def value_rotation_folded(self) -> bool:
        """Hadamard-rotated asymmetric values (fp16 min) beside static per-channel keys: the custom tier ships the
        rotation folded into the weights (W_v' = H W_v and its bias per kv head, W_o' = W_o H per query head:
        exact, H orthogonal and symmetric), so the static-family kernels, which quantize whatever values they
        are given with reference.encode_values, store encode_values(v H) as validate simulates."""
        return (self.value.rotate != "none" and not self.value.symmetric and self.value.min == "fp16" and not self.is_native
                and not (self.token_keys or self.key.group_tokens))

    @property
    def token_keys(self) -> bool:
        """Keys quantized per token at write time (reference.encode_rotated), no static scales."""
        return self.key.granularity == "token" and not self.is_native

    @property
    def rotated_values(self) -> bool:
        """Values through reference.encode_rotated (symmetric and/or rotated) instead of encode_values."""
        return (self.value.symmetric or self.value.rotate != "none" or self.value.min == "code") and not self.is_native

    @property
    def coded_min(self) -> bool:
        """Asymmetric values whose min is a uint8 code (kv.value.min=code, reference.value_meta_coded)."""
        return self.value.min == "code" and not self.is_native

    def key_group(self, head_dim: int) -> int:
        return self.key.group_size or head_dim

    @property
    def pairs_folded(self) -> bool:
        """Whether fit chooses per-pair key rotations (kv.fold_pairs; see the field)."""
        if self.fold_pairs == "auto":
            return self.format == "native_fp8" and self.fold_keys is not False
        return self.fold_pairs

    @property
    def is_native(self) -> bool:
        return self.format != "kvcompress"

    @property
    def fp16_positions(self) -> int:
        """The leading positions of a sequence whose attention reads only fp16 K/V: the sinks plus the recent window
        (position p = fp16_positions is the first to read a compressed entry; it predicts token p + 1)."""
        return self.sink_tokens + self.window

    @property
    def tier(self) -> str:
        """'native' (stock TensorRT-LLM KV format), 'custom' (the kvcompress format) or 'baseline'."""
        return "native" if self.is_native else ("baseline" if self.is_baseline else "custom")

    @property
    def is_baseline(self) -> bool:
        """fp16 everywhere: the cache is a no-op."""
        if self.is_mixed:
            return all(f.is_fp16 for f in self.layers)
        return self.key.bits == 16 and not self.is_native

    @property
    def is_mixed(self) -> bool:
        """A format per layer (kv.layers is a tuple)."""
        return isinstance(self.layers, tuple)

    @property
    def is_auto(self) -> bool:
        """kv=auto, kv.layers=split or kv.layers=budget before tuning: the per-layer formats are still to be chosen."""
        return self.layers in TUNED_LAYERS

    @property
    def is_split(self) -> bool:
        """kv.layers=split before tuning: each layer's key/value bit split is still to be chosen."""
        return self.layers == "split"

    @property
    def is_budget(self) -> bool:
        """kv.layers=budget before tuning: each layer's value format, within the uniform format's bytes, is still to be chosen."""
        return self.layers == "budget"

    def budget_formats(self) -> tuple["LayerFormat", ...]:
        """kv.layers=budget's candidates: the spec's own format first, then its keys with the value groups halved and
        doubled and with 8-bit values in the spec's groups (more or fewer bytes than the spec's: the tune stage keeps
        the total within the spec's). Key bits, outlier channels and everything else are the spec's."""
        g = self.value.group_size
        own = LayerFormat(key_bits=self.key.bits, value_bits=self.value.bits, value_group=g, outlier_channels=self.outlier_channels)
        alt = [own.model_copy(update={"value_group": h}) for h in (2 * g, *((g // 2,) if g >= 4 and g % 2 == 0 else ())) if g]
        if self.value.bits != 8:
            alt.append(own.model_copy(update={"value_bits": 8}))
        return tuple(dict.fromkeys([own, *alt]))

    def split_formats(self) -> tuple["LayerFormat", ...]:
        """kv.layers=split's candidates: every (key bits, value bits) with key.bits + value.bits between them,
        each 4..8 and no fewer bits to keys than to values (on the embedded model 5/7 and 4/8 lost on every layer),
        most bits to keys first; value.group_size and the value metadata as the spec's, so every candidate takes
        the same bytes per token (reference.row_width: D * bits / 8 per row)."""
        total = self.key.bits + self.value.bits
        return tuple(LayerFormat(key_bits=k, value_bits=total - k, value_group=self.value.group_size)
                     for k in range(8, 3, -1) if 4 <= total - k <= k)

    def layer(self, i: int) -> "KVSpec":
        """The uniform spec that layer i follows (self when the spec is not mixed)."""
        return _layer_spec(self, i) if self.is_mixed else self

    def layer_formats(self, n_layers: int) -> tuple[LayerFormat, ...]:
        """One LayerFormat per layer (a uniform spec repeated)."""
        if self.is_mixed:
            if len(self.layers) != n_layers:
                from kvcompress.errors import UserError

                raise UserError(f"kv.layers has {len(self.layers)} formats but the model has {n_layers} layers")
            return self.layers
        return (LayerFormat(key_bits=self.key.bits, value_bits=self.value.bits, value_group=self.value.group_size,
                            outlier_channels=self.outlier_channels),) * n_layers

    def check_geometry(self, head_dim: int) -> None:
        """Raise UserError if the spec cannot apply to a head of this size."""
        from kvcompress.errors import UserError

        if self.is_mixed:
            for i, f in enumerate(self.layers):
                if head_dim % (f.value_group or head_dim) or f.outlier_channels >= head_dim:
                    raise UserError(f"kv.layers[{i}]: value_group={f.value_group} must divide head_dim={head_dim} and "
                                    f"outlier_channels={f.outlier_channels} must be < head_dim")
                if {f.key_bits, f.value_bits} & set(PLANE_BITS) and head_dim % 8:
                    raise UserError(f"kv.layers[{i}]={f.label}: 5..7-bit codes are stored as bit planes of head_dim / 8 bytes; "
                                    f"head_dim={head_dim} is not a multiple of 8")
        if self.key.granularity == "token" and head_dim % self.key_group(head_dim):
            raise UserError(f"kv.key.group_size={self.key.group_size} must divide head_dim={head_dim}")
        # the values' rotation folded into W_v/W_o works in blocks (reference.hadamard_block); the kernels' need a power of two
        if (self.key.rotate == "hadamard" or (self.value.rotate == "hadamard" and not self.value_rotation_folded)) and head_dim & (head_dim - 1):
            raise UserError(f"kv.key.rotate/kv.value.rotate=hadamard needs a power-of-two head_dim here (rotated in the kernels); got head_dim={head_dim}")
        g = head_dim if self.is_native else self.value.group_size or head_dim  # a native format's scales are per layer: no groups
        if head_dim % g:
            raise UserError(f"kv.value.group_size={self.value.group_size} must divide head_dim={head_dim}")
        if self.outlier_channels >= head_dim:
            raise UserError(f"kv.outlier_channels={self.outlier_channels} must be < head_dim={head_dim}")
        if head_dim % 2:
            raise UserError(f"head_dim={head_dim} must be even (int4 packing, RoPE pairs)")
        if {self.key.bits, self.value.bits} & set(PLANE_BITS) and head_dim % 8:
            raise UserError(f"3- and 5..7-bit codes are stored as bit planes of head_dim / 8 bytes; head_dim={head_dim} is not a multiple of 8")
        if self.key.group_tokens and head_dim * self.key.bits % 32:
            raise UserError(f"token-grouped keys are stored as rows of head_dim * kv.key.bits / 8 bytes, read as 32-bit words: head_dim * bits "
                            f"must be a multiple of 32; got head_dim={head_dim}, kv.key.bits={self.key.bits}")
        if self.format == "native_nvfp4" and head_dim % 16:
            raise UserError(f"kv=native_nvfp4 needs head_dim divisible by its 16-element blocks; head_dim={head_dim}")

    def value_group(self, head_dim: int) -> int:
        return self.value.group_size or head_dim


def _first_error(e: ValueError) -> str:
    """The message of a pydantic validation error's first error (or of a plain ValueError)."""
    errs = getattr(e, "errors", None)
    return str(errs()[0]["msg"]).removeprefix("Value error, ") if callable(errs) else str(e)


@lru_cache(maxsize=4096)
def _layer_spec(spec: KVSpec, i: int) -> KVSpec:
    f = spec.layers[i]
    d = spec.model_dump()
    d["layers"] = None
    d["key"]["bits"], d["value"]["bits"] = f.key_bits, f.value_bits
    d["value"]["group_size"], d["outlier_channels"] = f.value_group, f.outlier_channels
    return KVSpec.model_validate(d)


def mixed_spec(base: KVSpec, formats, name: str | None = None, **updates) -> KVSpec:
    """`base` (its window, sinks, clipping) with one LayerFormat per layer."""
    d = base.model_dump()
    d.update(layers=tuple(LayerFormat.model_validate(f) if isinstance(f, dict) else f for f in formats), **updates)
    if name is not None:
        d["name"] = name
    return KVSpec.model_validate(d)


TUNED_LAYERS = ("auto", "split", "budget")  # kv.layers values the tune stage resolves into per-layer formats

NATIVE_ALGO = {"native_int8": "INT8", "native_fp8": "FP8", "native_nvfp4": "NVFP4"}  # TensorRT-LLM kv_cache_quant_algo
ALGO_FORMAT = {v: k for k, v in NATIVE_ALGO.items()}


def native_spec(fmt: str) -> KVSpec:
    """The stock TensorRT-LLM KV format `fmt` (native_int8 | native_fp8 | native_nvfp4), fold decided in fit."""
    return KVSpec(name=fmt, format=fmt, window=0, sink_tokens=0)
