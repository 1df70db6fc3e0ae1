"""Jinja2 templates of the rendered objects (render/templates/*.j2), loaded from the package.

Values enter the templates through the ``json`` filter: JSON is YAML, so strings with quotes, colons or newlines
survive unchanged, and a missing value is an error (StrictUndefined), never an empty field.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import jinja2
import yaml

_TEMPLATES = Path(__file__).parent / "templates"
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml: the parse is most of a render's time


@functools.cache
def _environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(_TEMPLATES),
        undefined=jinja2.StrictUndefined,
        autoescape=False,  # YAML, not HTML
        keep_trailing_newline=True,
    )
    env.filters["json"] = lambda value: json.dumps(value, ensure_ascii=False)
    return env


def render_yaml(template: str, **context: Any) -> dict[str, Any]:
    """Render ``template`` with ``context`` and parse the result (one YAML mapping)."""
    text = _environment().get_template(template).render(**context)
    doc = yaml.load(text, Loader=_LOADER)  # a safe loader (libyaml when available)
    if not isinstance(doc, dict):
        raise TypeError(f"template {template} did not render a mapping")
    return doc
