"""Griffe extension for the API reference: Sphinx roles in shardkit's docstrings as inline code.

shardkit's docstrings cross-reference with Sphinx roles (``:class:`~shardkit.read.dataset.Dataset```),
which Markdown would print as they are. They become inline code: the last name for a ``~``
target, as Sphinx shows it, else the target as written. Loaded by mkdocs.yml's python handler.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

__all__ = ["SphinxRoles"]

_ROLE = re.compile(r":(?:class|meth|func|mod|data|attr|exc|obj):`(~?)([^`]+)`")


def _as_code(match: re.Match[str]) -> str:
    tilde, target = match.groups()
    return f"`{target.rsplit('.', 1)[-1] if tilde else target}`"


class SphinxRoles(griffe.Extension):
    """Rewrites the roles of every docstring griffe loads, before it is parsed."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        """Rewrite ``obj``'s docstring, if it has one.

        Args:
            obj: the module, class, function or attribute griffe just loaded.
            **kwargs: the other hook arguments, unused.
        """
        if obj.docstring is not None:
            obj.docstring.value = _ROLE.sub(_as_code, obj.docstring.value)
