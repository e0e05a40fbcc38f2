"""The native CPU kernels build wherever a C++ compiler is present: a kernel that fails to build is a failure
here, not a skip of the kernel tests (which skip, as the ops fall back to XLA, only where there is no
compiler or the kernels are turned off)."""

import platform

import pytest

from jaxhybrid.ops import native

SOURCES = [native.SOURCE, native.KDA_SOURCE, native.MLA_SOURCE]


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.name)
def test_each_kernel_builds_with_the_compiler_present(source, tmp_path, monkeypatch):
    cxx = native._compiler()
    if cxx is None or native.turned_off():
        pytest.skip("no C++ compiler here, or the native kernels are turned off")
    if source == native.SOURCE and platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("the product kernels are x86 (AVX2 / AVX-512 intrinsics)")
    monkeypatch.setenv("JAXHYBRID_KERNEL_DIR", str(tmp_path))  # a fresh build, not one cached earlier
    library = native._build(source, cxx)  # raises with the compiler's message where it fails
    assert library.exists() and library.parent == tmp_path


def test_the_kernels_build_in_the_background_once_each(tmp_path, monkeypatch):
    """`build_in_background` (what `serve` and `generate` start before loading the model) compiles each
    kernel library once, all at once; a trace that asks for a library meanwhile waits for that build and
    gets its file, rather than compiling it a second time. The compiler is a stand-in here that takes 0.3 s
    and writes the library file."""
    import subprocess
    import threading
    import time

    if native._compiler() is None or native.turned_off():
        pytest.skip("no C++ compiler here, or the native kernels are turned off")
    monkeypatch.setenv("JAXHYBRID_KERNEL_DIR", str(tmp_path))
    compiled, lock = [], threading.Lock()

    def compiler(cmd, **kwargs):
        time.sleep(0.3)
        out = cmd[cmd.index("-o") + 1]
        with open(out, "wb"):
            pass
        with lock:
            compiled.append(cmd[-3])  # the source
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(native.subprocess, "run", compiler)
    started = time.monotonic()
    futures = native.build_in_background()
    assert len(futures) == 3 and time.monotonic() - started < 0.3  # nothing waited for here
    asked = native._build(native.KDA_SOURCE, native._compiler())  # a trace meanwhile
    for f in futures:
        f.result(timeout=30)
    assert sorted(compiled) == sorted(str(s) for s in SOURCES)  # once each
    assert asked.exists() and asked.parent == tmp_path
    assert len(list(tmp_path.glob("*.so"))) == 3
