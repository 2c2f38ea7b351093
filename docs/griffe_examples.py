"""A griffe extension for the API pages, which reads shoal's docstrings as Markdown
without changing the source (help() and doctest read it as it is):

- the doctests are headed ``Example:``, which Google style (griffe) reads as an
  admonition of Markdown text, so ``>>>`` lines would render as prose and printed arrays
  (``[[1.]]``) as reference links. Read as ``Examples:`` they render as highlighted
  ``pycon`` blocks, the text between them as Markdown;
- reST's ``::`` that ends a paragraph before a literal block becomes ``:`` (the indented
  block is already a Markdown code block).
"""

from __future__ import annotations

import re

import griffe

_EXAMPLE = re.compile(r"^(\s*)Example:[ \t]*$", re.M)
_LITERAL = re.compile(r"(\S) ?::$", re.M)


class ExampleSections(griffe.Extension):
    def on_object(self, *, obj: griffe.Object, **kwargs) -> None:
        if obj.docstring is not None:
            text = _EXAMPLE.sub(r"\1Examples:", obj.docstring.value)
            obj.docstring.value = _LITERAL.sub(r"\1:", text)
