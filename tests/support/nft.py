"""What nf_tables holds in a network namespace, for tests (this machine has no `nft` program)."""

from __future__ import annotations

from shim.net import netlink, netns, nftlock


def nft_tables(netns_path: str) -> list[str]:
    """The names of the nf_tables tables in the namespace at `netns_path` (a netlink dump)."""

    def dump() -> list[str]:
        with netlink.Netlink(netlink.NETLINK_NETFILTER) as nl:
            msgs = nl.dump(nftlock._kind(nftlock.NFT_MSG_GETTABLE), nftlock._nfgen(0), "listing tables")
        return [netlink.parse_attrs(m.body[4:]).get(nftlock.NFTA_TABLE_NAME, b"").rstrip(b"\0").decode() for m in msgs]

    return netns.run_in(netns_path, dump)
