"""Shared pytest configuration. Fixtures live in tests/support/ and are registered here."""

pytest_plugins = [
    "tests.support.registry",
    "tests.support.containerd",
]


def pytest_sessionstart(session: object) -> None:
    """The kernel's RCU switch as the tests found it (shim/host/rcu.py turns it on during dumps and restores)."""
    global _RCU_AT_START
    _RCU_AT_START = _rcu_switch()


def pytest_sessionfinish(session: object, exitstatus: int) -> None:
    """Tests leave what they found: an agent a test killed mid-dump may have left the switch on (its next
    start would put it back); put back here, and say so."""
    now = _rcu_switch()
    if _RCU_AT_START and now and now != _RCU_AT_START:
        import sys

        print(f"\nnote: /sys/kernel/rcu_expedited was {now}, put back to {_RCU_AT_START}", file=sys.stderr)
        try:
            with open(RCU_SWITCH, "w") as f:
                f.write(_RCU_AT_START)
        except OSError as e:
            print(f"note: could not put it back: {e}", file=sys.stderr)


RCU_SWITCH = "/sys/kernel/rcu_expedited"
_RCU_AT_START = ""


def _rcu_switch() -> str:
    try:
        with open(RCU_SWITCH) as f:
            return f.read().strip()
    except OSError:
        return ""
