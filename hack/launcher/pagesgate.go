package main

import (
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// The pages gate, as a CRIU action script (shim/engine/staging.py, "two phases").
//
// A restore whose CRIU images are staged but whose page files are still downloading runs `runc restore`
// at once: the runtime hook hands CRIU (through runc's environment: CRIU_CONFIG_FILE) a configuration
// whose only line is `action-script <this launcher>`. CRIU runs its action scripts with no arguments and
// CRTOOLS_SCRIPT_ACTION set; at "post-setup-namespaces" (the container's namespaces and mounts are
// restored, no page file is open yet) this waits until the agent lets go of the gate's pages lock
// (KUBECTL_SNAPSHOT_PAGES_GATE) and exits 0 only if the agent answered that the page files are
// complete. Any other answer, no answer (the agent died), or the deadline
// (KUBECTL_SNAPSHOT_PAGES_DEADLINE, POSIX seconds) exits non-zero: CRIU then aborts the restore and
// kills what it restored so far, so the container is never started on half its memory. Every other
// action returns at once.

const (
	actionEnv       = "CRTOOLS_SCRIPT_ACTION"
	pagesGateEnv    = "KUBECTL_SNAPSHOT_PAGES_GATE"
	pagesDeadline   = "KUBECTL_SNAPSHOT_PAGES_DEADLINE"
	waitAction      = "post-setup-namespaces"
	defaultWait     = 60 * time.Second
	readyAnswer     = "ready"
	maxAnswerLength = 64 << 10
)

// isCriuAction: CRIU runs action scripts without arguments, in its environment plus CRTOOLS_SCRIPT_ACTION;
// every other role of the launcher (the runtime hook, CRIU's and tar's launchers) has arguments.
func isCriuAction(args []string, getenv func(string) string) bool {
	return len(args) == 0 && getenv(actionEnv) != ""
}

// criuAction returns the exit status for one CRIU action, and why it is not 0.
func criuAction(getenv func(string) string, now func() time.Time) (int, string) {
	gate := getenv(pagesGateEnv)
	if getenv(actionEnv) != waitAction || gate == "" {
		return 0, ""
	}
	deadline := now().Add(defaultWait)
	if raw := getenv(pagesDeadline); raw != "" {
		secs, err := strconv.ParseFloat(raw, 64)
		if err != nil {
			return 1, fmt.Sprintf("%s=%q is not a time", pagesDeadline, raw)
		}
		deadline = time.Unix(0, int64(secs*1e9))
	}
	fd, err := syscall.Open(gate, syscall.O_RDONLY|syscall.O_CLOEXEC, 0)
	if err != nil {
		return 1, fmt.Sprintf("the restore's pages gate %s: %v (the agent let go before the page files were complete)", gate, err)
	}
	locked := make(chan error, 1)
	go func() { locked <- syscall.Flock(fd, syscall.LOCK_SH) }() // held by the agent until it answers
	wait := deadline.Sub(now())
	if wait < 0 {
		wait = 0
	}
	select {
	case err := <-locked:
		_ = syscall.Close(fd)
		if err != nil {
			return 1, fmt.Sprintf("waiting for the page files: %v", err)
		}
	case <-time.After(wait):
		return 1, fmt.Sprintf("the page files were not complete by the restore's deadline (%s)", deadline.UTC().Format(time.RFC3339))
	}
	state, message, err := readAnswer(gate + ".state")
	if err != nil {
		return 1, fmt.Sprintf("the agent staging this restore let go before the page files were complete (%v)", err)
	}
	if state != readyAnswer {
		if message == "" {
			message = "no reason"
		}
		return 1, "the agent's staging of this restore failed: " + message
	}
	return 0, ""
}

func readAnswer(path string) (string, string, error) {
	f, err := os.Open(path)
	if err != nil {
		return "", "", err
	}
	defer f.Close()
	raw, err := io.ReadAll(io.LimitReader(f, maxAnswerLength))
	if err != nil {
		return "", "", err
	}
	state, message, _ := strings.Cut(string(raw), "\n")
	return state, message, nil
}

func runCriuAction() {
	status, why := criuAction(os.Getenv, time.Now)
	if status != 0 {
		fmt.Fprintf(os.Stderr, "kubectl-snapshot: refusing to restore: %s\n", why)
	}
	os.Exit(status)
}
