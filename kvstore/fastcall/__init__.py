"""The direct socket channel beside Ray: the data plane of the block tier and the SWA fetch.

Ray stays the control plane (placement, restarts, names, endpoints, every other call), but a Ray
actor call cost ~1-1.5 ms of CPU on this kind of machine, caller and actor together (submit,
task dispatch, serialisation, output store), and a value over 100 KiB goes through the object
store (measured with Ray 2.60). A plain socket with one request and one scatter-gather reply
moves a batch at several GB/s. So the calls that move bytes or sit on the hit path go over a
socket to a thread in the actor's process: a storage node's ``put``/``commit``/``abort``/
``get``/``holds``/``delete``, a meta shard's ``lookup_wire`` and the calls of every put
(``begin_put``, ``commit``, ``abort_put``, ``release``), an SWA entrypoint's ``lookup`` and an
SWA store's ``fetch`` of a state. A round trip costs tens of microseconds; arrays go out
uncopied.

The map, one module per job (this ``__init__`` imports none of them):

- ``frames``: the wire framing (length-prefixed frames on a plain or TLS socket, what a call
  and a reply frame hold, the remote errors a caller sees, waiting on many connections);
- ``handshake``: the mutual HMAC challenge on the actor's key, both sides of it;
- ``tls``: the operator's setting (``FastcallConfig``: TLS and insecure, read through
  ``kvstore.envconfig``), where a server may listen in plaintext (loopback, or insecure:
  ``check_plaintext``), the TLS contexts and the bounded TLS handshake;
- ``admission``: the handshake slots of a server, shared fairly by source address;
- ``budget``: the in-flight byte budget of a server;
- ``server``: ``FastCallServer``, serving an object's methods;
- ``client``: ``connect`` and ``FastChannel``, calling them.

A storage node's engine read socket (``kvstore.blockstore.readserver``), where engines read
with a lease's read capability instead of the actor's key, is built from the same parts
(``admission``, ``budget``, ``frames``, ``tls``).

Finding an actor's endpoint is Ray's business (it hands the endpoint and its key out):
``kvstore.runtime.endpoints`` (``FastChannels``). This package imports neither Ray nor the
runtime.

Failure semantics match Ray's as the callers see them: a dead or restarted actor closes its
sockets, the caller's call fails (``NodeUnavailable`` in ``RayFanout``), the stale endpoint is
forgotten and the next call asks the actor, through Ray, for its new one.
"""
