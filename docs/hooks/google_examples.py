"""Griffe extension: read a Google-style ``Example:`` section as ``Examples:``.

Napoleon and Google's style guide accept both spellings; griffe knows only ``Examples:``
and renders ``Example:`` as an admonition whose ``>>>`` lines become nested quotes.
"""
import re

import griffe

_EXAMPLE = re.compile(r"^(\s*)Example:\s*$", re.MULTILINE)


class GoogleExampleSection(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _EXAMPLE.sub(r"\1Examples:", obj.docstring.value)
