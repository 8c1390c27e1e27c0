"""The docs hold together (issue 18): every relative link of README.md, docs/*.md and
bench/RESULTS.md resolves (the file, and its #anchor as GitHub renders headings); every
QUEEN_* variable the code reads is in docs/configuration.md; every public queen.* function is in
docs/sql-reference.md. Public: every function sql/schema creates in schema queen whose name does
not start with an underscore (the rule for internal helpers)."""

from __future__ import annotations

import re
from pathlib import Path

from conftest import ROOT

DOCS = [ROOT / "README.md", ROOT / "bench" / "RESULTS.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
# a QUEEN_ name the code reads: not part of a longer identifier like __QUEEN_TIMERS__
VARIABLE = re.compile(r"(?<![A-Za-z0-9_])QUEEN_[A-Z0-9_]*[A-Z0-9](?![A-Za-z0-9_])")
FUNCTION = re.compile(r"CREATE\s+(?:OR\s+REPLACE\s+)?FUNCTION\s+queen\.([a-z0-9_]+)\s*\(", re.I)


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, markup and punctuation dropped, spaces to '-'."""
    text = re.sub(r"`|\*|\[([^\]]*)\]\([^)]*\)", lambda m: m.group(1) or "", heading.strip()).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in FENCE.sub("", path.read_text()).splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(path: Path) -> list[str]:
    text = FENCE.sub("", path.read_text())
    text = re.sub(r"`[^`\n]*`", "", text)
    return [a or b for a, b in LINK.findall(text)]


def test_every_relative_link_resolves():
    broken = []
    for doc in DOCS:
        for target in links(doc):
            if re.match(r"^[a-z]+:", target):
                continue
            file, _, anchor = target.partition("#")
            dest = (doc.parent / file).resolve() if file else doc
            where = f"{doc.relative_to(ROOT)} -> {target}"
            if not dest.exists():
                broken.append(f"{where}: no such file")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{where}: no such heading")
    assert broken == []


def test_the_link_check_can_fail(tmp_path):
    doc = tmp_path / "x.md"
    doc.write_text("# A `b` heading: c\n\n[ok](#a-b-heading-c) [bad](#nope) [gone](missing.md)\n")
    assert anchors(doc) == {"a-b-heading-c"}
    assert links(doc) == ["#a-b-heading-c", "#nope", "missing.md"]


def code_variables() -> set[str]:
    found = set()
    for base in ("python/queen_timers", "scripts"):
        for path in (ROOT / base).rglob("*"):
            if path.is_file() and "__pycache__" not in path.parts:
                found |= set(VARIABLE.findall(path.read_text(errors="replace")))
    return found


def test_every_variable_the_code_reads_is_in_configuration():
    variables = code_variables()
    assert "QUEEN_DATABASE_URL" in variables and "QUEEN_PG_FSYNC" in variables
    documented = set(VARIABLE.findall((ROOT / "docs" / "configuration.md").read_text()))
    assert sorted(variables - documented) == []


def public_functions() -> set[str]:
    names = set()
    for path in (ROOT / "sql" / "schema").glob("*.sql"):
        names |= set(FUNCTION.findall(path.read_text()))
    return {n for n in names if not n.startswith("_")}


def test_every_public_function_is_in_the_sql_reference():
    functions = public_functions()
    assert {"schedule_timers", "cancel_timer", "fire_due_timers"} <= functions
    text = (ROOT / "docs" / "sql-reference.md").read_text()
    assert sorted(f for f in functions if not re.search(rf"queen\.{f}\b", text)) == []
