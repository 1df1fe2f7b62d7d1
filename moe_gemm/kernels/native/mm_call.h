// grouped_mm's repeated call in C++: included by general_call.cc (after its helpers, which
// this file uses: Ref, NotPlain, ThreadIsPlain, Append, CuteDisabled, Capturing, ParseInt,
// kTypes, g_local; and ffi_call.h's TVM-FFI C call).
//
// Why: a grouped_mm call that hits a cached plan (ops._mm_plans) spent ~10 us of host time in
// Python before its kernel started on an H200 host (session 12, scripts/host_profile.py with
// the host-only timer): the plan key 2.3 us, torch.empty 2.2, the workspace lookup, and the
// kernel's Python call 5.4 (TVM-FFI converting nine torch tensors). Everything up to the
// launch is the launch gap, since the launch is the call's last act; torch's grouped_mm
// launches mid-call. Here: one key over the same fields as ops._mm_plan_key plus the stream
// and thread (they pick the workspace), the output from at::empty, and the compiled
// function's TVM-FFI handle called through its C ABI with DLTensors made in place (its
// generated host function then packs the TMA descriptors and launches).
//
// An entry is made by Python after a cached plan launched (kernels/native.py remember_mm),
// so only calls that Python has already validated, with the same shapes, strides, dtypes,
// devices, 16-byte alignment, config and switches, ever launch from here; offs values never
// matter (the kernel reads them on the GPU). Anything else, or any doubt, declines.

namespace mm {

using namespace ffi;  // the C ABI's names and calls (ffi_call.h)

// The kernel's arguments (host_sm90.MmPlan / BmmPlan): x, w, out, meta, meta32, offs, table,
// workspace, trace, then seven ints. x, w, out come from the call, offs too in the 2-D form.
constexpr Py_ssize_t kArgs = 16;
constexpr Py_ssize_t kTensorArgs = 9;
constexpr Py_ssize_t kX = 0, kW = 1, kOut = 2, kOffs = 5;
constexpr size_t kMaxEntries = 1024;
// Device memory the entries keep alive (their workspaces above all: a tail-split one holds
// partial tiles, ~9 MB at 66 CTAs of 128x256): past this, all entries are dropped, as past
// kMaxEntries. Counted per entry, so a workspace shared by entries counts more than once.
constexpr int64_t kMaxEntryBytes = int64_t{256} << 20;

// `req` flags of mm_call / remember_mm (general_call.cc's kRequireCuda, kPdl).
struct Entry {
  Ref kernel;  // the compiled function (keeps `handle` alive); called from Python without one
  Ref config;  // held: its address is part of the key and must not be reused
  Ref raw;     // host_sm90._local.raw after a launch (LaunchInfo's tuple)
  Ref args;    // the argument tuple, None in the call's slots (the Python call)
  void* handle = nullptr;  // its TVM-FFI function; null: call `kernel` from Python
  std::vector<at::Tensor> held;            // the fixed tensor arguments, kept alive
  std::vector<std::vector<int64_t>> dims;  // their shapes and strides, for `fixed`
  DLTensorC fixed[kTensorArgs] = {};       // the fixed tensor arguments as DLTensors
  int64_t ints[kArgs - kTensorArgs] = {};
  std::vector<int64_t> out_shape;
  c10::ScalarType out_type = c10::ScalarType::BFloat16;
  int64_t stream = 0;  // the key stream's raw handle
  int64_t bytes = 0;   // of the allocations of `held`
  bool batched = false;
};

auto& g_entries = *new std::unordered_map<std::string, std::shared_ptr<Entry>>();
int64_t g_fast_launches = 0;  // launches from an entry (stats; tests)
int64_t g_entries_made = 0;   // (stats; tests)
int64_t g_entry_bytes = 0;    // the entries' `bytes`

// A plain strided tensor with its own storage (Tensor or Parameter), or null.
const at::Tensor* Plain(PyObject* obj) {
  if (!THPVariable_CheckExact(obj)) return nullptr;
  const at::Tensor& t = THPVariable_Unpack(obj);
  if (!t.defined() || t.is_nested() || t.layout() != c10::kStrided || !t.has_storage() ||
      t.key_set().has_any(NotPlain())) {
    return nullptr;
  }
  return &t;
}

void AppendTensor(std::string* key, const at::Tensor& t) {
  const c10::Device dev = t.device();
  Append(key, static_cast<int64_t>(t.scalar_type()) |
                  (static_cast<int64_t>(dev.type()) << 8) |
                  (static_cast<int64_t>(dev.has_index() ? dev.index() + 1 : 0) << 16) |
                  (t.dim() << 24));
  for (const int64_t s : t.sizes()) Append(key, s);
  for (const int64_t s : t.strides()) Append(key, s);
}

void AppendEnv(std::string* key, const char* name) {
  const char* v = std::getenv(name);  // os.environ writes go through putenv
  Append(key, v ? static_cast<int64_t>(std::strlen(v)) : -1);
  if (v) key->append(v);
}

bool ChecksOffs() {
  const char* v = std::getenv("MOE_GEMM_CHECK_OFFS");
  return v != nullptr && v[0] != '\0' && std::strcmp(v, "0") != 0;
}

struct Operands {
  const at::Tensor* x = nullptr;
  const at::Tensor* w = nullptr;
  const at::Tensor* offs = nullptr;  // null: the batched (3-D) form
  const at::Tensor* out = nullptr;   // null: a fresh output
};

// The operands of mm_call / remember_mm, or false where the call is not for this path.
// args: x, w, offs, out, config, out_dtype_index, req.
bool ReadOperands(PyObject* const* args, bool require_cuda, Operands* o) {
  if (!(o->x = Plain(args[0])) || !(o->w = Plain(args[1]))) return false;
  if (args[2] != Py_None && !(o->offs = Plain(args[2]))) return false;
  if (args[3] != Py_None && !(o->out = Plain(args[3]))) return false;
  const c10::Device dev = o->x->device();
  if (require_cuda ? !(dev.is_cuda() && dev.has_index()) : !dev.is_cpu()) return false;
  return true;
}

// Entry key: form, device, stream, thread, then what ops._mm_plan_key (_bmm_plan_key) holds:
// x, w, offs, out (dtype, device, sizes, strides; x, w, out addresses mod 16), out dtype,
// config identity, PDL, the L2-hints and tail-split switches.
void EntryKey(const Operands& o, int64_t odt, int64_t req, PyObject* config, bool require_cuda,
              std::string* key) {
  int64_t stream = 0;
  const c10::Device dev = o.x->device();
  if (require_cuda) {
    stream = static_cast<int64_t>(
        c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getStream(dev).id());
  }
  key->clear();
  key->reserve(320);
  Append(key, stream);
  Append(key, static_cast<int64_t>(PyThread_get_thread_ident()));
  Append(key, (o.offs ? 1 : 0) | (o.out ? 2 : 0));
  AppendTensor(key, *o.x);
  AppendTensor(key, *o.w);
  if (o.offs) AppendTensor(key, *o.offs);
  if (o.out) AppendTensor(key, *o.out);
  auto low = [](const at::Tensor* t) {
    return t ? reinterpret_cast<int64_t>(t->const_data_ptr()) & 15 : 0;
  };
  Append(key, low(o.x) | low(o.w) << 4 | low(o.out) << 8);
  Append(key, odt);
  Append(key, req);
  Append(key, reinterpret_cast<int64_t>(config));
  AppendEnv(key, "MOE_GEMM_L2_HINTS");
  AppendEnv(key, "MOE_GEMM_TAIL_SPLIT");  // heuristics.TAIL_SPLIT_ENV
}

// Whether a and b's allocations meet (the same storage, or storages over the same memory).
// Coarser than aliasing.py's element spans: a meeting pair declines, and ops.grouped_mm
// decides exactly (computing into a copy where the elements do overlap).
bool MayShareMemory(const at::Tensor& a, const at::Tensor& b) {
  const c10::Storage& sa = a.storage();
  const c10::Storage& sb = b.storage();
  if (sa.unsafeGetStorageImpl() == sb.unsafeGetStorageImpl()) return true;
  const auto pa = reinterpret_cast<uintptr_t>(sa.data());
  const auto pb = reinterpret_cast<uintptr_t>(sb.data());
  return pa < pb + sb.nbytes() && pb < pa + sa.nbytes();
}

// Launches `e` on operands `o` with output `out`. False with a Python error set, or false
// without one where the TVM-FFI call failed (the Python path then makes the same call and
// raises its error with the whole message).
bool LaunchEntry(const Entry& e, const Operands& o, const at::Tensor& out, PyObject* const* args,
                 PyObject* out_obj) {
  // The Python call: no TVM-FFI handle (CPU tests), the C entry points dropped since the
  // entry was made (init_ffi("")), or tensors not on a CUDA device.
  if (e.handle == nullptr || !FfiReady() || !o.x->is_cuda()) {
    PyObject* tmpl = e.args.get();
    std::vector<PyObject*> argv(kArgs);
    for (Py_ssize_t i = 0; i < kArgs; ++i) argv[i] = PyTuple_GET_ITEM(tmpl, i);
    argv[kX] = args[0];
    argv[kW] = args[1];
    argv[kOut] = out_obj;
    if (!e.batched) argv[kOffs] = args[2];
    PyObject* r = PyObject_Vectorcall(e.kernel.get(), argv.data(), kArgs, nullptr);
    if (r == nullptr) return false;
    Py_DECREF(r);
    return true;
  }
  DLTensorC dl[kTensorArgs];
  std::memcpy(dl, e.fixed, sizeof(dl));
  if (!ToDl(*o.x, &dl[kX]) || !ToDl(*o.w, &dl[kW]) || !ToDl(out, &dl[kOut], true)) {
    return false;
  }
  if (!e.batched && !ToDl(*o.offs, &dl[kOffs])) return false;
  FfiAny argv[kArgs];
  for (Py_ssize_t i = 0; i < kTensorArgs; ++i) {
    argv[i].type_index = kFfiDLTensorPtr;
    argv[i].pad = 0;
    argv[i].v = reinterpret_cast<int64_t>(&dl[i]);
  }
  for (Py_ssize_t i = kTensorArgs; i < kArgs; ++i) {
    argv[i].type_index = kFfiInt;
    argv[i].pad = 0;
    argv[i].v = e.ints[i - kTensorArgs];
  }
  return Call(e.handle, argv, static_cast<int32_t>(kArgs), o.x->device().index(), e.stream);
}

// mm_call(x, w, offs, out, config, out_dtype_index, req) ->
//   the output     launched from an entry
//   False          no entry for this call yet: the caller takes the Python path and, after
//                  its plan launched, calls remember_mm
//   None           declined (grad, capture, dispatch modes, subclasses, switches, an `out`
//                  sharing memory with an operand, a failed launch): the Python path decides
PyObject* CallImpl(PyObject* const* args, int64_t odt, int64_t req) {
  const bool require_cuda = (req & kRequireCuda) != 0;
  Operands o;
  if (!ThreadIsPlain() || !ReadOperands(args, require_cuda, &o)) Py_RETURN_NONE;
  // Inference-only kernels: under grad mode a grad-requiring operand takes the Python path
  // (it links the output so that backward raises); a grad-requiring `out` too.
  if (((o.x->requires_grad() || o.w->requires_grad()) && at::GradMode::is_enabled()) ||
      (o.out && o.out->requires_grad()) || CuteDisabled() || ChecksOffs()) {
    Py_RETURN_NONE;
  }
  const int capturing = Capturing(require_cuda);
  if (capturing < 0) return nullptr;
  if (capturing) Py_RETURN_NONE;  // a capture gets its own workspace (host_sm90._workspace)
  std::string key;
  EntryKey(o, odt, req, args[4], require_cuda, &key);
  auto it = g_entries.find(key);
  if (it == g_entries.end()) Py_RETURN_FALSE;
  const std::shared_ptr<Entry> e = it->second;  // held through the launch
  if (o.out && (MayShareMemory(*o.out, *o.x) || MayShareMemory(*o.out, *o.w) ||
                (o.offs && MayShareMemory(*o.out, *o.offs)))) {
    Py_RETURN_NONE;  // ops.grouped_mm computes into a copy
  }
  at::Tensor fresh;
  PyObject* out_obj;
  if (o.out) {
    out_obj = args[3];
    Py_INCREF(out_obj);
  } else {
    fresh = at::empty(e->out_shape, at::TensorOptions().dtype(e->out_type).device(
                                        o.x->device()));
    out_obj = THPVariable_Wrap(fresh);
    if (out_obj == nullptr) return nullptr;
  }
  const at::Tensor& out = o.out ? *o.out : fresh;
  if (!LaunchEntry(*e, o, out, args, out_obj)) {
    Py_DECREF(out_obj);
    if (PyErr_Occurred()) return nullptr;
    Py_RETURN_NONE;
  }
  ++g_fast_launches;
  if (g_local.get() != nullptr && PyObject_SetAttrString(g_local.get(), "raw", e->raw.get()) < 0) {
    Py_DECREF(out_obj);
    return nullptr;
  }
  return out_obj;
}

PyObject* Call(PyObject*, PyObject* const* args, Py_ssize_t n) {
  int64_t odt, req;
  if (n != 7 || !ParseInt(args[5], &odt) || !ParseInt(args[6], &req)) {
    if (!PyErr_Occurred()) {
      PyErr_SetString(PyExc_TypeError, "mm_call(x, w, offs, out, config, odt, req)");
    }
    return nullptr;
  }
  DECLINE_ON_THROW({ return CallImpl(args, odt, req); })
}

// remember_mm(x, w, offs, out, config, out_dtype_index, req, kernel, handle, args, out_shape,
//             out_type_index, raw, stream) -> made (bool)
// The entry for this call on the current stream and thread, from the plan that just launched
// it: `args` is the kernel's argument tuple with None in the call's slots (x, w, out, and
// offs in the 2-D form); `handle` the compiled function's TVM-FFI handle (0: call `kernel`
// from Python); `stream` the current stream's raw handle.
PyObject* RememberImpl(PyObject* const* args, int64_t odt, int64_t req) {
  const bool require_cuda = (req & kRequireCuda) != 0;
  int64_t handle, out_type, stream;
  PyObject* tmpl = args[9];
  PyObject* shape = args[10];
  if (!ParseInt(args[8], &handle) || !ParseInt(args[11], &out_type) ||
      !ParseInt(args[13], &stream)) {
    return nullptr;
  }
  if (!PyTuple_Check(tmpl) || PyTuple_GET_SIZE(tmpl) != kArgs || !PyTuple_Check(shape) ||
      out_type < 0 || out_type > 2 || !PyTuple_Check(args[12])) {
    PyErr_SetString(PyExc_TypeError, "remember_mm: bad entry");
    return nullptr;
  }
  Operands o;
  if (!ThreadIsPlain() || !ReadOperands(args, require_cuda, &o)) Py_RETURN_FALSE;
  auto e = std::make_shared<Entry>();
  e->kernel = Ref(args[7]);
  e->config = Ref(args[4]);
  e->raw = Ref(args[12]);
  e->args = Ref(tmpl);
  e->handle = FfiReady() ? reinterpret_cast<void*>(handle) : nullptr;
  e->batched = o.offs == nullptr;
  e->stream = stream;
  e->out_type = kTypes[out_type];
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(shape); ++i) {
    int64_t v;
    if (!ParseInt(PyTuple_GET_ITEM(shape, i), &v)) return nullptr;
    e->out_shape.push_back(v);
  }
  e->dims.reserve(kTensorArgs);
  for (Py_ssize_t i = 0; i < kArgs; ++i) {
    PyObject* a = PyTuple_GET_ITEM(tmpl, i);
    const bool call_slot = i == kX || i == kW || i == kOut || (i == kOffs && !e->batched);
    if (i >= kTensorArgs) {
      if (!ParseInt(a, &e->ints[i - kTensorArgs])) return nullptr;
    } else if (call_slot) {
      if (a != Py_None) {
        PyErr_SetString(PyExc_ValueError, "remember_mm: the call's slots must be None");
        return nullptr;
      }
    } else {
      const at::Tensor* t = Plain(a);
      if (t == nullptr) {
        PyErr_SetString(PyExc_TypeError, "remember_mm: a fixed argument is not a tensor");
        return nullptr;
      }
      e->held.push_back(*t);
      const at::Tensor& h = e->held.back();
      e->bytes += static_cast<int64_t>(h.storage().nbytes());
      if (!ToDl(h, &e->fixed[i])) {
        PyErr_SetString(PyExc_TypeError, "remember_mm: a fixed argument's dtype");
        return nullptr;
      }
      // Own copies of its sizes and strides (the DLTensor must not point into a tensor
      // that `held` could move when it grows).
      std::vector<int64_t> d(h.sizes().begin(), h.sizes().end());
      d.insert(d.end(), h.strides().begin(), h.strides().end());
      e->dims.push_back(std::move(d));
      std::vector<int64_t>& v = e->dims.back();
      e->fixed[i].shape = v.data();
      e->fixed[i].strides = v.data() + h.dim();
    }
  }
  std::string key;
  EntryKey(o, odt, req, args[4], require_cuda, &key);
  const int64_t bytes = e->bytes;
  if (g_entries.size() >= kMaxEntries || g_entry_bytes + bytes > kMaxEntryBytes) {
    auto old = std::move(g_entries);  // released after the map is consistent again
    g_entries = {};
    g_entries.emplace(std::move(key), std::move(e));
    g_entry_bytes = bytes;
  } else {
    auto it = g_entries.find(key);
    if (it != g_entries.end()) {
      std::shared_ptr<Entry> old = std::move(it->second);
      g_entry_bytes += bytes - old->bytes;
      it->second = std::move(e);
    } else {
      g_entries.emplace(std::move(key), std::move(e));
      g_entry_bytes += bytes;
    }
  }
  ++g_entries_made;
  Py_RETURN_TRUE;
}

PyObject* Remember(PyObject*, PyObject* const* args, Py_ssize_t n) {
  int64_t odt, req;
  if (n != 14 || !ParseInt(args[5], &odt) || !ParseInt(args[6], &req)) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "remember_mm(...)");
    return nullptr;
  }
  try {
    return RememberImpl(args, odt, req);
  } catch (const std::exception& ex) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, ex.what());
    return nullptr;
  }
}

// mm_stats() -> (entries, entries made so far, launches from entries so far)
PyObject* Stats(PyObject*, PyObject* const*, Py_ssize_t) {
  return Py_BuildValue("(nLL)", static_cast<Py_ssize_t>(g_entries.size()),
                       static_cast<long long>(g_entries_made),
                       static_cast<long long>(g_fast_launches));
}

void Forget() {
  auto old = std::move(g_entries);
  g_entries = {};
  g_entry_bytes = 0;
}

}  // namespace mm
