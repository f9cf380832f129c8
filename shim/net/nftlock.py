"""Drop every packet of a network namespace: one nf_tables table, set through netlink in-process.

The lock is a table of family ``inet`` (IPv4 and IPv6) holding two base chains, on the ``input`` and
``output`` hooks, with policy ``drop``: a packet that any base chain drops is dropped, whatever other
tables (kube-proxy's, a CNI's, iptables-nft's) say. Lifting it is deleting the table. Each chain has one
rule, ``meta mark 0xc114 accept``: the packets CRIU itself sends while it restores TCP connections (soccr
marks its raw socket with SOCCR_MARK, e.g. the FIN of a half-closed connection) pass, as CRIU's own lock
lets them; without it the restore of a pod caught with a half-closed connection (an HTTP probe's, say)
failed with "Unable to send a fin packet ... Operation not permitted".
This is what CRIU's own ``network-lock nftables`` does (its ``CRIU-<pid>`` table), on the same kernel
interface, so a node where CRIU locks with nftables (install-node writes that into
/etc/criu/runc.conf after a real dump with it worked) needs nothing more for these locks: no
``nsenter``, ``sh`` or ``iptables-restore``. Needs ``CONFIG_NF_TABLES`` and ``CONFIG_NF_TABLES_INET``
(doctor probes it: shim/service/nodecheck.py). Call it from a thread in the namespace (shim/net/netns.py).
"""

from __future__ import annotations

import errno
import socket
import struct

from shim.net.netlink import (
    NETLINK_NETFILTER,
    NLM_F_ACK,
    NLM_F_CREATE,
    Netlink,
    NetlinkError,
    attr,
    attr_be32,
    attr_str,
    nested,
    parse_attrs,
)

NFNL_SUBSYS_NFTABLES = 10
NFNL_MSG_BATCH_BEGIN = 0x10
NFNL_MSG_BATCH_END = 0x11
NFT_MSG_NEWTABLE, NFT_MSG_GETTABLE, NFT_MSG_DELTABLE, NFT_MSG_NEWCHAIN = 0, 1, 2, 3
NFPROTO_UNSPEC, NFPROTO_INET = 0, 1
NFTA_TABLE_NAME = 1
NFTA_CHAIN_TABLE, NFTA_CHAIN_NAME, NFTA_CHAIN_HOOK, NFTA_CHAIN_POLICY, NFTA_CHAIN_TYPE = 1, 3, 4, 5, 7
NFTA_HOOK_HOOKNUM, NFTA_HOOK_PRIORITY = 1, 2
NF_INET_LOCAL_IN, NF_INET_LOCAL_OUT = 1, 3
NF_DROP, NF_ACCEPT = 0, 1
NFT_MSG_NEWRULE = 6
NFTA_RULE_TABLE, NFTA_RULE_CHAIN, NFTA_RULE_EXPRESSIONS = 1, 2, 4
NFTA_LIST_ELEM, NFTA_EXPR_NAME, NFTA_EXPR_DATA = 1, 1, 2
NFTA_META_DREG, NFTA_META_KEY, NFT_META_MARK = 1, 2, 3
NFTA_CMP_SREG, NFTA_CMP_OP, NFTA_CMP_DATA, NFT_CMP_EQ = 1, 2, 3, 0
NFTA_IMMEDIATE_DREG, NFTA_IMMEDIATE_DATA = 1, 2
NFTA_DATA_VALUE, NFTA_DATA_VERDICT, NFTA_VERDICT_CODE = 1, 2, 1
NFT_REG_VERDICT, NFT_REG_1 = 0, 1
NLM_F_APPEND = 0x800
SOCCR_MARK = 0xC114  # CRIU's soccr/soccr.h: the mark of the packets CRIU sends while it restores sockets
PRIORITY = -300  # before conntrack (-200): dropped packets leave no connection-tracking entries
HOOKS = (("input", NF_INET_LOCAL_IN), ("output", NF_INET_LOCAL_OUT))


def _nfgen(family: int, res_id: int = 0) -> bytes:
    return struct.pack("=BBH", family, 0, socket.htons(res_id))


def _kind(msg: int) -> int:
    return (NFNL_SUBSYS_NFTABLES << 8) | msg


def _batch(*messages: tuple[int, int, bytes]) -> list[tuple[int, int, bytes]]:
    mark = _nfgen(NFPROTO_UNSPEC, NFNL_SUBSYS_NFTABLES)
    return [(NFNL_MSG_BATCH_BEGIN, 0, mark), *messages, (NFNL_MSG_BATCH_END, 0, mark)]


def lock_messages(table: str) -> list[tuple[int, int, bytes]]:
    """The batch that creates (or keeps) the table with its two drop-policy base chains, each with its
    rule that lets CRIU's own marked packets pass."""
    body = _nfgen(NFPROTO_INET) + attr_str(NFTA_TABLE_NAME, table)
    msgs = [(_kind(NFT_MSG_NEWTABLE), NLM_F_CREATE | NLM_F_ACK, body)]
    for name, hook in HOOKS:
        chain = _nfgen(NFPROTO_INET) + b"".join(
            (
                attr_str(NFTA_CHAIN_TABLE, table),
                attr_str(NFTA_CHAIN_NAME, name),
                nested(NFTA_CHAIN_HOOK, attr_be32(NFTA_HOOK_HOOKNUM, hook), attr_be32(NFTA_HOOK_PRIORITY, PRIORITY)),
                attr_be32(NFTA_CHAIN_POLICY, NF_DROP),
                attr_str(NFTA_CHAIN_TYPE, "filter"),
            )
        )
        msgs.append((_kind(NFT_MSG_NEWCHAIN), NLM_F_CREATE | NLM_F_ACK, chain))
        msgs.append((_kind(NFT_MSG_NEWRULE), NLM_F_CREATE | NLM_F_APPEND | NLM_F_ACK, _accept_mark(table, name)))
    return _batch(*msgs)


def _expr(name: str, *data: bytes) -> bytes:
    return nested(NFTA_LIST_ELEM, attr_str(NFTA_EXPR_NAME, name), nested(NFTA_EXPR_DATA, *data))


def _accept_mark(table: str, chain: str) -> bytes:
    """The rule ``meta mark SOCCR_MARK accept`` of `chain` (the packet's mark is a host-order u32)."""
    return (
        _nfgen(NFPROTO_INET)
        + attr_str(NFTA_RULE_TABLE, table)
        + attr_str(NFTA_RULE_CHAIN, chain)
        + nested(
            NFTA_RULE_EXPRESSIONS,
            _expr("meta", attr_be32(NFTA_META_DREG, NFT_REG_1), attr_be32(NFTA_META_KEY, NFT_META_MARK)),
            _expr(
                "cmp",
                attr_be32(NFTA_CMP_SREG, NFT_REG_1),
                attr_be32(NFTA_CMP_OP, NFT_CMP_EQ),
                nested(NFTA_CMP_DATA, attr(NFTA_DATA_VALUE, struct.pack("=I", SOCCR_MARK))),
            ),
            _expr(
                "immediate",
                attr_be32(NFTA_IMMEDIATE_DREG, NFT_REG_VERDICT),
                nested(NFTA_IMMEDIATE_DATA, nested(NFTA_DATA_VERDICT, attr_be32(NFTA_VERDICT_CODE, NF_ACCEPT))),
            ),
        )
    )


def lock(table: str) -> None:
    """Drop every packet in this thread's network namespace but CRIU's own (taken again, the same table and
    chains stay; each gets its accept rule once more, which passes the same packets)."""
    with Netlink(NETLINK_NETFILTER) as nl:
        nl.transact(lock_messages(table), f"nf_tables: creating the lock table inet {table}")


def unlock(table: str) -> bool:
    """Lift the lock; False when there was none."""
    body = _nfgen(NFPROTO_INET) + attr_str(NFTA_TABLE_NAME, table)
    try:
        with Netlink(NETLINK_NETFILTER) as nl:
            nl.transact(_batch((_kind(NFT_MSG_DELTABLE), NLM_F_ACK, body)), f"nf_tables: deleting inet {table}")
    except NetlinkError as e:
        if e.errno == errno.ENOENT:
            return False
        raise
    return True


def locked(table: str) -> bool:
    """Whether the lock table exists in this thread's network namespace."""
    body = _nfgen(NFPROTO_INET) + attr_str(NFTA_TABLE_NAME, table)
    try:
        with Netlink(NETLINK_NETFILTER) as nl:
            nl.transact([(_kind(NFT_MSG_GETTABLE), NLM_F_ACK, body)], f"nf_tables: reading inet {table}")
    except NetlinkError as e:
        if e.errno == errno.ENOENT:
            return False
        raise
    return True


def tables(family: int = NFPROTO_INET) -> list[str]:
    """The names of this thread's network namespace's nf_tables tables of `family` (a netlink dump)."""
    with Netlink(NETLINK_NETFILTER) as nl:
        msgs = nl.dump(_kind(NFT_MSG_GETTABLE), _nfgen(family), "nf_tables: listing tables")
    names = [parse_attrs(m.body[4:]).get(NFTA_TABLE_NAME, b"") for m in msgs if m.body[:1] == bytes([family])]
    return [n.rstrip(b"\0").decode(errors="replace") for n in names]


def probe() -> str:
    """ "" when this kernel has nf_tables for the lock, else why not (read-only; any namespace)."""
    try:
        locked("kubectl-snapshot-probe")
    except OSError as e:
        return f"nf_tables is not usable here ({e}): the kernel needs CONFIG_NF_TABLES and CONFIG_NF_TABLES_INET"
    return ""
