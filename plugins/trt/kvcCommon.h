// Shared by the kvcompress TensorRT plugins: the compiled variant's constants and shape checks that
// report through TensorRT's logger. No numerics here.
#pragma once
#include "kvc_launchers.h"
#include KVC_VARIANT_HEADER  // kvc_variant_<name>.h, generated with the AOT kernels (constants they were compiled with)
#include <NvInferRuntime.h>
#include <cstdint>
#include <string>

namespace kvc {

#ifndef KVC_PLUGIN_NAMESPACE
#define KVC_PLUGIN_NAMESPACE "kvcompress"  // a library holding several variants registers each as kvcompress.<variant>
#endif
static constexpr char const* kNAMESPACE = KVC_PLUGIN_NAMESPACE;
#ifndef KVC_GT
#define KVC_GT 0  // variant headers of the static family written before the grouped family existed
#define KVC_V_SYM 0
#define KVC_V_ROT 0
#define KVC_V_CODE 0
#endif
#ifndef KVC_KGROUP
#define KVC_KGROUP 0
#define KVC_KROT 0
#endif
// the grouped family (KVC_GT > 0, e.g. kv=wf4): keys per channel over groups of KVC_GT tokens, codes of varying
// widths (mean KVC_KEY_BITS) in one bitstream per row, a scale and min per channel and group; the plugins take the
// widths and bit offsets [H, D] int32 instead of the static key parameters, and 10 cache buffers instead of 9.
// the per-token family (KVC_KGROUP > 0, e.g. kv=rot8k_int4v): keys quantized per token (an fp16 scale per KVC_KGROUP
// channels, k_scale replaces k_outliers), no static key parameters; KvcDecodeAttention also takes the query in the
// keys' basis (qr [B, HQ, D] fp16: the Hadamard-rotated query when KVC_KROT, else the query)
static constexpr bool kGROUPED = KVC_GT > 0;
static constexpr bool kPER_TOKEN = KVC_KGROUP > 0;
// an fp16 layer of a per-layer format (kv=auto): the static family with KVC_KEY_BITS == KVC_VAL_BITS == 16, no sinks or window;
// k_payload and v_payload hold fp16 rows of KVC_D, k_outliers is empty, v_scale/v_min are [B, H, 1, 1] (one row per head,
// neither written nor read: no bytes per token beyond the fp16 K and V)
static constexpr bool kFP16 = KVC_KEY_BITS == 16;
static constexpr int32_t kNCACHE = kGROUPED ? 10 : 9;  // cache buffers (layout.py), in the plugins' input order
static constexpr int32_t kNKEYP = kGROUPED ? 2 : kPER_TOKEN ? 0 : 3;  // key-parameter inputs before them (after q, or after k_new and v_new)
static constexpr int32_t kNQ = kPER_TOKEN ? 2 : 1;  // KvcDecodeAttention's query inputs (q, and qr for the per-token family)
// elements of a stored row: KVC_D fp16 (an fp16 layer), else KVC_D * bits / 8 bytes (int8; int4 nibbles; 5..7 bits, per-token
// family only, as nibbles plus one KVC_D/8-byte bit plane per further bit; the grouped family's bitstream of mean KVC_KEY_BITS)
static constexpr int32_t kKEY_ROW = kFP16 ? KVC_D : KVC_D * KVC_KEY_BITS / 8;
static constexpr int32_t kVAL_ROW = kFP16 ? KVC_D : KVC_D * KVC_VAL_BITS / 8;
static constexpr int32_t kNG = KVC_D / KVC_GROUP;
static constexpr int32_t kNKS = kPER_TOKEN ? KVC_D / (KVC_KGROUP > 0 ? KVC_KGROUP : 1) : 0;  // per-token key scales per token
static constexpr int32_t kDECODE_IN = kNQ + kNKEYP + kNCACHE + 1;    // 14 (static, grouped) or 12 (per-token)
static constexpr int32_t kAPPEND_IN = 2 + kNKEYP + kNCACHE + 1;      // 15 (static, grouped) or 12 (per-token)

// dtype of the i-th key-parameter input: static k_scale, k_zero(_masked) fp32 and outlier_idx int32; grouped k_bits, k_offsets int32
inline nvinfer1::DataType keyParamType(int32_t i) noexcept {
  return kGROUPED || i == 2 ? nvinfer1::DataType::kINT32 : nvinfer1::DataType::kFLOAT;
}

// dtype of the i-th cache buffer
inline nvinfer1::DataType cacheType(int32_t i) noexcept {
  using nvinfer1::DataType;
  if (i < 4) return DataType::kHALF;  // sinks and window
  DataType const vpay = KVC_V_SYM && KVC_VAL_BITS == 8 ? DataType::kINT8 : DataType::kUINT8;
  DataType const vmin = KVC_V_CODE ? DataType::kUINT8 : DataType::kHALF;
  if (kGROUPED) {
    DataType const t[] = {DataType::kUINT8, DataType::kHALF, DataType::kHALF, vpay, DataType::kHALF, vmin};
    return t[i - 4];
  }
  if (kPER_TOKEN) {
    DataType const t[] = {KVC_KEY_BITS == 8 ? DataType::kINT8 : DataType::kUINT8, DataType::kHALF, vpay, DataType::kHALF, vmin};
    return t[i - 4];
  }
  DataType const t[] = {kFP16 ? DataType::kHALF : KVC_KEY_BITS == 8 ? DataType::kINT8 : DataType::kUINT8, DataType::kHALF,
                        kFP16 ? DataType::kHALF : DataType::kUINT8, DataType::kHALF, DataType::kHALF};
  return t[i - 4];
}

inline void logError(std::string const& msg) noexcept {
  if (nvinfer1::ILogger* l = getLogger()) l->log(nvinfer1::ILogger::Severity::kERROR, (std::string("kvcompress plugin: ") + msg).c_str());
}

// dims of one tensor against the expected extents (-1 = any); false (and a logged error) on mismatch
inline bool checkDims(nvinfer1::Dims const& d, std::initializer_list<int64_t> want, char const* plugin, char const* name) noexcept {
  if (d.nbDims != int32_t(want.size())) {
    logError(std::string(plugin) + ": input " + name + " has " + std::to_string(d.nbDims) + " dims, expected " + std::to_string(want.size()));
    return false;
  }
  int32_t i = 0;
  for (int64_t w : want) {
    if (w >= 0 && d.d[i] >= 0 && d.d[i] != w) {
      logError(std::string(plugin) + ": input " + name + " dim " + std::to_string(i) + " is " + std::to_string(d.d[i]) + ", the compiled variant " +
               KVC_VARIANT_NAME + " needs " + std::to_string(w));
      return false;
    }
    ++i;
  }
  return true;
}

// the packed cache buffers at inputs [first, first + kNCACHE), then lens [B]:
//   static:  sink_k sink_v win_k win_v k_payload k_outliers v_payload v_scale v_min
//   grouped: sink_k sink_v win_k win_v k_payload k_gscale k_gmin v_payload v_scale v_min (cap: whole key groups)
//   per-token: sink_k sink_v win_k win_v k_payload k_scale v_payload v_scale v_min
inline bool checkCache(nvinfer1::DynamicPluginTensorDesc const* in, int32_t first, int64_t B, int32_t H, int32_t cap, char const* plugin) noexcept {
  if (kGROUPED && cap % (KVC_GT > 0 ? KVC_GT : 1) != 0) {
    logError(std::string(plugin) + ": cap=" + std::to_string(cap) + " must be a whole number of key groups of " + std::to_string(KVC_GT) +
             " tokens (variant " + KVC_VARIANT_NAME + ")");
    return false;
  }
  int64_t const capg = kGROUPED ? cap / (KVC_GT > 0 ? KVC_GT : 1) : 0;
  char const* sNames[] = {"sink_k", "sink_v", "win_k", "win_v", "k_payload", kPER_TOKEN ? "k_scale" : "k_outliers", "v_payload", "v_scale", "v_min"};
  int64_t const vRows = kFP16 ? 1 : cap;  // an fp16 layer's value scales: one unused row per head
  int64_t const sRows[] = {KVC_NS, KVC_NS, KVC_W, KVC_W, cap, cap, cap, vRows, vRows};
  int64_t const sCols[] = {KVC_D, KVC_D, KVC_D, KVC_D, kKEY_ROW, kPER_TOKEN ? kNKS : KVC_N_OUT, kVAL_ROW, kNG, kNG};
  char const* gNames[] = {"sink_k", "sink_v", "win_k", "win_v", "k_payload", "k_gscale", "k_gmin", "v_payload", "v_scale", "v_min"};
  int64_t const gRows[] = {KVC_NS, KVC_NS, KVC_W, KVC_W, cap, capg, capg, cap, cap, cap};
  int64_t const gCols[] = {KVC_D, KVC_D, KVC_D, KVC_D, kKEY_ROW, KVC_D, KVC_D, kVAL_ROW, kNG, kNG};
  for (int32_t i = 0; i < kNCACHE; ++i) {
    char const* name = kGROUPED ? gNames[i] : sNames[i];
    if (!checkDims(in[first + i].desc.dims, {B, H, kGROUPED ? gRows[i] : sRows[i], kGROUPED ? gCols[i] : sCols[i]}, plugin, name)) return false;
    if (in[first + i].desc.type != cacheType(i)) {
      logError(std::string(plugin) + ": input " + name + " has the wrong dtype for the compiled variant " + KVC_VARIANT_NAME);
      return false;
    }
  }
  return checkDims(in[first + kNCACHE].desc.dims, {B}, plugin, "lens");
}

inline bool aligned16(void const* p) noexcept { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

}  // namespace kvc
