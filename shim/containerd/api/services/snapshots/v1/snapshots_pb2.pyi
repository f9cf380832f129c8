from google.protobuf import empty_pb2 as _empty_pb2
from google.protobuf import timestamp_pb2 as _timestamp_pb2
from shim.containerd.api.types import mount_pb2 as _mount_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    UNKNOWN: _ClassVar[Kind]
    VIEW: _ClassVar[Kind]
    ACTIVE: _ClassVar[Kind]
    COMMITTED: _ClassVar[Kind]
UNKNOWN: Kind
VIEW: Kind
ACTIVE: Kind
COMMITTED: Kind

class PrepareSnapshotRequest(_message.Message):
    __slots__ = ("snapshotter", "key", "parent", "labels")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SNAPSHOTTER_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    PARENT_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    snapshotter: str
    key: str
    parent: str
    labels: _containers.ScalarMap[str, str]
    def __init__(self, snapshotter: _Optional[str] = ..., key: _Optional[str] = ..., parent: _Optional[str] = ..., labels: _Optional[_Mapping[str, str]] = ...) -> None: ...

class PrepareSnapshotResponse(_message.Message):
    __slots__ = ("mounts",)
    MOUNTS_FIELD_NUMBER: _ClassVar[int]
    mounts: _containers.RepeatedCompositeFieldContainer[_mount_pb2.Mount]
    def __init__(self, mounts: _Optional[_Iterable[_Union[_mount_pb2.Mount, _Mapping]]] = ...) -> None: ...

class ViewSnapshotRequest(_message.Message):
    __slots__ = ("snapshotter", "key", "parent", "labels")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SNAPSHOTTER_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    PARENT_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    snapshotter: str
    key: str
    parent: str
    labels: _containers.ScalarMap[str, str]
    def __init__(self, snapshotter: _Optional[str] = ..., key: _Optional[str] = ..., parent: _Optional[str] = ..., labels: _Optional[_Mapping[str, str]] = ...) -> None: ...

class ViewSnapshotResponse(_message.Message):
    __slots__ = ("mounts",)
    MOUNTS_FIELD_NUMBER: _ClassVar[int]
    mounts: _containers.RepeatedCompositeFieldContainer[_mount_pb2.Mount]
    def __init__(self, mounts: _Optional[_Iterable[_Union[_mount_pb2.Mount, _Mapping]]] = ...) -> None: ...

class MountsRequest(_message.Message):
    __slots__ = ("snapshotter", "key")
    SNAPSHOTTER_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    snapshotter: str
    key: str
    def __init__(self, snapshotter: _Optional[str] = ..., key: _Optional[str] = ...) -> None: ...

class MountsResponse(_message.Message):
    __slots__ = ("mounts",)
    MOUNTS_FIELD_NUMBER: _ClassVar[int]
    mounts: _containers.RepeatedCompositeFieldContainer[_mount_pb2.Mount]
    def __init__(self, mounts: _Optional[_Iterable[_Union[_mount_pb2.Mount, _Mapping]]] = ...) -> None: ...

class RemoveSnapshotRequest(_message.Message):
    __slots__ = ("snapshotter", "key")
    SNAPSHOTTER_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    snapshotter: str
    key: str
    def __init__(self, snapshotter: _Optional[str] = ..., key: _Optional[str] = ...) -> None: ...

class StatSnapshotRequest(_message.Message):
    __slots__ = ("snapshotter", "key")
    SNAPSHOTTER_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    snapshotter: str
    key: str
    def __init__(self, snapshotter: _Optional[str] = ..., key: _Optional[str] = ...) -> None: ...

class Info(_message.Message):
    __slots__ = ("name", "parent", "kind", "created_at", "updated_at", "labels")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    PARENT_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    UPDATED_AT_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    name: str
    parent: str
    kind: Kind
    created_at: _timestamp_pb2.Timestamp
    updated_at: _timestamp_pb2.Timestamp
    labels: _containers.ScalarMap[str, str]
    def __init__(self, name: _Optional[str] = ..., parent: _Optional[str] = ..., kind: _Optional[_Union[Kind, str]] = ..., created_at: _Optional[_Union[_timestamp_pb2.Timestamp, _Mapping]] = ..., updated_at: _Optional[_Union[_timestamp_pb2.Timestamp, _Mapping]] = ..., labels: _Optional[_Mapping[str, str]] = ...) -> None: ...

class StatSnapshotResponse(_message.Message):
    __slots__ = ("info",)
    INFO_FIELD_NUMBER: _ClassVar[int]
    info: Info
    def __init__(self, info: _Optional[_Union[Info, _Mapping]] = ...) -> None: ...
