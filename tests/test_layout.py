"""The package's shape: the import contracts hold, and a wheel carries every subpackage of the library, the
lab and the server, and no repository tooling (tools/)."""

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_import_contract_holds():
    """The layers (commands, lab, server, exercises > options > engine > techniques > core), the techniques
    independent of each other, the library importing no lab, server or command (pyproject.toml,
    [tool.importlinter])."""
    lint = Path(sys.executable).parent / "lint-imports"
    p = subprocess.run([str(lint)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "0 broken" in p.stdout


def test_the_wheel_holds_every_subpackage_and_no_tooling(tmp_path):
    src = tmp_path / "src"  # a clean copy, so that no build folder of an earlier run leaks into the wheel
    for folder in ("minillm", "tools"):  # tools/ beside the package, as in the repository: it must stay out
        shutil.copytree(ROOT / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__"))
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
    assert {"minillm/lab/__init__.py", "minillm/lab/records.py", "minillm/lab/peers.py",
            "minillm/server/__init__.py", "minillm/server/app.py"} <= names  # the lab and the server ship
    assert {"minillm/lab/replay_page.html", "minillm/fast/kernels/dense.cpp"} <= names  # and the files they read
    assert not [n for n in names if n.startswith("tools/") or "/tables/" in n], "repository tooling is in the wheel"
    assert (ROOT / "tools" / "tables" / "__init__.py").exists()  # it exists, beside the package
