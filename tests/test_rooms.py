"""Rooms stay small: no class in p2p/ over 300 lines, no function in p2p/ over 60 nor in bench/ over
80 lines; a room that outgrows its bound is split by concern. A room over its bound today is listed
below by name with its size: it may shrink, never grow, and no other may join the list."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# (folder, the most lines of a class, the most lines of a function or method)
BOUNDS = (("p2p", 300, 60), ("bench", None, 80))
# Rooms over their bound today, "path:Qualified.name" -> its lines then: still to be split.
OVER: dict[str, int] = {}


def rooms(path: Path):
    """(qualified name, is a class, lines) of every class, function and method in the file, nested
    ones included (``end_lineno - lineno + 1``, decorators not counted)."""
    def walk(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                name = prefix + child.name
                yield name, isinstance(child, ast.ClassDef), child.end_lineno - child.lineno + 1
                yield from walk(child, name + ".")
            else:
                yield from walk(child, prefix)
    yield from walk(ast.parse(path.read_text(), str(path)), "")


def test_no_room_grows_past_its_bound():
    over = []
    for folder, max_class, max_function in BOUNDS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            for name, is_class, lines in rooms(path):
                bound = max_class if is_class else max_function
                key = f"{path.relative_to(ROOT).as_posix()}:{name}"
                if bound is not None and lines > max(bound, OVER.get(key, 0)):
                    over.append(f"{key}: {lines} lines (at most {max(bound, OVER.get(key, 0))})")
    assert not over, "rooms too large (split them by concern):\n" + "\n".join(over)


def test_the_measure_counts_nested_rooms(tmp_path):
    path = tmp_path / "probe.py"
    path.write_text("class A:\n    def f(self):\n        def g():\n            pass\n        return g\n")
    assert list(rooms(path)) == [("A", True, 5), ("A.f", False, 4), ("A.f.g", False, 2)]
