"""The netlink messages the node side sends instead of running host tools (pure encoding and parsing).

Against the real kernel: tests/integration/test_whole_pod_wrapper.py (the pod lock, lent addresses,
aborted connections in a real namespace) and tests/integration/test_node_bundle.py (all of it from
the installed hook with no host tool)."""

from __future__ import annotations

import socket
import struct

from shim.net import netlink, nftlock, tcpabort


def test_attributes_round_trip_with_padding() -> None:
    data = netlink.attr_str(1, "ab") + netlink.attr_be32(2, -300) + netlink.nested(4, netlink.attr_be32(1, 3))
    assert len(netlink.attr_str(1, "ab")) == 8  # 4 header + "ab\0" padded to 4
    attrs = netlink.parse_attrs(data)
    assert attrs[1] == b"ab\0" and struct.unpack("!i", attrs[2]) == (-300,)
    assert netlink.parse_attrs(attrs[4]) == {1: struct.pack("!I", 3)}  # the nested flag is masked off


def test_the_lock_is_one_batch_a_table_and_two_drop_policy_base_chains() -> None:
    msgs = nftlock.lock_messages("t")
    kinds = [k for k, _, _ in msgs]
    assert kinds[0] == nftlock.NFNL_MSG_BATCH_BEGIN and kinds[-1] == nftlock.NFNL_MSG_BATCH_END
    chain, rule = (10 << 8) | nftlock.NFT_MSG_NEWCHAIN, (10 << 8) | nftlock.NFT_MSG_NEWRULE
    assert kinds[1:-1] == [(10 << 8) | nftlock.NFT_MSG_NEWTABLE] + [chain, rule] * 2
    assert all(flags & netlink.NLM_F_ACK for _, flags, _ in msgs[1:-1])
    # each chain lets CRIU's own marked packets pass (its FIN of a half-closed connection), nothing else
    for _, _, body in (m for m in msgs if m[0] == rule):
        attrs = netlink.parse_attrs(body[4:])
        assert attrs[nftlock.NFTA_RULE_TABLE] == b"t\0"
        assert struct.pack("=I", nftlock.SOCCR_MARK) in attrs[nftlock.NFTA_RULE_EXPRESSIONS]
    hooks = []
    for _, _, body in (m for m in msgs[2:-1] if m[0] == chain):
        assert body[0] == nftlock.NFPROTO_INET
        attrs = netlink.parse_attrs(body[4:])
        assert attrs[nftlock.NFTA_CHAIN_TABLE] == b"t\0" and attrs[nftlock.NFTA_CHAIN_TYPE] == b"filter\0"
        assert struct.unpack("!I", attrs[nftlock.NFTA_CHAIN_POLICY]) == (nftlock.NF_DROP,)
        hook = netlink.parse_attrs(attrs[nftlock.NFTA_CHAIN_HOOK])
        hooks.append(struct.unpack("!I", hook[nftlock.NFTA_HOOK_HOOKNUM])[0])
    assert hooks == [nftlock.NF_INET_LOCAL_IN, nftlock.NF_INET_LOCAL_OUT]


def test_tcp_diag_answers_are_parsed_and_loopback_told_apart() -> None:
    sockid = struct.pack("!HH", 36844, 7001) + socket.inet_aton("10.244.0.3") + b"\0" * 12
    sockid += socket.inet_aton("10.244.9.2") + b"\0" * 12 + struct.pack("=I2I", 0, 7, 9)
    c = tcpabort.parse(bytes([socket.AF_INET, 1, 0, 0]) + sockid + b"\0" * 20)
    assert c is not None and (c.local, c.local_port, c.remote, c.remote_port) == (
        "10.244.0.3",
        36844,
        "10.244.9.2",
        7001,
    )
    assert c.sockid == sockid  # handed back as is in SOCK_DESTROY (the cookie included)
    assert (
        tcpabort.is_loopback("127.0.0.5") and tcpabort.is_loopback("::1") and tcpabort.is_loopback("::ffff:127.0.0.1")
    )
    assert not tcpabort.is_loopback("10.244.0.3") and not tcpabort.is_loopback("fd00::3")
    assert tcpabort.parse(b"\0" * 10) is None
