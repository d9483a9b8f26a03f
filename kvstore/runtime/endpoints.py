"""Finding an actor's direct socket through Ray: ``FastChannels``, the channels by target.

An actor that serves ``kvstore.fastcall`` hands its endpoint (host, port and the key the
handshake proves) out only through Ray: its ``fast_endpoint()`` method. This is the Ray side of
the direct sockets, kept out of the socket package: asking the actors, without ever blocking a
call on the answer, and forgetting an endpoint whose actor went away (the next call goes through
Ray, which knows whether the actor is still there, and asks it for its new one). A caller that
wants no Ray call on its byte path at all asks for the endpoints up front (``prepare``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Hashable, Mapping
from typing import Any, TypeVar

import ray
from ray.exceptions import RayError

from kvstore.fastcall.client import FastChannel
from kvstore.fastcall.tls import ClientTLS

log = logging.getLogger(__name__)

K = TypeVar("K", bound=Hashable)


class FastChannels:
    """Channels to many actors, by target name. ``get`` never blocks: the first call to a
    target (and the first after its channel failed) goes through Ray while the actor is asked,
    through Ray too, for its endpoint (``fast_endpoint()``); later calls use the socket
    (``prepare`` asks up front). A target without one (or not answering) is asked again after
    ``retry_s``."""

    def __init__(self, retry_s: float = 1.0, tls: ClientTLS | None = None) -> None:
        self._retry = retry_s
        self._tls = tls
        self._channels: dict[Hashable, FastChannel] = {}
        self._asking: dict[Hashable, Any] = {}  # target -> ObjectRef of fast_endpoint()
        self._none_until: dict[Hashable, float] = {}
        self._lock = threading.Lock()

    def get(self, target: Hashable, handle: Any) -> FastChannel | None:
        """The target's channel, or None: call it through Ray this time."""
        with self._lock:
            channel = self._channels.get(target)
            if channel is not None:
                return channel
            asking = self._asking.get(target)
            if asking is None:
                if self._none_until.get(target, 0.0) <= time.monotonic():
                    try:
                        self._asking[target] = handle.fast_endpoint.remote()
                    except (RayError, AttributeError) as error:
                        self._none_until[target] = time.monotonic() + self._retry
                        log.debug("no fast path to %s: %s", target, error)
                return None
        ready, _ = ray.wait([asking], timeout=0)
        if not ready:
            return None
        try:
            host, port, authkey = ray.get(asking, timeout=0)
        except (RayError, TypeError, ValueError) as error:
            log.debug("no fast path to %s: %s", target, error)
            with self._lock:
                self._asking.pop(target, None)
                self._none_until[target] = time.monotonic() + self._retry
            return None
        with self._lock:
            self._asking.pop(target, None)
            channel = FastChannel((host, port, authkey), self._tls)
            return self._channels.setdefault(target, channel)

    def prepare(self, handles: Mapping[K, Any], timeout_s: float) -> list[K]:
        """Ask every target of ``handles`` (target -> actor handle) without a channel for its
        endpoint, all at once, and wait up to ``timeout_s`` for the answers, so that even the
        first calls go over the sockets; returns the targets still without a channel."""
        for target, handle in handles.items():
            self.get(target, handle)  # starts asking
        with self._lock:
            asking = [self._asking[target] for target in handles if target in self._asking]
        if asking:
            ray.wait(asking, num_returns=len(asking), timeout=max(0.0, timeout_s))
        return [target for target, handle in handles.items() if self.get(target, handle) is None]

    def forget(self, target: Hashable, channel: FastChannel) -> None:
        """The actor behind ``channel`` went away (or restarted on a new port)."""
        with self._lock:
            if self._channels.get(target) is channel:
                del self._channels[target]
        channel.close()
