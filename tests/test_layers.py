"""Imports run only down the layers (README, architecture): every ``import`` / ``from ... import``
of every module, including those inside functions, read with ``ast`` (nothing is imported)."""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

# bottom first; a module may import its own layer and any layer below it
LAYERS = (
    ("pallas_kernels",),
    ("mtraining_jax", "mtraining_jax.layouts", "mtraining_jax.mesh", "mtraining_jax.ring"),
    ("mtraining_jax.sparsity",),
    ("mtraining_jax.attention",),
    ("mtraining_jax.model",),
    ("mtraining_jax.train",),
    ("mtraining_jax.eval",),
    ("mtraining_jax.apps",),
    ("benchmarks",),
)

# Known upward imports, (importer, imported). Each entry is a debt, not a rule: remove it when fixed.
ALLOWED: set = set()


def layer(module: str) -> int | None:
    """Index in :data:`LAYERS` of the longest prefix naming ``module``'s layer (None: outside)."""
    best, idx = -1, None
    for i, prefixes in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best:
                best, idx = len(p), i
    return idx


def module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: pathlib.Path, text: str | None = None) -> set[str]:
    """Absolute names of every module ``path`` imports (relative imports resolved; for
    ``from pkg import name``, ``pkg.name``, which :func:`layer` places by its longest prefix)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text() if text is None else text, str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            out.update(f"{base}.{a.name}" for a in node.names)
    return out


def modules():
    for pkg in ("pallas_kernels", "mtraining_jax", "benchmarks"):
        yield from sorted((ROOT / pkg).rglob("*.py"))


def upward_imports(texts: dict | None = None) -> set[tuple[str, str]]:
    """``(importer, imported)`` module pairs whose import runs up the layers; ``texts``: source to
    read instead of some files (``{path: text}``)."""
    bad = set()
    for path in modules():
        me = module_name(path)
        mine = layer(me)
        for target in imports(path, (texts or {}).get(path)):
            theirs = layer(target)
            if theirs is not None and theirs > mine:
                bad.add((me, _module_of(target)))
    return bad


def _module_of(target: str) -> str:
    """``pkg.mod.name`` -> ``pkg.mod`` when ``name`` is not itself a module file or package."""
    path = ROOT.joinpath(*target.split("."))
    return target if path.with_suffix(".py").exists() or path.is_dir() else target.rpartition(".")[0]


def test_every_module_is_in_a_layer():
    assert [module_name(p) for p in modules() if layer(module_name(p)) is None] == []


def test_imports_only_run_down_the_layers():
    bad = upward_imports()
    assert sorted(bad - ALLOWED) == [], "upward imports (importer, imported); see LAYERS"
    assert sorted(ALLOWED - bad) == [], "allow-list entries that no longer occur: remove them"


@pytest.mark.parametrize("source, module, expected", [
    ("from mtraining_jax.train.loop import setup", "mtraining_jax.model.qwen2", "mtraining_jax.train.loop"),
    ("from ..train import loop", "mtraining_jax.model.qwen2", "mtraining_jax.train.loop"),
    ("import benchmarks.hlo", "pallas_kernels.api", "benchmarks.hlo"),
])
def test_an_upward_import_is_found(source, module, expected):
    path = ROOT.joinpath(*module.split(".")).with_suffix(".py")
    texts = {path: path.read_text() + "\n\ndef _f():\n    " + source + "\n"}  # even inside a function
    assert (module, expected) in upward_imports(texts) - upward_imports()
