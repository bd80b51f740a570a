from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KeyValue(_message.Message):
    __slots__ = ("key", "value", "create_revision", "mod_revision", "version", "lease")
    KEY_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    CREATE_REVISION_FIELD_NUMBER: _ClassVar[int]
    MOD_REVISION_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    key: str
    value: bytes
    create_revision: int
    mod_revision: int
    version: int
    lease: int
    def __init__(self, key: _Optional[str] = ..., value: _Optional[bytes] = ..., create_revision: _Optional[int] = ..., mod_revision: _Optional[int] = ..., version: _Optional[int] = ..., lease: _Optional[int] = ...) -> None: ...

class RangeRequest(_message.Message):
    __slots__ = ("key", "prefix")
    KEY_FIELD_NUMBER: _ClassVar[int]
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    key: str
    prefix: bool
    def __init__(self, key: _Optional[str] = ..., prefix: _Optional[bool] = ...) -> None: ...

class RangeReply(_message.Message):
    __slots__ = ("kvs", "revision", "hosted_by_agent", "token_unused")
    KVS_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    HOSTED_BY_AGENT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_UNUSED_FIELD_NUMBER: _ClassVar[int]
    kvs: _containers.RepeatedCompositeFieldContainer[KeyValue]
    revision: int
    hosted_by_agent: bool
    token_unused: bool
    def __init__(self, kvs: _Optional[_Iterable[_Union[KeyValue, _Mapping]]] = ..., revision: _Optional[int] = ..., hosted_by_agent: _Optional[bool] = ..., token_unused: _Optional[bool] = ...) -> None: ...

class PutRequest(_message.Message):
    __slots__ = ("key", "value", "lease")
    KEY_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    key: str
    value: bytes
    lease: int
    def __init__(self, key: _Optional[str] = ..., value: _Optional[bytes] = ..., lease: _Optional[int] = ...) -> None: ...

class PutReply(_message.Message):
    __slots__ = ("revision",)
    REVISION_FIELD_NUMBER: _ClassVar[int]
    revision: int
    def __init__(self, revision: _Optional[int] = ...) -> None: ...

class DeleteRangeRequest(_message.Message):
    __slots__ = ("key", "prefix")
    KEY_FIELD_NUMBER: _ClassVar[int]
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    key: str
    prefix: bool
    def __init__(self, key: _Optional[str] = ..., prefix: _Optional[bool] = ...) -> None: ...

class DeleteRangeReply(_message.Message):
    __slots__ = ("deleted",)
    DELETED_FIELD_NUMBER: _ClassVar[int]
    deleted: int
    def __init__(self, deleted: _Optional[int] = ...) -> None: ...

class CompareAndPutRequest(_message.Message):
    __slots__ = ("key", "value", "expected_mod_revision", "lease")
    KEY_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_MOD_REVISION_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    key: str
    value: bytes
    expected_mod_revision: int
    lease: int
    def __init__(self, key: _Optional[str] = ..., value: _Optional[bytes] = ..., expected_mod_revision: _Optional[int] = ..., lease: _Optional[int] = ...) -> None: ...

class CompareAndDeleteRequest(_message.Message):
    __slots__ = ("key", "expected_mod_revision")
    KEY_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_MOD_REVISION_FIELD_NUMBER: _ClassVar[int]
    key: str
    expected_mod_revision: int
    def __init__(self, key: _Optional[str] = ..., expected_mod_revision: _Optional[int] = ...) -> None: ...

class CompareReply(_message.Message):
    __slots__ = ("succeeded",)
    SUCCEEDED_FIELD_NUMBER: _ClassVar[int]
    succeeded: bool
    def __init__(self, succeeded: _Optional[bool] = ...) -> None: ...

class LeaseGrantRequest(_message.Message):
    __slots__ = ("ttl_seconds",)
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ttl_seconds: float
    def __init__(self, ttl_seconds: _Optional[float] = ...) -> None: ...

class LeaseGrantReply(_message.Message):
    __slots__ = ("lease",)
    LEASE_FIELD_NUMBER: _ClassVar[int]
    lease: int
    def __init__(self, lease: _Optional[int] = ...) -> None: ...

class LeaseKeepAliveRequest(_message.Message):
    __slots__ = ("lease",)
    LEASE_FIELD_NUMBER: _ClassVar[int]
    lease: int
    def __init__(self, lease: _Optional[int] = ...) -> None: ...

class LeaseKeepAliveReply(_message.Message):
    __slots__ = ("lease", "expired", "ttl_seconds")
    LEASE_FIELD_NUMBER: _ClassVar[int]
    EXPIRED_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    lease: int
    expired: bool
    ttl_seconds: float
    def __init__(self, lease: _Optional[int] = ..., expired: _Optional[bool] = ..., ttl_seconds: _Optional[float] = ...) -> None: ...

class LeaseRevokeRequest(_message.Message):
    __slots__ = ("lease",)
    LEASE_FIELD_NUMBER: _ClassVar[int]
    lease: int
    def __init__(self, lease: _Optional[int] = ...) -> None: ...

class LeaseRevokeReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WatchRequest(_message.Message):
    __slots__ = ("key", "prefix", "start_revision")
    KEY_FIELD_NUMBER: _ClassVar[int]
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    START_REVISION_FIELD_NUMBER: _ClassVar[int]
    key: str
    prefix: bool
    start_revision: int
    def __init__(self, key: _Optional[str] = ..., prefix: _Optional[bool] = ..., start_revision: _Optional[int] = ...) -> None: ...

class WatchEvent(_message.Message):
    __slots__ = ("type", "key", "value", "revision")
    class Type(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        PUT: _ClassVar[WatchEvent.Type]
        DELETE: _ClassVar[WatchEvent.Type]
    PUT: WatchEvent.Type
    DELETE: WatchEvent.Type
    TYPE_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    type: WatchEvent.Type
    key: str
    value: bytes
    revision: int
    def __init__(self, type: _Optional[_Union[WatchEvent.Type, str]] = ..., key: _Optional[str] = ..., value: _Optional[bytes] = ..., revision: _Optional[int] = ...) -> None: ...

class WatchReply(_message.Message):
    __slots__ = ("store_id", "events", "compact_revision", "hosted_by_agent")
    STORE_ID_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    COMPACT_REVISION_FIELD_NUMBER: _ClassVar[int]
    HOSTED_BY_AGENT_FIELD_NUMBER: _ClassVar[int]
    store_id: int
    events: _containers.RepeatedCompositeFieldContainer[WatchEvent]
    compact_revision: int
    hosted_by_agent: bool
    def __init__(self, store_id: _Optional[int] = ..., events: _Optional[_Iterable[_Union[WatchEvent, _Mapping]]] = ..., compact_revision: _Optional[int] = ..., hosted_by_agent: _Optional[bool] = ...) -> None: ...

class SetRequest(_message.Message):
    __slots__ = ("key", "value")
    KEY_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    key: str
    value: bytes
    def __init__(self, key: _Optional[str] = ..., value: _Optional[bytes] = ...) -> None: ...

class SetReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetRequest(_message.Message):
    __slots__ = ("key", "timeout_seconds")
    KEY_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    key: str
    timeout_seconds: float
    def __init__(self, key: _Optional[str] = ..., timeout_seconds: _Optional[float] = ...) -> None: ...

class GetReply(_message.Message):
    __slots__ = ("value", "timed_out")
    VALUE_FIELD_NUMBER: _ClassVar[int]
    TIMED_OUT_FIELD_NUMBER: _ClassVar[int]
    value: bytes
    timed_out: bool
    def __init__(self, value: _Optional[bytes] = ..., timed_out: _Optional[bool] = ...) -> None: ...

class AddRequest(_message.Message):
    __slots__ = ("key", "amount")
    KEY_FIELD_NUMBER: _ClassVar[int]
    AMOUNT_FIELD_NUMBER: _ClassVar[int]
    key: str
    amount: int
    def __init__(self, key: _Optional[str] = ..., amount: _Optional[int] = ...) -> None: ...

class AddReply(_message.Message):
    __slots__ = ("value",)
    VALUE_FIELD_NUMBER: _ClassVar[int]
    value: int
    def __init__(self, value: _Optional[int] = ...) -> None: ...

class CompareSetRequest(_message.Message):
    __slots__ = ("key", "expected", "desired")
    KEY_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_FIELD_NUMBER: _ClassVar[int]
    DESIRED_FIELD_NUMBER: _ClassVar[int]
    key: str
    expected: bytes
    desired: bytes
    def __init__(self, key: _Optional[str] = ..., expected: _Optional[bytes] = ..., desired: _Optional[bytes] = ...) -> None: ...

class CompareSetReply(_message.Message):
    __slots__ = ("value",)
    VALUE_FIELD_NUMBER: _ClassVar[int]
    value: bytes
    def __init__(self, value: _Optional[bytes] = ...) -> None: ...

class WaitRequest(_message.Message):
    __slots__ = ("keys", "timeout_seconds")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[str]
    timeout_seconds: float
    def __init__(self, keys: _Optional[_Iterable[str]] = ..., timeout_seconds: _Optional[float] = ...) -> None: ...

class WaitReply(_message.Message):
    __slots__ = ("timed_out",)
    TIMED_OUT_FIELD_NUMBER: _ClassVar[int]
    timed_out: bool
    def __init__(self, timed_out: _Optional[bool] = ...) -> None: ...

class CheckRequest(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, keys: _Optional[_Iterable[str]] = ...) -> None: ...

class CheckReply(_message.Message):
    __slots__ = ("ready",)
    READY_FIELD_NUMBER: _ClassVar[int]
    ready: bool
    def __init__(self, ready: _Optional[bool] = ...) -> None: ...

class NumKeysRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class NumKeysReply(_message.Message):
    __slots__ = ("count",)
    COUNT_FIELD_NUMBER: _ClassVar[int]
    count: int
    def __init__(self, count: _Optional[int] = ...) -> None: ...

class DeleteKeyRequest(_message.Message):
    __slots__ = ("key",)
    KEY_FIELD_NUMBER: _ClassVar[int]
    key: str
    def __init__(self, key: _Optional[str] = ...) -> None: ...

class DeleteKeyReply(_message.Message):
    __slots__ = ("deleted",)
    DELETED_FIELD_NUMBER: _ClassVar[int]
    deleted: bool
    def __init__(self, deleted: _Optional[bool] = ...) -> None: ...

class MultiGetRequest(_message.Message):
    __slots__ = ("keys", "timeout_seconds")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[str]
    timeout_seconds: float
    def __init__(self, keys: _Optional[_Iterable[str]] = ..., timeout_seconds: _Optional[float] = ...) -> None: ...

class MultiGetReply(_message.Message):
    __slots__ = ("values", "timed_out")
    VALUES_FIELD_NUMBER: _ClassVar[int]
    TIMED_OUT_FIELD_NUMBER: _ClassVar[int]
    values: _containers.RepeatedScalarFieldContainer[bytes]
    timed_out: bool
    def __init__(self, values: _Optional[_Iterable[bytes]] = ..., timed_out: _Optional[bool] = ...) -> None: ...

class MultiSetRequest(_message.Message):
    __slots__ = ("keys", "values")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[str]
    values: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, keys: _Optional[_Iterable[str]] = ..., values: _Optional[_Iterable[bytes]] = ...) -> None: ...

class MultiSetReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
