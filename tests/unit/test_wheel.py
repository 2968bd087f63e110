"""The wheel carries the kernel sources and the recipes, and works installed away from the checkout.

Fast tests check :mod:`lightning_moe.resources` on the checkout and on made-up layouts. The slow
ones build the wheel from a copy of the tree (``pip wheel --no-deps --no-build-isolation
--no-index``: offline, with the setuptools already installed), install it into a fresh target
folder put first on ``PYTHONPATH`` of the interpreter running the tests (so its torch and Lightning
serve, in a virtual environment too) and run it from an empty directory, so neither the checkout
nor the editable install can stand in for the wheel.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from lightning_moe import resources
from lightning_moe.ops import build, build_cutlass

REPO = Path(__file__).resolve().parents[2]
KERNEL_SUFFIXES = (".cu", ".cuh", ".cpp", ".h")
EXTERNAL_INCLUDES = ("cute/", "cutlass/")  # CUTLASS's headers, found through its include dirs
# What the copy of the tree leaves out: VCS data, caches, build outputs, local runs.
_IGNORE = shutil.ignore_patterns(".*", "__pycache__", "*.egg-info", "build", "dist", "runs", "lightning_logs", "*.so")


def _repo_kernel_files() -> set[str]:
    """Every kernel file under the checkout's ``csrc/``, relative to it."""
    csrc = REPO / "csrc"
    return {p.relative_to(csrc).as_posix() for p in csrc.rglob("*") if p.suffix in KERNEL_SUFFIXES}


def _repo_recipes() -> set[str]:
    return {p.name for p in (REPO / "configs").glob("*.yaml")}


def _built_files(root: Path) -> set[str]:
    """What the two JIT builders read from ``root`` (a ``csrc`` directory), relative to it."""
    files = build.kernel_files(root) + build.kernel_files(root / "cutlass")
    return {p.relative_to(root).as_posix() for p in files}


def test_checkout_layout_uses_the_top_level_folders() -> None:
    assert resources.csrc_dir() == REPO / "csrc"
    assert resources.configs_dir() == REPO / "configs"
    assert build.csrc_dir() == REPO / "csrc"


def test_builders_read_every_kernel_file_of_the_checkout() -> None:
    listed = {p.relative_to(REPO / "csrc").as_posix() for p in build.kernel_files() + build_cutlass.cutlass_kernel_files()}
    assert listed == _repo_kernel_files()
    assert all(p.is_file() for p in build.kernel_files() + build_cutlass.cutlass_kernel_files())


def test_every_quoted_include_is_a_kernel_file_beside_it() -> None:
    files = build.kernel_files() + build_cutlass.cutlass_kernel_files()
    for path in files:
        for name in re.findall(r'^\s*#\s*include\s+"([^"]+)"', path.read_text(), flags=re.MULTILINE):
            if not name.startswith(EXTERNAL_INCLUDES):
                assert path.parent / name in files, f"{path.name} includes {name}, which no build lists"


def _fake_layout(tmp_path: Path, *, packaged: bool, checkout: bool) -> Path:
    package = tmp_path / "lightning_moe"
    package.mkdir()
    for where, wanted in ((package / "_csrc", packaged), (tmp_path / "csrc", checkout)):
        if wanted:
            where.mkdir()
    return package


def test_packaged_folder_wins_over_the_checkout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    package = _fake_layout(tmp_path, packaged=True, checkout=True)
    monkeypatch.setattr(resources, "_package_dir", lambda: package)
    assert resources.csrc_dir() == package / "_csrc"


def test_checkout_folder_serves_when_nothing_is_packaged(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    package = _fake_layout(tmp_path, packaged=False, checkout=True)
    monkeypatch.setattr(resources, "_package_dir", lambda: package)
    assert resources.csrc_dir() == tmp_path / "csrc"


def test_missing_data_reports_the_packaged_location(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    package = _fake_layout(tmp_path, packaged=False, checkout=False)
    monkeypatch.setattr(resources, "_package_dir", lambda: package)
    assert resources.csrc_dir() == package / "_csrc"
    assert resources.recipe_names() == []
    with pytest.raises(ValueError, match=r"--config=tiny_moe names no file.*none under"):
        resources.recipe_path("tiny_moe")


# --- the built wheel, installed into a fresh venv -------------------------------------------------


def _run(cmd: list[str], cwd: Path, env: dict[str, str] | None = None, timeout: int = 300) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("wheel")
    tree = root / "tree"
    shutil.copytree(REPO, tree, ignore=_IGNORE)
    out = root / "out"
    pip = [sys.executable, "-m", "pip", "wheel", ".", "--no-deps", "--no-build-isolation", "--no-index", "-q", "-w", str(out)]
    _run(pip, cwd=tree)
    (found,) = out.glob("lightning_moe-*.whl")
    return found


@pytest.fixture(scope="module")
def venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str], Path]:
    """``(target, env, cwd)``: the wheel installed into a fresh target folder, an environment whose
    ``PYTHONPATH`` is that folder alone, and an empty directory to run from.

    The interpreter is the one running the tests, with whatever it has installed (torch, Lightning):
    a plain interpreter, a virtual environment or conda alike. A nested ``venv --system-site-packages``
    would see the base interpreter's packages, not the outer virtual environment's.
    """
    root = tmp_path_factory.mktemp("venv")
    target = root / "site"
    _run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target", str(target), str(wheel)],
         cwd=root)  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["PYTHONPATH"] = str(target)  # ahead of site-packages, where an editable install of the checkout may be
    env["PATH"] = f"{target / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["LIGHTNING_MOE_KERNELS"] = "torch"  # CPU run: no JIT build attempt, no warning
    cwd = root / "work"
    cwd.mkdir()
    return target, env, cwd


# One interpreter start (torch and Lightning imports dominate): `lightning-moe recipes` as
# cli.main runs it, then what the builders and resources see, as the last line.
_INSPECT = """
import json
import lightning_moe
from lightning_moe import cli, resources
cli.main(["recipes"])
from lightning_moe.ops import build, build_cutlass
files = build.kernel_files() + build_cutlass.cutlass_kernel_files()
print(json.dumps({
    "package": lightning_moe.__file__,
    "csrc": str(build.csrc_dir()),
    "configs": str(resources.configs_dir()),
    "files": [str(p) for p in files],
    "missing": [str(p) for p in files if not p.is_file()],
    "recipes": resources.recipe_names(),
    "typed": (resources._package_dir() / "py.typed").is_file(),
}))
"""


@pytest.mark.slow
def test_wheel_holds_kernels_recipes_and_py_typed(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "lightning_moe/py.typed" in names
    csrc = {n.removeprefix("lightning_moe/_csrc/") for n in names if n.startswith("lightning_moe/_csrc/")}
    assert csrc == _repo_kernel_files()
    configs = {n.removeprefix("lightning_moe/_configs/") for n in names if n.startswith("lightning_moe/_configs/")}
    assert configs == _repo_recipes()


@pytest.mark.slow
def test_installed_wheel_finds_every_kernel_source_and_recipe(venv: tuple[Path, dict[str, str], Path]) -> None:
    env_dir, env, cwd = venv
    proc = _run([sys.executable, "-c", _INSPECT], cwd=cwd, env=env)
    *listed, last = proc.stdout.strip().splitlines()
    seen = json.loads(last)
    package = Path(seen["package"]).resolve()
    assert package.is_relative_to(env_dir.resolve()) and not package.is_relative_to(REPO), package
    csrc = Path(seen["csrc"])
    assert csrc == package.parent / "_csrc" and Path(seen["configs"]) == package.parent / "_configs"
    assert seen["missing"] == []
    assert {Path(p).relative_to(csrc).as_posix() for p in seen["files"]} == _repo_kernel_files()
    assert set(seen["recipes"]) == {name.removesuffix(".yaml") for name in _repo_recipes()}
    assert seen["typed"]
    assert f"tiny_moe  {csrc.parent / '_configs' / 'tiny_moe.yaml'}" in listed, listed


@pytest.mark.slow
def test_installed_wheel_runs_a_packaged_recipe_by_name(venv: tuple[Path, dict[str, str], Path]) -> None:
    env_dir, env, cwd = venv
    fit = [
        str(env_dir / "bin" / "lightning-moe"), "fit", "--config", "tiny_moe",
        "--trainer.max_steps=3", "--trainer.val_check_interval=3", "--trainer.limit_val_batches=1",
        "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false",
        "--data.init_args.max_bytes=200000",
    ]  # fmt: skip
    proc = _run(fit, cwd=cwd, env=env, timeout=240)
    assert re.search(r"^validation loss: [\d.]+ at step 0 -> [\d.]+ at step 3", proc.stdout, flags=re.MULTILINE), proc.stdout[-2000:]
    assert (cwd / "runs" / "tiny_moe").is_dir()  # the recipe's logger wrote where the user stands
