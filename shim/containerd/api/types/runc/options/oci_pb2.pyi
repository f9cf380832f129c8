from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class Options(_message.Message):
    __slots__ = ("no_pivot_root", "no_new_keyring", "shim_cgroup", "io_uid", "io_gid", "binary_name", "root", "systemd_cgroup", "criu_image_path", "criu_work_path", "task_api_address", "task_api_version")
    NO_PIVOT_ROOT_FIELD_NUMBER: _ClassVar[int]
    NO_NEW_KEYRING_FIELD_NUMBER: _ClassVar[int]
    SHIM_CGROUP_FIELD_NUMBER: _ClassVar[int]
    IO_UID_FIELD_NUMBER: _ClassVar[int]
    IO_GID_FIELD_NUMBER: _ClassVar[int]
    BINARY_NAME_FIELD_NUMBER: _ClassVar[int]
    ROOT_FIELD_NUMBER: _ClassVar[int]
    SYSTEMD_CGROUP_FIELD_NUMBER: _ClassVar[int]
    CRIU_IMAGE_PATH_FIELD_NUMBER: _ClassVar[int]
    CRIU_WORK_PATH_FIELD_NUMBER: _ClassVar[int]
    TASK_API_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TASK_API_VERSION_FIELD_NUMBER: _ClassVar[int]
    no_pivot_root: bool
    no_new_keyring: bool
    shim_cgroup: str
    io_uid: int
    io_gid: int
    binary_name: str
    root: str
    systemd_cgroup: bool
    criu_image_path: str
    criu_work_path: str
    task_api_address: str
    task_api_version: int
    def __init__(self, no_pivot_root: bool = ..., no_new_keyring: bool = ..., shim_cgroup: _Optional[str] = ..., io_uid: _Optional[int] = ..., io_gid: _Optional[int] = ..., binary_name: _Optional[str] = ..., root: _Optional[str] = ..., systemd_cgroup: bool = ..., criu_image_path: _Optional[str] = ..., criu_work_path: _Optional[str] = ..., task_api_address: _Optional[str] = ..., task_api_version: _Optional[int] = ...) -> None: ...

class CheckpointOptions(_message.Message):
    __slots__ = ("exit", "open_tcp", "external_unix_sockets", "terminal", "file_locks", "empty_namespaces", "cgroups_mode", "image_path", "work_path")
    EXIT_FIELD_NUMBER: _ClassVar[int]
    OPEN_TCP_FIELD_NUMBER: _ClassVar[int]
    EXTERNAL_UNIX_SOCKETS_FIELD_NUMBER: _ClassVar[int]
    TERMINAL_FIELD_NUMBER: _ClassVar[int]
    FILE_LOCKS_FIELD_NUMBER: _ClassVar[int]
    EMPTY_NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    CGROUPS_MODE_FIELD_NUMBER: _ClassVar[int]
    IMAGE_PATH_FIELD_NUMBER: _ClassVar[int]
    WORK_PATH_FIELD_NUMBER: _ClassVar[int]
    exit: bool
    open_tcp: bool
    external_unix_sockets: bool
    terminal: bool
    file_locks: bool
    empty_namespaces: _containers.RepeatedScalarFieldContainer[str]
    cgroups_mode: str
    image_path: str
    work_path: str
    def __init__(self, exit: bool = ..., open_tcp: bool = ..., external_unix_sockets: bool = ..., terminal: bool = ..., file_locks: bool = ..., empty_namespaces: _Optional[_Iterable[str]] = ..., cgroups_mode: _Optional[str] = ..., image_path: _Optional[str] = ..., work_path: _Optional[str] = ...) -> None: ...
