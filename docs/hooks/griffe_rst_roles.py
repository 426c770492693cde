"""Griffe extension: the docstrings' reStructuredText markup read as Markdown in the API reference.

The package's docstrings are written for readers of the source and for Sphinx-style tools: roles
such as ``:class:`~kareus_fx.x.Y``` and literal blocks introduced by ``::``. mkdocstrings renders
docstrings as Markdown, where a role would show as ``:class:`` text and ``::`` as two colons. This
extension rewrites them as the reader meant them: a role becomes inline code of its target (the last
name only with ``~``, as Sphinx shows it), and a paragraph ending in ``::`` ends in one colon before
its indented block, which Markdown already shows as code. Plain code, not links: a link that does
not resolve would be a warning, and the strict build fails on warnings.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|attr|data|exc|obj|const|ref):`(~?)([^`<]+?)(?:\s*<([^>]+)>)?`")
LITERAL_BLOCK_INTRO = re.compile(r"(\S)::$", re.MULTILINE)


def _code(match: re.Match[str]) -> str:
    shorten, target, explicit = match.group(1), match.group(2).strip(), match.group(3)
    if explicit:  # :role:`title <target>`: Sphinx shows the title
        return f"`{target}`"
    return f"`{target.rsplit('.', 1)[-1] if shorten else target}`"


def markdown_docstring(text: str) -> str:
    """``text`` with its roles as inline code and ``::`` paragraph ends as one colon."""
    return LITERAL_BLOCK_INTRO.sub(r"\1:", ROLE.sub(_code, text))


class RstRoles(griffe.Extension):
    """Rewrites every loaded object's docstring with :func:`markdown_docstring`."""

    def on_instance(self, *, node: Any, obj: griffe.Object, agent: Any, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = markdown_docstring(obj.docstring.value)
