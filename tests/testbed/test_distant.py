"""The distant tier's link (``kvstore.testbed.distant.shape``): a token bucket on each host's
``eth0`` caps what it sends; None lifts it; bad rates are refused. Real namespaces, a real
transfer timed."""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator

import pytest

from kvstore.errors import InvalidArgument
from kvstore.testbed.distant import shape
from kvstore.testbed.netns import Network

#: b sends a MB to a; a prints the seconds from the first byte to the last.
RECEIVE = (
    "import socket, sys, time; s = socket.create_server((sys.argv[1], 45001)); c, _ = s.accept()"
    "; n = c.recv(65536); t = time.monotonic(); total = len(n)\n"
    "while n:\n    n = c.recv(65536); total += len(n)\n"
    "print(total, time.monotonic() - t)"
)
SEND = (
    "import socket, sys, time\nfor _ in range(100):\n    try:\n"
    "        c = socket.create_connection((sys.argv[1], 45001)); break\n"
    "    except OSError: time.sleep(0.05)\n"
    "c.sendall(bytes(1_000_000)); c.close()"
)


@pytest.fixture
def network() -> Iterator[Network]:
    made = Network.create(f"kvtb{secrets.token_hex(3)}", ["a", "b"])
    try:
        yield made
    finally:
        made.destroy()


def _seconds_for_a_megabyte(network: Network) -> float:
    address = network.address("a")
    receiver = network.popen("a", ["python3", "-c", RECEIVE, address], stdout=-1, text=True)
    time.sleep(0.3)
    sent = network.run("b", ["python3", "-c", SEND, address])
    assert sent.returncode == 0, sent.stderr
    out, _ = receiver.communicate(timeout=60)
    total, seconds = out.split()
    assert int(total) == 1_000_000
    return float(seconds)


def test_the_link_is_capped_and_lifted(network: Network) -> None:
    shape(network, 500e3)
    assert _seconds_for_a_megabyte(network) > 1.5  # 2 s at 500 kB/s (less the first burst)
    shape(network, None)
    assert _seconds_for_a_megabyte(network) < 0.5


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan")])
def test_a_bad_rate_is_refused(network: Network, bad: float) -> None:
    with pytest.raises(InvalidArgument, match="bytes_per_s"):
        shape(network, bad)
