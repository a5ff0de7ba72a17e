"""How the engine reaches its servers: URLs with credentials, private CAs over real TLS, proxies from the environment.

Every server is real and on 127.0.0.1: endpoints and judges (``tests/servers.py``), a TLS server
with a certificate signed by a test CA (made with ``trustme``), and a minimal HTTP forward proxy that
counts what it forwards.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest
import trustme
from cli_support import make_workspace, row, write_rows
from conftest import SleepRecorder, add_endpoint_env, add_rubric_env, item
from servers import Request, Response, Server

import engine
from engine import ConfigError, EngineConfig, JudgeConfig, Limits, VerificationError, load_config
from engine._http.network import Proxies, ssl_context
from engine._reasons import Scrubber
from engine._verifiers.endpoint.verifier import EndpointVerifier
from engine.cli import EXIT_BAD_INPUT

RUBRICS = Path(__file__).parent / "rubrics"
ARITH = "alice/arithmetic-correctness"  # version 1 scores on [0, 1]
SECRET = "s3cr3t-PASS"  # the password in every URL with credentials below


def leaked(*texts: str) -> bool:
    return any(SECRET in text for text in texts)


# --- credentials in URLs ---------------------------------------------------------------------------


@pytest.fixture
def all_logs(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    """Every record of the engine's and httpx's loggers, down to DEBUG."""
    caplog.set_level(logging.DEBUG, logger="engine")
    caplog.set_level(logging.DEBUG, logger="httpx")
    return caplog


async def test_an_endpoint_url_with_credentials_is_refused_and_never_shown(
    envs: Path, all_logs: pytest.LogCaptureFixture
) -> None:
    with Server.json(lambda request: {"reward": 1.0}) as server:
        plain = f"{server.url}/score"
        add_endpoint_env(envs, "secret", plain.replace("://", f"://alice:{SECRET}@"))
        async with engine.Engine(EngineConfig(environments=envs)) as eng:
            with pytest.raises(ConfigError) as info:
                await eng.run([item("secret", item_id="a")])
        assert server.requests == []  # nothing was sent
    err = info.value
    message = str(err)
    assert "field 'verifier.ref': the URL carries credentials" in message, message
    assert f'[refs."{plain}"] headers = {{ Authorization = "Basic ${{VERIFIER_AUTH}}" }}' in message, message
    assert not leaked(message, repr(err), all_logs.text, *(r.getMessage() for r in all_logs.records))


def test_the_command_line_refuses_it_and_writes_no_reward(tmp_path: Path) -> None:
    with Server.json(lambda request: {"reward": 1.0}) as server:
        space = make_workspace(tmp_path)
        add_endpoint_env(space.envs, "secret", f"{server.url}/score".replace("://", f"://alice:{SECRET}@"))
        out = space.root / "out.jsonl"
        result = space.score(write_rows(space.root / "in.jsonl", [row(0, "secret")]), out)
        assert server.requests == []
    assert result.returncode == EXIT_BAD_INPUT, result.stderr
    assert "the URL carries credentials" in result.stderr
    assert not leaked(result.stdout, result.stderr)
    written = [path.read_bytes().decode(errors="replace") for path in space.root.rglob("out*") if path.is_file()]
    assert not leaked(*written)  # no provenance (nor anything else) holds it


@pytest.mark.parametrize("userinfo", [f"alice:{SECRET}", SECRET])
def test_a_judge_base_url_with_credentials_is_refused_without_echoing_it(tmp_path: Path, userinfo: str) -> None:
    path = tmp_path / "engine.toml"
    path.write_text(f'[judge]\nbase_url = "https://{userinfo}@judge.example/v1"\nmodel = "m"\n')
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert message.startswith(f"{path}: judge.base_url: the URL carries credentials"), message
    assert 'use https://judge.example/v1 and send them in a header read from an environment variable: ' in message
    assert 'headers = { Authorization = "Basic ${JUDGE_AUTH}" }' in message, message
    assert not leaked(message, repr(info.value))


def test_a_judge_config_built_in_code_refuses_credentials_too(all_logs: pytest.LogCaptureFixture) -> None:
    """httpx would have sent them, and logged the URL, password and all, at INFO with every request."""
    with Server.judge() as judge:
        base_url = judge.base_url.replace("://", f"://alice:{SECRET}@")
        with pytest.raises(ConfigError) as info:
            JudgeConfig(base_url=base_url, model="m")
        assert judge.requests == []
    assert not leaked(str(info.value), repr(info.value), all_logs.text)


async def test_the_judge_sends_basic_auth_from_a_header_variable_and_never_shows_it(
    envs: Path, monkeypatch: pytest.MonkeyPatch, all_logs: pytest.LogCaptureFixture
) -> None:
    """What the refusal points at: ``[judge] headers``, read at each call and scrubbed from messages."""
    add_rubric_env(envs, "graded", f"{ARITH}@1")
    monkeypatch.delenv("ENGINE_TEST_JUDGE_AUTH", raising=False)
    echo = Response.json({"error": {"message": f"bad credentials {SECRET}"}}, 403)
    with Server.judge(echo) as judge:
        headers = {"Authorization": "Basic ${ENGINE_TEST_JUDGE_AUTH}"}
        config = EngineConfig(
            environments=envs, rubrics=RUBRICS, judge=JudgeConfig(base_url=judge.base_url, model="m", headers=headers)
        )
        async with engine.Engine(config) as eng:
            with pytest.raises(VerificationError) as unset:
                await eng.score([item("graded", "42", prompt="6 * 7?")])
            assert judge.requests == []
            monkeypatch.setenv("ENGINE_TEST_JUDGE_AUTH", SECRET)
            with pytest.raises(VerificationError) as echoed:
                await eng.score([item("graded", "42", prompt="6 * 7?")])
            assert await eng.score([item("graded", "42", prompt="6 * 7?")]) == [1.0]
        assert [request.headers["authorization"] for request in judge.requests] == [f"Basic {SECRET}"] * 2
    assert "the judge's header Authorization: environment variable ENGINE_TEST_JUDGE_AUTH is not set" in str(
        unset.value
    )
    assert "judge answered HTTP 403" in echoed.value.reason and "[redacted]" in echoed.value.reason
    assert not leaked(str(echoed.value), repr(echoed.value), all_logs.text)


# How a server may echo a secret in a JSON body: escaped as json writes it (ensure_ascii), as orjson
# writes it, and with '/' escaped too (PHP, Go's HTML-safe encoder).
ECHOES = {
    "json": lambda value: json.dumps(value).encode(),
    "orjson": orjson.dumps,
    "slashes": lambda value: json.dumps(value).replace("/", "\\/").encode(),
}
ESCAPED_KEY = f'q"u\\o/te-{SECRET}-b\\a"ck/'  # printable ASCII, as a header carries: '"', '\' and '/' in JSON


def test_the_scrubber_removes_every_json_form_of_a_secret() -> None:
    """Also non-ASCII (escaped as \\uXXXX in either case, a surrogate pair beyond the BMP), which no header carries."""
    secret = f'"\\/é😀{SECRET}'
    scrub = Scrubber([secret, "other"])
    ascii_json = json.dumps(secret)[1:-1]
    forms = {
        secret,
        ascii_json,
        re.sub(r"\\u([0-9a-f]{4})", lambda match: f"\\u{match[1].upper()}", ascii_json),  # upper-case hex
        json.dumps(secret, ensure_ascii=False)[1:-1],
        orjson.dumps(secret).decode()[1:-1],
    }
    forms |= {form.replace("/", "\\/") for form in forms}
    assert len(forms) == 8
    for form in forms:
        assert scrub(f"bad key {form}!") == "bad key [redacted]!", form
        assert scrub.body(f"bad key {form}!".encode()) == b"bad key [redacted]!", form


@pytest.mark.parametrize("echo", list(ECHOES))
async def test_an_endpoint_echoing_a_header_secret_json_escaped_never_shows_it(
    envs: Path, monkeypatch: pytest.MonkeyPatch, all_logs: pytest.LogCaptureFixture, echo: str
) -> None:
    encode = ECHOES[echo]

    async def echoing(request: Request) -> Response:
        return Response(401, encode({"error": f"bad token {request.headers['authorization']}"}))

    monkeypatch.setenv("ENGINE_TEST_TOKEN", ESCAPED_KEY)
    with Server(echoing) as server:
        url = f"{server.url}/score"
        add_endpoint_env(envs, "remote", url)
        limits = Limits(headers={"Authorization": "Bearer ${ENGINE_TEST_TOKEN}"})
        config = EngineConfig(environments=envs, refs={url: limits})
        async with engine.Engine(config) as eng:
            with pytest.raises(VerificationError) as info:
                await eng.score([item("remote")])
        assert [request.headers["authorization"] for request in server.requests] == [f"Bearer {ESCAPED_KEY}"]
    assert "HTTP 401" in info.value.reason and "[redacted]" in info.value.reason, info.value.reason
    assert not leaked(str(info.value), repr(info.value), all_logs.text)


@pytest.mark.parametrize("echo", list(ECHOES))
@pytest.mark.parametrize("where", ["error", "reply"])
async def test_a_judge_echoing_its_api_key_json_escaped_never_shows_it(
    envs: Path, monkeypatch: pytest.MonkeyPatch, all_logs: pytest.LogCaptureFixture, echo: str, where: str
) -> None:
    """In an error body, or in the reply's content (decoded, it is the key as it is: the body is scrubbed first)."""
    encode = ECHOES[echo]

    def echoing(request: Request) -> Response:
        said = f"your key was {request.headers['authorization']}"
        if where == "error":
            return Response(401, encode({"error": {"message": said}}))
        return Response(200, encode({"choices": [{"message": {"content": said}, "finish_reason": "stop"}]}))

    add_rubric_env(envs, "graded", f"{ARITH}@1")
    monkeypatch.setenv("ENGINE_TEST_JUDGE_KEY", ESCAPED_KEY)
    with Server.judge(echoing) as judge:
        judge_config = JudgeConfig(base_url=judge.base_url, model="m", api_key_env="ENGINE_TEST_JUDGE_KEY")
        config = EngineConfig(environments=envs, rubrics=RUBRICS, judge=judge_config)
        async with engine.Engine(config) as eng:
            with pytest.raises(VerificationError) as info:
                await eng.score([item("graded", "42", prompt="6 * 7?")])
        assert [request.headers["authorization"] for request in judge.requests] == [f"Bearer {ESCAPED_KEY}"]
    assert "[redacted]" in info.value.reason, info.value.reason
    assert not leaked(str(info.value), repr(info.value), all_logs.text)


@pytest.mark.parametrize(
    ("headers", "key", "message"),
    [
        ({"Authorization": f"Basic {SECRET}"}, "judge.headers.Authorization", "must name an environment variable"),
        ({"Host": "${H}"}, "judge.headers.Host", "is set by the engine itself"),
        ({"Authorization": "Bearer ${K}"}, "judge.headers.Authorization", "api_key_env sends it already"),
        ("x", "judge.headers", "must be a table"),
    ],
)
def test_bad_judge_headers_are_refused_naming_the_key(headers: object, key: str, message: str) -> None:
    table = {"base_url": "http://h/v1", "model": "m", "api_key_env": "KEY", "headers": headers}
    with pytest.raises(ConfigError) as info:
        JudgeConfig.from_table(table, Path("engine.toml"))
    assert str(info.value).startswith(f"engine.toml: {key}: "), str(info.value)
    assert message in str(info.value) and not leaked(str(info.value)), str(info.value)


def test_a_refs_key_with_credentials_is_refused_without_echoing_it(tmp_path: Path) -> None:
    path = tmp_path / "engine.toml"
    path.write_text(f'[refs."http://alice:{SECRET}@127.0.0.1:8080/score"]\nmax_concurrency = 2\n')
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert message.startswith(f"{path}: refs.'http://127.0.0.1:8080/score': the URL carries credentials"), message
    assert not leaked(message, repr(info.value))


def test_an_endpoint_verifier_built_in_code_refuses_credentials_too() -> None:
    with pytest.raises(ValueError, match="must not carry credentials") as info:
        EndpointVerifier(f"http://u:{SECRET}@127.0.0.1:1/score", Limits(), httpx.AsyncHTTPTransport())
    assert not leaked(str(info.value))


# A password with an unencoded '/', '?' or '#': where the authority ends is ambiguous, and httpx's own
# error ("Invalid port: 'pa'") quotes the start of the password.
AMBIGUOUS = [f"alice:pa/{SECRET}", f"alice:123/{SECRET}", f"alice:pa#{SECRET}", f"alice:pa?{SECRET}"]
CARRIES = "the URL carries credentials"
UNREADABLE = "httpx cannot read it as a URL"


@pytest.mark.parametrize("userinfo", AMBIGUOUS)
async def test_an_endpoint_url_with_an_ambiguous_password_is_refused_at_load_without_showing_it(
    envs: Path, all_logs: pytest.LogCaptureFixture, userinfo: str
) -> None:
    """A ManifestError when the manifest is read, not a raw httpx.InvalidURL from the first call."""
    with Server.json(lambda request: {"reward": 1.0}) as server:
        add_endpoint_env(envs, "secret", f"{server.url}/score".replace("://", f"://{userinfo}@"))
        async with engine.Engine(EngineConfig(environments=envs)) as eng:
            with pytest.raises(ConfigError) as info:
                await eng.score([item("secret")])
        assert server.requests == []
    message = str(info.value)
    assert "field 'verifier.ref': " in message and f"{server.url}/score" in message, message
    assert CARRIES in message, message  # an '@' anywhere: it may carry them
    assert not leaked(message, repr(info.value), all_logs.text)


def test_an_endpoint_verifier_built_in_code_refuses_a_url_httpx_cannot_read() -> None:
    with pytest.raises(ValueError, match=UNREADABLE):
        EndpointVerifier("http://127.0.0.1:notaport/score", Limits(), httpx.AsyncHTTPTransport())
    with pytest.raises(ValueError, match=CARRIES) as info:  # and one that may hold a password, without showing it
        EndpointVerifier(f"http://u:pa#{SECRET}@127.0.0.1:1/score", Limits(), httpx.AsyncHTTPTransport())
    assert not leaked(str(info.value))


@pytest.mark.parametrize("userinfo", [*AMBIGUOUS, f"alice:pa {SECRET}"])
def test_a_judge_base_url_with_an_ambiguous_password_is_refused_without_showing_it(
    tmp_path: Path, userinfo: str
) -> None:
    """Refused with the config, not as a raw httpx.InvalidURL when the engine opens; no part of it repeated."""
    path = tmp_path / "engine.toml"
    path.write_text(f'[judge]\nbase_url = "http://{userinfo}@127.0.0.1:9/v1"\nmodel = "m"\n')
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert message.startswith(f"{path}: judge.base_url: "), message
    assert "http://127.0.0.1:9/v1" in message and not leaked(message, repr(info.value)), message


def test_a_judge_base_url_httpx_cannot_read_is_a_config_error() -> None:
    with pytest.raises(ConfigError) as info:
        JudgeConfig(base_url="http://127.0.0.1:notaport/v1", model="m")
    assert str(info.value) == (
        "judge.base_url: httpx cannot read it as a URL: http://127.0.0.1:notaport/v1 (Invalid port: 'notaport')"
    )


@pytest.mark.parametrize("userinfo", AMBIGUOUS)
def test_a_refs_key_with_an_ambiguous_password_is_refused_without_showing_it(tmp_path: Path, userinfo: str) -> None:
    path = tmp_path / "engine.toml"
    path.write_text(f'[refs."http://{userinfo}@127.0.0.1:8080/score"]\nmax_concurrency = 2\n')
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert message.startswith(f"{path}: refs.'http://127.0.0.1:8080/score': "), message
    assert CARRIES in message, message  # an '@' anywhere: it may carry them
    assert not leaked(message, repr(info.value))



# --- TLS: failing verification, and a private CA added to the default trust ---------------------------


@pytest.fixture
def private_ca(tmp_path: Path) -> tuple[trustme.CA, Path]:
    """A CA no default trust store knows, and its certificate written as a PEM file."""
    ca = trustme.CA()
    path = tmp_path / "private-ca.pem"
    ca.cert_pem.write_to_path(str(path))
    return ca, path


@pytest.fixture
def tls_endpoint(private_ca: tuple[trustme.CA, Path]) -> Iterator[Server]:
    with Server.json(lambda request: {"reward": 0.75}, tls=private_ca[0].issue_cert("127.0.0.1")) as server:
        yield server


async def test_an_untrusted_certificate_fails_at_once_saying_why(
    envs: Path, tls_endpoint: Server, sleeps: SleepRecorder
) -> None:
    add_endpoint_env(envs, "private", f"{tls_endpoint.url}/score")
    async with engine.Engine(EngineConfig(environments=envs), sleep=sleeps) as eng:
        with pytest.raises(VerificationError) as info:
            await eng.score([item("private")])
    err = info.value
    assert err.reason.startswith("TLS certificate verification failed: "), err.reason
    assert "gave up" not in err.reason  # one attempt: a certificate that fails verification fails again
    assert sleeps.calls == []  # no retry waited for
    assert tls_endpoint.requests == []


async def test_ca_bundle_trusts_a_private_ca_for_endpoints(
    envs: Path, tls_endpoint: Server, private_ca: tuple[trustme.CA, Path]
) -> None:
    add_endpoint_env(envs, "private", f"{tls_endpoint.url}/score")
    async with engine.Engine(EngineConfig(environments=envs, ca_bundle=private_ca[1])) as eng:
        assert await eng.score([item("private"), item("private")]) == [0.75, 0.75]
    assert len(tls_endpoint.requests) == 2


async def test_ca_bundle_trusts_a_private_ca_for_the_judge(
    envs: Path, private_ca: tuple[trustme.CA, Path], sleeps: SleepRecorder
) -> None:
    add_rubric_env(envs, "graded", f"{ARITH}@1")
    with Server.judge(tls=private_ca[0].issue_cert("127.0.0.1")) as judge:
        judged = JudgeConfig(base_url=judge.base_url, model="m")
        untrusted = EngineConfig(environments=envs, rubrics=RUBRICS, judge=judged)
        async with engine.Engine(untrusted, sleep=sleeps) as eng:
            with pytest.raises(VerificationError) as info:
                await eng.score([item("graded", "42", prompt="6 * 7?")])
        assert "judge request failed: TLS certificate verification failed: " in info.value.reason, info.value.reason
        assert sleeps.calls == [] and judge.requests == []
        trusted = EngineConfig(environments=envs, rubrics=RUBRICS, judge=judged, ca_bundle=private_ca[1])
        async with engine.Engine(trusted) as eng:
            assert await eng.score([item("graded", "42", prompt="6 * 7?")]) == [1.0]
        assert len(judge.requests) == 1


async def test_ca_bundle_is_added_to_the_default_trust_not_put_in_its_place(
    envs: Path, tmp_path: Path, private_ca: tuple[trustme.CA, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """One engine verifies a server the default trust knows and one only ca_bundle knows.

    The default trust is httpx's: certifi's bundle, or SSL_CERT_FILE when set, which stands for the
    public CAs here (no test reaches a public server).
    """
    public_ca = trustme.CA()
    public_pem = tmp_path / "public-ca.pem"
    public_ca.cert_pem.write_to_path(str(public_pem))
    monkeypatch.setenv("SSL_CERT_FILE", str(public_pem))
    def reward(request: Request) -> dict[str, float]:
        return {"reward": 0.5}

    with (
        Server.json(reward, tls=public_ca.issue_cert("127.0.0.1")) as public,
        Server.json(reward, tls=private_ca[0].issue_cert("127.0.0.1")) as private,
    ):
        add_endpoint_env(envs, "public", f"{public.url}/score")
        add_endpoint_env(envs, "private", f"{private.url}/score")
        async with engine.Engine(EngineConfig(environments=envs, ca_bundle=private_ca[1])) as eng:
            assert await eng.score([item("public"), item("private")]) == [0.5, 0.5]


def test_the_context_holds_the_default_bundle_and_the_private_ca(private_ca: tuple[trustme.CA, Path]) -> None:
    default = httpx.create_ssl_context().cert_store_stats()["x509_ca"]
    assert default > 1  # certifi's bundle
    assert ssl_context(private_ca[1]).cert_store_stats()["x509_ca"] == default + 1


def test_ca_bundle_is_relative_to_the_config_file(tmp_path: Path, private_ca: tuple[trustme.CA, Path]) -> None:
    (tmp_path / "conf").mkdir()
    private_ca[1].rename(tmp_path / "conf" / "ca.pem")
    path = tmp_path / "conf" / "engine.toml"
    path.write_text('ca_bundle = "ca.pem"\n')
    assert load_config(path).ca_bundle == tmp_path / "conf" / "ca.pem"


@pytest.mark.parametrize(
    ("content", "value", "message"),
    [
        (None, '"missing.pem"', "ca_bundle: no such file: "),
        (b"not a certificate\n", '"bad.pem"', "does not load as PEM CA certificates"),
        (b"", '"bad.pem"', "bad.pem does not load as PEM CA certificates"),
        (None, '"."', "ca_bundle: not a file: "),
        (None, "3", "ca_bundle: must be the path of a PEM file of CA certificates, got 3"),
        (None, '""', "ca_bundle: must be the path of a PEM file"),
    ],
)
def test_a_bad_ca_bundle_is_a_config_error_naming_the_key(
    tmp_path: Path, content: bytes | None, value: str, message: str
) -> None:
    if content is not None:
        (tmp_path / "bad.pem").write_bytes(content)
    path = tmp_path / "engine.toml"
    path.write_text(f"ca_bundle = {value}\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value).startswith(f"{path}: ca_bundle: "), str(info.value)
    assert message in str(info.value), str(info.value)


# --- proxies from the environment -----------------------------------------------------------------

async def forward(request: Request) -> Response:
    """A plain HTTP forward proxy: takes ``POST http://host:port/path`` (absolute form) and forwards it.

    Its server's ``requests`` hold what it forwarded, each with its absolute URL as ``path``.
    """
    assert request.path.startswith("http://"), request.path  # a proxy is sent the absolute form
    headers = {k: v for k, v in request.headers.items() if k not in ("host", "proxy-authorization", "connection")}
    async with httpx.AsyncClient(trust_env=False) as client:
        answer = await client.request(request.method, request.path, content=request.body, headers=headers)
    chunked = answer.headers.get("transfer-encoding") == "chunked"  # passed on as it came: no length
    headers = {"content-type": answer.headers.get("content-type", "")}
    return Response(answer.status_code, answer.content, headers, chunked=chunked, piece=512)


@pytest.fixture
def proxy() -> Iterator[Server]:
    with Server(forward) as server:
        yield server


@pytest.fixture
def target(envs: Path) -> Iterator[Server]:
    """An endpoint (environment ``remote``) answering each item's task's ``r`` as its reward."""
    with Server.json(lambda request: {"reward": request.json()["task"]["r"]}) as server:
        add_endpoint_env(envs, "remote", f"{server.url}/score")
        yield server


async def test_an_endpoint_goes_through_the_proxy_the_environment_names(
    envs: Path, proxy: Server, target: Server, no_proxies: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="engine")
    no_proxies.setenv("HTTP_PROXY", proxy.url.replace("://", f"://bob:{SECRET}@"))
    async with engine.Engine(EngineConfig(environments=envs)) as eng:
        assert await eng.score([item("remote", r=r) for r in (0.25, 0.5, 1)]) == [0.25, 0.5, 1.0]
    assert sorted(request.path for request in proxy.requests) == [f"{target.url}/score"] * 3
    assert len(target.requests) == 3
    assert all(request.headers["proxy-authorization"].startswith("Basic ") for request in proxy.requests)
    lines = [record.getMessage() for record in caplog.records]
    assert f"requests to http:// URLs go through the proxy {proxy.url} (HTTP_PROXY)" in lines, lines
    assert lines.count(f"{target.url} is reached through the proxy {proxy.url}") == 1, lines
    assert not leaked(caplog.text)


@pytest.mark.parametrize("no_proxy", ["127.0.0.1", "localhost,127.0.0.1", "*", "example.com, 127.0.0.1"])
async def test_an_endpoint_no_proxy_covers_is_called_directly(
    envs: Path, proxy: Server, target: Server, no_proxies: pytest.MonkeyPatch, no_proxy: str
) -> None:
    no_proxies.setenv("HTTP_PROXY", proxy.url)
    no_proxies.setenv("no_proxy", no_proxy)
    async with engine.Engine(EngineConfig(environments=envs)) as eng:
        assert await eng.score([item("remote", r=0.5)]) == [0.5]
    assert proxy.requests == [] and len(target.requests) == 1


async def test_all_proxy_is_used_and_https_proxy_is_not_for_http(
    envs: Path, proxy: Server, target: Server, no_proxies: pytest.MonkeyPatch
) -> None:
    no_proxies.setenv("HTTPS_PROXY", "http://127.0.0.1:9")  # for https:// URLs only: never used here
    no_proxies.setenv("all_proxy", proxy.url)
    async with engine.Engine(EngineConfig(environments=envs)) as eng:
        assert await eng.score([item("remote", r=0.5)]) == [0.5]
    assert len(proxy.requests) == 1


async def test_a_proxied_call_keeps_max_body_and_the_whole_call_timeout(
    envs: Path, proxy: Server, no_proxies: pytest.MonkeyPatch, sleeps: SleepRecorder
) -> None:
    async def big_or_never(request: Request) -> Response:
        task = request.json()["task"]
        if task.get("hang"):
            await asyncio.sleep(60)  # cancelled when the caller gives up
        big = Response.json({"reward": 1, "padding": "x" * 4096})
        big.chunked = bool(task.get("chunked"))  # no length announced: the body is cut off as it grows
        return big

    no_proxies.setenv("HTTP_PROXY", proxy.url)
    with Server(big_or_never) as server:
        url = f"{server.url}/score"
        add_endpoint_env(envs, "remote", url)
        # a second and a half: the calls that answer go through two servers in this process (a loaded machine's)
        config = EngineConfig(environments=envs, refs={url: Limits(max_body=1024, timeout=1.5)})
        async with engine.Engine(config, sleep=sleeps) as eng:
            with pytest.raises(VerificationError) as big:
                await eng.score([item("remote")])
            with pytest.raises(VerificationError) as grown:
                await eng.score([item("remote", chunked=True)])
            with pytest.raises(VerificationError) as hung:
                await eng.score([item("remote", hang=True)])
    assert "response body of 4121 bytes is over the 1 KiB limit (max_body)" in big.value.reason, big.value.reason
    assert "response body over the 1 KiB limit (max_body)" in grown.value.reason, grown.value.reason
    assert "timeout: 1.5 s for the whole call" in hung.value.reason, hung.value.reason
    assert len(proxy.requests) == 3 and sleeps.calls == []


async def test_the_judge_goes_through_the_proxy_unless_no_proxy_covers_it(
    envs: Path, proxy: Server, no_proxies: pytest.MonkeyPatch
) -> None:
    add_rubric_env(envs, "graded", f"{ARITH}@1")
    no_proxies.setenv("HTTP_PROXY", proxy.url)
    with Server.judge() as judge:
        config = EngineConfig(environments=envs, rubrics=RUBRICS, judge=JudgeConfig(base_url=judge.base_url, model="m"))
        async with engine.Engine(config) as eng:
            assert await eng.score([item("graded", "42", prompt="6 * 7?")]) == [1.0]
        assert [request.path for request in proxy.requests] == [f"{judge.base_url}/chat/completions"]
        no_proxies.setenv("NO_PROXY", "127.0.0.1")
        async with engine.Engine(config) as eng:
            assert await eng.score([item("graded", "42", prompt="6 * 7?")]) == [1.0]
        assert len(proxy.requests) == 1 and len(judge.requests) == 2


@pytest.mark.parametrize("userinfo", [f"carol:{SECRET}", SECRET])  # httpx masks a password, not a lone token
async def test_a_proxy_httpx_cannot_use_is_a_config_error_at_open(
    envs: Path, no_proxies: pytest.MonkeyPatch, userinfo: str
) -> None:
    no_proxies.setenv("HTTPS_PROXY", f"ftp://{userinfo}@127.0.0.1:21")
    with pytest.raises(ConfigError) as info:
        async with engine.Engine(EngineConfig(environments=envs)):
            pass
    message = str(info.value)
    assert message.startswith("HTTPS_PROXY (or https_proxy) names a proxy httpx cannot use, ftp://127.0.0.1:21: ")
    assert "httpx proxies through http://, https://, socks5:// and socks5h:// only (ValueError)" in message, message
    assert not leaked(message, repr(info.value))


@pytest.mark.parametrize("userinfo", AMBIGUOUS)
async def test_a_proxy_url_with_an_ambiguous_password_is_a_config_error_that_never_shows_it(
    envs: Path, no_proxies: pytest.MonkeyPatch, all_logs: pytest.LogCaptureFixture, userinfo: str
) -> None:
    """Not a raw httpx.InvalidURL quoting the password's start; and not the proxy ``alice:123`` httpx would
    read from ``alice:123/...@host``, logged at INFO password and all."""
    no_proxies.setenv("HTTP_PROXY", f"http://{userinfo}@127.0.0.1:9")
    with pytest.raises(ConfigError) as info:
        async with engine.Engine(EngineConfig(environments=envs)):
            pass
    message = str(info.value)
    assert message.startswith("HTTP_PROXY (or http_proxy): ") and "http://127.0.0.1:9" in message, message
    assert not leaked(message, repr(info.value), all_logs.text)


@pytest.mark.parametrize("no_proxy", ["[::1]", "host:notaport", "[::1]:x"])
async def test_no_proxy_is_not_read_when_no_proxy_is_set(
    envs: Path, target: Server, no_proxies: pytest.MonkeyPatch, no_proxy: str
) -> None:
    """It changes nothing then, so an entry httpx cannot read does not stop the engine from opening."""
    no_proxies.setenv("NO_PROXY", no_proxy)
    async with engine.Engine(EngineConfig(environments=envs)) as eng:
        assert await eng.score([item("remote", r=0.5)]) == [0.5]
    assert len(target.requests) == 1


@pytest.mark.parametrize("no_proxy", ["host:notaport", "example.com, [::1]:x"])
async def test_a_no_proxy_entry_httpx_cannot_read_is_a_config_error_naming_it(
    envs: Path, no_proxies: pytest.MonkeyPatch, no_proxy: str
) -> None:
    no_proxies.setenv("HTTP_PROXY", "http://127.0.0.1:9")
    no_proxies.setenv("no_proxy", no_proxy)
    with pytest.raises(ConfigError) as info:
        async with engine.Engine(EngineConfig(environments=envs)):
            pass
    entry = no_proxy.rpartition(" ")[2]
    assert str(info.value).startswith(f"NO_PROXY (or no_proxy) holds {entry!r}, which httpx cannot read"), info.value


PROXY = "http://proxy.invalid:3128"  # never reached: these tests only ask which URLs would go to it


def proxy_for(no_proxies: pytest.MonkeyPatch, no_proxy: str, url: str) -> str | None:
    """The proxy the engine sends ``url`` through, with HTTP_PROXY set and NO_PROXY as given."""
    no_proxies.setenv("HTTP_PROXY", PROXY)
    no_proxies.setenv("NO_PROXY", no_proxy)
    return Proxies.from_environment().proxy_for(httpx.URL(url))


@pytest.mark.parametrize(
    ("no_proxy", "url", "direct"),
    [
        ("[::1]", "http://[::1]/score", True),
        ("[::1]", "http://[::1]:8080/score", True),
        ("[::1]", "http://[::2]/score", False),
        ("[::1]:8080", "http://[::1]:8080/score", True),
        ("[::1]:8080", "http://[::1]/score", False),
    ],
)
def test_a_bracketed_ipv6_no_proxy_entry_is_that_address(
    no_proxies: pytest.MonkeyPatch, no_proxy: str, url: str, direct: bool
) -> None:
    """httpx itself raises on ``[::1]`` (it reads it as a domain); curl and others take it for ::1."""
    assert proxy_for(no_proxies, no_proxy, url) == (None if direct else PROXY)


@pytest.mark.parametrize(
    ("no_proxy", "host", "direct"),
    [
        ("example.com", "example.com", True),
        ("example.com", "www.example.com", True),
        ("example.com", "wwwexample.com", False),
        (".example.com", "example.com", False),
        (".example.com", "www.example.com", True),
        ("localhost", "localhost", True),
        ("localhost", "127.0.0.1", False),  # as httpx: a loopback address is proxied unless NO_PROXY names it
        ("::1", "[::1]", True),
        ("example.com:8080", "example.com:8080", True),
        ("example.com:8080", "example.com", False),
        ("http://example.com", "example.com", True),
        ("", "127.0.0.1", False),
    ],
)
def test_no_proxy_is_read_as_httpx_reads_it(
    no_proxies: pytest.MonkeyPatch, no_proxy: str, host: str, direct: bool
) -> None:
    url = f"http://{host}/score"
    assert proxy_for(no_proxies, no_proxy, url) == (None if direct else PROXY)
    # httpx itself, on a client that reads the environment, agrees
    client = httpx.Client()
    try:
        proxied = client._transport_for_url(httpx.URL(url)) is not client._transport
    finally:
        client.close()
    assert proxied is not direct
