"""CompressedCache: a transformers `Cache` that really stores the kvcompress format.

Per layer and sequence it holds: fp16 sink tokens, an fp16 window of the most recent tokens,
and the compressed store (packed int8/int4 key payload, fp16 outlier key channels, packed
value payload, fp16 per-token value scale and min). A token is encoded, with the reference
numerics and from its fp16 form, when it leaves the window. Token-grouped keys (kv.key.group_tokens
= G) are encoded a group at a time, when the group's first token leaves the window (all G tokens are
in it then, since window >= G): the key store runs up to G - 1 tokens ahead of the value store, and
those tokens are read from the window until they leave it. `update` hands attention the dequantized view.

Semantics, as serving engines run them (two named modes, one reference each in
`kvcompress.reference`):
* a call with C = 1 token is a **generation step** (decode-equivalent): the query at position t
  reads s in fp16 iff s < sink_tokens or t - s < window, else the compressed value (DESIGN §3);
* a call with C > 1 tokens is a **context-phase chunk** (prefill): the chunk's queries attend to
  the chunk's own tokens exactly (model dtype, as an engine's context-phase attention does on
  the fresh K/V), and to older tokens as the cache holds them after the chunk is stored.
Sinks are the first cache slots (with left padding these are pad slots).

    book = ScaleBook.load("runs/.../scalebook.safetensors")
    cache = CompressedCache(book)
    model.generate(input_ids, cache=cache, max_new_tokens=32)
    cache.nbytes()  # bytes of the real tensors held
"""
from __future__ import annotations

from pathlib import Path

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicLayer

from kvcompress import reference as ref
from kvcompress.errors import UserError
from kvcompress.hashing import fingerprint_match, legacy_path_fingerprint, path_fingerprint, warn_legacy
from kvcompress.scalebook import ScaleBook

_STORE = ("k_payload", "k_outliers", "v_payload", "v_scale", "v_min", "k_scale", "k_gscale", "k_gmin")


def _cat(a: torch.Tensor | None, b: torch.Tensor) -> torch.Tensor:
    return b if a is None else torch.cat([a, b], dim=-2)


class CompressedLayer(CacheLayerMixin):
    is_sliding = False

    def __init__(self, book: ScaleBook, layer_idx: int):
        super().__init__()
        self.p = book.key_params(layer_idx)
        self.spec = book.layer_spec(layer_idx)
        self.group = book.value_group(layer_idx)
        self.key_bits = book.key_bits(layer_idx)  # int, or per channel [H, D] (kv.key.alloc=waterfill)
        self.n_tokens = 0
        self.n_spilled = 0  # tokens that left the window (the value store's length)
        self.sink_k = self.sink_v = self.win_k = self.win_v = None
        self.store: dict[str, torch.Tensor | None] = dict.fromkeys(_STORE)

    def lazy_initialization(self, key_states, value_states) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def _encode_key_groups(self, spill: int) -> None:
        """Token-grouped keys: encode every group holding one of the `spill` oldest window tokens that is not
        encoded yet, from the window (which holds the whole group)."""
        G, s = self.spec.key.group_tokens, self.store
        n_enc = 0 if s["k_payload"] is None else s["k_payload"].shape[-2]
        while n_enc < self.n_spilled + spill:
            a = n_enc - self.n_spilled  # the group's first token, as a window index
            codes, scale, vmin = ref.quantize_keys_grouped(self.win_k[..., a : a + G, :], self._bits_bcast(), G)
            for name, t in (("k_payload", ref.pack_key_codes(codes, self.key_bits)), ("k_gscale", scale), ("k_gmin", vmin)):
                s[name] = _cat(s[name], t)
            n_enc += G

    def _bits_bcast(self):
        return self.key_bits.unsqueeze(-2) if torch.is_tensor(self.key_bits) else self.key_bits  # [H, 1, D]

    def _encode(self, k: torch.Tensor, v: torch.Tensor) -> None:
        # k, v: [B, H, n, D] tokens leaving the window
        sp, D = self.spec, k.shape[-1]
        k_payload = k_out = k_scale = None
        if self.spec.key.group_tokens:  # keys: encoded a group at a time (_encode_key_groups)
            pass
        elif self.spec.token_keys:  # per-token symmetric keys in a rotated basis: payload + fp16 scale
            k_payload, k_scale = ref.encode_rotated(k, sp.key.bits, sp.key_group(D), True, sp.key.rotate)
            k_out = None
        else:
            (k_payload, k_out), k_scale = ref.encode_keys(k, self.p), None
        if self.spec.rotated_values:
            v_parts = ref.encode_rotated(v, sp.value.bits, self.group, sp.value.symmetric, sp.value.rotate, sp.coded_min)
            v_payload, v_scale, v_min = (*v_parts, None)[:3]
        else:
            v_payload, v_scale, v_min = ref.encode_values(v, sp.value.bits, self.group)
        for name, t in zip(_STORE, (k_payload, k_out, v_payload, v_scale, v_min, k_scale)):
            if t is not None:
                self.store[name] = _cat(self.store[name], t)

    def update(self, key_states, value_states, *args, **kwargs):
        # key_states, value_states: [B, H, C, D] new post-RoPE tokens
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        k, v = key_states, value_states
        n_sink = self.sink_k.shape[-2] if self.sink_k is not None else 0
        take = min(self.spec.sink_tokens - n_sink, k.shape[-2])
        if take > 0:
            self.sink_k = _cat(self.sink_k, k[..., :take, :].to(ref.HP_DTYPE))
            self.sink_v = _cat(self.sink_v, v[..., :take, :].to(ref.HP_DTYPE))
            k, v = k[..., take:, :], v[..., take:, :]
        if k.shape[-2]:
            self.win_k = _cat(self.win_k, k.to(ref.HP_DTYPE))
            self.win_v = _cat(self.win_v, v.to(ref.HP_DTYPE))
            spill = self.win_k.shape[-2] - self.spec.window
            if spill > 0:  # the oldest tokens leave the window: encode them from their fp16 form
                if self.spec.key.group_tokens:
                    self._encode_key_groups(spill)
                self._encode(self.win_k[..., :spill, :], self.win_v[..., :spill, :])
                self.win_k, self.win_v = self.win_k[..., spill:, :], self.win_v[..., spill:, :]
                self.n_spilled += spill
        self.n_tokens += key_states.shape[-2]
        k_view, v_view = self._view()
        C = key_states.shape[-2]
        if C > 1:  # context phase: the chunk reads itself exactly
            k_view = torch.cat([k_view[..., :-C, :], key_states.to(self.dtype)], dim=-2)
            v_view = torch.cat([v_view[..., :-C, :], value_states.to(self.dtype)], dim=-2)
        return k_view, v_view

    def _view(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantized [B, H, n_tokens, D] keys and values, in the model's dtype."""
        ks, vs = [], []
        if self.sink_k is not None:
            ks.append(self.sink_k.to(self.dtype))
            vs.append(self.sink_v.to(self.dtype))
        if self.store["v_payload"] is not None:
            s, sp, D = self.store, self.spec, self.p.scale.shape[-1]
            if sp.key.group_tokens:  # whole groups are stored: the first n_spilled tokens are read compressed
                G = sp.key.group_tokens
                ks.append(ref.dequantize_keys_grouped(ref.unpack_key_codes(s["k_payload"], self.key_bits), s["k_gscale"], s["k_gmin"], G)[..., : self.n_spilled, :].to(self.dtype))
            elif self.spec.token_keys:
                ks.append(ref.decode_rotated((s["k_payload"], s["k_scale"]), sp.key.bits, sp.key_group(D), True, sp.key.rotate).to(self.dtype))
            else:
                ks.append(ref.decode_keys(s["k_payload"], s["k_outliers"], self.p).to(self.dtype))
            if self.spec.rotated_values:
                stored = (s["v_payload"], s["v_scale"]) if sp.value.symmetric else (s["v_payload"], s["v_scale"], s["v_min"])
                vs.append(ref.decode_rotated(stored, sp.value.bits, self.group, sp.value.symmetric, sp.value.rotate).to(self.dtype))
            else:
                vs.append(ref.decode_values(s["v_payload"], s["v_scale"], s["v_min"], sp.value.bits, self.group).to(self.dtype))
        if self.win_k is not None and self.win_k.shape[-2]:
            ks.append(self.win_k.to(self.dtype))
            vs.append(self.win_v.to(self.dtype))
        return torch.cat(ks, dim=-2), torch.cat(vs, dim=-2)

    def nbytes(self) -> dict[str, int]:
        def nb(t):
            return 0 if t is None else t.nbytes

        s = self.store
        out = {
            "key_payload": nb(s["k_payload"]),
            "key_outliers": nb(s["k_outliers"]),
            "value_payload": nb(s["v_payload"]),
            "value_meta": nb(s["v_scale"]) + nb(s["v_min"]),
            "sinks": nb(self.sink_k) + nb(self.sink_v),
            "window": nb(self.win_k) + nb(self.win_v),
            "static": self.p.scale.nbytes + self.p.zero.nbytes + self.p.outlier_idx.nbytes,
        }
        if self.spec.token_keys:  # no static key scales: a scale per token, stored with it
            out |= {"key_meta": nb(s["k_scale"]), "static": 0}
        if self.spec.key.group_tokens:  # an fp16 scale and min per channel per group of tokens; the bits per channel are static
            out |= {"key_meta": nb(s["k_gscale"]) + nb(s["k_gmin"]), "static": self.key_bits.numel() if torch.is_tensor(self.key_bits) else 0}  # uint8 each
        return out

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.n_tokens + query_length, 0

    def get_seq_length(self) -> int:
        return self.n_tokens

    def get_max_length(self) -> int:
        return -1


class _Fp16Layer(DynamicLayer):
    """The baseline (kv=fp16): a plain cache in the model's dtype."""

    def nbytes(self) -> dict[str, int]:
        n = 0 if not self.is_initialized or self.keys.numel() == 0 else self.keys.nbytes + self.values.nbytes
        return {"fp16_tokens": n, "static": 0}


class _HpLayer(_Fp16Layer):
    """An fp16 layer of a per-layer format: every token stored in fp16 (as the byte accounting
    counts it); decode reads the fp16 form, a prefill chunk reads itself exactly (as CompressedLayer)."""

    def update(self, key_states, value_states, *args, **kwargs):
        dt, C = key_states.dtype, key_states.shape[-2]
        keys, values = super().update(key_states.to(ref.HP_DTYPE), value_states.to(ref.HP_DTYPE), *args, **kwargs)
        keys, values = keys.to(dt), values.to(dt)
        if C > 1:
            keys = torch.cat([keys[..., :-C, :], key_states], dim=-2)
            values = torch.cat([values[..., :-C, :], value_states], dim=-2)
        return keys, values


def check_book_model(book: ScaleBook, model_path: str | Path) -> None:
    """Refuse a ScaleBook not profiled on the model at `model_path` (a directory of config/tokenizer/weight files, or a GGUF
    file): the fingerprint a run records (hashing.path_fingerprint) against the book's provenance.
    A book fingerprinted by the old edge hash (before 2026-12-07) is accepted, with a warning, when that hash matches."""
    p = Path(model_path)
    if not p.exists():
        raise UserError(f"CompressedCache: model_path={str(model_path)!r} does not exist (give the model's directory or GGUF file)")
    theirs = book.profiled("model").get("sha256")
    if not theirs:
        raise UserError("CompressedCache: this ScaleBook records no model fingerprint to check model_path against (drop model_path)")
    mine = path_fingerprint(p)
    match = fingerprint_match(theirs, mine, lambda: legacy_path_fingerprint(p))
    if match == "legacy":
        warn_legacy("this ScaleBook", str(model_path))
    if match:
        return
    raise UserError(f"CompressedCache: the ScaleBook was profiled on model {book.profiled('model').get('name', '?')} (fingerprint "
                    f"{theirs[:12]}), not on {model_path} (fingerprint {mine[:12]}): load the book of this model's run")


class CompressedCache(Cache):
    """A transformers Cache holding a ScaleBook's compressed format (see module docstring)."""

    def __init__(self, book: ScaleBook, model_path: str | Path | None = None):
        """`model_path`: the model's directory (or GGUF file) this cache will serve; the book is then refused unless it was
        profiled on those very files (its fingerprint, as a run checks it). Without it, only K/V shapes are checked
        (`update`): another model of the same shape (a fine-tune of this one) is not caught."""
        if model_path is not None:
            check_book_model(book, model_path)
        if book.spec.is_native:
            raise UserError(
                f"kv.format={book.spec.format} is TensorRT-LLM's own cache: serve it there (export=trtllm); "
                "validate simulates it exactly, CompressedCache holds the kvcompress format only"
            )
        n = book.geometry["n_layers"]
        # per-layer formats: an fp16 layer holds every token in fp16
        if book.spec.is_baseline:
            layers = [_Fp16Layer() for _ in range(n)]
        else:
            layers = [_HpLayer() if book.layer_spec(i).is_baseline else CompressedLayer(book, i) for i in range(n)]
        super().__init__(layers=layers)
        self.book = book

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        """transformers' Cache.update, after checking the model's K/V [B, kv heads, tokens, head_dim] at layer_idx against the
        geometry the ScaleBook was fitted for (another model's book was an IndexError, or applied silently at one shape)."""
        g = self.book.geometry
        if not 0 <= layer_idx < g["n_layers"] or key_states.dim() != 4 or tuple(key_states.shape[1::2]) != (g["n_kv_heads"], g["head_dim"]):
            raise UserError(f"CompressedCache: layer {layer_idx}'s keys are {list(key_states.shape)} [batch, kv heads, tokens, head_dim], but the "
                            f"ScaleBook was fitted for {g['n_layers']} layers x {g['n_kv_heads']} kv heads x head_dim {g['head_dim']}"
                            f" (model {self.book.profiled('model').get('name', '?')}): load the book of this model's run")
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def nbytes_breakdown(self) -> dict[str, int]:
        """Bytes of the real tensors held, by part, summed over layers."""
        out: dict[str, int] = {}
        for layer in self.layers:
            for k, v in layer.nbytes().items():
                out[k] = out.get(k, 0) + v
        return out

    def nbytes(self, include_static: bool = False) -> int:
        b = self.nbytes_breakdown()
        return sum(v for k, v in b.items() if include_static or k != "static")

    def bytes_per_token(self) -> float:
        """Per-sequence bytes per cached token (static scales excluded)."""
        n = self.get_seq_length()
        return self.nbytes() / n if n else 0.0
