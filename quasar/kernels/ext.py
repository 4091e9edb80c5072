"""The `cpu` int8 backend's C++ ops (``csrc/``), built lazily: a fused linear, a whole layer.

For small layers the ~10 ATen ops of Int8Linear's pure-PyTorch path (quantize, GEMM,
epilogue) cost more than the GEMM itself; the fused op does them in one call with the
same IEEE operations in the same order, so its results are bitwise equal (checked once
per process on load; a mismatch disables it).

Build and cache: on the first call to :func:`int8_linear_op` in a process the op is loaded
from ``$QUASAR_CACHE/torch_ext/int8_linear-<digest>/int8_linear.so``, where the digest covers
the source, the compiler flags, the torch build and the Python ABI, so an upgrade builds a
fresh copy. A cache hit only ``dlopen``s the library (no compiler, no
``torch.utils.cpp_extension`` import). On a miss one process builds it with
``torch.utils.cpp_extension.load`` (needs a C++ compiler and ninja; output captured)
in a private temporary directory while holding an exclusive ``flock`` on the digest
directory's ``lock`` file, then moves the library into place with an atomic rename;
processes that start meanwhile wait on the lock and then load the finished library. A
killed builder releases the lock with its process and leaves no partial library behind.

Kernel paths (``csrc/common/cpu_features.h``): ``portable`` (plain C++, any CPU), ``avx2``,
``avx-vnni``, ``avx512-vnni`` and ``amx``. The path is an argument of each op whose result or
speed depends on it (``path``, last; csrc/bindings.cpp), handed down to every kernel the op
calls; "" (what the modules pass) means the process default: the highest path the CPU has,
or the highest at or below ``QUASAR_ISA``, which :func:`_load` passes to the library once.
So the environment only sets the default; :func:`forced_kernel_path` moves it for a block
(a whole model on a lower path), and a test or benchmark can pass ``path=`` to compare paths
call by call in one process. Every path computes the same exact int32 sums, so the int8 GEMMs
give the same bits on all of them; the fused decoder step's float kernels (norms,
attention) have one order on the AVX512 paths and another, shared, on avx2 / avx-vnni /
portable. :func:`kernel_path` names the path that runs ("pytorch" without the op).

Small M: the op computes M <= 16 rows (the speculative verifier's k + 1 tokens) with a
hand-written kernel that reads the weight once, instead of oneDNN's ``_int_mm`` (several
times its M = 1 cost on AVX512-VNNI); the int32s and hence the outputs are the same bits.
Below the AVX512 paths the kernel takes every M: oneDNN's int8 GEMM without VNNI makes its
sums with saturating int16 pairs (wrong), and the kernel is exact on every path.
:func:`small_m_max` reads or sets the threshold (0: always oneDNN), for benchmarks and tests.
On a CPU with AMX-INT8 the same kernel computes steps of 2 or more rows with tile matrix
multiplies (:func:`amx_min_rows`; ``QUASAR_NO_AMX=1`` keeps it off): the same exact int32
sums, so extra rows (drafts, batched sequences) cost little more than the first; and
attention over a bfloat16 KV cache (prompt chunks and verifier steps) uses AMX-BF16 tiles
(:func:`amx_attention_supported`).

W4A8 (issue #34, ``csrc/gemm_w4a8/``): :func:`pack_w4` lays affine 4-bit weights out for
streaming and :func:`w4a8_linear_op` computes ``w4a8_numerics.reference_linear_w4a8`` bit for
bit on every path (portable, AVX2, AVX-VNNI, AVX512-VNNI; amx runs the AVX512-VNNI kernel).
Its kernels pass a self-check of their own on first use; a wrong one disables only its
path's W4A8 op (:func:`w4a8_kernel_path` names the path that runs).

Fallback: with ``QUASAR_NO_EXT=1`` (read whenever a layer packs its weights), without a
compiler or ninja, on a failed build or load, or off POSIX, :func:`int8_linear_op` returns
None and Int8Linear runs its pure-PyTorch path; the reason is logged once at debug level.
A failed compilation is recorded in ``FAILED`` next to the lock and not retried for that
digest (delete the directory to retry), so it costs later processes nothing.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import sys
import sysconfig
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from quasar.errors import QuasarError
from quasar.paths import cache_dir

try:
    import fcntl  # POSIX file locks, for the build
except ImportError:  # not POSIX: the build is refused (see _load_or_build)
    fcntl = None

__all__ = [
    "ENV_DISABLE",
    "ENV_ISA",
    "ENV_NO_AMX",
    "KERNEL_PATHS",
    "cpu_runs",
    "onednn_exact",
    "forced_kernel_path",
    "kernel_path",
    "requested_kernel_path",
    "build_dir",
    "disabled",
    "info",
    "decoder_layer_op",
    "row_argmax_topk_op",
    "refine_head_rows_op",
    "refine_exact_rows_op",
    "int8_linear_op",
    "parallel_threads",
    "pack_tiles",
    "release_pages",
    "small_m_max",
    "small_m_supported",
    "amx_supported",
    "amx_min_rows",
    "prefetch_whole_stream",
    "w4_prefetch_distance",
    "bf16_kv_supported",
    "amx_attention_supported",
    "pack_w4",
    "w4a8_linear_op",
    "w4a8_kernel_path",
]

log = logging.getLogger(__name__)

ENV_DISABLE = "QUASAR_NO_EXT"
ENV_NO_AMX = "QUASAR_NO_AMX"  # keep AMX off (the VNNI kernel for every row count)
ENV_ISA = "QUASAR_ISA"  # the highest kernel path to use (KERNEL_PATHS), e.g. avx2
# The C++ kernel paths, lowest first (csrc/common/cpu_features.h).
KERNEL_PATHS = ("portable", "avx2", "avx-vnni", "avx512-vnni", "amx")
PYTORCH_PATH = "pytorch"  # what kernel_path() says when the op is unavailable
NAME = "int8_linear"
CSRC = Path(__file__).resolve().parent / "csrc"
# One library, laid out as one ISA ladder per op family (each: generic.cpp once, the x86 paths
# beside it, AMX in amx/): common/ (the kernel path, shared scalar and SIMD helpers),
# gemm_w8a8/ (the int8 GEMM and its linear op), gemm_w4a8/ (the W4A8 GEMM and its op), step/
# (the fused step's float kernels), attention/ (attention over a bfloat16 cache), amx/ (the
# AMX GEMM and attention), decoder_layer/ (the fused step's orchestration, linears and
# sparse MLP), head/ (per-row argmax / top-k and the exact and refined heads' logits); bindings.cpp
# registers every op (ops.h). Files are named relative to CSRC, which is the include root.
# The cache digest covers every file listed, names included.
SOURCES = tuple(CSRC / f for f in (
    "bindings.cpp", "common/cpu_features.cpp", "common/library_ops.cpp",
    "gemm_w8a8/generic.cpp", "gemm_w8a8/pack.cpp", "gemm_w8a8/x86_avx2.cpp", "gemm_w8a8/x86_avx512.cpp",
    "gemm_w8a8/linear_op.cpp", "gemm_w4a8/generic.cpp", "gemm_w4a8/x86_avx2.cpp", "gemm_w4a8/x86_avx512.cpp",
    "gemm_w4a8/linear_op.cpp", "step/generic.cpp", "step/x86_avx2.cpp", "step/x86_avx512.cpp",
    "attention/x86_avx512_bf16.cpp", "amx/gemm.cpp", "amx/attention.cpp", "decoder_layer/decoder_layer.cpp",
    "decoder_layer/step_linears.cpp", "decoder_layer/sparse_mlp.cpp", "head/row_select.cpp", "head/refine_rows.cpp"))
HEADERS = tuple(CSRC / f for f in (
    "ops.h", "common/cpu_features.h", "common/activation_quant.h", "common/simd_avx512.h", "common/head_dim.h",
    "gemm_w8a8/int8_gemm.h", "gemm_w8a8/kernels.h", "gemm_w4a8/w4a8_gemm.h", "gemm_w4a8/x86_common.h",
    "step/step_kernels.h", "step/vec8.inc", "attention/attention.h", "decoder_layer/step_linears.h",
    "decoder_layer/sparse_mlp.h", "head/row_topk.h"))
# -ffp-contract=off: a fused multiply-add would round the epilogue differently from the
# PyTorch path. No -march=native: the library may sit in a cache shared by other CPUs,
# and the loops it would speed up are a small part of the call. -fopenmp: at::parallel_for
# is a header template whose OpenMP pragma is compiled here; without the flag every
# "parallel" loop of these ops ran on one thread (one core's memory bandwidth).
CFLAGS = ("-O3", "-ffp-contract=off", "-fopenmp")
LDFLAGS = ("-fopenmp",)

_lock = threading.Lock()
_op: Callable[..., torch.Tensor] | None = None
_info: dict[str, Any] = {}  # empty until the first load attempt
_w4_state: dict[str, Any] = {}  # empty until the W4A8 self-check ran (see _w4_check)


def disabled() -> bool:
    """True when ``QUASAR_NO_EXT`` is set to anything but "" or "0"."""
    return os.environ.get(ENV_DISABLE, "").strip() not in ("", "0")


def int8_linear_op() -> Callable[..., torch.Tensor] | None:
    """``torch.ops.quasar_quant.int8_linear``, loading or building it on the first call;
    None when disabled or unavailable (then use the pure-PyTorch path)."""
    if disabled():
        return None
    if not _info:
        _load()
    return _op


def requested_kernel_path() -> str | None:
    """The path ``QUASAR_ISA`` asks for (None when unset); a QuasarError names the choices."""
    value = os.environ.get(ENV_ISA, "").strip().lower()
    if not value:
        return None
    aliases = {"avx512": "avx512-vnni", "avx512vnni": "avx512-vnni", "avxvnni": "avx-vnni", "scalar": "portable"}
    value = aliases.get(value, value)
    if value not in KERNEL_PATHS:
        raise QuasarError(f"{ENV_ISA} must be one of {', '.join(KERNEL_PATHS)}; got {os.environ[ENV_ISA]!r}")
    return value


def kernel_path() -> str:
    """The kernel path the int8 ops run now: one of KERNEL_PATHS ("amx" only while AMX is on,
    see :func:`amx_min_rows`), or "pytorch" when the op is unavailable."""
    if int8_linear_op() is None:
        return PYTORCH_PATH
    path = str(torch.ops.quasar_quant.kernel_path())
    return "avx512-vnni" if path == "amx" and amx_min_rows() == 0 else path


def cpu_runs(path: str) -> bool:
    """Whether this CPU can run kernel path ``path`` (False without the op, except "pytorch")."""
    if path == PYTORCH_PATH:
        return True
    if path not in KERNEL_PATHS:
        raise ValueError(f"unknown kernel path {path!r}")
    return int8_linear_op() is not None and bool(torch.ops.quasar_quant.cpu_runs_path(path))


@contextlib.contextmanager
def forced_kernel_path(path: str) -> Iterator[str]:
    """Make ``path`` (the highest path at or below it this CPU runs) the ops' default inside
    the block, for tests and benchmarks; yields the path that runs. Models set up inside (their
    KV cache dtype, their fused-step plan) belong to it: build them inside the block. One op
    call on another path needs no block: pass it ``path=``."""
    if path not in KERNEL_PATHS:
        raise ValueError(f"unknown kernel path {path!r}")
    if int8_linear_op() is None:
        raise RuntimeError("the int8 C++ op is unavailable")
    before = str(torch.ops.quasar_quant.kernel_path())
    try:
        yield str(torch.ops.quasar_quant.kernel_path(path))
    finally:
        torch.ops.quasar_quant.kernel_path(before)


def onednn_exact(value: bool | None = None) -> bool:
    """Whether the op may hand rows past its small-M limit to oneDNN on the AVX512 paths
    (quasar.runtime.w8a8_backends tells it whether oneDNN's int8 GEMM is exact here; below AVX512 it
    never does); with ``value``, set it first. False without the op."""
    if int8_linear_op() is None:
        return False
    return bool(torch.ops.quasar_quant.int8_onednn_exact(-1 if value is None else int(value)))


def small_m_supported() -> bool:
    """True when the op is loaded: its small-M kernel runs on every kernel path (False without op)."""
    return int8_linear_op() is not None and bool(torch.ops.quasar_quant.int8_small_m_supported())


def small_m_max(value: int | None = None) -> int:
    """The largest M the op sends to its small-M kernel (default 16, 128 where AMX computes them;
    at most 128; 0 disables it); with
    ``value``, set it process-wide and return the previous one. 0 without the op."""
    if int8_linear_op() is None:
        return 0
    return int(torch.ops.quasar_quant.int8_small_m_max(-1 if value is None else max(0, value)))


def amx_supported() -> bool:
    """True when the small-M kernel computes multi-row steps with AMX here (the CPU has
    AMX-INT8 and Linux allows the tile state) and AMX is not turned off
    (``QUASAR_NO_AMX``, ``amx_min_rows(0)``). False without the op."""
    return small_m_supported() and bool(torch.ops.quasar_quant.int8_amx_supported()) and amx_min_rows() > 0


_prefetch_whole: bool | None = None  # the op's setting as last read or set here


def prefetch_whole_stream(value: bool | None = None) -> bool:
    """Whether one-row passes (the AVX2 / AVX-VNNI int8 kernels, every W4A8 kernel) prefetch
    their whole weight stream in software (True, the default) or only each stream's first 64
    KiB, leaving the rest to the hardware prefetcher (False: faster on some CPUs, slower on
    others; ``quasar.runtime.step_cost`` measures which, per model, and the fused step sets its
    model's choice before each call). With
    ``value``, set it process-wide and return the previous one; setting the value it already
    has costs no op call. Speed only: never a bit of the results. False without the op."""
    global _prefetch_whole
    if int8_linear_op() is None:
        return False
    if value is not None and _prefetch_whole is not None and bool(value) == _prefetch_whole:
        return _prefetch_whole
    previous = bool(torch.ops.quasar_quant.int8_stream_prefetch(-1 if value is None else int(bool(value))))
    _prefetch_whole = previous if value is None else bool(value)
    return previous


_w4_prefetch_bytes: int | None = None  # the op's distance as last read or set here


def w4_prefetch_distance(value: int | None = None) -> int:
    """How many bytes ahead the W4A8 kernels' passes prefetch their weights (a multiple of 64
    in [1 KiB, 1 MiB]; 32 KiB by default). The best distance depends on the CPU, so
    ``quasar.runtime.step_cost`` measures it per model and the fused step sets its model's
    before each call. With ``value``, set it process-wide and return the previous one; setting
    the distance it already has costs no op call. A bad value is a RuntimeError naming it.
    Speed only: never a bit of the results. 0 without the op."""
    global _w4_prefetch_bytes
    if int8_linear_op() is None:
        return 0
    if value is not None and value == _w4_prefetch_bytes:
        return _w4_prefetch_bytes
    previous = int(torch.ops.quasar_quant.w4_prefetch_distance(-1 if value is None else int(value)))
    _w4_prefetch_bytes = previous if value is None else int(value)
    return previous


def amx_min_rows(value: int | None = None) -> int:
    """The smallest M the small-M kernel sends to AMX where the CPU has it (0: never; the
    default 2, and 0 when ``QUASAR_NO_AMX`` is set at load); with ``value``, set it
    process-wide and return the previous one. 0 without the op. AMX and VNNI compute the
    same exact int32 sums, so this changes speed, never a bit of the results."""
    if int8_linear_op() is None:
        return 0
    return int(torch.ops.quasar_quant.int8_amx_min_rows(-1 if value is None else max(0, value)))


def pack_tiles(weight: torch.Tensor, release_source: bool = False) -> torch.Tensor | None:
    """``weight`` [N, K] int8 in the small-M kernel's tile layout (int8, 1-D; the same on every
    kernel path), or None without the op. ``release_source``: the weight is handed back to
    the OS as it is copied, 16 MiB at a time (as :func:`release_pages`), so a memory-mapped
    weight is not resident twice while it is packed."""
    if not small_m_supported():
        return None
    return torch.ops.quasar_quant.int8_pack_tiles(weight, release_source)


def release_pages(t: torch.Tensor) -> bool:
    """Hint the OS to reclaim ``t``'s pages (madvise MADV_PAGEOUT; nothing is lost: a mapped
    file's pages are read again if touched). For a weight whose kernel copy is elsewhere."""
    if int8_linear_op() is None:
        return False
    return bool(torch.ops.quasar_quant.release_pages(t))


def parallel_threads() -> int:
    """How many threads the library's parallel loops run on right now (0 without the op):
    torch's intra-op thread count when it was built with OpenMP, 1 when it was not."""
    if int8_linear_op() is None:
        return 0
    return int(torch.ops.quasar_quant.parallel_threads())


def bf16_kv_supported() -> bool:
    """True when the decoder op takes a bfloat16 KV cache here: AVX512-BF16 on the AVX512 kernel
    paths, widened to float32 in software on the lower ones (False without op)."""
    return small_m_supported() and bool(torch.ops.quasar_quant.w8a8_bf16_supported())


MAX_ROW_TOP_K = 64  # the largest k of row_argmax_topk and refine_head_rows (csrc/head/row_topk.h: kMaxTopK)


def row_argmax_topk_op() -> Callable[..., tuple[torch.Tensor, torch.Tensor]] | None:
    """``torch.ops.quasar_quant.row_argmax_topk`` (logits [R, V] float32, k) -> (argmax [R],
    top-k ids [R, k]): torch.argmax's choice per row and the k largest, in one pass;
    None without the op."""
    return torch.ops.quasar_quant.row_argmax_topk if int8_linear_op() is not None else None


def refine_head_rows_op() -> Callable[..., None] | None:
    """``torch.ops.quasar_quant.refine_head_rows`` (logits [R, V] float32, changed in place, qx
    int8 [R, K], sx [R, 1], the int8 head's weight [V, K] and weight_scale [V, 1], top_k <= 64):
    RefinedHead's refinement bit for bit (csrc/head/refine_rows.cpp); None without the op."""
    return torch.ops.quasar_quant.refine_head_rows if int8_linear_op() is not None else None


def refine_exact_rows_op() -> Callable[..., None] | None:
    """``torch.ops.quasar_quant.refine_exact_rows`` (logits [R, V] float32, changed in place,
    x [R, K] float32, weight [V, K] float32, top_k): ExactTopHead's refinement, its float64
    sums in one fixed order (csrc/head/refine_rows.cpp); None without the op."""
    return torch.ops.quasar_quant.refine_exact_rows if int8_linear_op() is not None else None


def amx_attention_supported() -> bool:
    """True when the decoder op attends over a bfloat16 cache (prompt chunks and verifier
    steps) with AMX-BF16 tiles here (False without the op)."""
    return bf16_kv_supported() and bool(torch.ops.quasar_quant.w8a8_amx_attention_supported())


def pack_w4(q: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, group: int) -> torch.Tensor | None:
    """Affine 4-bit weights (q int8 or uint8 [N, K] in [0, 15], float16 scales and offsets
    [N, K / group], w = scale * q + offset; group 32, 64 or 128, K a multiple of it) in the
    W4A8 op's streaming layout (uint8, 1-D; csrc/gemm_w4a8/w4a8_gemm.h), or None without the library.
    A bad shape or value is a RuntimeError naming it."""
    if int8_linear_op() is None:
        return None
    return torch.ops.quasar_quant.w4_pack(q, scales, offsets, group)


def pack_w4_q4k(q: torch.Tensor, scale_codes: torch.Tensor, offset_codes: torch.Tensor, super_scales: torch.Tensor,
                super_offsets: torch.Tensor) -> torch.Tensor | None:
    """4-bit weights with a Q4_K file's own parameters (q [N, K] in [0, 15], K a multiple of
    256; 6-bit codes c and o, uint8 [N, K / 32] in [0, 63]; float16 d and m [N, K / 256]; scale =
    d * c, offset = m * o) in the op's Q4_K form (w4a8_numerics.Q4K_FORM), or None without the
    library."""
    if int8_linear_op() is None:
        return None
    return torch.ops.quasar_quant.w4_pack_q4k(q, scale_codes, offset_codes, super_scales, super_offsets)


def pack_w4_q6k(q: torch.Tensor, sub_scales: torch.Tensor, super_scales: torch.Tensor) -> torch.Tensor | None:
    """A Q6_K file's 6-bit weights as stored (q [N, K] in [0, 63], K a multiple of 256; int8
    scales [N, K / 16]; float16 d [N, K / 256]; w = d * s * (q - 32)) in the op's Q6_K form
    (w4a8_numerics.Q6K_FORM), or None without the library."""
    if int8_linear_op() is None:
        return None
    return torch.ops.quasar_quant.w4_pack_q6k(q, sub_scales, super_scales)


def w4a8_linear_op() -> Callable[..., torch.Tensor] | None:
    """``torch.ops.quasar_quant.w4a8_linear`` (x float [..., K], packed (:func:`pack_w4`), N, K,
    group, bias [N] or None) -> float32 [..., N], bitwise ``w4a8_numerics.reference_linear_w4a8``
    on every kernel path; None without the library or when even its portable kernel failed
    the W4A8 self-check. A path whose W4A8 kernel fails it is disabled alone (the op runs the
    next lower one; the int8 ops keep it): see :func:`w4a8_kernel_path`."""
    if int8_linear_op() is None:
        return None
    if not _w4_state:
        _w4_check()
    return torch.ops.quasar_quant.w4a8_linear if _w4_state.get("ok") else None


def w4a8_kernel_path() -> str:
    """The kernel path the W4A8 op runs now: the active one (:func:`kernel_path`; "amx" is
    served by the avx512-vnni kernel), or the next lower one the self-check left on, or
    "pytorch" without the op."""
    if w4a8_linear_op() is None:
        return PYTORCH_PATH
    return str(torch.ops.quasar_quant.w4a8_kernel_path()) or PYTORCH_PATH


def decoder_layer_op() -> Callable[..., torch.Tensor] | None:
    """``torch.ops.quasar_quant.w8a8_decoder_layers`` when the op is loaded (it runs on every
    kernel path), else None. The packet's C++ function itself: called through the packet, an
    op with a script-object argument walks every argument (over a thousand tensors a step)
    in Python, looking for tracing objects a verifier step never passes."""
    if not small_m_supported():
        return None
    packet = torch.ops.quasar_quant.w8a8_decoder_layers
    return getattr(packet, "_op", packet)


def info() -> dict[str, Any]:
    """How the op was obtained: ``state`` ("cache", "built", "loaded" (already registered
    in this process), "failed" or "not loaded"), ``path``, ``seconds``, on failure ``error``."""
    return dict(_info) if _info else {"state": "not loaded"}


def build_dir() -> Path:
    """The cache directory for this source, flag set, torch build and Python ABI."""
    return cache_dir("torch_ext") / f"{NAME}-{_digest()}"


def _digest() -> str:
    h = hashlib.sha256()
    for part in (
        *(path.relative_to(CSRC).as_posix().encode() + b"\0" + path.read_bytes() for path in (*SOURCES, *HEADERS)),
        " ".join(CFLAGS + LDFLAGS).encode(),
        torch.__version__.encode(),
        str(torch.version.git_version).encode(),
        str(torch.compiled_with_cxx11_abi()).encode(),
        (sysconfig.get_config_var("EXT_SUFFIX") or sys.implementation.cache_tag or "").encode(),
        sysconfig.get_platform().encode(),
    ):
        h.update(part)
        h.update(b"\0")
    return h.hexdigest()[:16]


def _load() -> None:
    global _op
    requested = requested_kernel_path()  # a bad QUASAR_ISA is the user's error, not a fallback
    with _lock:
        if _info:
            return
        start = time.perf_counter()
        path = None
        try:
            path = build_dir() / f"{NAME}.so"
            state = _load_or_build(path)
            op = torch.ops.quasar_quant.int8_linear
            if requested is not None:
                torch.ops.quasar_quant.kernel_path(requested)
            if os.environ.get(ENV_NO_AMX, "").strip() not in ("", "0"):
                torch.ops.quasar_quant.int8_amx_min_rows(0)
            _self_check(op)
            _op = op
            _info.update(state=state, path=str(path))
        except Exception as exc:  # any failure means: use the PyTorch path
            _op = None
            _info.update(state="failed", path=str(path), error=f"{type(exc).__name__}: {exc}")
            log.debug("int8 C++ extension unavailable, using the PyTorch path: %s", _info["error"])
        _info["seconds"] = time.perf_counter() - start


def _registered() -> bool:
    try:
        torch.ops.quasar_quant.int8_linear
    except (AttributeError, RuntimeError):
        return False
    return True


def _load_or_build(so: Path) -> str:
    if _registered():  # already loaded in this process
        return "loaded"
    if so.is_file():
        torch.ops.load_library(str(so))
        return "cache"
    if os.name != "posix" or fcntl is None:
        raise RuntimeError("building the extension needs POSIX file locks")
    so.parent.mkdir(parents=True, exist_ok=True)
    with open(so.parent / "lock", "a") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)  # released on close or process exit
        if so.is_file():  # another process built it while we waited
            torch.ops.load_library(str(so))
            return "cache"
        failed = so.parent / "FAILED"
        if failed.is_file():
            raise RuntimeError(f"an earlier build failed (see {failed}; delete it to retry)")
        for stale in so.parent.glob("build-*"):  # left by a builder that was killed
            shutil.rmtree(stale, ignore_errors=True)
        env_path = _toolchain_path()
        if sys.stderr.isatty():  # the one wait a new machine has before anything else shows
            print("quasar: compiling the int8 kernels (once per machine and version, about a minute)...",
                  file=sys.stderr, flush=True)
        tmp = Path(tempfile.mkdtemp(prefix="build-", dir=so.parent))
        try:
            try:
                _build(tmp, env_path)
            except Exception as exc:
                failed.write_text(f"{type(exc).__name__}: {exc}\n")
                raise
            os.replace(tmp / so.name, so)  # atomic: readers see all of it or nothing
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return "built"


def _toolchain_path() -> str:
    """PATH for the build; raises when there is no C++ compiler or ninja (cheap checks, so
    a machine without a toolchain records no FAILED marker and picks one up later)."""
    path = os.environ.get("PATH", "")
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        raise RuntimeError(f"no C++ compiler ({cxx!r}) on PATH")
    if shutil.which("ninja") is None:
        dirs = [str(Path(sys.executable).parent)]  # a venv's bin, even when not activated
        try:
            import ninja  # lazy: optional (the PyPI wheel ships the binary), only needed to build

            dirs.append(str(ninja.BIN_DIR))
        except Exception:
            pass
        found = [d for d in dirs if shutil.which("ninja", path=d)]
        if not found:
            raise RuntimeError("ninja not found (pip install ninja)")
        path = os.pathsep.join([found[0], path])
    return path


def _build(build_directory: Path, env_path: str) -> None:
    """Compile and load the library in ``build_directory``; output is captured, not shown."""
    from torch.utils import cpp_extension  # lazy: slow to import, only needed on a cache miss

    ext_log = logging.getLogger("torch.utils.cpp_extension")
    level, old_path = ext_log.level, os.environ.get("PATH")
    ext_log.setLevel(logging.CRITICAL)
    os.environ["PATH"] = env_path
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cpp_extension.load(
                name=NAME,
                sources=[str(path) for path in _unit_files(build_directory)],
                extra_include_paths=[str(CSRC)],
                extra_cflags=list(CFLAGS),
                extra_ldflags=list(LDFLAGS),
                build_directory=str(build_directory),
                verbose=False,
                is_python_module=False,
            )
    finally:
        ext_log.setLevel(level)
        if old_path is None:
            os.environ.pop("PATH", None)
        else:
            os.environ["PATH"] = old_path


def _unit_files(build_directory: Path) -> list[Path]:
    """One file per source in ``build_directory`` that includes it, named by its path under
    CSRC ("gemm_w8a8/generic.cpp" -> "gemm_w8a8__generic.cpp"): torch names each object after
    its source's base name, and several folders hold a generic.cpp. Compiler messages still
    name the real file."""
    units = []
    for source in SOURCES:
        unit = build_directory / source.relative_to(CSRC).as_posix().replace("/", "__")
        unit.write_text(f'#include "{source.as_posix()}"\n')
        units.append(unit)
    return units


def _self_check(op: Callable[..., torch.Tensor]) -> None:
    """The op must reproduce the PyTorch path bit for bit (e.g. no FMA contraction)."""
    from quasar.runtime.w8a8_numerics import (  # lazy: runtime sits above kernels; its reference, checked once
        quantize_activation, reference_mm, scale_output)

    gen = torch.Generator().manual_seed(0)
    w = torch.randint(-128, 128, (19, 131), generator=gen, dtype=torch.int8)
    ws = torch.rand((19, 1), generator=gen) / 100
    bias = torch.randn(19, generator=gen)
    comp = w.sum(dim=1, dtype=torch.int32).mul_(128).unsqueeze(0)
    tiles = torch.ops.quasar_quant.int8_pack_tiles(w) if torch.ops.quasar_quant.int8_small_m_supported() else None
    for m in (1, 3, 8, 9):  # the small-M kernel (on VNNI CPUs) and oneDNN
        x = torch.randn(m, 131, generator=gen) * torch.logspace(-3, 3, m)[:, None]
        qx, sx = quantize_activation(x)
        acc = reference_mm(qx, (w,))
        for b in (bias, None):
            want = scale_output(acc, sx, ws, b, torch.float32)
            for u8 in (False, True):
                got = op(x, w, ws, b, comp, u8, u8, tiles)
                if not torch.equal(got, want):
                    raise RuntimeError(f"self-check mismatch (M={m}, bias={b is not None}, u8={u8})")


def _w4_check() -> None:
    """Runs each W4A8 kernel the CPU has on small cases against the reference, once per
    process; a wrong one is disabled (a warning names it) and the op runs the next lower
    path; a wrong portable kernel leaves no W4A8 op. The verdict lands in ``info()["w4a8"]``."""
    with _lock:
        if _w4_state:
            return
        disabled: list[str] = []
        try:
            fallback = "nothing (no W4A8 op)"  # the highest path checked so far that passed
            for path in KERNEL_PATHS[:-1]:  # lowest first; amx runs the avx512-vnni kernel
                if not torch.ops.quasar_quant.cpu_runs_path(path):
                    continue
                problem = _w4_mismatch(path) or _w4_q4k_mismatch(path) or _w4_q6k_mismatch(path)
                if not problem:
                    fallback = path
                    continue
                torch.ops.quasar_quant.w4a8_kernel_path(disable=path)
                disabled.append(path)
                log.warning("W4A8 self-check: the %s kernel is wrong (%s); it is disabled, the W4A8 op "
                            "runs %s instead", path, problem, fallback)
            ok = "portable" not in disabled
            _w4_state.update(ok=ok, disabled=disabled)
        except Exception as exc:  # e.g. a library without the W4A8 ops
            _w4_state.update(ok=False, disabled=disabled, error=f"{type(exc).__name__}: {exc}")
            log.warning("W4A8 op unavailable: %s", _w4_state["error"])
        _info["w4a8"] = dict(_w4_state)


def _w4_mismatch(path: str) -> str:
    """The first case where ``path``'s W4A8 kernel differs from the reference ("" if none):
    padded vectors, every group size, row counts that cut each kernel's row passes, the
    extremes (nibbles 15, activations at +-127), with and without bias."""
    from quasar.runtime.w4a8_numerics import reference_linear_w4a8  # lazy: runtime sits above kernels; checked once

    gen = torch.Generator().manual_seed(34)
    for n, k, group in ((19, 96, 32), (21, 128, 64), (16, 256, 128)):
        q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.int8)
        q[0] = 15
        scales = (torch.rand(n, k // group, generator=gen) / 10).half()
        offsets = (torch.randn(n, k // group, generator=gen) / 10).half()
        bias = torch.randn(n, generator=gen)
        packed = torch.ops.quasar_quant.w4_pack(q, scales, offsets, group)
        for m in (1, 3, 7):
            x = torch.randn(m, k, generator=gen) * torch.logspace(-3, 3, m)[:, None]
            x[0, : k // 2], x[0, k // 2:] = 1.0, -1.0  # q = +-127 against nibbles 15
            for b in (bias, None):
                got = torch.ops.quasar_quant.w4a8_linear(x, packed, n, k, group, b, path)
                if not torch.equal(got, reference_linear_w4a8(x, q, scales, offsets, b, group)):
                    return f"N={n}, K={k}, group={group}, M={m}, bias={b is not None}"
    return ""


def _w4_q4k_mismatch(path: str) -> str:
    """The same for the Q4_K form (superblock codes, the largest code values included)."""
    from quasar.runtime.w4a8_numerics import Q4K_FORM, q4k_group_params, reference_linear_w4a8  # lazy: as above

    gen = torch.Generator().manual_seed(35)
    n, k = 19, 512
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    codes = [torch.randint(0, 64, (n, k // 32), generator=gen, dtype=torch.uint8) for _ in range(2)]
    codes[0][0] = codes[1][1] = 63
    supers = [(torch.randn(n, k // 256, generator=gen) / 100).half() for _ in range(2)]
    packed = torch.ops.quasar_quant.w4_pack_q4k(q, *codes, *supers)
    scales, offsets = q4k_group_params(*codes, *supers)
    for m in (1, 5):
        x = torch.randn(m, k, generator=gen)
        got = torch.ops.quasar_quant.w4a8_linear(x, packed, n, k, Q4K_FORM, None, path)
        if not torch.equal(got, reference_linear_w4a8(x, q, scales, offsets, None, 32)):
            return f"Q4_K form, N={n}, K={k}, M={m}"
    return ""


def _w4_q6k_mismatch(path: str) -> str:
    """The same for the Q6_K form (6-bit values 63 against activations at +-127, int8 scales
    at both ends, sums past 2**24)."""
    from quasar.runtime.w4a8_numerics import Q6K_FORM, reference_linear_q6k  # lazy: as above

    gen = torch.Generator().manual_seed(36)
    n, k = 19, 512
    q = torch.randint(0, 64, (n, k), generator=gen, dtype=torch.uint8)
    q[0] = 63
    sub = torch.randint(-128, 128, (n, k // 16), generator=gen, dtype=torch.int8)
    sub[0] = 127
    d = (torch.rand(n, k // 256, generator=gen) / 100).half()
    packed = torch.ops.quasar_quant.w4_pack_q6k(q, sub, d)
    for m in (1, 5):
        x = torch.randn(m, k, generator=gen)
        x[0] = 1.0  # q = 127 against weights 63: T beyond 2**24
        got = torch.ops.quasar_quant.w4a8_linear(x, packed, n, k, Q6K_FORM, None, path)
        if not torch.equal(got, reference_linear_q6k(x, q, sub, d, None)):
            return f"Q6_K form, N={n}, K={k}, M={m}"
    return ""
