"""One self-contained HTML page for a run's forests (``treegrpo view``).

The page has no network dependency: the stylesheet (``viewer.css``) and script (``viewer.js``)
are inlined, and the data is embedded as JSON in ``<script type="application/json">`` elements —
one small index parsed at load, and one element per forest, parsed only when that forest is
selected, so a run of a thousand forests opens as fast as one (the script draws a single forest).

Model output is untrusted text: the embedded JSON escapes ``<``, ``>``, ``&`` and the JavaScript
line separators, so no string can close its ``<script>`` element, and the script puts every
string into the page with ``textContent`` (never as HTML). The page's Content-Security-Policy
(:func:`content_security_policy`) fetches nothing and runs only the viewer's own script and
stylesheet, named by their SHA-256 hashes (no ``'unsafe-inline'``): were some text ever to
become markup, a script or style it brought would not run.
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
from importlib import resources
from pathlib import Path
from typing import Any

from treegrpo.io import atomic_write_text
from treegrpo.viz.data import ViewData, load_view

_ESCAPES = {"<": "\\u003c", ">": "\\u003e", "&": "\\u0026", "\u2028": "\\u2028", "\u2029": "\\u2029"}


def embed_json(obj: Any) -> str:
    """``obj`` as JSON that is safe inside a ``<script type="application/json">`` element: no
    ``</script>``, ``<!--`` or HTML entity can be formed from the text (JSON.parse restores it)."""
    try:
        text = json.dumps(obj, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    except ValueError:  # a NaN/inf in a free-form field: JSON.parse would reject the page
        text = json.dumps(_finite(obj), ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    for c, esc in _ESCAPES.items():  # outside strings JSON has none of these characters
        text = text.replace(c, esc)
    return text


def _finite(obj: Any) -> Any:
    """``obj`` with every NaN or infinite float replaced by None."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def _asset(name: str) -> str:
    return resources.files("treegrpo.viz").joinpath(name).read_text(encoding="utf-8")


def _inline_asset(name: str) -> str:
    """An asset as it goes inside its element, line ends as the HTML parser leaves them (LF: the
    browser hashes the parsed text, so the hash must be of the same characters)."""
    text = _asset(name).replace("\r\n", "\n").replace("\r", "\n")
    tag = "script" if name.endswith(".js") else "style"
    if f"</{tag}" in text.lower():
        raise ValueError(f"{name} contains '</{tag}': it would end its inline element")
    return text


def csp_hash(text: str) -> str:
    """The CSP source expression allowing an inline element whose text is ``text``."""
    return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode("utf-8")).digest()).decode("ascii") + "'"


def content_security_policy(script: str, style: str) -> str:
    """The page's policy: nothing fetched (``default-src 'none'``, images only as ``data:``), and
    only the inline ``script`` and ``style`` with exactly these texts run (hash sources)."""
    return f"default-src 'none'; style-src {csp_hash(style)}; script-src {csp_hash(script)}; img-src data:"


def _attr(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace('"', "&quot;")


def build_html(data: ViewData, title: str | None = None) -> str:
    """The page: inline CSS and JS, the index and every forest as embedded JSON."""
    name = title or f"treegrpo · {data.index['run'].get('name', 'forests')}"
    script, style = _inline_asset("viewer.js"), _inline_asset("viewer.css")
    parts = [
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">",
        f'<meta http-equiv="Content-Security-Policy" content="{_attr(content_security_policy(script, style))}">',
        f"<title>{_attr(name)}</title><style>{style}</style></head><body>",
        '<div id="app"><header id="top"></header><nav id="side"></nav>',
        '<main id="main"><div id="budget"></div><div id="legend"></div><div id="canvas"></div></main>',
        '<aside id="detail"><p class="hint">Click a node to see its text, observation, reward, '
        "advantage and per-token log-probs.</p></aside></div>",
        f'<script type="application/json" id="tg-index">{embed_json(data.index)}</script>',
    ]
    parts += [
        f'<script type="application/json" id="tg-f{i}">{embed_json(doc)}</script>' for i, doc in enumerate(data.forests)
    ]
    parts.append(f"<script>{script}</script></body></html>\n")
    return "\n".join(parts)


def write_view(source: str | Path, out: str | Path | None = None) -> tuple[Path, ViewData]:
    """Read ``source`` (a run folder or a forest file) and write its page; returns the page's path
    (default: ``view.html`` in the run folder, or beside the forest file) and the data shown."""
    src = Path(source)
    data = load_view(src)
    if out is None:
        out = (src / "view.html") if src.is_dir() else src.with_suffix(".html")
    out = Path(out)
    atomic_write_text(out, build_html(data))
    return out, data


__all__ = ["build_html", "content_security_policy", "csp_hash", "embed_json", "write_view"]
