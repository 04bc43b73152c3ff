"""cuBLASLt products with a chosen algorithm, for shapes where cuBLAS's own pick leaves the GPU part idle.

At 256 rows the 8B shape's gate/up product is 224 output tiles of 256 x 128 on 132 multiprocessors: its second
wave is 70% full. cuBLASLt's heuristic lists other algorithms (tiles, split-K, stream-K schedules) for a shape;
`candidates` returns them, `variants` the first of them with other cluster shapes and swizzles (which ran the 8B's
gate/up, down and q/k/v products at 256 rows 2-8% faster than any heuristic candidate on the H200), and
`LtMatmul.run` calls one. The binding goes through ctypes into the libcublasLt that torch itself has loaded, so
nothing is built or downloaded.

Y [M, N] = X [M, K] @ W [N, K].T in row-major is, in cuBLASLt's column-major terms, D [N, M] = op(W) [N, K] @ X^T
with W transposed: the same TN product torch issues.
"""
from __future__ import annotations

import contextlib
import ctypes
import logging
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

_COMPUTE_32F = 68  # cublasComputeType_t CUBLAS_COMPUTE_32F
_R_32F, _R_16F, _R_16BF = 0, 2, 14  # cudaDataType_t
_DESC_TRANSA, _DESC_TRANSB = 3, 4  # cublasLtMatmulDescAttributes_t
_OP_N, _OP_T = 0, 1
_PREF_MAX_WORKSPACE = 1  # cublasLtMatmulPreferenceAttributes_t
_CONFIG = {"id": (0, 4), "tile": (1, 4), "split_k": (2, 4), "reduction": (3, 4), "swizzle": (4, 4), "custom": (5, 4),
           "stages": (6, 4), "inner_shape": (7, 2), "cluster": (8, 2)}  # cublasLtMatmulAlgoConfigAttributes_t, bytes
log = logging.getLogger(__name__)
_DTYPES = {torch.bfloat16: _R_16BF, torch.float16: _R_16F, torch.float32: _R_32F}


class Algo(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class _Heuristic(ctypes.Structure):
    _fields_ = [("algo", Algo), ("workspace", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


class CublasLtError(RuntimeError):
    pass


_lib = None
_handle = None


def library() -> ctypes.CDLL:
    """The libcublasLt torch has loaded (found in this process's mapped libraries after one cuBLAS call)."""
    global _lib, _handle
    if _lib is None:
        a = torch.ones(8, 8, device="cuda", dtype=torch.bfloat16)
        a @ a  # noqa: B018 - loads cuBLAS and cuBLASLt
        torch.cuda.synchronize()
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libcublasLt" in line}
        if not paths:
            raise CublasLtError("libcublasLt is not loaded in this process")
        _lib = ctypes.CDLL(sorted(paths)[0])
        handle = ctypes.c_void_p()
        _check(_lib.cublasLtCreate(ctypes.byref(handle)), "cublasLtCreate")
        _handle = handle
    return _lib


def _check(status: int, what: str) -> None:
    if status != 0:
        raise CublasLtError(f"{what} failed with cublasStatus {status}")


def _layout(dtype: torch.dtype, rows: int, cols: int, ld: int) -> ctypes.c_void_p:
    lay = ctypes.c_void_p()
    _check(library().cublasLtMatrixLayoutCreate(ctypes.byref(lay), _DTYPES[dtype], ctypes.c_uint64(rows),
                                                ctypes.c_uint64(cols), ctypes.c_int64(ld)), "MatrixLayoutCreate")
    return lay


def algo_config(algo: Algo) -> dict:
    """The algorithm's configuration ids (tile, stages, split-K, cluster shape, ...), for reports."""
    out = {}
    for name, (attr, size) in _CONFIG.items():
        value, written = ctypes.c_uint64(0), ctypes.c_size_t(0)
        status = library().cublasLtMatmulAlgoConfigGetAttribute(ctypes.byref(algo), attr, ctypes.byref(value),
                                                                ctypes.c_size_t(size), ctypes.byref(written))
        if status == 0:
            out[name] = value.value
    return out


def configured(base: Algo, **config: int) -> Algo | None:
    """A copy of the algorithm with the given configuration attributes (names as in `algo_config`) set, or None
    where cuBLASLt refuses one. Whether it runs for a shape is `LtMatmul`'s check."""
    algo = Algo()
    ctypes.memmove(ctypes.byref(algo), ctypes.byref(base), ctypes.sizeof(Algo))
    for name, value in config.items():
        attr, size = _CONFIG[name]
        buf = (ctypes.c_uint16 if size == 2 else ctypes.c_uint32)(value)
        if library().cublasLtMatmulAlgoConfigSetAttribute(ctypes.byref(algo), attr, ctypes.byref(buf),
                                                          ctypes.c_size_t(size)):
            return None
    return algo


@dataclass
class LtMatmul:
    """One product shape, Y [m, n] = X [m, k] @ W [n, k].T, its descriptors built once."""
    m: int
    n: int
    k: int
    dtype: torch.dtype = torch.bfloat16
    x_ld: int = 0  # X's row stride (k when contiguous)
    workspace_bytes: int = 32 << 20
    _desc: ctypes.c_void_p = field(default=None, repr=False)
    _layouts: tuple = field(default=(), repr=False)

    def __post_init__(self):
        lib = library()
        self.x_ld = self.x_ld or self.k
        desc = ctypes.c_void_p()
        _check(lib.cublasLtMatmulDescCreate(ctypes.byref(desc), _COMPUTE_32F, _R_32F), "MatmulDescCreate")
        for attr, op in ((_DESC_TRANSA, _OP_T), (_DESC_TRANSB, _OP_N)):
            value = ctypes.c_int32(op)
            _check(lib.cublasLtMatmulDescSetAttribute(desc, attr, ctypes.byref(value), ctypes.c_size_t(4)),
                   "MatmulDescSetAttribute")
        self._desc = desc
        self._layouts = (_layout(self.dtype, self.k, self.n, self.k),  # W as column-major [k, n], transposed
                         _layout(self.dtype, self.k, self.m, self.x_ld),  # X^T [k, m]
                         _layout(self.dtype, self.n, self.m, self.n))  # Y^T [n, m]

    def candidates(self, count: int = 32) -> list[tuple[Algo, int]]:
        """Up to `count` algorithms cuBLASLt's heuristic offers for this shape, best guess first, with the
        workspace each needs."""
        lib = library()
        pref = ctypes.c_void_p()
        _check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "PreferenceCreate")
        ws = ctypes.c_uint64(self.workspace_bytes)
        _check(lib.cublasLtMatmulPreferenceSetAttribute(pref, _PREF_MAX_WORKSPACE, ctypes.byref(ws),
                                                        ctypes.c_size_t(8)), "PreferenceSetAttribute")
        results = (_Heuristic * count)()
        found = ctypes.c_int(0)
        a, b, c = self._layouts
        _check(lib.cublasLtMatmulAlgoGetHeuristic(_handle, self._desc, a, b, c, c, pref, count, results,
                                                  ctypes.byref(found)), "AlgoGetHeuristic")
        lib.cublasLtMatmulPreferenceDestroy(pref)
        return [(results[i].algo, int(results[i].workspace)) for i in range(found.value) if results[i].state == 0]

    def variants(self, algos: list[Algo]) -> list[tuple[Algo, int]]:
        """Each of algos with each cluster shape in CLUSTERS and CTA swizzling off and on, where cuBLASLt's check
        accepts that for this shape within the workspace, with the workspace each needs; configurations equal to
        one of algos left out. The heuristic proposes one cluster shape and swizzle per tile."""
        seen = {tuple(algo_config(a).items()) for a in algos}
        out = []
        for base in algos:
            for cluster in CLUSTERS:
                for swizzle in (0, 1):
                    algo = configured(base, cluster=cluster, swizzle=swizzle)
                    need = self.check(algo)
                    config = None if need is None else tuple(algo_config(algo).items())
                    if config is not None and config not in seen:
                        seen.add(config)
                        out.append((algo, need))
        return out

    def check(self, algo: Algo | None) -> int | None:
        """The workspace bytes the algorithm needs for this shape, or None where there is none, cuBLASLt refuses
        it, or it needs more than the workspace."""
        if algo is None:
            return None
        result = _Heuristic()
        a, b, c = self._layouts
        status = library().cublasLtMatmulAlgoCheck(_handle, self._desc, a, b, c, c, ctypes.byref(algo),
                                                  ctypes.byref(result))
        return int(result.workspace) if status == 0 and result.workspace <= self.workspace_bytes else None

    def run(self, x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, algo: Algo, workspace: torch.Tensor) -> None:
        # x [m, k], w [n, k], y [m, n]
        alpha, beta = ctypes.c_float(1.0), ctypes.c_float(0.0)
        a, b, c = self._layouts
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        _check(library().cublasLtMatmul(_handle, self._desc, ctypes.byref(alpha), ctypes.c_void_p(w.data_ptr()), a,
                                        ctypes.c_void_p(x.data_ptr()), b, ctypes.byref(beta),
                                        ctypes.c_void_p(y.data_ptr()), c, ctypes.c_void_p(y.data_ptr()), c,
                                        ctypes.byref(algo), ctypes.c_void_p(workspace.data_ptr()),
                                        ctypes.c_size_t(workspace.numel()), stream), "cublasLtMatmul")


TUNE_ROWS: int | None = None  # products of at least this many rows take the fastest algorithm timed; None = off
TRIES = 8  # heuristic candidates timed for a shape
VARIED = 3  # the first candidates also timed with each cluster shape in CLUSTERS and swizzle (`LtMatmul.variants`)
CLUSTERS = (2, 5)  # cublasLtClusterShape_t: 1x1x1, 1x2x1
IN_GRAPH = True  # candidates timed inside a CUDA graph, as a captured step runs them (`_seconds`)
MARGIN = 0.97  # a candidate replaces torch's product only when it takes less than this share of its time
_plans: dict[tuple, tuple[LtMatmul, Algo] | None] = {}
_workspaces: dict[tuple, torch.Tensor] = {}
_streams: dict[int, torch.cuda.Stream] = {}  # device -> the stream timing graphs capture on (one cuBLAS workspace)
_tuning = False


@contextlib.contextmanager
def tuning():
    """Inside: a product shape met for the first time is tuned (its candidates timed against torch's). Graph
    captures warm up inside this, so every captured shape has its plan before the capture records it."""
    global _tuning
    before, _tuning = _tuning, True
    try:
        yield
    finally:
        _tuning = before


def forget() -> None:
    """Drops every shape's plan, so the next `tuning` times each shape afresh (under changed settings)."""
    _plans.clear()


ALIGN = 256  # bytes: the heuristic's candidates assume operands at this alignment (its preference's default)


def _key(x: torch.Tensor, weight: torch.Tensor) -> tuple | None:
    """The plan key of x [m, k] @ weight [n, k].T, or None for products never tuned: below TUNE_ROWS, not half
    precision, strided columns, or an operand off ALIGN (a view into another tensor)."""
    if (TUNE_ROWS is None or x.dim() != 2 or x.shape[0] < TUNE_ROWS or x.dtype not in (torch.bfloat16, torch.float16)
            or weight.dtype != x.dtype or x.stride(1) != 1 or not weight.is_contiguous()
            or x.data_ptr() % ALIGN or weight.data_ptr() % ALIGN or x.stride(0) * x.element_size() % 16):
        return None
    return (x.shape[0], weight.shape[0], x.shape[1], x.stride(0), x.dtype, x.device.index)


def product(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """x [m, k] @ weight [n, k].T by the algorithm timed fastest for this shape, or None (the caller runs torch's
    product) where torch's own pick was fastest, the shape is below TUNE_ROWS, or it has no plan and cannot be
    tuned now (outside `tuning`, or inside a graph capture)."""
    key = _key(x, weight)
    if key is None:
        return None
    if key not in _plans:
        if not _tuning or torch.cuda.is_current_stream_capturing():
            return None
        try:
            _plans[key] = _tune(x, weight)
        except CublasLtError as e:  # no usable cuBLASLt here: every shape keeps cuBLAS's pick
            global TUNE_ROWS
            log.warning("cuBLASLt tuning off: %s", e)
            TUNE_ROWS = None
            return None
    plan = _plans[key]
    if plan is None:
        return None
    mm, algo = plan
    y = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)  # [m, n]
    mm.run(x, weight, y, algo, _workspace(x.device, mm.workspace_bytes))
    return y


def _workspace(device: torch.device, size: int) -> torch.Tensor:
    """One workspace per stream: a graph records its pointer, and graphs of two streams may run at once."""
    key = (device.index, torch.cuda.current_stream(device).cuda_stream)
    if key not in _workspaces:
        _workspaces[key] = torch.empty(size, dtype=torch.uint8, device=device)
    return _workspaces[key]


def _seconds(fn, calls: int = 5, reps: int = 3) -> float:
    """Seconds a call of fn takes as a captured step runs it (IN_GRAPH): `calls` calls in a CUDA graph, replayed
    `reps` times after a first replay, the fastest replay's mean. So what cuBLASLt launches beside some algorithms'
    kernels (a memset: session 59's 8B batch-256 graph had 33 a step, ~5.8 us each with the gaps around them on an
    H100) is counted as the engine's graphs pay it. Without IN_GRAPH, `calls` calls launched eagerly."""
    fn()  # allocations and lazy loading outside the capture
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    if not IN_GRAPH:
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / calls
    device = torch.cuda.current_device()
    if device not in _streams:
        _streams[device] = torch.cuda.Stream()
    stream, graph = _streams[device], torch.cuda.CUDAGraph()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        graph.capture_begin(capture_error_mode="thread_local")
        try:
            for _ in range(calls):
                fn()
        finally:
            graph.capture_end()
    torch.cuda.current_stream().wait_stream(stream)
    graph.replay()
    best = float("inf")
    for _ in range(reps):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3 / calls)
    return best


def _tune(x: torch.Tensor, weight: torch.Tensor) -> tuple[LtMatmul, Algo] | None:
    """The fastest candidate (or variant of the first VARIED) for x @ weight.T that agrees with torch's product, if
    it beats it by MARGIN."""
    mm = LtMatmul(x.shape[0], weight.shape[0], x.shape[1], x.dtype, x.stride(0))
    y = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)  # [m, n]
    ws = _workspace(x.device, mm.workspace_bytes)
    want = F.linear(x, weight).float()  # [m, n]
    tolerance = 16 * torch.finfo(x.dtype).eps * want.abs().max().item()
    best, best_s = None, _seconds(lambda: F.linear(x, weight)) * MARGIN
    candidates = [algo for algo, _ in mm.candidates(TRIES)]
    for algo in candidates + [algo for algo, _ in mm.variants(candidates[:VARIED])]:
        try:
            mm.run(x, weight, y, algo, ws)
            if (y.float() - want).abs().max().item() > tolerance:
                continue
            seconds = _seconds(lambda: mm.run(x, weight, y, algo, ws))
        except CublasLtError:
            continue
        if seconds < best_s:
            best, best_s = algo, seconds
    if IN_GRAPH:
        torch.cuda.empty_cache()  # the timing graphs' memory pools (each released with its graph)
    return None if best is None else (mm, best)
