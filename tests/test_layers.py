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
# Within p2p/: the serving client side never imports the server side (Petals keeps client/ and
# server/ apart), and the peer (node.py) imports no client module.
SERVER = ("blocktrain.p2p.serving.server", "blocktrain.p2p.serving.hop", "blocktrain.p2p.serving.batching",
          "blocktrain.p2p.serving.fair")
FORBIDDEN_MODULES = {
    "blocktrain.p2p.serving.client": SERVER,
    "blocktrain.p2p.serving.verify": SERVER,
    "blocktrain.p2p.serving.api": SERVER + ("blocktrain.p2p.serving.client", "blocktrain.p2p.serving.verify"),
    "blocktrain.p2p.view": SERVER + ("blocktrain.p2p.serving.client",),
    "blocktrain.p2p.node": ("blocktrain.p2p.view", "blocktrain.p2p.serving.client", "blocktrain.p2p.serving.verify"),
}


def imports(path: Path, package: str):
    """(line, imported module, names) for every import in the file, relative ones resolved
    against ``package`` (the file's own package, at any depth)."""
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
    """(path, its package, its module name) of every module of every layer, subpackages included."""
    for folder, package in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            pkg = ".".join([package, *parts[:-1]])
            yield path, pkg, pkg if parts[-1] == "__init__" else f"{pkg}.{parts[-1]}"


def test_every_layer_imports_only_what_it_may():
    bad = []
    for path, package, me in modules():
        layer = ".".join(package.split(".")[:2])
        for line, mod, names in imports(path, package):
            targets = {mod} | {f"{mod}.{n}" for n in names}  # `from . import hop` imports a module too
            for f in FORBIDDEN.get(layer, ()) + FORBIDDEN_MODULES.get(me, ()):
                if any(t == f or t.startswith(f + ".") for t in targets):
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


def _found(tmp_path: Path, text: str, package: str) -> set[str]:
    """The modules a file of ``package`` holding ``text`` imports, as the checks above read them."""
    src = tmp_path / "_layer_probe.py"
    src.write_text(text)
    return {m for _, m, _ in imports(src, package)}


def test_the_checker_sees_violations(tmp_path):
    """The walk above must find imports inside functions and resolve relative ones, at any depth."""
    assert _found(tmp_path, "def f():\n    from ..p2p import node\n    import asyncio\n",
                  "blocktrain.blocks") == {"blocktrain.p2p", "asyncio"}
    deep = {name: pkg for path, pkg, name in modules()}
    assert deep["blocktrain.p2p.serving.client"] == "blocktrain.p2p.serving"  # subpackages are walked
    assert deep["blocktrain.p2p.averaging.round"] == "blocktrain.p2p.averaging"
    assert _found(tmp_path, "from .server import PipelineServer\nfrom ..view import holders\n",
                  "blocktrain.p2p.serving") == {"blocktrain.p2p.serving.server", "blocktrain.p2p.view"}
