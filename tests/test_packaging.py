"""What a (non-editable) install ships, read from pyproject.toml: every package, the lm-eval task YAMLs as
package data of bilinear_lm, console scripts that resolve to a ``main``; and no sys.path inserts in scripts."""
import importlib
import re
from pathlib import Path

import pytest

import bilinear_lm
from bilinear_lm.evaluation.harness import TASKS_DIR

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

REPO = Path(__file__).resolve().parents[1]
SETUPTOOLS = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]


def package_folder(name: str) -> Path:
    """The source folder of an installed package name, following [tool.setuptools.package-dir]."""
    mapped = SETUPTOOLS.get("package-dir", {})
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        if ".".join(parts[:i]) in mapped:
            return REPO / mapped[".".join(parts[:i])] / Path(*parts[i:])
    return REPO / Path(*parts)


def shipped_data() -> set[Path]:
    """The files [tool.setuptools.package-data] puts in the wheel."""
    return {path for name in SETUPTOOLS["packages"] for pattern in SETUPTOOLS["package-data"].get(name, [])
            for path in package_folder(name).glob(pattern)}


def test_every_package_folder_is_listed():
    listed = {package_folder(name) for name in SETUPTOOLS["packages"]}
    assert all(folder.is_dir() and (folder / "__init__.py").is_file() for folder in listed)
    roots = [package_folder(name) for name in SETUPTOOLS["packages"] if "." not in name or
             name in SETUPTOOLS.get("package-dir", {})]
    found = {init.parent for root in roots for init in root.rglob("__init__.py") if "__pycache__" not in init.parts}
    assert found - listed == set(), "add these folders to [tool.setuptools] packages in pyproject.toml"


def test_lm_eval_tasks_are_package_data():
    """The default include path is inside the bilinear_lm package (not a repo folder), and every task YAML there
    is matched by a package-data pattern, with its ``!function`` module beside it in the same package."""
    package_dir = Path(bilinear_lm.__file__).resolve().parent
    assert TASKS_DIR.is_relative_to(package_dir)
    yamls = sorted(TASKS_DIR.rglob("*.yaml"))
    names = {re.search(r"^task: (\S+)", y.read_text(), re.M).group(1) for y in yamls}
    assert {"wikitext2_local", "lambada_openai_local", "probe_parity"} <= names
    assert set(yamls) <= shipped_data()
    for y in yamls:
        for module, function in re.findall(r"!function (\w+)\.(\w+)", y.read_text()):
            assert (y.parent / "__init__.py").is_file()  # a listed package (checked above), so the .py ships
            package = ".".join(y.parent.relative_to(package_dir.parent).parts)
            assert callable(getattr(importlib.import_module(f"{package}.{module}"), function))


def test_every_data_file_of_bilinear_lm_ships():
    """Non-Python files in the bilinear_lm folder (presets, task YAMLs, kernel sources) are package data."""
    data = {p for p in (REPO / "bilinear_lm").rglob("*") if p.is_file() and p.suffix not in (".py", ".pyc")}
    assert data - shipped_data() == set(), "add these to [tool.setuptools.package-data] in pyproject.toml"


def test_console_scripts_resolve_to_main():
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert {"bilinear-perplexity", "bilinear-probes", "bilinear-recall", "bilinear-speed",
            "bilinear-equal-time"} <= set(scripts)
    for target in scripts.values():
        module, _, function = target.partition(":")
        package, _, leaf = module.rpartition(".")
        assert package in SETUPTOOLS["packages"]
        source = package_folder(package) / f"{leaf}.py"
        assert re.search(rf"^def {function}\(argv=None\)", source.read_text(), re.M), source


@pytest.mark.parametrize("folder", ["eval", "benchmarks"])
def test_scripts_do_not_touch_sys_path(folder):
    offenders = [p.name for p in (REPO / folder).glob("*.py") if "sys.path" in p.read_text()]
    assert offenders == []
