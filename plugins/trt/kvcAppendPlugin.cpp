// TensorRT IPluginV3 "KvcAppend" (namespace kvcompress): quantize-on-write of one new token per sequence
// into the packed store and the fp16 window/sinks ring, launching the AOT-compiled Triton kv_append
// kernel (bit-exact with kvcompress/reference/ in the interpreter tests). Thin: no numerics here.
//
// Compiled (not run) against TensorRT v10.13.3's public headers (plugins/README.md, tests/test_plugins.py).
//
// Inputs: 0 k_new 1 v_new [B, H, D] fp16   2 k_scale [H, D] fp32   3 k_zero [H, D] fp32   4 outlier_idx [H, N_OUT] int32
//         5 sink_k 6 sink_v [B, H, NS, D] fp16   7 win_k 8 win_v [B, H, W, D] fp16
//         9 k_payload 10 k_outliers 11 v_payload 12 v_scale 13 v_min (packed store)   14 lens [B] int32 (tokens before this one)
// Per-token family (KVC_KGROUP > 0, kv=rot8k_int4v): 0 k_new 1 v_new   2..10 the 9 cache buffers (k_scale replaces
// k_outliers)   11 lens; outputs 0..8 aliased to 2..10. No key parameters (scales are computed per token on write).
// Grouped family (KVC_GT > 0, kv=wf4): 0 k_new 1 v_new   2 k_bits 3 k_offsets [H, D] int32   4..13 the 10 cache buffers
// (sink_k sink_v win_k win_v k_payload k_gscale k_gmin v_payload v_scale v_min)   14 lens; outputs 0..9 aliased to 4..13.
// When the token leaving the window starts a key group, the kernel encodes the whole group (all of it is in the window).
// Outputs 0..8: the updated cache buffers 5..13, ALIASED to those inputs (IPluginV3OneBuildV2::getAliasedInput; the
// builder config must enable PreviewFeature::kALIASED_PLUGIN_IO_10_03): written in place, nothing copied.
// lens is read, not advanced: the network adds 1 after the step (an elementwise Add), so every head of the
// launch reads the same position.
#include "kvcCommon.h"
#include <vector>

using namespace nvinfer1;

namespace kvc {

static constexpr char const* kAPPEND = "KvcAppend";
static constexpr char const* kAPPEND_VERSION = "1";
static constexpr int32_t kIN = kAPPEND_IN, kOUT = kNCACHE, kFIRST_CACHE = 2 + kNKEYP;

struct AppendParams {
  int32_t H, D, cap;
};

class AppendPlugin : public IPluginV3, public IPluginV3OneCore, public IPluginV3OneBuildV2, public IPluginV3OneRuntime {
 public:
  explicit AppendPlugin(AppendParams p) : p_(p) {}
  IPluginCapability* getCapabilityInterface(PluginCapabilityType type) noexcept override {
    if (type == PluginCapabilityType::kBUILD) return static_cast<IPluginV3OneBuildV2*>(this);
    if (type == PluginCapabilityType::kRUNTIME) return static_cast<IPluginV3OneRuntime*>(this);
    return static_cast<IPluginV3OneCore*>(this);
  }
  IPluginV3* clone() noexcept override { return new AppendPlugin(p_); }
  char const* getPluginName() const noexcept override { return kAPPEND; }
  char const* getPluginVersion() const noexcept override { return kAPPEND_VERSION; }
  char const* getPluginNamespace() const noexcept override { return kNAMESPACE; }

  int32_t getNbOutputs() const noexcept override { return kOUT; }
  int32_t getAliasedInput(int32_t outputIndex) noexcept override { return outputIndex >= 0 && outputIndex < kOUT ? kFIRST_CACHE + outputIndex : -1; }
  int32_t getOutputDataTypes(DataType* out, int32_t nbOutputs, DataType const* in, int32_t nbInputs) const noexcept override {
    if (nbInputs != kIN || nbOutputs != kOUT) return logError("KvcAppend: needs " + std::to_string(kIN) + " inputs and " + std::to_string(kOUT) + " outputs"), -1;
    for (int32_t i = 0; i < kOUT; ++i) out[i] = in[kFIRST_CACHE + i];
    return 0;
  }
  int32_t getOutputShapes(DimsExprs const* in, int32_t nbInputs, DimsExprs const*, int32_t, DimsExprs* out, int32_t nbOutputs,
                          IExprBuilder&) noexcept override {
    if (nbInputs != kIN || nbOutputs != kOUT) return logError("KvcAppend: needs " + std::to_string(kIN) + " inputs and " + std::to_string(kOUT) + " outputs"), -1;
    for (int32_t i = 0; i < kOUT; ++i) out[i] = in[kFIRST_CACHE + i];
    return 0;
  }
  bool supportsFormatCombination(int32_t pos, DynamicPluginTensorDesc const* io, int32_t, int32_t) noexcept override {
    if (io[pos].desc.format != TensorFormat::kLINEAR) return false;
    int32_t src = pos < kIN ? pos : kFIRST_CACHE + (pos - kIN);  // an output has its aliased input's type
    DataType want = src < 2 ? DataType::kHALF : src < kFIRST_CACHE ? keyParamType(src - 2) : src < kFIRST_CACHE + kNCACHE ? cacheType(src - kFIRST_CACHE)
                  : DataType::kINT32;
    return io[pos].desc.type == want;
  }
  int32_t configurePlugin(DynamicPluginTensorDesc const* in, int32_t nbInputs, DynamicPluginTensorDesc const*, int32_t nbOutputs) noexcept override {
    char const* P = kAPPEND;
    if (nbInputs != kIN || nbOutputs != kOUT) return logError("KvcAppend: needs " + std::to_string(kIN) + " inputs and " + std::to_string(kOUT) + " outputs"), -1;
    if (p_.D != KVC_D || p_.H <= 0 || p_.cap <= 0) {
      logError(std::string(P) + ": attributes D=" + std::to_string(p_.D) + " H=" + std::to_string(p_.H) + " cap=" + std::to_string(p_.cap) +
               " do not fit the compiled variant " + KVC_VARIANT_NAME + " (D=" + std::to_string(KVC_D) + "; H, cap > 0)");
      return -1;
    }
    int64_t B = in[0].desc.dims.d[0];
    bool ok = checkDims(in[0].desc.dims, {B, p_.H, KVC_D}, P, "k_new") && checkDims(in[1].desc.dims, {B, p_.H, KVC_D}, P, "v_new");
    if (kGROUPED)
      ok = ok && checkDims(in[2].desc.dims, {p_.H, KVC_D}, P, "k_bits") && checkDims(in[3].desc.dims, {p_.H, KVC_D}, P, "k_offsets");
    else if (!kPER_TOKEN)
      ok = ok && checkDims(in[2].desc.dims, {p_.H, KVC_D}, P, "k_scale") && checkDims(in[3].desc.dims, {p_.H, KVC_D}, P, "k_zero") &&
           checkDims(in[4].desc.dims, {p_.H, KVC_N_OUT}, P, "outlier_idx");
    return ok && checkCache(in, kFIRST_CACHE, B, p_.H, p_.cap, P) ? 0 : -1;
  }
  size_t getWorkspaceSize(DynamicPluginTensorDesc const*, int32_t, DynamicPluginTensorDesc const*, int32_t) const noexcept override { return 0; }
  int32_t onShapeChange(PluginTensorDesc const*, int32_t, PluginTensorDesc const*, int32_t) noexcept override { return 0; }
  IPluginV3* attachToContext(IPluginResourceContext*) noexcept override { return clone(); }
  PluginFieldCollection const* getFieldsToSerialize() noexcept override {
    fields_ = {PluginField("H", &p_.H, PluginFieldType::kINT32, 1), PluginField("D", &p_.D, PluginFieldType::kINT32, 1),
               PluginField("cap", &p_.cap, PluginFieldType::kINT32, 1)};
    fc_ = {int32_t(fields_.size()), fields_.data()};
    return &fc_;
  }

  int32_t enqueue(PluginTensorDesc const* in, PluginTensorDesc const*, void const* const* inputs, void* const* outputs, void*,
                  cudaStream_t stream) noexcept override {
    for (int32_t i = 0; i < kIN; ++i)
      if (!aligned16(inputs[i])) return logError("KvcAppend: input " + std::to_string(i) + " is not 16-byte aligned"), -1;
    for (int32_t i = 0; i < kOUT; ++i)
      if (outputs[i] != inputs[kFIRST_CACHE + i]) return logError("KvcAppend: output " + std::to_string(i) + " is not aliased to its cache input"), -1;
    auto ptr = [&](int32_t i) { return reinterpret_cast<CUdeviceptr>(inputs[i]); };
    unsigned B = unsigned(in[0].dims.d[0]);
#if KVC_GT > 0  // kv_append_grp(KN, VN, SK, SV, WK, WV, KP, KB, KOFF, KGS, KGM, VP, VS, VM, LENS, H, CAP, CAPG)
    CUresult r = KVC_APPEND_LAUNCH(reinterpret_cast<CUstream>(stream), B, unsigned(p_.H), 1u, ptr(0), ptr(1), ptr(4), ptr(5), ptr(6), ptr(7),
                                   ptr(8), ptr(2), ptr(3), ptr(9), ptr(10), ptr(11), ptr(12), ptr(13), ptr(14), p_.H, p_.cap, p_.cap / KVC_GT);
#elif KVC_KGROUP > 0  // kv_append_rot(KN, VN, SK, SV, WK, WV, KP, KSC, VP, VS, VM, LENS, H, CAP): the input order
    CUresult r = KVC_APPEND_LAUNCH(reinterpret_cast<CUstream>(stream), B, unsigned(p_.H), 1u, ptr(0), ptr(1), ptr(2), ptr(3), ptr(4), ptr(5),
                                   ptr(6), ptr(7), ptr(8), ptr(9), ptr(10), ptr(11), p_.H, p_.cap);
#else
    CUresult r = KVC_APPEND_LAUNCH(reinterpret_cast<CUstream>(stream), B, unsigned(p_.H), 1u, ptr(0), ptr(1), ptr(2), ptr(3), ptr(4), ptr(5),
                                   ptr(6), ptr(7), ptr(8), ptr(9), ptr(10), ptr(11), ptr(12), ptr(13), ptr(14), p_.H, p_.cap);
#endif
    return r == CUDA_SUCCESS ? 0 : int32_t(r);
  }

 private:
  AppendParams p_;
  std::vector<PluginField> fields_;
  PluginFieldCollection fc_{};
};

class AppendCreator : public IPluginCreatorV3One {
 public:
  char const* getPluginName() const noexcept override { return kAPPEND; }
  char const* getPluginVersion() const noexcept override { return kAPPEND_VERSION; }
  char const* getPluginNamespace() const noexcept override { return kNAMESPACE; }
  PluginFieldCollection const* getFieldNames() noexcept override {
    fields_ = {PluginField("H", nullptr, PluginFieldType::kINT32, 1), PluginField("D", nullptr, PluginFieldType::kINT32, 1),
               PluginField("cap", nullptr, PluginFieldType::kINT32, 1)};
    fc_ = {int32_t(fields_.size()), fields_.data()};
    return &fc_;
  }
  IPluginV3* createPlugin(char const*, PluginFieldCollection const* fc, TensorRTPhase) noexcept override {
    AppendParams p{};
    for (int32_t i = 0; i < fc->nbFields; ++i) {
      std::string n = fc->fields[i].name;
      int32_t v = *static_cast<int32_t const*>(fc->fields[i].data);
      if (n == "H") p.H = v; else if (n == "D") p.D = v; else if (n == "cap") p.cap = v;
    }
    return new AppendPlugin(p);
  }

 private:
  std::vector<PluginField> fields_;
  PluginFieldCollection fc_{0, nullptr};
};

}  // namespace kvc

using kvc::AppendCreator;
REGISTER_TENSORRT_PLUGIN(AppendCreator);
