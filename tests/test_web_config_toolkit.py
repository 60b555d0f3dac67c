"""``gpuwatchd web-config check`` on exporter-toolkit's own test data (tests/fixtures/
exporter-toolkit-web, copied from prometheus/exporter-toolkit web/testdata): the toolkit's verdict
(``web/tls_config_test.go``: ``.good``/``.bad``, and its table for the files named neither) is
the oracle, and each file where gpuwatchd differs on purpose is listed with the reason, also in
docs/security.md. The list is exact: a difference that goes away fails the test too."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuwatchd.cli import main

HERE = Path(__file__).resolve().parent / "fixtures" / "exporter-toolkit-web"
FILES = sorted(p.name for p in HERE.iterdir() if p.suffix in (".yml", ".yaml"))

# Files that are neither .good nor .bad: the toolkit's verdict from tls_config_test.go.
TOOLKIT_VALID = {
    "web_config_empty.yml": True,
    "web_config_junk.yml": False,  # "YAML error"
    "web_config_junk_key.yml": False,  # UnmarshalStrict: unknown key
    "web_config_rate_limiter_nonblocking.yaml": True,  # interval 0: no limiter
    "web_config_rate_limiter_one_second.yaml": True,  # burst 0: every request gets 429
    "web_config_auth_client_san.bad.yaml": True,  # a valid file; the client's certificate fails
}

_NO_CA = (
    "client certificates verified against no named CA: Go falls back to the system's roots, "
    "so any publicly issued certificate would pass; gpuwatchd requires client_ca_file"
)
_CIPHERS = (
    "cipher_suites: Go's suite names; Python's ssl takes OpenSSL cipher strings and cannot "
    "set TLS 1.3 suites, so gpuwatchd refuses the key rather than ignore it"
)
DIFFERENCES = {
    "tls_config_noAuth.requireanyclientcert.good.yml": (
        "RequireAnyClientCert: Python's ssl cannot ask for a certificate without verifying it"
    ),
    "tls_config_noAuth.requireanyclientcertkeyinline.good.yml": "RequireAnyClientCert (as above), and an inline key",
    "web_config_noAuth.good.yml": _NO_CA,
    "web_config_noAuth.good.blocking.yml": _NO_CA,
    "web_config_noAuth_allCiphers.good.yml": _CIPHERS,
    "web_config_noAuth_someCiphers.good.yml": _CIPHERS,
    "web_config_noAuth_someCiphers_noOrder.good.yml": _CIPHERS,
    "web_config_noAuth_noHTTP2.good.yml": _CIPHERS,
    "web_config_noAuth_allCurves.good.yml": "curve_preferences: not settable through Python's ssl",
    "web_config_noAuth_someCurves.good.yml": "curve_preferences: not settable through Python's ssl",
    "web_config_noAuth_tlsInline.good.yml": "inline cert/key: gpuwatchd reads certificates from files",
}


def toolkit_valid(name: str) -> bool:
    if name in TOOLKIT_VALID:
        return TOOLKIT_VALID[name]
    assert ".good." in name or ".bad." in name, name
    return ".good." in name


def test_every_file_has_a_verdict() -> None:
    assert len(FILES) >= 40
    assert set(DIFFERENCES) <= set(FILES) and set(TOOLKIT_VALID) <= set(FILES)


@pytest.mark.parametrize("name", FILES)
def test_web_config_check_agrees_with_exporter_toolkit(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["web-config", "check", str(HERE / name)])
    out = capsys.readouterr()
    assert rc in (0, 2) and "Traceback" not in out.err  # 2: a bad file, as `config check` says
    ours = rc == 0
    if name in DIFFERENCES:
        assert ours != toolkit_valid(name), f"{name} no longer differs: drop it from DIFFERENCES"
        assert not ours  # every difference is gpuwatchd refusing what it cannot honour
    else:
        assert ours == toolkit_valid(name), out.err or out.out


def test_the_docs_list_each_difference() -> None:
    doc = (Path(__file__).resolve().parent.parent / "docs" / "security.md").read_text()
    for name in DIFFERENCES:
        assert f"`{name}`" in doc, name
