"""MkDocs hooks of the docs site (``mkdocs.yml``): the command-line reference is rendered from
the click commands themselves, so it can't drift from them."""

from __future__ import annotations

from typing import Any

import click

PLACEHOLDER = "<!-- keyedstate: cli reference -->"


def _commands(group: click.Command, path: str) -> list[tuple[str, click.Command]]:
    found = [(path, group)]
    if isinstance(group, click.Group):
        for name in sorted(group.commands):
            found += _commands(group.commands[name], f"{path} {name}")
    return found


def cli_reference() -> str:
    """Markdown: one section per command, its ``--help`` text as a code block."""
    from keyedstate.cli import main

    parts = []
    for path, command in _commands(main, "keyedstate"):
        with click.Context(command, info_name=path) as ctx:
            text = command.get_help(ctx)
        parts.append(f"## `{path}`\n\n```text\n{text}\n```\n")
    return "\n".join(parts)


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    return markdown.replace(PLACEHOLDER, cli_reference()) if PLACEHOLDER in markdown else markdown
