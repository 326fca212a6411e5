"""Prepare: turns input rows into prompts, or into a per-row error that says why not.

Templates use `{column}` fields and nothing else: attribute access, indexing and positional
fields are refused when the template is parsed, so a template cannot reach Python internals.
"""
from __future__ import annotations

import string


class TemplateError(ValueError):
    """The template itself is invalid (fatal, reported before any actor starts)."""


class PromptBuilder:
    """Builds one prompt per row from a column or a template over columns."""

    def __init__(self, prompt_column: str | None = "prompt", template: str | None = None):
        if template is None and not prompt_column:
            raise TemplateError("set input.prompt_column or input.template")
        self.prompt_column = prompt_column
        self.template = template
        self.fields = parse_template(template) if template is not None else []

    @property
    def columns(self) -> list[str]:
        """Input columns the prompts are built from."""
        return self.fields if self.template is not None else [self.prompt_column]

    def build(self, row: dict) -> tuple[str | None, str | None]:
        """(prompt, None) or (None, error message)."""
        if self.template is not None:
            return self._render(row)
        if self.prompt_column not in row:
            return None, f"row has no column {self.prompt_column!r}"
        return check_prompt(row[self.prompt_column])

    def _render(self, row: dict) -> tuple[str | None, str | None]:
        values = {}
        for name in self.fields:
            if name not in row:
                return None, f"template refers to missing column {name!r}"
            if row[name] is None:
                return None, f"template column {name!r} is null"
            values[name] = row[name]
        try:
            return check_prompt(self.template.format_map(values))
        except (ValueError, TypeError) as exc:
            return None, f"template error: {exc}"


def parse_template(template: str) -> list[str]:
    """Field names of a `{column}` template; refuses anything but plain names."""
    names = []
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as exc:
        raise TemplateError(f"invalid template: {exc}") from None
    for _, field, spec, _ in parsed:
        if field is None:
            continue
        if not field.isidentifier():
            raise TemplateError(f"template field {{{field}}} is not allowed: use plain column names "
                                "like {question} (no attribute access, indexing or positional fields)")
        if spec and "{" in spec:
            raise TemplateError(f"nested fields are not allowed in templates: {{{field}:{spec}}}")
        if field not in names:
            names.append(field)
    if not names:
        raise TemplateError("template has no {column} field")
    return names


def check_prompt(value) -> tuple[str | None, str | None]:
    if value is None:
        return None, "prompt is null"
    if not isinstance(value, str):
        return None, f"prompt must be text, got {type(value).__name__}"
    if not value:
        return None, "prompt is empty"
    return value, None
