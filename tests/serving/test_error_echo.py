"""Client text in an error message: a bounded prefix on one line, with the full length."""

from kvmesh.serving.errors import ECHO_CHARS, shown


def test_client_text_is_quoted_short_and_on_one_line():
    text = shown("a\nb" * 1000)
    assert "\n" not in text and len(text) < 2 * ECHO_CHARS and text.endswith("... (3000 characters)")
    assert shown("gpt-x") == "'gpt-x'"
    assert shown({"type": "x" * 1000}).endswith(" characters)")
