"""Where a session's server listens and what it tells the controller (``session.json``):
its Ray node's IP by default, or ``TALLY_SESSIONS_ADVERTISE_HOST``: an address of this
machine is bound itself, a name (a Kubernetes Service) or a NAT's address is advertised
while the node's IP is bound. Binds on loopback only; nothing is sent."""

from __future__ import annotations

from pathlib import Path

from services.controller.session_rows import ready_url
from services.controller.tables import Run
from services.sessions.server import listen, write_state


def bound(node_ip: str, advertise: str | None) -> tuple[str, str]:
    sock, host = listen(node_ip, advertise)
    with sock:
        return sock.getsockname()[0], host


def test_the_node_ip_unless_an_advertised_host_says_otherwise() -> None:
    assert bound("127.0.0.1", None) == ("127.0.0.1", "127.0.0.1")
    assert bound("127.0.0.2", "127.0.0.1") == ("127.0.0.1", "127.0.0.1")  # an own address
    assert bound("127.0.0.1", "tally-sessions.ml.svc") == ("127.0.0.1", "tally-sessions.ml.svc")
    assert bound("127.0.0.1", "203.0.113.9") == ("127.0.0.1", "203.0.113.9")  # not ours


def test_the_controller_calls_the_address_in_session_json(tmp_path: Path) -> None:
    row = Run(kind="session", id="s", output_dir=str(tmp_path))
    assert ready_url(row) is None
    write_state(tmp_path, {"state": "ready", "host": "10.1.2.3", "port": 41000})
    assert ready_url(row) == "http://10.1.2.3:41000"
    write_state(tmp_path, {"state": "ready", "host": "fd00::7", "port": 41000})
    assert ready_url(row) == "http://[fd00::7]:41000"
