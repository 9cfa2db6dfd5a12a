// CPU harness for the kvcompress TensorRT plugins: links the plugin sources with stand-ins for the three
// things they take from outside (TensorRT's plugin registry and logger, the CUDA driver), then drives the
// plugins' build-time and serialization logic exactly as TensorRT would call it. Nothing here launches a
// kernel (enqueue needs a GPU). Prints one "OK"/"FAIL" line per check; exit status 1 if any fails.
// Built by tests/test_plugins.py when TENSORRT_INCLUDE_DIR is set.
#include <NvInferRuntime.h>
#include <cuda.h>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include KVC_VARIANT_HEADER

using namespace nvinfer1;

// ---------------------------------------------------------------- stand-ins
namespace {
// function-local: the plugins' static registrars run before this file's globals may be constructed
std::vector<IPluginCreatorInterface*>& creators() {
  static std::vector<IPluginCreatorInterface*> v;
  return v;
}
std::vector<std::string> gLog;

// the registry interface still declares TensorRT's deprecated IPluginV2-era methods: a stand-in must override them
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
class Registry : public IPluginRegistry {
 public:
  bool registerCreator(IPluginCreator&, AsciiChar const* const) noexcept override { return false; }
  IPluginCreator* const* getPluginCreatorList(int32_t* const n) const noexcept override { *n = 0; return nullptr; }
  IPluginCreator* getPluginCreator(AsciiChar const* const, AsciiChar const* const, AsciiChar const* const) noexcept override { return nullptr; }
  void setErrorRecorder(IErrorRecorder* const) noexcept override {}
  IErrorRecorder* getErrorRecorder() const noexcept override { return nullptr; }
  bool deregisterCreator(IPluginCreator const&) noexcept override { return false; }
  bool isParentSearchEnabled() const override { return false; }
  void setParentSearchEnabled(bool const) override {}
  PluginLibraryHandle loadLibrary(AsciiChar const*) noexcept override { return nullptr; }
  void deregisterLibrary(PluginLibraryHandle) noexcept override {}
  bool registerCreator(IPluginCreatorInterface& c, AsciiChar const* const) noexcept override { creators().push_back(&c); return true; }
  IPluginCreatorInterface* const* getAllCreators(int32_t* const n) const noexcept override { *n = int32_t(creators().size()); return creators().data(); }
  IPluginCreatorInterface* getCreator(AsciiChar const* const, AsciiChar const* const, AsciiChar const* const) noexcept override { return nullptr; }
  bool deregisterCreator(IPluginCreatorInterface const&) noexcept override { return false; }
  IPluginResource* acquirePluginResource(AsciiChar const*, IPluginResource*) noexcept override { return nullptr; }
  int32_t releasePluginResource(AsciiChar const*) noexcept override { return 0; }
  IPluginCreatorInterface* const* getAllCreatorsRecursive(int32_t* const n) noexcept override { return getAllCreators(n); }
};
#pragma GCC diagnostic pop

class Logger : public ILogger {
 public:
  void log(Severity s, AsciiChar const* msg) noexcept override {
    if (s <= Severity::kERROR) gLog.push_back(msg);
  }
};
}  // namespace

extern "C" IPluginRegistry* getPluginRegistry() noexcept {
  static Registry r;
  return &r;
}
extern "C" ILogger* getLogger() noexcept {
  static Logger l;
  return &l;
}
extern "C" {
CUresult CUDAAPI cuModuleLoadData(CUmodule*, const void*) { return CUDA_ERROR_NOT_SUPPORTED; }
CUresult CUDAAPI cuModuleGetFunction(CUfunction*, CUmodule, const char*) { return CUDA_ERROR_NOT_SUPPORTED; }
CUresult CUDAAPI cuFuncSetAttribute(CUfunction, CUfunction_attribute, int) { return CUDA_ERROR_NOT_SUPPORTED; }
CUresult CUDAAPI cuLaunchKernel(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, CUstream, void**, void**) {
  return CUDA_ERROR_NOT_SUPPORTED;
}
}

// ---------------------------------------------------------------- checks
static int gFailed = 0;
static void check(bool ok, std::string const& what) {
  std::printf("%s %s\n", ok ? "OK" : "FAIL", what.c_str());
  gFailed += !ok;
}

static IPluginCreatorV3One* creator(char const* name) {
  for (auto* c : creators()) {
    auto* v3 = static_cast<IPluginCreatorV3One*>(c);
    if (std::string(v3->getPluginName()) == name) return v3;
  }
  return nullptr;
}

static DynamicPluginTensorDesc desc(std::vector<int64_t> dims, DataType t) {
  DynamicPluginTensorDesc d{};
  d.desc.dims.nbDims = int32_t(dims.size());
  for (size_t i = 0; i < dims.size(); ++i) d.desc.dims.d[i] = dims[i];
  d.desc.type = t;
  d.desc.format = TensorFormat::kLINEAR;
  d.min = d.max = d.opt = d.desc.dims;
  return d;
}

#ifndef KVC_GT
#define KVC_GT 0
#define KVC_V_SYM 0
#define KVC_V_CODE 0
#endif
#ifndef KVC_KGROUP
#define KVC_KGROUP 0
#endif
static constexpr int32_t kCACHE = KVC_GT > 0 ? 10 : 9;  // cache buffers (lens follows them)
static constexpr int32_t kKEYP = KVC_GT > 0 ? 2 : KVC_KGROUP > 0 ? 0 : 3;  // key-parameter inputs before them
static constexpr int32_t kQ = KVC_KGROUP > 0 ? 2 : 1;  // decode query inputs: q (and qr, per-token family)
static constexpr int32_t kDIN = kQ + kKEYP + kCACHE + 1, kAIN = 2 + kKEYP + kCACHE + 1;

// the cache buffers + lens (layout.py) for B sequences, H kv heads, cap compressed slots
static std::vector<DynamicPluginTensorDesc> cache(int64_t B, int64_t H, int64_t cap) {
  int64_t vr = KVC_VAL_BITS == 16 ? KVC_D : KVC_D * KVC_VAL_BITS / 8, ng = KVC_D / KVC_GROUP;
  std::vector<DynamicPluginTensorDesc> out = {desc({B, H, KVC_NS, KVC_D}, DataType::kHALF), desc({B, H, KVC_NS, KVC_D}, DataType::kHALF),
                                              desc({B, H, KVC_W, KVC_D}, DataType::kHALF), desc({B, H, KVC_W, KVC_D}, DataType::kHALF)};
#if KVC_GT > 0
  int64_t capg = cap / KVC_GT;
  for (auto d : {desc({B, H, cap, KVC_D * KVC_KEY_BITS / 8}, DataType::kUINT8), desc({B, H, capg, KVC_D}, DataType::kHALF), desc({B, H, capg, KVC_D}, DataType::kHALF),
                 desc({B, H, cap, vr}, KVC_V_SYM && KVC_VAL_BITS == 8 ? DataType::kINT8 : DataType::kUINT8), desc({B, H, cap, ng}, DataType::kHALF),
                 desc({B, H, cap, ng}, KVC_V_CODE ? DataType::kUINT8 : DataType::kHALF)})
    out.push_back(d);
#elif KVC_KGROUP > 0
  int64_t kr = KVC_KEY_BITS == 16 ? KVC_D : KVC_D * KVC_KEY_BITS / 8;
  for (auto d : {desc({B, H, cap, kr}, KVC_KEY_BITS == 8 ? DataType::kINT8 : DataType::kUINT8), desc({B, H, cap, KVC_D / KVC_KGROUP}, DataType::kHALF),
                 desc({B, H, cap, vr}, KVC_V_SYM && KVC_VAL_BITS == 8 ? DataType::kINT8 : DataType::kUINT8), desc({B, H, cap, ng}, DataType::kHALF),
                 desc({B, H, cap, ng}, KVC_V_CODE ? DataType::kUINT8 : DataType::kHALF)})
    out.push_back(d);
#else
  int64_t kr = KVC_KEY_BITS == 16 ? KVC_D : KVC_D * KVC_KEY_BITS / 8;
  DataType const kt = KVC_KEY_BITS == 16 ? DataType::kHALF : KVC_KEY_BITS == 8 ? DataType::kINT8 : DataType::kUINT8;  // 16: an fp16 layer
  for (auto d : {desc({B, H, cap, kr}, kt), desc({B, H, cap, KVC_N_OUT}, DataType::kHALF),
                 desc({B, H, cap, vr}, KVC_VAL_BITS == 16 ? DataType::kHALF : DataType::kUINT8), desc({B, H, KVC_VAL_BITS == 16 ? 1 : cap, ng}, DataType::kHALF),
                 desc({B, H, KVC_VAL_BITS == 16 ? 1 : cap, ng}, DataType::kHALF)})
    out.push_back(d);
#endif
  out.push_back(desc({B}, DataType::kINT32));
  return out;
}

// the key-parameter inputs: static k_scale, k_zero(_masked) [H, D] fp32, outlier_idx [H, N_OUT] int32; grouped k_bits, k_offsets [H, D] int32
static std::vector<DynamicPluginTensorDesc> keyParams(int64_t H) {
#if KVC_GT > 0
  return {desc({H, KVC_D}, DataType::kINT32), desc({H, KVC_D}, DataType::kINT32)};
#elif KVC_KGROUP > 0
  (void)H;
  return {};  // per-token keys: no static key parameters
#else
  return {desc({H, KVC_D}, DataType::kFLOAT), desc({H, KVC_D}, DataType::kFLOAT), desc({H, KVC_N_OUT}, DataType::kINT32)};
#endif
}

template <typename T>
static T* as(IPluginV3* p, PluginCapabilityType t) { return static_cast<T*>(p->getCapabilityInterface(t)); }

static IPluginV3* roundTrip(IPluginCreatorV3One* c, IPluginV3* p, std::vector<std::pair<std::string, double>>& a, std::vector<std::pair<std::string, double>>& b) {
  PluginFieldCollection const* f = as<IPluginV3OneRuntime>(p, PluginCapabilityType::kRUNTIME)->getFieldsToSerialize();
  for (int32_t i = 0; i < f->nbFields; ++i)
    a.push_back({f->fields[i].name, f->fields[i].type == PluginFieldType::kFLOAT32 ? *static_cast<float const*>(f->fields[i].data)
                                                                                   : *static_cast<int32_t const*>(f->fields[i].data)});
  IPluginV3* q = c->createPlugin("x", f, TensorRTPhase::kRUNTIME);  // what deserialization does
  PluginFieldCollection const* g = as<IPluginV3OneRuntime>(q, PluginCapabilityType::kRUNTIME)->getFieldsToSerialize();
  for (int32_t i = 0; i < g->nbFields; ++i)
    b.push_back({g->fields[i].name, g->fields[i].type == PluginFieldType::kFLOAT32 ? *static_cast<float const*>(g->fields[i].data)
                                                                                   : *static_cast<int32_t const*>(g->fields[i].data)});
  return q;
}

int main() {
  IPluginCreatorV3One* dc = creator("KvcDecodeAttention");
  IPluginCreatorV3One* ac = creator("KvcAppend");
  check(dc && ac, "both creators registered at load (static registrars)");
  if (!dc || !ac) return 1;
  check(std::string(dc->getPluginNamespace()) == "kvcompress" && std::string(ac->getPluginNamespace()) == "kvcompress", "namespace kvcompress");
  check(dc->getFieldNames()->nbFields == 6 && ac->getFieldNames()->nbFields == 3, "creators list their fields");

  int32_t H = 2, G = KVC_G, D = KVC_D, splits = 3, cap = KVC_GT > 0 ? 2 * KVC_GT : 100, B = 4;
  float sm = 0.125f;
  std::vector<PluginField> df = {PluginField("H", &H, PluginFieldType::kINT32, 1), PluginField("G", &G, PluginFieldType::kINT32, 1),
                                 PluginField("D", &D, PluginFieldType::kINT32, 1), PluginField("splits", &splits, PluginFieldType::kINT32, 1),
                                 PluginField("cap", &cap, PluginFieldType::kINT32, 1), PluginField("sm_scale", &sm, PluginFieldType::kFLOAT32, 1)};
  PluginFieldCollection dfc{int32_t(df.size()), df.data()};
  IPluginV3* dp = dc->createPlugin("decode", &dfc, TensorRTPhase::kBUILD);
  std::vector<std::pair<std::string, double>> a, b;
  IPluginV3* dq = roundTrip(dc, dp, a, b);
  check(a == b && a.size() == 6 && a[5].second == 0.125, "KvcDecodeAttention fields round-trip through serialization");

  auto* build = as<IPluginV3OneBuild>(dq, PluginCapabilityType::kBUILD);
  std::vector<DynamicPluginTensorDesc> in = {desc({B, H * G, D}, DataType::kHALF)};
  if (kQ == 2) in.push_back(desc({B, H * G, D}, DataType::kHALF));  // qr: the query in the keys' basis
  for (auto& c : keyParams(H)) in.push_back(c);
  for (auto& c : cache(B, H, cap)) in.push_back(c);
  check(in.size() == size_t(kDIN), "KvcDecodeAttention has " + std::to_string(kDIN) + " inputs for this variant");
  DynamicPluginTensorDesc out = desc({B, H * G, D}, DataType::kFLOAT);
  gLog.clear();
  check(build->configurePlugin(in.data(), kDIN, &out, 1) == 0 && gLog.empty(), "KvcDecodeAttention accepts the variant's shapes");
  auto bad = in;
  bad[0] = desc({B, H * G, D + 2}, DataType::kHALF);
  gLog.clear();
  bool rejected = build->configurePlugin(bad.data(), kDIN, &out, 1) != 0;
  check(rejected && !gLog.empty() && gLog[0].find("input q ") != std::string::npos,
        "KvcDecodeAttention rejects a wrong head dim, through the logger: " + (gLog.empty() ? std::string("(nothing logged)") : gLog[0]));
  bad = in;
  bad[kQ + kKEYP + 4] = cache(B, H, cap + 1)[4];  // k_payload
  gLog.clear();
  check(build->configurePlugin(bad.data(), kDIN, &out, 1) != 0 && !gLog.empty(), "KvcDecodeAttention rejects a store that is not `cap` long");
  gLog.clear();
  check(build->configurePlugin(in.data(), kDIN - 1, &out, 1) != 0 && !gLog.empty(), "KvcDecodeAttention rejects a missing input");
  size_t ws = build->getWorkspaceSize(in.data(), kDIN, &out, 1);
  check(ws >= size_t(B) * H * G * splits * (2 + D) * sizeof(float), "workspace holds the split partials");

  std::vector<PluginField> af = {PluginField("H", &H, PluginFieldType::kINT32, 1), PluginField("D", &D, PluginFieldType::kINT32, 1),
                                 PluginField("cap", &cap, PluginFieldType::kINT32, 1)};
  PluginFieldCollection afc{int32_t(af.size()), af.data()};
  IPluginV3* ap = ac->createPlugin("append", &afc, TensorRTPhase::kBUILD);
  a.clear();
  b.clear();
  IPluginV3* aq = roundTrip(ac, ap, a, b);
  check(a == b && a.size() == 3, "KvcAppend fields round-trip through serialization");
  auto* abuild = as<IPluginV3OneBuildV2>(aq, PluginCapabilityType::kBUILD);
  bool alias = true;
  int32_t first = 2 + kKEYP;
  for (int32_t i = 0; i < kCACHE; ++i) alias = alias && abuild->getAliasedInput(i) == first + i;
  check(alias && abuild->getAliasedInput(kCACHE) == -1 && abuild->getNbOutputs() == kCACHE,
        "KvcAppend aliases its " + std::to_string(kCACHE) + " cache outputs to inputs " + std::to_string(first) + ".." + std::to_string(first + kCACHE - 1));
  std::vector<DynamicPluginTensorDesc> ain = {desc({B, H, D}, DataType::kHALF), desc({B, H, D}, DataType::kHALF)};
  for (auto& c : keyParams(H)) ain.push_back(c);
  for (auto& c : cache(B, H, cap)) ain.push_back(c);
  check(ain.size() == size_t(kAIN), "KvcAppend has " + std::to_string(kAIN) + " inputs for this variant");
  std::vector<DynamicPluginTensorDesc> aout(ain.begin() + first, ain.begin() + first + kCACHE);
  gLog.clear();
  check(abuild->configurePlugin(ain.data(), kAIN, aout.data(), kCACHE) == 0 && gLog.empty(), "KvcAppend accepts the variant's shapes");
  auto abad = ain;
  abad[first + 2] = desc({B, H, KVC_W + 1, D}, DataType::kHALF);  // win_k
  gLog.clear();
  rejected = abuild->configurePlugin(abad.data(), kAIN, aout.data(), kCACHE) != 0;
  check(rejected && !gLog.empty() && gLog[0].find("win_k") != std::string::npos,
        "KvcAppend rejects a window that is not the compiled one: " + (gLog.empty() ? std::string("(nothing logged)") : gLog[0]));
#if KVC_GT > 0
  auto gbad = cache(B, H, cap + 1);  // a store that is not whole key groups (its group buffers truncated)
  std::vector<DynamicPluginTensorDesc> gin(ain.begin(), ain.begin() + first);
  for (auto& c : gbad) gin.push_back(c);
  std::vector<PluginField> gf = af;
  int32_t badCap = cap + 1;
  gf[2] = PluginField("cap", &badCap, PluginFieldType::kINT32, 1);
  PluginFieldCollection gfc{int32_t(gf.size()), gf.data()};
  IPluginV3* gp = ac->createPlugin("append", &gfc, TensorRTPhase::kBUILD);
  gLog.clear();
  rejected = as<IPluginV3OneBuildV2>(gp, PluginCapabilityType::kBUILD)->configurePlugin(gin.data(), kAIN, aout.data(), kCACHE) != 0;
  check(rejected && !gLog.empty() && gLog[0].find("whole number of key groups") != std::string::npos,
        "KvcAppend (grouped) rejects a store that is not whole key groups: " + (gLog.empty() ? std::string("(nothing logged)") : gLog[0]));
  delete gp;
#endif
  for (IPluginV3* p : {dp, dq, ap, aq}) delete p;
  return gFailed ? 1 : 0;
}
