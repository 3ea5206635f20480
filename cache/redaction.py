"""Store URLs as they may be shown: in errors, logs, the effective config, /healthz.

A leaf module (the standard library only), so every module that shows a URL (the URL table in
``cache/urls.py``, each backend's own errors, the CLI, the config) imports it without importing
the backends.

Invariants:

* A URL's password, and any ``password``/``ssl_password`` parameter, never appears in what
  :func:`redact_url` returns: it is ``***``; nested store URLs (``tiered://``'s ``l1``, ``l2``)
  are redacted too.
* What cannot hold a secret (scheme, user name, host, port, path, other parameters) is kept as
  it was; text that is not a URL comes back unchanged; a URL that does not parse keeps only its
  scheme.
"""

from __future__ import annotations

from urllib.parse import parse_qsl, quote, urlencode, urlsplit

MASK = "***"
SECRET_PARAMS = frozenset({"password", "ssl_password"})  # masked wherever a URL shows them


def redact_url(url: str) -> str:
    """``url`` with its password (and any ``password``/``ssl_password`` parameter) shown as
    ``***``, nested store URLs (``tiered://``'s ``l1``, ``l2``) too; the user name, host, port,
    path and other parameters as they were. Text that is not a URL comes back unchanged."""
    try:
        parts = urlsplit(url)
        password = parts.password
    except ValueError:  # e.g. a bad port: keep only what cannot hold a secret
        return f"{url.partition('://')[0]}://<unparsable URL>" if "@" in url else url
    if not parts.scheme or (not parts.netloc and not parts.query):
        return url
    if "@" in parts.path or "@" in parts.fragment:  # a password with an unencoded / or #
        return f"{parts.scheme}://<unparsable URL>"
    netloc = parts.netloc
    if password is not None:
        userinfo, _, hostport = netloc.rpartition("@")
        user = userinfo.partition(":")[0]
        netloc = f"{user}:{MASK}@{hostport}"
    query = parts.query
    if query:
        pairs = parse_qsl(query, keep_blank_values=True)
        masked = [
            (k, MASK if k in SECRET_PARAMS else redact_url(v) if "://" in v else v)
            for k, v in pairs
        ]
        if masked != pairs:
            query = urlencode(masked, safe="*:/@?=", quote_via=quote)
    query = f"?{query}" if query else ""
    fragment = f"#{parts.fragment}" if parts.fragment else ""
    return f"{parts.scheme}://{netloc}{parts.path}{query}{fragment}"
