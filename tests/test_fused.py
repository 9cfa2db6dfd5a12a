"""Fused projections (Phi-3/Phi-4's qkv_proj and gate_up_proj) split into Llama names and joined again."""
import torch

from kvcompress.fold import apply_fold
from kvcompress.models.base import Geometry
from kvcompress.models.fused import fuse, parts_of, unfuse
from kvcompress.models.tiny import build_tiny


def test_unfuse_splits_as_phi3_does_and_fuse_undoes_it():
    m = build_tiny("phi3", layers=1, hidden=96, heads=6, kv_heads=2, head_dim=32)
    g, sd = Geometry.from_hf_config(m.config), m.state_dict()
    u = unfuse(sd, g)
    p = "model.layers.0."
    assert u[p + "self_attn.q_proj.weight"].shape == (192, 96) and u[p + "self_attn.k_proj.weight"].shape == (64, 96)
    assert u[p + "mlp.gate_proj.weight"].shape == (192, 96) and not any("qkv_proj" in k or "gate_up" in k for k in u)
    x = torch.randn(5, 96)
    with torch.no_grad():  # the split rows are what Phi3Attention and Phi3MLP slice out of the fused outputs
        qkv = m.model.layers[0].self_attn.qkv_proj(x)
        assert torch.equal(qkv[:, 192:256], x @ u[p + "self_attn.k_proj.weight"].T)
        gate = m.model.layers[0].mlp.gate_up_proj(x).chunk(2, -1)[0]
        assert torch.allclose(gate, x @ u[p + "mlp.gate_proj.weight"].T)
    back = fuse(u, sd)
    assert set(back) == set(sd) and all(torch.equal(back[k], sd[k]) for k in sd)
    assert parts_of(p + "self_attn.qkv_proj.weight") == [p + "self_attn.q_proj.weight", p + "self_attn.k_proj.weight", p + "self_attn.v_proj.weight"]


def test_the_fold_through_fused_weights_is_exact():
    """apply_fold (the export's arithmetic) on a Phi-3: same logits, and the cached keys are R k / sigma."""
    m = build_tiny("phi3", layers=2, hidden=96, heads=6, kv_heads=2, head_dim=32).double()
    ids = torch.randint(0, 200, (1, 40))
    with torch.no_grad():
        ref = m(ids, use_cache=True)
    torch.manual_seed(0)
    sig = torch.rand(2, 2, 16).clamp(min=0.1).repeat(1, 1, 2)
    apply_fold(m, sig, torch.rand(2, 2, 32) + 0.5, None)
    with torch.no_grad():
        out = m(ids, use_cache=True)
    assert torch.allclose(out.logits, ref.logits, atol=1e-5)
    k0, k1 = ref.cache.layers[1].keys, out.cache.layers[1].keys  # [B, H, T, D]
    assert torch.allclose(k1, k0 / sig[1][None, :, None, :], rtol=1e-5, atol=1e-6)
