"""Prepare: turns input rows into prompts, or into a per-row error that says why not.

A prompt is text (from a column or a template), or a list of chat messages (from a messages
column, or a text prompt wrapped in the spec's system prompt and few-shot turns) that the
worker renders with the model's chat template.

Templates use `{column}` fields and nothing else: attribute access, indexing and positional
fields are refused when the template is parsed, so a template cannot reach Python internals.
"""
from __future__ import annotations

import string
from typing import TYPE_CHECKING

from pipeline.errors import TemplateError
from pipeline.tasks.openai_batch.requests import parse_messages

if TYPE_CHECKING:
    from engine.api import Engine
    from pipeline.spec import InputSpec


class PromptBuilder:
    """Builds one prompt per row from a column, a template over columns, or chat messages."""

    def __init__(self, prompt_column: str | None = "prompt", template: str | None = None,
                 messages_column: str | None = None, system_prompt: str | None = None,
                 few_shot: list[dict] | tuple = (), image_column: str | None = None):
        if template is None and not prompt_column and not messages_column:
            raise TemplateError("set input.prompt_column, input.template or input.messages_column")
        self.prompt_column = prompt_column
        self.template = template
        self.messages_column = messages_column
        self.image_column = image_column
        """A column of images: each row becomes one user message, its images first (chat)."""
        self.fields = parse_template(template) if template is not None and not messages_column else []
        self.preamble = ([{"role": "system", "content": system_prompt}] if system_prompt else [])
        for shot in few_shot:
            self.preamble += [{"role": "user", "content": shot["user"]},
                              {"role": "assistant", "content": shot["assistant"]}]

    @classmethod
    def from_spec(cls, input_spec: InputSpec) -> PromptBuilder:
        return cls(input_spec.prompt_column, input_spec.template, input_spec.messages_column,
                   input_spec.system_prompt, [shot.model_dump() for shot in input_spec.few_shot],
                   input_spec.image_column)

    @property
    def chat(self) -> bool:
        """Whether prompts are chat messages (rendered with the model's chat template)."""
        return bool(self.messages_column or self.preamble or self.image_column)

    @property
    def columns(self) -> list[str]:
        """Input columns the prompts are built from."""
        if self.messages_column:
            return [self.messages_column]
        text = self.fields if self.template is not None else [self.prompt_column]
        return text + ([self.image_column] if self.image_column else [])

    def build(self, row: dict) -> tuple[str | list[dict] | None, str | None]:
        """(prompt, None) or (None, error message); a chat prompt is a list of messages."""
        if self.messages_column:
            if self.messages_column not in row:
                return None, f"row has no column {self.messages_column!r}"
            try:
                return self.preamble + parse_messages(row[self.messages_column], self.messages_column), None
            except ValueError as exc:
                return None, str(exc)
        if self.template is not None:
            prompt, error = self._render(row)
        elif self.prompt_column not in row:
            return None, f"row has no column {self.prompt_column!r}"
        else:
            prompt, error = check_prompt(row[self.prompt_column])
        if prompt is not None and self.image_column:
            value = row.get(self.image_column)
            if value is None:
                return None, f"row has no image in column {self.image_column!r}"
            pictures = value if isinstance(value, (list, tuple)) else [value]
            parts = [{"type": "image", "image": picture} for picture in pictures]
            return self.preamble + [{"role": "user", "content": parts + [{"type": "text", "text": prompt}]}], None
        if prompt is not None and self.preamble:
            return self.preamble + [{"role": "user", "content": prompt}], None
        return prompt, error

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


def chat_or_error(engine: Engine, messages: list[dict]) -> tuple:
    """(the engine's encode_chat prompt, None), or (None, the one-line error of these messages)."""
    try:
        return engine.encode_chat(messages), None
    except (ValueError, TypeError) as exc:
        return None, str(exc)
