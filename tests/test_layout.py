"""The package's shape: the import contract holds, and a wheel carries every subpackage."""

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_import_contract_holds():
    """Technique folders import the core and never each other; the core imports no technique
    (pyproject.toml, [tool.importlinter])."""
    lint = Path(sys.executable).parent / "lint-imports"
    p = subprocess.run([str(lint)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "0 broken" in p.stdout


def test_the_wheel_holds_every_subpackage(tmp_path):
    src = tmp_path / "src"  # a copy, so that no build folder of an earlier run leaks into the wheel
    shutil.copytree(ROOT / "minillm", src / "minillm", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    p = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                        str(tmp_path), str(src)], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    wheel = next(tmp_path.glob("minillm-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    packages = sorted(str(init.parent.relative_to(ROOT)) for init in (ROOT / "minillm").rglob("__init__.py"))
    assert len(packages) >= 5
    for pkg in packages:
        assert f"{pkg}/__init__.py" in names, f"{pkg} is missing from the wheel"
    assert {"minillm/quant/gptq.py", "minillm/speculative/rejection.py", "minillm/formats/gguf.py"} <= names
