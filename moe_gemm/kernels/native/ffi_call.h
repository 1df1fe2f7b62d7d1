// A compiled kernel called through TVM-FFI's C ABI: included by general_call.cc (after Ref).
//
// The DSL compiles each kernel with a host function exported as a TVM-FFI function; its
// Python call (tvm_ffi.Function.__call__) converts every torch tensor through DLPack's
// exchange API and sets the environment stream from torch's current stream. Called here
// with DLTensors made in place from the at::Tensors, the same launch costs ~1 us less host
// time per call with nine tensor arguments (session 12, H200 host: 5.1 us through ctypes'
// TVMFFIFunctionCall against 5.4 us for the Python call of the same kernel, ctypes' own
// ~0.5 us included in the first). The symbols come from the tvm_ffi library Python has
// already loaded (kernels/native.py passes its path to init_ffi); without them every launch
// stays a Python call.

namespace ffi {

// The TVM-FFI C ABI (tvm/ffi/c_api.h), the entries used here.
struct FfiAny {
  int32_t type_index;
  uint32_t pad;
  int64_t v;
};
constexpr int32_t kFfiInt = 1;
constexpr int32_t kFfiDLTensorPtr = 7;
constexpr int32_t kFfiStaticObjectBegin = 64;  // type indices from here on are objects
struct DLDev {
  int32_t type;
  int32_t id;
};
struct DLType {
  uint8_t code;
  uint8_t bits;
  uint16_t lanes;
};
struct DLTensorC {  // DLPack's DLTensor
  void* data;
  DLDev device;
  int32_t ndim;
  DLType dtype;
  int64_t* shape;
  int64_t* strides;
  uint64_t byte_offset;
};
constexpr int32_t kDLCPU = 1;
constexpr int32_t kDLCUDA = 2;

struct Ffi {
  int (*call)(void*, FfiAny*, int32_t, FfiAny*) = nullptr;
  int (*set_stream)(int32_t, int32_t, void*, void**) = nullptr;
  void (*move_from_raised)(void**) = nullptr;
  int (*dec_ref)(void*) = nullptr;
};
Ffi g_ffi;

bool FfiReady() { return g_ffi.call != nullptr; }

bool DlType(c10::ScalarType t, DLType* d) {
  switch (t) {
    case c10::ScalarType::BFloat16: *d = {4, 16, 1}; return true;
    case c10::ScalarType::Half: *d = {2, 16, 1}; return true;
    case c10::ScalarType::Float: *d = {2, 32, 1}; return true;
    case c10::ScalarType::Int: *d = {0, 32, 1}; return true;
    case c10::ScalarType::Long: *d = {0, 64, 1}; return true;
    default: return false;
  }
}

// A DLTensor viewing `t` (its sizes and strides arrays: valid while `t` lives).
// `written`: the kernel writes through it (its mutable pointer: a copy-on-write tensor is
// materialized first, as torch's own DLPack export does).
bool ToDl(const at::Tensor& t, DLTensorC* d, bool written = false) {
  if (!DlType(t.scalar_type(), &d->dtype)) return false;
  d->data = written ? t.mutable_data_ptr() : const_cast<void*>(t.const_data_ptr());
  const c10::Device dev = t.device();
  d->device = {dev.is_cuda() ? kDLCUDA : kDLCPU, dev.has_index() ? dev.index() : 0};
  d->ndim = static_cast<int32_t>(t.dim());
  d->shape = const_cast<int64_t*>(t.sizes().data());
  d->strides = const_cast<int64_t*>(t.strides().data());
  d->byte_offset = 0;
  return true;
}

// The TVM-FFI handle of a compiled kernel (its tvm_ffi.Function), cached by the kernel
// object (held, so that its address is never reused while cached); null where it has none.
void* HandleOf(PyObject* kernel) {
  static auto& cache = *new std::unordered_map<PyObject*, std::pair<Ref, void*>>();
  auto it = cache.find(kernel);
  if (it != cache.end()) return it->second.second;
  void* handle = nullptr;
  PyObject* inner = PyObject_GetAttrString(kernel, "_tvm_ffi_function");
  if (inner != nullptr) {
    PyObject* h = PyObject_CallMethod(inner, "__chandle__", nullptr);
    if (h != nullptr) {
      handle = PyLong_AsVoidPtr(h);
      Py_DECREF(h);
    }
    Py_DECREF(inner);
  }
  PyErr_Clear();  // no handle: the Python call
  if (cache.size() >= 4096) cache.clear();
  cache.emplace(kernel, std::make_pair(Ref(kernel), handle));
  return handle;
}

// Calls `handle` with the DLTensors / ints in `argv` on `stream` of device `dev`.
// True: launched. False: the call failed (its error dropped: the caller repeats the call
// from Python, which raises it with the whole message).
bool Call(void* handle, FfiAny* argv, int32_t n, int dev, int64_t stream) {
  // The compiled function launches on the environment stream of the tensors' device: set
  // for the call and put back after it, as the Python call does, so that no later call
  // finds this one's stream there.
  void* before = nullptr;
  g_ffi.set_stream(kDLCUDA, dev, reinterpret_cast<void*>(stream), &before);
  FfiAny result{};
  const int rc = g_ffi.call(handle, argv, n, &result);
  g_ffi.set_stream(kDLCUDA, dev, before, nullptr);
  if (rc != 0) {
    void* err = nullptr;
    g_ffi.move_from_raised(&err);
    if (err != nullptr) g_ffi.dec_ref(err);
    return false;
  }
  if (result.type_index >= kFfiStaticObjectBegin && result.v != 0) {
    g_ffi.dec_ref(reinterpret_cast<void*>(result.v));
  }
  return true;
}

// A launch record's call (kernel, args + one trailing int) through the C ABI on `stream`:
// true launched; false not (an argument it does not convert, or a failed call: the caller
// makes the Python call). Tensor arguments must be plain CUDA tensors.
bool CallRecord(PyObject* kernel, PyObject* args, int64_t last, int64_t stream) {
  if (!FfiReady()) return false;
  void* handle = HandleOf(kernel);
  const Py_ssize_t n = PyTuple_GET_SIZE(args);
  constexpr Py_ssize_t kMax = 24;
  if (handle == nullptr || n + 1 > kMax) return false;
  DLTensorC dl[kMax];
  FfiAny argv[kMax];
  int dev = -1;
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* a = PyTuple_GET_ITEM(args, i);
    argv[i].pad = 0;
    if (THPVariable_Check(a)) {
      const at::Tensor& t = THPVariable_Unpack(a);
      // (Written through: the kernel's outputs and workspace come in as tensors too.)
      if (!t.defined() || !t.is_cuda() || !ToDl(t, &dl[i], true)) return false;
      dev = dl[i].device.id;
      argv[i].type_index = kFfiDLTensorPtr;
      argv[i].v = reinterpret_cast<int64_t>(&dl[i]);
    } else if (PyLong_CheckExact(a)) {
      argv[i].type_index = kFfiInt;
      argv[i].v = PyLong_AsLongLong(a);
      if (argv[i].v == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        return false;
      }
    } else {
      return false;
    }
  }
  if (dev < 0) return false;
  argv[n] = {kFfiInt, 0, last};
  return Call(handle, argv, static_cast<int32_t>(n + 1), dev, stream);
}

// init_ffi(path) -> resolved (bool): the TVM-FFI C entry points from its loaded library.
// Without them every launch is a Python call; "" drops them (tests compare the two).
PyObject* InitFfi(PyObject*, PyObject* const* args, Py_ssize_t n) {
  const char* path;
  if (n != 1 || (path = PyUnicode_AsUTF8(args[0])) == nullptr) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "init_ffi(path)");
    return nullptr;
  }
  if (path[0] == '\0') {  // init_ffi(""): back to Python calls (tests)
    g_ffi = Ffi{};
    Py_RETURN_FALSE;
  }
  void* lib = dlopen(path, RTLD_NOW | RTLD_NOLOAD);
  if (lib == nullptr) Py_RETURN_FALSE;
  Ffi f;
  f.call = reinterpret_cast<decltype(f.call)>(dlsym(lib, "TVMFFIFunctionCall"));
  f.set_stream = reinterpret_cast<decltype(f.set_stream)>(dlsym(lib, "TVMFFIEnvSetStream"));
  f.move_from_raised =
      reinterpret_cast<decltype(f.move_from_raised)>(dlsym(lib, "TVMFFIErrorMoveFromRaised"));
  f.dec_ref = reinterpret_cast<decltype(f.dec_ref)>(dlsym(lib, "TVMFFIObjectDecRef"));
  if (!f.call || !f.set_stream || !f.move_from_raised || !f.dec_ref) Py_RETURN_FALSE;
  g_ffi = f;
  Py_RETURN_TRUE;
}

}  // namespace ffi
