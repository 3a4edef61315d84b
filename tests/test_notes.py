"""Every ``[Note: X]`` a comment, docstring or document refers to names a note that exists, defined once.

A note is defined where a line begins with ``[Note: X]`` followed by its text (not by "in", "of" or punctuation, as
a reference that wraps onto a line of its own is); anywhere else the same brackets refer to it. References may wrap
across lines and comment markers; they are compared with their whitespace folded.
"""

from __future__ import annotations

import re
from pathlib import Path

from conftest import REPO

CODE = [p for pattern in ("offload/**/*.py", "native/**/*.cpp", "native/**/*.h") for p in sorted(REPO.glob(pattern))]
READERS = CODE + sorted(REPO.glob("docs/**/*.md")) + sorted(REPO.glob("tests/**/*.py")) + [REPO / "README.md"]
DEFINITION = re.compile(
    r"^[ \t]*(?:#|//|\*|r?\"\"\")?[ \t]*\[Note: ([^\]]+)\](?:[ \t]+(?!(?:in|of|and|or)\b)\S|[ \t]*$)", re.M)
REFERENCE = re.compile(r"\[Note: ([^\]]+)\]")
# a line break inside a reference: the newline, the next line's indent and comment marker
WRAP = re.compile(r"\n[ \t]*(?:#|//|\*)?[ \t]*")


def _fold(name: str) -> str:
    return re.sub(r"\s+", " ", name).strip()


def definitions() -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for path in CODE:
        text = path.read_text()
        for m in DEFINITION.finditer(text):
            where = f"{path.relative_to(REPO)}:{text.count(chr(10), 0, m.start()) + 1}"
            found.setdefault(_fold(WRAP.sub(" ", m.group(1))), []).append(where)
    return found


def references() -> list[tuple[str, str]]:
    out = []
    for path in READERS:
        if path.name == Path(__file__).name:
            continue
        for m in REFERENCE.finditer(WRAP.sub(" ", path.read_text())):
            out.append((str(path.relative_to(REPO)), _fold(m.group(1))))
    return out


def test_there_are_notes_to_check():
    assert len(definitions()) > 50 and len(references()) > 200


def test_every_note_is_defined_once():
    twice = {name: where for name, where in definitions().items() if len(where) > 1}
    assert twice == {}, "notes defined in more than one place (keep one, refer to it from the other)"


def test_every_reference_names_a_note():
    known = definitions()
    dangling = sorted({(path, name) for path, name in references() if name not in known})
    assert dangling == [], ("references to no note (a name cut short or changed; the notes are: "
                            + ", ".join(sorted(known)) + ")")
