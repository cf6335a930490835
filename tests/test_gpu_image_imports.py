"""`python -m pytest -m gpu` must collect on the GPU image, which lacks some of this project's test
extras (nbformat / nbclient were imported at module level once and broke the whole GPU run): every
module-level import of a test file is the standard library, this project, or a package of that image
(the device machines' package list, read 2026-11-17). Optional packages go inside the test that needs them."""

import ast
import pathlib
import sys

TESTS = pathlib.Path(__file__).resolve().parent
PROJECT = {"mtraining_jax", "pallas_kernels", "benchmarks"}
# the GPU image's packages this project's tests may import at module level (import names)
GPU_IMAGE = {"jax", "jaxlib", "numpy", "pytest", "chex", "hypothesis", "flax", "optax", "orbax", "torch",
             "transformers", "safetensors", "yaml", "matplotlib", "tqdm", "ml_dtypes", "scipy", "psutil",
             "xdist", "pytest_timeout", "_pytest"}


def module_level_imports(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text())
    roots = set()
    for node in tree.body:  # module level only (not inside functions or classes)
        if isinstance(node, ast.Import):
            roots |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
    return roots


def not_on_gpu_image(path: pathlib.Path) -> set[str]:
    local = {p.stem for p in TESTS.glob("*.py")}
    return {m for m in module_level_imports(path)
            if m not in sys.stdlib_module_names and m not in PROJECT | GPU_IMAGE | local and m != "__future__"}


def test_every_test_file_collects_on_the_gpu_image():
    bad = {p.name: sorted(not_on_gpu_image(p)) for p in sorted(TESTS.glob("*.py"))}
    assert not {k: v for k, v in bad.items() if v}, bad


def test_the_check_catches_a_module_level_import(tmp_path):
    f = tmp_path / "t.py"
    f.write_text("import os\nimport nbformat\nfrom jax import numpy\n\ndef test():\n    import nbclient\n")
    assert not_on_gpu_image(f) == {"nbformat"}
