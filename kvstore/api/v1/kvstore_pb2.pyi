from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class HitMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    HIT_MODE_UNSPECIFIED: _ClassVar[HitMode]
    HIT_MODE_STANDARD: _ClassVar[HitMode]
    HIT_MODE_BOUNDED_REPLAY: _ClassVar[HitMode]
    HIT_MODE_FULL_ATTENTION: _ClassVar[HitMode]
    HIT_MODE_EXACT_WINDOW: _ClassVar[HitMode]

class Advice(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ADVICE_UNSPECIFIED: _ClassVar[Advice]
    ADVICE_FETCH: _ClassVar[Advice]
    ADVICE_REPLAY: _ClassVar[Advice]
HIT_MODE_UNSPECIFIED: HitMode
HIT_MODE_STANDARD: HitMode
HIT_MODE_BOUNDED_REPLAY: HitMode
HIT_MODE_FULL_ATTENTION: HitMode
HIT_MODE_EXACT_WINDOW: HitMode
ADVICE_UNSPECIFIED: Advice
ADVICE_FETCH: Advice
ADVICE_REPLAY: Advice

class Layout(_message.Message):
    __slots__ = ("fingerprint", "block_bytes", "state_bytes")
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    STATE_BYTES_FIELD_NUMBER: _ClassVar[int]
    fingerprint: bytes
    block_bytes: int
    state_bytes: int
    def __init__(self, fingerprint: _Optional[bytes] = ..., block_bytes: _Optional[int] = ..., state_bytes: _Optional[int] = ...) -> None: ...

class QueryHitRequest(_message.Message):
    __slots__ = ("token_ids", "block_keys", "prompt_len", "mode", "traffic_class", "take_lease", "block_keys_packed", "layout", "direct", "prefill_tokens_per_s")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_KEYS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LEN_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    TRAFFIC_CLASS_FIELD_NUMBER: _ClassVar[int]
    TAKE_LEASE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_KEYS_PACKED_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    DIRECT_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    block_keys: _containers.RepeatedScalarFieldContainer[bytes]
    prompt_len: int
    mode: HitMode
    traffic_class: str
    take_lease: bool
    block_keys_packed: bytes
    layout: Layout
    direct: bool
    prefill_tokens_per_s: float
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., block_keys: _Optional[_Iterable[bytes]] = ..., prompt_len: _Optional[int] = ..., mode: _Optional[_Union[HitMode, str]] = ..., traffic_class: _Optional[str] = ..., take_lease: _Optional[bool] = ..., block_keys_packed: _Optional[bytes] = ..., layout: _Optional[_Union[Layout, _Mapping]] = ..., direct: _Optional[bool] = ..., prefill_tokens_per_s: _Optional[float] = ...) -> None: ...

class HitPlan(_message.Message):
    __slots__ = ("prompt_len", "cap", "block_hit_tokens", "hit_tokens", "swa_hit", "swa_position", "swa_owner", "replay_start", "replay_tokens", "compute_from", "store_at")
    PROMPT_LEN_FIELD_NUMBER: _ClassVar[int]
    CAP_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SWA_HIT_FIELD_NUMBER: _ClassVar[int]
    SWA_POSITION_FIELD_NUMBER: _ClassVar[int]
    SWA_OWNER_FIELD_NUMBER: _ClassVar[int]
    REPLAY_START_FIELD_NUMBER: _ClassVar[int]
    REPLAY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_FROM_FIELD_NUMBER: _ClassVar[int]
    STORE_AT_FIELD_NUMBER: _ClassVar[int]
    prompt_len: int
    cap: int
    block_hit_tokens: int
    hit_tokens: int
    swa_hit: bool
    swa_position: int
    swa_owner: str
    replay_start: int
    replay_tokens: int
    compute_from: int
    store_at: int
    def __init__(self, prompt_len: _Optional[int] = ..., cap: _Optional[int] = ..., block_hit_tokens: _Optional[int] = ..., hit_tokens: _Optional[int] = ..., swa_hit: _Optional[bool] = ..., swa_position: _Optional[int] = ..., swa_owner: _Optional[str] = ..., replay_start: _Optional[int] = ..., replay_tokens: _Optional[int] = ..., compute_from: _Optional[int] = ..., store_at: _Optional[int] = ...) -> None: ...

class QueryHitResponse(_message.Message):
    __slots__ = ("plan", "advice", "fetch_seconds", "replay_seconds", "lease_id", "hit_block_keys", "hit_block_keys_packed", "direct", "prefill_tokens_per_s", "stored_blocks")
    PLAN_FIELD_NUMBER: _ClassVar[int]
    ADVICE_FIELD_NUMBER: _ClassVar[int]
    FETCH_SECONDS_FIELD_NUMBER: _ClassVar[int]
    REPLAY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    HIT_BLOCK_KEYS_FIELD_NUMBER: _ClassVar[int]
    HIT_BLOCK_KEYS_PACKED_FIELD_NUMBER: _ClassVar[int]
    DIRECT_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    STORED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    plan: HitPlan
    advice: Advice
    fetch_seconds: float
    replay_seconds: float
    lease_id: str
    hit_block_keys: _containers.RepeatedScalarFieldContainer[bytes]
    hit_block_keys_packed: bytes
    direct: DirectRead
    prefill_tokens_per_s: float
    stored_blocks: int
    def __init__(self, plan: _Optional[_Union[HitPlan, _Mapping]] = ..., advice: _Optional[_Union[Advice, str]] = ..., fetch_seconds: _Optional[float] = ..., replay_seconds: _Optional[float] = ..., lease_id: _Optional[str] = ..., hit_block_keys: _Optional[_Iterable[bytes]] = ..., hit_block_keys_packed: _Optional[bytes] = ..., direct: _Optional[_Union[DirectRead, _Mapping]] = ..., prefill_tokens_per_s: _Optional[float] = ..., stored_blocks: _Optional[int] = ...) -> None: ...

class ReadEndpoint(_message.Message):
    __slots__ = ("node_id", "host", "port")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    node_id: int
    host: str
    port: int
    def __init__(self, node_id: _Optional[int] = ..., host: _Optional[str] = ..., port: _Optional[int] = ...) -> None: ...

class DirectRead(_message.Message):
    __slots__ = ("capability", "block_keys_packed", "placements", "sizes", "endpoints", "k", "m")
    CAPABILITY_FIELD_NUMBER: _ClassVar[int]
    BLOCK_KEYS_PACKED_FIELD_NUMBER: _ClassVar[int]
    PLACEMENTS_FIELD_NUMBER: _ClassVar[int]
    SIZES_FIELD_NUMBER: _ClassVar[int]
    ENDPOINTS_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    M_FIELD_NUMBER: _ClassVar[int]
    capability: bytes
    block_keys_packed: bytes
    placements: bytes
    sizes: bytes
    endpoints: _containers.RepeatedCompositeFieldContainer[ReadEndpoint]
    k: int
    m: int
    def __init__(self, capability: _Optional[bytes] = ..., block_keys_packed: _Optional[bytes] = ..., placements: _Optional[bytes] = ..., sizes: _Optional[bytes] = ..., endpoints: _Optional[_Iterable[_Union[ReadEndpoint, _Mapping]]] = ..., k: _Optional[int] = ..., m: _Optional[int] = ...) -> None: ...

class Block(_message.Message):
    __slots__ = ("key", "payload")
    KEY_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    payload: bytes
    def __init__(self, key: _Optional[bytes] = ..., payload: _Optional[bytes] = ...) -> None: ...

class PutBlocksRequest(_message.Message):
    __slots__ = ("blocks", "traffic_class", "shared", "layout")
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TRAFFIC_CLASS_FIELD_NUMBER: _ClassVar[int]
    SHARED_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    blocks: _containers.RepeatedCompositeFieldContainer[Block]
    traffic_class: str
    shared: bool
    layout: Layout
    def __init__(self, blocks: _Optional[_Iterable[_Union[Block, _Mapping]]] = ..., traffic_class: _Optional[str] = ..., shared: _Optional[bool] = ..., layout: _Optional[_Union[Layout, _Mapping]] = ...) -> None: ...

class PutBlocksResponse(_message.Message):
    __slots__ = ("committed", "failed_keys", "existing", "busy_keys")
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    FAILED_KEYS_FIELD_NUMBER: _ClassVar[int]
    EXISTING_FIELD_NUMBER: _ClassVar[int]
    BUSY_KEYS_FIELD_NUMBER: _ClassVar[int]
    committed: int
    failed_keys: _containers.RepeatedScalarFieldContainer[bytes]
    existing: int
    busy_keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, committed: _Optional[int] = ..., failed_keys: _Optional[_Iterable[bytes]] = ..., existing: _Optional[int] = ..., busy_keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class GetBlocksRequest(_message.Message):
    __slots__ = ("keys", "lease_id", "layout")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    lease_id: str
    layout: Layout
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ..., lease_id: _Optional[str] = ..., layout: _Optional[_Union[Layout, _Mapping]] = ...) -> None: ...

class GetBlocksResponse(_message.Message):
    __slots__ = ("key", "found", "payload", "miss_reason", "degraded")
    KEY_FIELD_NUMBER: _ClassVar[int]
    FOUND_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    MISS_REASON_FIELD_NUMBER: _ClassVar[int]
    DEGRADED_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    found: bool
    payload: bytes
    miss_reason: str
    degraded: bool
    def __init__(self, key: _Optional[bytes] = ..., found: _Optional[bool] = ..., payload: _Optional[bytes] = ..., miss_reason: _Optional[str] = ..., degraded: _Optional[bool] = ...) -> None: ...

class PutSWAStateRequest(_message.Message):
    __slots__ = ("key", "position", "state", "machine", "shared", "layout")
    KEY_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    MACHINE_FIELD_NUMBER: _ClassVar[int]
    SHARED_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    position: int
    state: bytes
    machine: str
    shared: bool
    layout: Layout
    def __init__(self, key: _Optional[bytes] = ..., position: _Optional[int] = ..., state: _Optional[bytes] = ..., machine: _Optional[str] = ..., shared: _Optional[bool] = ..., layout: _Optional[_Union[Layout, _Mapping]] = ...) -> None: ...

class PutSWAStateResponse(_message.Message):
    __slots__ = ("owner",)
    OWNER_FIELD_NUMBER: _ClassVar[int]
    owner: str
    def __init__(self, owner: _Optional[str] = ...) -> None: ...

class GetSWAStateRequest(_message.Message):
    __slots__ = ("key", "position", "layout")
    KEY_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    position: int
    layout: Layout
    def __init__(self, key: _Optional[bytes] = ..., position: _Optional[int] = ..., layout: _Optional[_Union[Layout, _Mapping]] = ...) -> None: ...

class GetSWAStateResponse(_message.Message):
    __slots__ = ("found", "state", "owner", "miss_reason")
    FOUND_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    MISS_REASON_FIELD_NUMBER: _ClassVar[int]
    found: bool
    state: bytes
    owner: str
    miss_reason: str
    def __init__(self, found: _Optional[bool] = ..., state: _Optional[bytes] = ..., owner: _Optional[str] = ..., miss_reason: _Optional[str] = ...) -> None: ...

class ReleaseLeaseRequest(_message.Message):
    __slots__ = ("lease_id",)
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    def __init__(self, lease_id: _Optional[str] = ...) -> None: ...

class ReleaseLeaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ClassStats(_message.Message):
    __slots__ = ("traffic_class", "lookups", "hit_blocks", "miss_blocks", "miss_reasons", "stored_bytes")
    class MissReasonsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    TRAFFIC_CLASS_FIELD_NUMBER: _ClassVar[int]
    LOOKUPS_FIELD_NUMBER: _ClassVar[int]
    HIT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MISS_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MISS_REASONS_FIELD_NUMBER: _ClassVar[int]
    STORED_BYTES_FIELD_NUMBER: _ClassVar[int]
    traffic_class: str
    lookups: int
    hit_blocks: int
    miss_blocks: int
    miss_reasons: _containers.ScalarMap[str, int]
    stored_bytes: int
    def __init__(self, traffic_class: _Optional[str] = ..., lookups: _Optional[int] = ..., hit_blocks: _Optional[int] = ..., miss_blocks: _Optional[int] = ..., miss_reasons: _Optional[_Mapping[str, int]] = ..., stored_bytes: _Optional[int] = ...) -> None: ...

class GetStatsResponse(_message.Message):
    __slots__ = ("classes", "block_bytes_stored", "swa_bytes_stored", "degraded_reads", "repairs_done", "repairs_pending", "live_storage_nodes", "storage_nodes", "json")
    CLASSES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_STORED_FIELD_NUMBER: _ClassVar[int]
    SWA_BYTES_STORED_FIELD_NUMBER: _ClassVar[int]
    DEGRADED_READS_FIELD_NUMBER: _ClassVar[int]
    REPAIRS_DONE_FIELD_NUMBER: _ClassVar[int]
    REPAIRS_PENDING_FIELD_NUMBER: _ClassVar[int]
    LIVE_STORAGE_NODES_FIELD_NUMBER: _ClassVar[int]
    STORAGE_NODES_FIELD_NUMBER: _ClassVar[int]
    JSON_FIELD_NUMBER: _ClassVar[int]
    classes: _containers.RepeatedCompositeFieldContainer[ClassStats]
    block_bytes_stored: int
    swa_bytes_stored: int
    degraded_reads: int
    repairs_done: int
    repairs_pending: int
    live_storage_nodes: int
    storage_nodes: int
    json: str
    def __init__(self, classes: _Optional[_Iterable[_Union[ClassStats, _Mapping]]] = ..., block_bytes_stored: _Optional[int] = ..., swa_bytes_stored: _Optional[int] = ..., degraded_reads: _Optional[int] = ..., repairs_done: _Optional[int] = ..., repairs_pending: _Optional[int] = ..., live_storage_nodes: _Optional[int] = ..., storage_nodes: _Optional[int] = ..., json: _Optional[str] = ...) -> None: ...
