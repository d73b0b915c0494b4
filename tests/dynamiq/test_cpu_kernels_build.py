"""How DynamiQ's C kernels are built and loaded: prebuilt by setup.py at install (one library per x86-64 level,
picked at run time), else compiled at run time into a private per-user cache under a lock, else torch; and a
library that another user could have written is never loaded."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_fedshard.dynamiq import cpu_kernels, cpu_kernels_build
from tests.dynamiq.test_cpu_kernels import hops, inputs

pytestmark = pytest.mark.skipif(
    not any(shutil.which(c) for c in ("cc", "gcc", "clang")) or os.name != "posix",
    reason="the C kernels need a C compiler and a POSIX system",
)
REPO = Path(__file__).resolve().parents[2]
OTHER_UID = 54321  # a user that is not us (and, here, not in the password database)


@pytest.fixture(autouse=True)
def fresh_load():
    cpu_kernels._load.cache_clear()
    yield
    cpu_kernels._load.cache_clear()


@pytest.fixture
def no_prebuilt(monkeypatch, tmp_path) -> Path:
    """No library installed with the package: the loader compiles at run time into a fresh private cache."""
    empty = tmp_path / "package"
    empty.mkdir()
    monkeypatch.setattr(cpu_kernels, "_PREBUILT_DIR", empty, raising=False)
    cache = tmp_path / "cache"
    monkeypatch.setenv("FEDSHARD_CACHE_DIR", str(cache))
    monkeypatch.setenv("FEDSHARD_DYNAMIQ_COMPILE", "auto")
    return cache


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The package directory of a build by the real setup.py (what a wheel or an editable install holds); where
    setuptools is missing (Python 3.12 venvs), the libraries that `pip install -e` (`make`) built in place."""
    if importlib.util.find_spec("setuptools") is None:
        if not any(cpu_kernels._PREBUILT_DIR.glob(f"{cpu_kernels_build.BASELINE.name}.*")):
            pytest.skip("neither setuptools to build the kernels nor an install that built them")
        return cpu_kernels._PREBUILT_DIR
    out = tmp_path_factory.mktemp("build")
    subprocess.run(
        [sys.executable, "setup.py", "-q", "build_ext", "--build-lib", str(out / "lib"), "--build-temp", str(out)],
        cwd=REPO,
        check=True,
        capture_output=True,
        timeout=300,
    )
    return out / "lib" / "lightning_fedshard" / "dynamiq"


def references() -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    x, y = inputs()["extremes"], inputs()["heavy"]
    os.environ["FEDSHARD_DYNAMIQ_COMPILE"] = "0"
    try:
        return hops(x, y, 5.0, "stochastic"), x, y
    finally:
        os.environ["FEDSHARD_DYNAMIQ_COMPILE"] = "auto"


def test_the_installed_library_is_loaded_without_compiling(monkeypatch, tmp_path, installed, recwarn) -> None:
    reference, x, y = references()
    monkeypatch.setattr(cpu_kernels, "_PREBUILT_DIR", installed, raising=False)
    monkeypatch.setattr(cpu_kernels.shutil, "which", lambda name: None)  # no compiler at run time
    monkeypatch.setenv("FEDSHARD_CACHE_DIR", str(tmp_path / "cache"))
    assert cpu_kernels.library() is not None
    kind, path, _ = cpu_kernels.origin()
    assert kind == "prebuilt" and path.parent == installed
    assert not (tmp_path / "cache").exists()  # nothing compiled, nothing cached
    assert not [w for w in recwarn if "DynamiQ" in str(w.message)]  # the intended path: no warning
    assert all(torch.equal(a, b) for a, b in zip(reference, hops(x, y, 5.0, "stochastic"), strict=True))


def test_every_level_this_cpu_runs_gives_the_bytes_of_torch(monkeypatch, tmp_path, installed) -> None:
    reference, x, y = references()
    libraries = {
        v.level: next(installed.glob(f"{v.name}.*"))
        for v in cpu_kernels_build.VARIANTS
        if any(installed.glob(f"{v.name}.*"))
    }
    baseline = libraries[0]
    cpu_level = cpu_kernels_build.load_prebuilt(baseline.parent)[0].dq_cpu_level()
    checked = []
    for level, library in libraries.items():
        if level > cpu_level:
            continue
        package = tmp_path / f"level{level}"  # the baseline (to ask the CPU) and this level only
        package.mkdir()
        for source in {baseline, library}:
            shutil.copy(source, package / source.name)
        monkeypatch.setattr(cpu_kernels, "_PREBUILT_DIR", package)
        cpu_kernels._load.cache_clear()
        assert cpu_kernels.origin().path == package / library.name
        assert all(torch.equal(a, b) for a, b in zip(reference, hops(x, y, 5.0, "stochastic"), strict=True)), level
        checked.append(level)
    assert 0 in checked and max(checked) == max(level for level in libraries if level <= cpu_level)


def test_a_prebuilt_library_of_other_source_is_not_used(monkeypatch, tmp_path, installed, no_prebuilt) -> None:
    changed = tmp_path / "cpu_kernels.c"  # the source as after a `git pull` that the editable install missed
    changed.write_text(cpu_kernels_build.SOURCE.read_text() + "/* changed */\n")
    monkeypatch.setattr(cpu_kernels_build, "SOURCE", changed)
    monkeypatch.setattr(cpu_kernels, "_PREBUILT_DIR", installed)
    with pytest.warns(UserWarning, match="built from another cpu_kernels.c.*compiled at run time"):
        kind, path, _ = cpu_kernels.origin()
    assert kind == "compiled" and path.parent == no_prebuilt


@pytest.mark.parametrize("unsafe", ["world-writable", "group-writable", "another user's"])
def test_a_cache_directory_others_can_write_is_refused(monkeypatch, tmp_path, no_prebuilt, unsafe) -> None:
    no_prebuilt.mkdir(mode=0o700)
    if unsafe == "another user's":
        os.chown(no_prebuilt, OTHER_UID, -1)
    else:
        os.chmod(no_prebuilt, 0o777 if unsafe == "world-writable" else 0o770)
    shared = tmp_path / "tmp"  # the temp dir: never a fallback
    shared.mkdir()
    monkeypatch.setattr("tempfile.tempdir", str(shared))
    with pytest.warns(UserWarning, match="refused.*using torch"):
        assert cpu_kernels.library() is None
    assert cpu_kernels.origin().kind == "torch"
    assert not [p for p in no_prebuilt.iterdir() if p.suffix == ".so"] and not list(shared.iterdir())


def test_a_planted_library_is_not_loaded(tmp_path, no_prebuilt) -> None:
    with pytest.warns(UserWarning, match="compiled at run time"):
        assert cpu_kernels.library() is not None
    (built,) = no_prebuilt.glob("*.so")  # the name a planter can predict
    marker = tmp_path / "planted-code-ran"
    planted = tmp_path / "planted.c"
    planted.write_text(
        f'#include <stdio.h>\n__attribute__((constructor)) static void run(void) {{ fopen("{marker}", "w"); }}\n'
    )
    compiler = next(c for c in ("cc", "gcc", "clang") if shutil.which(c))
    subprocess.run([compiler, "-shared", "-fPIC", str(planted), "-o", str(built)], check=True, timeout=60)
    for owner, mode in ((os.geteuid(), 0o775), (OTHER_UID, 0o700)):  # group-writable; another user's
        os.chown(built, owner, -1)
        os.chmod(built, mode)
        cpu_kernels._load.cache_clear()
        with pytest.warns(UserWarning, match="refused.*using torch"):
            assert cpu_kernels.library() is None
        assert not marker.exists()


def build_in_a_process(env: dict[str, str], before: str = "") -> subprocess.Popen:
    """A fresh Python with only ``env`` (no HOME unless given) that runs ``before`` and then compiles the kernels
    at run time as the loader does (``cpu_kernels_build`` alone, loaded by path: a rank without the seconds
    of importing torch and Lightning), printing the library's path."""
    code = f"""
import importlib.util, os, platform, shutil, time
from pathlib import Path
{before}
spec = importlib.util.spec_from_file_location("cpu_kernels_build", {str(cpu_kernels_build.__file__)!r})
build = importlib.util.module_from_spec(spec)
spec.loader.exec_module(build)
compiler = os.environ.get("CC") or next(c for c in ("cc", "gcc", "clang") if shutil.which(c))
print(build.compile_cached(compiler, build.native_tunings(platform.machine()))[1])
"""
    return subprocess.Popen(
        [sys.executable, "-c", code],
        env={"PATH": os.environ["PATH"], **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_without_home_fedshard_cache_dir_is_used(tmp_path) -> None:
    cache = tmp_path / "cache"
    # HOME unset, and the user not in the password database, as in a container run with `--user <uid>`
    no_passwd = "import pwd\ndef missing(uid): raise KeyError(uid)\npwd.getpwuid = missing"
    process = build_in_a_process({"FEDSHARD_CACHE_DIR": str(cache)}, no_passwd)
    out, err = process.communicate(timeout=120)
    assert process.returncode == 0, err
    assert Path(out.strip()).parent == cache, err


def test_ranks_starting_together_compile_once(tmp_path) -> None:
    log = tmp_path / "compiles.log"
    compiler = tmp_path / "cc"  # the real compiler, logging each build and taking a second longer
    real = next(shutil.which(c) for c in ("cc", "gcc", "clang") if shutil.which(c))
    compiler.write_text(f'#!/bin/sh\ncase " $* " in *" -o "*) echo "$$" >> {log}; sleep 1;; esac\nexec {real} "$@"\n')
    compiler.chmod(0o755)
    cache = tmp_path / "cache"
    # both ranks imported and ready before either asks for the kernels
    together = (
        f"Path('{tmp_path}', f'ready{{os.getpid()}}').touch()\n"
        f"while len(list(Path('{tmp_path}').glob('ready*'))) < 2: time.sleep(0.01)"
    )
    env = {"CC": str(compiler), "FEDSHARD_CACHE_DIR": str(cache), "HOME": str(tmp_path)}
    ranks = [build_in_a_process(env, together) for _ in range(2)]
    results = [rank.communicate(timeout=120) for rank in ranks]
    assert all(rank.returncode == 0 for rank in ranks), [err for _, err in results]
    paths = {out.strip() for out, _ in results}
    assert len(paths) == 1 and Path(paths.pop()).parent == cache
    assert len(log.read_text().splitlines()) == 1
