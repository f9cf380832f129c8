"""A pod's network, through the kernel's interfaces in-process (netlink, sock_diag, setns): no host tool."""
