// Small host-to-device uploads without torch: a pinned ring per stream and the CUDA driver's
// asynchronous copy (general_call.cc includes this; kernels/native.py builds them together).
//
// Why: new operand addresses for a known problem set need G * 64 bytes of metadata rows on the
// GPU before the launch. Through torch (a pinned at::empty, then copy_) that is ~8.5 us per
// call on an H200 host: the caching host allocator's lock and event bookkeeping, TensorIterator,
// the device guard. The driver's copy from memory pinned once costs ~1-2 us.
//
// Safety: a copy reads its pinned bytes when it runs on the stream, which can be long after
// the call returns (the host runs ahead of the GPU). The ring is cut into chunks; leaving a
// chunk records an event on the stream after the chunk's last copy, and a chunk is written
// again only once that event has completed. A GPU more than a lap behind makes Reserve decline
// (the caller then copies through torch, which is always safe). Everything runs under the GIL.
//
// The driver is the libcuda.so.1 torch has already loaded (dlopen with RTLD_NOLOAD): a process
// without it, or any driver error, leaves uploads to torch. Tests can install fakes
// (InstallFakes) to run the ring logic on the CPU.

#pragma once

#include <dlfcn.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

namespace upload {

constexpr int kSuccess = 0;        // CUDA_SUCCESS
constexpr int kNotReady = 600;     // CUDA_ERROR_NOT_READY
constexpr unsigned kPortable = 1;  // CU_MEMHOSTALLOC_PORTABLE: pinned for every context
constexpr unsigned kNoTiming = 2;  // CU_EVENT_DISABLE_TIMING: the cheapest event to record
constexpr int kChunks = 8;
// 64 KiB chunks: one upload of up to 1024 problems fits; 8 of them (512 KiB pinned per stream)
// hold ~1000 uploads of 8 problems before the ring needs the GPU to have caught up.
constexpr int64_t kDefaultChunkBytes = int64_t{64} << 10;
constexpr size_t kMaxRings = 16;  // streams (per context) with a ring; others use torch
constexpr int64_t kRowAlign = 64;

// The driver entry points used (CUDA driver API signatures, opaque handles as void*).
struct Driver {
  int (*ctx_get_current)(void** ctx) = nullptr;
  int (*ctx_get_device)(int* device) = nullptr;
  int (*stream_get_ctx)(void* stream, void** ctx) = nullptr;
  int (*mem_host_alloc)(void** p, size_t bytes, unsigned flags) = nullptr;
  int (*event_create)(void** event, unsigned flags) = nullptr;
  int (*event_record)(void* event, void* stream) = nullptr;
  int (*event_query)(void* event) = nullptr;
  int (*memcpy_htod_async)(uint64_t dst, const void* src, size_t bytes, void* stream) = nullptr;
  bool fake = false;  // host memory is malloc'd (and freed with the ring)
};

// Test fakes: a copy is a memcpy to a host address, run at once or, while g_fake_defer, queued
// until FlushFakes (a GPU behind the host: the source is read when the copy runs). Events
// complete once no copy is queued, unless g_fake_not_ready; copies fail while g_fake_fail.
inline bool g_fake_not_ready = false;
inline bool g_fake_fail = false;
inline bool g_fake_defer = false;

struct QueuedCopy {
  uint64_t dst;
  const void* src;
  size_t bytes;
};
inline std::vector<QueuedCopy>& FakeQueue() {
  static auto& queue = *new std::vector<QueuedCopy>();
  return queue;
}
inline void FlushFakes() {
  for (const QueuedCopy& c : FakeQueue()) {
    std::memcpy(reinterpret_cast<void*>(c.dst), c.src, c.bytes);
  }
  FakeQueue().clear();
}

inline int FakeCtx(void** ctx) {
  *ctx = reinterpret_cast<void*>(1);
  return kSuccess;
}
inline int FakeDevice(int* device) {
  *device = 0;
  return kSuccess;
}
inline int FakeStreamCtx(void*, void** ctx) { return FakeCtx(ctx); }
inline int FakeHostAlloc(void** p, size_t bytes, unsigned) {
  *p = std::malloc(bytes);
  return *p != nullptr ? kSuccess : 2;  // CUDA_ERROR_OUT_OF_MEMORY
}
inline int FakeEventCreate(void** event, unsigned) {
  *event = reinterpret_cast<void*>(1);
  return kSuccess;
}
inline int FakeEventRecord(void*, void*) { return kSuccess; }
inline int FakeEventQuery(void*) {
  return g_fake_not_ready || !FakeQueue().empty() ? kNotReady : kSuccess;
}
inline int FakeCopy(uint64_t dst, const void* src, size_t bytes, void*) {
  if (g_fake_fail) return 1;  // CUDA_ERROR_INVALID_VALUE
  FakeQueue().push_back({dst, src, bytes});
  if (!g_fake_defer) FlushFakes();
  return kSuccess;
}

inline Driver& TheDriver() {
  static Driver d;
  return d;
}
inline int& DriverState() {  // 0 unresolved, 1 usable, -1 not available
  static int state = 0;
  return state;
}

// The driver, or nullptr where this process has none loaded (or lacks an entry point).
inline const Driver* Cuda() {
  int& state = DriverState();
  if (state == 0) {
    state = -1;
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    if (lib == nullptr) return nullptr;
    Driver d;
    auto sym = [&](auto* fn, const char* name) {
      *fn = reinterpret_cast<std::remove_reference_t<decltype(*fn)>>(dlsym(lib, name));
      return *fn != nullptr;
    };
    if (sym(&d.ctx_get_current, "cuCtxGetCurrent") && sym(&d.ctx_get_device, "cuCtxGetDevice") &&
        sym(&d.stream_get_ctx, "cuStreamGetCtx") && sym(&d.mem_host_alloc, "cuMemHostAlloc") &&
        sym(&d.event_create, "cuEventCreate") && sym(&d.event_record, "cuEventRecord") &&
        sym(&d.event_query, "cuEventQuery") &&
        sym(&d.memcpy_htod_async, "cuMemcpyHtoDAsync_v2")) {
      TheDriver() = d;
      state = 1;
    }
  }
  return state == 1 ? &TheDriver() : nullptr;
}

// One stream's pinned ring (in one context).
class Ring {
 public:
  Ring(const Driver& d, void* stream, int64_t chunk_bytes)
      : d_(d), stream_(stream), chunk_(chunk_bytes) {
    void* ctx = nullptr;
    if (d_.ctx_get_current(&ctx) != kSuccess || d_.ctx_get_device(&device_) != kSuccess) return;
    if (stream != nullptr) {  // a stream of another context cannot be ordered with this one
      void* sctx = nullptr;
      if (d_.stream_get_ctx(stream, &sctx) != kSuccess || sctx != ctx) return;
    }
    void* host = nullptr;
    if (d_.mem_host_alloc(&host, static_cast<size_t>(kChunks * chunk_), kPortable) != kSuccess) {
      return;
    }
    host_ = static_cast<char*>(host);  // kept for the process: freeing pinned memory syncs
    for (void*& e : events_) {
      if (d_.event_create(&e, kNoTiming) != kSuccess) return;
    }
    ok_ = true;
  }
  ~Ring() {
    if (d_.fake) std::free(host_);
  }
  Ring(const Ring&) = delete;
  Ring& operator=(const Ring&) = delete;

  bool usable(int device) const { return ok_ && device == device_; }
  bool fake() const { return d_.fake; }

  // `bytes` of pinned memory that no pending copy reads, or nullptr: too big, the GPU more
  // than a lap behind, or the ring broken by a driver error.
  char* Reserve(int64_t bytes) {
    if (!ok_ || bytes > chunk_) return nullptr;
    if (used_ + bytes > chunk_) {
      const int next = (cur_ + 1) % kChunks;
      if (fenced_[next]) {
        const int q = d_.event_query(events_[next]);
        if (q == kNotReady) return nullptr;
        if (q != kSuccess) return Break();
        fenced_[next] = false;
      }
      if (d_.event_record(events_[cur_], stream_) != kSuccess) return Break();
      fenced_[cur_] = true;
      cur_ = next;
      used_ = 0;
    }
    return host_ + cur_ * chunk_ + used_;
  }

  // Queues the copy of what Reserve handed out to `dst` on the stream. False: nothing queued
  // (the bytes stay free for the next Reserve).
  bool Send(const char* p, int64_t bytes, uint64_t dst) {
    if (d_.memcpy_htod_async(dst, p, static_cast<size_t>(bytes), stream_) != kSuccess) {
      return false;
    }
    used_ += (bytes + kRowAlign - 1) / kRowAlign * kRowAlign;
    return true;
  }

 private:
  char* Break() {
    ok_ = false;  // a fence is lost: its chunk could still be read, so the ring stops here
    return nullptr;
  }

  const Driver d_;  // by value: the fakes can be swapped in while real rings live
  void* stream_;
  int device_ = -1;
  int64_t chunk_;
  char* host_ = nullptr;
  void* events_[kChunks] = {};
  bool fenced_[kChunks] = {};
  int cur_ = 0;
  int64_t used_ = 0;
  bool ok_ = false;
};

// Rings by (context, stream handle); heap-allocated and never destroyed (see general_call.cc).
inline std::map<std::pair<void*, void*>, std::unique_ptr<Ring>>& Rings() {
  static auto& rings = *new std::map<std::pair<void*, void*>, std::unique_ptr<Ring>>();
  return rings;
}
inline int64_t g_chunk_bytes = kDefaultChunkBytes;  // for rings made from now on (tests)

// The driver for a copy to device memory (`cuda`) or, under the fakes, to host memory; a
// device copy while the fakes are installed is left to torch (a fake memcpy there would crash).
inline const Driver* Active(bool cuda) {
  if (TheDriver().fake) return cuda ? nullptr : &TheDriver();
  return cuda ? Cuda() : nullptr;
}

// The ring of `stream` (a raw CUstream) in the current context, where it can copy to
// `device`'s memory; nullptr: use torch. `cuda`: the destination is device memory.
inline Ring* RingFor(int64_t stream, int device, bool cuda) {
  const Driver* d = Active(cuda);
  if (d == nullptr) return nullptr;
  void* ctx = nullptr;
  if (d->ctx_get_current(&ctx) != kSuccess || ctx == nullptr) return nullptr;
  void* handle = reinterpret_cast<void*>(static_cast<intptr_t>(stream));
  auto& rings = Rings();
  auto it = rings.find({ctx, handle});
  if (it == rings.end()) {
    if (rings.size() >= kMaxRings) return nullptr;
    it = rings.emplace(std::make_pair(ctx, handle),
                       std::make_unique<Ring>(*d, handle, g_chunk_bytes)).first;
  }
  return it->second->usable(device) ? it->second.get() : nullptr;
}

// Test hook: fakes on (rings made from now on use them) or off (fake rings dropped; the real
// driver resolved again on next use), and the chunk size for new rings (0: the default).
inline void InstallFakes(bool on, int64_t chunk_bytes) {
  FakeQueue().clear();  // their sources may be in the rings dropped below
  auto& rings = Rings();
  for (auto it = rings.begin(); it != rings.end();) {
    it = it->second->fake() ? rings.erase(it) : std::next(it);
  }
  g_fake_not_ready = g_fake_fail = g_fake_defer = false;
  g_chunk_bytes = chunk_bytes > 0 ? chunk_bytes : kDefaultChunkBytes;
  if (on) {
    Driver f;
    f.ctx_get_current = FakeCtx;
    f.ctx_get_device = FakeDevice;
    f.stream_get_ctx = FakeStreamCtx;
    f.mem_host_alloc = FakeHostAlloc;
    f.event_create = FakeEventCreate;
    f.event_record = FakeEventRecord;
    f.event_query = FakeEventQuery;
    f.memcpy_htod_async = FakeCopy;
    f.fake = true;
    TheDriver() = f;
  } else if (TheDriver().fake) {
    TheDriver() = Driver();
    DriverState() = 0;
  }
}

}  // namespace upload
