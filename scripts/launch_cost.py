"""Device: what one compiled-kernel call costs on the host, piece by piece (grouped_mm, E=8).

Compares the kernel's Python call (tvm_ffi.Function.__call__: argument conversion, env stream,
the generated host function, the CUDA launch) with the same function called through the
TVM-FFI C API (TVMFFIFunctionCall via ctypes, DLTensor arguments made once), with a bare
cuLaunchKernelEx of the same kernel (its parameter block read back from a captured graph node),
that graph's replay, an empty DSL kernel, and torch's own small launches: how much of a call's
host time each launch path costs. Host time only: the clock stops around each synchronize.
"""

import ctypes
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402


def cpu_per_call(fn, n=2000):
    """Host time of one call, synchronizing every 16 calls OUTSIDE the timed region (a call
    faster than its kernel would otherwise be timed at the GPU's pace)."""
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    best = []
    for _ in range(5):
        total = 0.0
        for _ in range(n // 80):
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(16):
                fn()
            total += time.perf_counter() - t
        best.append(total / (n // 80 * 16) * 1e6)
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

    from moe_gemm import grouped_mm
    from moe_gemm.ops import api as ops
    from moe_gemm.ops import launch as host_sm90

    dev, dt = "cuda", torch.bfloat16
    x = torch.randn(64, 512, device=dev, dtype=dt)
    w = torch.randn(8, 512, 512, device=dev, dtype=dt)
    offs = torch.tensor([1, 8, 19, 27, 37, 48, 58, 64], dtype=torch.int32, device=dev)
    grouped_mm(x, w, offs)
    plan = ops.cached_mm_plan(x, w, offs)
    out = torch.empty(64, 512, device=dev, dtype=dt)
    ws = host_sm90._kernel_workspace(x.device, plan.num_ctas, plan.choice)
    tensors = (x, w, out, plan.meta, plan.meta32, offs, plan.no_table, ws, plan.no_trace)
    ints = (plan.num_problems, plan.num_ctas, plan.choice.swizzle, 0, 0, 0, 0)
    kernel = plan.kernel
    args = (*tensors, *ints)
    print(f"grouped_mm E=8 call:             {cpu_per_call(lambda: grouped_mm(x, w, offs)):6.2f} us")
    print(f"kernel(*args):                   {cpu_per_call(lambda: kernel(*args)):6.2f} us")
    # The compiled function wraps a tvm_ffi.Function (kwargs wrapper, pointer-argument check).
    inner = getattr(kernel, "_tvm_ffi_function", None) or kernel
    assert isinstance(inner, tvm_ffi.Function), type(inner)
    print(f"inner tvm_ffi.Function(*args):   {cpu_per_call(lambda: inner(*args)):6.2f} us")
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

    def direct(on=stream):
        setstream(2, 0, on, None)
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
    print(f"TVMFFIFunctionCall via ctypes:   {cpu_per_call(direct):6.2f} us")
    nop = ctypes.CDLL(None).getpid
    print(f"  (a ctypes call alone:          {cpu_per_call(nop):6.2f} us)")
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
    print(f"cuTensorMapEncodeTiled (ctypes): {cpu_per_call(encode):6.2f} us")
    sleep0 = lambda: torch.cuda._sleep(1)  # noqa: E731
    print(f"torch.cuda._sleep(1) launch:     {cpu_per_call(sleep0):6.2f} us")
    print(f"torch.empty(64, 512) cuda:       "
          f"{cpu_per_call(lambda: torch.empty(64, 512, device=dev, dtype=dt)):6.2f} us")
    print(f"torch.mm 64x512x512:             {cpu_per_call(lambda: torch.mm(x, w[0])):6.2f} us")
    print(f"grouped_mm E=8 call again:       "
          f"{cpu_per_call(lambda: grouped_mm(x, w, offs)):6.2f} us")
    gmm = getattr(torch.nn.functional, "grouped_mm", None) or torch._grouped_mm
    print(f"torch grouped_mm:                {cpu_per_call(lambda: gmm(x, w, offs=offs)):6.2f} us")
    own_launch(direct, out, ref, stream)
    tiny_dsl_call()



# ---------------------------------------------------------------------------------------------
# Our own launch of the same kernel: its parameter block read back from a captured graph node.

class KernelNodeParams(ctypes.Structure):  # CUDA_KERNEL_NODE_PARAMS_v2
    _fields_ = [("func", ctypes.c_void_p), ("grid", ctypes.c_uint * 3),
                ("block", ctypes.c_uint * 3), ("smem", ctypes.c_uint),
                ("params", ctypes.POINTER(ctypes.c_void_p)), ("extra", ctypes.c_void_p),
                ("kern", ctypes.c_void_p), ("ctx", ctypes.c_void_p)]


class LaunchAttr(ctypes.Structure):  # CUlaunchAttribute: id, pad to 8, a 64-byte value union
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_int), ("value", ctypes.c_uint8 * 64)]


class LaunchConfig(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("smem", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(LaunchAttr)),
                ("num_attrs", ctypes.c_uint)]


def own_launch(direct, out, ref, stream_handle) -> None:
    """Capture one DSL call on a side stream, read the kernel node (function, grid, block,
    shared memory, cluster and parameter block), then launch it with cuLaunchKernelEx."""
    cu = ctypes.CDLL("libcuda.so.1")
    vp = ctypes.c_void_p
    side = torch.cuda.Stream()
    s = vp(side.cuda_stream)

    def check(rc: int, what: str) -> None:
        if rc:
            raise RuntimeError(f"{what}: CUresult {rc}")

    torch.cuda.synchronize()
    check(cu.cuStreamBeginCapture_v2(s, 2), "cuStreamBeginCapture_v2")  # relaxed
    t = time.perf_counter()
    direct(side.cuda_stream)
    graph = vp()
    check(cu.cuStreamEndCapture(s, ctypes.byref(graph)), "cuStreamEndCapture")
    n = ctypes.c_size_t(0)
    check(cu.cuGraphGetNodes(graph, None, ctypes.byref(n)), "cuGraphGetNodes")
    nodes = (vp * n.value)()
    check(cu.cuGraphGetNodes(graph, nodes, ctypes.byref(n)), "cuGraphGetNodes")
    print(f"captured nodes: {n.value}")
    kp = KernelNodeParams()
    check(cu.cuGraphKernelNodeGetParams_v2(vp(nodes[0]), ctypes.byref(kp)), "GetParams")
    print(f"func={kp.func:#x} kern={kp.kern or 0:#x} grid={tuple(kp.grid)} block={tuple(kp.block)} "
          f"smem={kp.smem} extra={kp.extra}")
    attrs = []
    for aid in (4, 5, 6):  # cluster dimension, cluster scheduling policy, PDL
        v = (ctypes.c_uint8 * 64)()
        rc = cu.cuGraphKernelNodeGetAttribute(vp(nodes[0]), aid, v)
        vals = tuple(ctypes.cast(v, ctypes.POINTER(ctypes.c_uint))[i] for i in range(3))
        print(f"  attribute {aid}: rc={rc} value={vals}")
        if rc == 0 and any(vals):
            a = LaunchAttr()
            a.id = aid
            ctypes.memmove(a.value, v, 64)
            attrs.append(a)
    func = vp(kp.func)
    if not kp.func:  # a library kernel only: its function in the current context
        check(cu.cuKernelGetFunction(ctypes.byref(func), vp(kp.kern)), "cuKernelGetFunction")
    # The parameter block: offsets and sizes from the function, values from the node.
    blocks = []
    i = 0
    while True:
        off, size = ctypes.c_size_t(), ctypes.c_size_t()
        if cu.cuFuncGetParamInfo(func, ctypes.c_size_t(i), ctypes.byref(off), ctypes.byref(size)):
            break
        buf = (ctypes.c_uint8 * size.value)()
        ctypes.memmove(buf, kp.params[i], size.value)
        blocks.append(buf)
        i += 1
    print(f"parameters: {len(blocks)}, {sum(len(b) for b in blocks)} bytes")
    capture_us = (time.perf_counter() - t) * 1e6
    params = (vp * len(blocks))(*[ctypes.addressof(b) for b in blocks])
    attr_arr = (LaunchAttr * max(1, len(attrs)))(*attrs)
    cfg = LaunchConfig()
    cfg.grid[:] = list(kp.grid)
    cfg.block[:] = list(kp.block)
    cfg.smem = kp.smem
    cfg.stream = vp(stream_handle)
    cfg.attrs = attr_arr
    cfg.num_attrs = len(attrs)
    launch_ex = cu.cuLaunchKernelEx
    cfg_ref = ctypes.byref(cfg)

    def ours():
        rc = launch_ex(cfg_ref, func, params, None)
        if rc:
            raise RuntimeError(f"cuLaunchKernelEx: {rc}")

    out.fill_(float("nan"))
    ours()
    torch.cuda.synchronize()
    print(f"own launch result equals kernel(): {bool(torch.equal(out, ref))}")
    print(f"capture + read params (once):      {capture_us:6.2f} us")
    print(f"cuLaunchKernelEx via ctypes:       {cpu_per_call(ours):6.2f} us")
    print(f"TVMFFIFunctionCall via ctypes:     {cpu_per_call(direct):6.2f} us")
    # A graph of the one node, replayed.
    exe = vp()
    check(cu.cuGraphInstantiateWithFlags(ctypes.byref(exe), graph, ctypes.c_ulonglong(0)),
          "instantiate")
    glaunch = cu.cuGraphLaunch
    gl = lambda: glaunch(exe, vp(stream_handle))  # noqa: E731
    out.fill_(float("nan"))
    gl()
    torch.cuda.synchronize()
    print(f"graph replay result equals:        {bool(torch.equal(out, ref))}")
    print(f"cuGraphLaunch via ctypes:          {cpu_per_call(gl):6.2f} us")
    # The same launch with the CUkernel handle, if the node had one.
    if kp.kern:
        kf = vp()
        rc = cu.cuKernelGetFunction(ctypes.byref(kf), vp(kp.kern))
        print(f"cuKernelGetFunction rc={rc} same func: {kf.value == kp.func}")


def tiny_dsl_call() -> None:
    """The DSL's fixed cost: an empty kernel (one tensor, one int) called like ours."""
    import cutlass
    import cutlass.cute as cute
    from cuda.bindings import driver as cuda

    @cute.kernel
    def empty_kernel(t: cute.Tensor, v: cutlass.Int32):
        pass

    @cute.jit
    def empty(t: cute.Tensor, v: cutlass.Int32, stream: cuda.CUstream):
        empty_kernel(t, v).launch(grid=(1, 1, 1), block=(32, 1, 1), stream=stream)

    fake = cute.runtime.make_fake_compact_tensor(cutlass.Int32, (16,))
    fn = cute.compile(empty, fake, cutlass.Int32(1),
                      cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True),
                      options="--enable-tvm-ffi")
    t = torch.zeros(16, dtype=torch.int32, device="cuda")
    print(f"empty DSL kernel call:             {cpu_per_call(lambda: fn(t, 1)):6.2f} us")


if __name__ == "__main__":
    main()
