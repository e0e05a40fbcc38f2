"""The native CPU kernels build wherever a C++ compiler is present: a kernel that fails to build is a failure
here, not a skip of the kernel tests (which skip, as the ops fall back to XLA, only where there is no
compiler or the kernels are turned off)."""

import os
import platform

import pytest

from jaxhybrid.ops import native

SOURCES = [native.SOURCE, native.KDA_SOURCE, native.MLA_SOURCE]


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.name)
def test_each_kernel_builds_with_the_compiler_present(source, tmp_path, monkeypatch):
    cxx = native._compiler()
    if cxx is None or os.environ.get("JAXHYBRID_NATIVE", "1") == "0":
        pytest.skip("no C++ compiler here, or the native kernels are turned off")
    if source == native.SOURCE and platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("the product kernels are x86 (AVX2 / AVX-512 intrinsics)")
    monkeypatch.setenv("JAXHYBRID_KERNEL_DIR", str(tmp_path))  # a fresh build, not one cached earlier
    library = native._build(source, cxx)  # raises with the compiler's message where it fails
    assert library.exists() and library.parent == tmp_path
