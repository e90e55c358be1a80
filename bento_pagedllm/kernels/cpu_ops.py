"""Builds and loads the CPU's native fused operators (cpu_ops.cpp) once per machine.

torch's C++ extension builder compiles the source on first use with the system's C++ compiler and
ninja (15 to 25 s on 2 cores), caching the library under `TORCH_EXTENSIONS_DIR` (default
~/.cache/torch_extensions), one directory per source version, for later processes. Where no compiler is
found or the build fails, `load()` returns False with a warning and the engine keeps the pure-torch
operators: slower, never wrong.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil

import torch

logger = logging.getLogger(__name__)

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu_ops.cpp")
# NOTE: -ffp-contract=off keeps products rounded apart from sums, as torch's eager operators do
# -fno-math-errno and -fno-trapping-math change no result; they let the compiler vectorise the loops
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math"]


def _staged_source() -> tuple[str, str]:
    """The source copied into a build directory named by its content, flags and torch version.

    NOTE: ninja rebuilds when a compile command changes, and the command names the source's path; the
    same source imported from two places (a checkout, an installed wheel, a bento) would otherwise make
    each process rebuild the other's library (~20 s of both cores, in the middle of serving or a test).
    """
    from torch.utils.cpp_extension import get_default_build_root

    with open(SOURCE, "rb") as f:
        text = f.read()
    key = hashlib.sha256(b"\0".join([text, " ".join(FLAGS).encode(), torch.__version__.encode()])).hexdigest()[:16]
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()
    build_dir = os.path.join(root, f"pagedllm_cpu_ops_{key}")
    os.makedirs(build_dir, exist_ok=True)
    staged = os.path.join(build_dir, "cpu_ops.cpp")
    if not os.path.exists(staged):  # NOTE: written once, atomically: concurrent processes see all or nothing
        temporary = f"{staged}.{os.getpid()}.tmp"
        with open(temporary, "wb") as f:
            f.write(text)
        os.replace(temporary, staged)
    return staged, build_dir


@functools.cache
def load() -> bool:
    """Registers `torch.ops.pagedllm_cpu.*`; True when the operators are available."""
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        logger.warning("no C++ compiler: the CPU path uses the (slower) pure-torch operators")
        return False
    if shutil.which("ninja") is None:
        try:  # the `ninja` wheel (a dependency) puts the binary beside the interpreter, not always on PATH
            import ninja

            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
        except ImportError:
            pass
    try:
        from torch.utils.cpp_extension import load as build

        source, build_dir = _staged_source()
        build(name="pagedllm_cpu_ops", sources=[source], extra_cflags=FLAGS, build_directory=build_dir,
              is_python_module=False, verbose=False)
    except Exception as error:  # noqa: BLE001 - any build failure falls back to the torch operators
        logger.warning("could not build the native CPU operators (%s): using the pure-torch ones", error)
        return False
    return hasattr(torch.ops.pagedllm_cpu, "decode_attention")
