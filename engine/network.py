"""How the engine reaches its servers: credentials in URLs, the TLS trust, and proxies from the environment.

* A URL that carries credentials (``https://user:secret@host/...``) is refused where it is
  configured: a URL is logged, shown in errors and written with every reward, so a password in it
  would leak everywhere. Credentials go in a header whose value is read from an environment variable.
* HTTPS is verified against httpx's default trust (certifi's bundle, or ``SSL_CERT_FILE`` /
  ``SSL_CERT_DIR`` when set), plus the config's ``ca_bundle``: a private CA is added to the default
  trust, never in place of it, so a public judge still verifies.
* ``HTTP_PROXY``, ``HTTPS_PROXY``, ``ALL_PROXY`` and ``NO_PROXY`` (either case) are read as httpx
  reads them (``urllib.request.getproxies()``, then httpx's rules for NO_PROXY: ``*`` turns proxies
  off, ``.example.com`` covers its subdomains, ``example.com`` covers itself and them, an IP address
  or ``localhost`` only itself; loopback addresses are proxied unless NO_PROXY names them, as in
  httpx). A URL the environment proxies is sent through httpx's own transport with that proxy; every
  other URL keeps the engine's transport. The environment is read once, when an engine opens.
"""

from __future__ import annotations

import ipaddress
import logging
import re
import ssl
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from .errors import ConfigError
from .transport import ResponseTooLarge, check_size

__all__ = [
    "Proxies",
    "Routes",
    "ca_bundle_problem",
    "credentials_refusal",
    "read_capped",
    "ssl_context",
    "without_credentials",
]

logger = logging.getLogger("engine")
_PROXY_SCHEMES = ("http", "https", "all")  # the keys of getproxies() that httpx uses


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


def _shown(url: str) -> str:
    """A URL fit for a log line: without its credentials (a proxy's URL may carry them)."""
    return without_credentials(url) or url


@dataclass(frozen=True)
class _Bypass:
    """One NO_PROXY entry, matched as httpx matches its ``all://*host`` patterns."""

    scheme: str  # "" for any scheme
    host: re.Pattern[str] | None  # None for any host
    port: int | None

    @classmethod
    def parse(cls, entry: str) -> _Bypass:
        if "://" in entry:
            pattern = entry
        elif _is_ip(entry, ipaddress.IPv4Address) or entry.lower() == "localhost":
            pattern = f"all://{entry}"
        elif _is_ip(entry, ipaddress.IPv6Address):
            pattern = f"all://[{entry}]"
        else:
            pattern = f"all://*{entry}"
        url = httpx.URL(pattern)
        host = url.host
        if not host or host == "*":
            regex = None
        elif host.startswith("*."):  # .example.com: its subdomains, not itself
            regex = re.compile(rf"^.+\.{re.escape(host[2:])}$")
        elif host.startswith("*"):  # example.com: itself and its subdomains, not wwwexample.com
            regex = re.compile(rf"^(.+\.)?{re.escape(host[1:])}$")
        else:
            regex = re.compile(rf"^{re.escape(host)}$")
        return cls("" if url.scheme == "all" else url.scheme, regex, url.port)

    def matches(self, url: httpx.URL) -> bool:
        return (
            (not self.scheme or self.scheme == url.scheme)
            and (self.host is None or self.host.match(url.host) is not None)
            and (self.port is None or self.port == url.port)
        )


def _is_ip(entry: str, kind: type[ipaddress.IPv4Address] | type[ipaddress.IPv6Address]) -> bool:
    try:
        kind(entry.split("/")[0])
    except ValueError:
        return False
    return True


@dataclass(frozen=True)
class Proxies:
    """The proxies the environment names: ``by_scheme`` (``http``, ``https``, ``all``) and NO_PROXY's exceptions."""

    by_scheme: Mapping[str, str]
    bypass: Sequence[_Bypass] = ()

    @classmethod
    def from_environment(cls) -> Proxies:
        info = urllib.request.getproxies()
        by_scheme = {}
        for scheme in _PROXY_SCHEMES:
            value = info.get(scheme)
            if value:
                by_scheme[scheme] = value if "://" in value else f"http://{value}"
        bypass = []
        for entry in (part.strip() for part in info.get("no", "").split(",")):
            if entry == "*":
                return cls({})
            if entry:
                bypass.append(_Bypass.parse(entry))
        return cls(by_scheme, tuple(bypass))

    def proxy_for(self, url: httpx.URL) -> str | None:
        """The proxy ``url`` goes through, or None for a direct connection."""
        if not self.by_scheme or any(entry.matches(url) for entry in self.bypass):
            return None
        return self.by_scheme.get(url.scheme) or self.by_scheme.get("all")


class Routes:
    """Which transport reaches a URL: httpx's own, through a proxy, for a URL the environment proxies;
    the engine's (``direct``) for every other.

    A proxy's transport is built when the engine opens, so a proxy httpx cannot use (a scheme it
    does not speak, SOCKS without ``socksio``) is a ``ConfigError`` then. Each proxied origin is
    logged once, at INFO, with the proxy's URL shown without its credentials.
    """

    def __init__(
        self,
        direct: httpx.AsyncBaseTransport,
        proxies: Proxies,
        *,
        tls: ssl.SSLContext | None,
        max_connections: int,
    ) -> None:
        self.direct = direct
        self.proxies = proxies
        self._via: dict[str, httpx.AsyncBaseTransport] = {}
        self._logged: set[tuple[str, str]] = set()
        limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
        for scheme, proxy in proxies.by_scheme.items():
            if proxy not in self._via:
                try:
                    self._via[proxy] = httpx.AsyncHTTPTransport(
                        proxy=proxy, verify=tls if tls is not None else True, limits=limits
                    )
                except (ValueError, ImportError) as exc:
                    variable = f"{scheme.upper()}_PROXY"
                    raise ConfigError(
                        f"{variable} (or {variable.lower()}) names a proxy httpx cannot use, {_shown(proxy)}: {exc}"
                    ) from None
            where = "every URL" if scheme == "all" else f"{scheme}:// URLs"
            logger.info("requests to %s go through the proxy %s (%s_PROXY)", where, _shown(proxy), scheme.upper())

    def transport_for(self, url: str | httpx.URL) -> httpx.AsyncBaseTransport:
        """The transport for requests to ``url`` (its proxy's, or the engine's)."""
        url = httpx.URL(url)
        proxy = self.proxies.proxy_for(url)
        if proxy is None:
            return self.direct
        origin = f"{url.scheme}://{url.netloc.decode('ascii')}"
        if (origin, proxy) not in self._logged:
            self._logged.add((origin, proxy))
            logger.info("%s is reached through the proxy %s", origin, _shown(proxy))
        return self._via[proxy]

    def mounts_for(self, url: str | httpx.URL) -> dict[str, httpx.AsyncBaseTransport]:
        """``httpx.AsyncClient(mounts=...)`` that send requests to ``url``'s origin where :meth:`transport_for` says."""
        url = httpx.URL(url)
        transport = self.transport_for(url)
        return {} if transport is self.direct else {f"{url.scheme}://{url.netloc.decode('ascii')}": transport}

    async def aclose(self) -> None:
        for transport in self._via.values():
            await transport.aclose()


async def read_capped(response: httpx.Response, limit: int, request: httpx.Request) -> httpx.Response:
    """``response`` read in full, refused past ``limit`` bytes as the engine's transport refuses it.

    For a transport that does not keep the cap itself (httpx's own, under a proxy): a longer
    announced body is refused before it is read, a body that grows past the cap as soon as it does,
    and a compressed one (the engine asks for ``identity``) at once. A response the engine's
    transport read already is only checked.
    """
    if response.is_stream_consumed:
        await response.aclose()
        check_size(response, limit)
        return response
    try:
        length = response.headers.get("content-length", "").strip()
        if length.isdigit() and int(length) > limit:
            raise ResponseTooLarge(limit, int(length))
        encoding = response.headers.get("content-encoding", "").strip().lower()
        if encoding not in ("", "identity"):
            raise httpx.DecodingError(f"the response is compressed (Content-Encoding: {encoding}), not asked for")
        chunks: list[bytes] = []
        size = 0
        async for chunk in response.aiter_raw():
            size += len(chunk)
            if size > limit:
                raise ResponseTooLarge(limit)
            chunks.append(chunk)
    finally:
        await response.aclose()
    return httpx.Response(
        response.status_code,
        headers=response.headers,
        content=b"".join(chunks),
        request=request,
        extensions=response.extensions,
    )
