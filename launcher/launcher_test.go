package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"syscall"
	"testing"
	"time"
)

// TestExecKeepsTheProcessVisible starts the built launcher as runc starts CRIU (and reads
// /proc/PID/fd/0 right after, as runc's getPipeFds does) many times, polling the process until it has
// become its target. An execve from a thread other than the leader shows /proc/PID as a zombie without
// descriptors for a moment (de_thread); init's runtime.LockOSThread keeps the exec on the leader.
func TestExecKeepsTheProcessVisible(t *testing.T) {
	if _, err := os.Stat("/proc/self/fd/0"); err != nil {
		t.Skip("no /proc")
	}
	target, err := filepath.EvalSymlinks("/bin/sleep")
	if err != nil {
		t.Skip("no /bin/sleep")
	}
	dir := t.TempDir()
	launcher := buildLauncher(t, filepath.Join(dir, "criu"), config{Argv: []string{target}, Log: filepath.Join(dir, "launches")})
	devnull, err := os.Open(os.DevNull)
	if err != nil {
		t.Fatal(err)
	}
	defer devnull.Close()
	const runs = 400
	for i := 0; i < runs; i++ {
		if err := startAndPoll(launcher, devnull, target); err != nil {
			t.Fatalf("run %d of %d: %v", i+1, runs, err)
		}
	}
}

// buildLauncher builds the launcher at path with its launch configuration beside it.
func buildLauncher(t *testing.T, path string, c config) string {
	t.Helper()
	build := exec.Command("go", "build", "-o", path, ".")
	build.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	conf, _ := json.Marshal(c)
	if err := os.WriteFile(path+".launch", conf, 0o644); err != nil {
		t.Fatal(err)
	}
	return path
}

// startAndPoll starts the launcher and reads /proc/PID/fd/0 until the process has exec'd `target`.
func startAndPoll(launcher string, devnull *os.File, target string) error {
	p, err := os.StartProcess(launcher, []string{launcher, "5"}, &os.ProcAttr{Files: []*os.File{devnull, devnull, devnull}})
	if err != nil {
		return err
	}
	defer func() {
		_ = p.Kill()
		_, _ = p.Wait()
	}()
	proc := "/proc/" + strconv.Itoa(p.Pid)
	deadline := time.Now().Add(5 * time.Second)
	for {
		if _, err := os.Readlink(proc + "/fd/0"); err != nil {
			if errors.Is(err, syscall.ENOENT) {
				return fmt.Errorf("%w: the launcher's pid showed no descriptors while it exec'd", err)
			}
			return err
		}
		if exe, err := os.Readlink(proc + "/exe"); err == nil && exe == target {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("the launcher did not exec %s", target)
		}
	}
}
