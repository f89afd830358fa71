"""The docs cannot drift from the code: the commands docs/*.md mark runnable run as written on the tiny models, the
figures they copy from bench/RESULTS.md are still there, every file they name exists, the generated "Where things
are" page holds every package's docstring and layering rule, and the README stays short with the demo first and
CI's block second (docs/development.md says how to mark a block)."""

from __future__ import annotations

import ast
import html
import importlib.util
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").is_file())  # tests/ may nest
DOCS = REPO / "docs"
PAGES = sorted(DOCS.glob("*.md"))
# A mark, then the fenced block right after it (blank lines allowed between).
MARKED = re.compile(
    r"^<!--\s*runnable(?::(?P<opts>.*?))?\s*-->\s*\n```(?P<lang>[^\n]*)\n(?P<code>.*?)\n```", re.DOTALL | re.MULTILINE
)


@dataclass
class Block:
    page: str
    line: int
    code: str
    exit: int = 0
    expect: list[str] = field(default_factory=list)
    slow: bool = False


def runnable_blocks() -> list[Block]:
    blocks = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for match in MARKED.finditer(text):
            block = Block(page.name, text.count("\n", 0, match.start()) + 1, match["code"])
            assert match["lang"] == "bash", f"{block.page}:{block.line}: a runnable block must be ```bash"
            for token in shlex.split(match["opts"] or ""):
                key, _, value = token.partition("=")
                if token == "slow":
                    block.slow = True
                elif key == "exit":
                    block.exit = int(value)
                elif key == "expect":
                    block.expect.append(value)
                else:
                    raise ValueError(f"{block.page}:{block.line}: unknown runnable option {token!r}")
            blocks.append(block)
    return blocks


BLOCKS = runnable_blocks()


def squeeze(text: str) -> str:
    return " ".join(text.split())


def test_every_mark_opens_a_block_and_every_fence_renders():
    """A mark with no bash block under it would run nothing; an info string with more than a language (```bash
    runnable) is not a fence to mkdocs' superfences, which renders the block as a paragraph of text."""
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        marks = len(re.findall(r"^<!--\s*runnable", text, re.MULTILINE))
        assert marks == len(MARKED.findall(text)), f"{page.name}: a runnable mark not followed by a fenced block"
        for n, line in enumerate(text.splitlines(), 1):
            if line.startswith("```"):
                assert re.fullmatch(r"```[\w+-]*", line), f"{page.name}:{n}: fence info must be one word: {line!r}"
    assert len(BLOCKS) >= 20 and {b.page for b in BLOCKS} >= {"start.md", "plan-probe.md", "long-context.md"}


def steps(code: str) -> list[str]:
    """The block's commands: continuation lines joined, blank and comment-only lines dropped."""
    joined = re.sub(r"\\\n\s*", " ", code)
    return [line for line in joined.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def glmtune_args(step: str) -> list[str] | None:
    """The arguments of a plain `glmtune ...` / `python -m glmtune ...` command (no pipe, redirection, `&&` or
    variable in front), as the shell would split them; None for anything else."""
    lexer = shlex.shlex(step, posix=True, punctuation_chars=True)
    lexer.whitespace_split, lexer.commenters = True, "#"
    words = list(lexer)
    if any(w and set(w) <= set("();<>|&") for w in words):
        return None
    for head in (["glmtune"], ["python", "-m", "glmtune"]):
        if words[: len(head)] == head:
            return words[len(head) :]
    return None


@pytest.mark.parametrize(
    "block", [pytest.param(b, id=f"{b.page}:{b.line}", marks=[pytest.mark.slow] if b.slow else []) for b in BLOCKS]
)
def test_runnable_block(block, tmp_path):
    """The block's commands in order, in a fresh folder that has the checkout's data/, scripts/ and bench/ (the
    docs' commands are typed in the checkout), stopping at the first that fails, as `bash -e` would. A glmtune
    command runs through glmtune's own entry point in this process (conftest.glmtune_in_process: the same argument
    checks, Hydra, modes and exit codes, without a fresh interpreter and torch import each); anything else — a
    launch script, a shell line — in bash, with this venv's `glmtune` and `python` first on PATH."""
    from conftest import glmtune_in_process

    for name in ("data", "scripts", "bench"):
        (tmp_path / name).symlink_to(REPO / name)
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}", PYTHON=sys.executable)
    where, said, commands = f"docs/{block.page}:{block.line}", "", steps(block.code)
    for n, step in enumerate(commands, 1):
        args = glmtune_args(step)
        if args is not None:
            proc = glmtune_in_process(*args, cwd=tmp_path)
        else:
            proc = subprocess.run(
                ["bash", "-eo", "pipefail", "-c", step],
                check=False,
                cwd=tmp_path,
                env=env,
                capture_output=True,
                text=True,
                timeout=600,
            )
        said += proc.stdout + proc.stderr
        if proc.returncode:
            break
    assert (proc.returncode, n) == (block.exit, len(commands)), (
        f"{where}: `{step}` exited {proc.returncode}; the block documents {block.exit} from its last command\n{said[-4000:]}"
    )
    for text in block.expect:
        assert squeeze(text) in squeeze(said), f"{where}: the output lacks {text!r}\n{said[-4000:]}"


# -- figures and files the docs name -----------------------------------------------------------------------------


def results_sections() -> dict[str, str]:
    text = (REPO / "bench" / "RESULTS.md").read_text(encoding="utf-8")
    heads = list(re.finditer(r"^## (\d+)\. ", text, re.MULTILINE))
    return {
        m[1]: text[m.start() : (heads[i + 1].start() if i + 1 < len(heads) else len(text))] for i, m in enumerate(heads)
    }


def test_cited_figures_are_in_their_results_section():
    """`[51.67 GiB](results.md#s26)`: the section exists and still holds the figure (its numbers, as written)."""
    sections, cited = results_sections(), 0
    for page in PAGES:
        for text, section in re.findall(r"\[([^\]]*)\]\(results\.md#s(\d+)\)", page.read_text(encoding="utf-8")):
            assert section in sections, f"{page.name}: cites §{section}, which bench/RESULTS.md does not have"
            figures = re.findall(r"[-+−]?\d[\d,]*(?:\.\d+)?", re.sub(r"§\s*\d+", "", text))
            for figure in figures:
                found = re.search(rf"(?<![\d.,]){re.escape(figure)}(?!\d)", sections[section])
                assert found, f"{page.name}: {figure!r} is not in bench/RESULTS.md §{section}"
                cited += 1
    assert cited >= 5  # the pages do copy some figures: the check is not vacuous


# Paths the docs name that are not files of the checkout: where the wheel puts conf/ and the samples.
WHEEL_ONLY = {"glmtune/conf/", "glmtune/data/samples*/"}


def test_every_file_the_docs_name_exists():
    """A module moved or renamed leaves no page pointing at its old place."""
    missing = []
    for page in [*PAGES, REPO / "README.md"]:
        for path in re.findall(r"`((?:glmtune|tests|bench|scripts|conf|data|docs)/[\w./*-]*)`", page.read_text()):
            if path in WHEEL_ONLY or "..." in path:  # `outputs/.../adapter`: a placeholder
                continue
            if not (list(REPO.glob(path.rstrip("/"))) if "*" in path else (REPO / path).exists()):
                missing.append(f"{page.name}: {path}")
    assert not missing, "named in the docs but not in the checkout:\n" + "\n".join(missing)


def test_readme_links_resolve():
    markdown = pytest.importorskip("markdown")  # the docs extra (the README's test block installs it)
    from markdown.extensions.toc import slugify

    for target in re.findall(r"\]\(([^)#\s]+)(?:#([^)\s]+))?\)", (REPO / "README.md").read_text()):
        path, anchor = target
        assert (REPO / path).exists(), f"README links to {path}, which does not exist"
        if anchor:
            heads = re.findall(r"^#+ (.+?)\s*$", (REPO / path).read_text(), re.MULTILINE)
            assert anchor in {slugify(h, "-") for h in heads}, f"README links to {path}#{anchor}: no such heading"
    assert markdown


# -- the generated pages -----------------------------------------------------------------------------------------


def load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_where_things_are_lists_every_package_and_rule():
    """Every package's docstring (whole first paragraph), every module and every part's import rule, as
    tests/test_layout.py has them, appear on the page that docs/gen_layout.py makes."""
    markdown = pytest.importorskip("markdown")

    page = load(DOCS / "gen_layout.py", "gen_layout").fill((DOCS / "layout.md").read_text(), REPO)
    rendered = re.sub(r"</?(code|em|strong)>", "", markdown.markdown(page, extensions=["tables"]))  # inline: no gap
    text = squeeze(html.unescape(re.sub(r"<[^>]+>", " ", rendered)))
    root = REPO / "glmtune"
    for init in sorted(root.rglob("__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc, f"{init}: no docstring"
        assert squeeze(doc.split("\n\n")[0].replace("`", "")) in text, (
            f"{init.parent.relative_to(REPO)}: docstring missing"
        )
        for module in init.parent.glob("*.py"):
            if module.name != "__init__.py":
                assert module.name in text, f"{module.relative_to(REPO)} is not listed"
    layout = load(next(REPO.glob("tests/**/test_layout.py")), "layout_rules")
    rows = {
        line.split("|")[1].strip(): line.split("|")[-2].strip()
        for line in page.splitlines()
        if line.startswith("| `glmtune/")
    }
    for part, allowed in layout.ALLOWED.items():
        path = f"glmtune/{part}/" if (root / part / "__init__.py").is_file() else f"glmtune/{part}.py"
        if not (REPO / path).exists():
            continue
        want = ", ".join(f"`{p}`" for p in sorted(allowed)) or "nothing of glmtune"
        assert rows.get(f"`{path}`") == want, f"{path}: the page says {rows.get(f'`{path}`')!r}, the rule {want!r}"


def test_results_page_anchors_every_section():
    hooks = pytest.importorskip("mkdocs") and load(DOCS / "hooks.py", "docs_hooks")
    page = hooks.results_page((REPO / "bench" / "RESULTS.md").read_text())
    for number in results_sections():
        assert re.search(rf"^## {number}\. .*\{{#s{number}\}}$", page, re.MULTILINE), (
            f"§{number} has no #s{number} anchor"
        )


# -- the README ----------------------------------------------------------------------------------------------------


def fenced_blocks(text: str) -> list[str]:
    blocks, inside = [], None
    for line in text.splitlines():
        if line.startswith("```"):
            if inside is None:
                inside = []
            else:
                blocks.append("\n".join(inside))
                inside = None
        elif inside is not None:
            inside.append(line)
    return blocks


def commands(block: str) -> list[str]:
    return [line.split("  #")[0].strip() for line in block.splitlines() if line.strip()]


def test_readme_is_short_with_the_demo_first_and_ci_block_second():
    readme = (REPO / "README.md").read_text()
    assert readme.count("\n") <= 300, f"README.md has {readme.count(chr(10))} lines: move detail into docs/"
    demo, tests = fenced_blocks(readme)[:2]
    demo = commands(demo)
    assert demo[0].startswith("python3 -m venv .venv") and "pip install torch==2.13.0" in demo
    assert demo[-1] == "python -m glmtune", "the first block ends with the tiny demo, no overrides"
    # .ci/run's own extraction yields the second block, which sets up, builds the docs and runs the suite
    ci = (REPO / ".ci" / "run").read_text()
    program = re.search(r"awk '([^']+)' README.md", ci)[1]
    extracted = subprocess.run(["awk", program, "README.md"], cwd=REPO, capture_output=True, text=True, check=True)
    assert extracted.stdout.rstrip("\n") == tests
    steps = commands(tests)
    assert steps[-1] == "python -m pytest -q" and "mkdocs build --strict" in steps
    install = next(s for s in steps if s.startswith("pip install -e"))
    assert "docs" in install and "dev" in install
