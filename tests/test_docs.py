"""The README is a front door: short, every link into docs/ and reports/ resolves, every docs page is reachable
from it, and the commands it gives a new user are the ones CI runs."""

import re

from conftest import ROOT

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _pages():
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _anchors(page):
    """The anchors GitHub gives a Markdown page's headings: lower case, punctuation dropped, spaces as hyphens."""
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
            for h in re.findall(r"^#+ (.*)$", page.read_text(), re.M)}


def test_every_relative_link_resolves():
    broken = []
    for page in _pages():
        for target in LINK.findall(page.read_text()):
            if re.match(r"[a-z]+://|mailto:", target):
                continue
            file, _, anchor = target.partition("#")
            path = (page.parent / file).resolve() if file else page
            if not path.exists():
                broken.append(f"{page.relative_to(ROOT)} -> {target}")
            elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
                broken.append(f"{page.relative_to(ROOT)} -> {target} (no such heading)")
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
    for command in ("bash setup.sh", "python -m pytest -q -n 2 --dist loadfile", "python -m pytest -q -m heavy"):
        assert command in readme and command.split(" ", 1)[1] in ci.replace("bash setup.sh \"$VENV\"", "setup.sh"), command


TRIPLE = re.compile(r"([+-]?\d+\.\d+)x?\s+\[([+-]?\d+\.\d+),\s+([+-]?\d+\.\d+)\]")


def _rounded(value, like):
    """`value` (a string from the claims page) rounded half away from zero to the decimals of `like`."""
    from decimal import ROUND_HALF_UP, Decimal

    places = Decimal(1).scaleb(-len(like.split(".")[1]))
    return Decimal(value).quantize(places, rounding=ROUND_HALF_UP)


def test_the_readme_headline_intervals_are_the_claims_pages_rounded():
    """Every 'estimate [low, high]' the README's summary quotes is one of reports/paper-claims/claims.md's, rounded."""
    summary = (ROOT / "README.md").read_text().split("## Quick start")[0]
    quoted = TRIPLE.findall(summary)
    assert len(quoted) >= 5, "the README's summary quotes the claims page's intervals"
    stored = TRIPLE.findall((ROOT / "reports" / "paper-claims" / "claims.md").read_text())
    from decimal import Decimal

    missing = [q for q in quoted
               if not any(all(_rounded(s, r) == Decimal(r) for s, r in zip(t, q)) for t in stored)]
    assert not missing, f"README intervals not on the claims page (rounded): {missing}"


def test_the_readme_headline_numbers_are_the_long_runs_leaderboard_rounded():
    """The KLD and perplexity pairs the README's summary quotes are reports/long-smollm2-135m's cells, rounded."""
    board = (ROOT / "reports" / "long-smollm2-135m" / "leaderboard.md").read_text()
    table = board.split("### Summary", 1)[1].split("\n\n|", 1)[1].split("\n\n", 1)[0]  # the first table after it
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in ("|" + table).splitlines()]
    header = rows[0]
    kld, ppl = header.index("WikiText-2 KLD"), header.index("WikiText-2 ppl")
    cell = {(r[0], r[1]): r for r in rows[2:]}

    def at(method, scheme, column, decimals):
        value = cell[(method, scheme)][column].strip("*").split()[0]
        return str(_rounded(value, "0." + "0" * decimals))

    summary = " ".join((ROOT / "README.md").read_text().split("## Quick start")[0].split())
    expected = [
        f"KL divergence {at('flexround', 'w3a16', kld, 2)} against {at('lrq', 'w3a16', kld, 2)}",
        f"perplexity {at('flexround', 'w3a16', ppl, 1)} against {at('lrq', 'w3a16', ppl, 1)}",
        f"KLD {at('flexround', 'w4a8', kld, 3)} against {at('lrq', 'w4a8', kld, 3)}",
        f"perplexity {at('flexround', 'w4a8', ppl, 1)} against {at('lrq', 'w4a8', ppl, 1)}",
        f"KLD {at('lrq', 'w4a8', kld, 3)} against {at('gptq', 'w4a8', kld, 3)}",
        f"KLD {at('lrq', 'w3a16', kld, 2)} against {at('awq', 'w3a16', kld, 2)}",
        f"{at('lrq', 'w4a8', kld, 3)} against {at('awq', 'w4a8', kld, 3)}",
    ]
    missing = [phrase for phrase in expected if phrase not in summary]
    assert not missing, f"the README's summary does not say what the long run's leaderboard holds: {missing}"
