"""The import rules of the design: packages follow the request path and imports point down.

Every `import` in lockgate is read from the source (function-level imports included) and
checked against the rules below; a new import that points up fails here with the module and
the line that broke the rule.
"""

from __future__ import annotations

import ast
import functools
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "lockgate"
GROUND = {"lockgate", "lockgate.config", "lockgate.datatypes", "lockgate.errors"}
GROUND |= {"lockgate.service_time", "lockgate.extras", "lockgate.parent_death"}
GENERATED = {"lockgate.protocol.grpc.inference_pb2", "lockgate.protocol.grpc.inference_pb2_grpc"}

# package -> packages it must never import
NEVER: dict[str, set[str]] = {
    "protocol": {"core", "frontend", "backends", "llm", "bench", "plan", "demo", "cli"},
    "core": {"protocol", "frontend", "llm", "bench", "plan", "demo", "cli"},
    "backends": {"core", "frontend", "llm", "protocol", "bench", "plan", "demo", "cli"},
    "llm": {"frontend", "protocol", "bench", "plan", "demo", "cli", "compose"},
    "cache": {"frontend", "protocol", "backends", "llm", "bench", "plan", "demo", "cli"},
    "compose": {"frontend", "protocol", "llm", "bench", "plan", "demo", "cli"},
    "bench": {"core", "frontend", "backends", "llm", "protocol", "demo", "cli"},
    "plan": {"core", "frontend", "backends", "llm", "protocol", "demo", "cli"},
    "frontend": {"bench", "plan", "cli"},
    "demo": {"core", "frontend", "protocol", "bench", "plan", "cli"},
    # the router is a process of its own in front of replicas: it holds no model
    "router": {"frontend", "compose", "cache", "backends", "llm", "bench", "plan", "demo", "cli"},
}
for _below in ("protocol", "core", "backends", "llm", "cache", "compose", "frontend"):
    NEVER[_below].add("router")
# the request path below the frontend: frontend -> compose -> cache -> core -> backends
for _lower in ("protocol", "core", "backends"):
    NEVER[_lower] |= {"cache", "compose"}
NEVER["cache"].add("compose")
for _tool in ("bench", "plan", "demo"):
    NEVER[_tool] |= {"cache", "compose"}


@dataclass(frozen=True, slots=True)
class Import:
    module: str  # the importing module
    target: str  # the imported module
    line: int


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> list[Import]:
    module = module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [Import(module, a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            found.append(Import(module, base, node.lineno))
            # `from lockgate.x import y` may import the module lockgate.x.y
            found += [
                Import(module, f"{base}.{a.name}", node.lineno)
                for a in node.names
                if (ROOT.parent / f"{base}.{a.name}".replace(".", "/")).with_suffix(".py").exists()
            ]
    return [i for i in found if i.target.startswith("lockgate")]


@functools.cache
def all_imports() -> tuple[Import, ...]:
    """Every lockgate import in the package, read once for all the tests below."""
    return tuple(
        i
        for path in sorted(ROOT.rglob("*.py"))
        if module_name(path) not in GENERATED
        for i in imports_of(path)
    )


def package_of(module: str) -> str:
    parts = module.split(".")
    if module in GROUND:
        return "ground"
    return parts[1] if len(parts) > 1 else "ground"


def test_the_rules_see_every_package() -> None:
    packages = {package_of(module_name(p)) for p in ROOT.rglob("*.py")}
    assert set(NEVER) | {"ground"} <= packages
    assert len(all_imports()) > 100  # the reader finds the imports it checks


def test_the_ground_floor_imports_only_the_ground_floor() -> None:
    broken = [
        f"{i.module}:{i.line} imports {i.target}"
        for i in all_imports()
        if i.module in GROUND and i.target not in GROUND
    ]
    assert not broken, broken


@pytest.mark.parametrize("package", sorted(NEVER))
def test_imports_point_down_the_request_path(package: str) -> None:
    broken = [
        f"{i.module}:{i.line} imports {i.target}"
        for i in all_imports()
        if package_of(i.module) == package and package_of(i.target) in NEVER[package]
    ]
    if package == "core":  # core uses the backend registry, never a concrete backend
        broken += [
            f"{i.module}:{i.line} imports {i.target}"
            for i in all_imports()
            if package_of(i.module) == "core"
            and package_of(i.target) == "backends"
            and i.target not in ("lockgate.backends", "lockgate.backends.base")
        ]
    assert not broken, broken


def test_no_two_modules_import_each_other() -> None:
    edges = {(i.module, i.target) for i in all_imports() if i.module != i.target}
    mutual = sorted(f"{a} <-> {b}" for a, b in edges if (b, a) in edges and a < b)
    assert not mutual, mutual
