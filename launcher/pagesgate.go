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

// The pages gate (shim/engine/staging.py, "two phases"): the agent holds a lock on the gate file
// (KUBECTL_SNAPSHOT_PAGES_GATE) while the page files of a restore download, and lets go once it has
// written its answer beside it (<gate>.state: "ready", or "failed" and why). The relay between runc and
// CRIU (criurelay.go) waits here before CRIU may read any page file.

const (
	defaultWait     = 60 * time.Second
	readyAnswer     = "ready"
	maxAnswerLength = 64 << 10
)

// waitForPages waits until the agent lets go of the gate, or the deadline (KUBECTL_SNAPSHOT_PAGES_DEADLINE,
// POSIX seconds); it returns 0 only if the agent answered that the page files are complete, else the
// status to fail with and why. Without a gate there is nothing to wait for.
func waitForPages(getenv func(string) string, now func() time.Time) (int, string) {
	gate := getenv(pagesGateEnv)
	if gate == "" {
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
