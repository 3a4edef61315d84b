"""docs/CONFIG.md is generated from the schema; it must not drift."""

from conftest import REPO

from offload.config import Support, config_fields
from offload.config.docs import render_markdown


def test_config_reference_is_current():
    on_disk = (REPO / "docs" / "CONFIG.md").read_text()
    assert on_disk == render_markdown(), "docs/CONFIG.md is stale: run `offload config docs > docs/CONFIG.md`"


def test_every_key_is_documented_and_documents_its_status():
    text = render_markdown()
    for info in config_fields():
        assert info.spec.doc.strip(), f"{info.path} has no doc"
        key = info.path.rsplit(".", 1)[-1]
        if not hasattr(info.hint, "__dataclass_fields__"):
            assert f"`{key}`" in text
        if info.spec.support is not Support.HONOURED and not hasattr(info.hint, "__dataclass_fields__"):
            row = next(line for line in text.splitlines() if line.startswith(f"| `{key}` ") and info.spec.doc in line)
            assert f"**{info.spec.support.value}**" in row
