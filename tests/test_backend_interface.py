"""Both backends implement kda_kcp.backend.Backend, and the shared core never asks which backend it has."""

import ast
import inspect
from pathlib import Path

import pytest
import torch

import kda_kcp
from kda_kcp.backend import TORCH, Backend
from kda_kcp.cuda import CudaBackend
from kda_kcp.torch_backend import TorchBackend

PACKAGE = Path(kda_kcp.__file__).parent
CORE = ("function.py", "steps.py", "sizing.py", "workspace.py", "states.py", "validate.py", "fla.py", "demo.py",
        "library.py", "entries.py")


def _members(cls) -> set[str]:
    """The Protocol's methods and annotated attributes."""
    names = {n for n, v in vars(cls).items() if inspect.isfunction(v)}
    return names | set(cls.__annotations__)


@pytest.mark.parametrize("backend", [TorchBackend(), CudaBackend(True), CudaBackend(False)], ids=repr)
def test_backends_implement_the_protocol(backend):
    assert isinstance(backend, Backend)
    missing = [n for n in sorted(_members(Backend)) if not hasattr(backend, n)]
    assert missing == []
    for name in _members(Backend) - set(Backend.__annotations__):
        assert callable(getattr(backend, name)), name


def test_the_protocol_names_what_the_core_calls():
    """Every attribute the core reads off a name ``backend`` is a member of the Protocol."""
    used = set()
    for name in CORE:
        for node in ast.walk(ast.parse((PACKAGE / name).read_text())):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "backend":
                used.add((name, node.attr))
    assert used, "the core names a backend somewhere"
    assert sorted((f, a) for f, a in used if a not in _members(Backend)) == []


def _name_comparisons(tree: ast.AST) -> list[str]:
    """Comparisons of anything with the string "cuda" or "torch" that read a ``.name`` (a backend's name)."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Compare):
            continue
        parts = [node.left, *node.comparators]
        names = {p.value for p in parts if isinstance(p, ast.Constant) and isinstance(p.value, str)}
        reads_name = any(isinstance(n, ast.Attribute) and n.attr == "name" for p in parts for n in ast.walk(p))
        reads_name |= any(isinstance(n, ast.Name) and "backend" in n.id for p in parts for n in ast.walk(p))
        if names & {"cuda", "torch"} and reads_name:
            found.append(ast.unparse(node))
    return found


def test_the_core_never_compares_backend_names():
    for name in CORE:
        assert _name_comparisons(ast.parse((PACKAGE / name).read_text())) == [], name


def test_the_name_check_sees_a_comparison():
    """(the check above finds what it looks for)"""
    tree = ast.parse('if backend.name == "cuda": pass\nif backend_name != "torch": pass\nif x.type == "cuda": pass')
    assert _name_comparisons(tree) == ["backend.name == 'cuda'", "backend_name != 'torch'"]


# a byte query for a GPU this machine lacks (kda_workspace_bytes_kcp(..., arch=)) makes the CUDA backend itself
PLANNING = {"CudaBackend", "planning_sm_count"}


def test_the_core_imports_no_backend_internals():
    """The core reaches a backend through the Protocol (and select_backend), never through its modules."""
    for name in CORE:
        for node in ast.walk(ast.parse((PACKAGE / name).read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 1:
                top = node.module.split(".")[0]
                assert top != "torch_backend", (name, node.module)
                if top == "cuda":
                    assert {a.name for a in node.names} <= PLANNING, (name, node.module)


def test_summary_and_input_dtypes():
    bf = torch.zeros(1, 1, 128, dtype=torch.bfloat16)
    f64 = torch.zeros(1, 1, 4, dtype=torch.float64)
    assert CudaBackend(True).summary_dtype(bf, f64) == torch.float32
    assert TORCH.summary_dtype(bf) == torch.float32 and TORCH.summary_dtype(bf, f64) == torch.float64
    assert CudaBackend(True).grad_output(f64).dtype == torch.bfloat16
    assert TORCH.grad_output(f64) is f64
    assert TORCH.input_dtypes(bf, bf, f64, bf, bf) == (torch.float64, torch.float32, torch.bfloat16)
    assert CudaBackend(True).input_dtypes(f64, f64, f64, f64, f64) == (torch.bfloat16, torch.float32, torch.bfloat16)
