"""How the engine reaches its servers: credentials in URLs refused, the TLS trust, proxies from the environment.

The rules, as httpx's: docs/design.md, Transport (Networks).
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

from engine._errors import ConfigError

__all__ = [
    "Proxies",
    "Routes",
    "ca_bundle_problem",
    "credentials_refusal",
    "shown_url",
    "ssl_context",
    "url_problem",
    "without_credentials",
]

logger = logging.getLogger("engine")
_PROXY_SCHEMES = ("http", "https", "all")  # the keys of getproxies() that httpx uses


def shown_url(url: str) -> str:
    """``url`` fit for a message or a log line whatever it holds: without anything between ``://`` and its last '@'.

    Where the authority ends is not certain: a password may hold an unencoded '/', '?', '#' or '@'
    (``http://user:pa/ss@host``), so everything up to the last '@' is taken for credentials. A URL
    with an '@' in its path or query loses more than its credentials; it is only shown, never used.
    """
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url.rpartition("@")[2]
    return f"{scheme}://{rest.rpartition('@')[2]}"


def without_credentials(url: str) -> str | None:
    """``url`` as :func:`shown_url` shows it when it may carry credentials, or None when it carries none.

    It may carry them whenever an '@' comes after ``://``: a reading that ends the authority at the
    first '/', '?' or '#' would let ``http://user:pa/ss@host/`` or ``http://user:1?pw@host/`` through
    (httpx reads the latter as host ``user``, port 1, and a query holding the password). A literal
    '@' in a path or query is written ``%40``.
    """
    _, sep, rest = url.partition("://")
    if not sep or "@" not in rest:
        return None
    return shown_url(url)


def url_problem(url: str) -> str | None:
    """Why httpx cannot read ``url``, in words that never repeat credentials it may hold; None if it can.

    httpx's own message quotes the part it choked on, which may be a piece of a password, so it is
    given only for a URL without an '@'.
    """
    try:
        httpx.URL(url)
    except httpx.InvalidURL as exc:
        why = f" ({exc})" if "@" not in url else " (httpx's reason would quote what comes before its '@': a password?)"
        return f"httpx cannot read it as a URL: {shown_url(url)}{why}"
    return None


def credentials_refusal(plain: str) -> str:
    """Why a URL with credentials is refused, and what to write instead; names ``plain``, the URL without them."""
    return (
        "the URL carries credentials (user:password@) or may (an '@' anywhere in it: write a literal one %40), "
        "which would be logged and written with every reward; "
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


@dataclass(frozen=True)
class _Bypass:
    """One NO_PROXY entry, matched as httpx matches its ``all://*host`` patterns."""

    scheme: str  # "" for any scheme
    host: re.Pattern[str] | None  # None for any host
    port: int | None

    @classmethod
    def parse(cls, entry: str) -> _Bypass:
        """The entry as httpx reads it, and ``[::1]`` (with or without a port) as the IPv6 address it is;
        an entry httpx cannot read (``host:notaport``) is a ``ConfigError`` (httpx itself raises on it)."""
        if "://" in entry or entry.startswith("["):
            pattern = entry if "://" in entry else f"all://{entry}"
        elif _is_ip(entry, ipaddress.IPv4Address) or entry.lower() == "localhost":
            pattern = f"all://{entry}"
        elif _is_ip(entry, ipaddress.IPv6Address):
            pattern = f"all://[{entry}]"
        else:
            pattern = f"all://*{entry}"
        try:
            url = httpx.URL(pattern)
        except httpx.InvalidURL as exc:
            raise ConfigError(
                f"NO_PROXY (or no_proxy) holds {entry!r}, which httpx cannot read as a host, domain, IP address "
                f"or URL ({exc})"
            ) from None
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


def _check_proxy(proxy: str, variable: str) -> None:
    """Refuse a proxy URL httpx cannot read, or one whose host httpx would read elsewhere than it seems.

    ``http://user:pa/ss@proxy:3128`` parses as the host ``user``, the port ``pa`` (invalid) and a
    path; with a numeric start of the password it parses, and the proxy would be ``user:123``. The
    URL is named without anything up to its last '@' (:func:`shown_url`), never as httpx quotes it.
    """
    named = f"{variable} (or {variable.lower()})"
    problem = url_problem(proxy)
    if problem is not None:
        raise ConfigError(f"{named}: {problem}")
    rest = proxy.partition("://")[2]
    after_host = re.split("[/?#]", rest, maxsplit=1)[1:]
    if after_host and "@" in after_host[0]:
        raise ConfigError(
            f"{named}: httpx would not read the proxy {shown_url(proxy)} as it seems to be: an '@' follows a "
            "'/', '?' or '#' (one in a password must be percent-encoded)"
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
        """The proxies the environment names; a proxy URL or a NO_PROXY entry that cannot be read is a ConfigError.

        NO_PROXY is read only when a proxy is set: it changes nothing otherwise.
        """
        info = urllib.request.getproxies()
        by_scheme = {}
        for scheme in _PROXY_SCHEMES:
            value = info.get(scheme)
            if value:
                by_scheme[scheme] = proxy = value if "://" in value else f"http://{value}"
                _check_proxy(proxy, f"{scheme.upper()}_PROXY")
        entries = [part.strip() for part in info.get("no", "").split(",")]
        if not by_scheme or "*" in entries:
            return cls({})
        return cls(by_scheme, tuple(_Bypass.parse(entry) for entry in entries if entry))

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
                    # httpx's message quotes the URL, with a token that is not user:password unmasked
                    variable = f"{scheme.upper()}_PROXY"
                    if isinstance(exc, ImportError):
                        why = "SOCKS needs the socksio package (pip install 'httpx[socks]')"
                    else:
                        why = "httpx proxies through http://, https://, socks5:// and socks5h:// only"
                    raise ConfigError(
                        f"{variable} (or {variable.lower()}) names a proxy httpx cannot use, {shown_url(proxy)}: "
                        f"{why} ({type(exc).__name__})"
                    ) from None
            where = "every URL" if scheme == "all" else f"{scheme}:// URLs"
            logger.info("requests to %s go through the proxy %s (%s_PROXY)", where, shown_url(proxy), scheme.upper())

    def transport_for(self, url: str | httpx.URL) -> httpx.AsyncBaseTransport:
        """The transport for requests to ``url`` (its proxy's, or the engine's)."""
        url = httpx.URL(url)
        proxy = self.proxies.proxy_for(url)
        if proxy is None:
            return self.direct
        origin = f"{url.scheme}://{url.netloc.decode('ascii')}"
        if (origin, proxy) not in self._logged:
            self._logged.add((origin, proxy))
            logger.info("%s is reached through the proxy %s", origin, shown_url(proxy))
        return self._via[proxy]

    def mounts_for(self, url: str | httpx.URL) -> dict[str, httpx.AsyncBaseTransport]:
        """``httpx.AsyncClient(mounts=...)`` that send requests to ``url``'s origin where :meth:`transport_for` says."""
        url = httpx.URL(url)
        transport = self.transport_for(url)
        return {} if transport is self.direct else {f"{url.scheme}://{url.netloc.decode('ascii')}": transport}

    async def aclose(self) -> None:
        for transport in self._via.values():
            await transport.aclose()
