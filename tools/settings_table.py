"""The settings table of docs/trainer.md, made from TrainConfig's fields (vcpo/trainer/config.py: each field's
default, help, group and whether a resumed run may change it), so that it is never written by hand.

`python tools/settings_table.py` rewrites the table in place; `--check` exits 1 when it is stale
(tests/trainer/test_settings.py checks it too)."""

from __future__ import annotations

import os
import sys
from dataclasses import MISSING, fields

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join(ROOT, "docs", "trainer.md")
BEGIN = "<!-- the settings table, written by tools/settings_table.py from vcpo/trainer/config.py -->"
END = "<!-- end of the settings table -->"


def _default(f) -> str:
    value = f.default_factory() if f.default is MISSING else f.default
    if value is None:
        return "-"
    if isinstance(value, bool):
        return str(value).lower()
    return f"`{value}`" if isinstance(value, str) else str(value)


def _markdown(text: str) -> str:
    """Text in a table cell: `<run>` would be read as an HTML tag, `|` as the end of the cell."""
    return text.replace("<", "&lt;").replace("|", "/")


def table() -> str:
    from vcpo.trainer.config import TrainConfig

    rows = ["| group | setting | default | resume | meaning |", "|---|---|---|---|---|"]
    previous = None
    for f in fields(TrainConfig):
        group = f.metadata["group"]
        rows.append(f"| {group if group != previous else ''} | `{f.name}` | {_default(f)} | "
                    f"{'may change' if f.metadata['resumable'] else ''} | {_markdown(f.metadata['help'])} |")
        previous = group
    return "\n".join(rows)


def updated(text: str) -> str:
    """`text` (docs/trainer.md) with the table between BEGIN and END made anew."""
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    return text[:start] + "\n" + table() + "\n" + text[end:]


def main(argv: list[str]) -> int:
    with open(DOC) as f:
        text = f.read()
    if updated(text) == text:
        return 0
    if "--check" in argv:
        print(f"{DOC}: the settings table is stale: run python tools/settings_table.py", file=sys.stderr)
        return 1
    with open(DOC, "w") as f:
        f.write(updated(text))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
