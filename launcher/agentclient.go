package main

// The `ks-agent checkpoint|restore` client of the node's warm agent (shim/service/localapi.py), done here so
// that a served command costs a static binary's start-up instead of an interpreter's (Python, its
// site and ~40 modules: 35-60 ms of every small pod's snapshot or restore on the project's machines,
// docs/performance.md). With "agentClient" in its launch configuration (the agent image's ks-agent,
// hack/agent_image.py) the launcher sends the request itself and prints the agent's answer, as
// rendered by the agent; everything else goes to argv (the Python ks-agent), which also takes:
//   - a terminal on stderr (its tqdm progress bar; served commands print no progress otherwise),
//   - no agent listening (the command runs standalone), -h/--help, other commands,
//   - a request the agent declines (then with the socket variable at "none": it runs standalone at
//     once instead of asking the agent a second time).
// What decides whether the agent may serve a request is the agent's, as for the Python client: it
// compares the request's environment and working directory with its own and checks the peer's uid.
// The names this client reads (the socket variable, the state dir, which variables go with the
// request) come from the launch configuration, which shim/service/localapi.py's client_launch() writes: one
// source for both clients.

import (
	"bufio"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"net"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"unsafe"
)

type agentClientConfig struct {
	Version         int      `json:"version"`
	Commands        []string `json:"commands"`
	SocketEnv       string   `json:"socketEnv"`
	SocketName      string   `json:"socketName"`
	StateDirEnv     string   `json:"stateDirEnv"`
	DefaultStateDir string   `json:"defaultStateDir"`
	EnvPrefixes     []string `json:"envPrefixes"`
	EnvNames        []string `json:"envNames"`
}

type agentOutcome int

const (
	notServed agentOutcome = iota // nothing was sent: argv runs the command (and may ask the agent itself)
	declined                      // the agent will not serve it: argv runs it standalone
	answered                      // the agent's answer is printed; exit with the returned status
)

const interruptedMsg = "error: interrupted; if the node's agent had the request, it carries it through " +
	"(its log says how it ended)"

// agentSocket is where the node's agent listens for this command line, or "" when the client should not
// ask it (another command, help, the socket variable set to none/off/empty, no socket there).
func agentSocket(c agentClientConfig, args []string, getenv func(string) (string, bool)) string {
	if len(args) == 0 || !contains(c.Commands, args[0]) {
		return ""
	}
	for _, a := range args {
		if a == "-h" || a == "--help" {
			return ""
		}
	}
	path, set := getenv(c.SocketEnv)
	if set {
		switch strings.ToLower(strings.TrimSpace(path)) {
		case "", "none", "off":
			return ""
		}
	} else {
		state, _ := getenv(c.StateDirEnv)
		if state == "" {
			state = c.DefaultStateDir
		}
		path = filepath.Join(state, c.SocketName)
	}
	if _, err := os.Stat(path); err != nil {
		return ""
	}
	return path
}

// relevantEnv is what the request carries of env: what the commands read (shim/service/localapi.relevant_env).
func relevantEnv(c agentClientConfig, env []string) map[string]string {
	out := map[string]string{}
	for _, kv := range env {
		k, v, ok := strings.Cut(kv, "=")
		if !ok || k == c.SocketEnv {
			continue
		}
		keep := contains(c.EnvNames, k)
		for _, p := range c.EnvPrefixes {
			keep = keep || strings.HasPrefix(k, p)
		}
		if keep {
			out[k] = v // the last one wins, as in Python's os.environ
		}
	}
	return out
}

// serveByAgent sends args to the agent at path and writes its answer to stdout/stderr.
func serveByAgent(c agentClientConfig, path string, args []string, env []string, stdout, stderr io.Writer) (agentOutcome, int) {
	conn, err := net.Dial("unix", path)
	if err != nil {
		return notServed, 0 // no agent (ENOENT), a dead one's socket (ECONNREFUSED), not ours (EACCES)
	}
	defer conn.Close()
	cwd, err := syscall.Getwd() // the kernel's answer, as Python's os.getcwd() (not $PWD)
	if err != nil {
		return notServed, 0
	}
	request, err := json.Marshal(map[string]any{
		"v": c.Version, "command": args[0], "argv": args[1:], "cwd": cwd, "env": relevantEnv(c, env),
	})
	if err != nil {
		return notServed, 0
	}
	fail := func(why string) (agentOutcome, int) {
		// the request may have been acted on: never run it a second time behind the user's back
		fmt.Fprintf(stderr, "error: the node's agent (%s) did not finish the %s: %s\nhint: check the agent's log "+
			"and the containers' state; %s=none runs the command without the agent\n", path, args[0], why, c.SocketEnv)
		return answered, 1
	}
	if _, err := conn.Write(append(request, '\n')); err != nil {
		return fail(err.Error())
	}
	lines := bufio.NewReader(conn)
	for {
		line, err := lines.ReadBytes('\n')
		if len(line) == 0 && err != nil {
			if errors.Is(err, io.EOF) {
				return fail("it closed the connection without an answer")
			}
			return fail(err.Error())
		}
		var msg map[string]json.RawMessage
		if json.Unmarshal(line, &msg) != nil || msg == nil {
			return fail("an answer that is not a JSON object")
		}
		if _, ok := msg["phase"]; ok {
			continue // progress: shown only on a terminal, where the Python client runs
		}
		if _, ok := msg["bytes"]; ok {
			continue
		}
		return finalAnswer(msg, stdout, stderr)
	}
}

func finalAnswer(msg map[string]json.RawMessage, stdout, stderr io.Writer) (agentOutcome, int) {
	if _, ok := msg["declined"]; ok {
		return declined, 0
	}
	if result, ok := msg["result"]; ok {
		var text string
		if json.Unmarshal(msg["rendered"], &text) != nil {
			var problem string
			if json.Unmarshal(msg["render_error"], &problem) == nil {
				fmt.Fprintln(stderr, problem)
				return answered, 1
			}
			// an agent from before answers were rendered for the client: its answer as JSON
			fmt.Fprintln(stderr, "warning: the node's agent is older than this ks-agent; its answer as JSON")
			text = string(result) + "\n"
		}
		if _, err := io.WriteString(stdout, text); err != nil {
			return answered, 120 // CPython's status when stdout cannot be written
		}
		return answered, 0
	}
	var text string
	if json.Unmarshal(msg["error"], &text) != nil || text == "" {
		text = "error: the node's agent gave no answer"
	}
	fmt.Fprintln(stderr, text)
	var code float64
	if json.Unmarshal(msg["exit"], &code) == nil && code > 0 && code < 256 && code == math.Trunc(code) {
		return answered, int(code)
	}
	return answered, 1
}

// isTerminal: fd is a terminal (TCGETS succeeds), as Python's isatty().
func isTerminal(fd int) bool {
	var t syscall.Termios
	_, _, errno := syscall.Syscall(syscall.SYS_IOCTL, uintptr(fd), syscall.TCGETS, uintptr(unsafe.Pointer(&t)))
	return errno == 0
}

// agentClient runs a served command to its end (exits), or returns the environment argv should run
// with: unchanged, or with the socket variable at "none" after the agent declined.
func agentClient(c agentClientConfig, args []string, env []string) []string {
	if isTerminal(2) {
		return env
	}
	path := agentSocket(c, args, lookupSet(env))
	if path == "" {
		return env
	}
	interrupts := make(chan os.Signal, 1)
	signal.Notify(interrupts, os.Interrupt)
	go func() {
		<-interrupts
		fmt.Fprintln(os.Stderr, interruptedMsg)
		os.Exit(130)
	}()
	outcome, code := serveByAgent(c, path, args, env, os.Stdout, os.Stderr)
	signal.Reset(os.Interrupt)
	switch outcome {
	case answered:
		os.Exit(code)
	case declined:
		return append(withoutKey(env, c.SocketEnv), c.SocketEnv+"=none")
	}
	return env
}

// lookupSet reads env as os.LookupEnv would (the last one wins).
func lookupSet(env []string) func(string) (string, bool) {
	return func(key string) (string, bool) {
		v, set := "", false
		for _, kv := range env {
			if k, value, ok := strings.Cut(kv, "="); ok && k == key {
				v, set = value, true
			}
		}
		return v, set
	}
}

func contains(list []string, s string) bool {
	for _, x := range list {
		if x == s {
			return true
		}
	}
	return false
}
