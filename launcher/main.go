// Command launcher starts a program of the kubectl-snapshot node bundle without anything of the host's
// userland: no shell, no interpreter, no library path. It is a static binary (CGO_ENABLED=0), so the
// kernel runs it directly, wherever the host has put it.
//
// It reads <its own path>.launch, a JSON object written by `kubectl-snapshot-agent install-node`:
//
//	{"argv": ["/opt/.../lib/ld-linux-x86-64.so.2", "--library-path", "/opt/.../lib", ..., "/opt/.../libexec/criu"],
//	 "env": {"KEY": "VALUE"}, "pathPrepend": ["/opt/.../bin"], "log": "/opt/.../criu.launches"}
//
// and replaces itself (execve) with argv followed by its own arguments, in its own environment plus
// "env", with the "pathPrepend" directories put in front of PATH (where CRIU finds the bundle's tar
// before anything of the host's). With "gzipFilter" (tar's launcher) it does tar's --gzip itself:
// GNU tar runs its compressor through /bin/sh, which a node may not have, so the launcher starts tar
// without --gzip and compresses (--create) or decompresses (--extract) the archive stream in-process,
// in the same format; CRIU's own tar calls for small tmpfs trees it does entirely (tmpfstar.go). With
// "log" it first appends one JSON line (time, pid, its arguments and the command line of its parent)
// to that file: the record of which CRIU a runc really ran (the file is cut to its newest half beyond
// 1 MiB).
//
// With "runcHook" (the runtime wrapper's launcher, whose argv is the hook's Python) it first looks at the
// runc command line containerd's shim gave it: every call the hook would only pass on to runc (state,
// kill, exec, start, delete) goes to runc here, with the installed CRIU, without starting Python; the
// start of a restored container (its marker under the state dir) succeeds here, as the hook's would;
// create, and anything unexpected, goes to the hook. See runcPassthrough. The hook learns the launcher's
// path (KUBECTL_SNAPSHOT_LAUNCHER), which it gives runc as its CRIU when it starts a restore before the
// page files are complete: run by runc as `swrk 3` with KUBECTL_SNAPSHOT_RELAY_CRIU set, the launcher
// starts that CRIU and relays runc's RPC socket to it, holding the restore at its pages gate
// (criurelay.go, pagesgate.go).
//
// With "agentClient" (the agent image's ks-agent, whose argv is the Python ks-agent) a `checkpoint` or
// `restore` the node's warm agent serves is sent to it from here and its answer printed, without
// starting Python; everything else goes to argv (agentclient.go).
package main

import (
	"bytes"
	"compress/gzip"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"runtime"
	"strings"
	"syscall"
	"time"
)

type config struct {
	Argv        []string           `json:"argv"`
	Env         map[string]string  `json:"env"`
	PathPrepend []string           `json:"pathPrepend"`
	GzipFilter  bool               `json:"gzipFilter"`
	RuncHook    bool               `json:"runcHook"`
	AgentClient *agentClientConfig `json:"agentClient"`
	Log         string             `json:"log"`
}

const (
	maxLog      = 1 << 20
	launcherEnv = "KUBECTL_SNAPSHOT_LAUNCHER"
)

// init locks the main goroutine to the process's first thread, the thread group's leader, so that
// every execve below comes from the leader. An execve from any other thread first kills the leader
// (de_thread): until that thread has taken the leader's pid, /proc/PID is a zombie with no descriptors
// and no exe. runc reads /proc/PID/fd/0-2 of the CRIU it has just started ("readlink /proc/PID/fd/0:
// no such file or directory"); with a Go launcher exec'ing from a non-leader thread that read failed
// now and then on a busy host, and the restore with it (launcher_test.go catches it within 400 starts).
func init() {
	runtime.LockOSThread()
}

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
	if isCriuRelay(os.Args[1:], os.Getenv) {
		runCriuRelay(os.Args[1:], os.Getenv) // runc's CRIU of an early restore (criurelay.go): no launch configuration
	}
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
	if len(c.PathPrepend) > 0 {
		path := strings.Join(c.PathPrepend, ":")
		found := false
		for i, kv := range env {
			if strings.HasPrefix(kv, "PATH=") {
				if rest := kv[len("PATH="):]; rest != "" {
					path += ":" + rest
				}
				env[i], found = "PATH="+path, true
			}
		}
		if !found {
			env = append(env, "PATH="+path)
		}
	}
	if c.Log != "" {
		record(c.Log, os.Args[1:])
	}
	if c.RuncHook {
		// the hook gives runc this launcher as its CRIU for an early restore (criurelay.go)
		env = append(withoutKey(env, launcherEnv), launcherEnv+"="+self)
		if runc, args, ok := runcPassthrough(os.Args[1:], lookup(env)); ok {
			if runc == "" {
				os.Exit(0) // the start of a restored container: it is running already
			}
			err = syscall.Exec(runc, append([]string{runc}, args...), env)
			fail("exec %s: %v", runc, err)
		}
	}
	if c.AgentClient != nil {
		env = agentClient(*c.AgentClient, os.Args[1:], env) // agentclient.go: returns unless it served the command
	}
	argv := append(append([]string{}, c.Argv...), os.Args[1:]...)
	if c.GzipFilter && hasGzip(os.Args[1:]) {
		if create, dir, ok := criuTarCall(os.Args[1:], os.Getenv); ok {
			os.Exit(runCriuTar(create, dir, argv, env)) // tmpfstar.go: CRIU's tmpfs trees without GNU tar
		}
		os.Exit(gzipFilter(argv, env, os.Stdin))
	}
	err = syscall.Exec(argv[0], argv, env)
	fail("exec %s: %v", argv[0], err)
}

func withoutKey(env []string, key string) []string {
	kept := env[:0:0]
	for _, kv := range env {
		if !strings.HasPrefix(kv, key+"=") {
			kept = append(kept, kv)
		}
	}
	return kept
}

func hasGzip(args []string) bool {
	for _, a := range args {
		if a == "--gzip" || a == "-z" {
			return true
		}
	}
	return false
}

// gzipFilter runs argv (tar) without --gzip, its archive stream going through gzip here (--extract:
// read from in); returns the exit status to exit with (tar's own).
func gzipFilter(argv []string, env []string, in io.Reader) int {
	create := false
	kept := make([]string, 0, len(argv))
	for _, a := range argv {
		switch a {
		case "--gzip", "-z":
			continue
		case "--create", "-c":
			create = true
		}
		kept = append(kept, a)
	}
	r, w, err := os.Pipe()
	if err != nil {
		fail("pipe: %v", err)
	}
	files := []uintptr{r.Fd(), 1, 2} // --extract: tar reads the decompressed stream
	if create {
		files = []uintptr{0, w.Fd(), 2} // --create: tar writes the stream we compress
	}
	pid, err := syscall.ForkExec(kept[0], kept, &syscall.ProcAttr{Env: env, Files: files})
	if err != nil {
		fail("exec %s: %v", kept[0], err)
	}
	var copyErr error
	if create {
		_ = w.Close()
		zw := gzip.NewWriter(os.Stdout)
		_, copyErr = io.Copy(zw, r)
		if err := zw.Close(); copyErr == nil {
			copyErr = err
		}
		_ = r.Close()
	} else {
		_ = r.Close()
		zr, err := gzip.NewReader(in)
		if err == nil {
			_, err = io.Copy(w, zr)
		}
		copyErr = err
		_ = w.Close()
	}
	var ws syscall.WaitStatus
	for {
		if _, err := syscall.Wait4(pid, &ws, 0, nil); err != syscall.EINTR {
			break
		}
	}
	status := ws.ExitStatus()
	if ws.Signaled() {
		status = 128 + int(ws.Signal())
	}
	if status == 0 && copyErr != nil {
		fmt.Fprintf(os.Stderr, "kubectl-snapshot launcher: gzip stream: %v\n", copyErr)
		return 2
	}
	return status
}
