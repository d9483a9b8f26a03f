"""A distant tier: ``kvstore up`` on one host, engines on another, the link between them
capped with ``tc`` (a rate, both ways).

Why this shape: a slow tier, as an engine meets it, is a tier far away or behind a thin link:
every byte it sends the engine (the gateway's answers, and the blocks, whichever path they
take) crosses that link, and so does every save. A relay in front of the gateway alone is not
that: an engine that reads its blocks straight from the storage nodes would pass it by. Here
the whole tier is on host ``tier`` (its embedded Ray cluster, nodes and gateway) and the
engines on host ``client`` (``kvstore.testbed.netns``: network namespaces on a bridge, each
with its own ``eth0``), and a token bucket (``tbf``) on both ``eth0`` s caps what each side
sends. (A delay too would need ``netem``, which this machine's kernel lacks; a thin link is
the slow tier that matters here: a load's time grows with its bytes.) The
nodes listen on the tier host's loopback, so an engine on ``client`` reads through the gateway
(a client outside the cluster's network); either way its load crosses the link.

Needs root, ``ip`` and ``tc``. The gateway listens beyond loopback without TLS (``--insecure``):
the network is the test range on one machine, reachable only from its namespaces.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from kvstore.errors import ConfigError, InvalidArgument
from kvstore.runtime.upprocess import TierProcess
from kvstore.testbed.netns import Network

TIER, CLIENT = "tier", "client"


class DistantTier:
    """``kvstore up`` on host ``tier`` of network ``name``; ``on_client``: what runs a command
    on the engines' host. ``shape`` sets the link; ``stop`` removes everything."""

    def __init__(self, network: Network, tier: TierProcess) -> None:
        self.network = network
        self.tier = tier

    @classmethod
    def start(
        cls,
        data_dir: Path,
        *,
        bytes_per_s: float,
        name: str = "kvtbdist",
        up_args: tuple[str, ...] = ("--fsync", "never"),
        env: dict[str, str] | None = None,
    ) -> DistantTier:
        if shutil.which("tc") is None:
            raise ConfigError("testbed", "`tc` not found (apt-get install iproute2)")
        network = Network.create(name, [TIER, CLIENT])
        try:
            shape(network, bytes_per_s)
            tier = TierProcess.start(
                data_dir,
                "--host",
                network.address(TIER),
                "--insecure",
                *up_args,
                env=env,
                prefix=network.exec_prefix(TIER),
            )
        except BaseException:
            network.destroy()
            raise
        return cls(network, tier)

    @property
    def address(self) -> str:
        return self.tier.address

    def on(self, host: str) -> tuple[str, ...]:
        """The prefix that runs a command on ``host`` (``TIER`` or ``CLIENT``)."""
        return tuple(self.network.exec_prefix(host))

    def shape(self, bytes_per_s: float | None) -> None:
        """The link from now on (``shape``)."""
        shape(self.network, bytes_per_s)

    def stop(self) -> list[str]:
        """Stop the tier, remove the hosts; what was left behind (nothing, normally)."""
        try:
            self.tier.stop()
        finally:
            left = self.network.destroy()
        return left


@contextmanager
def distant_tier(data_dir: Path, **options: Any) -> Iterator[DistantTier]:
    """``DistantTier.start(data_dir, **options)``, stopped on the way out."""
    distant = DistantTier.start(data_dir, **options)
    try:
        yield distant
    finally:
        distant.stop()


def shape(network: Network, bytes_per_s: float | None) -> None:
    """Cap what each host of ``network`` sends at ``bytes_per_s``; None: full speed."""
    if bytes_per_s is not None and not bytes_per_s > 0:
        raise InvalidArgument("bytes_per_s", f"must be > 0 or None, got {bytes_per_s}")
    for host in network.hosts:
        tc = [*network.exec_prefix(host), "tc", "qdisc"]
        subprocess.run([*tc, "del", "dev", "eth0", "root"], capture_output=True, check=False)
        if bytes_per_s is None:
            continue
        # A 64 KiB bucket (bursts of a few packets) and a queue of up to 10 s: a thin link
        # delays what is in flight, it does not drop it.
        done = subprocess.run(
            [*tc, "add", "dev", "eth0", "root", "tbf", "rate", f"{int(bytes_per_s * 8)}bit",
             "burst", "64kb", "latency", "10s"],
            capture_output=True, text=True, check=False,
        )  # fmt: skip
        if done.returncode != 0:
            raise ConfigError("testbed", f"tc on {host}: {done.stderr.strip()}")
