"""What an install ships, checked on a wheel built from this checkout: bilinear_lm with every subpackage (found by
setuptools, no package-dir remapping), the presets and the lm-eval task YAMLs as package data, console scripts for
library modules only; and the eval/ scripts as thin command lines over the library."""
import importlib
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import bilinear_lm
from bilinear_lm.evaluation.harness import TASKS_DIR

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

REPO = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
CONSOLE_SCRIPTS = {"bilinear-perplexity", "bilinear-probes", "bilinear-recall"}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    """A wheel built (offline, with this environment's setuptools) from a copy of the checkout's sources."""
    pytest.importorskip("setuptools")
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    for folder in ("bilinear_lm", "eval", "benchmarks"):
        shutil.copytree(REPO / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    build = subprocess.run([sys.executable, "-c", f"from setuptools import build_meta; "
                            f"print(build_meta.build_wheel({str(tmp / 'dist')!r}))"],
                           cwd=src, capture_output=True, text=True)
    assert build.returncode == 0, build.stderr[-3000:]
    return zipfile.ZipFile(tmp / "dist" / build.stdout.split()[-1])


def test_packages_are_found_not_listed_or_remapped():
    setuptools = PYPROJECT["tool"]["setuptools"]
    assert "package-dir" not in setuptools
    assert setuptools["packages"] == {"find": {"include": ["bilinear_lm*"], "namespaces": False}}


def test_wheel_holds_every_package_and_nothing_else(wheel):
    names = wheel.namelist()
    assert {n.split("/")[0] for n in names} == {"bilinear_lm", "bilinear_lm-0.1.0.dist-info"}
    packages = {p.parent.relative_to(REPO).as_posix() for p in (REPO / "bilinear_lm").rglob("__init__.py")
                if "__pycache__" not in p.parts}
    assert {"bilinear_lm/evaluation", "bilinear_lm/evaluation/lm_eval_tasks", "bilinear_lm/probes"} <= packages
    assert {f"{p}/__init__.py" for p in packages} <= set(names)


def test_wheel_ships_the_presets_and_the_lm_eval_tasks(wheel):
    """Every non-Python file of the bilinear_lm folder is in the wheel: the presets and the task YAMLs, whose
    ``!function`` modules ship beside them."""
    names = set(wheel.namelist())
    data = {p.relative_to(REPO).as_posix() for p in (REPO / "bilinear_lm").rglob("*")
            if p.is_file() and p.suffix not in (".py", ".pyc")}
    assert data - names == set()
    yamls = [n for n in names if n.endswith(".yaml")]
    assert {"tiny", "shakespeare-char", "tinystories", "125m"} <= {Path(n).stem for n in yamls}
    tasks = {}
    for n in yamls:
        task = re.search(r"^task: (\S+)", wheel.read(n).decode(), re.M)
        if task:
            tasks[task.group(1)] = n
    assert {"wikitext2_local", "lambada_openai_local", "probe_parity"} <= set(tasks)
    for n in tasks.values():
        for module, _ in re.findall(r"!function (\w+)\.(\w+)", wheel.read(n).decode()):
            assert f"{Path(n).parent.as_posix()}/{module}.py" in names


def test_the_default_include_path_is_the_packaged_tasks():
    """run_lm_eval's default include path (and the README's ``--include_path``) is inside the package, and its
    ``!function`` utils import as modules of it."""
    package_dir = Path(bilinear_lm.__file__).resolve().parent
    assert TASKS_DIR == package_dir / "evaluation" / "lm_eval_tasks"
    for y in TASKS_DIR.rglob("*.yaml"):
        for module, function in re.findall(r"!function (\w+)\.(\w+)", y.read_text()):
            package = ".".join(y.parent.relative_to(package_dir.parent).parts)
            assert callable(getattr(importlib.import_module(f"{package}.{module}"), function))


def test_console_scripts_are_the_library_mains(wheel):
    entry_points = wheel.read("bilinear_lm-0.1.0.dist-info/entry_points.txt").decode()
    scripts = dict(re.findall(r"^(\S+) = (\S+)$", entry_points, re.M))
    assert set(scripts) == CONSOLE_SCRIPTS
    for target in scripts.values():
        module, _, function = target.partition(":")
        assert module.startswith("bilinear_lm.") and module.replace(".", "/") + ".py" in wheel.namelist()
        assert callable(getattr(importlib.import_module(module), function))


@pytest.mark.parametrize("folder", ["eval", "benchmarks"])
def test_scripts_are_not_packages_and_do_not_touch_sys_path(folder):
    assert not (REPO / folder / "__init__.py").exists()
    offenders = [p.name for p in (REPO / folder).glob("*.py") if "sys.path" in p.read_text()]
    assert offenders == []


def test_eval_scripts_run_the_library_command_lines(monkeypatch, capsys):
    """``python eval/X.py`` is the library's CLI: the script, run as ``__main__``, prints the same --help as the console
    script's module."""
    import runpy

    scripts = {"perplexity": "bilinear_lm.evaluation.perplexity", "state_tracking": "bilinear_lm.probes.cli",
               "recall": "bilinear_lm.probes.recall_cli"}
    assert {p.stem for p in (REPO / "eval").glob("*.py")} == set(scripts)
    for name, module in scripts.items():
        script = REPO / "eval" / f"{name}.py"
        monkeypatch.setattr(sys, "argv", [str(script), "--help"])
        with pytest.raises(SystemExit) as done:
            runpy.run_path(str(script), run_name="__main__")
        assert done.value.code == 0
        parser = importlib.import_module(module).build_parser()
        parser.prog = f"{name}.py"
        assert capsys.readouterr().out == parser.format_help()


def _package_imports(path: Path) -> set[str]:
    """Modules of ``bilinear_lm`` that the file at ``path`` imports anywhere in it (lazy imports too), as dotted
    names (a relative import resolved against the file's package)."""
    import ast

    package = ".".join(path.relative_to(REPO).with_suffix("").parts[:-1])
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            name = ".".join(filter(None, [base, node.module or ""])) if node.level else node.module or ""
            found |= {name} | ({f"{name}.{alias.name}" for alias in node.names} if node.level else set())
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
    return {name for name in found if name.startswith("bilinear_lm")}


def test_imports_flow_one_way():
    """The kernels import nothing from the modeling code, the config nothing of the machinery it configures, the
    modeling modules import each other without a circle (lazy imports included), and the Gated DeltaNet peer's
    modules nothing of the bilinear model."""
    modeling = {p.stem: p for p in (REPO / "bilinear_lm" / "modeling").glob("*.py") if p.stem != "__init__"}
    for path in (REPO / "bilinear_lm" / "kernels").rglob("*.py"):
        assert not {m for m in _package_imports(path) if m.startswith("bilinear_lm.modeling")}, path
    assert _package_imports(modeling["configuration_bilinear"]) == set()
    edges = {name: {m.split(".")[2] for m in _package_imports(path) if m.startswith("bilinear_lm.modeling.")}
             & set(modeling) for name, path in modeling.items()}
    assert edges["dispatch"] and edges["modeling_bilinear"]  # the parse sees relative imports

    def reaches(start, goal, seen=()):
        return any(n == goal or (n not in seen and reaches(n, goal, (*seen, n))) for n in edges[start])

    circles = [name for name in modeling if reaches(name, name)]
    assert not circles, edges
    # the Gated DeltaNet peer's saved remote code holds nothing of the bilinear model
    peer = {n for n in modeling if reaches("modeling_gated_deltanet", n)}
    assert peer == {"configuration_gated_deltanet", "initialization", "transformers_compat"}, peer
