"""The layering of DESIGN.md, checked on every import of every module (functions included)."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"protocol": "blocktrain.protocol", "blocks": "blocktrain.blocks", "p2p": "blocktrain.p2p",
            "bench": "blocktrain.bench"}
FORBIDDEN = {
    "blocktrain.protocol": ("asyncio", "socket", "selectors", "torch", "blocktrain.p2p", "blocktrain.blocks",
                            "blocktrain.bench"),
    "blocktrain.blocks": ("asyncio", "socket", "blocktrain.p2p", "blocktrain.protocol", "blocktrain.bench"),
    "blocktrain.p2p": ("blocktrain.bench",),
}


def imports(path: Path, package: str):
    """(line, imported module, names) for every import in the file, relative ones resolved."""
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield node.lineno, a.name, ()
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            yield node.lineno, mod, tuple(a.name for a in node.names)


def modules():
    for folder, package in PACKAGES.items():
        for path in sorted((ROOT / folder).glob("*.py")):
            yield path, package, f"{package}.{path.stem}"


def test_every_layer_imports_only_what_it_may():
    bad = []
    for path, package, _ in modules():
        for line, mod, _ in imports(path, package):
            for f in FORBIDDEN.get(package, ()):
                if mod == f or mod.startswith(f + "."):
                    bad.append(f"{path.relative_to(ROOT)}:{line} imports {mod}")
    assert not bad, "layer violations:\n" + "\n".join(bad)


def test_nothing_imports_a_cli_module_or_a_private_name_of_another_module():
    bad = []
    for path, package, me in modules():
        for line, mod, names in imports(path, package):
            if not mod.startswith("blocktrain."):
                continue
            if mod.endswith(".cli") and not me.endswith(".cli"):
                bad.append(f"{path.relative_to(ROOT)}:{line} imports the CLI module {mod}")
            for n in names:
                if n.startswith("_") and mod != me:
                    bad.append(f"{path.relative_to(ROOT)}:{line} imports the private name {mod}.{n}")
                if n == "cli" and not me.endswith(".cli"):
                    bad.append(f"{path.relative_to(ROOT)}:{line} imports a CLI module from {mod}")
    assert not bad, "\n".join(bad)


def test_the_checker_sees_violations():
    """The walk above must find imports inside functions and resolve relative ones."""
    src = ROOT / "tests" / "_layer_probe.py"
    src.write_text("def f():\n    from ..p2p import node\n    import asyncio\n")
    try:
        found = {m for _, m, _ in imports(src, "blocktrain.blocks")}
    finally:
        src.unlink()
    assert found == {"blocktrain.p2p", "asyncio"}
