"""How DynamiQ's CPU kernels (``cpu_kernels.c``) are built and found, without torch: ``setup.py`` loads this
file by path in pip's isolated build environment, where neither torch nor this package is importable.

Two paths, the first preferred:

* **Prebuilt** at install: ``setup.py`` builds one library per x86-64 level (:data:`VARIANTS`: baseline, v2,
  v3 = AVX2, v4 = AVX-512; one, portable, elsewhere) into the package directory, where a wheel and an
  editable install both put them. At run time the baseline library asks the CPU which level it supports
  (``dq_cpu_level``, GCC's and Clang's ``__builtin_cpu_supports``, which also check that the OS saves the
  wide registers) and the highest level built that the CPU runs is loaded: one wheel, no ``-march=native``.
  A library built from other source than the ``cpu_kernels.c`` beside it (an editable install after a
  ``git pull``) says so through ``dq_source_sha256`` and is not used.
* **Compiled at run time**, where no prebuilt library is present (a source checkout on ``PYTHONPATH``, an
  install without a compiler): with ``-march=native`` into a per-user cache, under a file lock so that the
  ranks of a node starting together compile once.

The cache is ``$FEDSHARD_CACHE_DIR``, else ``$XDG_CACHE_HOME/lightning_fedshard``, else
``~/.cache/lightning_fedshard``, created 0700, never the shared temp directory. A directory or library that
another user owns or could write (group/others write bits; for the directory's parents: unless sticky, as
``/tmp``) is refused with :class:`PermissionError`: whoever can write the library runs code in every process
that loads it.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import platform
import stat
import subprocess
import tempfile
from collections.abc import Iterator, Sequence
from importlib.machinery import EXTENSION_SUFFIXES
from pathlib import Path
from typing import NamedTuple

SOURCE = Path(__file__).with_name("cpu_kernels.c")
# -ffp-contract=off: no fused multiply-adds, so every float rounds as the torch reference's does; no trapping
# math and no errno: they change no result and let float-to-int conversion and floor vectorise
FLAGS = ("-O3", "-std=c11", "-ffp-contract=off", "-fno-trapping-math", "-fno-math-errno", "-fno-strict-aliasing")
_X86_64_V2 = ("-mssse3", "-msse4.1", "-msse4.2", "-mpopcnt")
_X86_64_V3 = (*_X86_64_V2, "-mavx", "-mavx2", "-mfma", "-mbmi", "-mbmi2")
_X86_64_V4 = (*_X86_64_V3, "-mavx512f", "-mavx512bw", "-mavx512cd", "-mavx512dq", "-mavx512vl")


class Variant(NamedTuple):
    """A prebuilt library: its module name in the package, its flags beyond :data:`FLAGS`, and the
    ``dq_cpu_level`` a CPU needs to run it."""

    name: str
    flags: tuple[str, ...]
    level: int


BASELINE = Variant("_dynamiq_cpu", (), 0)
# The levels are those of dq_cpu_level in cpu_kernels.c, which checks exactly the features these flags enable.
VARIANTS = (
    BASELINE,
    Variant("_dynamiq_cpu_x86_64_v2", _X86_64_V2, 2),
    Variant("_dynamiq_cpu_x86_64_v3", _X86_64_V3, 3),
    Variant("_dynamiq_cpu_x86_64_v4", (*_X86_64_V4, "-mprefer-vector-width=512"), 4),
)


def is_x86(machine: str) -> bool:
    """Whether ``machine`` (``platform.machine()``, or the tail of ``sysconfig.get_platform()``) is x86."""
    return machine.lower() in ("x86_64", "amd64", "i386", "i686", "x86")


def variants(machine: str) -> tuple[Variant, ...]:
    """The libraries to build for ``machine``: the x86-64 levels on x86, the portable one elsewhere."""
    return VARIANTS if is_x86(machine) else (BASELINE,)


def native_tunings(machine: str) -> tuple[tuple[str, ...], ...]:
    """Run-time compiling's flags for this CPU, best first; the last, portable, where the others fail to build.
    ``-mprefer-vector-width`` exists on x86 only, and ``-march=native`` is spelt ``-mcpu=native`` on Arm and
    POWER."""
    if is_x86(machine):
        return ("-march=native", "-mprefer-vector-width=512"), ("-march=native",), ()
    return ("-mcpu=native",), ()


def source_digest() -> str:
    """The SHA-256 of ``cpu_kernels.c``, built into every library as ``dq_source_sha256()``."""
    return hashlib.sha256(SOURCE.read_bytes()).hexdigest()


def source_macro() -> tuple[str, str]:
    """The ``-D`` definition (name, value) that builds :func:`source_digest` into a library."""
    return "DQ_SOURCE_SHA256", f'"{source_digest()}"'


def _open(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    lib.dq_cpu_level.restype = ctypes.c_int
    lib.dq_source_sha256.restype = ctypes.c_char_p
    if lib.dq_source_sha256().decode() != source_digest():
        raise OSError(f"{path} was built from another cpu_kernels.c than {SOURCE} (reinstall the package)")
    return lib


def load_prebuilt(directory: Path) -> tuple[ctypes.CDLL, Path] | None:
    """The best library built at install in ``directory`` that this CPU runs, or ``None`` where there is none.
    Raises :class:`OSError` where they were built from other source or do not load.

    The baseline library is loaded first to ask the CPU's level: only it is sure to run on any CPU (a
    library's constructor may already use the instructions it was built for)."""
    found = {}
    for variant in VARIANTS:  # this interpreter's own suffix first, as setup.py names them
        paths = (directory / f"{variant.name}{suffix}" for suffix in EXTENSION_SUFFIXES)
        if (path := next((p for p in paths if p.is_file()), None)) is not None:
            found[variant.level] = path
    if BASELINE.level not in found:
        return None
    baseline = _open(found[BASELINE.level])
    cpu_level = baseline.dq_cpu_level()
    best = max(level for level in found if level <= cpu_level)
    return (baseline if best == BASELINE.level else _open(found[best])), found[best]


def _home() -> Path:
    try:
        return Path.home()
    except (RuntimeError, KeyError) as error:  # HOME unset and the user not in the password database
        raise OSError("no home directory to cache the DynamiQ CPU kernels in: set FEDSHARD_CACHE_DIR") from error


def cache_dir() -> Path:
    """The per-user cache for libraries compiled at run time, created 0700 and checked to be private."""
    configured = os.environ.get("FEDSHARD_CACHE_DIR")
    if configured:
        directory = Path(configured)
    else:
        directory = Path(os.environ.get("XDG_CACHE_HOME") or _home() / ".cache") / "lightning_fedshard"
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    directory = directory.resolve(strict=True)  # checked and used as this path: a symlink swapped later is not followed
    check_private(directory)
    for parent in directory.parents:
        info = os.stat(parent)
        if info.st_uid not in (0, os.geteuid()) or (info.st_mode & 0o022 and not info.st_mode & stat.S_ISVTX):
            raise PermissionError(
                f"DynamiQ kernel cache {directory}: its parent {parent} is owned by uid {info.st_uid} or writable by "
                f"others (mode {stat.filemode(info.st_mode)}), who could replace the cache; set FEDSHARD_CACHE_DIR "
                "to a directory of your own"
            )
    return directory


def check_private(path: Path) -> None:
    """Raises :class:`PermissionError` unless ``path`` (not followed if a link) is a directory or regular file
    that the current user owns and that neither group nor others can write."""
    info = os.lstat(path)
    kind = "directory" if stat.S_ISDIR(info.st_mode) else "file" if stat.S_ISREG(info.st_mode) else None
    if kind is None:
        raise PermissionError(f"DynamiQ kernel cache: {path} is not a regular file or directory; refused")
    if info.st_uid != os.geteuid() or info.st_mode & 0o022:
        raise PermissionError(
            f"DynamiQ kernel cache: the {kind} {path} is owned by uid {info.st_uid} with mode "
            f"{stat.filemode(info.st_mode)}; refused: it must be yours (uid {os.geteuid()}) and not writable by "
            "group or others"
        )


def _cpu_features() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return next((line for line in cpuinfo if line.startswith(("flags", "Features"))), platform.processor())
    except OSError:
        return platform.machine() + platform.processor()


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    import fcntl  # POSIX only, as the kernels are

    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _compile(compiler: str, flags: tuple[str, ...], target: Path) -> None:
    # built under a temporary name and renamed: a process loading without the lock never sees a half-written file
    handle, partial = tempfile.mkstemp(dir=target.parent, suffix=".so.partial")
    os.close(handle)
    name, value = source_macro()
    try:
        subprocess.run(
            [compiler, *flags, "-fPIC", "-shared", f"-D{name}={value}", str(SOURCE), "-o", partial, "-lm"],
            check=True,
            capture_output=True,
            timeout=300,
        )
        os.chmod(partial, 0o700)  # whatever the umask: check_private accepts it
        os.replace(partial, target)
    except subprocess.CalledProcessError as error:
        raise subprocess.SubprocessError(error.stderr.decode(errors="replace")) from error
    finally:
        Path(partial).unlink(missing_ok=True)


def compile_cached(compiler: str, tunings: Sequence[tuple[str, ...]]) -> tuple[ctypes.CDLL, Path]:
    """The library built with ``compiler`` and the first of ``tunings`` that builds, compiled into
    :func:`cache_dir` unless there already. One lock per library: of the processes asking at once, one
    compiles and the others wait and load its file. Raises :class:`PermissionError` for an unsafe cache,
    :class:`subprocess.SubprocessError` (each tuning's error) where none builds."""
    directory = cache_dir()
    version = subprocess.run([compiler, "--version"], check=False, capture_output=True, text=True, timeout=30).stdout
    errors = []
    for tuning in tunings:
        flags = (*FLAGS, *tuning)
        key = hashlib.sha256(
            b"\0".join(s.encode() for s in (compiler, version, *flags, _cpu_features())) + SOURCE.read_bytes()
        ).hexdigest()[:20]
        target = directory / f"dynamiq_cpu_{key}.so"
        try:
            with _locked(directory / f"dynamiq_cpu_{key}.lock"):
                if not os.path.lexists(target):
                    _compile(compiler, flags, target)
            check_private(target)
            return _open(target), target
        except PermissionError:
            raise
        except (OSError, subprocess.SubprocessError) as error:
            errors.append(f"{' '.join(tuning) or 'portable'}: {str(error)[-300:]}")
    raise subprocess.SubprocessError("; ".join(errors))
