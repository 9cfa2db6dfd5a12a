"""A synthetic Llama checkpoint of any size, written shard by shard (never held in memory).

For proving that a streamed run's memory is bounded by a layer, not by the model: random
weights (seeded, init std 0.02, norms 1), a byte-level tokenizer, `config.json`, sharded
`model-0000i-of-0000n.safetensors` with `model.safetensors.index.json`, the layout of a Hugging
Face checkpoint directory. The numbers such a model produces are meaningless; its memory and
time are not.

    python -m kvcompress.models.synthetic --out /tmp/synth --gb 4.8
"""
from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

DTYPE_NAMES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def synthetic_config(target_gb: float, hidden: int = 2048, heads: int = 16, kv_heads: int = 4, intermediate: int = 5632,
                     vocab: int = 49152, dtype: str = "float32", tie: bool = False, max_position: int = 8192, rope: dict | None = None):
    """A LlamaConfig whose checkpoint is about target_gb (10^9 bytes) in `dtype` (rope: transformers'
    rope_parameters, e.g. Llama-3.1's {"rope_type": "llama3", "factor": 8.0, ...})."""
    from transformers import LlamaConfig

    esize = torch.empty(0, dtype=DTYPE_NAMES[dtype]).element_size()
    hd = hidden // heads
    per_layer = (2 * hidden * hidden + 2 * hidden * kv_heads * hd + 3 * hidden * intermediate + 2 * hidden) * esize
    fixed = (vocab * hidden * (1 if tie else 2) + hidden) * esize
    layers = max(1, round((target_gb * 1e9 - fixed) / per_layer))
    return LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                       num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=hd, max_position_embeddings=max_position,
                       tie_word_embeddings=tie, dtype=dtype, bos_token_id=0, eos_token_id=0, architectures=["LlamaForCausalLM"],
                       **({"rope_parameters": rope} if rope else {}))


def _layer_tensors(cfg, i: int, gen: torch.Generator, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    h, hd, nkv, inter = cfg.hidden_size, cfg.head_dim, cfg.num_key_value_heads, cfg.intermediate_size
    p = f"model.layers.{i}."
    shapes = {"self_attn.q_proj.weight": (cfg.num_attention_heads * hd, h), "self_attn.k_proj.weight": (nkv * hd, h),
              "self_attn.v_proj.weight": (nkv * hd, h), "self_attn.o_proj.weight": (h, cfg.num_attention_heads * hd),
              "mlp.gate_proj.weight": (inter, h), "mlp.up_proj.weight": (inter, h), "mlp.down_proj.weight": (h, inter)}
    out = {p + k: (torch.randn(s, generator=gen) * 0.02).to(dtype) for k, s in shapes.items()}
    out[p + "input_layernorm.weight"] = torch.ones(h, dtype=dtype)
    out[p + "post_attention_layernorm.weight"] = torch.ones(h, dtype=dtype)
    return out


def byte_tokenizer():
    """A byte-level BPE tokenizer with no merges: every UTF-8 byte is one token (ids 0..255)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=alphabet[0], eos_token=alphabet[0])


def write_synthetic(out: Path, cfg, seed: int = 0, shard_bytes: int = 1 << 30) -> Path:
    """Write the checkpoint directory `out` (atomically: temp name, then rename)."""
    out = Path(out)
    dtype = DTYPE_NAMES[str(cfg.dtype).removeprefix("torch.")]
    gen = torch.Generator().manual_seed(seed)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        n_shards = 0
        weight_map: dict[str, str] = {}
        shard: dict[str, torch.Tensor] = {}
        n = 0

        def flush():
            nonlocal shard, n, n_shards
            if shard:
                n_shards += 1
                name = f"model-{n_shards:05d}.safetensors"
                save_file(shard, str(tmp / name), metadata={"format": "pt"})
                weight_map.update({k: name for k in shard})
                shard, n = {}, 0

        def add(tensors: dict[str, torch.Tensor]):
            nonlocal n
            size = sum(t.numel() * t.element_size() for t in tensors.values())
            if n and n + size > shard_bytes:
                flush()
            shard.update(tensors)
            n += size

        add({"model.embed_tokens.weight": (torch.randn(cfg.vocab_size, cfg.hidden_size, generator=gen) * 0.02).to(dtype)})
        for i in range(cfg.num_hidden_layers):
            add(_layer_tensors(cfg, i, gen, dtype))
        tail = {"model.norm.weight": torch.ones(cfg.hidden_size, dtype=dtype)}
        if not cfg.tie_word_embeddings:
            tail["lm_head.weight"] = (torch.randn(cfg.vocab_size, cfg.hidden_size, generator=gen) * 0.02).to(dtype)
        add(tail)
        flush()
        total = sum((tmp / f).stat().st_size for f in set(weight_map.values()))
        (tmp / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
        cfg.save_pretrained(str(tmp))
        byte_tokenizer().save_pretrained(str(tmp))
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--gb", type=float, default=4.8, help="checkpoint size in 10^9 bytes")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--dtype", default="float32", choices=sorted(DTYPE_NAMES))
    ap.add_argument("--tie", action="store_true")
    a = ap.parse_args(argv)
    cfg = synthetic_config(a.gb, hidden=a.hidden, dtype=a.dtype, tie=a.tie)
    p = write_synthetic(Path(a.out), cfg)
    print(f"wrote {p}: {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}")


if __name__ == "__main__":
    main()
