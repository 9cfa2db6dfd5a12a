// TensorRT IPluginV3 wrapper around the kvcompress decode-attention kernels (thin: no numerics here).
//
// Compiled (not run) against TensorRT v10.13.3's public headers with -Wall -Wextra -Werror (see
// plugins/README.md, tests/test_plugins.py); build it on a TensorRT host with plugins/CMakeLists.txt.
// The kernels it launches are the AOT-compiled Triton kernels of plugin_bundle/kernels/<arch>/
// (tested against the reference numerics).
//
// Inputs (one layer, layout of kvcompress/kernels/layout.py):
//   0 q [B, HQ, D] fp16          1 k_scale [H, D] fp32      2 k_zero_masked [H, D] fp32   3 outlier_idx [H, N_OUT] int32
//   4 sink_k 5 sink_v [B, H, NS, D] fp16    6 win_k 7 win_v [B, H, W, D] fp16
//   8 k_payload 9 k_outliers 10 v_payload 11 v_scale 12 v_min (packed store)   13 lens [B] int32
// Output: 0 out [B, HQ, D] fp32.  Workspace: split partials (max, sum, acc).
#include "kvc_launchers.h"
#include <NvInferRuntime.h>
#include <cstdint>
#include <cstring>
#include <string>
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
  char const* getPluginNamespace() const noexcept override { return "kvcompress"; }

  int32_t getNbOutputs() const noexcept override { return 1; }
  int32_t getOutputDataTypes(DataType* out, int32_t, DataType const*, int32_t) const noexcept override {
    out[0] = DataType::kFLOAT;
    return 0;
  }
  int32_t getOutputShapes(DimsExprs const* in, int32_t, DimsExprs const*, int32_t, DimsExprs* out, int32_t,
                          IExprBuilder&) noexcept override {
    out[0] = in[0];  // [B, HQ, D]
    return 0;
  }
  bool supportsFormatCombination(int32_t pos, DynamicPluginTensorDesc const* io, int32_t, int32_t) noexcept override {
    static DataType const kTypes[] = {DataType::kHALF, DataType::kFLOAT, DataType::kFLOAT, DataType::kINT32,
                                      DataType::kHALF, DataType::kHALF, DataType::kHALF, DataType::kHALF,
                                      DataType::kINT8, DataType::kHALF, DataType::kUINT8, DataType::kHALF,
                                      DataType::kHALF, DataType::kINT32, DataType::kFLOAT};
    return io[pos].desc.format == TensorFormat::kLINEAR && (pos == 8 || io[pos].desc.type == kTypes[pos]);
  }
  int32_t configurePlugin(DynamicPluginTensorDesc const*, int32_t, DynamicPluginTensorDesc const*, int32_t) noexcept override { return 0; }
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
    for (int i = 0; i < 14; ++i)
      if (ptr(i) % 16) return -1;
    if (reinterpret_cast<uintptr_t>(workspace) % 16 || reinterpret_cast<uintptr_t>(outputs[0]) % 16) return -1;
    unsigned B = in[0].dims.d[0], HQ = in[0].dims.d[1];
    CUdeviceptr mo = reinterpret_cast<CUdeviceptr>(workspace);
    size_t part = (size_t(B) * HQ * p_.splits * sizeof(float) + 15) & ~size_t(15);
    CUdeviceptr lo = mo + part;
    CUdeviceptr ao = lo + part;
    CUresult r = KVC_DECODE_SPLIT_LAUNCH(reinterpret_cast<CUstream>(stream), B, p_.H, p_.splits, ptr(0), ptr(1), ptr(2), ptr(3),
                                         ptr(4), ptr(5), ptr(6), ptr(7), ptr(8), ptr(9), ptr(10), ptr(11), ptr(12), ptr(13),
                                         mo, lo, ao, p_.sm_scale, p_.H, p_.cap, p_.splits);
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
  char const* getPluginNamespace() const noexcept override { return "kvcompress"; }
  PluginFieldCollection const* getFieldNames() noexcept override { return &fc_; }
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
  PluginFieldCollection fc_{0, nullptr};
};

}  // namespace kvc

using kvc::DecodeAttentionCreator;
REGISTER_TENSORRT_PLUGIN(DecodeAttentionCreator);
