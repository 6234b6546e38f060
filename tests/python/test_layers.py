"""The package's shape: no import cycles, and lower modules never import
higher ones (a save can be followed top to bottom)."""

from __future__ import annotations

import ast
import os

import fastpersist

PKG = os.path.dirname(fastpersist.__file__)

#: Module -> its layer. A module may import only modules of lower layers.
LAYERS = {
    "_core": 0,
    "errors": 1,
    "plan": 2,
    "options": 2,
    "pickling": 2,
    "collectives": 2,
    "torch_zip": 3,
    "safetensors_format": 3,
    "cuda_staging": 4,
    "distributed": 5,
    "writer": 6,
    "reader": 6,
    "verify": 7,
    "async_save": 7,
    "resume": 7,
    "tiers": 7.5,
    "replicas": 7.5,
    "checkpoint_manager": 8,
    "bench": 8,
    "cli": 9,
    "patching": 9,
    "testing": 9,
    "__init__": 10,
    "__main__": 10,  # python -m fastpersist: the command line
    # Public names of adapters (imported on demand, never by __init__).
    "dcp": 11,
}

#: Modules that re-export an adapter under a public name.
ADAPTER_ALIASES = {"dcp": "integrations.dcp"}


def _modules() -> dict:
    out = {}
    for root, _, files in os.walk(PKG):
        for f in files:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(root, f), PKG)[:-3].replace(os.sep, ".")
                out[rel] = os.path.join(root, f)
    return out


def _imports(path: str, module: str) -> set:
    """fastpersist modules imported anywhere in the file (functions included)."""
    tree = ast.parse(open(path).read())
    pkg_parts = module.split(".")[:-1]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg_parts[: len(pkg_parts) - (node.level - 1)] if node.level > 1 else pkg_parts
                target = ".".join([*base, node.module] if node.module else base)
                if node.module is None:
                    found |= {".".join([*base, a.name]) for a in node.names}
                else:
                    found.add(target)
            elif node.module and node.module.startswith("fastpersist"):
                found.add(node.module[len("fastpersist.") :] if node.module != "fastpersist" else "__init__")
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("fastpersist."):
                    found.add(a.name[len("fastpersist.") :])
    return {f if f else "__init__" for f in found}


def test_no_import_cycles() -> None:
    mods = _modules()
    graph = {m: {i for i in _imports(p, m) if i in mods or i == "_core"} - {m} for m, p in mods.items()}
    state: dict = {}

    def visit(m: str, stack: list) -> None:
        state[m] = "open"
        for n in sorted(graph.get(m, ())):
            if state.get(n) == "open":
                raise AssertionError("import cycle: " + " -> ".join([*stack, m, n]))
            if n not in state:
                visit(n, [*stack, m])
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m, [])


def test_lower_modules_import_only_lower_ones() -> None:
    mods = _modules()
    for m, p in mods.items():
        if m.startswith("integrations"):
            # Adapters sit on top: they may use anything but the CLI.
            assert "cli" not in _imports(p, m), m
            continue
        assert m in LAYERS, f"{m} has no layer: add it to LAYERS in {__file__}"
        for i in _imports(p, m):
            if i.startswith("integrations"):
                if ADAPTER_ALIASES.get(m) == i:
                    continue
                raise AssertionError(f"{m} imports the adapter {i}")
            assert LAYERS[i] < LAYERS[m], f"{m} (layer {LAYERS[m]}) imports {i} (layer {LAYERS[i]})"


def test_adapters_are_not_imported_by_the_package() -> None:
    """``import fastpersist`` imports no adapter (nor its framework)."""
    import subprocess
    import sys

    code = "import sys, fastpersist; print(sorted(m for m in sys.modules if m.startswith(('fastpersist.integrations', 'fastpersist.dcp', 'torch.distributed.checkpoint'))))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out


def test_no_private_names_cross_modules() -> None:
    """Modules use each other's public names only."""
    for m, p in _modules().items():
        tree = ast.parse(open(p).read())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level and node.module not in (None, "_core"):
                private = [a.name for a in node.names if a.name.startswith("_")]
                assert not private, f"{m} imports private names {private} from .{node.module}"
