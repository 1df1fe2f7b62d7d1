// grouped_gemm's per-call host work in C++ (moe_gemm/kernels/native.py builds and loads it);
// grouped_mm's repeated calls are in mm_call.h, the kernels' TVM-FFI C call in ffi_call.h.
//
// A grouped_gemm call on lists reads every operand's dtype, device, shape, strides and address,
// allocates the outputs and launches. In Python that is ~1.2 us per problem to read the
// operands plus ~0.9 us per output view (torch's split: dispatcher, autograd view bookkeeping,
// Python wrapper) on an H200 host: 33.6 us for 8 problems against torch's own grouped_mm
// at 17.5 (issue 4, host overhead). Here the operands are read straight from their
// at::Tensor (a few ns each), the outputs are plain tensors sharing one fresh allocation, and
// a repeated call launches from a record without entering Python's host wrapper at all.
//
// Two caches, both keyed by what a launch depends on:
//   problem set: sizes, dtypes, B major, device, config (by identity), the L2-hints switch
//     -> the Python GeneralShape (kernel choice, order, grid) and the output layout;
//   operands:    addresses and leading dims, current stream, thread
//     -> a launch record (kernel, its arguments but d_base, LaunchInfo), whose uploaded
//        metadata stays valid while the same addresses come back (the serving loop).
// New operand addresses for a known problem set (fresh activations each step) launch from a
// template, the problem set's last record on the same stream and thread: the metadata rows
// are filled here and copied (upload_ring.h: a pinned ring per stream and the driver's
// asynchronous copy; torch's copy where that declines) into the template's scratch rows, or,
// for addresses seen a second time, into a record of their own. Only the
// first launch of a problem set on a stream and thread goes through Python
// (host_sm90.general_record: ~35 us for 8 problems on an H200 host).
// Everything outside the common case (kernels/support.fast_general's: plain 2-D tensors of
// one dtype on one CUDA device, TMA-ready, one B major) is declined: the Python path then
// decides, and words any error. The GIL is held throughout; nothing here blocks on the GPU.

#include <Python.h>
#include <pythread.h>

#include <ATen/core/Tensor.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/view.h>
#include <c10/core/DispatchKeySet.h>
#include <c10/core/TensorImpl.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <torch/csrc/autograd/python_variable.h>

#include "upload_ring.h"

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

namespace {

constexpr int64_t kTmaAlignBytes = 16;
constexpr int64_t kMaxProblems = 65535;  // kernels/support.py MAX_PROBLEMS
// Cache bounds: problem sets as general_shape's lru_cache; launch records (each holds G * 64
// bytes of device metadata) as host_sm90.META_CACHE_ENTRIES.
constexpr size_t kMaxShapes = 256;
constexpr size_t kMaxLaunches = 1024;
constexpr int64_t kMaxLaunchMetaBytes = int64_t{64} << 20;
constexpr int64_t kMaxDim = (int64_t{1} << 31) - 1;  // metadata packs M | N << 32; K is Int32

// `req` flags of call / remember_launch.
constexpr int64_t kRequireCuda = 1;  // else CPU tensors (tests)
constexpr int64_t kPdl = 2;          // host_sm90.PDL at the call: launch records differ

// Column rows of a scan: (kRows, G) int64, row-major.
enum Row : int64_t { kAPtr = 0, kBPtr, kALd, kBLd, kM, kN, kK, kRows };

// The general kernel's arguments (host_sm90._general_args): the metadata rows at kMetaArg,
// their int32 view right after it. A metadata row (host_sm90.GeneralShape.metadata):
// [a_ptr, b_ptr, D offset, a_ld, b_ld, D ld, M | N << 32, K], in launch order.
constexpr Py_ssize_t kMetaArg = 3;
constexpr int64_t kMetaCols = 8;
// GeneralShape.static, per problem in the caller's order: [D offset, D ld, M | N << 32, K].
constexpr int64_t kStaticCols = 4;
// Launch-record templates kept per problem set (one per stream and thread).
constexpr size_t kMaxTemplates = 64;

// A strong reference to a Python object.
class Ref {
 public:
  Ref() = default;
  explicit Ref(PyObject* p) : p_(p) { Py_XINCREF(p_); }
  Ref(const Ref&) = delete;
  Ref& operator=(const Ref&) = delete;
  Ref(Ref&& o) noexcept : p_(o.p_) { o.p_ = nullptr; }
  Ref& operator=(Ref&& o) noexcept {
    std::swap(p_, o.p_);
    return *this;
  }
  ~Ref() { Py_XDECREF(p_); }
  PyObject* get() const { return p_; }

 private:
  PyObject* p_ = nullptr;
};

// dtype index as kernels/native.py's _DTYPES: 0 bf16, 1 fp16, 2 fp32; -1 anything else.
int DtypeIndex(c10::ScalarType t) {
  switch (t) {
    case c10::ScalarType::BFloat16: return 0;
    case c10::ScalarType::Half: return 1;
    case c10::ScalarType::Float: return 2;
    default: return -1;
  }
}

const c10::ScalarType kTypes[3] = {c10::ScalarType::BFloat16, c10::ScalarType::Half,
                                   c10::ScalarType::Float};

struct Scan {
  int64_t G = 0;
  int64_t code = 0;  // dtype | device id << 4 | (B K-major) << 20
  bool any_requires_grad = false;
  std::vector<int64_t> cols;  // kRows x G
};

// Dispatch keys of tensors and thread states whose memory is not what the kernel should read
// or whose results must go through torch (functorch's vmap/grad wrappers, functionalization,
// Python subclasses and modes, lazily negated or conjugated views, zero tensors).
c10::DispatchKeySet NotPlainKeys() {
  using K = c10::DispatchKey;
  return c10::DispatchKeySet({K::Functionalize, K::FuncTorchBatched, K::FuncTorchVmapMode,
                              K::FuncTorchGradWrapper, K::FuncTorchDynamicLayerFrontMode,
                              K::FuncTorchDynamicLayerBackMode, K::Python,
                              K::PythonTLSSnapshot, K::PythonDispatcher, K::Conjugate,
                              K::Negative, K::ZeroTensor});
}

const c10::DispatchKeySet& NotPlain() {
  static const auto* keys = new c10::DispatchKeySet(NotPlainKeys());
  return *keys;
}

// A plain strided 2-D tensor with its own storage, or false (the Python path decides).
bool Plain2D(PyObject* obj, const at::Tensor** out) {
  // Tensor or Parameter only: a subclass may not own plain memory (FakeTensor, DTensor, ...).
  if (!THPVariable_CheckExact(obj)) return false;
  const at::Tensor& t = THPVariable_Unpack(obj);
  if (!t.defined() || t.is_nested() || t.layout() != c10::kStrided || t.dim() != 2) return false;
  if (!t.has_storage() || t.key_set().has_any(NotPlain())) return false;
  *out = &t;
  return true;
}

// Thread states under which torch must see the call: a TorchDispatchMode (FakeTensorMode,
// ...), functionalization or functorch transforms in the thread-local included keys.
bool ThreadIsPlain() {
  if (c10::impl::TorchDispatchModeTLS::stack_len() > 0) return false;
  return !c10::impl::tls_local_dispatch_key_set().included_.has_any(NotPlain());
}

// The same checks and columns as kernels/support.py fast_general (tests/kernels/test_native.py
// compares them on random problem sets).
bool ScanOperands(PyObject* a, PyObject* b, int64_t out_dtype_index, bool require_cuda,
                  Scan* s) {
  if (!(PyList_CheckExact(a) || PyTuple_CheckExact(a)) ||
      !(PyList_CheckExact(b) || PyTuple_CheckExact(b))) {
    return false;
  }
  const Py_ssize_t G = PySequence_Fast_GET_SIZE(a);
  if (G == 0 || G > kMaxProblems || PySequence_Fast_GET_SIZE(b) != G) return false;
  PyObject** as = PySequence_Fast_ITEMS(a);
  PyObject** bs = PySequence_Fast_ITEMS(b);
  const at::Tensor* t0;
  if (!Plain2D(as[0], &t0)) return false;
  const int dtype = DtypeIndex(t0->scalar_type());
  if (dtype != 0 && dtype != 1) return false;  // the kernels read bf16 or fp16 operands
  const int64_t odt = out_dtype_index < 0 ? dtype : out_dtype_index;
  if (odt > 2) return false;
  const c10::Device dev = t0->device();
  if (require_cuda ? !dev.is_cuda() : !dev.is_cpu()) return false;
  const int64_t dev_id = dev.has_index() ? dev.index() : 0;
  if (require_cuda && !dev.has_index()) return false;
  const c10::ScalarType st = t0->scalar_type();
  const int64_t align = kTmaAlignBytes / 2;
  const int64_t out_align = kTmaAlignBytes / (odt == 2 ? 4 : 2);

  s->G = G;
  s->cols.assign(kRows * G, 0);
  int64_t* c = s->cols.data();
  auto at = [&](Row r, Py_ssize_t i) -> int64_t& { return c[r * G + i]; };
  int64_t k_major = 0, n_major = 0;
  bool grad = false;
  for (Py_ssize_t i = 0; i < G; ++i) {
    const at::Tensor* ta;
    const at::Tensor* tb;
    if (!Plain2D(as[i], &ta) || !Plain2D(bs[i], &tb)) return false;
    if (ta->scalar_type() != st || tb->scalar_type() != st) return false;
    if (ta->device() != dev || tb->device() != dev) return false;
    grad = grad || ta->requires_grad() || tb->requires_grad();
    const int64_t M = ta->sizes()[0], K = ta->sizes()[1];
    const int64_t Kb = tb->sizes()[0], N = tb->sizes()[1];
    if (Kb != K || M > kMaxDim || N > kMaxDim || K > kMaxDim) return false;
    at(kM, i) = M;
    at(kN, i) = N;
    at(kK, i) = K;
    if (M == 0 || N == 0) continue;
    if (N % out_align) return false;  // output rows not 16-byte multiples
    if (K == 0) continue;
    const int64_t sa0 = ta->strides()[0], sa1 = ta->strides()[1];
    const int64_t pa = reinterpret_cast<int64_t>(ta->const_data_ptr());
    if ((sa1 != 1 && K > 1) || pa % kTmaAlignBytes || (M > 1 && sa0 % align)) return false;
    const int64_t sb0 = tb->strides()[0], sb1 = tb->strides()[1];
    // ld strides the dimension that is not contiguous: K for an N-major B, N for a K-major
    // one; TMA needs it 16-byte aligned wherever that dimension has more than one element.
    int64_t ld, strided;
    if (sb1 == 1 || N == 1) {
      ld = sb0;
      strided = K;
      ++n_major;
    } else if (sb0 == 1 || K == 1) {
      ld = sb1;
      strided = N;
      ++k_major;
    } else {
      return false;
    }
    const int64_t pb = reinterpret_cast<int64_t>(tb->const_data_ptr());
    if (pb % kTmaAlignBytes || (ld % align && strided > 1)) return false;
    at(kAPtr, i) = pa;
    at(kALd, i) = sa0;
    at(kBPtr, i) = pb;
    at(kBLd, i) = ld;
  }
  // Mixed B layouts need per-call copies of the minority: the Python path does that.
  if (k_major && n_major) return false;
  s->any_requires_grad = grad;
  s->code = dtype | (dev_id << 4) | ((k_major ? int64_t{1} : 0) << 20) |
            ((dev.is_cpu() ? int64_t{1} : 0) << 21);
  return true;
}

// The kernels' output layout for a problem set (host_sm90.GeneralShape): one block, output i
// of shape (M_i, N_i), row stride N_i, starting offsets[i] elements into it.
struct OutputLayout {
  c10::ScalarType type;
  std::vector<int64_t> block_shape;
  std::vector<int64_t> offsets;
};

// What a problem set's metadata rows take from its GeneralShape rather than the operands.
struct MetaLayout {
  std::vector<int64_t> fixed;  // G x kStaticCols (GeneralShape.static)
  std::vector<int64_t> order;  // launch order (GeneralShape.order); empty: the caller's
};

// What new operand addresses on one stream and thread launch from (see CallImpl).
struct Template {
  Ref record;               // the last launch record made there
  int64_t stream = -1;      // that stream's raw CUstream handle (-1: unknown, torch copies)
  Ref scratch;              // its one-off twin: the same arguments but scratch_meta's rows
  at::Tensor scratch_meta;  // rewritten before each one-off launch
};

struct ShapeEntry {
  Ref shape;   // host_sm90.GeneralShape
  Ref config;  // held: its address is part of the key and must not be reused
  std::shared_ptr<const OutputLayout> out;
  std::shared_ptr<const MetaLayout> meta;
  std::unordered_map<std::string, Ref> launches;  // -> (kernel, args, raw LaunchInfo)
  // Stream and thread (a launch key's first 16 bytes) -> what new operand addresses launch
  // from there (the workspace in its arguments belongs to that stream).
  std::unordered_map<std::string, std::shared_ptr<Template>> templates;
  int64_t meta_bytes = 0;  // of its launch records' metadata
};

// Heap-allocated and never destroyed: static destructors run after the interpreter has
// finalized, when releasing a Python reference would crash the exiting process.
auto& g_shapes = *new std::unordered_map<std::string, ShapeEntry>();
size_t g_launch_count = 0;
int64_t g_launch_meta_bytes = 0;  // G * 64 per record: the device metadata they keep
int64_t g_records_made = 0;       // launch records made here (stats; tests)
int64_t g_one_off_launches = 0;   // launches through a template's scratch (stats; tests)
int64_t g_ring_uploads = 0;       // metadata uploads through upload_ring.h (stats; tests)
int64_t g_torch_uploads = 0;      // the same through torch's copy (stats; tests)
// Hashes of operand keys seen once without a record: the second sighting makes one.
auto& g_seen = *new std::unordered_set<size_t>();
constexpr size_t kMaxSeen = 65536;
auto& g_is_capturing = *new Ref();  // torch._C._cuda_isCurrentStreamCapturing
auto& g_local = *new Ref();         // host_sm90._local (thread-local LaunchInfo)

void Append(std::string* key, int64_t v) { key->append(reinterpret_cast<const char*>(&v), 8); }

// Problem-set key: code, out dtype, flags (PDL), config identity, L2-hints switch, sizes.
std::string ShapeKey(const Scan& s, int64_t odt, int64_t req, PyObject* config) {
  std::string key;
  key.reserve(56 + 24 * s.G);
  Append(&key, s.code);
  Append(&key, odt);
  Append(&key, req);
  Append(&key, reinterpret_cast<int64_t>(config));
  const char* l2 = std::getenv("MOE_GEMM_L2_HINTS");  // os.environ writes go through putenv
  Append(&key, l2 ? static_cast<int64_t>(std::strlen(l2)) : -1);
  if (l2) key.append(l2);
  key.append(reinterpret_cast<const char*>(s.cols.data() + kM * s.G), 3 * 8 * s.G);
  return key;
}

// Operand key: current stream, thread, addresses and leading dims.
void LaunchKey(const Scan& s, bool require_cuda, std::string* key) {
  int64_t stream = 0;
  if (require_cuda) {
    const c10::Device dev(c10::DeviceType::CUDA,
                          static_cast<c10::DeviceIndex>(s.code >> 4 & 255));
    stream = static_cast<int64_t>(
        c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getStream(dev).id());
  }
  key->clear();
  key->reserve(16 + 32 * s.G);
  Append(key, stream);
  Append(key, static_cast<int64_t>(PyThread_get_thread_ident()));
  key->append(reinterpret_cast<const char*>(s.cols.data()), 4 * 8 * s.G);
}

constexpr size_t kStreamThreadBytes = 16;  // a launch key's prefix: stream, thread

std::string StreamThread(const std::string& lkey) { return lkey.substr(0, kStreamThreadBytes); }

bool CuteDisabled() {
  const char* v = std::getenv("MOE_GEMM_DISABLE_CUTE");
  return v != nullptr && v[0] != '\0' && std::strcmp(v, "0") != 0;
}

// Declined while a CUDA graph is captured: cached metadata and workspaces must not be baked
// into a graph (the Python path keeps what a capture needs alive).
int Capturing(bool require_cuda) {
  if (!require_cuda || g_is_capturing.get() == nullptr) return 0;
  PyObject* r = PyObject_CallNoArgs(g_is_capturing.get());
  if (r == nullptr) return -1;
  const int yes = PyObject_IsTrue(r);
  Py_DECREF(r);
  return yes;
}

// The outputs: fresh block, then plain tensors on its storage (not autograd views of it: the
// block itself is never handed out, so nothing can write through it).
PyObject* NewOutputs(const Scan& s, const OutputLayout& lay, bool require_cuda,
                     int64_t* d_base) {
  at::Tensor block;
  try {
    const c10::Device dev = require_cuda
        ? c10::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(s.code >> 4 & 255))
        : c10::Device(c10::DeviceType::CPU);
    block = at::empty(lay.block_shape, at::TensorOptions().dtype(lay.type).device(dev));
    // Only a plain tensor on that device with real memory (ThreadIsPlain already ruled out
    // modes that would hand back something else; this is the last word).
    if (!block.has_storage() || block.key_set().has_any(NotPlain()) ||
        block.device().type() != dev.type() ||
        (block.numel() > 0 && block.const_data_ptr() == nullptr)) {
      return nullptr;
    }
    *d_base = reinterpret_cast<int64_t>(block.const_data_ptr());
  } catch (const std::exception&) {
    return nullptr;  // e.g. out of memory: declined, torch.empty on the Python path raises it
  }
  const c10::Storage& storage = block.storage();
  const int64_t* M = s.cols.data() + kM * s.G;
  const int64_t* N = s.cols.data() + kN * s.G;
  PyObject* list = PyList_New(s.G);
  if (list == nullptr) return nullptr;
  for (int64_t i = 0; i < s.G; ++i) {
    auto impl = c10::make_intrusive<c10::TensorImpl>(
        c10::TensorImpl::VIEW, c10::Storage(storage), block.key_set(), block.dtype());
    const int64_t sizes[2] = {M[i], N[i]};
    const int64_t strides[2] = {N[i] > 0 ? N[i] : 1, 1};
    impl->set_sizes_and_strides(c10::IntArrayRef(sizes, 2), c10::IntArrayRef(strides, 2));
    impl->set_storage_offset(lay.offsets[i]);
    PyObject* t = THPVariable_Wrap(at::Tensor(std::move(impl)));
    if (t == nullptr) {
      Py_DECREF(list);
      return nullptr;
    }
    PyList_SET_ITEM(list, i, t);
  }
  return list;
}

// The TVM-FFI C call of compiled kernels (its own file; it uses Ref).
#include "ffi_call.h"

// Calls record = (kernel, args, raw): kernel(*args, d_base); host_sm90._local.raw = raw.
// `stream`: the current stream's raw handle where known (the C call, ffi_call.h), else -1
// (the Python call, which reads torch's current stream itself).
bool Launch(PyObject* record, int64_t d_base, int64_t stream) {
  PyObject* kernel = PyTuple_GET_ITEM(record, 0);
  PyObject* args = PyTuple_GET_ITEM(record, 1);
  if (stream >= 0 && ffi::CallRecord(kernel, args, d_base, stream)) {
    return g_local.get() == nullptr ||
           PyObject_SetAttrString(g_local.get(), "raw", PyTuple_GET_ITEM(record, 2)) >= 0;
  }
  const Py_ssize_t n = PyTuple_GET_SIZE(args);
  std::vector<PyObject*> argv(n + 1);
  for (Py_ssize_t i = 0; i < n; ++i) argv[i] = PyTuple_GET_ITEM(args, i);
  PyObject* base = PyLong_FromLongLong(d_base);
  if (base == nullptr) return false;
  argv[n] = base;
  PyObject* r = PyObject_Vectorcall(kernel, argv.data(), n + 1, nullptr);
  Py_DECREF(base);
  if (r == nullptr) return false;
  Py_DECREF(r);
  if (g_local.get() != nullptr &&
      PyObject_SetAttrString(g_local.get(), "raw", PyTuple_GET_ITEM(record, 2)) < 0) {
    return false;
  }
  return true;
}

// The metadata rows of operands `s` for a problem set (as GeneralShape.metadata fills them)
// into `m` (G x kMetaCols int64).
void FillRows(const Scan& s, const MetaLayout& lay, int64_t* m) {
  const int64_t G = s.G;
  const int64_t* c = s.cols.data();
  const bool reorder = !lay.order.empty();
  for (int64_t j = 0; j < G; ++j) {
    const int64_t i = reorder ? lay.order[j] : j;
    const int64_t* f = lay.fixed.data() + kStaticCols * i;
    int64_t* r = m + kMetaCols * j;
    r[0] = c[kAPtr * G + i];
    r[1] = c[kBPtr * G + i];
    r[2] = f[0];
    r[3] = c[kALd * G + i];
    r[4] = c[kBLd * G + i];
    r[5] = f[1];
    r[6] = f[2];
    r[7] = f[3];
  }
}

// Copies operands `s`'s metadata rows into `rows` (where the kernel reads them) on `stream`
// (a raw handle, the current stream's; -1: unknown): through its pinned ring where it can,
// else through torch (a pinned block that its asynchronous copy keeps until the copy has run).
void UploadRows(const Scan& s, const MetaLayout& lay, int64_t stream, at::Tensor& rows,
                bool require_cuda) {
  const int64_t bytes = 8 * kMetaCols * s.G;
  if (stream >= 0) {
    upload::Ring* ring = upload::RingFor(stream, static_cast<int>(s.code >> 4 & 255),
                                         require_cuda);
    char* p = ring != nullptr ? ring->Reserve(bytes) : nullptr;
    if (p != nullptr) {
      FillRows(s, lay, reinterpret_cast<int64_t*>(p));
      if (ring->Send(p, bytes, reinterpret_cast<uint64_t>(rows.mutable_data_ptr()))) {
        ++g_ring_uploads;
        return;
      }
    }
  }
  at::Tensor host = at::empty({s.G, kMetaCols},
                              at::TensorOptions().dtype(at::kLong).pinned_memory(require_cuda));
  FillRows(s, lay, host.mutable_data_ptr<int64_t>());
  rows.copy_(host, /*non_blocking=*/true);
  ++g_torch_uploads;
}

// Whether `tmpl` is a record whose arguments this module knows how to rewrite.
bool Rewritable(PyObject* tmpl) {
  PyObject* targs = PyTuple_GET_ITEM(tmpl, 1);
  return PyTuple_GET_SIZE(targs) > kMetaArg + 1 &&
         THPVariable_Check(PyTuple_GET_ITEM(targs, kMetaArg));
}

// The record `tmpl` with `meta` (device rows) and its int32 view as the metadata arguments.
// New reference or nullptr (a Python error set).
PyObject* WithMeta(PyObject* tmpl, at::Tensor meta) {
  PyObject* targs = PyTuple_GET_ITEM(tmpl, 1);
  const Py_ssize_t n = PyTuple_GET_SIZE(targs);
  at::Tensor meta32 = meta.view(at::kInt);
  PyObject* args = PyTuple_New(n);
  if (args == nullptr) return nullptr;
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* v;
    if (i == kMetaArg) {
      v = THPVariable_Wrap(std::move(meta));
    } else if (i == kMetaArg + 1) {
      v = THPVariable_Wrap(std::move(meta32));
    } else {
      v = PyTuple_GET_ITEM(targs, i);
      Py_INCREF(v);
    }
    if (v == nullptr) {
      Py_DECREF(args);
      return nullptr;
    }
    PyTuple_SET_ITEM(args, i, v);
  }
  PyObject* rec = PyTuple_Pack(3, PyTuple_GET_ITEM(tmpl, 0), args, PyTuple_GET_ITEM(tmpl, 2));
  Py_DECREF(args);
  return rec;
}

// Uninitialized metadata rows for operands `s` where the kernel reads them.
at::Tensor NewRows(const Scan& s, bool require_cuda) {
  const c10::Device dev = require_cuda
      ? c10::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(s.code >> 4 & 255))
      : c10::Device(c10::DeviceType::CPU);
  return at::empty({s.G, kMetaCols}, at::TensorOptions().dtype(at::kLong).device(dev));
}

// A launch record for new operand addresses from template `t` (the last record of the same
// problem set made on the same stream and thread): its kernel, LaunchInfo and arguments, with
// metadata rows of its own uploaded once. New reference, or nullptr (a Python error set, or
// none: declined).
PyObject* NewRecord(const Scan& s, const MetaLayout& lay, const Template& t, bool require_cuda) {
  if (!Rewritable(t.record.get())) return nullptr;
  at::Tensor rows = NewRows(s, require_cuda);
  UploadRows(s, lay, t.stream, rows, require_cuda);
  PyObject* rec = WithMeta(t.record.get(), std::move(rows));
  if (rec != nullptr) ++g_records_made;
  return rec;
}

// Launches operands `s` once through `t`'s scratch record, whose metadata rows are rewritten
// for each such launch (made on first use). Safe without events: the scratch belongs to one
// stream (and thread), so each copy into it runs after the previous launch that read it.
// 1 launched, 0 declined, -1 a Python error set.
int OneOffLaunch(const Scan& s, const MetaLayout& lay, Template* t, bool require_cuda,
                 int64_t d_base) {
  if (t->scratch.get() == nullptr) {
    if (!Rewritable(t->record.get())) return 0;
    at::Tensor rows = NewRows(s, require_cuda);
    PyObject* rec = WithMeta(t->record.get(), rows);
    if (rec == nullptr) return -1;
    t->scratch = Ref(rec);
    Py_DECREF(rec);
    t->scratch_meta = std::move(rows);
  }
  UploadRows(s, lay, t->stream, t->scratch_meta, require_cuda);
  Ref rec(t->scratch.get());  // held through the launch (its Python code could drop `t`'s)
  if (!Launch(rec.get(), d_base, require_cuda ? t->stream : -1)) return -1;
  ++g_one_off_launches;
  return 1;
}

PyObject* ColsBytes(const Scan& s) {
  return PyBytes_FromStringAndSize(reinterpret_cast<const char*>(s.cols.data()),
                                   static_cast<Py_ssize_t>(8 * s.cols.size()));
}

bool ParseInt(PyObject* o, int64_t* v) {
  *v = PyLong_AsLongLong(o);
  return !(*v == -1 && PyErr_Occurred());
}

// ---- Python functions ----

// init(is_capturing, local)
PyObject* Init(PyObject*, PyObject* const* args, Py_ssize_t n) {
  if (n != 2) {
    PyErr_SetString(PyExc_TypeError, "init(is_capturing, local)");
    return nullptr;
  }
  g_is_capturing = Ref(args[0] == Py_None ? nullptr : args[0]);
  g_local = Ref(args[1] == Py_None ? nullptr : args[1]);
  Py_RETURN_NONE;
}

// A C++ exception must not cross into Python (it would terminate the process): anything
// torch throws while reading tensors or allocating declines the call instead.
#define DECLINE_ON_THROW(body)                     \
  try {                                            \
    body                                           \
  } catch (const std::exception&) {                \
    if (PyErr_Occurred()) return nullptr;          \
    Py_RETURN_NONE;                                \
  }

// grouped_mm's repeated calls (its own file; it uses the helpers above).
#include "mm_call.h"

// scan(a, b, out_dtype_index, require_cuda) -> None | (code, cols bytes)
PyObject* ScanFn(PyObject*, PyObject* const* args, Py_ssize_t n) {
  int64_t odt, req;
  if (n != 4 || !ParseInt(args[2], &odt) || !ParseInt(args[3], &req)) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "scan(a, b, odt, require_cuda)");
    return nullptr;
  }
  DECLINE_ON_THROW({
    Scan s;
    if (!ScanOperands(args[0], args[1], odt, req != 0, &s)) Py_RETURN_NONE;
    return Py_BuildValue("(LN)", static_cast<long long>(s.code), ColsBytes(s));
  })
}

bool ScanFromBytes(PyObject* cols, int64_t code, Scan* s) {
  char* buf;
  Py_ssize_t len;
  if (PyBytes_AsStringAndSize(cols, &buf, &len) < 0) return false;
  if (len <= 0 || len % (8 * kRows)) {
    PyErr_SetString(PyExc_ValueError, "cols: not a scan's bytes");
    return false;
  }
  s->G = len / (8 * kRows);
  s->code = code;
  s->cols.resize(len / 8);
  std::memcpy(s->cols.data(), buf, len);
  return true;
}

// Drops every entry (the references go after the maps are consistent again).
void ForgetAll() {
  std::unordered_map<std::string, ShapeEntry> old;
  old.swap(g_shapes);
  g_seen.clear();
  g_launch_count = 0;
  g_launch_meta_bytes = 0;
}

// Drops every launch record and template, keeping the problem sets. Each record's metadata
// was allocated on its key's stream, so the allocator reuses it only after that stream's work.
void ForgetLaunches() {
  std::vector<std::unordered_map<std::string, Ref>> old;
  std::vector<std::unordered_map<std::string, std::shared_ptr<Template>>> old_templates;
  for (auto& kv : g_shapes) {
    old.emplace_back();
    old.back().swap(kv.second.launches);
    old_templates.emplace_back();
    old_templates.back().swap(kv.second.templates);
    kv.second.meta_bytes = 0;
  }
  g_launch_count = 0;
  g_launch_meta_bytes = 0;
}

// Keeps `record` under the problem set `skey` and operands `lkey`, and as the template of its
// stream and thread. False where the problem set was forgotten meanwhile (the next call
// rebuilds). Replaced references are released after the maps are consistent again.
// `stream`: the raw handle of the key's stream (-1: unknown, or kept from the template).
bool StoreLaunch(const std::string& skey, std::string lkey, PyObject* record, int64_t G,
                 int64_t stream) {
  const int64_t bytes = 64 * G;
  if (g_launch_count >= kMaxLaunches || g_launch_meta_bytes + bytes > kMaxLaunchMetaBytes) {
    ForgetLaunches();
  }
  auto it = g_shapes.find(skey);
  if (it == g_shapes.end()) return false;
  ShapeEntry& e = it->second;
  Ref old_record, old_template;
  std::unordered_map<std::string, std::shared_ptr<Template>> old_templates;
  if (e.templates.size() >= kMaxTemplates) old_templates.swap(e.templates);
  std::shared_ptr<Template>& slot = e.templates[StreamThread(lkey)];
  if (!slot) slot = std::make_shared<Template>();
  old_template = std::move(slot->record);  // its scratch stays: same stream, same arguments
  slot->record = Ref(record);
  if (stream >= 0) slot->stream = stream;
  auto li = e.launches.find(lkey);
  if (li != e.launches.end()) {
    old_record = std::move(li->second);
    li->second = Ref(record);
  } else {
    e.launches.emplace(std::move(lkey), Ref(record));
    e.meta_bytes += bytes;
    ++g_launch_count;
    g_launch_meta_bytes += bytes;
  }
  return true;
}

PyObject* CallImpl(PyObject* const* args, int64_t odt, int64_t req) {
  const bool require_cuda = (req & kRequireCuda) != 0;
  Scan s;
  if (!ThreadIsPlain() || !ScanOperands(args[0], args[1], odt, require_cuda, &s)) {
    Py_RETURN_NONE;
  }
  // Inference-only kernels: a grad-requiring operand under grad mode takes the Python path,
  // which links the outputs so that backward raises, or runs the torch backend as configured.
  if ((s.any_requires_grad && at::GradMode::is_enabled()) || CuteDisabled()) Py_RETURN_NONE;
  const int capturing = Capturing(require_cuda);
  if (capturing < 0) return nullptr;
  if (capturing) Py_RETURN_NONE;
  std::string skey = ShapeKey(s, odt, req, args[3]);
  auto it = g_shapes.find(skey);
  if (it == g_shapes.end()) {
    return Py_BuildValue("(LN)", static_cast<long long>(s.code), ColsBytes(s));
  }
  // Everything needed from the entry is taken (strong references, shared layouts) before
  // anything that can run Python code (wrapping tensors can start a garbage collection whose
  // finalizers could call back in and drop entries).
  std::string lkey;
  LaunchKey(s, require_cuda, &lkey);
  const ShapeEntry& e = it->second;
  Ref shape(e.shape.get());
  const std::shared_ptr<const OutputLayout> layout = e.out;
  const std::shared_ptr<const MetaLayout> meta = e.meta;
  auto li = e.launches.find(lkey);
  Ref record(li == e.launches.end() ? nullptr : li->second.get());
  std::shared_ptr<Template> tmpl;  // this stream and thread's (its raw stream handle too)
  {
    auto ti = e.templates.find(StreamThread(lkey));
    if (ti != e.templates.end()) tmpl = ti->second;
  }
  const int64_t raw_stream = require_cuda && tmpl ? tmpl->stream : -1;
  int64_t d_base = 0;
  PyObject* outs = NewOutputs(s, *layout, require_cuda, &d_base);
  if (outs == nullptr) {
    if (PyErr_Occurred()) return nullptr;
    Py_RETURN_NONE;
  }
  if (record.get() == nullptr && tmpl && meta) {
    // New operand addresses on a stream and thread this problem set has launched on. Seen
    // once: launched through the template's scratch metadata (fresh activations every step
    // keep no record). Seen again (an allocator handing the same blocks back): a record of
    // their own, so that later calls launch without any upload.
    const size_t seen = std::hash<std::string>{}(lkey);
    const bool again = g_seen.count(seen) != 0;
    PyObject* made = nullptr;
    int launched = 0;
    try {
      if (again) {
        made = NewRecord(s, *meta, *tmpl, require_cuda);
      } else {
        launched = OneOffLaunch(s, *meta, tmpl.get(), require_cuda, d_base);
      }
    } catch (const std::exception&) {
      made = nullptr;  // e.g. out of memory: the Python path below makes it (or raises)
      launched = 0;
    }
    if (launched < 0 || (made == nullptr && PyErr_Occurred())) {
      Py_XDECREF(made);
      Py_DECREF(outs);
      return nullptr;
    }
    if (launched > 0) {
      if (g_seen.size() >= kMaxSeen) g_seen.clear();
      g_seen.insert(seen);
      return outs;
    }
    record = Ref(made);
    Py_XDECREF(made);
    if (record.get() != nullptr) {
      g_seen.erase(seen);
      StoreLaunch(skey, std::move(lkey), record.get(), s.G, -1);
    }
  }
  if (record.get() == nullptr) {
    return Py_BuildValue("(ONLLN)", shape.get(), outs, static_cast<long long>(d_base),
                         static_cast<long long>(s.code), ColsBytes(s));
  }
  if (!Launch(record.get(), d_base, raw_stream)) {
    Py_DECREF(outs);
    return nullptr;
  }
  return outs;
}

// call(a, b, out_dtype_index, config, req) ->
//   None                                  declined: the Python path decides
//   list                                  launched (from a record, or one made here): the
//                                         outputs
//   (shape, outs, d_base, code, cols)     known problem set, new operands, no record of it on
//                                         this stream and thread yet: the caller makes the
//                                         launch record (remember_launch) and launches
//   (code, cols)                          new problem set: the caller registers its shape
//                                         (remember_shape) and calls again
// req: kRequireCuda | kPdl flags.
PyObject* Call(PyObject*, PyObject* const* args, Py_ssize_t n) {
  int64_t odt, req;
  if (n != 5 || !ParseInt(args[2], &odt) || !ParseInt(args[4], &req)) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "call(a, b, odt, config, req)");
    return nullptr;
  }
  DECLINE_ON_THROW({ return CallImpl(args, odt, req); })
}

// int64 values from a bytes object of `count` of them (count < 0: any), appended to `out`.
bool Int64s(PyObject* o, int64_t count, std::vector<int64_t>* out) {
  char* buf;
  Py_ssize_t len;
  if (PyBytes_AsStringAndSize(o, &buf, &len) < 0) return false;
  if (len % 8 || (count >= 0 && len != 8 * count)) {
    PyErr_SetString(PyExc_ValueError, "remember_shape: bad metadata layout");
    return false;
  }
  out->resize(len / 8);
  std::memcpy(out->data(), buf, len);
  return true;
}

// remember_shape(cols, code, odt, req, config, shape, out_type_index, block_shape, offsets,
//                static_rows, order)
// static_rows: GeneralShape.static's bytes (G x 4 int64); order: GeneralShape.order_np's
// bytes, or None for the caller's order.
PyObject* RememberShape(PyObject*, PyObject* const* args, Py_ssize_t n) {
  int64_t code, odt, req, out_type;
  if (n != 11 || !ParseInt(args[1], &code) || !ParseInt(args[2], &odt) ||
      !ParseInt(args[3], &req) || !ParseInt(args[6], &out_type) || !PyTuple_Check(args[7]) ||
      !PyTuple_Check(args[8])) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "remember_shape(...)");
    return nullptr;
  }
  Scan s;
  if (!ScanFromBytes(args[0], code, &s)) return nullptr;
  if (out_type < 0 || out_type > 2 || PyTuple_GET_SIZE(args[8]) != s.G) {
    PyErr_SetString(PyExc_ValueError, "remember_shape: bad output layout");
    return nullptr;
  }
  OutputLayout lay;
  lay.type = kTypes[out_type];
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(args[7]); ++i) {
    int64_t v;
    if (!ParseInt(PyTuple_GET_ITEM(args[7], i), &v)) return nullptr;
    lay.block_shape.push_back(v);
  }
  for (Py_ssize_t i = 0; i < s.G; ++i) {
    int64_t v;
    if (!ParseInt(PyTuple_GET_ITEM(args[8], i), &v)) return nullptr;
    lay.offsets.push_back(v);
  }
  MetaLayout meta;
  if (!Int64s(args[9], kStaticCols * s.G, &meta.fixed)) return nullptr;
  if (args[10] != Py_None) {
    if (!Int64s(args[10], s.G, &meta.order)) return nullptr;
    std::vector<bool> seen(s.G, false);
    for (const int64_t i : meta.order) {  // a permutation, or rows would be read out of bounds
      if (i < 0 || i >= s.G || seen[i]) {
        PyErr_SetString(PyExc_ValueError, "remember_shape: order is not a permutation");
        return nullptr;
      }
      seen[i] = true;
    }
  }
  if (g_shapes.size() >= kMaxShapes) ForgetAll();
  ShapeEntry entry;
  entry.shape = Ref(args[5]);
  entry.config = Ref(args[4]);
  entry.out = std::make_shared<const OutputLayout>(std::move(lay));
  entry.meta = std::make_shared<const MetaLayout>(std::move(meta));
  std::string key = ShapeKey(s, odt, req, args[4]);
  auto it = g_shapes.find(key);
  if (it != g_shapes.end()) {
    ShapeEntry old = std::move(it->second);  // released after the map holds the new one
    g_launch_count -= old.launches.size();
    g_launch_meta_bytes -= old.meta_bytes;
    it->second = std::move(entry);
  } else {
    g_shapes.emplace(std::move(key), std::move(entry));
  }
  Py_RETURN_NONE;
}

// remember_launch(cols, code, odt, req, config, record, stream) -> registered (bool)
// stream: the current stream's raw handle (torch.cuda.current_stream().cuda_stream; 0 for the
// CPU tests), or -1: metadata uploads then go through torch.
PyObject* RememberLaunch(PyObject*, PyObject* const* args, Py_ssize_t n) {
  int64_t code, odt, req, stream;
  if (n != 7 || !ParseInt(args[1], &code) || !ParseInt(args[2], &odt) ||
      !ParseInt(args[3], &req) || !ParseInt(args[6], &stream) || !PyTuple_Check(args[5]) ||
      PyTuple_GET_SIZE(args[5]) != 3 ||
      !PyTuple_Check(PyTuple_GET_ITEM(args[5], 1))) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "remember_launch(...)");
    return nullptr;
  }
  Scan s;
  if (!ScanFromBytes(args[0], code, &s)) return nullptr;
  std::string lkey;
  try {
    LaunchKey(s, (req & kRequireCuda) != 0, &lkey);
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
  if (StoreLaunch(ShapeKey(s, odt, req, args[4]), std::move(lkey), args[5], s.G, stream)) {
    Py_RETURN_TRUE;
  }
  Py_RETURN_FALSE;
}

// upload_rows(cols, code, odt, req, config, stream) -> the metadata rows of operands `cols`
// for their (remembered) problem set, on their device, uploaded on `stream` (as
// remember_launch's); None where the problem set is not (or no longer) remembered: the caller
// makes them. A problem set's first launch on a stream (kernels/native.py _first_calls).
PyObject* UploadRowsFn(PyObject*, PyObject* const* args, Py_ssize_t n) {
  int64_t code, odt, req, stream;
  if (n != 6 || !ParseInt(args[1], &code) || !ParseInt(args[2], &odt) ||
      !ParseInt(args[3], &req) || !ParseInt(args[5], &stream)) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "upload_rows(...)");
    return nullptr;
  }
  Scan s;
  if (!ScanFromBytes(args[0], code, &s)) return nullptr;
  auto it = g_shapes.find(ShapeKey(s, odt, req, args[4]));
  if (it == g_shapes.end() || !it->second.meta) Py_RETURN_NONE;
  const std::shared_ptr<const MetaLayout> meta = it->second.meta;
  const bool require_cuda = (req & kRequireCuda) != 0;
  try {
    at::Tensor rows = NewRows(s, require_cuda);
    UploadRows(s, *meta, stream, rows, require_cuda);
    return THPVariable_Wrap(std::move(rows));
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
}

PyObject* Forget(PyObject*, PyObject* const*, Py_ssize_t) {
  ForgetAll();
  mm::Forget();
  Py_RETURN_NONE;
}

// stats() -> (problem sets, launch records, records made here so far, one-off launches so far,
//             metadata uploads through the ring so far, through torch so far)
PyObject* Stats(PyObject*, PyObject* const*, Py_ssize_t) {
  return Py_BuildValue("(nnLLLL)", static_cast<Py_ssize_t>(g_shapes.size()),
                       static_cast<Py_ssize_t>(g_launch_count),
                       static_cast<long long>(g_records_made),
                       static_cast<long long>(g_one_off_launches),
                       static_cast<long long>(g_ring_uploads),
                       static_cast<long long>(g_torch_uploads));
}

// upload_testing(fake, chunk_bytes, flags): the ring's test hook. fake: upload_ring.h's fakes
// on or off (fresh rings where that or chunk_bytes changes; chunk_bytes applies to rings made
// afterwards, real ones too; 0: the default). flags: 1 fences never complete, 2 copies fail,
// 4 copies queue until flushed, 8 flush the queued copies now.
PyObject* UploadTesting(PyObject*, PyObject* const* args, Py_ssize_t n) {
  int64_t fake, chunk, flags;
  if (n != 3 || !ParseInt(args[0], &fake) || !ParseInt(args[1], &chunk) ||
      !ParseInt(args[2], &flags)) {
    if (!PyErr_Occurred()) {
      PyErr_SetString(PyExc_TypeError, "upload_testing(fake, chunk_bytes, flags)");
    }
    return nullptr;
  }
  if (chunk < 0 || chunk > (int64_t{1} << 24)) {
    PyErr_SetString(PyExc_ValueError, "upload_testing: chunk_bytes out of range");
    return nullptr;
  }
  if (flags & 8) upload::FlushFakes();
  if ((fake != 0) != upload::TheDriver().fake ||
      (chunk > 0 ? chunk : upload::kDefaultChunkBytes) != upload::g_chunk_bytes) {
    upload::InstallFakes(fake != 0, chunk);  // fresh rings; else the ring state carries on
  }
  upload::g_fake_not_ready = (flags & 1) != 0;
  upload::g_fake_fail = (flags & 2) != 0;
  upload::g_fake_defer = (flags & 4) != 0;
  Py_RETURN_NONE;
}

#define FASTCALL(f) reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(f))

PyMethodDef kMethods[] = {
    {"init", FASTCALL(Init), METH_FASTCALL, "init(is_capturing, local)"},
    {"scan", FASTCALL(ScanFn), METH_FASTCALL, "scan(a, b, odt, require_cuda)"},
    {"call", FASTCALL(Call), METH_FASTCALL, "call(a, b, odt, config, req)"},
    {"remember_shape", FASTCALL(RememberShape), METH_FASTCALL, "remember_shape(...)"},
    {"remember_launch", FASTCALL(RememberLaunch), METH_FASTCALL, "remember_launch(...)"},
    {"upload_rows", FASTCALL(UploadRowsFn), METH_FASTCALL, "upload_rows(...)"},
    {"forget", FASTCALL(Forget), METH_FASTCALL, "forget()"},
    {"mm_call", FASTCALL(mm::Call), METH_FASTCALL, "mm_call(x, w, offs, out, config, odt, req)"},
    {"remember_mm", FASTCALL(mm::Remember), METH_FASTCALL, "remember_mm(...)"},
    {"init_ffi", FASTCALL(ffi::InitFfi), METH_FASTCALL, "init_ffi(path)"},
    {"mm_stats", FASTCALL(mm::Stats), METH_FASTCALL, "mm_stats()"},
    {"stats", FASTCALL(Stats), METH_FASTCALL, "stats()"},
    {"upload_testing", FASTCALL(UploadTesting), METH_FASTCALL,
     "upload_testing(fake, chunk_bytes, flags)"},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "_moe_gemm_native",
                       "grouped_gemm's per-call host work", -1, kMethods};

}  // namespace

PyMODINIT_FUNC PyInit__moe_gemm_native() { return PyModule_Create(&kModule); }
