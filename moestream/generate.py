"""Generation and what the commands share around it: prompts and chat templates."""

from __future__ import annotations

from pathlib import Path


def chat_template_text(value: str) -> str:
    """--chat-template: the template itself, or a file that holds it."""
    try:
        if value and Path(value).is_file():
            return Path(value).read_text()
    except OSError:  # a template's text too long for a file name
        pass
    return value
