"""flatshard/_C.pyi (hand-written) names exactly what the extension flatshard._C defines:
every module-level name, class and class member, in both directions. A binding change that
forgets the stub (or a stub entry for a method that went away) fails here."""

import ast
import inspect
from pathlib import Path

import flatshard._C as C

STUB = Path(__file__).resolve().parents[2] / "client" / "python" / "flatshard" / "_C.pyi"


def _stub_names():
    """{class name: set of member names} and the set of module-level function names."""
    tree = ast.parse(STUB.read_text())
    classes, functions = {}, set()
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            classes[node.name] = {
                n.name for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                and (not n.name.startswith("__") or n.name == "__init__")}
        elif isinstance(node, ast.FunctionDef):
            functions.add(node.name)
    return classes, functions


def _ext_names():
    classes, functions = {}, set()
    for name, obj in vars(C).items():
        if name.startswith("__"):
            continue
        if inspect.isclass(obj):
            classes[name] = {a for a in vars(obj) if not a.startswith("__")}
        elif callable(obj):
            functions.add(name)
    return classes, functions


def test_stub_names_the_extension():
    stub_classes, stub_functions = _stub_names()
    ext_classes, ext_functions = _ext_names()
    assert set(stub_classes) == set(ext_classes)
    assert stub_functions == ext_functions
    for name, members in ext_classes.items():
        stub = stub_classes[name] - {"__init__"}
        assert stub == members, f"_C.{name}: stub-only {stub - members}, missing {members - stub}"


def test_stub_init_exactly_where_python_can_construct():
    """pybind11 classes without a py::init refuse construction ("No constructor defined!");
    the stub declares __init__ for exactly the others."""
    stub_classes, _ = _stub_names()
    for name, members in stub_classes.items():
        try:
            getattr(C, name)()
            constructible = True
        except TypeError as e:
            constructible = "No constructor defined" not in str(e)
        assert ("__init__" in members) == constructible, name
