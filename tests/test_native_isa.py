"""Which instruction set the native kernels are built for (``cacheblend.native``: AVX-512 or
AVX2 with FMA, from what PyTorch reports for the CPU), and that the sources still compile for
the one this machine does not run, so a change tested on one kind of CPU cannot break the
other's build unseen."""

from __future__ import annotations

import shutil
import subprocess
import sysconfig

import pytest
import torch
from torch.utils import cpp_extension

from cacheblend import native

has_compiler = pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler")


@pytest.mark.parametrize(("capability", "isa"), [("AVX512", "AVX512"), ("AVX512_VNNI", "AVX512"), ("AVX2", "AVX2"),
                                                   ("DEFAULT", None), ("ZVECTOR", None)])
def test_the_kernels_follow_the_cpu_pytorch_reports(monkeypatch, capability, isa):
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    assert native.isa() == isa
    if isa is None:
        assert native.unavailable_reason() == \
            f"the CPU has neither AVX-512 nor AVX2 (PyTorch reports {capability})"
    else:
        assert f"-DCPU_CAPABILITY_{isa}" in native.flags()


@has_compiler
def test_a_cpu_with_avx2_only_gets_the_kernels(monkeypatch):
    """Before, the kernels were AVX-512 only: an AVX2 CPU (most AMD Zen 2/3 and Intel client
    parts) ran PyTorch's attention and layer ops, 8 % slower blends and 21 % slower decode steps
    (benchmarks/native_attention.py on a 2-core EPYC without AVX-512)."""
    pytest.importorskip("ninja")
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    assert native.unavailable_reason() is None


def test_each_instruction_set_builds_in_its_own_folder(monkeypatch):
    """A cache home shared by an AVX-512 host and an AVX2 host must not hand one the other's module."""
    folders = set()
    for capability in ("AVX512", "AVX2"):
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda c=capability: c)
        folders.add(native.build_dir())
    assert len(folders) == 2


def test_an_unknown_instruction_set_is_refused():
    with pytest.raises(ValueError, match="no kernel build for 'SVE256'"):
        native.flags("SVE256")


@has_compiler
def test_the_sources_compile_for_the_instruction_set_this_cpu_does_not_run(tmp_path):
    """Compile only (the machine cannot run the other ISA's code; -O0: checking, not running):
    every kernel source, with the flags a build for the other ISA would use, side by side."""
    other = "AVX2" if native.isa() == "AVX512" else "AVX512"
    includes = [f"-I{p}" for p in [*cpp_extension.include_paths(), sysconfig.get_paths()["include"]]]
    sources = [s for s in native.SOURCES if s.suffix == ".cpp"]
    compiles = [subprocess.Popen(["c++", "-std=c++17", "-fPIC", "-w", "-c", str(source),
                                  "-o", str(tmp_path / f"{source.stem}.o"), *includes, f"-I{source.parent}",
                                  *native.flags(other), "-O0", "-DTORCH_EXTENSION_NAME=cacheblend_native"],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for source in sources]
    for source, compile_ in zip(sources, compiles, strict=True):
        _, err = compile_.communicate(timeout=600)
        assert compile_.returncode == 0, f"{source.name} for {other}:\n{err[-3000:]}"
