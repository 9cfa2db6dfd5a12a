"""The kernels' cache layout for one layer: fixed-capacity buffers, a batch of variable lengths.

For sequence b holding n = lens[b] tokens (positions 0..n-1), with NS sink slots and a window of W:
    positions p < NS                -> sink_k/sink_v[b, h, p]                      fp16
    compressed positions            -> index c = p - NS in the compressed store     packed
    the last min(n - NS, W) tokens  -> window ring slot (p - NS) % W                fp16
A token enters the ring when appended and is encoded (reference numerics) when the ring slot
is reused W tokens later; with W = 0 it is encoded on append.

Buffers ([B, H, *, *], contiguous):
    sink_k, sink_v  [B, H, NS, D] fp16          win_k, win_v [B, H, W, D] fp16
    k_payload       [B, H, CAP, D] int8 | [B, H, CAP, D/2] uint8 (int4, offset-binary, low nibble = even)
    k_outliers      [B, H, CAP, N_OUT] fp16     v_payload [B, H, CAP, D] uint8 | [.., D/2] (int4)
    (the per-token family also takes 5..7-bit codes: rows of D * bits / 8 bytes, the low nibbles as int4's
    then one D/8-byte plane per further bit, reference.pack_codes)
    v_scale, v_min  [B, H, CAP, D/G] fp16       lens [B] int32
The per-token family (key_group > 0: kv.key.granularity=token, e.g. kv=rot4) has no static key
parameters: k_payload holds signed codes of the (Hadamard-rotated if key_rotate) key, int8 or packed
offset-binary (q + 2**(bits-1): int4, or 5..7 bits as nibble and planes), and k_scale [B, H, CAP, D/key_group] fp16 its per-token scales; with
value_symmetric the values are signed codes the same way (v_payload int8 for 8 bits) and v_min is
unused; value_rotate stores values in the rotated basis (reference.encode_rotated); value_coded_min
(kv.value.min=code) makes v_min uint8 codes (reference.value_meta_coded).
An fp16 layer of a per-layer format (key_bits == value_bits == 16, static family, the same sinks and
window as every layer, so one CAP serves all layers): k_payload and v_payload [B, H, CAP, D] fp16 hold
each token leaving the window as it came; k_outliers is empty and v_scale, v_min are [B, H, 1, 1], one row
per head that is neither written nor read (no bytes per token beyond the fp16 K and V).
The grouped family (key_group_tokens = GT > 0: kv.key.group_tokens, e.g. kv=wf4 and kv=kivi_int4) stores
keys per channel over groups of GT compressed tokens (group j: compressed indices [GT*j, GT*j + GT)):
k_payload [B, H, CAPG*GT, D*key_bits/8] uint8 holds each token's codes as one bitstream of varying
widths, key_bits_table [H, D] (reference.pack_bits; a uniform table of 4 is pack_int4's layout), and
k_gscale, k_gmin [B, H, CAPG, D] fp16 each group's scale and min. A group is written whole when its
first token leaves the ring (all GT tokens are in it then: window >= GT); its later tokens stay readable
in fp16 from the ring until they leave it. Its values follow the per-token family's value options.
`PackedKV.from_reference` builds one from plain K/V with the reference numerics, so tests
compare kernels with the reference on identical bytes.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcompress import reference as ref
from kvcompress.reference import KeyParams


@dataclass
class PackedKV:
    sink_k: torch.Tensor
    sink_v: torch.Tensor
    win_k: torch.Tensor
    win_v: torch.Tensor
    k_payload: torch.Tensor
    k_outliers: torch.Tensor
    v_payload: torch.Tensor
    v_scale: torch.Tensor
    v_min: torch.Tensor
    lens: torch.Tensor
    key_bits: int
    value_bits: int
    group: int
    k_scale: torch.Tensor | None = None  # [B, H, CAP, D / key_group] fp16; per-token family only
    key_group: int = 0  # 0: static per-channel keys (KeyParams); > 0: per-token symmetric keys
    key_rotate: bool = False
    value_symmetric: bool = False
    value_rotate: bool = False
    value_coded_min: bool = False
    key_group_tokens: int = 0  # > 0: the grouped family (token-grouped keys)
    key_bits_table: torch.Tensor | None = None  # [H, D] int32 bits of each key channel (grouped family)
    k_gscale: torch.Tensor | None = None  # [B, H, CAPG, D] fp16 (grouped family)
    k_gmin: torch.Tensor | None = None

    @property
    def grouped(self) -> bool:
        """The grouped family (kv_append_grp_kernel / decode_split_grp_kernel)."""
        return bool(self.key_group_tokens)

    @property
    def key_bit_offsets(self) -> torch.Tensor:
        """[H, D] int32: where each key channel's code starts in a row's bitstream (reference.pack_bits)."""
        return ref.bit_offsets(self.key_bits_table).to(torch.int32)

    @property
    def per_token(self) -> bool:
        """The per-token family (kv_append_rot_kernel / decode_split_rot_kernel)."""
        return bool(self.key_group)  # empty() refuses the value options without per-token keys

    @property
    def n_sink(self) -> int:
        return self.sink_k.shape[2]

    @property
    def window(self) -> int:
        return self.win_k.shape[2]

    @property
    def key_how(self) -> str:
        return "hadamard" if self.key_rotate else "none"

    @property
    def value_how(self) -> str:
        return "hadamard" if self.value_rotate else "none"

    @classmethod
    def empty(cls, B, H, D, cap, *, n_sink, window, n_out, key_bits, value_bits, group, device="cpu",
              key_group=0, key_rotate=False, value_symmetric=False, value_rotate=False, value_coded_min=False,
              key_group_tokens=0, key_bits_table=None) -> "PackedKV":
        if (key_rotate or value_symmetric or value_rotate or value_coded_min) and not (key_group or key_group_tokens):
            raise ValueError("the per-token kernels need per-token keys (key_group > 0)")
        if key_group_tokens:
            if key_group or key_rotate or not window >= key_group_tokens:
                raise ValueError(f"token-grouped keys (key_group_tokens={key_group_tokens}) are unrotated, per channel, with window >= key_group_tokens; "
                                 f"got key_group={key_group}, key_rotate={key_rotate}, window={window}")
            key_bits_table = (torch.full((H, D), key_bits) if key_bits_table is None else key_bits_table).to(torch.int32).to(device)
            if int(key_bits_table.sum(-1).min()) != int(key_bits_table.sum(-1).max()) or int(key_bits_table[0].sum()) != key_bits * D:
                raise ValueError(f"key_bits_table: every head's row must spend key_bits * D = {key_bits * D} bits")
        if value_coded_min and value_symmetric:
            raise ValueError("a coded min is for asymmetric values (value_symmetric=False)")
        fp16 = key_bits == ref.FP16_BITS
        if (value_bits == ref.FP16_BITS) != fp16 or fp16 and (key_group or key_group_tokens or n_out or group != D):
            raise ValueError(f"an fp16 store (key_bits = value_bits = 16) is the static family with no outlier channels and one value group; "
                             f"got key_bits={key_bits} value_bits={value_bits} n_out={n_out} group={group}")
        if (key_bits in ref.PLANE_BITS or value_bits in ref.PLANE_BITS) and not (key_group or key_group_tokens):
            raise ValueError(f"5..7-bit codes (key_bits={key_bits}, value_bits={value_bits}) are in the per-token (key_group > 0) and "
                             f"token-grouped (key_group_tokens > 0) families only")
        f16 = dict(dtype=torch.float16, device=device)
        kd, vd = ref.row_width(D, key_bits), ref.row_width(D, value_bits)
        capg = -(-cap // key_group_tokens) if key_group_tokens else 0
        cap = capg * key_group_tokens or cap  # the grouped family: every store holds whole groups of rows (one CAP for keys and values)
        vrows = 1 if fp16 else cap  # an fp16 store has no value scales: one unused row per head, not one per token
        return cls(
            sink_k=torch.zeros(B, H, n_sink, D, **f16),
            sink_v=torch.zeros(B, H, n_sink, D, **f16),
            win_k=torch.zeros(B, H, window, D, **f16),
            win_v=torch.zeros(B, H, window, D, **f16),
            k_payload=torch.zeros(B, H, cap, kd, dtype=torch.float16 if fp16 else torch.uint8 if key_bits < 8 or key_group_tokens else torch.int8, device=device),
            k_outliers=torch.zeros(B, H, cap, n_out, **f16),
            v_payload=torch.zeros(B, H, cap, vd, dtype=torch.float16 if fp16 else torch.int8 if value_symmetric and value_bits == 8 else torch.uint8,
                                  device=device),
            v_scale=torch.zeros(B, H, vrows, D // group, **f16),
            v_min=torch.zeros(B, H, vrows, D // group, dtype=torch.uint8 if value_coded_min else torch.float16, device=device),
            lens=torch.zeros(B, dtype=torch.int32, device=device),
            key_bits=key_bits,
            value_bits=value_bits,
            group=group,
            k_scale=torch.zeros(B, H, cap, D // key_group if key_group else 0, **f16),
            key_group=key_group,
            key_rotate=key_rotate,
            value_symmetric=value_symmetric,
            value_rotate=value_rotate,
            value_coded_min=value_coded_min,
            key_group_tokens=key_group_tokens,
            key_bits_table=key_bits_table,
            k_gscale=torch.zeros(B, H, capg, D, **f16),
            k_gmin=torch.zeros(B, H, capg, D, **f16),
        )

    @classmethod
    def from_reference(cls, ks: list[torch.Tensor], vs: list[torch.Tensor], p: KeyParams, *, n_sink, window, value_bits, group, cap=None,
                       key_group=0, key_rotate=False, value_symmetric=False, value_rotate=False, value_coded_min=False,
                       key_group_tokens=0, key_bits_table=None) -> "PackedKV":
        """Sequences of different lengths (k: [H, n_b, D] each) -> buffers written by the reference.
        For the per-token and grouped families (key_group > 0, key_group_tokens > 0) only p.bits is read."""
        B, (H, _, D) = len(ks), ks[0].shape
        cap = cap or max(1, max(k.shape[1] for k in ks))
        fam = dict(key_group=key_group, key_rotate=key_rotate, value_symmetric=value_symmetric, value_rotate=value_rotate, value_coded_min=value_coded_min,
                   key_group_tokens=key_group_tokens, key_bits_table=key_bits_table)
        out = cls.empty(B, H, D, cap, n_sink=n_sink, window=window, n_out=p.outlier_idx.shape[-1], key_bits=p.bits, value_bits=value_bits, group=group,
                        device=ks[0].device, **fam)
        for b, (k, v) in enumerate(zip(ks, vs)):
            n = k.shape[1]
            kh, vh = k.to(torch.float16), v.to(torch.float16)
            ns, nc, nw = ref.region_sizes(n, n_sink, window)
            out.sink_k[b, :, :ns], out.sink_v[b, :, :ns] = kh[:, :ns], vh[:, :ns]
            if nc:
                kc, vc = kh[:, ns : ns + nc], vh[:, ns : ns + nc]
                if out.grouped:  # whole groups, from tokens still in the window for the last one
                    GT, bits = key_group_tokens, out.key_bits_table.long()
                    ng = -(-nc // GT)
                    codes, gs, gm = ref.quantize_keys_grouped(kh[:, ns : ns + ng * GT], bits.unsqueeze(-2), GT)
                    out.k_payload[b, :, : ng * GT] = ref.pack_key_codes(codes, bits)
                    out.k_gscale[b, :, :ng], out.k_gmin[b, :, :ng] = gs, gm
                    v_parts = ref.encode_rotated(vc, value_bits, group, value_symmetric, out.value_how, value_coded_min)
                elif out.per_token:
                    out.k_payload[b, :, :nc], out.k_scale[b, :, :nc] = ref.encode_rotated(kc, p.bits, key_group, True, out.key_how)
                    v_parts = ref.encode_rotated(vc, value_bits, group, value_symmetric, out.value_how, value_coded_min)
                elif p.bits == ref.FP16_BITS:  # an fp16 layer: the tokens themselves
                    out.k_payload[b, :, :nc], out.v_payload[b, :, :nc] = kc, vc
                    v_parts = ()
                else:
                    payload, outl = ref.encode_keys(kc, p)
                    out.k_payload[b, :, :nc], out.k_outliers[b, :, :nc] = payload, outl
                    v_parts = ref.encode_values(vc, value_bits, group)
                for name, t in zip(("v_payload", "v_scale", "v_min"), v_parts):
                    getattr(out, name)[b, :, :nc] = t
            for pos in range(ns + nc, n):
                slot = (pos - n_sink) % window
                out.win_k[b, :, slot], out.win_v[b, :, slot] = kh[:, pos], vh[:, pos]
            out.lens[b] = n
        return out
