"""MkDocs hook: fail the strict build on docstring markup that mkdocstrings leaves unrendered.

- reStructuredText roles (``:class:`X```, ``:func:`f```): mkdocstrings prints them as text, so
  the reference they stand for is neither linked nor checked. Write ``[X][rnnkit.X]`` (a
  cross-reference the build checks) or plain ``X`` in backticks for a name outside rnnkit.
- a reStructuredText literal-block marker (a paragraph ending in ``::``): Markdown prints the
  ``::``; the indented block after it is code already.
- ``>>>`` lines outside an ``Examples:`` / ``Example:`` section (a section header needs a
  blank line before it): Markdown shows them as prose, or reads them as three nested block
  quotes, instead of as code.

Each warning names the page and the documented object the markup sits in.
"""
import logging
import re

log = logging.getLogger("mkdocs.hooks.docstring_checks")  # under "mkdocs": counted by --strict

_ROLE = re.compile(r":(?:py:)?(class|func|meth|mod|attr|data|exc|obj|const|ref|doc):<code>([^<]*)</code>")
_DOCTEST_AS_QUOTES = re.compile(r"<blockquote>\s*<blockquote>\s*<blockquote>\s*<p>([^<\n]*)")
_LITERAL_MARKER = re.compile(r"<p>([^<]*(?:<(?!/p>)[^<]*)*)::</p>")
_PARAGRAPH = re.compile(r"<p>(.*?)</p>", re.DOTALL)
_OBJECT = re.compile(r'id="(rnnkit[\w.]*)"')


def _text(html: str) -> str:
    return " ".join(re.sub(r"<[^>]+>", "", html).split())


def _owner(html: str, position: int) -> str:
    owners = _OBJECT.findall(html, 0, position)
    return owners[-1] if owners else "the page text"


def on_page_content(html, page, **kwargs):
    for match in _ROLE.finditer(html):
        log.warning(
            "%s: %s: reStructuredText role :%s:`%s` is not rendered; write a cross-reference "
            "[name][rnnkit.path] or plain `code`",
            page.file.src_uri, _owner(html, match.start()), match.group(1), match.group(2),
        )
    for match in _LITERAL_MARKER.finditer(html):
        log.warning(
            "%s: %s: '%s' ends in the reStructuredText literal marker '::', which renders as text",
            page.file.src_uri, _owner(html, match.start()), _text(match.group(1))[-60:],
        )
    for match in _DOCTEST_AS_QUOTES.finditer(html):
        log.warning(
            "%s: %s: '>>> %s' is outside an Examples section and renders as nested quotes",
            page.file.src_uri, _owner(html, match.start()), match.group(1).strip(),
        )
    for match in _PARAGRAPH.finditer(html):
        if "&gt;&gt;&gt;" in match.group(1):
            line = match.group(1)[match.group(1).index("&gt;&gt;&gt;"):].split("\n")[0]
            log.warning(
                "%s: %s: '%s' is outside an Examples section and renders as prose",
                page.file.src_uri, _owner(html, match.start()), line.replace("&gt;", ">").strip(),
            )
    return html
