"""export: the deployment of a run (DESIGN §5), written only from the ScaleBooks validate measured.

    export/trtllm_ckpt/tp{N}/   native tier: TensorRT-LLM 1.2.x checkpoint, INT8/FP8 KV, folded weights
    export/hf_ckpt/             native tier: folded HF checkpoint with FP8 KV scales (trtllm-serve, vLLM)
    export/plugin_bundle/       custom tier: ScaleBook + spec, AOT kernels + C launchers, plugin sources
    export/manifest.json        what was written, from which validated format, and the checks that ran

The stage only sequences: plan (which validated ScaleBook feeds which artifact), writers
(kvcompress.targets.*), checks (kvcompress.targets.recheck: the written checkpoints are read
back and re-measured; a mismatch with the validated numbers fails the export). Everything is
written into a temporary directory that is renamed to export/ when complete, manifest last.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
from contextlib import contextmanager
from pathlib import Path

import torch
from tqdm.auto import tqdm

from kvcompress.artifacts import atomic_write_json
from kvcompress.data import load_texts, token_windows
from kvcompress.errors import UserError
from kvcompress.fold import absorb_kv_scale, check_range, fold_layer, guard_layer
from kvcompress.hashing import file_fingerprint
from kvcompress.kernels.aot import Variant
from kvcompress.models.base import DTYPES, Geometry
from kvcompress.models import int_weights
from kvcompress.models.fused import unfuse
from kvcompress.models.quantized import quantization_config, served_activations, weight_quantization
from kvcompress.scalebook import ScaleBook
from kvcompress.spec import NATIVE_ALGO
from kvcompress.targets import launchers, recheck
from kvcompress.models.streaming import HEAD_CHUNK_BYTES
from kvcompress.targets.hf_ckpt import KV_SCALES_UNREAD, HFWriter
from kvcompress.targets.trtllm_ckpt import TRTLLM_VERSION, TrtllmWriter, check_tp, trtllm_architecture

log = logging.getLogger("kvcompress")
ROOT = Path(__file__).resolve().parents[2]
EXPORT_ROPE_TYPES = ("default", "linear", "llama3", "yarn")  # targets.trtllm_reader.rope_inv_freq re-measures these
SUPPORTED_ARCH = ("LlamaForCausalLM", "MistralForCausalLM", "MixtralForCausalLM", "Phi3ForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                  "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")
EVERY_LAYER_MOE = ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")  # configs that can place dense layers among the expert layers
# written as the folded FP8 HF checkpoint only (hf_ckpt: TensorRT-LLM's PyTorch backend and vLLM run the model's own code from
# config.json, sliding windows, GeGLU, sandwich norms and all); no TensorRT-LLM checkpoint (the reader and the custom-tier
# graph implement the Llama layer), so kv=native_fp8 only
# Beyond Gemma 3, the families whose fold (key factors, pair rotations, value factors) is exact in transformers' modeling code
# (tests/test_architectures.py folds a fitted native_fp8 ScaleBook into each and compares logits) and whose folded checkpoint
# exports and re-measures. Llama 4 (a weightless norm of q and k after RoPE) and HunYuan (q/k layernorms after RoPE) fold their
# values only (profile.fold_obstacles: fit leaves their keys unfolded); not here: BitNet (its value fold is blocked by the
# attention output's norm, and its servers re-quantize the weights to ternary, which folded rows would not survive). GPT-OSS:
# its MXFP4 experts are copied as stored (targets.hf_ckpt, export.fp8_weights=keep), its bfloat16 attention folded (sinks and
# biases: the fold is exact)
HF_ONLY_ARCH = ("Gemma3ForCausalLM", "GemmaForCausalLM", "Gemma2ForCausalLM", "Cohere2ForCausalLM", "Olmo2ForCausalLM", "Olmo3ForCausalLM",
                "OlmoeForCausalLM", "GraniteForCausalLM", "GraniteMoeForCausalLM", "GlmForCausalLM", "Glm4ForCausalLM", "SmolLM3ForCausalLM",
                "Exaone4ForCausalLM", "SeedOssForCausalLM", "Ernie4_5ForCausalLM", "ApertusForCausalLM", "ArceeForCausalLM", "MinistralForCausalLM",
                "HeliumForCausalLM", "GptOssForCausalLM", "Llama4ForCausalLM", "HunYuanDenseV1ForCausalLM",
                "HunYuanMoEV1ForCausalLM")
BF16_ARCH = ("GemmaForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM", "GptOssForCausalLM")  # trained and served in bfloat16: export.dtype=float16 is refused
FORMAT_VERSION = 2
HF_SERVE_CHECK = ("python export/check_hf_ckpt.py   (vLLM serves hf_ckpt/ on validate's held-out windows, KV unquantized and FP8: its perplexities "
                  "against validate's; not run here)")


def hf_only(model) -> bool:
    """The export writes this model's folded FP8 HF checkpoint only (export_route)."""
    return export_route(model)[0]


def export_route(model) -> tuple[bool, str]:
    """(HF checkpoint only?, why). The TensorRT-LLM checkpoint, its reader and the custom-tier graph implement the Llama
    layer (trtllm_obstacle); where they cannot carry a model of a known family, the folded FP8 HF checkpoint still can:
    TensorRT-LLM's PyTorch backend and vLLM run it with the model's own code (windows, biases, RoPE variants, MLPs), and
    the re-measure reads it through transformers. Gemma 3 (HF_ONLY_ARCH) always goes that way. An architecture outside
    both lists is refused (the fold's tensor names are the Llama family's)."""
    arch = type(model).__name__
    if arch in HF_ONLY_ARCH:
        return True, f"{arch}: kvcompress's TensorRT-LLM checkpoint writer, its reader and the custom-tier graph implement the Llama layer"
    if arch not in SUPPORTED_ARCH:
        raise UserError(f"export=trtllm supports {', '.join(SUPPORTED_ARCH)} (and, as the FP8 HF checkpoint with kv=native_fp8, "
                        f"{', '.join(HF_ONLY_ARCH)}); this model is {arch}: add export=none to profile, fit and validate it")
    why = trtllm_obstacle(model)
    return bool(why), why


def check_exportable(model, spec=None, dtype: str | None = None) -> None:
    """export=trtllm: say before profiling, not after validating, what cannot be written. Where the TensorRT-LLM
    checkpoint cannot carry the model (export_route), the folded FP8 HF checkpoint is written alone, the native tier's
    hf_ckpt: the run's kv `spec` must then be native_fp8 (what hf_ckpt holds; nothing else would ship what was
    validated), and Gemma's weights bfloat16 or float32 (`dtype`, export.dtype), as Gemma is trained and served (its
    residual stream outgrows float16)."""
    only_hf, why = export_route(model)
    arch = type(model).__name__
    if not only_hf:
        D = Geometry.from_hf_config(model.config).head_dim
        if spec is not None and spec.format == "kvcompress" and D & (D - 1):
            raise UserError(f"export=trtllm: the custom tier's kernels (kv={spec.name}) take a power-of-two head_dim; this {arch} has head_dim={D}: "
                            "use kv=native_int8 or kv=native_fp8 (the native tier), or add export=none")
        return
    if spec is not None and spec.format != "native_fp8":
        raise UserError(f"export=trtllm writes this {arch} as the folded FP8 Hugging Face checkpoint only (hf_ckpt, for TensorRT-LLM's PyTorch "
                        f"backend and vLLM; {why}); kv={spec.name} is not that format: use kv=native_fp8, or add export=none")
    if dtype == "float16" and arch in BF16_ARCH:
        raise UserError(f"export.dtype=float16: {arch} is trained and served in bfloat16 (its residual stream outgrows float16's range); "
                        "allowed for it: bfloat16, float32")


TP_CHOICES = (2, 4, 8, 16)  # the tensor-parallel sizes tp_advice suggests


def export_disk(n_params: int, tp_sizes: list[int], only_hf: bool, bytes_per_param: float) -> float:
    """Disk bytes of the export's checkpoints at bytes_per_param: a full copy of the weights per TensorRT-LLM tp size and one
    for hf_ckpt (the plugin bundle's kernels are small beside them)."""
    return n_params * bytes_per_param * ((0 if only_hf else len(tp_sizes)) + 1)


def _free_bytes(where: Path) -> tuple[Path, int]:
    """The free bytes of the filesystem `where` will be on (its nearest existing parent: a run directory may not exist yet)."""
    where = Path(where).absolute()
    while not where.exists():
        where = where.parent
    return where, shutil.disk_usage(where).free


def disk_warning(where: Path, n_params: int, tp_sizes: list[int], only_hf: bool) -> str:
    """'' when the export's checkpoints at 2 bytes a parameter fit the free space under `where`, else one line saying so
    (before profiling: FP8 weights kept as stored take half, so this warns and check_disk refuses)."""
    where, free = _free_bytes(where)
    need = export_disk(n_params, tp_sizes, only_hf, 2)
    return "" if need <= free else (f"its checkpoints take about {need / 1e9:.1f} GB at 2 bytes a parameter and {free / 1e9:.1f} GB are free "
                                    f"under {where}: free space, write fewer export.tp_sizes or set hydra.run.dir on a larger disk")


def check_disk(where: Path, n_params: int, tp_sizes: list[int], only_hf: bool) -> None:
    """Refuse, before anything is written, an export whose checkpoints cannot fit the free space under `where` even at one
    byte a parameter (every weight FP8); otherwise a full disk would stop it halfway, after the hours of validation."""
    where, free = _free_bytes(where)
    low = export_disk(n_params, tp_sizes, only_hf, 1)
    if low > free:
        n = int(round(low / n_params))
        raise UserError(f"export: its {n} checkpoint(s) of {n_params / 1e9:.2f}B parameters need at least {low / 1e9:.1f} GB and {free / 1e9:.1f} GB "
                        f"are free under {where}: free space, write fewer export.tp_sizes or set hydra.run.dir on a larger disk; nothing was written")


def tp_advice(weight_bytes: float, tp_sizes: list[int], gpu_memory_gb: float, geom, hf_cfg) -> str:
    """'' when the largest of export.tp_sizes puts at most export.gpu_memory_gb of the TensorRT-LLM checkpoint's weights
    (weight_bytes in all) on each GPU, else one line saying so, with the smallest size of TP_CHOICES whose share fits and
    the model's shapes allow (trtllm_ckpt.check_tp)."""
    gpu, tp = gpu_memory_gb * 1e9, max(tp_sizes)
    if weight_bytes / tp <= gpu:
        return ""

    def allowed(t: int) -> bool:
        try:
            check_tp(geom, t, hf_cfg)
            return True
        except UserError:
            return False

    fit = next((t for t in TP_CHOICES if t > tp and weight_bytes / t <= gpu and allowed(t)), None)
    return (f"trtllm_ckpt at tp {tp} puts {weight_bytes / tp / 1e9:.1f} GB of weights on each GPU, more than export.gpu_memory_gb={gpu_memory_gb:g}: "
            + (f"add export.tp_sizes=[{fit}]" if fit else f"no tensor-parallel size of {list(TP_CHOICES)} the model's shapes allow brings it under"))


def trtllm_obstacle(model) -> str:
    """'' when the TensorRT-LLM checkpoint (and the custom tier) can carry this model of SUPPORTED_ARCH, else why not.
    A Mistral model is a Llama forward (same tensors, same attention) unless it has a sliding window, which
    the checkpoint cannot carry (TensorRT-LLM maps MistralForCausalLM to its Llama class); Phi-3/Phi-4 are the Llama
    forward with fused q/k/v and gate/up matrices (split on reading, models.fused), written as Llama; Mixtral is the
    Llama attention with a mixture-of-experts MLP (TensorRT-LLM's Llama class with its `moe` block); Qwen2 is the
    Llama layer with q/k/v biases, Qwen3 the Llama layer with a per-head q/k RMSNorm before RoPE (TensorRT-LLM's
    QWen class, the same tensor names); Qwen3-MoE is Qwen3's attention with Mixtral's expert tensors in every layer
    (the QWen class, qwen_type qwen3_moe), Qwen2-MoE Qwen2's attention with those experts and a shared expert behind
    a sigmoid gate (qwen_type qwen2_moe): a model of either with dense layers among its expert layers (mlp_only_layers,
    decoder_sparse_step > 1) cannot be written, as the checkpoint gives every layer the same MLP. A sliding_window of 0
    or None is no window (Qwen2-MoE's config says 0 when use_sliding_window is off)."""
    arch, cfg = type(model).__name__, model.config
    dense, step = list(getattr(cfg, "mlp_only_layers", None) or []), int(getattr(cfg, "decoder_sparse_step", 1) or 1)
    if arch in EVERY_LAYER_MOE and (dense or step != 1):
        return (f"the TensorRT-LLM checkpoint has an expert MLP in every layer; this {arch} has dense layers (mlp_only_layers={dense}, "
                f"decoder_sparse_step={step}; allowed: [] and 1)")
    window, positions = getattr(cfg, "sliding_window", None), getattr(cfg, "max_position_embeddings", None)
    sliding = "sliding_attention" in (getattr(cfg, "layer_types", None) or [])
    if sliding or (window and (positions is None or window < positions)):
        return f"the TensorRT-LLM checkpoint has no attention window; this {arch} has sliding_window={window} < max_position_embeddings={positions}"
    biases = [n for n in ("attention_bias", "mlp_bias") if getattr(cfg, n, False)]
    if biases:  # Llama's attention_bias also puts a bias on o_proj: neither the checkpoint writer nor the custom-tier graph carries it
        return f"the TensorRT-LLM checkpoint carries q/k/v biases only (Qwen2's); this {arch} has {' and '.join(f'{n}=True' for n in biases)}"
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    kind = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
    if kind not in EXPORT_ROPE_TYPES:  # the checkpoint reader (and so the re-measure of what ships) implements these only
        return f"the TensorRT-LLM checkpoint is written with RoPE scaling of type {', '.join(EXPORT_ROPE_TYPES)}; this {arch} has rope_type={kind!r}"
    from kvcompress.models.base import Geometry
    from kvcompress.stages.profile import rotary_dim

    g = Geometry.from_hf_config(cfg)
    r = rotary_dim(model, g)
    if r < g.head_dim:  # Phi-4-mini, GPT-NeoX: a Llama checkpoint rotates every channel
        return f"the TensorRT-LLM checkpoint rotates the whole head; this {arch} rotates {r} of its {g.head_dim} head channels (partial rotary)"
    mismatch = rope_mismatch(model)
    if mismatch:
        return f"the TensorRT-LLM checkpoint's RoPE {kind}, as TensorRT-LLM computes it, differs from this {arch}'s own ({mismatch})"
    act = getattr(cfg, "hidden_act", "silu")
    if act != "silu":
        return f"the TensorRT-LLM checkpoint is a Llama checkpoint (SiLU gated MLP); this {arch} has hidden_act={act!r}"
    return ""


def rope_mismatch(model) -> str:
    """'' when the RoPE the checkpoint config describes, as TensorRT-LLM computes it (trtllm_reader.rope_inv_freq and
    rope_scale on trtllm_ckpt's rotary_scaling), is the model's own (its rotary module's inv_freq and attention_scaling);
    else what differs. transformers and TensorRT-LLM read some YaRN settings differently (an explicit attention_factor,
    truncate=false, mscale without mscale_all_dim or the reverse): such a checkpoint would serve another model."""
    from kvcompress.models.base import Geometry
    from kvcompress.targets.trtllm_ckpt import trtllm_config
    from kvcompress.targets.trtllm_reader import rope_inv_freq, rope_scale

    rotary = getattr(getattr(model, "model", None), "rotary_emb", None)
    own = getattr(rotary, "inv_freq", None)
    if own is None:
        return ""
    geom = Geometry.from_hf_config(model.config)
    rc = trtllm_config(model.config, geom, 1, "float16", None)
    inv, scale = rope_inv_freq(geom.head_dim, rc["rotary_base"], rc["rotary_scaling"]), rope_scale(rc["rotary_scaling"])
    own_scale = float(getattr(rotary, "attention_scaling", 1.0))
    out = []
    if own.numel() != inv.numel() or not torch.allclose(inv.double(), own.detach().cpu().double(), rtol=1e-5, atol=0):
        out.append("inverse frequencies")
    if abs(scale - own_scale) > 1e-6 * max(1.0, own_scale):
        out.append(f"cos/sin scale {scale:.6g} vs {own_scale:.6g}")
    return ", ".join(out)


def engine_status(policy: str) -> tuple[bool, str]:
    """(build now?, why) for export.build_engine; `always` without TensorRT-LLM + GPU is a user error."""
    have_trtllm = importlib.util.find_spec("tensorrt_llm") is not None
    have_gpu = torch.cuda.is_available()
    missing = [n for n, ok in (("tensorrt_llm", have_trtllm), ("a CUDA GPU", have_gpu)) if not ok]
    if policy == "never":
        return False, "export.build_engine=never"
    if missing:
        if policy == "always":
            raise UserError(f"export.build_engine=always but this machine lacks {' and '.join(missing)}; use build_engine=auto or run on a TensorRT-LLM GPU host")
        return False, f"this machine lacks {' and '.join(missing)}"
    return True, "TensorRT-LLM and a GPU are present"


class Checks:
    """The checks that ran in this export, in order; the manifest records exactly these."""

    def __init__(self):
        self.rows: list[dict] = []

    def add(self, name: str, passed: bool, detail) -> bool:
        self.rows.append({"check": name, "status": "passed" if passed else "failed", "detail": detail})
        return passed

    def skip(self, name: str, why: str) -> None:
        self.rows.append({"check": name, "status": "skipped", "detail": {"skipped": why}})


def bundle_variants(book: ScaleBook, geom) -> tuple[list[Variant], list[str]]:
    """(the kernel variants of a ScaleBook, the variant of each layer): one for a uniform format; one
    per distinct layer format for per-layer formats (named after the spec and the layer format)."""
    D, G = geom.head_dim, geom.n_heads // geom.n_kv_heads
    variants: dict[str, Variant] = {}
    per_layer = []
    for i in range(geom.n_layers):
        s = book.layer_spec(i)
        name = f"d{D}_g{G}_{book.spec.name}" + (f"_{book.spec.layers[i].label}" if book.spec.is_mixed else "")
        if s.is_baseline:  # an fp16 layer: the static kernels storing fp16 K and V (layout.py), the spec's sinks and window
            variants.setdefault(name, Variant(name, D, G, 16, 16, D, s.sink_tokens, s.window, 0))
            per_layer.append(name)
            continue
        vopt = dict(value_symmetric=s.value.symmetric, value_rotate=s.value.rotate != "none", value_coded_min=s.coded_min)
        fam = (dict(key_group_tokens=s.key.group_tokens, **vopt) if s.key.group_tokens  # the grouped family (kv=wf4)
               else dict(key_group=s.key_group(D), key_rotate=s.key.rotate != "none", **vopt) if s.token_keys else {})  # per-token (kv=rot8k_int4v)
        variants.setdefault(name, Variant(name, D, G, s.key.bits, s.value.bits, s.value_group(D), s.sink_tokens, s.window, s.outlier_channels, **fam))
        per_layer.append(name)
    return list(variants.values()), per_layer


def _aot_compile(out: Path, archs: list[str], variants: list[Variant]) -> None:
    """python -m kvcompress.kernels.aot for every arch, in parallel (subprocesses: no Triton interpreter)."""
    env = {k: val for k, val in os.environ.items() if k != "TRITON_INTERPRET"}
    procs = {}
    try:
        for arch in archs:
            procs[arch] = subprocess.Popen([sys.executable, "-m", "kvcompress.kernels.aot", "--arch", arch, "--out", str(out / "kernels" / arch),
                                            "--variant-json", json.dumps([v.__dict__ for v in variants])], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        errs = {arch: p.communicate()[1] for arch, p in procs.items()}
    except BaseException:  # Ctrl-C: stop the compilers before the caller removes the directory they write into
        with _uninterruptible():
            for p in procs.values():  # os-level: an interrupted communicate() can leave the Popen's wait lock held
                try:
                    os.kill(p.pid, signal.SIGKILL)
                    os.waitpid(p.pid, 0)
                except (ProcessLookupError, ChildProcessError):
                    pass  # already exited and reaped
        raise
    for arch, p in procs.items():
        if p.returncode:
            raise RuntimeError(f"AOT compile for {arch} failed: {errs[arch].strip()[-600:]}")


def retile(variants: list, spilled: set[str], log: dict) -> tuple[list, bool]:
    """The next compile of the variants whose decode kernel needs a stack frame on some arch (a ptxas choice): first
    without plan.decode_maxnreg's register cap, if it had one, then with half the token tile (down to 16), the same on
    every arch (the plugin and kit read it). `log` collects, per variant, what was tried. (variants, anything changed)."""
    out, changed = [], False
    for v in variants:
        if v.name in spilled and v.decode_maxnreg > 0:
            log.setdefault(v.name, [f"block_t {v.block_t}, maxnreg {v.decode_maxnreg}"]).append(f"block_t {v.block_t}, no register cap")
            v, changed = dataclasses.replace(v, decode_maxnreg=-1), True
        elif v.name in spilled and v.block_t > 16:
            log.setdefault(v.name, [f"block_t {v.block_t}"]).append(f"block_t {v.block_t // 2}")
            v, changed = dataclasses.replace(v, block_t=v.block_t // 2), True
        out.append(v)
    return out, changed


def plugin_bundle(book: ScaleBook, geom, out: Path, archs: list[str], checks: Checks, stats_path: Path | None = None) -> dict:
    """ScaleBook + spec, AOT kernels for each arch (compiled in parallel) with their SASS audit and C
    launchers, the plugin sources (and the plugin library when TensorRT's headers are given), and the
    ONNX acceptance kit built from the run's real K/V (`stats_path`) and checked on CPU. Per-layer
    formats: every variant is compiled, gets its kit, and is linked into the one plugin library
    (plugins registered under kvcompress.<variant>)."""
    from kvcompress.targets.plugin_lib import plugin_namespace

    out.mkdir(parents=True, exist_ok=True)
    book.save(out / "scalebook.safetensors")
    atomic_write_json(out / "kv_spec.json", {"spec": book.spec.model_dump(), "geometry": book.geometry, "layout": "kvcompress.kernels.layout"})
    variants, per_layer = bundle_variants(book, geom)
    retiled = {}
    while True:  # ends: retile drops a cap once and halves a tile down to 16, so the last build is of the final variants
        _aot_compile(out, archs, variants)
        spilled = {k["variant"]["name"] for arch in archs for k in json.loads((out / "kernels" / arch / "kernels.json").read_text())["kernels"]
                   if k["spills"] and k["kernel"].startswith("decode_split")}
        variants, changed = retile(variants, spilled, retiled)
        if not changed:
            break
    kernels = {}
    for arch in archs:
        kdir = out / "kernels" / arch
        files = launchers.generate(kdir)
        meta = json.loads((kdir / "kernels.json").read_text())["kernels"]
        kernels[arch] = [k["name"] for k in meta]
        checks.add(f"AOT kernels {arch}: no spills (cuobjdump)", not any(k["spills"] for k in meta),
                   {k["name"]: {"registers": k["registers"], "local": k["local"], "stack": k["stack"], "block_t": k["constexprs"].get("BLOCK_T")} for k in meta}
                   | ({"recompiled after a stack frame (variant: builds tried)": retiled} if retiled else {}))
        audit = json.loads((kdir / "audit.json").read_text())["kernels"]  # written by the AOT build (kvcompress.kernels.audit)
        loops = {k["name"]: k["main_loop"]["narrowest_payload_bits"] for k in audit if "main_loop" in k}
        checks.add(f"AOT kernels {arch}: decode payload read by >= 64-bit loads (SASS audit, audit.json)", all(b >= 64 for b in loops.values()),
                   {n: f"{b}-bit" for n, b in loops.items()})
        _compile_launchers(kdir, files, arch, checks)
        _compile_plugin(kdir, [v.name for v in variants], out / "lib" / arch, arch, checks)
    ns = {v.name: plugin_namespace(v.name, len(variants)) for v in variants}
    if stats_path is not None and stats_path.is_file() and importlib.util.find_spec("onnx") is not None:
        from kvcompress.targets.acceptance import check_kit, kit_for_bundle

        for v in variants:
            kit = out / "acceptance" / v.name
            layer = None if len(variants) == 1 else per_layer.index(v.name)  # a layer that runs this variant
            kit_for_bundle(kit, {**v.__dict__, "namespace": ns[v.name]}, stats_path, book, layer)
            res = check_kit(kit)
            checks.add(f"ONNX acceptance kit {v.name}: onnx.checker + onnx.reference reproduce the reference goldens exactly", all(res.values()),
                       {"cases": res, "on a TensorRT host": f"python acceptance/{v.name}/verify.py --plugin-lib lib/<arch>/libkvcompress_trt.so"})
    shutil.copytree(ROOT / "plugins", out / "plugins", dirs_exist_ok=True)
    shutil.copy(ROOT / "export" / "build_engine.py", out / "build_engine.py")
    shutil.copy(ROOT / "kvcompress" / "targets" / "trtllm_network.py", out / "trtllm_network.py")
    _copy_weight_readers(out)
    info = {"variant": variants[0].__dict__, "kernels": kernels}
    if book.spec.is_mixed:
        info |= {"variants": {v.name: {**v.__dict__, "namespace": ns[v.name]} for v in variants}, "layer_variants": per_layer}
    return info


NETWORK_NEW_TOKENS = 8  # generated after the prompt in the network check
TP_SIZES = (1, 2, 4, 8)  # the custom-tier engine's tensor-parallel sizes the export plans for (one node)


def custom_network(run, book: ScaleBook, variant: dict, out: Path, checks: Checks, layers: list[dict] | None = None) -> dict:
    """network.json + plugin_params.safetensors for build_engine.py --tier custom, and the CPU check of
    that network's graph (trtllm_network.decoder_step, plugins = reference numerics) against
    CompressedCache decoding of the same tokens on the run's model: a prompt of held-out text long
    enough to cross the window into the compressed store, then greedy tokens."""
    from kvcompress.kernels import plan
    from kvcompress.targets import network_oracle as no
    from kvcompress.targets import trtllm_network as tn

    lm, cfg = run.lm, run.cfg
    g = lm.geometry
    token_bytes = tn.token_bytes(variant, g.head_dim)
    n_comp = max(1, min(g.max_position, 8192) - variant["n_sink"] - variant["window"])
    splits = plan.choose_splits(1, g.n_kv_heads, n_comp, variant["gqa"], g.head_dim, token_bytes, variant["block_t"])
    spec = no.network_spec(book, variant, lm.model.config, g, lm.identity, splits, layers)
    # a tensor-parallel rank holds n_kv_heads / tp heads (one, replicated, above them): fewer CTAs a launch, so more splits fill
    # its GPU (build_engine --tp)
    spec["splits_by_tp"] = {str(tp): plan.choose_splits(1, tn.kv_heads_per_rank(spec, tp), n_comp, variant["gqa"], g.head_dim, token_bytes,
                                                        variant["block_t"]) for tp in TP_SIZES if tn.tp_allowed(g.n_heads, g.n_kv_heads, tp)}
    no.write_network_files(out, spec, no.plugin_params(book))
    hf_dir = spec["weights"]["hf_dir"]
    info = {"files": [no.tn.SPEC_FILE, no.tn.PARAMS_FILE, "trtllm_network.py", *WEIGHT_READERS], "splits_at_8k": splits, "weights_hf_dir": hf_dir,
            "build": "python build_engine.py --tier custom --bundle plugin_bundle --plugin-lib lib/<arch>/libkvcompress_trt.so --out engine_custom (not run here)"}
    moe = spec["arch"].get("moe")
    if moe:  # the graph's expert MLP is exact but dense: say what it costs where the operator reads the export
        E, k = moe["num_experts"], moe["top_k"]
        info["moe_mlp"] = {"experts": E, "top_k": k, "work_vs_routed": E / k,
                           "note": f"every expert runs on every token, summed by the routing weights (0 for the {E - k} not chosen): {E / k:g}x the "
                                   f"routed experts' work, and a decode step reads all {E} experts' weights whatever the batch; a correctness "
                                   f"path, not TensorRT-LLM's MoE plugin (its native-tier checkpoint routes sparsely)"}
        log.warning("export: the custom-tier network runs all %d experts on every token (%gx the routed work of top-%d routing); "
                    "the native-tier checkpoint routes sparsely (manifest: plugin_bundle.network.moe_mlp)", E, E / k, k)
    if hf_dir and any(Path(hf_dir).glob("*.safetensors")):  # what each GPU must hold, at the fewest tensor-parallel GPUs that hold it
        mem = tn.fewest_gpus(spec, Path(hf_dir), min(g.max_position, 8192), cfg.export.gpu_memory_gb * 1e9, TP_SIZES)
        fits = mem.pop("fits")
        info["engine_memory"] = mem | {"gpus": mem["tp"], "gpu_memory_gb": cfg.export.gpu_memory_gb, "fits": fits,
                                       "note": "the fewest tensor-parallel GPUs (build_engine.py --tp) that hold the fp16 weights and one "
                                               "sequence's cache; build_engine.py refuses an engine larger than its GPU; TensorRT's "
                                               "activations and workspace come on top"}
        if mem["tp"] > 1:
            info["build"] = info["build"].replace("--out engine_custom", f"--out engine_custom --tp {mem['tp']}")
        if not fits:
            log.warning("export: the custom-tier engine needs %s, more than a %g GB GPU holds (export.gpu_memory_gb) even split over "
                        "its most tensor-parallel GPUs (a divisor of its %d kv heads up to %d)", tn.memory_line(mem), cfg.export.gpu_memory_gb,
                        g.n_kv_heads, TP_SIZES[-1])
    if lm.streamer is not None or not hf_dir or not any(Path(hf_dir).glob("*.safetensors")):
        why = "streamed model: the CPU oracle would hold every layer" if lm.streamer is not None else "no HF weights directory (model built in code)"
        checks.skip("custom-tier network graph (CPU oracle, reference plugins) decodes like CompressedCache", why)
        return info | {"check": {"skipped": why}}
    text = " ".join(load_texts(cfg.eval, "eval").texts)
    n = variant["n_sink"] + variant["window"] + 8
    prompt = lm.tokenizer.encode(text)[:n]
    tol = cfg.export.recheck_abs_tol
    res = no.check_network(out, Path(hf_dir), lm.model, book, prompt, NETWORK_NEW_TOKENS, kl_tolerance=tol)
    res["kl_tolerance"] = tol
    info["files"].append(res["check_file"])
    tp = (info.get("engine_memory") or {}).get("tp", 1)
    info["engine_check"] = (f"{f'mpirun -n {tp} ' if tp > 1 else ''}python build_engine.py --tier custom --check engine_custom: the network check's tokens through the engine against "
                            f"the validated decoding ({res['check_file']}; not run here)")
    ok = res["kl_mean"] <= tol
    checks.add(f"custom-tier network graph (CPU oracle of trtllm_network.decoder_step, reference plugins, fp16 weights) decodes like "
               f"CompressedCache on {res['tokens']} tokens{' crossing into the compressed store' if res['crossed_into_store'] else ''}", ok, res)
    if not ok:
        raise UserError(f"export: the custom-tier network's CPU oracle differs from the validated decoding (mean KL {res['kl_mean']:.2e} > {tol:.1e}); nothing exported")
    return info | {"check": res}


def _compile_launchers(kdir: Path, files: list[Path], arch: str, checks: Checks) -> None:
    inc = launchers.cuda_include_dirs()
    if shutil.which("gcc") is None or not inc:
        return  # not run: recorded by its absence from the checks
    errs = []
    for src in (f for f in files if f.suffix == ".c"):
        c = subprocess.run(["gcc", "-c", "-Wall", "-Werror", f"-I{inc[0]}", f"-I{kdir}", str(src), "-o", "/dev/null"], capture_output=True, text=True)
        if c.returncode:
            errs.append(c.stderr.strip()[-300:])
    checks.add(f"C launchers {arch} compile against cuda.h (gcc -Wall -Werror)", not errs, errs or f"{sum(f.suffix == '.c' for f in files)} files")


def _compile_plugin(kdir: Path, variant: list[str], out: Path, arch: str, checks: Checks) -> None:
    """libkvcompress_trt.so when TensorRT's headers are given (TENSORRT_INCLUDE_DIR); else not run."""
    from kvcompress.targets.plugin_lib import build

    trt = os.environ.get("TENSORRT_INCLUDE_DIR")
    if not trt or shutil.which("g++") is None:
        return  # not run: recorded by its absence from the checks (and in not_verified_here)
    out.mkdir(parents=True, exist_ok=True)
    try:
        build(Path(trt), kdir, variant if len(variant) > 1 else variant[0], out / "libkvcompress_trt.so")
        checks.add(f"plugin library {arch} compiles against TensorRT headers (-Wall -Wextra -Werror)", True, {"headers": trt, "lib": str(out / "libkvcompress_trt.so")})
    except RuntimeError as e:
        checks.add(f"plugin library {arch} compiles against TensorRT headers (-Wall -Wextra -Werror)", False, str(e)[-800:])


def _book_for(books: dict[str, ScaleBook], fmt: str) -> ScaleBook:
    return next(b for b in books.values() if b.spec.format == fmt)


def _validated(report: dict, name: str) -> dict:
    """The validated FormatResult (as a dict) of the format `name` in report.json."""
    if report["kv"]["name"] == name:
        return {"quality": report["quality"], "verdict": report["verdict"]}
    return next(f for f in report["fallbacks"] if f["name"] == name)


class ModelTensors:
    """The model's Hugging Face-named tensors, one decoder layer (or one row block) at a time:
    views of the loaded model's state dict, or read from the checkpoint of a streamed model, in
    the model's dtype either way (so both give the same exported bytes). Layers come under Llama
    names (fused Phi-3 q/k/v and gate/up split, models.fused); `own_meta` has the model's own names."""

    def __init__(self, lm):
        self.lm = lm
        state = lm.model.state_dict()
        if lm.model.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        self.own_meta = {k: torch.empty_like(v, device="meta") for k, v in state.items()}
        self.meta = unfuse(self.own_meta, lm.geometry)
        self.state = None if lm.streamer is not None else {k: v.detach() for k, v in state.items()}

    def layer(self, i: int) -> dict[str, torch.Tensor]:
        keys = [k for k in self.own_meta if k.startswith(f"model.layers.{i}.")]
        if self.state is not None:
            return unfuse({k: self.state[k] for k in keys}, self.lm.geometry)
        return unfuse(self.lm.streamer.ckpt.load(keys, self.lm.dtype, "cpu"), self.lm.geometry)

    def row_blocks(self, key: str, rows: int):
        """(lo, tensor rows lo:lo+rows) over a global tensor (embedding, lm_head, final norm)."""
        n = self.meta[key].shape[0] if self.meta[key].dim() > 1 else 0
        if n == 0:
            yield 0, (self.state[key] if self.state is not None else self.lm.streamer.ckpt.load([key], self.lm.dtype, "cpu")[key])
            return
        for lo in range(0, n, rows):
            hi = min(n, lo + rows)
            yield lo, (self.state[key][lo:hi] if self.state is not None else self.lm.streamer.ckpt.rows(key, lo, hi, self.lm.dtype, "cpu"))


class FoldedLayers:
    """Fold one ScaleBook into each layer as it passes (guard, fold, range check), recording the
    guard's changes and any range problem for the manifest."""

    def __init__(self, book: ScaleBook, geom, dtype: torch.dtype, label: str, norm_offset: float = 0.0):
        self.book, self.geom, self.dtype, self.label, self.norm_offset = book, geom, dtype, label, norm_offset
        self.sigma = book.tensors["fold_k"].clone()
        self.guard = {"raised": 0, "layers": []}
        self.bad: list[str] = []
        self.weights: dict = {}  # the writer's word on how the weights were written (write_native_checkpoints)

    def __call__(self, layer: dict[str, torch.Tensor], i: int) -> dict[str, torch.Tensor]:
        self.sigma[i], n = guard_layer(layer, self.geom, i, self.book.tensors["fold_k"][i], self.dtype, norm_offset=self.norm_offset)
        if n:
            self.guard["raised"] += n
            self.guard["layers"].append(i)
        folded = {**layer, **fold_layer(layer, self.geom, i, self.sigma, self.book.tensors["fold_v"], self.book.tensors.get("fold_k_rot"), self.norm_offset)}
        self.bad += check_range(folded, self.dtype)
        if self.bad:
            raise UserError(f"export: folding {self.book.spec.name} puts weights outside {self.dtype}: {self.bad[0]}; nothing exported")
        return folded

    def record(self, checks: Checks) -> None:
        checks.add(f"{self.label}: folded q/k/v/o weights within {str(self.dtype).removeprefix('torch.')} range (no overflow, no rows flushed)", not self.bad,
                   {"factors_raised_by_guard": self.guard["raised"], "layers": self.guard["layers"], "problems": self.bad[:5]})


def write_native_checkpoints(lm, geom, trt_book: ScaleBook | None, hf_book: ScaleBook, ecfg, tp_dirs: list[Path], hf_dir: Path, progress: bool = True):
    """One pass over the model, layer by layer: each layer is read once, folded with each book and
    written to every rank file of every tp size and to its HF shard. Returns the two FoldedLayers
    (trt_book None, an HF_ONLY_ARCH model: the HF checkpoint alone, and None for the first)."""
    from kvcompress.stages.profile import key_norm_offset

    dtype = DTYPES[ecfg.dtype]
    src = ModelTensors(lm)
    offset = key_norm_offset(lm.model)
    keep = lm.streamer.ckpt if ecfg.fp8_weights == "keep" and lm.streamer is not None and (weight_quantization(lm.streamer.ckpt.dir) in ("fp8", "mxfp4", "nvfp4")
                                                                                           or lm.streamer.ckpt.packed or lm.streamer.ckpt.int8 or _repackable(lm.streamer.ckpt)) else None
    unread = KV_SCALES_UNREAD.get(str((quantization_config(keep.dir) or {}).get("quant_method", "")).lower()) if keep is not None else None
    absorbed = bool(unread) and not (hf_book.fit_info.get("fold_keys_off") or hf_book.fit_info.get("fold_values_off"))
    if absorbed:  # the server reads no stored KV scale and quantizes at 1.0: the scale goes into the fold, the stored scales are 1.0
        sk, sv = absorb_kv_scale(hf_book.tensors["fold_k"], hf_book.tensors["fold_v"], hf_book.tensors["native_scale"])
        hf_book = dataclasses.replace(hf_book, tensors={**hf_book.tensors, "fold_k": sk, "fold_v": sv,
                                                        "native_scale": torch.ones_like(hf_book.tensors["native_scale"])})
    trt_fold = None if trt_book is None else FoldedLayers(trt_book, geom, dtype, "trtllm_ckpt", offset)
    hf_fold = FoldedLayers(hf_book, geom, dtype, "hf_ckpt", offset)
    trt_keep = keep if keep is not None and weight_quantization(keep.dir) in ("fp8", "nvfp4") else None
    trt = [] if trt_book is None else [TrtllmWriter(src.meta, geom, d, tp, ecfg.dtype, NATIVE_ALGO[trt_book.spec.format], trt_book.tensors["native_scale"],
                                                    lm.model.config, fp8_source=trt_keep) for tp, d in zip(ecfg.tp_sizes, tp_dirs)]
    hf = HFWriter(src.own_meta, lm.model.config, lm.tokenizer, hf_dir, hf_book.tensors["native_scale"], dtype, ecfg.shard_mb, model=lm.model,
                  fp8_source=keep)
    writers = [*trt, hf]
    try:
        rows = max(1, HEAD_CHUNK_BYTES // (geom.hidden_size * 4))
        for key in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"):
            if key in src.meta:
                for lo, block in src.row_blocks(key, rows):
                    for w in trt:
                        w.write_rows(key, lo, block)
                    hf.write(key, block, row=lo)
        for i in tqdm(range(geom.n_layers), desc="export", unit="layer", disable=not progress):
            if keep is not None:  # the layer's stored tensors, read once for its folded state and for each writer's copies
                keep.remember(True)
            layer = src.layer(i)
            if trt:
                t = trt_fold(layer, i)
                for w in trt:
                    w.write_layer(t, i)
                del t
            hf.write_layer(hf_fold(layer, i), i)
        for w in writers:
            w.close()
    except BaseException:
        for w in writers:
            w.abort()
        raise
    finally:
        if keep is not None:
            keep.remember(False)
    hf_fold.weights = hf.weights_note()
    if absorbed:
        del hf_fold.weights["kv_scales_unread"]
        hf_fold.weights["kv_scale_absorbed"] = (f"{unread}: each layer's FP8 KV scale was folded into the attention weights (keys and values "
                                                "divided by it) and the stored k_scale / v_scale are 1.0, the scale such a server quantizes "
                                                "with, so --kv-cache-dtype fp8 caches what validate measured")
    if trt_fold is not None:
        trt_fold.weights = trt[0].weights_note()
    return trt_fold, hf_fold


def export(run, books: dict[str, ScaleBook], report: dict, out: Path) -> dict:
    lm, cfg = run.lm, run.cfg
    ecfg = cfg.export
    geom = lm.geometry
    check_exportable(lm.model, books["primary"].spec, ecfg.dtype)
    only_hf = hf_only(lm.model)
    check_disk(out.parent, report["model"]["n_params"], ecfg.tp_sizes, only_hf)  # the parameters validate counted
    for tp in ([] if only_hf else ecfg.tp_sizes):
        check_tp(geom, tp, lm.model.config)
    checks = Checks()
    trt_book, hf_book = (None if only_hf else _book_for(books, cfg.trtllm_format())), _book_for(books, "native_fp8")
    artifacts = {}

    # ---- writers: one pass over the layers, nothing larger than a layer held
    tp_dirs = [] if only_hf else [out / "trtllm_ckpt" / f"tp{tp}" for tp in ecfg.tp_sizes]
    trt_fold, hf_fold = write_native_checkpoints(lm, geom, trt_book, hf_book, ecfg, tp_dirs, out / "hf_ckpt", run.progress)
    # what each GPU loads: the largest rank file of each tp size, as written (FP8 weights kept as stored count as they are)
    per_gpu = {f"tp{tp}": max(f.stat().st_size for f in d.glob("rank*.safetensors")) for tp, d in zip(ecfg.tp_sizes, tp_dirs)}
    tp_note = tp_advice(per_gpu[f"tp{max(ecfg.tp_sizes)}"] * max(ecfg.tp_sizes), ecfg.tp_sizes, ecfg.gpu_memory_gb, geom, lm.model.config) if per_gpu else ""
    if tp_note:
        log.warning("export: %s", tp_note)
    if trt_fold is not None:
        trt_fold.record(checks)
    hf_fold.record(checks)
    hf_guard = hf_fold.guard
    if only_hf:
        return _hf_only_manifest(run, out, checks, report, hf_book, hf_guard, hf_fold.weights)
    algo = NATIVE_ALGO[trt_book.spec.format]
    trt_guard = trt_fold.guard
    primary = books["primary"]
    if primary.spec.tier == "custom":
        mixed = " (per-layer formats: one kernel variant per distinct layer format)" if primary.spec.is_mixed else ""
        artifacts["plugin_bundle"] = {
            "tier": "custom", "what": f"full kvcompress format {primary.spec.name}{mixed}: ScaleBook + fused dequant-attention kernels (AOT) + TensorRT plugin sources",
            "validated_as": primary.spec.name, "verdict": report["verdict"], **plugin_bundle(primary, geom, out / "plugin_bundle", ecfg.archs, checks, run.dir / "kv_stats.safetensors"),
        }
        pb = artifacts["plugin_bundle"]
        if primary.spec.value_rotation_folded:
            pb["value_rotation"] = (f"{primary.spec.value.rotate}, folded into W_v and W_o per head by trtllm_network.load_hf_weights "
                                    "(network.json value_rotation, plugin_params v_rotation); the kernels store the rotated values")
        from kvcompress.targets.network_oracle import key_max_position

        if key_max_position(primary):
            pb["key_positions"] = (f"asymmetric static keys: ranges hold at positions 0..{key_max_position(primary) - 1} (kv.key.max_position, else "
                                   "the model's max_position); build_engine.py --tier custom caps its default --max-seq-len there and refuses a longer one")
        layers = [pb["variants"][n] for n in pb["layer_variants"]] if "layer_variants" in pb else None
        pb["network"] = custom_network(run, primary, pb["variant"], out / "plugin_bundle", checks, layers)

    # ---- checks: read back and re-measure what was written
    base, tol = _baseline(run), (ecfg.recheck_rel_tol, ecfg.recheck_abs_tol)
    g = books["primary"].geometry
    streamed = lm.streamer is not None  # a model that does not fit is re-measured layer by layer, never loaded whole
    how = f"streamed layer by layer into transformers' {type(lm.model).__name__}" if streamed else "reader"
    v_trt = _validated(report, trt_book.spec.name)
    m_trt = recheck.remeasure_trtllm_streamed(tp_dirs[0], lm.model.config, g, base, lm.device) if streamed \
        else recheck.remeasure_trtllm(tp_dirs[0], base)
    c_trt = recheck.compare(v_trt["quality"], m_trt, *tol)
    wdesc = f"the source's FP8 MLP weights and {ecfg.dtype}" if trt_fold.weights["fp8_weights_kept"] else ecfg.dtype
    checks.add(f"trtllm_ckpt/tp{ecfg.tp_sizes[0]} re-measured ({how}, {wdesc} weights, {algo} KV from its stored scales) matches validated {trt_book.spec.name}", c_trt["passed"], c_trt)
    for tp, d in list(zip(ecfg.tp_sizes, tp_dirs))[1:]:
        same = recheck.same_trtllm_tensors(tp_dirs[0], d, geom.n_layers)
        checks.add(f"trtllm_ckpt/tp{tp} shards merge to exactly the tensors of tp{ecfg.tp_sizes[0]}", same, None)
    _refuse_failed("trtllm_ckpt", c_trt)
    v_hf, c_hf = _check_hf(run, out, hf_book, report, checks, base, g)

    artifacts["trtllm_ckpt"] = {
        "tier": "native", "what": f"TensorRT-LLM {TRTLLM_VERSION} checkpoint(s) tp {ecfg.tp_sizes}, kv_cache_quant_algo={algo} (one scale per layer), {wdesc} weights with the fold of {trt_book.spec.name}",
        **trt_fold.weights,
        "paths": [str(d.relative_to(out)) for d in tp_dirs], "validated_as": trt_book.spec.name, "verdict": v_trt["verdict"],
        "weights_per_gpu_bytes": per_gpu, **({"tp_advice": tp_note} if tp_note else {}),
        "fold": {k: trt_book.fit_info.get(k) for k in ("fold_strength_keys", "fold_strength_values", "headroom", "fold_pairs")}, "fold_guard": trt_guard, "remeasured": c_trt,
        "architecture": {"source": type(lm.model).__name__, "written": trtllm_architecture(lm.model.config)},
    }
    if algo == "NVFP4":
        artifacts["trtllm_ckpt"]["pre_blackwell_fallback"] = ("NVFP4 KV needs a Blackwell GPU (sm_100+); on Hopper/Ampere serve hf_ckpt/ (FP8 KV, validated above) "
                                                              "or re-export with export.native_kv=FP8")
    artifacts["hf_ckpt"] = _hf_artifact(ecfg, hf_book, v_hf, c_hf, hf_guard, hf_fold.weights)
    _note_source_weights(lm, artifacts, ecfg.dtype)
    shutil.copy(ROOT / "export" / "build_engine.py", out / "build_engine.py")
    shutil.copy(ROOT / "kvcompress" / "targets" / "trtllm_network.py", out / "trtllm_network.py")
    _copy_weight_readers(out)
    build, why = engine_status(ecfg.build_engine)
    ckpt0 = f"export/trtllm_ckpt/tp{ecfg.tp_sizes[0]}"
    manifest = {
        "format_version": FORMAT_VERSION,
        "run": str(run.dir),
        "artifacts": artifacts,
        **_text_decoder_note(lm),
        "checks": checks.rows,
        "engine_built": False,
        "engine_reason": why,
        "next_step_on_gpu_host": f"python export/build_engine.py --ckpt {ckpt0} --out engine   (tensorrt_llm=={TRTLLM_VERSION}; the native tier)",
        **({"next_step_custom_tier_on_gpu_host": "cd export/plugin_bundle && python acceptance/<variant>/verify.py --plugin-lib lib/<arch>/libkvcompress_trt.so; "
            "python build_engine.py --tier custom --bundle . --plugin-lib lib/<arch>/libkvcompress_trt.so --out engine_custom; "
            "python build_engine.py --tier custom --run engine_custom --prompt 'Hello'   (tensorrt_llm==1.2.1; not run here)"} if "plugin_bundle" in artifacts else {}),
        "check_on_gpu_host": HF_SERVE_CHECK,
        "fallback_fp16_kv": f"python export/build_engine.py --ckpt {ckpt0} --out engine_fp16kv --kv-cache fp16"
        "   (the same folded weights with an unquantized KV cache: a rollback without re-exporting)",
        "not_verified_here": {
            "trtllm-build / trtllm-serve / vLLM acceptance": "TensorRT-LLM and vLLM cannot be installed on this machine",
            "TensorRT plugin wrapper": ("compiled in this run against the TensorRT headers in TENSORRT_INCLUDE_DIR (see checks); never run"
                                        if os.environ.get("TENSORRT_INCLUDE_DIR") else
                                        "not compiled in this run (TENSORRT_INCLUDE_DIR unset); compiled against TensorRT v10.13.3's headers at "
                                        "development time (plugins/README.md); never run (no TensorRT runtime or GPU here)"),
            "kernel speed": "needs a GPU (scripts/bench_decode_attention.py); predicted from the compiled code by scripts/predict_decode.py",
            "ONNX acceptance kit on TensorRT": "plugin_bundle/acceptance/<variant>/verify.py needs a TensorRT host with a GPU; only its CPU check ran here",
            "custom-tier TensorRT-LLM engine": ("build_engine.py --tier custom (network: trtllm_network.py) was not run: no TensorRT-LLM or GPU here; "
                                                "its graph ran on CPU with the reference plugins (see checks), its TensorRT names were checked "
                                                "against TensorRT v10.13.3's bindings and its TensorRT-LLM names by reading the source (export/TRTLLM_API_CHECK.md); "
                                                "where the export ran the network check, build_engine.py --tier custom --check ENGINE compares the built "
                                                "engine with the validated decoding on its tokens (plugin_bundle/network_check.safetensors) on a GPU host"),
        },
        "files": _files(out),
    }
    return manifest, build


def _files(out: Path) -> dict:
    """Every file the export wrote (checkpoints, kernels, launchers, audit, plugin sources, acceptance kit), hashed."""
    return {str(p.relative_to(out)): file_fingerprint(p) for p in sorted(out.rglob("*")) if p.is_file() and not p.is_symlink()}


def _baseline(run):
    """validate's kept baseline of the held-out windows, or (export without validate in this process) computed again."""
    if run.baseline is not None:
        return run.baseline
    lm, cfg = run.lm, run.cfg
    windows = token_windows(lm.tokenizer, load_texts(cfg.eval, "eval"), cfg.eval.n_windows, cfg.eval.seq_len, seed=cfg.eval.seed)
    return recheck.baseline(lm, windows, cfg.eval.batch_size)


def _refuse_failed(label: str, c: dict) -> None:
    if not c["passed"]:
        raise UserError(f"export: the written {label} re-measures KL {c['remeasured_kl']:.3e} but validate measured {c['validated_kl']:.3e} "
                        f"(tolerance {c['tolerance']:.1e}); nothing exported")


def _check_hf(run, out: Path, hf_book: ScaleBook, report: dict, checks: Checks, base, g: dict) -> tuple[dict, dict]:
    """Re-measure the written hf_ckpt through transformers (layer by layer for a streamed model) against validate's
    numbers for its format: (validated, comparison); a failed comparison exports nothing."""
    lm, ecfg = run.lm, run.cfg.export
    streamed = lm.streamer is not None
    v_hf = _validated(report, hf_book.spec.name)
    m_hf = recheck.remeasure_hf_streamed(out / "hf_ckpt", g, base, lm.device) if streamed \
        else recheck.remeasure_hf(out / "hf_ckpt", g, base)
    c_hf = recheck.compare(v_hf["quality"], m_hf, ecfg.recheck_rel_tol, ecfg.recheck_abs_tol)
    checks.add(f"hf_ckpt re-measured (transformers reads config.json + shards{', layer by layer' if streamed else ''}, FP8 KV from k_scale/v_scale) "
               f"matches validated {hf_book.spec.name}", c_hf["passed"], c_hf)
    _refuse_failed("hf_ckpt", c_hf)
    write_serve_check(out, base.windows, v_hf["quality"], hf_book.spec.name)
    return v_hf, c_hf


def write_serve_check(out: Path, windows: torch.Tensor, quality: dict, fmt: str) -> None:
    """export/check_hf_ckpt.py and what it reads (hf_ckpt_check/): the held-out windows validate measured and its numbers on
    them, so a GPU host serves hf_ckpt/ with vLLM on the same tokens and compares (the script's doc)."""
    from safetensors.torch import save_file

    d = out / "hf_ckpt_check"
    d.mkdir(parents=True, exist_ok=True)
    save_file({"ids": windows.to(torch.int32).contiguous()}, str(d / "windows.safetensors"))
    atomic_write_json(d / "expected.json", {"format": fmt, "windows": list(windows.shape), "ppl_baseline": quality["ppl_baseline"],
                                            "ppl_fp8_kv": quality["ppl_compressed"], "ppl_delta_rel": quality["ppl_delta_rel"],
                                            "semantics": "validate's perplexity over every token after the first of each window: float32 model, "
                                                         "KV unquantized (ppl_baseline) and with the checkpoint's FP8 KV cache simulated"})
    shutil.copy(ROOT / "export" / "check_hf_ckpt.py", out / "check_hf_ckpt.py")


def _hf_artifact(ecfg, hf_book: ScaleBook, v_hf: dict, c_hf: dict, guard: dict, weights: dict) -> dict:
    what = (f"Hugging Face checkpoint (sharded) with FP8 KV scales, the source's {weights['kept_formats']} weights kept, fold of {hf_book.spec.name}"
            if weights["fp8_weights_kept"] else
            f"Hugging Face checkpoint ({ecfg.dtype}, sharded) with FP8 KV scales, ModelOpt unified format, fold of {hf_book.spec.name}")
    return {
        "tier": "native", "what": what, **weights,
        "paths": ["hf_ckpt"], "validated_as": hf_book.spec.name, "verdict": v_hf["verdict"],
        "fold": {k: hf_book.fit_info.get(k) for k in ("fold_strength_keys", "fold_strength_values", "headroom", "fold_pairs", "key_norm", "fold_keys_off",
                                                       "fold_values_off")},
        "fold_guard": guard, "remeasured": c_hf,
    }


# the weight readers build_engine.py's loader (trtllm_network.py) imports beside it in the bundle: FP8, integer (pack-quantized,
# GPTQ, AWQ) and NVFP4 sources' dequantization
WEIGHT_READERS = ("fp8_weights.py", "int_weights.py", "nvfp4_weights.py")


def _copy_weight_readers(out: Path) -> None:
    for f in WEIGHT_READERS:
        shutil.copy(ROOT / "kvcompress" / "models" / f, out / f)


def _repackable(ckpt) -> bool:
    """A GPTQ / AWQ source hf_ckpt writes as compressed-tensors pack-quantized (int_weights.repack_obstacle says why not)."""
    return bool(ckpt.qweights) and int_weights.repack_obstacle(quantization_config(ckpt.dir)) is None


def _note_source_weights(lm, artifacts: dict, dtype: str) -> dict:
    """A source with NVFP4 or integer weights (models.nvfp4_weights, models.int_weights): each native checkpoint says whether
    it keeps them (hf_ckpt: NVFP4 and compressed-tensors' as stored, GPTQ's and AWQ's repacked as pack-quantized; trtllm_ckpt:
    Model Optimizer's NVFP4 MLPs) or writes them dequantized (`source_nvfp4_weights`, `source_int_weights`). Any quantized
    source whose server quantizes activations (models.quantized.served_activations: W4A4 NVFP4, W8A8 int8, FP8 W8A8): each
    checkpoint that keeps its weights gets `served_otherwise`, the caveat that it is served otherwise than validated. The
    run warns once for each."""
    src = lm.streamer.ckpt.dir if lm.streamer is not None else None
    if src is None:
        return artifacts
    if weight_quantization(src) == "nvfp4":
        ct = str((quantization_config(src) or {}).get("quant_method")) == "compressed-tensors"
        note = (f"the source's NVFP4 weights are written dequantized, e2m1 code x fp8 block scale {'/' if ct else 'x'} global scale in {dtype}, the values "
                "validate computed with, activations unquantized as validate ran them")
        kept = ("the source's NVFP4 weights kept as stored (codes, fp8 block scales, global and input scales; the attention projections the fold "
                f"changes in {dtype}, in {'its ignore list' if ct else 'exclude_modules'}); validate computed with the values they define")
        for a in artifacts.values():
            if a.get("tier") == "native":
                a["source_nvfp4_weights"] = kept if a.get("fp8_weights_kept") else note
    if weight_quantization(src) == "int":
        q = quantization_config(src) or {}
        why = int_weights.repack_obstacle(q) if int_weights.layout(q) != "pack-quantized" else None
        note = (f"the source's integer weights are written dequantized, (q - z) * s in {dtype}, the values validate computed with "
                "(re-quantize them where the server needs int weights)")
        kept = ("the source's compressed-tensors integer weights kept as stored (pack-quantized codes, or int-quantized int8 codes, with "
                f"their scales; the attention projections the fold changes in {dtype}, listed in its ignore list); validate computed with the "
                "values they define")
        if int_weights.layout(q) != "pack-quantized":
            kept = (f"the source's {q.get('quant_method')} integer weights written as compressed-tensors pack-quantized, the same codes, zero "
                    f"points and scales (checked to dequantize to the validated weights; the attention projections the fold changes in {dtype}, "
                    "listed in its ignore list)")
        hf_note = note + (f"; not written pack-quantized: {why}" if why else "")
        for name, a in artifacts.items():
            if a.get("tier") == "native":
                a["source_int_weights"] = kept if a.get("fp8_weights_kept") else hf_note if name == "hf_ckpt" else note
        if not (artifacts.get("hf_ckpt") or {}).get("fp8_weights_kept"):
            log.warning("export: %s", hf_note)
    served = served_activations(src)
    kept_by = [name for name, a in artifacts.items() if a.get("tier") == "native" and a.get("fp8_weights_kept")]
    if served and kept_by:
        caveat = _activations_caveat(*served, artifacts)
        for name in kept_by:
            artifacts[name]["served_otherwise"] = caveat
        log.warning("export: %s: %s", " and ".join(kept_by), caveat)
    return artifacts


def _activations_caveat(served: str, to: str, artifacts: dict) -> str:
    """The caveat for checkpoints that keep a source's quantized weights whose server also quantizes each kept layer's input
    (W4A4 NVFP4, W8A8 int8 or FP8); it names the artifacts that serve the activations unquantized, as validate ran them
    (those with the weights dequantized, and the custom tier's engine)."""
    plain = [n for n, a in artifacts.items() if a.get("tier") == "native" and not a.get("fp8_weights_kept")]
    plain += ["the custom tier"] if "plugin_bundle" in artifacts else []
    as_plain = f" (as {' and '.join(plain)} {'serves' if len(plain) == 1 else 'serve'} them)" if plain else ""
    return (f"served as {served}, each kept quantized layer also quantizes its input to {to}, which validate and the re-measurement ran "
            f"unquantized{as_plain}: the K/V its server caches differ from the validated ones by that noise from layer 1 on (not emulated "
            "here; export.fp8_weights=dequantize writes the weights dequantized, served as validated)")


def _text_decoder_note(lm) -> dict:
    """The manifest's word on a multimodal source (models.multimodal): only its text decoder was compressed and written."""
    wrapper = lm.identity.get("text_decoder_of")
    if not wrapper:
        return {}
    return {"text_decoder_only": f"the source is a multimodal {wrapper}: its text decoder ({type(lm.model).__name__}) was profiled, validated and "
                                 "written; its vision tower and projector are not in this export (the checkpoints serve text)"}


def _hf_only_manifest(run, out: Path, checks: Checks, report: dict, hf_book: ScaleBook, guard: dict, weights: dict) -> tuple[dict, bool]:
    """The export of a model the TensorRT-LLM checkpoint cannot carry (export_route; Gemma 3): the folded FP8 HF checkpoint,
    re-measured, and nothing else."""
    lm = run.lm
    v_hf, c_hf = _check_hf(run, out, hf_book, report, checks, _baseline(run), hf_book.geometry)
    manifest = {
        "format_version": FORMAT_VERSION,
        "run": str(run.dir),
        "artifacts": _note_source_weights(lm, {"hf_ckpt": _hf_artifact(run.cfg.export, hf_book, v_hf, c_hf, guard, weights)}, run.cfg.export.dtype),
        **_text_decoder_note(lm),
        "not_written": {"trtllm_ckpt": f"{export_route(lm.model)[1]}; serve hf_ckpt/, which TensorRT-LLM's PyTorch backend and vLLM run with "
                                       "the model's own code"},
        "checks": checks.rows,
        "engine_built": False,
        "engine_reason": "no TensorRT-LLM checkpoint for this model (hf_ckpt/ is served by TensorRT-LLM's PyTorch backend, which builds no engine)",
        "next_step_on_gpu_host": ("python export/check_hf_ckpt.py   (the stored k/v scales are not read by vLLM for this quantization method: "
                                  "artifacts.hf_ckpt.kv_scales_unread; the check measures what --kv-cache-dtype fp8 serves before you rely on it; "
                                  "vllm serve export/hf_ckpt --kv-cache-dtype auto serves the validated weights with an unquantized KV cache)")
                                 if weights.get("kv_scales_unread") else
                                 "trtllm-serve export/hf_ckpt --kv_cache_dtype fp8   (TensorRT-LLM's PyTorch backend; the quantization config carries the "
                                 "FP8 KV cache and its stored k_scale/v_scale; or: vllm serve export/hf_ckpt --kv-cache-dtype fp8; neither run here)",
        "check_on_gpu_host": HF_SERVE_CHECK,
        "fallback_fp16_kv": ("serve export/hf_ckpt with --kv-cache-dtype auto after removing the KV entries of its quantization config (kv_cache_quant_algo "
                             "in hf_quant_config.json, kv_cache_scheme in config.json), keeping the weight format: the same folded weights with an "
                             "unquantized KV cache") if weights["fp8_weights_kept"] else
                            ("serve export/hf_ckpt without hf_quant_config.json and config.json's quantization_config: the same folded weights "
                             "(the fold is exact in float32, then rounded to export.dtype) with an unquantized KV cache"),
        "not_verified_here": {
            "trtllm-serve / vLLM loading and serving": "neither installs on this machine; the checkpoint was re-measured through transformers (see checks)",
        },
        "files": _files(out),
    }
    return manifest, False


def _build(ckpt: Path, engine: Path) -> dict:
    p = subprocess.run([sys.executable, str(ROOT / "export" / "build_engine.py"), "--ckpt", str(ckpt), "--out", str(engine)], capture_output=True, text=True)
    return {"returncode": p.returncode, "log_tail": (p.stdout + p.stderr)[-2000:]}


@contextmanager
def _uninterruptible():
    """Ignore further Ctrl-C while cleaning up after an interrupt (a second one must not leave half a temp dir)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)


def export_run(run, book_paths: dict[str, Path]) -> dict[str, Path]:
    """Pipeline glue: export into a temporary directory, rename to export/ when complete."""
    report_path = run.dir / "report.json"
    if not report_path.is_file() or any(not Path(p).is_file() for p in book_paths.values()):
        raise UserError("stage export ships only what validate measured: run it with fit and validate (the default stages)")
    report = json.loads(report_path.read_text())
    books = {role: run.scalebook(Path(p)) for role, p in book_paths.items()}
    final, tmp = run.dir / "export", run.dir / ".export.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        manifest, build = export(run, books, report, tmp)
        atomic_write_json(tmp / "manifest.json", manifest)  # last: a directory with a manifest is complete
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
    except BaseException:
        with _uninterruptible():
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if build:
        manifest["engine_build"] = _build(final / "trtllm_ckpt" / f"tp{run.cfg.export.tp_sizes[0]}", final / "engine")
        manifest["engine_built"] = manifest["engine_build"]["returncode"] == 0
        atomic_write_json(final / "manifest.json", manifest)
    failed = [c["check"] for c in manifest["checks"] if c["status"] not in ("passed", "skipped")]
    skipped = [c["check"] for c in manifest["checks"] if c["status"] == "skipped"]
    log.info("export: wrote %s (%s); %d checks, %s%s; TensorRT engine %s: %s", final, ", ".join(manifest["artifacts"]), len(manifest["checks"]),
             f"FAILED: {failed}" if failed else "all that ran passed", f"; skipped (reason in the manifest): {skipped}" if skipped else "",
             "BUILT" if manifest["engine_built"] else "NOT BUILT", manifest["engine_reason"])
    report["export"] = manifest
    atomic_write_json(report_path, report)
    return {"export": final}
