"""How the engine reaches its servers: credentials in URLs, the TLS trust, and proxies from the environment.

* A URL that carries credentials (``https://user:secret@host/...``) is refused where it is
  configured: a URL is logged, shown in errors and written with every reward, so a password in it
  would leak everywhere. Credentials go in a header whose value is read from an environment variable.
* HTTPS is verified against httpx's default trust (certifi's bundle, or ``SSL_CERT_FILE`` /
  ``SSL_CERT_DIR`` when set), plus the config's ``ca_bundle``: a private CA is added to the default
  trust, never in place of it, so a public judge still verifies.
"""

from __future__ import annotations

import ssl
from pathlib import Path

import httpx

__all__ = ["ca_bundle_problem", "credentials_refusal", "ssl_context", "without_credentials"]


def without_credentials(url: str) -> str | None:
    """``url`` without its ``user:password@`` part, or None when it has none (then it is fine as it is)."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return None
    end = min((i for i in (rest.find(c) for c in "/?#") if i >= 0), default=len(rest))
    authority = rest[:end]
    if "@" not in authority:
        return None
    return f"{scheme}://{authority.rpartition('@')[2]}{rest[end:]}"


def credentials_refusal(plain: str) -> str:
    """Why a URL with credentials is refused, and what to write instead; names ``plain``, the URL without them."""
    return (
        "the URL carries credentials (user:password@), which would be logged and written with every reward; "
        f'use {plain} and send them in a header read from an environment variable: in the config, [refs."{plain}"] '
        'headers = { Authorization = "Basic ${VERIFIER_AUTH}" } (the variable holding base64 of user:password)'
    )


def ssl_context(ca_bundle: Path | None = None) -> ssl.SSLContext:
    """httpx's default client context, trusting also the CA certificates in ``ca_bundle`` (PEM)."""
    context = httpx.create_ssl_context()
    if ca_bundle is not None:
        context.load_verify_locations(cafile=ca_bundle)
    return context


def ca_bundle_problem(path: Path) -> str | None:
    """Why ``path`` cannot serve as a CA bundle, or None if it loads as PEM certificates."""
    if not path.exists():
        return f"no such file: {path}"
    if not path.is_file():
        return f"not a file: {path}"
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    try:
        context.load_verify_locations(cafile=path)
    except (ssl.SSLError, OSError, UnicodeDecodeError) as exc:
        return f"{path} does not load as PEM CA certificates ({exc})"
    if not context.cert_store_stats()["x509"]:
        return f"{path} holds no certificate"
    return None
