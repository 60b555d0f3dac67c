"""web/web_config.py on the checkers of config/checks.py: every problem of a web-config named as
``key.path: must be ..., got ...`` (a password hash's value never), and the inputs the checks
used to let through to a crash: keys that are not strings, a zero rate-limit interval, a NUL
byte in a certificate's name (also on a reload while serving)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from pkiutil import make_pki

from gpuwatchd.web.web_config import ConfigHolder, WebConfigError, load_web_config, parse_web_config

HASH = "$2b$04$" + "a" * 53


def _problems(doc: object) -> list[str]:
    with pytest.raises(WebConfigError) as err:
        parse_web_config(doc, "/etc/gpuwatchd/web.yml")
    assert err.value.path == "/etc/gpuwatchd/web.yml"
    return err.value.problems


def test_every_bad_value_is_named_with_what_it_must_be() -> None:
    doc = {
        "tls_server_config": {
            "cert_file": 5,
            "key_file": "k",
            "client_auth_type": "RequireAndVerify",
            "min_version": "TLS1.2",
            "client_allowed_sans": "db",
            "prefer_server_cipher_suites": "yes",
            "cipher_suites": [],
        },
        "basic_auth_users": {"alice": "plaintext-password", "bob:x": HASH},
        "http_server_config": {"http2": 1, "headers": {"X-Evil": "1", "X-Frame-Options": "a\nb"}},
        "rate_limit": {"interval": "soon", "burst": -1},
        "tls_config": {},
    }
    assert _problems(doc) == [
        "tls_server_config.cert_file: must be a non-empty path string, got 5",
        "tls_server_config.client_auth_type: must be one of NoClientCert, VerifyClientCertIfGiven,"
        " RequireAndVerifyClientCert, got 'RequireAndVerify'",
        "tls_server_config.min_version: must be one of TLS10, TLS11, TLS12, TLS13, got 'TLS1.2'",
        "tls_server_config.client_allowed_sans: must be a list of non-empty strings, got 'db'",
        "tls_server_config.prefer_server_cipher_suites: must be true or false, got 'yes'",
        "tls_server_config.cipher_suites: not supported by gpuwatchd",
        "basic_auth_users.alice: not a bcrypt hash ($2b$10$... , 60 characters; make one with"
        " `gpuwatchd web-config hash`)",
        "basic_auth_users.bob:x: user names are non-empty and have no ':'",
        "http_server_config.http2: must be true or false, got 1",
        "http_server_config.headers.X-Evil: not one of Content-Security-Policy,"
        " Strict-Transport-Security, X-Content-Type-Options, X-Frame-Options, X-XSS-Protection",
        "http_server_config.headers.X-Frame-Options: must be a one-line string, got 'a\\nb'",
        "rate_limit.interval: must be a duration such as 1s, 100ms or 1m30s, got 'soon'",
        "rate_limit.burst: must be >= 0, got -1",
        "tls_config: unknown key",
    ]


def test_sections_of_the_wrong_shape_and_missing_keys() -> None:
    assert _problems(
        {
            "tls_server_config": ["cert_file"],
            "basic_auth_users": ["alice"],
            "rate_limit": {"burst": 2},
            "http_server_config": {"headers": "x"},
        }
    ) == [
        "tls_server_config: must be a mapping, got list",
        "basic_auth_users: must be a mapping, got list",
        "rate_limit.interval: required when rate_limit is set",
        "http_server_config.headers: must be a mapping, got str",
    ]
    assert _problems(
        {
            "tls_server_config": {
                "cert_file": "c",
                "client_allowed_sans": ["db"],
                "client_auth_type": "RequireAnyClientCert",
            }
        }
    ) == [
        "tls_server_config.client_auth_type: RequireAnyClientCert is not supported (Python's ssl"
        " cannot request a certificate without verifying it); use RequireAndVerifyClientCert",
        "tls_server_config.key_file: required when tls_server_config is set",
    ]
    assert _problems(
        {
            "tls_server_config": {
                "cert_file": "c",
                "key_file": "k",
                "client_allowed_sans": ["db"],
                "client_auth_type": "VerifyClientCertIfGiven",
            }
        }
    ) == ["tls_server_config.client_ca_file: required by client_auth_type VerifyClientCertIfGiven"]
    assert _problems({"tls_server_config": {"cert_file": "c", "key_file": "k", "client_allowed_sans": ["db"]}}) == [
        "tls_server_config.client_allowed_sans: needs a client_auth_type that verifies client certificates"
    ]
    assert _problems([]) == ["(top level): must be a mapping, got list"]


def test_a_good_file_parses_as_before() -> None:
    cfg = parse_web_config(
        {
            "tls_server_config": {
                "cert_file": "server.crt",
                "key_file": "/k/server.key",
                "client_ca_file": "ca.crt",
                "client_auth_type": "RequireAndVerifyClientCert",
                "client_allowed_sans": ["db"],
                "max_version": "TLS13",
                "prefer_server_cipher_suites": True,
            },
            "basic_auth_users": {"alice": HASH},
            "http_server_config": {"http2": True, "headers": {"X-Frame-Options": "deny"}},
            "rate_limit": {"interval": "100ms", "burst": 3},
        },
        "/etc/gpuwatchd/web.yml",
    )
    assert cfg.tls is not None and cfg.tls.cert_file == "/etc/gpuwatchd/server.crt"
    assert (cfg.tls.key_file, cfg.tls.client_ca_file) == ("/k/server.key", "/etc/gpuwatchd/ca.crt")
    assert (cfg.tls.client_allowed_sans, cfg.tls.min_version, cfg.tls.max_version) == (("db",), "TLS12", "TLS13")
    assert cfg.basic_auth_users == {"alice": HASH.encode()}
    assert cfg.headers == {"X-Frame-Options": "deny"}
    assert cfg.rate_limit is not None and (cfg.rate_limit.interval_seconds, cfg.rate_limit.burst) == (0.1, 3)
    empty = parse_web_config({"tls_server_config": None, "rate_limit": {}, "basic_auth_users": None})
    assert empty.tls is None and empty.rate_limit is None and not empty.basic_auth_users
    assert parse_web_config(None) == empty


def test_keys_that_are_not_strings_are_named_not_a_crash() -> None:
    """YAML keys may be numbers: sorting them with the string keys raised TypeError."""
    assert _problems({1: "x", "extra": 2, "tls_server_config": {2: "y", "cert_file": "c", "key_file": "k"}}) == [
        "1: unknown key",
        "extra: unknown key",
        "tls_server_config.2: unknown key",
    ]
    assert _problems({"tls_server_config": {2: "y", "z": 1, "cert_file": "c", "key_file": "k"}}) == [
        "tls_server_config.2: unknown key",
        "tls_server_config.z: unknown key",
    ]


def test_a_zero_rate_limit_interval_is_refused() -> None:
    """'0s' was accepted, and the token bucket then divided by it on the first request."""
    assert _problems({"rate_limit": {"interval": "0s", "burst": 1}}) == ["rate_limit.interval: must be > 0.0, got 0.0"]
    assert _problems({"rate_limit": {"interval": float("inf"), "burst": 1}}) == [
        "rate_limit.interval: must be finite, got inf"
    ]


def test_a_nul_byte_in_a_certificate_name_is_a_config_error(tmp_path: Path) -> None:
    """A NUL byte reached ssl.load_cert_chain, whose ValueError was no WebConfigError: it
    escaped the start-up check, and a reload while serving raised it into every connection."""
    pki = make_pki(tmp_path)
    path = pki / "web.yml"
    path.write_text('tls_server_config:\n  cert_file: "server.crt\\0"\n  key_file: server.key\n')
    with pytest.raises(WebConfigError) as err:
        load_web_config(str(path))
    assert err.value.problems == ["tls_server_config.cert_file: must not contain NUL bytes"]
    path.write_text("tls_server_config:\n  cert_file: server.crt\n  key_file: server.key\n")
    holder = ConfigHolder(str(path))
    good = holder.current()
    assert good.ssl_context is not None
    path.write_text('tls_server_config:\n  cert_file: "server.crt\\0"\n  key_file: server.key\n')
    os.utime(path, ns=(0, 1))  # a change the holder sees even within one mtime tick
    assert holder.current().config == good.config  # the last good one keeps serving


def test_a_user_given_twice_is_refused_naming_it(tmp_path: Path) -> None:
    """A second entry of one user name silently replaced the first hash (yaml last-wins)."""
    import bcrypt

    h = bcrypt.hashpw(b"pw", bcrypt.gensalt(4)).decode()
    path = tmp_path / "web.yml"
    path.write_text(f"basic_auth_users:\n  prometheus: {h}\n  prometheus: {h}\n")
    with pytest.raises(WebConfigError) as e:
        load_web_config(str(path))
    assert "key 'prometheus' appears twice in one mapping (lines 2 and 3)" in str(e.value)


@pytest.mark.parametrize(
    ("interval", "seconds"), [("1m30s", 90.0), ("1.5h", 5400.0), ("250ms", 0.25), ("1h2m3s4ms", 3723.004), (2, 2.0)]
)
def test_rate_limit_intervals_are_go_durations(interval: object, seconds: float) -> None:
    rate = parse_web_config({"rate_limit": {"interval": interval, "burst": 2}}).rate_limit
    assert rate is not None and rate.interval_seconds == pytest.approx(seconds)


def test_rate_limit_interval_0_turns_it_off_and_a_final_newline_is_no_duration() -> None:
    assert parse_web_config({"rate_limit": {"interval": 0, "burst": 0}}).rate_limit is None
    assert parse_web_config({"rate_limit": {"interval": "0", "burst": 5}}).rate_limit is None
    with pytest.raises(WebConfigError):
        parse_web_config({"rate_limit": {"interval": "1s\n", "burst": 5}})
