"""The "Where things are" page, made from the code itself: each package's docstring (what it owns), each module's
first sentence, and the layering rules of tests/test_layout.py (what each part may import). docs/hooks.py puts it
into docs/layout.md at every `mkdocs build`; `python docs/gen_layout.py` prints it. Nothing is imported: the files
are read with ast, so the page follows any move of a module or rule without an edit here.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MARKER = "<!-- generated: layout -->"


def docstring(path: Path) -> str:
    return ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""


def first_paragraph(doc: str) -> str:
    return " ".join(doc.split("\n\n")[0].split())


def first_sentence(doc: str) -> str:
    """Up to the first full stop that ends a sentence (not `e.g.`, `i.e.` nor a file name's dot)."""
    text = first_paragraph(doc)
    for match in re.finditer(r"\.(?=\s|$)", text):
        if not re.search(r"\b(e\.g|i\.e|etc|vs)$", text[: match.start()]):
            return text[: match.end()]
    return text


def md_text(text: str) -> str:
    """Docstring prose as Markdown that renders as written: outside `code spans`, escape what Markdown would read
    as emphasis (`__version__`, `serve.*`), an HTML tag (`<sweep dir>`) or a table cell's end."""
    parts = text.split("`")
    for i in range(0, len(parts), 2):
        parts[i] = re.sub(r"([\\_*\[\]|])", r"\\\1", parts[i]).replace("<", "&lt;")
    return "`".join(parts)


def layout_rules(repo: Path = REPO) -> tuple[dict[str, list[str]], dict[str, str]]:
    """tests/test_layout.py's ALLOWED (part -> the parts it may import, in the file's order) and each rule's
    trailing comment, read from wherever the layout test lives under tests/."""
    test = next(iter(sorted((repo / "tests").rglob("test_layout.py"))), None)
    if test is None:
        raise FileNotFoundError("no tests/**/test_layout.py: the layering rules are not where the docs look")
    source = test.read_text(encoding="utf-8")
    lines = source.splitlines()
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "ALLOWED" for t in node.targets):
            rules, notes = {}, {}
            for key, value in zip(node.value.keys, node.value.values):
                elts = value.elts if isinstance(value, (ast.Set, ast.List, ast.Tuple)) else []  # set() is empty
                rules[key.value] = sorted(e.value for e in elts)
                comment = lines[key.lineno - 1].partition("#")[2].strip()
                if comment:
                    notes[key.value] = comment
            return rules, notes
    raise ValueError(f"{test}: no ALLOWED = {{...}} assignment")


def part_path(part: str) -> str:
    """The file or folder a layout part names: a package folder, or a module at the top of glmtune/."""
    return f"glmtune/{part}/" if (REPO / "glmtune" / part / "__init__.py").is_file() else f"glmtune/{part}.py"


def module_table(folder: Path, repo: Path) -> list[str]:
    rows = ["| module | what it is |", "|---|---|"]
    for path in sorted(folder.glob("*.py")):
        if path.name == "__init__.py":
            continue
        sentence = first_sentence(docstring(path)) or "(no docstring)"
        rows.append(f"| `{path.name}` | {md_text(sentence)} |")
    return rows if len(rows) > 2 else []


def package_section(folder: Path, repo: Path, level: str, rule: str) -> list[str]:
    name = folder.relative_to(repo).as_posix()
    out = [f"{level} `{name}/`", ""]
    if rule:
        out += [rule, ""]
    doc = docstring(folder / "__init__.py")
    out += [md_text(" ".join(paragraph.split())) + "\n" for paragraph in doc.split("\n\n") if paragraph.strip()]
    out += module_table(folder, repo) + [""]
    for sub in sorted(p for p in folder.iterdir() if (p / "__init__.py").is_file()):
        out += package_section(sub, repo, level + "#", "")
    return out


def render(repo: Path = REPO) -> str:
    rules, notes = layout_rules(repo)
    root = repo / "glmtune"
    present = sorted(
        {p.name for p in root.iterdir() if (p / "__init__.py").is_file()} | {p.stem for p in root.glob("*.py")}
    )
    order = [p for p in rules if p in present] + [p for p in present if p not in rules]

    def may(part: str) -> str:
        if part not in rules:
            return "**no rule in tests/test_layout.py**"
        return ", ".join(f"`{p}`" for p in rules[part]) or "nothing of glmtune"

    def owns(part: str) -> str:
        path = root / part / "__init__.py" if (root / part / "__init__.py").is_file() else root / f"{part}.py"
        return md_text(first_sentence(docstring(path)) or notes.get(part, ""))

    out = ["| part | what it owns (its docstring) | may import |", "|---|---|---|"]
    out += [f"| `{part_path(p)}` | {owns(p)} | {may(p)} |" for p in order]
    families = sorted(p.name for p in (root / "models").iterdir() if (p / "__init__.py").is_file())
    rule = (
        f"Inside `glmtune/models/`, each family folder ({', '.join(f'`{f}/`' for f in families if f != 'kernels')})"
        " imports only `kernels/`, and `kernels/` imports no model code; the modules beside them pick a family"
        " from a checkpoint's `config.json`."
    )
    out += ["", rule, "", "## Each package", ""]
    for part in order:
        folder = root / part
        if (folder / "__init__.py").is_file():
            note = f"May import: {may(part)}." + (f" ({md_text(notes[part])})" if part in notes else "")
            out += package_section(folder, repo, "###", note)
    loose = [p for p in order if not (root / p / "__init__.py").is_file()]
    out += ["## Modules at the top of `glmtune/`", "", "| module | what it is | may import |", "|---|---|---|"]
    out += [f"| `{part_path(p)}` | {owns(p)} | {may(p)} |" for p in loose]
    return "\n".join(out) + "\n"


def fill(markdown: str, repo: Path = REPO) -> str:
    """docs/layout.md with its marker replaced by the generated part."""
    if MARKER not in markdown:
        raise ValueError(f"docs/layout.md has no {MARKER} line for the generated tables")
    return markdown.replace(MARKER, render(repo))


if __name__ == "__main__":
    sys.stdout.write(render())
