"""What an operator reads at info level: one line per prepare and unprepare of a claim (its
namespace/name/UID, devices, result, duration) and no line per HTTP request (issues 37, 43)."""

from __future__ import annotations

import io
import logging

import pytest

from agent.kubeletplugin.types import ClaimRef
from agent.prepare.driver import Driver
from agent.service.logs import setup_logging
from tests.kubelet_standin import claim, gpu, inventory, settings_for


def test_one_line_per_prepare_and_unprepare(tmp_path, caplog):
    driver = Driver(settings_for(str(tmp_path)), lambda: inventory(gpu(0), gpu(1)))
    good = claim("good", [("r", "gpu-0000-1b-00-0"), ("r", "gpu-0000-1c-00-0")], uid="11111111-1111-1111-1111-111111111111")
    driver.recover()
    gone = claim("gone", [("r", "gpu-0000-99-00-0")], uid="22222222-2222-2222-2222-222222222222")
    with caplog.at_level(logging.INFO, logger="agent.prepare.driver"):
        driver.prepare_claims([good, gone])
        driver.unprepare_claims([ClaimRef("default", "good", good["metadata"]["uid"])])
    lines = [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "agent.prepare.driver"]
    assert len(lines) == 3, lines
    (lvl1, ok), (lvl2, failed), (lvl3, undone) = lines
    assert lvl1 == "INFO" and ok.startswith("prepare claim default/good (11111111-1111-1111-1111-111111111111), "
                                            "devices gpu-0000-1b-00-0, gpu-0000-1c-00-0: ok in ") and ok.endswith(" ms")
    assert lvl2 == "WARNING" and failed.startswith("prepare claim default/gone (22222222-") and "failed: " in failed
    assert "not on this node" in failed
    assert lvl3 == "INFO" and undone.startswith("unprepare claim default/good (11111111-") and "gpu-0000-1b-00-0" in undone


@pytest.mark.parametrize("level, shown", [("info", False), ("debug", True)])
def test_http_requests_are_debug_lines(tmp_path, monkeypatch, level, shown):
    err = io.StringIO()
    monkeypatch.setattr("sys.stderr", err)
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        setup_logging(settings_for(str(tmp_path), log_level=level))
        logging.getLogger("httpx2").info('HTTP Request: GET https://127.0.0.1/apis "HTTP/1.1 200 OK"')
        logging.getLogger("agent.x").info("kept")
    finally:
        root.handlers[:], _ = saved[0], root.setLevel(saved[1])
    out = err.getvalue()
    assert "kept" in out
    assert ("DEBUG httpx2: HTTP Request" in out) is shown, out


def test_json_lines_carry_the_traceback_of_an_exception(capsys):
    """``log_format: json``: a log.exception's traceback goes with its line (a shipper's reader needs it)."""
    import json as _json
    import logging as _logging

    from agent.service.logs import setup_logging
    from agent.settings import Settings

    root = _logging.getLogger()
    before = root.handlers[:]
    try:
        setup_logging(Settings.of({"node_name": "n", "log_format": "json"}))
        try:
            raise KeyError("the cause")
        except KeyError:
            _logging.getLogger("sysdra.test").exception("a round failed")
        (line,) = [x for x in capsys.readouterr().err.splitlines() if "a round failed" in x]
        got = _json.loads(line)
        assert got["msg"] == "a round failed" and got["level"] == "error"
        assert "Traceback" in got["exc"] and "KeyError: 'the cause'" in got["exc"]
    finally:
        root.handlers[:] = before
