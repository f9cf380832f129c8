// Command pause is the sandbox ("infra") process of every pod in the local test cluster.
//
// It holds the pod's namespaces open: it sleeps forever, reaps children re-parented to it (it
// is PID 1 of the pod's PID namespace when that is shared) and exits promptly on SIGINT/SIGTERM
// so pods stop without waiting for the kill timeout. Written for this project (no upstream copy);
// built statically with CGO_ENABLED=0 by hack/cluster/up.sh.
package main

import (
	"os"
	"os/signal"
	"syscall"
)

func main() {
	sigs := make(chan os.Signal, 8)
	signal.Notify(sigs, syscall.SIGINT, syscall.SIGTERM, syscall.SIGCHLD)
	for s := range sigs {
		if s == syscall.SIGCHLD {
			for {
				var ws syscall.WaitStatus
				pid, err := syscall.Wait4(-1, &ws, syscall.WNOHANG, nil)
				if pid <= 0 || err != nil {
					break
				}
			}
			continue
		}
		os.Exit(0)
	}
}
