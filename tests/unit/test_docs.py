"""The wire-schema document stays in step with the code: every field of every schema is documented
under that schema's heading, with the right version."""

import dataclasses
import re
from pathlib import Path

from engine.schemas import SCHEMAS

DOC = Path(__file__).resolve().parents[2] / "docs" / "wire-schemas.md"


def _sections() -> dict[str, tuple[int, str]]:
    text = DOC.read_text()
    out = {}
    for m in re.finditer(r"^## (\w+) \(v(\d+)\)(.*?)(?=^## |\Z)", text, re.S | re.M):
        out[m.group(1)] = (int(m.group(2)), m.group(3))
    return out


def test_every_schema_and_field_is_documented():
    sections = _sections()
    for name, cls in SCHEMAS.items():
        assert name in sections, f"docs/wire-schemas.md has no section for {name}"
        version, body = sections[name]
        assert version == cls.VERSION, f"{name}: doc says v{version}, code is v{cls.VERSION}"
        documented = set(re.findall(r"^\| `(\w+)` \|", body, re.M))
        fields = {f.name for f in dataclasses.fields(cls)}
        assert fields == documented, f"{name}: undocumented {fields - documented}, stale {documented - fields}"
