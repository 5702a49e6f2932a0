"""Settings shared by every AGL process. Each default lives here once.

Every field can be set from an ``AGL_``-prefixed environment variable (``AGL_REDIS_URL``,
``AGL_PREFIX``...), as CONTRACT §4 requires.
"""

from __future__ import annotations

import os
import re
import shlex
import unicodedata
from urllib.parse import parse_qsl, urlencode, urlsplit

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
DEFAULT_PREFIX = "agl:"


def check_prefix(prefix: str) -> str:
    """Return ``prefix`` if it can prefix the Redis keys: printable text (not bytes that are not UTF-8), no ``{``
    or ``}`` (Redis Cluster hash-tag delimiters); else ``ValueError``. The Store and every settings model check it with this."""
    if not prefix.isprintable():  # a terminal escape, or bytes that are not UTF-8 (read as lone surrogates)
        raise ValueError(f"prefix {prefix!r} must be printable text")
    if "{" in prefix or "}" in prefix:
        raise ValueError(f"prefix {prefix!r} must not contain '{{' or '}}' (Redis Cluster hash-tag delimiters)")
    if not prefix.strip(":"):  # "" or ":": the keys' own hash tag would be "{}" (no slot: Redis Cluster fails)
        raise ValueError(f"prefix {prefix!r} must hold a name (e.g. 'agl:'): an empty one leaves the keys no hash tag")
    return prefix


def command_argv(command: str) -> list[str]:
    """A harness command line split as the controller runs it (``shlex``). Raises ``ValueError`` for an unclosed
    quote or a line that names no program (``"   "``, ``"''"``)."""
    argv = shlex.split(command)
    if not argv or not argv[0].strip():
        raise ValueError(f"command {command!r:.60} names no program to run")
    return argv


def check_bind_host(host: str) -> str:
    """Return ``host`` if it names one interface to listen on; ``ValueError`` for an empty or blank one (uvicorn
    reads ``""`` as every interface: an unset ``$HOST`` in ``--host "$HOST"`` would expose the service)."""
    if not host or host != host.strip():
        raise ValueError(f"--host {host!r} names no interface: give 127.0.0.1, or 0.0.0.0 for every interface")
    return host


#: Host header names a service bound to a loopback address answers (:func:`allowed_hosts`).
LOOPBACK_NAMES = ("127.0.0.1", "localhost", "[::1]")


def allowed_hosts(host: str) -> list[str]:
    """The ``Host`` header values a service bound to ``host`` answers (Starlette's ``TrustedHostMiddleware``): for
    a loopback bind (``127.x``, ``::1``, ``localhost``) only loopback names, so a web page cannot read it through DNS
    rebinding; for any other bind every name (``*``: it is reached by names this process cannot know)."""
    import ipaddress

    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name other than localhost
        loopback = False
    if loopback:  # (an IPv6 literal is named in brackets: Host: [::1]:8080)
        return sorted({*LOOPBACK_NAMES, f"[{host}]" if ":" in host else host})
    return ["*"]


def check_env_names(names: list[str] | tuple[str, ...], what: str = "pass-env") -> list[str]:
    """``names`` as a list if each is an environment variable name or an ``fnmatch`` glob (``MY_*``): not empty,
    no ``=``. Raises ``ValueError`` naming ``what`` (``--pass-env``, a config's ``harness_env``) otherwise."""
    for name in names:
        if not name or "=" in name:
            raise ValueError(f"{what}: {name!r} is not a variable name (or a glob like LC_*)")
    return list(names)


#: Query parameter names taken to hold a secret: one of these words, whole, in the name (``api_key``, ``X-Auth``,
#: ``accessToken``, ``password``), case-insensitive; ``ssl_keyfile``, ``tokenizer`` or ``author`` are not.
SECRET_PARAM = re.compile(r"(?:^|[^a-z])(?:pass|password|passwd|pwd|secret|token|key|apikey|auth|authorization|sig|"
                          r"signature|credential|credentials)(?:$|[^a-z])", re.IGNORECASE)


#: Characters that change how a terminal or an editor shows the text around them: bidirectional embeddings, overrides
#: and isolates (U+202A-U+202E, U+2066-U+2069; "Trojan Source") and the line and paragraph separators.
_REORDERING = frozenset("\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069\u2028\u2029")


def printable(text: str, keep: str = "") -> str:
    """``text`` with each control character (ESC and the other C0 and C1 codes), lone surrogate and bidirectional or
    line-separating mark (:data:`_REORDERING`) but those in ``keep`` written as its escape (``\\x1b``), so that
    nothing stored by a harness, sent by an engine or a Redis server, or typed by a user can drive the terminal it is
    shown on. Any other character is kept as it is: letters of any script, an ideographic space, a zero-width joiner."""
    return "".join(repr(c)[1:-1] if (unicodedata.category(c) in ("Cc", "Cs") or c in _REORDERING) and c not in keep
                   else c for c in text)


def printable_log_records() -> None:
    """From now on, every log record of this process has its message made printable (:func:`printable`, newlines and
    tabs kept), whatever logger and handler writes it: a gateway's or a controller's log lines carried a Redis
    server's error text with its terminal escapes. Calling it again changes nothing."""
    import logging

    factory = logging.getLogRecordFactory()
    if getattr(factory, "agl_printable", False):
        return

    def make(*args, **kwargs):
        record = factory(*args, **kwargs)
        try:
            record.msg, record.args = printable(record.getMessage(), "\n\t"), ()
            if record.exc_info and not record.exc_text:  # (a traceback's last line holds the server's text)
                record.exc_text = printable(logging.Formatter().formatException(record.exc_info), "\n\t")
            if record.stack_info:
                record.stack_info = printable(record.stack_info, "\n\t")
        except Exception:  # noqa: BLE001 - a record whose arguments do not fit its format: left to logging's report
            pass
        return record

    make.agl_printable = True  # type: ignore[attr-defined]
    logging.setLogRecordFactory(make)


def _credential_end(url: str) -> int | None:
    """Where the user part of ``url`` ends (the index of its ``@`` in ``url``) when ``urlsplit`` did not read it as one
    (:func:`unparsed_password`), else ``None``."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return None
    scheme, sep, rest = url.partition("://")
    first = re.match(r"[^/?#@]*", rest)[0]  # (what urlsplit took as the host and port)
    if not parts.scheme or not sep or "@" in parts.netloc or ":" not in first:
        return None
    at = re.search(r"@([^/?#@]*)(?=[/?#]|$)", rest)  # (the first @ followed by a host alone: "a/b@c:d@h" → "h")
    if at is None:
        return None
    port = first.rpartition(":")[2]
    host_port = re.fullmatch(r"(\[[^\]]*\]|[^:\[\]]+)(:[0-9]+)?", at[1])
    in_path = at.start() < min([i for i in (rest.find("?"), rest.find("#")) if i >= 0] or [len(rest)])
    # A port that is no number is a password's piece. Else an @ in the path (not the query: "?client_name=a@b") is
    # one in a Redis URL (its path is a database number) or before a host and its port ("http://h:8000/x@v1.2" is
    # a path).
    if (port and not port.isdigit()) or (in_path and (scheme.lower().startswith("redis") or (host_port and
                                                                                              host_port[2]))):
        return len(scheme) + 3 + at.start()
    return None


def unparsed_password(url: str) -> bool:
    """Whether ``url``'s user part holds a password with an unescaped ``/``, ``?`` or ``#`` (base64 passwords hold
    ``/``): ``urlsplit`` then ends the host at that character, reads ``user:pass`` as a host and a port, and the rest
    of the password as the path or query (``redis://:ab/cd@h:6379/0``, ``http://u:12/x@engine:8000``). Such a URL
    names no server; it is refused where it is read (percent-encode the password) and shown with all of it
    hidden."""
    return _credential_end(url) is not None


def redacted_url(url: str) -> str:
    """``url`` as it may be shown (logs, pages, messages, a run's files): a password in it replaced by ``***``,
    in the user part (``redis://:pw@h:6379/0`` → ``redis://:***@h:6379/0``) or a query parameter whose name says
    it holds a secret (:data:`SECRET_PARAM`: ``?password=pw`` → ``?password=***``, ``?api_key=``, ``?token=``...).
    Every place that prints a Redis, engine or gateway URL uses this (or :func:`redacted_urls` for a
    comma-separated list)."""
    url = printable(url)  # (shown: a URL typed or stored with terminal escapes must not drive the terminal)
    try:
        parts = urlsplit(url)
        query = parse_qsl(parts.query, keep_blank_values=True)
    except ValueError:  # not parseable: show nothing of it that could be a secret
        return "<unparseable URL>"
    if not parts.netloc and "@" in url:  # no scheme (``user:pw@host:8080``): nothing before the @ is shown
        return "***@" + url.rpartition("@")[2]
    end = _credential_end(url)
    if end is not None:  # (its user part read as a host, the rest of the password as a path: shown whole)
        return redacted_url(f"{url.partition('://')[0]}://***@{url[end + 1:]}")

    def secret(name: str) -> bool:  # camelCase split into words: accessToken -> access_Token
        return bool(SECRET_PARAM.search(re.sub(r"([a-z])([A-Z])", r"\1_\2", name)))

    if any(secret(k) for k, _ in query):
        parts = parts._replace(query="&".join(f"{k}=***" if secret(k) else
                                              urlencode([(k, v)], safe=":/") for k, v in query))
    if parts.fragment:  # (a fragment may carry a token: #access_token=...)
        parts = parts._replace(fragment="***")
    if not parts.password and parts.username:  # a user part alone may be a token (https://ghp_x@host, curl's key:)
        parts = parts._replace(netloc=f"***@{parts.netloc.rpartition('@')[2]}")
    elif parts.password is not None:
        host = parts.netloc.rpartition("@")[2]
        parts = parts._replace(netloc=f"{parts.username or ''}:***@{host}")
    return parts.geturl()


#: A URL inside a longer text (a command line's ``--base http://u:pw@h``): a scheme, ``://``, no space, quote or
#: comma (a comma-separated list is several URLs: the second one's password was shown).
URL_IN_TEXT = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>,]+")


def redacted_text(text: str) -> str:
    """``text`` with each URL in it (:data:`URL_IN_TEXT`) that holds a secret shown as :func:`redacted_url` shows
    it; the rest of the text, and URLs without a secret, unchanged. For free text that may hold a URL: a harness
    ``command``, a config's other string fields."""
    def one(m: re.Match) -> str:
        shown = redacted_url(m.group())
        return shown if "***" in shown or shown.startswith("<") else m.group()

    return URL_IN_TEXT.sub(one, text)


def hides_secret(text: str) -> bool:
    """Whether ``text`` holds a URL whose secret is already hidden (``***``, as :func:`redacted_text` shows it): a
    run's ``config.json`` read back would send ``***`` as the password."""
    urls = [u for part in text.split(",") for u in URL_IN_TEXT.findall(part)]  # (a list: each of its URLs)
    return any("***" in u and redacted_url(u) == u for u in urls)


def redacted_urls(value: str) -> str:
    """A comma-separated list of URLs (``--upstream``, ``engine_url``) as it may be shown: each :func:`redacted_url`."""
    return ",".join(redacted_url(u.strip()) for u in value.split(","))


def engine_base_urls(value: str) -> list[str]:
    """Engine base URLs from a comma-separated list (``agl-gateway serve --upstream``, the trainer's
    ``engine_url``), each stripped of spaces, a trailing ``/`` and a trailing ``/v1``:
    ``"http://a:8000/v1, http://b:8000/"`` → ``["http://a:8000", "http://b:8000"]``.

    Raises ``ValueError`` for an empty list or an entry that is not an ``http(s)://host[:port]`` URL (one
    such, ``notaurl``, used to be retried as an unreachable engine for ever)."""
    urls = [u.strip().rstrip("/").removesuffix("/v1") for u in value.split(",") if u.strip()]
    if not urls:
        raise ValueError("no engine URL given")
    return [check_http_url(url, "engine URL") for url in urls]


#: The engine's API key (environment only): the gateway sends it on every engine request (``GatewaySettings
#: .upstream_key``), and the trainer on its own (adapter loads, weight reloads, probes). A run that starts its vLLM
#: sets it to a fresh key of that engine's (``agl_trainer.stack.start_engine``).
ENGINE_KEY_ENV = "AGL_UPSTREAM_KEY"


def url_credentials(url: str) -> list[str]:
    """What a client sends for the user part of ``url`` (percent-decoded), as an engine echoing the request would show
    it: ``user:password``, its ``Basic`` base64 (what httpx sends, UTF-8, and aiohttp, latin-1: round 23, a password
    with an accent showed) and the password; a user alone (a token) and the base64 of ``user:`` when there is no
    password. ``[]`` for a URL without a user part. The one list of an
    engine URL's credentials: the gateway masks them in what it answers and records
    (``agl_gateway.upstream.engine_credentials``), the trainer in an engine's answer it shows
    (``agl_trainer.cycle._answer_excerpt``); each keeps the forms it can mask safely."""
    import base64
    from urllib.parse import unquote

    parts = urlsplit(url)
    if parts.username is None:
        return []
    user, password = unquote(parts.username), unquote(parts.password or "")
    pair = f"{user}:{password}"
    basic = [base64.b64encode(pair.encode(codec)).decode() for codec in ("utf-8", "latin-1")  # (httpx: UTF-8;
             if pair.encode(codec, "ignore").decode(codec) == pair]  # aiohttp: latin-1, where it can)
    if password:
        return list(dict.fromkeys([pair, *basic, password]))
    return list(dict.fromkeys(x for x in (user, *basic) if x))


def check_engine_key(key: str) -> str:
    """``key`` if it can be the engine's API key: 16 characters or more, letters, digits and ``._~+/=-`` (characters
    an HTTP header carries and no JSON or Python quoting escapes: the gateway masks it, and any prefix of 16
    characters or more, in what it answers and records), with a letter other than e/E or one of ``_~/=`` among its
    first 16 (never part of a JSON number: a masked number would break an answer). Else ``ValueError`` (the key
    itself is not shown). The one rule for the gateway's ``upstream_key`` and the trainer's own engine requests."""
    if len(key) < 16 or not re.fullmatch(r"[A-Za-z0-9._~+/=-]+", key):
        raise ValueError(f"{ENGINE_KEY_ENV} (the engine's key, {len(key)} characters): 16 characters or more, letters, "
                         "digits and ._~+/=- only (no spaces, newlines or other characters)")
    if not set(key[:16]) - set("0123456789.+-eE"):
        raise ValueError(f"{ENGINE_KEY_ENV}: its first 16 characters must hold a letter other than e/E, or one of "
                         "_~/= (digits alone would mask numbers in the answers)")
    return key


def engine_headers() -> dict[str, str]:
    """``{"Authorization": "Bearer <key>"}`` when :data:`ENGINE_KEY_ENV` is set and not empty, else ``{}``. Raises
    ``ValueError`` for a key :func:`check_engine_key` refuses (a trailing space or a newline was sent as is, and read
    as an engine that "cannot be reached")."""
    key = os.environ.get(ENGINE_KEY_ENV)
    return {"Authorization": f"Bearer {check_engine_key(key)}"} if key else {}


def check_gateway_url(url: str, what: str = "gateway URL") -> str:
    """``url`` if it can be the gateway's base URL (what each harness's ``/rollouts/{id}/attempts/{n}/v1`` URLs are
    built on): :func:`check_http_url`, no query or fragment, not ending in ``/v1`` (that is a harness's base URL,
    not the gateway's); else ``ValueError``."""
    check_http_url(url, what)
    parts = urlsplit(url)
    if parts.query or parts.fragment or url.endswith("#") or url.endswith("?"):
        raise ValueError(f"{what} {redacted_url(url)!r} must have no ?query or #fragment")
    if parts.path.rstrip("/").endswith("/v1"):
        raise ValueError(f"{what} {redacted_url(url)!r} is the gateway's base URL, without /v1 "
                         "(http://host:port): each harness's .../v1 URL is built on it")
    return url


def check_http_url(url: str, what: str = "URL") -> str:
    """``url`` if it is ``http(s)://host[:port][/path]``; else ``ValueError`` naming ``what`` (an engine's or the
    gateway's URL: a typo there fails every later call, or every harness run, as something else)."""
    if not url.isprintable():  # (a NUL or another control character: every call then failed deep in httpx)
        raise ValueError(f"{what} {redacted_url(url)!r} holds a control character")
    if unparsed_password(url):
        raise ValueError(f"{what} {redacted_url(url)!r}: its password holds '/', '?' or '#': percent-encode them "
                         "(%2F, %3F, %23)")
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError for a port that is not a number in range
    except ValueError as exc:
        raise ValueError(f"{what} {redacted_url(url)!r}: {exc}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{what} {redacted_url(url)!r} must be http(s)://host[:port][/path]")
    return url


class CommonSettings(BaseSettings):
    """Where Redis is and which key prefix this experiment uses."""

    model_config = SettingsConfigDict(env_prefix="AGL_", extra="ignore")

    redis_url: str = Field(default=DEFAULT_REDIS_URL, description=(
        "Redis URL; redis+cluster://host:port[,host:port...] selects Redis Cluster"))
    prefix: str = DEFAULT_PREFIX

    @field_validator("prefix")
    @classmethod
    def _prefix(cls, v: str) -> str:
        return check_prefix(v)
