from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuwatchd.config.checks import parse_listen_address
from gpuwatchd.config.schema import DEFAULT_PORT, Config, ConfigError, load_config, parse_config, with_overrides

REPO = Path(__file__).resolve().parent.parent


def test_defaults_match_design() -> None:
    c = load_config(None)
    assert c == Config()
    assert c.interval_seconds == 5
    assert c.rank_dir == "/run/gpuwatch/ranks"
    assert c.state_dir == "/var/lib/gpuwatchd"
    assert c.kernel_log == "auto"
    assert (c.gil.enabled, c.gil.interval_seconds, c.gil.duration_seconds, c.gil.rate_hz, c.gil.max_concurrent) == (
        True,
        30,
        5,
        50,
        2,
    )
    assert c.stall.after_seconds == 300
    assert c.alertmanager.url is None
    assert c.web.listen_address == f"0.0.0.0:{DEFAULT_PORT}"


def test_example_config_is_valid_and_equals_defaults() -> None:
    assert load_config(str(REPO / "config.example.yaml")) == Config()


def test_every_problem_is_reported_with_its_dotted_key() -> None:
    with pytest.raises(ConfigError) as e:
        parse_config(
            {
                "interval_seconds": "5s",
                "web": {"listen_address": "localhost", "colour": "red"},
                "gil": {"rate_hz": 0, "enabled": "yes", "unknown": 1},
                "kernel_log": "dmesg",
                "rank_dir": "relative/dir",
                "alertmanager": {"url": "ftp://x"},
                "stall": [],
                "toplevel_typo": 1,
            }
        )
    problems = "\n".join(e.value.problems)
    for expected in (
        "interval_seconds: must be a number",
        "web.listen_address: must be HOST:PORT",
        "web.colour: unknown key",
        "gil.rate_hz: must be between 1 and 1000",
        "gil.enabled: must be true or false",
        "gil.unknown: unknown key",
        "kernel_log: must be one of",
        "rank_dir: must be an absolute path",
        "alertmanager.url: must be an http",
        "stall: must be a mapping",
        "toplevel_typo: unknown key",
    ):
        assert expected in problems, problems
    assert len(e.value.problems) == 11


@pytest.mark.parametrize(
    "value,expected",
    [
        ("0.0.0.0:9863", ("0.0.0.0", 9863)),
        (":9863", ("", 9863)),  # all interfaces: the server binds "::" dual-stack or 0.0.0.0
        ("localhost:0", ("localhost", 0)),
        ("[::1]:80", ("::1", 80)),
        ("127.0.0.1:0", ("127.0.0.1", 0)),
    ],
)
def test_listen_address(value: str, expected: tuple[str, int]) -> None:
    assert parse_listen_address(value) == expected


@pytest.mark.parametrize("value", ["::1:80", "[zz]:80", "host:99999", "host", 9863, "host:-1"])
def test_bad_listen_address(value: object) -> None:
    with pytest.raises(ValueError):
        parse_listen_address(value)


def test_flag_overrides_file() -> None:
    c = with_overrides(Config(), "127.0.0.1:1234")
    assert c.web.listen_address == "127.0.0.1:1234"
    with pytest.raises(ConfigError, match=r"--web\.listen-address"):
        with_overrides(Config(), "nonsense")


@pytest.mark.parametrize("content", [b"\xff\xfe\x00garbage", b"a: [unclosed", b"- just\n- a list\n", b"x" * (2 << 20)])
def test_unreadable_files_are_config_errors(tmp_path: Path, content: bytes) -> None:
    p = tmp_path / "c.yaml"
    p.write_bytes(content)
    with pytest.raises(ConfigError):
        load_config(str(p))


def test_missing_file() -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_config("/nonexistent/gpuwatchd.yaml")


yaml_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=12), children, max_size=4),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None)
@given(
    st.dictionaries(
        st.sampled_from(
            [
                "web",
                "gil",
                "stall",
                "interval_seconds",
                "rank_dir",
                "nvml",
                "discovery",
                "fds",
                "alertmanager",
                "orphans",
                "x",
            ]
        ),
        yaml_values,
        max_size=6,
    )
)
def test_any_yaml_gives_a_config_or_a_config_error(data: dict) -> None:
    try:
        cfg = parse_config(data)
    except ConfigError as e:
        assert e.problems and all(":" in p for p in e.problems)
    else:
        assert isinstance(cfg, Config)


def test_config_check_cli(tmp_path: Path) -> None:
    good = subprocess.run(
        [sys.executable, "-m", "gpuwatchd", "config", "check", str(REPO / "config.example.yaml")],
        capture_output=True,
        text=True,
    )
    assert good.returncode == 0 and "OK" in good.stdout
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"gil": {"max_concurrent": 0}, "procfs": 3}))
    r = subprocess.run([sys.executable, "-m", "gpuwatchd", "config", "check", str(bad)], capture_output=True, text=True)
    assert r.returncode == 2
    assert "gil.max_concurrent" in r.stderr and "procfs" in r.stderr and "2 problem(s)" in r.stderr


def test_unquoted_off_means_off() -> None:
    assert parse_config(yaml.safe_load("kernel_log: off")).kernel_log == "off"
    with pytest.raises(ConfigError, match="kernel_log"):
        parse_config(yaml.safe_load("kernel_log: on"))


@pytest.mark.parametrize(
    "text",
    [
        "interval_seconds: 5\ninterval_seconds: 10\n",
        "web:\n  listen_address: ':9958'\n  listen_address: ':9959'\n",
    ],
)
def test_a_key_given_twice_is_refused_naming_it(tmp_path: Path, text: str) -> None:
    """Not silently last-wins (config/strict_yaml.py; exporter-toolkit's UnmarshalStrict does the same)."""
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_config(str(path))
    key = text.splitlines()[-1].split(":")[0].strip()
    assert f"key '{key}' appears twice" in str(e.value) and "lines" in str(e.value)


def test_a_merge_may_override_what_it_brings(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("base: &b {listen_address: ':1'}\nweb:\n  <<: *b\n  listen_address: ':9958'\n")
    with pytest.raises(ConfigError) as e:  # 'base' is no config key; the merge itself is fine
        load_config(str(path))
    assert "appears twice" not in str(e.value) and "base" in str(e.value)


def test_alertmanager_instance_is_any_label_value_prometheus_may_give() -> None:
    """The pushed alerts' ``instance`` must equal what Prometheus labels the node with for
    Alertmanager to merge the two paths: often the bare host name (relabelled without the port,
    as this repository's PodMonitor does with the node name). It had to be HOST:PORT, so such a
    node could not be matched at all."""
    from gpuwatchd.events.alertmanager import alert_for
    from gpuwatchd.model.events import Event

    for instance in ("node1", "node1.example.org", "node1:9863", "[::1]:9863"):
        c = parse_config({"alertmanager": {"url": "http://am:9093", "instance": instance}})
        assert c.alertmanager.instance == instance
        ev = Event(
            "k", "oom_kill", 1.0, "critical", "s", job_id="j", rank="0", comm="python", killer="kernel", alert=True
        )
        alert = alert_for(ev, c.alertmanager.instance)
        assert alert is not None and alert["labels"]["instance"] == instance
    for bad in ("", "a\nb", 5):
        with pytest.raises(ConfigError, match=r"alertmanager\.instance"):
            parse_config({"alertmanager": {"instance": bad}})
