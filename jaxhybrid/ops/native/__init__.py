"""CPU kernels that XLA:CPU does not emit, built from source on first use and called as XLA FFI custom calls.

- `matvec.cc`: products of a few rows with int8 or float32 weights. XLA:CPU runs a product with int8 (or
  bf16) weights at under 1 GB/s (a loop without vectors), and a convert-then-multiply-then-sum formulation
  reads int8 at the speed of float32 (measured in `git show 9bb8ba5:BENCHMARKS.md`, "Weight-only int8");
  the kernel reads each weight byte once at full speed. Float32 matrices of a few MB XLA:CPU multiplies
  on one thread, and an expert picked out of a stack it copies first (ibid., "Float32 decode products").
  With AVX-512, an int8 matrix's rows of a prompt go through a blocked matrix product over the codes in place,
  where XLA:CPU would first write the matrix out in float32, and so do a prompt's (token, expert) pairs
  against float32 experts, which XLA:CPU copies out of their stack (ibid., "int8 prefill").
- `mla_decode.cc`: MLA attention of one new token over the paged latent pool
  (`jaxhybrid.ops.mla.mla_attention_paged`), reading the latents in place through the block table where
  XLA:CPU gathers them into a copy, transposes it and runs a dozen small products.
- `kda_decode.cc`: one KDA step (`jaxhybrid.ops.kda.kda_decode`), which XLA:CPU runs as a dozen passes over
  the recurrent state; the kernel reads and writes each state once. Its pool variants write a step's states
  and conv windows over the old ones in the engine's pools, in place (`kda_decode_into_pool`,
  `jaxhybrid.ops.conv.causal_conv1d_into_pool`), where XLA:CPU copies a pool that one program both reads
  and writes. Its many-token variant runs a verify step's few tokens per row and keeps every state
  (`kda_decode_states`), where XLA:CPU runs a loop of a dozen ops a token; and the states it accepts are
  set into their slots in place (`jaxhybrid.ops.stacks.set_rows`).

Each shared library is compiled with the machine's C++ compiler (`$CXX`, else g++, else c++) and
`-march=native`, once per source, compiler and CPU, into the user's cache directory (or
`$JAXHYBRID_KERNEL_DIR`); compiling takes a few seconds. `JAXHYBRID_NATIVE_MARCH` names another target
(`x86-64-v3`: AVX2 and FMA without AVX-512), so that one machine can run the kernels' other branches.
Where that fails (no compiler, no AVX2), the op says why once and takes its XLA formulation, which gives the
same numbers. `JAXHYBRID_NATIVE=0` turns every kernel off.
"""

from __future__ import annotations

import collections
import concurrent.futures
import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("matvec.cc")
TARGET = "jaxhybrid_matvec_int8"
F32_TARGET = "jaxhybrid_matvec_f32"
KDA_SOURCE = Path(__file__).with_name("kda_decode.cc")
KDA_TARGET = "jaxhybrid_kda_decode"
KDA_POOL_TARGET = "jaxhybrid_kda_decode_pool"
KDA_STATES_TARGET = "jaxhybrid_kda_states"
SET_ROWS_TARGET = "jaxhybrid_set_rows_pool"
CONV_POOL_TARGET = "jaxhybrid_conv_decode_pool"
MLA_SOURCE = Path(__file__).with_name("mla_decode.cc")
MLA_TARGET = "jaxhybrid_mla_decode"


def _cache_dir() -> Path:
    if os.environ.get("JAXHYBRID_KERNEL_DIR"):
        return Path(os.environ["JAXHYBRID_KERNEL_DIR"])
    import platformdirs

    return Path(platformdirs.user_cache_dir("jaxhybrid")) / "kernels"


def cpu_flags() -> str:
    """The host CPU's feature flags (what `-march=native` and XLA:CPU compile for)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def turned_off() -> bool:
    """Whether `JAXHYBRID_NATIVE=0` turns every kernel off."""
    return os.environ.get("JAXHYBRID_NATIVE", "1") == "0"


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if name and shutil.which(name):
            return name
    return None


_BUILDING: dict[Path, threading.Lock] = collections.defaultdict(threading.Lock)


def _build(path: Path, cxx: str) -> Path:
    """The library of `path`, compiled unless the cache directory has it. One thread builds a source at a
    time (another waits, then finds it built)."""
    with _BUILDING[path]:
        return _build_unlocked(path, cxx)


def _build_unlocked(path: Path, cxx: str) -> Path:
    import jax.ffi

    source = path.read_bytes() + b"".join(h.read_bytes() for h in sorted(path.parent.glob("*.h")))
    march = os.environ.get("JAXHYBRID_NATIVE_MARCH", "native")
    key = hashlib.sha256(
        source + cxx.encode() + cpu_flags().encode() + jax.__version__.encode() + march.encode()
    ).hexdigest()
    out = _cache_dir() / f"{path.stem}-{key[:16]}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        lib = Path(tmp) / out.name
        cmd = [cxx, "-O3", f"-march={march}", "-std=c++17", "-shared", "-fPIC", "-w"]
        cmd += [f"-I{jax.ffi.include_dir()}", str(path), "-o", str(lib)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd[:2])} ... failed: {done.stderr.strip()[-500:]}")
        os.replace(lib, out)  # atomic: a concurrent builder finds a whole library or none
    return out


def _library(path: Path, fallback: str) -> ctypes.CDLL | None:
    """The kernel library built from `path`; None (with one log line saying why, and that `fallback` is
    used instead) where it cannot be built or native kernels are turned off."""
    if turned_off():
        return None
    cxx = _compiler()
    if cxx is None:
        log.warning("no C++ compiler: %s (slower on the CPU)", fallback)
        return None
    try:
        return ctypes.cdll.LoadLibrary(str(_build(path, cxx)))
    except (OSError, RuntimeError) as exc:
        log.warning("the kernel %s did not build (%s); %s", path.name, exc, fallback)
        return None


def _register(lib: ctypes.CDLL, target: str) -> str:
    """Register the library's handler `target` (its symbol has the target's name) with JAX for the CPU."""
    import jax

    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, target)), platform="cpu")
    return target


@functools.cache
def _matvec_library() -> ctypes.CDLL | None:
    """The products' library (None, with one log line saying why, where it cannot be built or would be no
    faster than XLA)."""
    lib = _library(SOURCE, "decode-sized products use XLA's")
    if lib is not None and lib.jaxhybrid_matvec_isa() == 0:
        log.warning("the product kernels have no AVX2 or AVX-512 here; decode-sized products use XLA's")
        return None
    return lib


@functools.cache
def int8_kernel() -> str | None:
    """The FFI target name of the int8 matrix-vector kernel, registered with JAX for the CPU; None where
    the library is not there."""
    lib = _matvec_library()
    return None if lib is None else _register(lib, TARGET)


@functools.cache
def gemm_rows() -> int:
    """From how many rows in a call the product kernels (int8 and float32) run a blocked matrix product over
    the weights in place (AVX-512; a call of per-row matrices, e.g. a prompt's experts, also needs 8 rows
    per matrix of its stack on average); 0 where they have none (or there is no kernel): then past a
    decode-sized batch `int8` and the experts use XLA's products."""
    lib = _matvec_library()
    return 0 if lib is None else int(lib.jaxhybrid_matvec_gemm_rows())


@functools.cache
def f32_kernel() -> str | None:
    """The FFI target name of the float32 matrix-vector kernel, registered with JAX for the CPU; None where
    the library is not there."""
    lib = _matvec_library()
    return None if lib is None else _register(lib, F32_TARGET)


@functools.cache
def _kda_library() -> ctypes.CDLL | None:
    return _library(KDA_SOURCE, "KDA decode steps use XLA's formulation")


@functools.cache
def kda_decode_kernel() -> str | None:
    """The FFI target name of the one-token KDA kernel, registered with JAX for the CPU; None (with one log
    line saying why) where it cannot be built."""
    lib = _kda_library()
    return None if lib is None else _register(lib, KDA_TARGET)


@functools.cache
def kda_states_kernel() -> str | None:
    """The FFI target name of the kernel that runs a few tokens per row and keeps the state after each,
    registered with JAX for the CPU; None where the library is not there."""
    lib = _kda_library()
    return None if lib is None else _register(lib, KDA_STATES_TARGET)


@functools.cache
def set_rows_kernel() -> str | None:
    """The FFI target name of the kernel that sets rows of a float32 pool in place, registered with JAX for
    the CPU; None where the library is not there."""
    lib = _kda_library()
    return None if lib is None else _register(lib, SET_ROWS_TARGET)


@functools.cache
def kda_pool_kernels() -> tuple[str, str] | None:
    """The FFI target names of the KDA step and of its short convolution that write their rows' new states
    and windows into a pool in place, registered with JAX for the CPU; None where the library is not there."""
    lib = _kda_library()
    return None if lib is None else (_register(lib, KDA_POOL_TARGET), _register(lib, CONV_POOL_TARGET))


@functools.cache
def mla_decode_kernel() -> str | None:
    """The FFI target name of the one-token paged MLA kernel, registered with JAX for the CPU; None (with
    one log line saying why) where it cannot be built."""
    lib = _library(MLA_SOURCE, "MLA decode steps use XLA's formulation")
    return None if lib is None else _register(lib, MLA_TARGET)


def register_all() -> None:
    """Register every kernel that builds here (each is built once): a compiled program read from the compile
    cache calls its kernels by name, and their handlers must be registered before it is loaded."""
    for kernel in (int8_kernel, f32_kernel, kda_decode_kernel, kda_states_kernel, set_rows_kernel):
        kernel()
    kda_pool_kernels()
    mla_decode_kernel()


def build_in_background() -> list[concurrent.futures.Future]:
    """Start compiling every kernel library this host lacks, all at once and off the caller's thread (a few
    seconds each, the first time on a machine), so that a command that loads a model meanwhile does not
    wait for them at its first trace. Nothing is started where the kernels are off or no compiler is
    found, and nothing is registered here: the kernels' functions do that when first asked (and find the
    libraries built, or being built: they wait for that build)."""
    cxx = _compiler()
    if turned_off() or cxx is None:
        return []

    def build(path: Path) -> None:
        try:
            _build(path, cxx)
        except (OSError, RuntimeError):
            pass  # the kernel's function tries again when asked, and says why it could not

    pool = concurrent.futures.ThreadPoolExecutor(max_workers=3, thread_name_prefix="jaxhybrid-kernels")
    futures = [pool.submit(build, path) for path in (SOURCE, KDA_SOURCE, MLA_SOURCE)]
    pool.shutdown(wait=False)
    return futures
