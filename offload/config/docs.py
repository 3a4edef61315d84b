"""docs/CONFIG.md, rendered from the schema so the docs cannot drift from the defaults."""

from __future__ import annotations

import json
import typing

from .fields import Auto, Support, _strip_optional
from .load import config_fields

_HEADER = """# Config reference

offload reads DeepSpeed's JSON config format. This page is generated from the schema
(`offload config docs > docs/CONFIG.md`); a test fails when it is stale.

- Numbers may be written as strings (`"5e8"`) and whole-number floats (`5e8`) where
  integers are meant. Keys under `offload.budgets` and `offload.unit_bytes` also take
  sizes such as `"24GiB"`.
- Keys marked **auto** may be written `"auto"`, as Hugging Face's integration writes them;
  `Config.resolve(world_size, hidden_size, values)` fills them in at initialize.
- **status**: every key has exactly one. *honoured*: offload acts on it. **no effect**:
  accepted, and when a config sets it (to anything but its default) `offload config
  check` prints it and `initialize` lists it in one log line, with the reason given here.
  **refused**: setting it is an error, because ignoring it would change training or
  memory; the message says what to do instead. Some honoured keys have no effect in
  context (fp16's settings while fp16 is off, NVMe settings of a tier that is not on
  NVMe); they are reported the same way.
- Older DeepSpeed names are accepted with a log line: `aio.thread_count`,
  `zero_optimization.cpu_offload`, `cpu_offload_params`, `cpu_offload_use_pin_memory`,
  `stage3_gather_fp16_weights_on_model_save`, the `stage3_` keys without their prefix,
  and `bfloat16` for `bf16`.
"""


def _type_name(hint: typing.Any) -> str:
    core, nullable = _strip_optional(hint)
    origin = typing.get_origin(core)
    if origin is tuple:
        name = "[number, number]"
    elif origin is list:
        name = "list"
    elif origin is dict:
        name = "object"
    else:
        names = {bool: "bool", int: "int", float: "number", str: "string"}
        name = names.get(core, getattr(core, "__name__", str(core)))
    return f"{name} or null" if nullable else name


def _default(value: typing.Any) -> str:
    if isinstance(value, tuple):
        value = list(value)
    if isinstance(value, Auto):
        value = str(value)
    return "`" + json.dumps(value) + "`"


def render_markdown() -> str:
    sections: dict[str, list[str]] = {}
    for info in config_fields():
        section = info.path.rsplit(".", 1)[0] if "." in info.path else "(top level)"
        if info.variant:
            section += f" ({info.variant.removesuffix('Params')})"
        spec = info.spec
        if typing.get_origin(info.hint) is None and hasattr(info.hint, "__dataclass_fields__"):
            continue  # section headers come from their leaves
        rows = sections.setdefault(section, ["", f"## {section}", "", "| key | type | default | status | meaning |",
                                             "|---|---|---|---|---|"])
        rules = []
        if spec.choices:
            rules.append("one of " + ", ".join(f"`{c}`" for c in spec.choices))
        for op, bound in (("≥", spec.ge), (">", spec.gt), ("≤", spec.le), ("<", spec.lt)):
            if bound is not None:
                rules.append(f"{op} {bound:g}")
        if spec.auto:
            rules.append("**auto**")
        if spec.aliases:
            rules.append("also " + ", ".join(f"`{a}`" for a in spec.aliases))
        status = spec.support.value if spec.support is Support.HONOURED else f"**{spec.support.value}**"
        note = ""
        if spec.note:
            note = f" *{'No effect' if spec.support is Support.NO_EFFECT else 'Refused'}:* {spec.note}"
        text = spec.doc + note + (f" ({'; '.join(rules)})" if rules else "")
        key = info.path.rsplit(".", 1)[-1]
        rows.append(f"| `{key}` | {_type_name(info.hint)} | {_default(info.default)} | {status} | "
                    f"{text.replace('|', '/')} |")
    lines = [_HEADER] + [row for rows in sections.values() for row in rows]
    return "\n".join(lines) + "\n"
