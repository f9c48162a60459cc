"""C sources of the language-model runtime, compiled once per machine and kept on disk.

A source beside this module (`decode_attention.c`, `prefill_attention.c`, `int8_rows.c`,
`layer_ops.c`) is compiled with the system's C compiler (`CC`, else `cc`; `FLAGS`: `-O3
-march=native -fassociative-math -fopenmp`, never `-ffast-math`) the first time a process
asks for it, in about a second,
and kept in `<cache>/kernels/` (`LOCKGATE_CACHE_DIR`, else `~/.cache/lockgate/llm`) under a
name that hashes the source (and the headers beside it: `bf16.h`, `exp.h`), the flags, the
compiler and the CPU, so every later load reuses it. The build writes a temporary file and
renames it into place: a process that loads the library never sees it half written, and concurrent
builds agree. The sources' OpenMP links `libgomp.so.1`; torch's Linux wheels load their own
GNU OpenMP under that name first, so the library runs on torch's runtime, not a second one.

Where a library cannot be had (no compiler, a compiler that fails, a cache that cannot be
written), `load_library` raises `KernelUnavailable` with the reason; each caller decides
whether that is a fallback or a failed load.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from lockgate.llm.loader import default_cache_dir

log = logging.getLogger("lockgate.llm")

# No -ffast-math: linked into a shared library it sets the CPU's flush-to-zero mode for the
# whole process (crtfastmath.o). These allow the reordered float sums that vectorise.
FLAGS = (
    "-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-fno-signed-zeros",
    "-fassociative-math", "-fopenmp", "-shared", "-fPIC",
)  # fmt: skip
BUILD_TIMEOUT_S = 120.0


class KernelUnavailable(RuntimeError):
    """A native library could not be built or loaded here."""


K = TypeVar("K")
MODES = ("auto", "kernel", "sdpa")  # an attention kernel's engine parameter


def chosen_kernel(
    parameter: str,
    mode: str,
    load: Callable[[], K],
    unsupported: Callable[[K], str | None],
    warn: Callable[[str], None],
) -> K | None:
    """An attention kernel as its engine parameter `mode` (`MODES`) chooses it: None for
    `sdpa`; else the kernel `load` builds or finds, when `unsupported` has no reason against
    the model's shapes. Where it cannot be had, `kernel` raises `KernelUnavailable` and
    `auto` gives None after `warn` with the reason."""
    if mode not in MODES:
        raise ValueError(f"{parameter} must be one of {', '.join(MODES)}, not {mode!r}")
    if mode == "sdpa":
        return None
    try:
        kernel = load()
        reason = unsupported(kernel)
        if reason is not None:
            raise KernelUnavailable(reason)
    except KernelUnavailable as exc:
        if mode == "kernel":
            raise
        warn(str(exc))
        return None
    return kernel


def load_library(source: Path) -> tuple[ctypes.CDLL, Path]:
    """`source` built for this machine (from the cache when it is there) and loaded."""
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        raise KernelUnavailable("no C compiler (set CC, or install gcc)")
    try:
        path = library_path(source, compiler)
    except OSError as exc:  # the source is not installed beside the package
        raise KernelUnavailable(f"cannot read {source}: {exc}") from exc
    if not path.exists():
        build(compiler, source, path)
    try:
        return ctypes.CDLL(str(path)), path
    except OSError as exc:
        raise KernelUnavailable(f"cannot load {path}: {exc}") from exc


def library_path(source: Path, compiler: str) -> Path:
    """Where this source, built with these flags by this compiler for this CPU, is kept."""
    digest = hashlib.sha256(source.read_bytes())
    for header in sorted(source.parent.glob("*.h")):  # what the sources include from beside
        digest.update(header.read_bytes())
    digest.update(" ".join(FLAGS).encode())
    digest.update(_compiler_version(compiler).encode())
    digest.update(platform.machine().encode())
    digest.update(_cpu_flags().encode())
    return default_cache_dir() / "kernels" / f"{source.stem}-{digest.hexdigest()[:16]}.so"


def _compiler_version(compiler: str) -> str:
    try:
        done = subprocess.run(
            [compiler, "--version"], capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise KernelUnavailable(f"cannot run {compiler}: {exc}") from exc
    return done.stdout


def _cpu_flags() -> str:
    """The CPU's model and feature flags (-march=native builds for them)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    wanted = ("model name", "flags", "Features", "CPU part")
    lines = [line for line in text.splitlines() if line.split(":")[0].strip() in wanted]
    return "\n".join(sorted(set(lines)))


def build(compiler: str, source: Path, path: Path) -> None:
    """Compile `source` into a temporary file beside `path`, then rename it into place."""
    try:  # a cache directory that cannot be written (a read-only home): the caller's fallback
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, temporary = tempfile.mkstemp(suffix=".so", dir=path.parent)
    except OSError as exc:
        raise KernelUnavailable(f"cannot write the kernel to {path.parent}: {exc}") from exc
    os.close(fd)
    command = [compiler, *FLAGS, "-o", temporary, str(source), "-lm"]
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, check=False
        )
        if done.returncode != 0:
            detail = (done.stderr or done.stdout).strip().splitlines()[-3:]
            raise KernelUnavailable(f"{Path(compiler).name} failed: {' / '.join(detail)}")
        os.replace(temporary, path)
        log.info("native: %s built at %s", source.name, path)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise KernelUnavailable(f"cannot build {source.name}: {exc}") from exc
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)
