"""The README stays short, and its links into the repository lead somewhere."""

import re
from urllib.parse import unquote

from conftest import REPO

README = REPO / "README.md"
MAX_LINES = 150

# [text](target) and ![alt](target), with an optional "title" after the target
INLINE_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
# [label]: target
REFERENCE_LINK = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")


def _prose_lines(text):
    """The README's lines outside fenced code blocks."""
    fenced = False
    for line in text.splitlines():
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
            continue
        if not fenced:
            yield line


def _relative_targets(text):
    for line in _prose_lines(text):
        targets = INLINE_LINK.findall(line)
        reference = REFERENCE_LINK.match(line)
        if reference:
            targets.append(reference.group(1))
        for target in targets:
            if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target) or target.startswith(("#", "//")):
                continue  # a URL (http:, mailto:, ...) or an anchor in the README itself
            yield target


def test_readme_is_at_most_150_lines():
    lines = README.read_text().splitlines()
    assert len(lines) <= MAX_LINES, (
        f"README.md has {len(lines)} lines, more than {MAX_LINES}: move the long parts into docs/ and link them")


def test_every_relative_link_in_the_readme_names_a_file_that_exists():
    targets = list(_relative_targets(README.read_text()))
    assert targets, "no relative links found in README.md: the link pattern no longer matches"
    missing = []
    for target in targets:
        path = unquote(target.split("#", 1)[0].split("?", 1)[0])
        if not (REPO / path).exists():
            missing.append(target)
    assert not missing, f"README.md links to files that do not exist: {', '.join(missing)}"


def test_the_link_check_sees_inline_reference_and_anchored_links():
    text = "\n".join([
        "See [the docs](docs/x.md#part) and ![a plot](docs/p.png \"title\").",
        "[ref]: docs/y.md",
        "Not these: [site](https://example.com), [here](#figures), [mail](mailto:a@b.c).",
        "```",
        "[in a code block](docs/ignored.md)",
        "```",
    ])
    assert list(_relative_targets(text)) == ["docs/x.md#part", "docs/p.png", "docs/y.md"]
