"""No production function over 100 lines of code (its docstring not counted: documenting every
parameter is wanted, not a length to cut), measured with Python's ast. The exceptions are
listed with their reason, and the list may only shrink: an exception that is now short enough
fails the test too, so that it is taken off."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LIMIT = 100
# Not production: the tests themselves, and the example training script users copy from.
OUTSIDE = {"tests", "examples", ".venv", "build"}
# none today; an entry is "path:function": "why it cannot be cut"
EXCEPTIONS: dict[str, str] = {}


def code_lines(fn: ast.FunctionDef) -> int:
    """Lines of a function, its docstring left out."""
    n = fn.end_lineno - fn.lineno + 1
    first = fn.body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
        if isinstance(first.value.value, str):
            n -= first.end_lineno - first.lineno + 1
    return n


def long_functions(root: Path = ROOT) -> dict[str, int]:
    """'path:name' -> lines, for every function over LIMIT in the production code."""
    out = {}
    for path in sorted(root.glob("*/**/*.py")):
        rel = path.relative_to(root)
        if OUTSIDE & set(rel.parts):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = code_lines(node)
                if lines > LIMIT:
                    out[f"{rel}:{node.name}"] = lines
    return out


def test_no_production_function_is_over_the_limit():
    long = long_functions()
    new = {k: v for k, v in long.items() if k not in EXCEPTIONS}
    assert not new, f"functions over {LIMIT} lines of code (cut them): {new}"


def test_every_exception_is_still_needed():
    fixed = sorted(set(EXCEPTIONS) - set(long_functions()))
    assert not fixed, f"no longer over {LIMIT} lines: take them off EXCEPTIONS: {fixed}"


def test_the_measure_sees_a_long_function(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    body = "\n".join(f"    x{i} = {i}" for i in range(LIMIT + 1))
    (pkg / "m.py").write_text(
        f'def f():\n    """doc\n    string"""\n{body}\n\n\ndef g():\n    pass\n'
    )
    assert long_functions(tmp_path) == {"pkg/m.py:f": LIMIT + 2}


def test_every_exception_says_why():
    for name, reason in EXCEPTIONS.items():
        assert len(reason.split()) >= 5, f"{name}: say why it is an exception"


C_LIMIT = 600  # lines of one C file of the host library: its units are cut along their seams


def test_no_host_c_file_is_over_the_limit():
    long = {
        p.name: n
        for p in sorted((ROOT / "hostlib").glob("*.c"))
        if (n := len(p.read_text().splitlines())) > C_LIMIT
    }
    assert not long, f"hostlib C files over {C_LIMIT} lines: {long}"
