package main

import (
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

// gate: a pages gate file held (LOCK_EX) by the "agent" until release is called.
func gate(t *testing.T) (path string, answer func(string), release func()) {
	t.Helper()
	path = filepath.Join(t.TempDir(), "c1.pages")
	fd, err := syscall.Open(path, syscall.O_RDWR|syscall.O_CREAT|syscall.O_CLOEXEC, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	if err := syscall.Flock(fd, syscall.LOCK_EX); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = syscall.Close(fd) })
	answer = func(text string) {
		if err := os.WriteFile(path+".state", []byte(text), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	release = func() { _ = syscall.Flock(fd, syscall.LOCK_UN) }
	return path, answer, release
}

func envOf(m map[string]string) func(string) string { return func(k string) string { return m[k] } }

func TestWithoutAGateThereIsNothingToWaitFor(t *testing.T) {
	if status, why := waitForPages(envOf(map[string]string{}), time.Now); status != 0 {
		t.Fatalf("status %d (%s)", status, why)
	}
}

func TestTheGateWaitsForTheAgentsReadyAnswer(t *testing.T) {
	path, answer, release := gate(t)
	go func() {
		time.Sleep(200 * time.Millisecond)
		answer("ready\n")
		release()
	}()
	start := time.Now()
	status, why := waitForPages(envOf(map[string]string{pagesGateEnv: path}), time.Now)
	if status != 0 {
		t.Fatalf("status %d: %s", status, why)
	}
	if waited := time.Since(start); waited < 150*time.Millisecond {
		t.Fatalf("returned after %v, before the agent let go of the gate", waited)
	}
}

func TestAFailedStagingAbortsTheRestore(t *testing.T) {
	path, answer, release := gate(t)
	answer("failed\nDigestMismatch: chunk sha256:ab did not match")
	release()
	status, why := waitForPages(envOf(map[string]string{pagesGateEnv: path}), time.Now)
	if status == 0 || !strings.Contains(why, "DigestMismatch") {
		t.Fatalf("status %d, why %q", status, why)
	}
}

func TestAnAgentThatLetGoWithoutAnAnswerAbortsTheRestore(t *testing.T) {
	path, _, release := gate(t)
	release()
	status, why := waitForPages(envOf(map[string]string{pagesGateEnv: path}), time.Now)
	if status == 0 || !strings.Contains(why, "let go") {
		t.Fatalf("status %d, why %q", status, why)
	}
	missing := filepath.Join(t.TempDir(), "gone.pages") // the gate itself removed
	status, why = waitForPages(envOf(map[string]string{pagesGateEnv: missing}), time.Now)
	if status == 0 || !strings.Contains(why, "let go") {
		t.Fatalf("status %d, why %q", status, why)
	}
}

func TestTheDeadlineBoundsTheWait(t *testing.T) {
	path, _, _ := gate(t) // never answered
	deadline := time.Now().Add(150 * time.Millisecond)
	env := map[string]string{pagesGateEnv: path,
		pagesDeadline: strconv.FormatFloat(float64(deadline.UnixNano())/1e9, 'f', 3, 64)}
	start := time.Now()
	status, why := waitForPages(envOf(env), time.Now)
	if status == 0 || !strings.Contains(why, "deadline") {
		t.Fatalf("status %d, why %q", status, why)
	}
	if waited := time.Since(start); waited > 5*time.Second {
		t.Fatalf("waited %v past a deadline 150 ms away", waited)
	}
	env[pagesDeadline] = "soon"
	if status, why := waitForPages(envOf(env), time.Now); status == 0 || !strings.Contains(why, "not a time") {
		t.Fatalf("status %d, why %q", status, why)
	}
}
