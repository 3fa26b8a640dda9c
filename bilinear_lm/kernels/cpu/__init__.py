"""The C++ CPU kernels, compiled on first use with ``torch.utils.cpp_extension`` into one module:

* ``scan_forward`` / ``scan_backward`` (``scan.cpp``): the CP rank-space scan, the signatures of
  ``bilinear_lm.modeling.scan`` plus the overflow guard's range; ``cp_step``: one decoding step of the CP state
  (``bilinear_lm.modeling.recurrence.reference_step``);
* ``small_batch_linear`` (``linear.cpp``): a GEMV for the few rows of a decoding step;
* ``swiglu_forward`` / ``swiglu_backward`` and ``rms_norm_forward`` / ``rms_norm_backward`` (``fused.cpp``): the
  MLP's SwiGLU and the blocks' RMSNorm, each one pass with one output (``bilinear_lm.modeling.dispatch``).

:func:`load` builds them once per machine (a one-line message on stderr while it compiles, under a minute)
and returns the module, or ``None`` where it cannot be built (no compiler) or ``BILINEAR_LM_NO_CPP=1`` disables it;
the model then runs the PyTorch scan and ``F.linear``. The build cache key covers the sources, this CPU's flags
(``-march=native``), the compiler, ninja, torch and Python, so two toolchains never rebuild each other's copy.
``TORCH_EXTENSIONS_DIR`` says where it lives.
"""

import hashlib
import logging
import os
import subprocess
import sys
import threading
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCES = sorted(Path(__file__).parent.glob("*.cpp"))
DISABLE_ENV = "BILINEAR_LM_NO_CPP"

_lock = threading.Lock()
_module = None
_failed = False


def _version(command: list[str]) -> str:
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "none"


def build_name() -> str:
    """``bilinear_cpu_kernels_<hash>``: the cache key of the build (see the module docstring)."""
    try:
        flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    except OSError:
        flags = ""
    compiler = os.environ.get("CXX", "c++")
    key = "\n".join([*(source.read_text() for source in SOURCES), flags, _version([compiler, "--version"]), _version(["ninja", "--version"]),
                     torch.__version__, sys.version])
    return f"bilinear_cpu_kernels_{hashlib.sha1(key.encode()).hexdigest()[:12]}"


def loaded():
    """The compiled kernels module if :func:`load` has built it in this process, else ``None`` (never builds)."""
    return _module


def load():
    """The compiled kernels module, built once per process (and cached on disk), or ``None`` (see the module
    docstring)."""
    global _module, _failed
    if _module is not None or _failed:
        return _module
    with _lock:
        if _module is None and not _failed:
            if os.environ.get(DISABLE_ENV) == "1":
                _failed = True
                return None
            try:
                from torch.utils.cpp_extension import _get_build_directory, load as load_extension

                name = build_name()
                if not (Path(_get_build_directory(name, False)) / f"{name}.so").exists():
                    print(f"bilinear-lm: compiling the C++ CPU kernels (once per machine, under a minute; "
                          f"{DISABLE_ENV}=1 skips it)", file=sys.stderr, flush=True)
                _module = load_extension(
                    name=name, sources=[str(source) for source in SOURCES],
                    extra_cflags=["-O3", "-march=native", "-fopenmp"],
                    extra_ldflags=["-fopenmp"], verbose=os.environ.get("BILINEAR_LM_VERBOSE_BUILD") == "1")
            except Exception as error:  # no compiler or headers: fall back, say so once
                _failed = True
                logger.warning("bilinear-lm: C++ CPU kernels unavailable (%s); using the PyTorch scan", error)
    return _module
