from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class AcquireStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ACQUIRE_STATUS_UNSPECIFIED: _ClassVar[AcquireStatus]
    OK: _ClassVar[AcquireStatus]
    NOT_FOUND: _ClassVar[AcquireStatus]
    INCOMPATIBLE: _ClassVar[AcquireStatus]
ACQUIRE_STATUS_UNSPECIFIED: AcquireStatus
OK: AcquireStatus
NOT_FOUND: AcquireStatus
INCOMPATIBLE: AcquireStatus

class AcquireRequest(_message.Message):
    __slots__ = ("conversation_id", "prompt", "compat", "nixl_agent", "nixl_metadata")
    CONVERSATION_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    COMPAT_FIELD_NUMBER: _ClassVar[int]
    NIXL_AGENT_FIELD_NUMBER: _ClassVar[int]
    NIXL_METADATA_FIELD_NUMBER: _ClassVar[int]
    conversation_id: str
    prompt: _containers.RepeatedScalarFieldContainer[int]
    compat: str
    nixl_agent: str
    nixl_metadata: bytes
    def __init__(self, conversation_id: _Optional[str] = ..., prompt: _Optional[_Iterable[int]] = ..., compat: _Optional[str] = ..., nixl_agent: _Optional[str] = ..., nixl_metadata: _Optional[bytes] = ...) -> None: ...

class Segment(_message.Message):
    __slots__ = ("addr", "len")
    ADDR_FIELD_NUMBER: _ClassVar[int]
    LEN_FIELD_NUMBER: _ClassVar[int]
    addr: int
    len: int
    def __init__(self, addr: _Optional[int] = ..., len: _Optional[int] = ...) -> None: ...

class NixlPath(_message.Message):
    __slots__ = ("agent", "metadata", "segments")
    AGENT_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    agent: str
    metadata: bytes
    segments: _containers.RepeatedCompositeFieldContainer[Segment]
    def __init__(self, agent: _Optional[str] = ..., metadata: _Optional[bytes] = ..., segments: _Optional[_Iterable[_Union[Segment, _Mapping]]] = ...) -> None: ...

class AcquireResponse(_message.Message):
    __slots__ = ("status", "gen", "tokens", "lease_id", "lease_ttl_ms", "total_bytes", "chunk_size", "digest", "boot_id", "compat", "nixl")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    GEN_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHUNK_SIZE_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    BOOT_ID_FIELD_NUMBER: _ClassVar[int]
    COMPAT_FIELD_NUMBER: _ClassVar[int]
    NIXL_FIELD_NUMBER: _ClassVar[int]
    status: AcquireStatus
    gen: int
    tokens: _containers.RepeatedScalarFieldContainer[int]
    lease_id: str
    lease_ttl_ms: int
    total_bytes: int
    chunk_size: int
    digest: bytes
    boot_id: str
    compat: str
    nixl: NixlPath
    def __init__(self, status: _Optional[_Union[AcquireStatus, str]] = ..., gen: _Optional[int] = ..., tokens: _Optional[_Iterable[int]] = ..., lease_id: _Optional[str] = ..., lease_ttl_ms: _Optional[int] = ..., total_bytes: _Optional[int] = ..., chunk_size: _Optional[int] = ..., digest: _Optional[bytes] = ..., boot_id: _Optional[str] = ..., compat: _Optional[str] = ..., nixl: _Optional[_Union[NixlPath, _Mapping]] = ...) -> None: ...

class PullRequest(_message.Message):
    __slots__ = ("lease_id", "offset")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    offset: int
    def __init__(self, lease_id: _Optional[str] = ..., offset: _Optional[int] = ...) -> None: ...

class PullChunk(_message.Message):
    __slots__ = ("offset", "data")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    offset: int
    data: bytes
    def __init__(self, offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class LeaseRequest(_message.Message):
    __slots__ = ("lease_id",)
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    def __init__(self, lease_id: _Optional[str] = ...) -> None: ...

class RenewResponse(_message.Message):
    __slots__ = ("ok",)
    OK_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    def __init__(self, ok: _Optional[bool] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("lease_id", "ok")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    ok: bool
    def __init__(self, lease_id: _Optional[str] = ..., ok: _Optional[bool] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("valid", "gen")
    VALID_FIELD_NUMBER: _ClassVar[int]
    GEN_FIELD_NUMBER: _ClassVar[int]
    valid: bool
    gen: int
    def __init__(self, valid: _Optional[bool] = ..., gen: _Optional[int] = ...) -> None: ...
