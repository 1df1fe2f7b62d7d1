"""Device: what one compiled-kernel call costs on the host, piece by piece (grouped_mm, E=8).

Compares the kernel's Python call (tvm_ffi.Function.__call__: argument conversion, env stream,
the generated host function, the CUDA launch) with the same function called through the
TVM-FFI C API (TVMFFIFunctionCall via ctypes, DLTensor arguments made once), and with torch's
own small launches, to see how much of a call's host time a C++ launch path could remove.
"""

from __future__ import annotations

import ctypes
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402


def per_call(fn, n=2000):
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    best = []
    for _ in range(5):
        t = time.perf_counter()
        for i in range(n // 5):
            fn()
            if i % 16 == 15:
                torch.cuda.synchronize()
        best.append((time.perf_counter() - t) / (n // 5) * 1e6)
    return sorted(best)[len(best) // 2]


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class Any(ctypes.Structure):
    _fields_ = [("type_index", ctypes.c_int32), ("pad", ctypes.c_uint32), ("v", ctypes.c_int64)]


_CODES = {torch.bfloat16: (4, 16), torch.float16: (2, 16), torch.float32: (2, 32),
          torch.int32: (0, 32), torch.int64: (0, 64)}


def dltensor(t, keep):
    shape = (ctypes.c_int64 * t.dim())(*t.shape)
    strides = (ctypes.c_int64 * t.dim())(*t.stride())
    keep += [shape, strides, t]
    code, bits = _CODES[t.dtype]
    dev = DLDevice(2, t.device.index or 0)
    return DLTensor(t.data_ptr(), dev, t.dim(), DLDataType(code, bits, 1), shape, strides, 0)


def main() -> None:
    import tvm_ffi
    from tvm_ffi import libinfo

    from moe_gemm import grouped_mm, ops
    from moe_gemm.kernels import host_sm90

    dev, dt = "cuda", torch.bfloat16
    x = torch.randn(64, 512, device=dev, dtype=dt)
    w = torch.randn(8, 512, 512, device=dev, dtype=dt)
    offs = torch.tensor([1, 8, 19, 27, 37, 48, 58, 64], dtype=torch.int32, device=dev)
    grouped_mm(x, w, offs)
    plan = ops._mm_plans[ops._mm_plan_key(x, w, offs, None, None, None)]
    out = torch.empty(64, 512, device=dev, dtype=dt)
    ws = host_sm90._kernel_workspace(x.device, plan.num_ctas, plan.choice)
    tensors = (x, w, out, plan.meta, plan.meta32, offs, plan.no_table, ws, plan.no_trace)
    ints = (plan.num_problems, plan.num_ctas, plan.choice.swizzle, 0, 0, 0, 0)
    kernel = plan.kernel
    args = (*tensors, *ints)
    print(f"grouped_mm E=8 call:             {per_call(lambda: grouped_mm(x, w, offs)):6.2f} us")
    print(f"kernel(*args):                   {per_call(lambda: kernel(*args)):6.2f} us")
    # The compiled function wraps a tvm_ffi.Function (kwargs wrapper, pointer-argument check).
    inner = getattr(kernel, "_tvm_ffi_function", None) or kernel
    assert isinstance(inner, tvm_ffi.Function), type(inner)
    print(f"inner tvm_ffi.Function(*args):   {per_call(lambda: inner(*args)):6.2f} us")
    lib = ctypes.CDLL(libinfo.find_libtvm_ffi())
    lib.TVMFFIFunctionCall.argtypes = [ctypes.c_void_p, ctypes.POINTER(Any), ctypes.c_int32,
                                       ctypes.POINTER(Any)]
    lib.TVMFFIEnvSetStream.argtypes = [ctypes.c_int32, ctypes.c_int32, ctypes.c_void_p,
                                       ctypes.c_void_p]
    keep: list = []
    dls = [dltensor(t, keep) for t in tensors]
    arr = (Any * len(args))()
    for i, d in enumerate(dls):
        arr[i].type_index = 7  # kTVMFFIDLTensorPtr
        arr[i].v = ctypes.addressof(d)
    for j, v in enumerate(ints):
        arr[len(dls) + j].type_index = 1  # kTVMFFIInt
        arr[len(dls) + j].v = v
    result = Any()
    handle = inner.__chandle__()
    stream = torch.cuda.current_stream().cuda_stream
    fcall, setstream = lib.TVMFFIFunctionCall, lib.TVMFFIEnvSetStream

    def direct():
        setstream(2, 0, stream, None)
        result.type_index = 0
        rc = fcall(handle, arr, len(args), ctypes.byref(result))
        if rc:
            raise RuntimeError(f"TVMFFIFunctionCall returned {rc}")

    direct()
    torch.cuda.synchronize()
    ref = out.clone()
    out.fill_(float("nan"))
    direct()
    torch.cuda.synchronize()
    print(f"direct result equals kernel():   {bool(torch.equal(out, ref))}")
    print(f"TVMFFIFunctionCall via ctypes:   {per_call(direct):6.2f} us")
    nop = ctypes.CDLL(None).getpid
    print(f"  (a ctypes call alone:          {per_call(nop):6.2f} us)")
    # For reference, the driver's TMA descriptor encoder (the DSL's host function does not
    # call it: it packs its descriptors inline; AGENTS.md). One encode, through ctypes:
    cu = ctypes.CDLL("libcuda.so.1")
    enc = cu.cuTensorMapEncodeTiled
    u64, u32 = ctypes.c_uint64, ctypes.c_uint32
    enc.argtypes = [ctypes.c_void_p, ctypes.c_int, u32, ctypes.c_void_p,
                    ctypes.POINTER(u64), ctypes.POINTER(u64), ctypes.POINTER(u32),
                    ctypes.POINTER(u32), ctypes.c_int, ctypes.c_int, ctypes.c_int,
                    ctypes.c_int]
    tmap = (ctypes.c_uint8 * 128)()
    gdim = (u64 * 2)(512, 64)
    gstride = (u64 * 1)(512 * 2)
    box = (u32 * 2)(64, 64)
    estr = (u32 * 2)(1, 1)
    # CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 = 9, no interleave, 128B swizzle = 3, L2 256B = 3
    encode = lambda: enc(tmap, 9, 2, x.data_ptr(), gdim, gstride, box, estr, 0, 3, 3, 0)  # noqa: E731
    assert encode() == 0
    print(f"cuTensorMapEncodeTiled (ctypes): {per_call(encode):6.2f} us")
    sleep0 = lambda: torch.cuda._sleep(1)  # noqa: E731
    print(f"torch.cuda._sleep(1) launch:     {per_call(sleep0):6.2f} us")
    print(f"torch.empty(64, 512) cuda:       "
          f"{per_call(lambda: torch.empty(64, 512, device=dev, dtype=dt)):6.2f} us")
    print(f"torch.mm 64x512x512:             {per_call(lambda: torch.mm(x, w[0])):6.2f} us")


if __name__ == "__main__":
    main()
