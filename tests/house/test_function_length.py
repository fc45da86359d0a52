"""No production function over 100 lines of code (its docstring not counted: documenting every
parameter is wanted, not a length to cut), measured with Python's ast. The exceptions are
listed with their reason, and the list may only shrink: an exception that is now short enough
fails the test too, so that it is taken off."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
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


# C (the host library's fast path and the BPF program): no function body over C_LIMIT lines, as
# the kernel's coding style asks of functions that do one thing; kernel style puts a function's
# braces alone at column 0, which is how they are found. The exceptions may only shrink too.
C_LIMIT = 80
C_DIRS = ("hostlib", "bpf")
C_EXCEPTIONS: dict[str, str] = {}  # none today; an entry says why, as EXCEPTIONS'


def c_functions(text: str) -> dict[str, int]:
    """name -> lines of its body, for every function defined in C source `text` (kernel style:
    the opening and closing braces of a function alone on their lines at column 0)."""
    out, lines, start, name = {}, text.splitlines(), None, "?"
    for i, line in enumerate(lines):
        if line == "{":
            j = i - 1
            while j > 0 and "(" not in lines[j]:
                j -= 1  # the parameters may take several lines: the name is before the "("
            m = re.search(r"(\w+)\s*\(", lines[j])
            name, start = (m[1] if m else "?"), i
        elif line == "}" and start is not None:
            out[name] = i - start - 1
            start = None
    return out


def long_c_functions(root: Path = ROOT) -> dict[str, int]:
    """'path:name' -> body lines, for every C function over C_LIMIT in C_DIRS."""
    out = {}
    for d in C_DIRS:
        for path in sorted((root / d).glob("*.[ch]")):
            for name, n in c_functions(path.read_text()).items():
                if n > C_LIMIT:
                    out[f"{path.relative_to(root)}:{name}"] = n
    return out


def test_no_c_function_is_over_the_limit():
    new = {k: v for k, v in long_c_functions().items() if k not in C_EXCEPTIONS}
    assert not new, f"C functions over {C_LIMIT} lines (cut them): {new}"


def test_every_c_exception_is_still_needed_and_says_why():
    fixed = sorted(set(C_EXCEPTIONS) - set(long_c_functions()))
    assert not fixed, f"no longer over {C_LIMIT} lines: take them off C_EXCEPTIONS: {fixed}"
    assert all(len(why.split()) >= 5 for why in C_EXCEPTIONS.values())


def test_the_c_measure_sees_each_function():
    body = "\n".join("\tx++;" for _ in range(C_LIMIT + 1))
    src = f"static int f(int a,\n\t     int b)\n{{\n{body}\n}}\n\nvoid g(void)\n{{\n\treturn;\n}}\n"
    assert c_functions(src) == {"f": C_LIMIT + 1, "g": 1}
