"""The C++ CPU kernels, compiled on first use with ``torch.utils.cpp_extension`` into one module:

* ``scan_forward`` / ``scan_backward`` (``bilinear_scan.cpp``): the CP rank-space scan, the signatures of
  ``bilinear_lm.modeling.bilinear_scan`` plus the overflow guard's range; ``cp_step``: one decoding step of the CP state
  (``bilinear_lm.modeling.bilinear_reference.reference_step``);
* ``delta_rule_step`` (``delta_rule.cpp``): one decoding step of the memory heads' state
  (``bilinear_lm.modeling.delta_rule_reference.delta_rule_step``);
* ``small_batch_linear`` (``linear.cpp``): a GEMV for the few rows of a decoding step;
* ``swiglu_forward`` / ``swiglu_backward`` and ``rms_norm_forward`` / ``rms_norm_backward`` (``fused.cpp``): the
  MLP's SwiGLU and the blocks' RMSNorm, each one pass with one output (``bilinear_lm.modeling.dispatch``).

:func:`load` builds them once per machine (a one-line message on stderr while it compiles, under a minute)
and returns the module, or ``None`` where it cannot be built (no compiler) or ``BILINEAR_LM_NO_CPP=1`` disables it;
the model then runs the PyTorch scan and ``F.linear``. The build cache key covers the sources, this CPU's flags
(``-march=native``), the compiler, ninja, torch and Python, so two toolchains never rebuild each other's copy.
``TORCH_EXTENSIONS_DIR`` says where it lives. One process builds at a time, under an OS lock that the kernel
releases when its holder dies; the lock file torch before 2.14 leaves behind when a compile is interrupted (it would
make every later run wait forever) is removed, with a one-line message.
"""

import hashlib
import logging
import os
import subprocess
import sys
import threading
import time
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


def _remove_stale_torch_lock(build_directory: Path) -> None:
    """Delete torch's ``lock`` file in ``build_directory``, called while holding the project's build lock, so no
    live build owns it. torch before 2.14 waits for as long as that file exists (``FileBaton``,
    pytorch/pytorch#189245), and a build killed mid-way (Ctrl-C, a kill, out of memory) leaves it: every later run
    would hang. Said on one line where that torch would have waited; torch 2.14 keeps the file as an OS lock, which
    never goes stale."""
    lock = build_directory / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return
    lock.unlink(missing_ok=True)
    from torch.utils import cpp_extension

    if hasattr(cpp_extension, "FileBaton"):
        print(f"bilinear-lm: removed a stale build lock {lock} ({age:.0f} s old: a compile of the kernels "
              "was interrupted there)", file=sys.stderr, flush=True)


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
                import fcntl

                from torch.utils import cpp_extension

                name = build_name()
                build_directory = Path(cpp_extension._get_build_directory(name, False))
                # One build at a time under an OS lock of our own: the kernel releases it when its holder dies, so
                # it never goes stale; whoever holds it is the only process building here.
                with open(build_directory / "bilinear-lm.lock", "w") as build_lock:
                    fcntl.flock(build_lock, fcntl.LOCK_EX)
                    _remove_stale_torch_lock(build_directory)
                    if not (build_directory / f"{name}.so").exists():
                        print(f"bilinear-lm: compiling the C++ CPU kernels (once per machine, under a minute; "
                              f"{DISABLE_ENV}=1 skips it)", file=sys.stderr, flush=True)
                    _module = cpp_extension.load(
                        name=name, sources=[str(source) for source in SOURCES],
                        extra_cflags=["-O3", "-march=native", "-fopenmp"],
                        extra_ldflags=["-fopenmp"], verbose=os.environ.get("BILINEAR_LM_VERBOSE_BUILD") == "1")
            except Exception as error:  # no compiler or headers: fall back, say so once
                _failed = True
                logger.warning("bilinear-lm: C++ CPU kernels unavailable (%s); using the PyTorch scan", error)
    return _module
