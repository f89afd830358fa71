"""The package layout: no import cycle between glmtune's modules, and packages that only import downward.

The graph is read with ast (nothing is imported), so a cycle hidden inside a function body counts too:
it would still fail at run time the day someone moves that import to the top.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "glmtune"

# What each part may import (besides itself): a subpackage by its folder, a top-level module by its name. Read
# top to bottom it is the pipeline, compose -> validate -> plan -> probe -> train -> serve, over the rooms every
# stage shares (config, launch, rundir, models); each part names only parts above it.
ALLOWED = {
    "__init__": set(),
    "launch": set(),  # who this process is, how it stops and prints (console, exit codes), the scripts' supervisor
    "config": {"__init__", "launch"},  # the command line, schema, validation (cli: __version__, the exit codes)
    "rundir": {"config", "launch"},  # durable writes, the run's lock, resume, the files a run leaves
    "models": {"config"},
    "data": {"config", "models"},
    "plan": {"config", "models"},
    "train": {"config", "launch", "rundir", "models", "data", "plan"},
    "probe": {"config", "launch", "models", "data", "plan", "train"},
    "infer": {"config", "rundir", "models", "data", "plan"},
    "serve": {"config", "launch", "rundir", "models", "data", "plan", "infer"},  # mode=serve's HTTP server
    "scale": {"__init__", "config", "launch", "rundir", "models", "plan", "train"},  # a plan's cluster objects
    "modes": {"config", "launch", "rundir", "models", "data", "plan", "probe", "train", "infer", "serve", "scale"},
    "__main__": {"config", "launch", "rundir", "modes"},
    "ray": {"config", "launch", "rundir"},  # `python -m glmtune.ray`: Ray Train workers that are glmtune ranks
    "supervise": {"launch"},  # `python -m glmtune.supervise`: the documented name of launch/supervise.py
}
# Loose modules at the top of glmtune/ besides __init__.py and __main__.py: only one that truly belongs nowhere.
MAX_LOOSE = 2
# Inside glmtune/models: one folder per architecture family (chatglm, ...) and `kernels`, what every family's decoder
# shares. A family imports the kernels and nothing of another family; the kernels import no model code; the modules
# beside them (loading, presets, quantize, generation, ...) pick a family from a checkpoint and may import any.
MODEL_KERNELS = "kernels"


def modules(root: Path = ROOT) -> dict[str, Path]:
    out = {}
    for f in root.rglob("*.py"):
        parts = ["glmtune", *f.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__" and len(parts) > 2:
            parts = parts[:-1]
        out[".".join(parts)] = f
    return out


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """module -> the glmtune modules it imports, at any depth of its body."""
    mods = modules(root)
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(anchor + ([base] if base else []))
                targets = [base] + [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            for target in targets:
                while target and target not in mods:
                    target = target.rpartition(".")[0]
                # A package's __init__ importing its own children is how packages work, not a cycle.
                if target and target != name and not target.startswith(name + "."):
                    graph[name].add(target)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as a path [a, b, ..., a], or None (iterative DFS with colours)."""
    colour = dict.fromkeys(graph, 0)  # 0 new, 1 on the stack, 2 done
    for start in graph:
        if colour[start]:
            continue
        stack, path = [(start, iter(sorted(graph[start])))], [start]
        colour[start] = 1
        while stack:
            node, children = stack[-1]
            child = next(children, None)
            if child is None:
                colour[node] = 2
                stack.pop()
                path.pop()
            elif colour[child] == 1:
                return path[path.index(child) :] + [child]
            elif colour[child] == 0:
                colour[child] = 1
                stack.append((child, iter(sorted(graph[child]))))
                path.append(child)
    return None


def part(module: str) -> str:
    """The layout unit of a module: its subpackage, or the top-level module's own name."""
    pieces = module.split(".")
    return pieces[1] if len(pieces) > 1 else "__init__"


def test_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_packages_import_only_downward():
    bad = sorted(
        f"{m} imports {t}"
        for m, targets in import_graph().items()
        for t in targets
        if part(t) != part(m) and part(t) not in ALLOWED[part(m)]
    )
    assert not bad, "\n".join(bad)


def test_every_part_has_a_rule_and_the_layout_has_subpackages():
    parts = {part(m) for m in modules()}
    assert parts <= set(ALLOWED), f"no layering rule for {sorted(parts - set(ALLOWED))}"
    packages = [p for p in ROOT.iterdir() if (p / "__init__.py").is_file()]
    assert len(packages) >= 4


def test_the_rules_are_a_layering():
    """No two parts may import each other, even through others: the rules themselves have no cycle."""
    cycle = find_cycle({p: {t for t in allowed if t in ALLOWED} for p, allowed in ALLOWED.items()})
    assert cycle is None, "the layering rules allow a cycle: " + " -> ".join(cycle)


def test_top_level_holds_packages():
    """The top of glmtune/ is __init__.py, __main__.py and packages; a loose module has to earn its place."""
    loose = sorted(p.name for p in ROOT.glob("*.py") if p.name not in ("__init__.py", "__main__.py"))
    assert len(loose) <= MAX_LOOSE, f"loose modules at the top of glmtune/: {loose} — move them into a package"
    for package in (p for p in ROOT.iterdir() if (p / "__init__.py").is_file()):
        doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text()))
        assert doc, f"glmtune/{package.name}/__init__.py: a docstring saying what the package owns"


def model_room(module: str) -> str | None:
    """A glmtune.models module's folder (a family, or the kernels), "shared" for the modules beside them, None
    outside glmtune.models."""
    pieces = module.split(".")
    if pieces[:2] != ["glmtune", "models"]:
        return None
    return pieces[2] if len(pieces) > 2 and (ROOT / "models" / pieces[2]).is_dir() else "shared"


def test_model_families_import_only_the_kernels():
    rooms = {model_room(m) for m in modules()} - {None, "shared"}
    assert {MODEL_KERNELS, "chatglm"} <= rooms, f"glmtune/models has no kernels or chatglm folder: {sorted(rooms)}"
    bad = []
    for module, targets in import_graph().items():
        room = model_room(module)
        for target in targets:
            other = model_room(target)
            if room in (None, "shared") or other in (None, room):
                continue
            if room == MODEL_KERNELS or other != MODEL_KERNELS:  # the kernels import no model code; families only them
                bad.append(f"{module} imports {target}")
    assert not bad, "\n".join(sorted(bad))


def test_cycle_finder_finds_a_planted_cycle(tmp_path):
    """The check itself can fail: two modules importing each other inside functions are reported."""
    pkg = tmp_path / "glmtune"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "a.py").write_text("def f():\n    from .b import g\n")
    (pkg / "sub" / "b.py").write_text("from . import a\n")
    (pkg / "c.py").write_text("from .sub import a\n")
    cycle = find_cycle(import_graph(pkg))
    assert cycle is not None and {"glmtune.sub.a", "glmtune.sub.b"} <= set(cycle)


@pytest.mark.parametrize("path", sorted(ROOT.rglob("*.py")), ids=lambda p: str(p.relative_to(ROOT)))
def test_modules_stay_readable(path):
    """Modules of one concern stay under ~300 lines (the tiny tokenizer corpus is data, not code)."""
    lines = path.read_text().count("\n")
    assert lines <= 330, f"{path.relative_to(ROOT)} has {lines} lines: split it by concern"
