"""MkDocs hook: links from docs/ to files elsewhere in the repository.

The Markdown under docs/ is read in two places: on GitHub (and in a checkout), where a relative
link such as ``../examples/quickstart/README.md`` is right, and on the site, which holds only
docs/. This hook keeps the source relative and, at build time, checks that every link leaving
docs/ names a file that exists in the repository (a broken one fails ``mkdocs build --strict``)
and rewrites it to the file on GitHub: ``blob/`` for pages and code, ``raw/`` for images.
Links inside docs/ are left to MkDocs' own validation.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path, PurePosixPath
from typing import Any

log = logging.getLogger("mkdocs.plugins.repo_links")

# [text](target) and ![alt](target), target without spaces, with an optional #anchor or "title".
_LINK = re.compile(r"(?P<bang>!?)\[(?P<text>[^\]]*)\]\((?P<target>[^)\s#]+)(?P<rest>[^)]*)\)")
_IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".gif", ".svg", ".webp"}


def _rewrite(
    markdown: str, *, page_path: str, page_dir: Path, docs_dir: Path, repo_root: Path, repo_url: str
) -> str:
    def replace(match: re.Match[str]) -> str:
        target = match["target"]
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("/"):
            return match[0]
        resolved = (page_dir / target).resolve()
        if resolved.is_relative_to(docs_dir):
            return match[0]
        if not resolved.is_relative_to(repo_root) or not resolved.exists():
            log.warning("link '%s' in %s names no file of the repository", target, page_path)
            return match[0]
        relative = PurePosixPath(resolved.relative_to(repo_root).as_posix())
        kind = "raw" if match["bang"] or relative.suffix in _IMAGE_SUFFIXES else "blob"
        if resolved.is_dir():
            kind = "tree"
        return f"{match['bang']}[{match['text']}]({repo_url}/{kind}/main/{relative}{match['rest']})"

    return _LINK.sub(replace, markdown)


def on_page_markdown(markdown: str, *, page: Any, config: Any, files: Any) -> str:
    """Rewrites links that leave docs/ into GitHub URLs after checking their targets exist."""
    docs_dir = Path(config["docs_dir"]).resolve()
    page_dir = (docs_dir / page.file.src_path).parent
    return _rewrite(
        markdown,
        page_path=page.file.src_path,
        page_dir=page_dir,
        docs_dir=docs_dir,
        repo_root=docs_dir.parent,
        repo_url=str(config["repo_url"]).rstrip("/"),
    )
