"""`python3 -m shim.guard`: the freeze guard (shim/freeze_guard.py) under the name the agent pod's `guard`
container runs (kubectl_snapshot/deploy/agent.py).

The command lives in the DaemonSet and the module in the image, and the two can come from different
releases (an image set by hand, a rollback, the e2e fixture putting back the agent it found), so the
pod spec keeps this name and every image answers to it.
"""

from shim.freeze_guard import main

if __name__ == "__main__":
    main()
