"""An installed ``easgd-train`` runs from any directory: nothing is read from the source tree.

The test builds a wheel from a copy of the package sources and the top-level config tree
(``conf/``, ``recipes/``, mapped into the package by ``build_hooks.py``), installs it
(``--no-deps``) into a fresh venv made by this interpreter, and runs the venv's
``easgd-train`` console script from an empty directory with ``PYTHONPATH`` unset. Installing torch, Lightning and DeepSpeed
from scratch would take minutes, so the venv sees them through a ``.pth`` file naming the
site-packages of the interpreter running the tests (``sysconfig`` of ``sys.prefix``); a
path added by a ``.pth`` file is no site directory, so the editable install of the source
checkout that lives there (its own ``.pth`` hook) is never activated, and the venv's own
site-packages, holding the wheel's ``easgd_lightning``, comes first on ``sys.path``.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

from tests.helpers import REPO, base_env, one_error_line

pytestmark = pytest.mark.slow  # wheel build + install + one 2-process run: ~1 minute on 2 cores

#: A user's own config directory: a strategy option extending a shipped one, and a recipe.
USER_STRATEGY = "defaults:\n  - sync_easgd\n  - _self_\ntau: 2\n"
USER_RECIPE = "# @package _global_\ntrainer:\n  max_epochs: 1\n  max_steps: 3\n"


def _run(cmd: list, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    env = base_env()
    env.pop("PYTHONPATH")  # nothing from the source tree
    return subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


def _run_all(cmds: list[list], cwd: Path, timeout: float = 300) -> list[subprocess.CompletedProcess]:
    """:func:`_run` of each command, all at once (in ``cwd``); their results in order."""
    with ThreadPoolExecutor(len(cmds)) as pool:
        return list(pool.map(lambda cmd: _run(cmd, cwd, timeout), cmds))


def _ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, f"rc={proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> dict[str, Path]:
    """A fresh venv with the wheel installed: {venv, python, easgd_train, site, wheel}."""
    root = tmp_path_factory.mktemp("wheel")
    src = root / "src"  # a copy, so the build writes nothing into the checkout
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "build_hooks.py", "MANIFEST.in"):
        shutil.copy2(REPO / name, src / name)
    for name in ("easgd_lightning", "hydra_plugins", "conf", "recipes"):  # no library built in place
        shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.so"))
    dist = root / "dist"
    _ok(_run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
              "-q", "-w", dist, src], cwd=root))
    wheel = next(dist.glob("easgd_lightning-*.whl"))

    venv = root / "venv"
    _ok(_run([sys.executable, "-m", "venv", "--without-pip", venv], cwd=root))
    python = venv / "bin" / "python"
    site = Path(_ok(_run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         cwd=root)).stdout.strip())
    deps = sysconfig.get_paths(vars={"base": sys.prefix, "platbase": sys.prefix})["purelib"]
    (site / "project_deps.pth").write_text(deps + "\n")
    _ok(_run([sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index",
              "-q", wheel], cwd=root))
    return {"venv": venv, "python": python, "easgd_train": venv / "bin" / "easgd-train",
            "site": site, "wheel": wheel}


def test_wheel_holds_the_config_tree_and_the_recipes(installed):
    """The top-level conf/ and recipes/ (their one source) are in the wheel, mapped at build time
    to easgd_lightning/conf/ and easgd_lightning/conf/recipe/ (build_hooks.py)."""
    names = set(zipfile.ZipFile(installed["wheel"]).namelist())
    shipped = {f"easgd_lightning/{dest}/{p.relative_to(REPO / src)}"
               for src, dest in (("conf", "conf"), ("recipes", "conf/recipe"))
               for p in (REPO / src).rglob("*") if p.suffix in (".yaml", ".md", ".py")}
    assert "easgd_lightning/conf/train.yaml" in shipped
    assert "easgd_lightning/conf/__init__.py" in shipped  # pkg:// needs it
    assert "easgd_lightning/conf/recipe/imagenet/alexnet_knl.yaml" in shipped
    assert "easgd_lightning/conf/recipe/nlp3d/gpt_tiny_pp2.yaml" in shipped
    assert shipped <= names, sorted(shipped - names)
    assert not [n for n in names if n.startswith(("conf/", "recipes/", "build_hooks"))]


#: from outside the checkout: where the installed package finds its tree, and a recipe of
#: each family composed by the command-line checker (the tree as a directory)
TREE_CHECK = """
import easgd_lightning, hydra
from easgd_lightning.config_tree import CONF_DIR, CONF_PATH, RECIPES_DIR
from easgd_lightning.cli.overrides import compose_checked
print(easgd_lightning.__file__, CONF_DIR, CONF_PATH, RECIPES_DIR, hydra.__file__)
for recipe in ("imagenet/alexnet_knl", "nlp3d/gpt_tiny_pp2_dp2_optimus"):
    cfg = compose_checked([f"recipe={recipe}"])
    print(recipe, cfg.strategy.name, cfg.model.name, cfg.compression.name)
"""


def test_installed_package_and_config_tree_live_in_the_venv(installed, tmp_path):
    lines = _ok(_run([installed["python"], "-c", TREE_CHECK], cwd=tmp_path)).stdout.splitlines()
    pkg, conf, config_path, recipes, hydra_file = lines[0].split()
    assert Path(pkg).is_relative_to(installed["site"]), pkg
    assert Path(conf) == installed["site"] / "easgd_lightning" / "conf"
    assert config_path == "pkg://easgd_lightning.conf"
    assert Path(recipes) == installed["site"] / "easgd_lightning" / "conf" / "recipe"
    assert not Path(conf).is_relative_to(REPO)
    assert not Path(hydra_file).is_relative_to(installed["venv"])  # dependencies: the .pth file
    assert lines[1:] == ["imagenet/alexnet_knl sync_easgd alexnet none",
                         "nlp3d/gpt_tiny_pp2_dp2_optimus pipeline_3d gpt optimus_cc"]


def test_installed_easgd_train_runs_from_an_empty_directory(installed, tmp_path):
    work = tmp_path / "empty"
    work.mkdir()
    exe = installed["easgd_train"]

    # Independent commands run side by side (each a fresh interpreter, one core busy importing),
    # every one checked as when they ran one after the other.
    helped, printed, bad = _run_all([[exe, "--help"], [exe, "recipe=nlp3d/gpt_tiny_pp2", "--cfg", "job"],
                                     [exe, "strategy=sync_easgd", "strategy.tauu=3"]], cwd=work)
    helped = _ok(helped).stdout
    assert "strategy: async_easgd, async_measgd" in helped
    assert "recipe/imagenet: alexnet_gpu, alexnet_knl" in helped
    assert "recipe/nlp3d: gpt2_medium_3d" in helped

    printed = yaml.safe_load(_ok(printed).stdout)
    assert printed["strategy"]["name"] == "pipeline_3d" and printed["model"]["name"] == "gpt"

    assert bad.returncode == 2
    assert one_error_line(bad.stderr).startswith("easgd-train: error: strategy.tauu: unknown key; did you mean strategy.tau?")
    assert list(work.iterdir()) == []  # refused before any run directory existed (nor did --help, --cfg make one)

    # A user's config directory extends the shipped tree (README, "Your own configs").
    user = tmp_path / "my_conf"
    (user / "strategy").mkdir(parents=True)
    (user / "recipe" / "mine").mkdir(parents=True)
    (user / "strategy" / "my_sync.yaml").write_text(USER_STRATEGY)
    (user / "recipe" / "mine" / "short.yaml").write_text(USER_RECIPE)
    (user / "recipe" / "mine" / "typo.yaml").write_text("# @package _global_\ntrainer:\n  max_epocs: 1\n")
    typo, run = _run_all([
        [exe, f"hydra.searchpath=[file://{user}]", "recipe=mine/typo", "hydra.run.dir=typo"],
        [exe, f"hydra.searchpath=[file://{user}]", "strategy=my_sync", "recipe=mine/short", "trainer.devices=2",
         "logger=none", "trainer.enable_progress_bar=false", "hydra.run.dir=run"]], cwd=work)
    assert typo.returncode == 2, typo.stderr[-3000:]
    assert one_error_line(typo.stderr).startswith(
        "easgd-train: error: trainer.max_epocs: unknown key; did you mean trainer.max_epochs?")
    assert not (work / "typo" / "ranks").exists()  # refused before any rank started
    _ok(run)

    summary = json.loads((work / "run" / "summary.json").read_text())
    assert summary["status"] == "ok", summary.get("error")
    assert summary["strategy"] == "sync_easgd"
    assert summary["config"]["strategy"]["tau"] == 2  # the user's option over the shipped one
    assert summary["config"]["trainer"]["max_steps"] == 3  # the user's recipe
    assert summary["steps_per_rank"] == [3, 3]
    sources = yaml.safe_load((work / "run" / ".hydra" / "hydra.yaml").read_text())["hydra"]["runtime"]["config_sources"]
    paths = {s["provider"]: s["path"] for s in sources}
    assert paths["main"] == "easgd_lightning.conf" and paths.get("hydra.searchpath in command-line") == str(user)
    assert "easgd-lightning recipes" not in paths  # the checkout's recipes plugin stays out of a wheel


#: from outside the checkout: where the kernels come from, and two codecs whose kernels are
#: bitwise their eager path, with the kernels and without (same data, fresh state each)
KERNEL_CHECK = """
import torch
from easgd_lightning.hooks import build_compressor
from easgd_lightning.hooks.compressors import _native
print(_native.source(), _native.__file__)
x = torch.randn(200_000, generator=torch.Generator().manual_seed(3))
for name, opts in (("topk", {"ratio": 0.01}), ("signsgd", {})):
    c = build_compressor(name, min_numel=0, **opts)
    native = c.decompress(c.compress(x.clone(), {"key_hash": 1}), x.shape)
    with _native.disabled():
        c = build_compressor(name, min_numel=0, **opts)
        eager = c.decompress(c.compress(x.clone(), {"key_hash": 1}), x.shape)
    print(name, bool(torch.equal(native, eager)), int(torch.count_nonzero(native)))
"""


def test_the_wheel_carries_compiled_kernels_used_without_a_compiler(installed, tmp_path):
    """The wheel holds the kernels compiled at build time (and their source); installed and
    run with no C compiler on PATH, the codecs use that library, bitwise as their eager path."""
    names = zipfile.ZipFile(installed["wheel"]).namelist()
    built = [n for n in names if n.startswith("easgd_lightning/hooks/compressors/_kernels_built") and n.endswith(".so")]
    assert len(built) == 1 and "easgd_lightning/hooks/compressors/_kernels.c" in names, names
    env = base_env()
    env.pop("PYTHONPATH")
    env.pop("CC", None)
    env["PATH"] = str(installed["venv"] / "bin")  # no cc, no gcc
    env["EASGD_KERNEL_CACHE"] = str(tmp_path / "cache")  # nothing compiled earlier is found
    proc = _ok(subprocess.run([str(installed["python"]), "-W", "error::UserWarning", "-c", KERNEL_CHECK],
                              cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120))
    lines = proc.stdout.splitlines()
    where, module = lines[0].split()
    assert where == "prebuilt" and Path(module).is_relative_to(installed["site"]), lines[0]
    assert not (tmp_path / "cache").exists()  # nothing was compiled at run time
    for line in lines[1:]:
        name, same, nonzero = line.split()
        assert same == "True" and int(nonzero) > 0, line
    assert len(lines) == 3
