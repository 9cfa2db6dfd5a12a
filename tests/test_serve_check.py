"""export/check_hf_ckpt.py, the serve-path check a GPU host runs on export/hf_ckpt/ with vLLM: here against a stand-in `vllm`
module (written below) that scores with transformers, FP8 KV simulated by kvcompress's evaluation attention from the
checkpoint's own k_scale/v_scale. What this proves: the export writes the held-out windows and validate's numbers, and the
script reads them, forms perplexities over the same positions, compares and exits as documented. vLLM itself never ran."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from safetensors.torch import load_file

FAKE_VLLM = '''
import torch
from kvcompress.eval.attention import compressed_attention
from kvcompress.models.base import Geometry
from kvcompress.targets.recheck import load_hf_checkpoint, native_book_from_scales


class SamplingParams:
    def __init__(self, **kw):
        self.kw = kw


class _Logprob:
    def __init__(self, v):
        self.logprob = v


class _Output:
    def __init__(self, lps):
        self.prompt_logprobs = lps


class LLM:
    def __init__(self, model, kv_cache_dtype="auto", **kw):
        assert kv_cache_dtype in ("auto", "fp8") and kw["enable_prefix_caching"] is False
        self.model, scales = load_hf_checkpoint(model)
        self.book = native_book_from_scales(Geometry.from_hf_config(self.model.config).to_dict(), "native_fp8", scales) if kv_cache_dtype == "fp8" else None

    def generate(self, prompts, params):
        assert params.kw == {"max_tokens": 1, "prompt_logprobs": 0}
        outs = []
        for p in prompts:
            ids = torch.tensor([p["prompt_token_ids"]])
            with torch.no_grad(), compressed_attention(self.model, self.book) as kw:
                lp = torch.log_softmax(self.model(input_ids=ids, use_cache=False, **kw).logits.float(), -1)[0]
            outs.append(_Output([None] + [{t: _Logprob(float(lp[i, t])), -1: _Logprob(0.0)} for i, t in enumerate(p["prompt_token_ids"][1:])]))
        return outs
'''


def _run(script: Path, fake: Path | None, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(([str(fake)] if fake else []) + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, env=env, timeout=600)


def test_the_serve_check_compares_served_perplexities_with_validates(tmp_path):
    from test_quantized_checkpoints import _export

    from kvcompress.models.synthetic import byte_tokenizer
    from kvcompress.models.tiny import build_tiny

    m = build_tiny("llama", layers=2, hidden=96, heads=6, kv_heads=2, head_dim=32)
    m.config.architectures = ["LlamaForCausalLM"]
    ckpt = tmp_path / "llama"
    m.save_pretrained(str(ckpt))
    byte_tokenizer().save_pretrained(str(ckpt))
    out = _export(tmp_path, ckpt, "run")
    script = out / "check_hf_ckpt.py"
    expected = json.loads((out / "hf_ckpt_check" / "expected.json").read_text())
    report = json.loads((out.parent / "report.json").read_text())
    native = next(f for f in [{"name": report["kv"]["name"], "quality": report["quality"]}, *report["fallbacks"]] if f["name"] == "native_fp8")
    assert expected["ppl_baseline"] == native["quality"]["ppl_baseline"] and expected["ppl_delta_rel"] == native["quality"]["ppl_delta_rel"]
    ids = load_file(str(out / "hf_ckpt_check" / "windows.safetensors"))["ids"]
    assert list(ids.shape) == expected["windows"] and ids.shape[1] > 100
    assert "check_hf_ckpt.py" in json.loads((out / "manifest.json").read_text())["check_on_gpu_host"]
    assert "serve-path check on a GPU host" in (out.parent / "report.md").read_text()

    fake = tmp_path / "fake"
    (fake / "vllm").mkdir(parents=True)
    (fake / "vllm" / "__init__.py").write_text(FAKE_VLLM)
    p = _run(script, fake)
    assert p.returncode == 0 and p.stdout.count("PASS") == 2, p.stdout + p.stderr[-3000:]
    served = float(p.stdout.split("served perplexity, KV unquantized: ")[1].split()[0])
    assert abs(served / expected["ppl_baseline"] - 1) < 0.02  # bfloat16 weights, float32 math: validate's float32 baseline
    # a served change that differs from the validated one by more than the tolerance: FAIL, exit 1
    (out / "hf_ckpt_check" / "expected.json").write_text(json.dumps({**expected, "ppl_delta_rel": expected["ppl_delta_rel"] + 0.05}))
    p = _run(script, fake)
    assert p.returncode == 1 and "FAIL" in p.stdout and "PASS" in p.stdout, p.stdout + p.stderr[-2000:]
    # without vLLM: one line, exit 2
    p = _run(script, None)
    assert p.returncode == 2 and "needs vLLM" in p.stderr and "Traceback" not in p.stderr
    p = _run(script, fake, "--check", str(tmp_path / "nowhere"))
    assert p.returncode == 2 and "does not exist" in p.stderr and "Traceback" not in p.stderr
    p = _run(script, fake, "--atol", "-0.1")  # a negative tolerance: one line, exit 2, before vLLM runs
    assert p.returncode == 2 and "tolerances must be numbers >= 0" in p.stderr and p.stderr.count("\n") == 1, p.stderr
