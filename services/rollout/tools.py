"""Tool calls out of generated text (issue 33's tool-call half replaces this file with vLLM's parsers)."""

from __future__ import annotations


def parse_tool_calls(text: str, *, parser: str | None, tokenizer, tools: list[dict] | None
                     ) -> tuple[str | None, list[dict]]:
    """(content, OpenAI-format tool_calls) of `text` under the model family's `parser`; no parser: (text, [])."""
    if parser is None:
        return text, []
    raise ValueError(f"tool parser {parser!r}: no parser is built into this build yet")
