"""Hand-written CPU kernels, compiled from C++ on first use and cached on disk (as inductor caches its own).

    from infer import kernels
    if kernels.available():
        y = torch.ops.infer.linear(x, weight, scale)     # x [M, K] float32/bf16; weight [N, K] f32/bf16/int8

``infer::rms_norm`` (norm.cpp) is the few-token steps' RMSNorm, and ``infer::rope`` / ``infer::silu_mul``
(pointwise.cpp) their bfloat16 elementwise chains: as opaque ops they make a compiled step bit-identical to the same
step run eagerly (inductor's fused norm sums in another order; its fused bfloat16 chains round once where eager
rounds at every op), with inductor's fast defaults, which lets the engine serve eagerly while graphs compile in the
background (engine.warmup) and gives plain and speculating engines one numerics.

``infer::argmax`` (argmax.cpp) is greedy decoding's and greedy verification's reduction over the vocabulary: ATen's
index-returning reductions are not vectorised on CPU (~130 us a row over SmolLM2's 49,152 logits, ~10 us here).
``infer::rejection_sample`` (sample.cpp) is a sampled verify's acceptance and final draw, row by row (the torch rule
is a dozen passes over the vocabulary).

``infer::eagle3_round`` (eagle_round.cpp) is a lone row's EAGLE-3 draft round in one call: the ops above chained as
C++ functions over pointers (ops.h), for a round that starts cold after every verify
(model.draft_heads.Eagle3Head.native_round); ``infer::draft_lm_round`` (lm_round.cpp) is a draft LM's round the same
way (proposers.draft_model.DraftModelProposer); round.h holds what the two share (the bfloat16 add, the draw).

``infer::linear`` (linear.cpp) is the decode/verify matrix-vector product: it streams the weights at the memory
bandwidth for float32, bfloat16 and int8 (weight-only, one scale per output row) and is batch-invariant: a row's
result does not depend on how many rows share the call. ATen has no kernel that does both on this CPU: its one-row
products run at a third to a half of the bandwidth, and its int8 weight-only kernel slower still
(docs/benchmarks.md, "Where a SmolLM2 decode step goes").

Building needs a C++ compiler (the one torch.compile's CPU backend uses) and ninja (a dependency); the first build takes
~45 s on 2 cores (39-46 s measured with the ten sources), later processes load the cached library in milliseconds. If
the build fails, ``available()`` is False, a warning says why, and every caller falls back to ATen.
``INFER_CPU_KERNELS=0`` turns the kernels off.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import warnings
from contextlib import nullcontext
from pathlib import Path

import torch

from ..cachedir import cache_dir

HERE = Path(__file__).parent
# the longest compiles first (ninja starts them in this order): attention's template instances take the longest
SOURCES = [HERE / "attention.cpp", HERE / "qlinear.cpp", HERE / "linear.cpp", HERE / "registry.cpp",
           HERE / "pointwise.cpp", HERE / "sample.cpp", HERE / "eagle_round.cpp", HERE / "lm_round.cpp",
           HERE / "norm.cpp", HERE / "argmax.cpp"]
CACHE_DIR = cache_dir("kernels")
MAX_ROWS = 16  # few-token steps (decode, verify); larger products (prefill) are compute-bound and go to ATen's GEMM

_loaded: bool | None = None


def _flags() -> list[str]:
    # no FMA contraction: the scalar tails must round the same way in every instantiation (batch invariance)
    flags = ["-O3", "-fopenmp", "-ffp-contract=off"]
    capability = torch.backends.cpu.get_cpu_capability()
    if capability in ("AVX2", "AVX512"):
        flags += ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY_AVX2"]  # the last: ATen's vec headers use AVX2
    if capability == "AVX512" and os.environ.get("INFER_CPU_AVX512", "1") != "0":
        flags += ["-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl"]  # infer::linear's 16-lane tiles
        if "avx512_vnni" in _cpu_flags():
            flags += ["-mavx512vnni"]  # infer::qlinear's integer dot products (vpdpbusd)
    return flags


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())
    except OSError:
        return set()


def build_name() -> str:
    """The build's name: one per source text, flags, torch and Python, so a cache shared by machines or versions
    never mixes them (cost profiles carry it too: spec_decode.profile_store)."""
    key = hashlib.sha256()
    for src in sorted(HERE.glob("*.[ch]*")):
        key.update(src.read_bytes())
    key.update(" ".join(_flags() + [torch.__version__, str(sys.version_info[:2])]).encode())
    return f"infer_kernels_{key.hexdigest()[:12]}"


def toolchain_key(sources: Path = HERE) -> str:
    """What torch writes into a build's build.ninja besides the sources' text and the flags, hashed: where this
    interpreter's torch and Python headers and libraries lie, the sources' directory (absolute paths there) and the
    compiler ($CXX). Two environments (two virtualenvs of one torch, or two checkouts) sharing one cache directory
    would each find the other's build.ninja changed and rebuild every kernel (~45 s on 2 cores) at each switch: a
    build lives in a directory of its own per environment."""
    import sysconfig

    where = [Path(torch.__file__).resolve().parent, sysconfig.get_path("include"), sources.resolve(),
             os.environ.get("CXX", "")]  # sysconfig's call is torch.utils.cpp_extension's own
    return hashlib.sha256("\0".join(map(str, where)).encode()).hexdigest()[:8]


def build_dir() -> Path:
    """This environment's build of the kernels: one per build (``build_name``) and environment (``toolchain_key``)."""
    return CACHE_DIR / f"{build_name()}-{toolchain_key()}"


def _ensure_ninja_on_path() -> None:
    """The `ninja` wheel (a dependency) puts its binary beside the interpreter, which may not be on PATH."""
    try:
        import ninja

        if ninja.BIN_DIR not in os.environ.get("PATH", "").split(os.pathsep):
            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    except ImportError:
        pass  # a system ninja, if any, is found on PATH


def _build() -> None:
    from torch.utils.cpp_extension import load

    from ..cachedir import build_lock

    _ensure_ninja_on_path()
    flags = _flags()
    name, where = build_name(), build_dir()
    with build_lock(where):
        load(name=name, sources=[str(s) for s in SOURCES], extra_cflags=flags, extra_ldflags=["-fopenmp"],
             build_directory=str(where), is_python_module=False, verbose=False)

    @torch.library.register_fake("infer::linear")
    def _(x, weight, scale=None, lens=None):  # what torch.compile traces: [M, K] x [N, K] -> [M, N] in x's dtype
        return x.new_empty(x.shape[0], weight.shape[0])

    @torch.library.register_fake("infer::qlinear")
    def _(x, packed, format, out_features, lens=None, float_out=False):  # [M, K] x GGML blocks packed by 8 rows ->
        # [M, N] in x's dtype (float_out: float32)
        return x.new_empty(x.shape[0], out_features, dtype=torch.float32 if float_out else x.dtype)

    @torch.library.register_fake("infer::rms_norm")
    def _(x, weight, eps, lens=None):  # [M, H] -> [M, H]
        return torch.empty_like(x)

    @torch.library.register_fake("infer::rope")
    def _(x, cos, sin, heads, head_dim, lens=None):  # [M, W] -> [M, heads * head_dim]
        return x.new_empty(x.shape[0], heads * head_dim)

    @torch.library.register_fake("infer::silu_mul")
    def _(x, lens=None):  # [M, 2n] -> [M, n]
        return x.new_empty(x.shape[0], x.shape[1] // 2)

    @torch.library.register_fake("infer::argmax")
    def _(x):  # [..., n] -> [...] int64
        return x.new_empty(x.shape[:-1], dtype=torch.long)

    @torch.library.register_fake("infer::rejection_sample")
    def _(p, drafts, q, nd, u, u_final):  # -> accepted drafts [B], tokens [B, K+1] (accepted, final, -1 padded)
        return drafts.new_empty(drafts.shape[0]), drafts.new_empty(drafts.shape[0], drafts.shape[1] + 1)

    @torch.library.register_fake("infer::attention")
    def _(q, k, v, mask=None, rows=None, lens=None):  # [B, H, T, D], stored as [B, T, H, D]
        B, H, T, D = q.shape
        return q.new_empty(B, T, H, D).transpose(1, 2)


def _intact_build(library: Path) -> bool:
    """Whether a cached build is there and whole. A library truncated by a stopped build (the linker writes in place)
    would fail to load at every start: it is reported in one line naming it, and its build directory removed, so
    the build below starts afresh."""
    from ..cachedir import elf_damage

    if not library.is_file():
        return False
    if (why := elf_damage(library)) is None:
        return True
    warnings.warn(f"infer's CPU kernels: the cached build {library} is damaged ({why}); rebuilding it",
                  RuntimeWarning, stacklevel=3)
    shutil.rmtree(library.parent, ignore_errors=True)
    return False


def available() -> bool:
    """True once the kernels are built and loaded (built on the first call; False, with a warning, if they cannot)."""
    global _loaded
    if _loaded is None:
        if os.environ.get("INFER_CPU_KERNELS", "1") == "0":
            _loaded = False
        else:
            try:
                from .. import progress

                built = _intact_build(build_dir() / f"{build_name()}.so")
                with progress.stage("building infer's CPU kernels (first start only, ~45 s on 2 cores)") if not built \
                        else nullcontext():
                    _build()
                _loaded = True
            except Exception as e:  # no compiler, no ninja, a read-only cache, ...: ATen serves every call
                why = str(e).strip().splitlines()[-1] if str(e).strip() else ""  # the compiler's log is long
                warnings.warn(f"infer's CPU kernels could not be built ({type(e).__name__}: {why}); "
                              "falling back to ATen's (slower) matrix products", RuntimeWarning, stacklevel=2)
                _loaded = False
    return _loaded


def _libgomp():
    """torch's OpenMP runtime (a no-op dlopen: libtorch_cpu links it), or None where it is not libgomp."""
    import ctypes

    try:
        return ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libgomp.so.1"))
    except OSError:
        return None


def release_thread_pool() -> bool:
    """Let the calling thread's OpenMP workers exit (OpenMP 5's omp_pause_resource on the host: libgomp frees this
    thread's pool, and starts a new one should the thread open a parallel region again). True if done.

    Why: libgomp keeps one pool of workers per thread that ran a parallel region, and while it manages more threads
    than there are cores its workers spin only briefly (GOMP_SPINCOUNT's throttled count) before sleeping, so each
    of the next parallel regions waits for a wake-up. A server builds its engine in the main thread (a pool: loading
    and profiling run parallel regions) and steps it in another (a second pool): SmolLM2's lone requests through
    AsyncEngine ran at 82-156 tok/s against 181-365 stepped where it was built, and at 238-408 once the builder's
    pool was released (AMD EPYC Zen 4, 2 cores)."""
    omp = _libgomp()
    if omp is None or not all(hasattr(omp, f) for f in ("omp_pause_resource", "omp_get_initial_device")):
        return False  # an OpenMP runtime before 5.0
    return omp.omp_pause_resource(1, omp.omp_get_initial_device()) == 0  # 1: omp_pause_soft


def one_thread_here() -> bool:
    """Run the calling thread's own parallel regions (torch's and these kernels') with one OpenMP thread, leaving every
    other thread's count and torch's process-wide default as they are. True if done so, False where this torch's
    OpenMP runtime cannot be reached (the caller then uses ``torch.set_num_threads``, which sets the default too).

    Why not ``torch.set_num_threads(1)``: it also stores the process-wide count that each shared library copies into
    a thread the first time that thread enters its ``at::parallel_for`` (ATen's inline once-per-thread init keeps one
    flag per library). These kernels' first call in the engine thread then cut the engine to one thread: SmolLM2 ran
    at ~0.75x for good after a background warm-up. So torch and the kernels initialise this thread first, and the
    count is then set for this thread only through OpenMP's (and MKL's) C entry points."""
    import ctypes

    lib = Path(torch.__file__).parent / "lib"
    omp = _libgomp()
    set_omp = getattr(omp, "omp_set_num_threads", None)
    if set_omp is None:
        return False
    torch.get_num_threads()  # libtorch's init of this thread
    if _loaded:
        torch.ops.infer.linear(torch.zeros(1, 1), torch.zeros(1, 1))  # the kernels' own init of this thread
    set_omp(1)
    try:  # MKL's GEMMs keep their own per-thread count (torch.set_num_threads sets it as well). The C entry point
        # by value: the lower-case name is the Fortran one, which takes a pointer.
        ctypes.CDLL(str(lib / "libtorch_cpu.so")).MKL_Set_Num_Threads_Local(1)
    except (OSError, AttributeError):
        pass  # a build without MKL
    return torch.get_num_threads() == 1
