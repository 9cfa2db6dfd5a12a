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
static constexpr int32_t kKEY_ROW = KVC_KEY_BITS == 4 ? KVC_D / 2 : KVC_D;  // bytes of a packed key row
static constexpr int32_t kVAL_ROW = KVC_VAL_BITS == 4 ? KVC_D / 2 : KVC_D;
static constexpr int32_t kNG = KVC_D / KVC_GROUP;

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

// the packed cache buffers at inputs [first, first + 10): sink_k sink_v win_k win_v k_payload k_outliers v_payload v_scale v_min lens
inline bool checkCache(nvinfer1::DynamicPluginTensorDesc const* in, int32_t first, int64_t B, int32_t H, int32_t cap, char const* plugin) noexcept {
  char const* names[] = {"sink_k", "sink_v", "win_k", "win_v", "k_payload", "k_outliers", "v_payload", "v_scale", "v_min", "lens"};
  int64_t const rows[] = {KVC_NS, KVC_NS, KVC_W, KVC_W, cap, cap, cap, cap, cap};
  int64_t const cols[] = {KVC_D, KVC_D, KVC_D, KVC_D, kKEY_ROW, KVC_N_OUT, kVAL_ROW, kNG, kNG};
  for (int32_t i = 0; i < 9; ++i)
    if (!checkDims(in[first + i].desc.dims, {B, H, rows[i], cols[i]}, plugin, names[i])) return false;
  return checkDims(in[first + 9].desc.dims, {B}, plugin, names[9]);
}

inline bool aligned16(void const* p) noexcept { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

}  // namespace kvc
