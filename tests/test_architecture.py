"""The layering of the code (docs/architecture.md): `hybrid` -> `moe` -> `moe.quant`, nothing importing upwards,
no import cycles, no module touching another's private attributes, private PyTorch operators only behind the
kernel seams.

Two independent checks of the direction: every module is imported alone in a process where none of the
project's modules were imported before (a subprocess that has imported only torch forks once per module) and
`sys.modules` is read afterwards; and a scan of every import statement in the source, function-level ones and
`importlib.import_module("...")` strings included, since those run only when called.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("hybrid", "moe")
KERNEL_SEAMS = ("moe/quant/kernels/",)  # where private PyTorch operators may appear
MODULE_NAME = re.compile(r"^(hybrid|moe)(\.\w+)*$")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


FILES = {module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}
MODULES = sorted(m for m in FILES if not m.endswith(".__main__"))  # entry points run on import


def is_package(name: str) -> bool:
    return FILES[name].name == "__init__.py"


def imported_names(name: str) -> set[str]:
    """Every project module that module `name` imports anywhere in its source (resolved to modules), with the
    package `__init__`s a `from package import x` runs; imports of the module's own ancestor packages are
    left out (Python has initialised them before the module runs)."""
    tree = ast.parse(FILES[name].read_text())
    package = name if is_package(name) else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) in (
                "import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant):
            found.add(str(node.args[0].value))  # importlib.import_module("...")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and "." in node.value \
                and MODULE_NAME.match(node.value):
            found.add(node.value)  # dotted module names in strings: lazy export tables
    ancestors = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}
    return {m for m in found if m in FILES and m != name and m not in ancestors}


# ------------------------------------------------------------------------------------------ fresh imports
_FORK_RUNNER = r"""
import importlib, json, os, sys
import torch  # the one heavy third-party import, done once before forking
modules = json.loads(sys.argv[1])
for name in modules:
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        try:
            before = sorted(m for m in sys.modules if m.split(".")[0] in ("hybrid", "moe"))
            module = importlib.import_module(name)
            for attr in getattr(module, "__all__", []):  # every public name, `from module import name`
                getattr(module, attr)
            loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("hybrid", "moe"))
            result = {"before": before, "loaded": loaded}
        except BaseException as e:
            result = {"error": f"{type(e).__name__}: {e}"}
        os.write(write, json.dumps(result).encode())
        os._exit(0)
    os.close(write)
    chunks = []
    while chunk := os.read(read, 1 << 16):
        chunks.append(chunk)
    os.close(read)
    os.waitpid(pid, 0)
    print(json.dumps({"module": name, **json.loads(b"".join(chunks) or b'{"error": "no result"}')}))
"""


@pytest.fixture(scope="module")
def fresh_imports() -> dict[str, dict]:
    """{module: {"before": [...], "loaded": [...]} or {"error": ...}}, each module imported alone."""
    r = subprocess.run([sys.executable, "-c", _FORK_RUNNER, json.dumps(MODULES)], cwd=ROOT, capture_output=True,
                       text=True, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 0, r.stderr[-3000:]
    results = {}
    for line in r.stdout.splitlines():
        if line.startswith("{"):
            record = json.loads(line)
            results[record.pop("module")] = record
    return results


def test_every_module_imports_alone(fresh_imports):
    assert sorted(fresh_imports) == MODULES
    errors = {m: r["error"] for m, r in fresh_imports.items() if "error" in r}
    assert not errors, errors
    assert all(r["before"] == [] for r in fresh_imports.values())  # no project module before the import


def test_moe_never_loads_hybrid(fresh_imports):
    for name, r in fresh_imports.items():
        if name.split(".")[0] == "moe":
            assert not [m for m in r["loaded"] if m.split(".")[0] == "hybrid"], name


def test_moe_quant_loads_nothing_of_moe_outside_it(fresh_imports):
    for name, r in fresh_imports.items():
        if name == "moe.quant" or name.startswith("moe.quant."):
            outside = [m for m in r["loaded"] if m.split(".")[0] == "hybrid"
                       or (m.startswith("moe.") and not (m == "moe.quant" or m.startswith("moe.quant.")))]
            assert not outside, (name, outside)


def test_the_public_names_import_in_a_fresh_process():
    """`import moe`, `from moe import X` for every public name, `import hybrid`: each in its own process."""
    import moe

    for statement in ["import moe", "import hybrid", "import moe.quant", f"from moe import {', '.join(moe.__all__)}"]:
        r = subprocess.run([sys.executable, "-c", statement], cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, (statement, r.stderr[-2000:])


# ------------------------------------------------------------------------------------------ static scan
def test_source_imports_run_downwards():
    """Function-level imports and import strings included: moe -> no hybrid; moe.quant -> nothing of moe
    outside moe.quant."""
    for name in FILES:
        targets = imported_names(name)
        if name.split(".")[0] == "moe":
            assert not {t for t in targets if t.split(".")[0] == "hybrid"}, name
        if name == "moe.quant" or name.startswith("moe.quant."):
            outside = {t for t in targets if t.startswith("moe") and not (t == "moe.quant" or t.startswith("moe.quant."))}
            assert not outside - {"moe"}, (name, outside)


def test_no_import_cycles():
    graph = {name: imported_names(name) for name in FILES}
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                pytest.fail("import cycle: " + " -> ".join(path[path.index(nxt):] + [node, nxt]))
            if nxt not in state:
                visit(nxt, path + [node])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [])


def test_the_scanner_sees_lazy_imports_and_import_strings():
    """The scan above could not fail if it missed imports inside functions or importlib strings."""
    assert "moe.quant.kernels.triton" in imported_names("moe.quant.kernels")  # a function-level import
    assert "moe.experts" in imported_names("moe")  # the lazy export table's strings


def _private_uses(path: Path) -> list[str]:
    """`x._name` where x is not self, cls or super(), and `from m import _name`, in one file."""
    uses = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            owner = node.value
            if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
                continue
            if isinstance(owner, ast.Call) and isinstance(owner.func, ast.Name) and owner.func.id == "super":
                continue  # nn.Module extension hooks (_save_to_state_dict, _apply, ...)
            uses.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.ImportFrom):
            uses += [f"{path.relative_to(ROOT)}:{node.lineno}: from {node.module} import {a.name}"
                     for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
    return uses


def test_no_module_touches_private_attributes_outside_the_kernel_seams():
    files = [p for p in FILES.values()] + sorted((ROOT / "scripts").glob("*.py"))
    uses = [u for p in files for u in _private_uses(p) if not str(p.relative_to(ROOT)).startswith(KERNEL_SEAMS)]
    assert not uses, uses


def test_private_torch_operators_are_listed_in_the_architecture_doc():
    doc = (ROOT / "docs" / "architecture.md").read_text()
    ops = {m.group(0) for p in FILES.values() if str(p.relative_to(ROOT)).startswith(KERNEL_SEAMS)
           for m in re.finditer(r"torch\.ops\.\w+\._\w+", p.read_text())}
    assert ops, "the seam uses no private operator: the test would check nothing"
    assert not {op for op in ops if f"`{op}`" not in doc}, ops


# ------------------------------------------------------------------------------------------ kernel choices
SEAMS = ("hybrid/ops/", "moe/quant/kernels/")  # where an operation picks its kernel
KERNEL_QUESTIONS = {"is_cuda", "cpu_for", "triton_for", "triton_kernels", "cpu_kernels", "gpu_path"}  # asked of a forward's tensors
KERNEL_MODULES = re.compile(r"^(hybrid\.ops\.(cpu|triton_mamba|triton_attention)"
                            r"|moe\.quant\.kernels\.(cpu|triton|bf16|amx|onednn|build))$")
# not in a forward: they build the kernels ahead, name what runs on a device, or prepack weights at load
LOAD_TIME = {"hybrid/cli.py", "hybrid/devices.py", "hybrid/loading.py", "moe/prepack.py"}


def _kernel_lookups(path: Path) -> list[str]:
    """Where `path` asks which kernel runs (`x.is_cuda`, `kernels.cpu_for(...)`, `backend.cpu_kernels(...)`, ...)
    or imports a kernel module."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        name = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else None
        if name in KERNEL_QUESTIONS:
            found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {name}")
        if isinstance(node, ast.ImportFrom) and node.module:
            modules = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            found += [f"{path.relative_to(ROOT)}:{node.lineno}: import {m}" for m in modules if KERNEL_MODULES.match(m)]
        elif isinstance(node, ast.Import):
            found += [f"{path.relative_to(ROOT)}:{node.lineno}: import {a.name}" for a in node.names
                      if KERNEL_MODULES.match(a.name)]
    return found


def test_kernel_choices_live_in_the_seams():
    """Only `hybrid/ops` and `moe/quant/kernels` ask which kernel runs or import a kernel module (and the
    load-time modules, which build kernels or prepack weights before any forward): a layer calls an operation,
    the operation picks its kernel beside its reference."""
    lookups = {p: _kernel_lookups(p) for p in FILES.values()
               if not str(p.relative_to(ROOT)).startswith(SEAMS) and str(p.relative_to(ROOT)) not in LOAD_TIME}
    offenders = {str(p.relative_to(ROOT)): found for p, found in lookups.items() if found}
    assert not offenders, offenders
    scanned = _kernel_lookups(ROOT / "moe" / "quant" / "kernels" / "experts.py")
    assert scanned, "the scan finds nothing in the seam itself: the test would check nothing"


def test_no_layer_probes_its_cache_with_hasattr():
    """The layers and the model speak one cache-handle protocol: no `hasattr` on what `Cache.layer` gives."""
    files = sorted((ROOT / "hybrid" / "layers").glob("*.py")) + [ROOT / "hybrid" / "model.py"]
    probes = [f"{p.relative_to(ROOT)}:{node.lineno}" for p in files for node in ast.walk(ast.parse(p.read_text()))
              if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "hasattr"]
    assert not probes, probes
