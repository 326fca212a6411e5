import pytest

from pipeline.errors import TemplateError
from pipeline.tasks import PromptBuilder


def test_column_prompts_and_bad_values():
    b = PromptBuilder("q")
    assert b.build({"q": "hi"}) == ("hi", None)
    assert b.build({"q": None}) == (None, "prompt is null")
    assert b.build({"q": ""}) == (None, "prompt is empty")
    assert b.build({"q": 3}) == (None, "prompt must be text, got int")
    assert b.build({"q": ["a"]}) == (None, "prompt must be text, got list")
    assert b.build({"other": "x"}) == (None, "row has no column 'q'")


def test_template_over_columns():
    b = PromptBuilder(template="Q: {question}\nContext: {ctx!r}\nA:")
    assert b.columns == ["question", "ctx"]
    assert b.build({"question": "why?", "ctx": "none"}) == ("Q: why?\nContext: 'none'\nA:", None)
    assert b.build({"question": "why?"}) == (None, "template refers to missing column 'ctx'")
    assert b.build({"question": None, "ctx": 1}) == (None, "template column 'question' is null")


@pytest.mark.parametrize("template", ["{q.__class__.__mro__}", "{q[0]}", "{0}", "{}", "{q:{w}}",
                                      "no fields", "{unclosed"])
def test_hostile_or_broken_templates_are_refused(template):
    with pytest.raises(TemplateError):
        PromptBuilder(template=template)


def test_format_spec_errors_are_row_errors():
    b = PromptBuilder(template="{n:d}")
    assert b.build({"n": 3}) == ("3", None)
    prompt, err = b.build({"n": "text"})
    assert prompt is None and err.startswith("template error")
