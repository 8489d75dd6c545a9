"""The README is a front door: short, every link into docs/ and reports/ resolves, every docs page is reachable
from it, and the commands it gives a new user are the ones CI runs."""

import re

from conftest import ROOT

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _pages():
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_every_relative_link_resolves():
    broken = []
    for page in _pages():
        for target in LINK.findall(page.read_text()):
            if re.match(r"[a-z]+://|mailto:|#", target):
                continue
            path = (page.parent / target.split("#")[0]).resolve()
            if not path.exists():
                broken.append(f"{page.relative_to(ROOT)} -> {target}")
    assert not broken, "links to nothing: " + ", ".join(broken)


def test_the_readme_is_a_front_door_to_every_docs_page():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 260, "the README is the front door: move detail into a docs/ page"
    linked = {(ROOT / t).resolve() for t in LINK.findall(readme)}
    unlinked = [p.name for p in (ROOT / "docs").glob("*.md") if p.resolve() not in linked]
    assert not unlinked, f"docs pages the README does not link: {unlinked}"
    for heading in ("## Quick start", "## Commands", "## Documentation", "## Layout"):
        assert heading in readme


def test_the_readme_commands_are_what_ci_runs():
    readme, ci = (ROOT / "README.md").read_text(), (ROOT / ".ci" / "run").read_text()
    for command in ("bash setup.sh", "python -m pytest -q", "python -m pytest -q -m heavy"):
        assert command in readme and command.split(" ", 1)[1] in ci.replace("bash setup.sh \"$VENV\"", "setup.sh"), command
