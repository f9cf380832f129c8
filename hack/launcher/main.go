// Command launcher starts a program of the kubectl-snapshot node bundle without anything of the host's
// userland: no shell, no interpreter, no library path. It is a static binary (CGO_ENABLED=0), so the
// kernel runs it directly, wherever the host has put it.
//
// It reads <its own path>.launch, a JSON object written by `kubectl-snapshot-agent install-node`:
//
//	{"argv": ["/opt/.../lib/ld-linux-x86-64.so.2", "--library-path", "/opt/.../lib", ..., "/opt/.../libexec/criu"],
//	 "env": {"KEY": "VALUE"}, "log": "/opt/.../criu.launches"}
//
// and replaces itself (execve) with argv followed by its own arguments, in its own environment plus
// "env". With "log" it first appends one JSON line (time, pid, its arguments and the command line of
// its parent) to that file: the record of which CRIU a runc really ran (the file is cut to its newest
// half beyond 1 MiB).
package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"os"
	"strings"
	"syscall"
	"time"
)

type config struct {
	Argv []string          `json:"argv"`
	Env  map[string]string `json:"env"`
	Log  string            `json:"log"`
}

const maxLog = 1 << 20

func fail(format string, a ...any) {
	fmt.Fprintf(os.Stderr, "kubectl-snapshot launcher: "+format+"\n", a...)
	os.Exit(127)
}

func record(path string, args []string) {
	parent, _ := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", os.Getppid()))
	line, _ := json.Marshal(map[string]any{
		"time":   time.Now().UTC().Format(time.RFC3339Nano),
		"pid":    os.Getpid(),
		"args":   args,
		"parent": strings.Split(strings.TrimRight(string(parent), "\x00"), "\x00"),
	})
	if st, err := os.Stat(path); err == nil && st.Size() > maxLog {
		if old, err := os.ReadFile(path); err == nil {
			half := old[len(old)/2:]
			if i := bytes.IndexByte(half, '\n'); i >= 0 {
				_ = os.WriteFile(path+".tmp", half[i+1:], 0o644)
				_ = os.Rename(path+".tmp", path)
			}
		}
	}
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_APPEND|os.O_CREATE, 0o644)
	if err != nil {
		return // a record is evidence, never a reason to fail the runtime
	}
	_, _ = f.Write(append(line, '\n'))
	_ = f.Close()
}

func main() {
	self, err := os.Executable()
	if err != nil {
		fail("cannot find my own path: %v", err)
	}
	raw, err := os.ReadFile(self + ".launch")
	if err != nil {
		fail("%v (reinstall with kubectl-snapshot-agent install-node)", err)
	}
	var c config
	if err := json.Unmarshal(raw, &c); err != nil || len(c.Argv) == 0 {
		fail("%s.launch is not a launch configuration: %v", self, err)
	}
	env := make([]string, 0, len(os.Environ())+len(c.Env))
	for _, kv := range os.Environ() {
		if _, over := c.Env[strings.SplitN(kv, "=", 2)[0]]; !over {
			env = append(env, kv)
		}
	}
	for k, v := range c.Env {
		env = append(env, k+"="+v)
	}
	if c.Log != "" {
		record(c.Log, os.Args[1:])
	}
	argv := append(append([]string{}, c.Argv...), os.Args[1:]...)
	err = syscall.Exec(argv[0], argv, env)
	fail("exec %s: %v", argv[0], err)
}
