// TensorRT IPluginV3 wrapper around the kvcompress decode-attention kernels (thin: no numerics here).
//
// Compiled (not run) against TensorRT v10.13.3's public headers with -Wall -Wextra -Werror (see
// plugins/README.md, tests/test_plugins.py); build it on a TensorRT host with plugins/CMakeLists.txt.
// The kernels it launches are the AOT-compiled Triton kernels of plugin_bundle/kernels/<arch>/
// (tested against the reference numerics).
//
// Inputs (one layer, layout of kvcompress/kernels/layout.py):
//   static family:
//   0 q [B, HQ, D] fp16          1 k_scale [H, D] fp32      2 k_zero_masked [H, D] fp32   3 outlier_idx [H, N_OUT] int32
//   4 sink_k 5 sink_v [B, H, NS, D] fp16    6 win_k 7 win_v [B, H, W, D] fp16
//   8 k_payload 9 k_outliers 10 v_payload 11 v_scale 12 v_min (packed store)   13 lens [B] int32
//   grouped family (KVC_GT > 0, kv=wf4):
//   0 q   1 k_bits 2 k_offsets [H, D] int32   3..6 sinks and window   7 k_payload [B, H, CAP, D*KEY_BITS/8] uint8
//   8 k_gscale 9 k_gmin [B, H, CAP/GT, D] fp16   10 v_payload 11 v_scale 12 v_min   13 lens
//   per-token family (KVC_KGROUP > 0, kv=rot8k_int4v): 12 inputs
//   0 q   1 qr [B, HQ, D] fp16 (the query in the keys' basis)   2..5 sinks and window   6 k_payload 7 k_scale [B, H, CAP, D/KGROUP] fp16
//   8 v_payload 9 v_scale 10 v_min   11 lens
// Output: 0 out [B, HQ, D] fp32.  Workspace: split partials (max, sum, acc).
#include "kvcCommon.h"
#include <cstring>
#include <vector>

using namespace nvinfer1;

namespace kvc {

static constexpr char const* kNAME = "KvcDecodeAttention";
static constexpr char const* kVERSION = "1";

struct Params {
  int32_t H, G, D, splits, cap;
  float sm_scale;
};

class DecodeAttentionPlugin : public IPluginV3, public IPluginV3OneCore, public IPluginV3OneBuild, public IPluginV3OneRuntime {
 public:
  explicit DecodeAttentionPlugin(Params p) : p_(p) {}
  IPluginCapability* getCapabilityInterface(PluginCapabilityType type) noexcept override {
    if (type == PluginCapabilityType::kBUILD) return static_cast<IPluginV3OneBuild*>(this);
    if (type == PluginCapabilityType::kRUNTIME) return static_cast<IPluginV3OneRuntime*>(this);
    return static_cast<IPluginV3OneCore*>(this);
  }
  IPluginV3* clone() noexcept override { return new DecodeAttentionPlugin(p_); }
  char const* getPluginName() const noexcept override { return kNAME; }
  char const* getPluginVersion() const noexcept override { return kVERSION; }
  char const* getPluginNamespace() const noexcept override { return kNAMESPACE; }

  int32_t getNbOutputs() const noexcept override { return 1; }
  int32_t getOutputDataTypes(DataType* out, int32_t nbOutputs, DataType const*, int32_t nbInputs) const noexcept override {
    if (nbInputs != kDECODE_IN || nbOutputs != 1) {
      logError("KvcDecodeAttention: needs " + std::to_string(kDECODE_IN) + " inputs and 1 output, got " + std::to_string(nbInputs) + " and " + std::to_string(nbOutputs));
      return -1;
    }
    out[0] = DataType::kFLOAT;
    return 0;
  }
  int32_t getOutputShapes(DimsExprs const* in, int32_t nbInputs, DimsExprs const*, int32_t, DimsExprs* out, int32_t,
                          IExprBuilder&) noexcept override {
    if (nbInputs != kDECODE_IN || in[0].nbDims != 3) {
      logError("KvcDecodeAttention: q must be [B, HQ, D] with " + std::to_string(kDECODE_IN - 1) + " inputs after it");
      return -1;
    }
    out[0] = in[0];  // [B, HQ, D]
    return 0;
  }
  bool supportsFormatCombination(int32_t pos, DynamicPluginTensorDesc const* io, int32_t, int32_t) noexcept override {
    int32_t const firstCache = kNQ + kNKEYP, lensPos = firstCache + kNCACHE;
    DataType want = pos < kNQ ? DataType::kHALF : pos < firstCache ? keyParamType(pos - kNQ) : pos < lensPos ? cacheType(pos - firstCache)
                  : pos == lensPos ? DataType::kINT32 : DataType::kFLOAT;
    return io[pos].desc.format == TensorFormat::kLINEAR && io[pos].desc.type == want;
  }
  // every shape against the attributes and the compiled variant (kvc_variant_<name>.h); errors go to TensorRT's logger
  int32_t configurePlugin(DynamicPluginTensorDesc const* in, int32_t nbInputs, DynamicPluginTensorDesc const*, int32_t) noexcept override {
    char const* P = "KvcDecodeAttention";
    if (nbInputs != kDECODE_IN) return logError("KvcDecodeAttention: needs " + std::to_string(kDECODE_IN) + " inputs"), -1;
    if (p_.D != KVC_D || p_.G != KVC_G || p_.H <= 0 || p_.cap <= 0 || p_.splits <= 0) {
      logError(std::string(P) + ": attributes D=" + std::to_string(p_.D) + " G=" + std::to_string(p_.G) + " H=" + std::to_string(p_.H) + " cap=" +
               std::to_string(p_.cap) + " splits=" + std::to_string(p_.splits) + " do not fit the compiled variant " + KVC_VARIANT_NAME +
               " (D=" + std::to_string(KVC_D) + ", G=" + std::to_string(KVC_G) + "; H, cap, splits > 0)");
      return -1;
    }
    int64_t B = in[0].desc.dims.d[0];
    bool ok = checkDims(in[0].desc.dims, {B, int64_t(p_.H) * p_.G, KVC_D}, P, "q");
    if (kPER_TOKEN)
      ok = ok && checkDims(in[1].desc.dims, {B, int64_t(p_.H) * p_.G, KVC_D}, P, "qr");
    else if (kGROUPED)
      ok = ok && checkDims(in[1].desc.dims, {p_.H, KVC_D}, P, "k_bits") && checkDims(in[2].desc.dims, {p_.H, KVC_D}, P, "k_offsets");
    else
      ok = ok && checkDims(in[1].desc.dims, {p_.H, KVC_D}, P, "k_scale") && checkDims(in[2].desc.dims, {p_.H, KVC_D}, P, "k_zero_masked") &&
           checkDims(in[3].desc.dims, {p_.H, KVC_N_OUT}, P, "outlier_idx");
    return ok && checkCache(in, kNQ + kNKEYP, B, p_.H, p_.cap, P) ? 0 : -1;
  }
  size_t getWorkspaceSize(DynamicPluginTensorDesc const* in, int32_t, DynamicPluginTensorDesc const*, int32_t) const noexcept override {
    size_t rows = size_t(in[0].max.d[0]) * in[0].max.d[1];
    return rows * p_.splits * (2 + p_.D) * sizeof(float) + 32;  // + 2 x 16: each part starts 16-byte aligned
  }
  int32_t onShapeChange(PluginTensorDesc const*, int32_t, PluginTensorDesc const*, int32_t) noexcept override { return 0; }
  IPluginV3* attachToContext(IPluginResourceContext*) noexcept override { return clone(); }
  PluginFieldCollection const* getFieldsToSerialize() noexcept override {
    fields_ = {PluginField("H", &p_.H, PluginFieldType::kINT32, 1), PluginField("G", &p_.G, PluginFieldType::kINT32, 1),
               PluginField("D", &p_.D, PluginFieldType::kINT32, 1), PluginField("splits", &p_.splits, PluginFieldType::kINT32, 1),
               PluginField("cap", &p_.cap, PluginFieldType::kINT32, 1), PluginField("sm_scale", &p_.sm_scale, PluginFieldType::kFLOAT32, 1)};
    fc_ = {int32_t(fields_.size()), fields_.data()};
    return &fc_;
  }

  int32_t enqueue(PluginTensorDesc const* in, PluginTensorDesc const*, void const* const* inputs, void* const* outputs,
                  void* workspace, cudaStream_t stream) noexcept override {
    auto ptr = [&](int i) { return reinterpret_cast<CUdeviceptr>(inputs[i]); };
    // the AOT kernels are compiled for 16-byte-aligned buffers (vectorized loads; kvcompress.kernels.aot.POINTER_ALIGN)
    for (int i = 0; i < kDECODE_IN; ++i)
      if (!aligned16(inputs[i])) return logError("KvcDecodeAttention: input " + std::to_string(i) + " is not 16-byte aligned"), -1;
    if (!aligned16(workspace) || !aligned16(outputs[0])) return logError("KvcDecodeAttention: workspace/output not 16-byte aligned"), -1;
    unsigned B = in[0].dims.d[0], HQ = in[0].dims.d[1];
    CUdeviceptr mo = reinterpret_cast<CUdeviceptr>(workspace);
    size_t part = (size_t(B) * HQ * p_.splits * sizeof(float) + 15) & ~size_t(15);
    CUdeviceptr lo = mo + part;
    CUdeviceptr ao = lo + part;
#if KVC_GT > 0  // decode_split_grp(Q, SK, SV, WK, WV, KP, KB, KOFF, KGS, KGM, VP, VS, VM, LENS, MO, LO, AO, sm_scale, H, CAP, CAPG, SPLITS)
    CUresult r = KVC_DECODE_SPLIT_LAUNCH(reinterpret_cast<CUstream>(stream), B, p_.H, p_.splits, ptr(0), ptr(3), ptr(4), ptr(5), ptr(6),
                                         ptr(7), ptr(1), ptr(2), ptr(8), ptr(9), ptr(10), ptr(11), ptr(12), ptr(13),
                                         mo, lo, ao, p_.sm_scale, p_.H, p_.cap, p_.cap / KVC_GT, p_.splits);
#elif KVC_KGROUP > 0  // decode_split_rot(Q, QR, SK, SV, WK, WV, KP, KSC, VP, VS, VM, LENS, MO, LO, AO, sm_scale, H, CAP, SPLITS): the input order
    CUresult r = KVC_DECODE_SPLIT_LAUNCH(reinterpret_cast<CUstream>(stream), B, p_.H, p_.splits, ptr(0), ptr(1), ptr(2), ptr(3),
                                         ptr(4), ptr(5), ptr(6), ptr(7), ptr(8), ptr(9), ptr(10), ptr(11),
                                         mo, lo, ao, p_.sm_scale, p_.H, p_.cap, p_.splits);
#else
    CUresult r = KVC_DECODE_SPLIT_LAUNCH(reinterpret_cast<CUstream>(stream), B, p_.H, p_.splits, ptr(0), ptr(1), ptr(2), ptr(3),
                                         ptr(4), ptr(5), ptr(6), ptr(7), ptr(8), ptr(9), ptr(10), ptr(11), ptr(12), ptr(13),
                                         mo, lo, ao, p_.sm_scale, p_.H, p_.cap, p_.splits);
#endif
    if (r != CUDA_SUCCESS) return int32_t(r);
    r = KVC_DECODE_REDUCE_LAUNCH(reinterpret_cast<CUstream>(stream), B * HQ, 1, 1, mo, lo, ao, reinterpret_cast<CUdeviceptr>(outputs[0]), p_.splits);
    return int32_t(r);
  }

 private:
  Params p_;
  std::vector<PluginField> fields_;
  PluginFieldCollection fc_{};
};

class DecodeAttentionCreator : public IPluginCreatorV3One {
 public:
  char const* getPluginName() const noexcept override { return kNAME; }
  char const* getPluginVersion() const noexcept override { return kVERSION; }
  char const* getPluginNamespace() const noexcept override { return kNAMESPACE; }
  PluginFieldCollection const* getFieldNames() noexcept override {
    fields_ = {PluginField("H", nullptr, PluginFieldType::kINT32, 1), PluginField("G", nullptr, PluginFieldType::kINT32, 1),
               PluginField("D", nullptr, PluginFieldType::kINT32, 1), PluginField("splits", nullptr, PluginFieldType::kINT32, 1),
               PluginField("cap", nullptr, PluginFieldType::kINT32, 1), PluginField("sm_scale", nullptr, PluginFieldType::kFLOAT32, 1)};
    fc_ = {int32_t(fields_.size()), fields_.data()};
    return &fc_;
  }
  IPluginV3* createPlugin(char const*, PluginFieldCollection const* fc, TensorRTPhase) noexcept override {
    Params p{};
    for (int32_t i = 0; i < fc->nbFields; ++i) {
      std::string n = fc->fields[i].name;
      if (n == "sm_scale") p.sm_scale = *static_cast<float const*>(fc->fields[i].data);
      else {
        int32_t v = *static_cast<int32_t const*>(fc->fields[i].data);
        if (n == "H") p.H = v; else if (n == "G") p.G = v; else if (n == "D") p.D = v;
        else if (n == "splits") p.splits = v; else if (n == "cap") p.cap = v;
      }
    }
    return new DecodeAttentionPlugin(p);
  }

 private:
  std::vector<PluginField> fields_;
  PluginFieldCollection fc_{0, nullptr};
};

}  // namespace kvc

using kvc::DecodeAttentionCreator;
REGISTER_TENSORRT_PLUGIN(DecodeAttentionCreator);
