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

// the 10 cache buffers (layout.py) for B sequences, H kv heads, cap compressed slots
static std::vector<DynamicPluginTensorDesc> cache(int64_t B, int64_t H, int64_t cap) {
  int64_t kr = KVC_KEY_BITS == 4 ? KVC_D / 2 : KVC_D, vr = KVC_VAL_BITS == 4 ? KVC_D / 2 : KVC_D, ng = KVC_D / KVC_GROUP;
  return {desc({B, H, KVC_NS, KVC_D}, DataType::kHALF), desc({B, H, KVC_NS, KVC_D}, DataType::kHALF),
          desc({B, H, KVC_W, KVC_D}, DataType::kHALF), desc({B, H, KVC_W, KVC_D}, DataType::kHALF),
          desc({B, H, cap, kr}, KVC_KEY_BITS == 8 ? DataType::kINT8 : DataType::kUINT8), desc({B, H, cap, KVC_N_OUT}, DataType::kHALF),
          desc({B, H, cap, vr}, DataType::kUINT8), desc({B, H, cap, ng}, DataType::kHALF), desc({B, H, cap, ng}, DataType::kHALF),
          desc({B}, DataType::kINT32)};
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

  int32_t H = 2, G = KVC_G, D = KVC_D, splits = 3, cap = 100, B = 4;
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
  std::vector<DynamicPluginTensorDesc> in = {desc({B, H * G, D}, DataType::kHALF), desc({H, D}, DataType::kFLOAT), desc({H, D}, DataType::kFLOAT),
                                             desc({H, KVC_N_OUT}, DataType::kINT32)};
  for (auto& c : cache(B, H, cap)) in.push_back(c);
  DynamicPluginTensorDesc out = desc({B, H * G, D}, DataType::kFLOAT);
  gLog.clear();
  check(build->configurePlugin(in.data(), 14, &out, 1) == 0 && gLog.empty(), "KvcDecodeAttention accepts the variant's shapes");
  auto bad = in;
  bad[0] = desc({B, H * G, D + 2}, DataType::kHALF);
  gLog.clear();
  bool rejected = build->configurePlugin(bad.data(), 14, &out, 1) != 0;
  check(rejected && !gLog.empty() && gLog[0].find("input q ") != std::string::npos,
        "KvcDecodeAttention rejects a wrong head dim, through the logger: " + (gLog.empty() ? std::string("(nothing logged)") : gLog[0]));
  bad = in;
  bad[8] = desc({B, H, cap + 1, KVC_KEY_BITS == 4 ? KVC_D / 2 : KVC_D}, KVC_KEY_BITS == 8 ? DataType::kINT8 : DataType::kUINT8);
  gLog.clear();
  check(build->configurePlugin(bad.data(), 14, &out, 1) != 0 && !gLog.empty(), "KvcDecodeAttention rejects a store that is not `cap` long");
  gLog.clear();
  check(build->configurePlugin(in.data(), 13, &out, 1) != 0 && !gLog.empty(), "KvcDecodeAttention rejects a missing input");
  size_t ws = build->getWorkspaceSize(in.data(), 14, &out, 1);
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
  for (int32_t i = 0; i < 9; ++i) alias = alias && abuild->getAliasedInput(i) == 5 + i;
  check(alias && abuild->getAliasedInput(9) == -1 && abuild->getNbOutputs() == 9, "KvcAppend aliases its 9 cache outputs to inputs 5..13");
  std::vector<DynamicPluginTensorDesc> ain = {desc({B, H, D}, DataType::kHALF), desc({B, H, D}, DataType::kHALF), desc({H, D}, DataType::kFLOAT),
                                              desc({H, D}, DataType::kFLOAT), desc({H, KVC_N_OUT}, DataType::kINT32)};
  for (auto& c : cache(B, H, cap)) ain.push_back(c);
  std::vector<DynamicPluginTensorDesc> aout(ain.begin() + 5, ain.begin() + 14);
  gLog.clear();
  check(abuild->configurePlugin(ain.data(), 15, aout.data(), 9) == 0 && gLog.empty(), "KvcAppend accepts the variant's shapes");
  auto abad = ain;
  abad[7] = desc({B, H, KVC_W + 1, D}, DataType::kHALF);
  gLog.clear();
  rejected = abuild->configurePlugin(abad.data(), 15, aout.data(), 9) != 0;
  check(rejected && !gLog.empty() && gLog[0].find("win_k") != std::string::npos,
        "KvcAppend rejects a window that is not the compiled one: " + (gLog.empty() ? std::string("(nothing logged)") : gLog[0]));
  for (IPluginV3* p : {dp, dq, ap, aq}) delete p;
  return gFailed ? 1 : 0;
}
