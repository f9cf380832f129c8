package main

import (
	"bufio"
	"bytes"
	"encoding/json"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
)

// testClient is the "agentClient" part of what shim/service/localapi.client_launch() writes (tests/unit/test_localapi.py
// checks that these names are the Python client's).
var testClient = agentClientConfig{
	Version: 1, Commands: []string{"checkpoint", "restore"}, SocketEnv: "KUBECTL_SNAPSHOT_AGENT_SOCKET",
	SocketName: "agent.sock", StateDirEnv: "KUBECTL_SNAPSHOT_STATE_DIR", DefaultStateDir: "/var/lib/kubectl-snapshot",
	EnvPrefixes: []string{"KUBECTL_SNAPSHOT_", "CONTAINERD_"}, EnvNames: []string{"HOME", "PATH", "DOCKER_CONFIG"},
}

// fakeAgent listens at a socket in dir, reads one request per connection and answers with `lines`;
// the requests it read come out of the returned channel.
func fakeAgent(t *testing.T, dir string, lines ...string) (string, <-chan map[string]any) {
	t.Helper()
	path := filepath.Join(dir, "agent.sock")
	l, err := net.Listen("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	requests := make(chan map[string]any, 8)
	go func() {
		for {
			conn, err := l.Accept()
			if err != nil {
				return
			}
			line, _ := bufio.NewReader(conn).ReadBytes('\n')
			var req map[string]any
			_ = json.Unmarshal(line, &req)
			requests <- req
			for _, answer := range lines {
				_, _ = conn.Write([]byte(answer + "\n"))
			}
			conn.Close()
		}
	}()
	return path, requests
}

func TestWhereTheClientAsksTheAgent(t *testing.T) {
	dir := t.TempDir()
	sock, _ := fakeAgent(t, dir)
	env := func(kv ...string) func(string) (string, bool) { return lookupSet(kv) }
	cases := []struct {
		args []string
		env  func(string) (string, bool)
		want string
	}{
		{[]string{"checkpoint", "c1"}, env("KUBECTL_SNAPSHOT_AGENT_SOCKET=" + sock), sock},
		{[]string{"restore", "r"}, env("KUBECTL_SNAPSHOT_STATE_DIR=" + dir), sock}, // <state dir>/agent.sock
		{[]string{"checkpoint"}, env("KUBECTL_SNAPSHOT_STATE_DIR=" + dir + "/elsewhere"), ""},
		{[]string{"checkpoint", "c1"}, env("KUBECTL_SNAPSHOT_AGENT_SOCKET= None "), ""},
		{[]string{"checkpoint", "c1"}, env("KUBECTL_SNAPSHOT_AGENT_SOCKET=off"), ""},
		{[]string{"checkpoint", "c1"}, env("KUBECTL_SNAPSHOT_AGENT_SOCKET="), ""},
		{[]string{"checkpoint", "--help"}, env("KUBECTL_SNAPSHOT_AGENT_SOCKET=" + sock), ""},
		{[]string{"restore", "-h"}, env("KUBECTL_SNAPSHOT_AGENT_SOCKET=" + sock), ""},
		{[]string{"serve"}, env("KUBECTL_SNAPSHOT_AGENT_SOCKET=" + sock), ""},
		{nil, env("KUBECTL_SNAPSHOT_AGENT_SOCKET=" + sock), ""},
	}
	for _, c := range cases {
		if got := agentSocket(testClient, c.args, c.env); got != c.want {
			t.Errorf("agentSocket(%q) = %q, want %q", c.args, got, c.want)
		}
	}
}

func TestTheRequestCarriesWhatTheCommandsRead(t *testing.T) {
	sock, requests := fakeAgent(t, t.TempDir(), `{"phase":"queued"}`, `{"bytes":[1,2]}`,
		`{"result":{"reference":"r@sha256:1"},"output":"text","rendered":"r@sha256:1\n"}`)
	env := []string{"HOME=/root", "PATH=/a", "PATH=/b", "KUBECTL_SNAPSHOT_X=1", "CONTAINERD_ADDRESS=/c",
		"KUBECTL_SNAPSHOT_AGENT_SOCKET=" + sock, "SECRET=s", "HOMEX=no"}
	var out, errs bytes.Buffer
	outcome, code := serveByAgent(testClient, sock, []string{"checkpoint", "-o", "text", "c1"}, env, &out, &errs)
	if outcome != answered || code != 0 || out.String() != "r@sha256:1\n" || errs.Len() != 0 {
		t.Fatalf("got %v %d stdout %q stderr %q", outcome, code, out.String(), errs.String())
	}
	req := <-requests
	cwd, _ := os.Getwd()
	want := map[string]any{
		"v": 1.0, "command": "checkpoint", "argv": []any{"-o", "text", "c1"}, "cwd": cwd,
		"env": map[string]any{"HOME": "/root", "PATH": "/b", "KUBECTL_SNAPSHOT_X": "1", "CONTAINERD_ADDRESS": "/c"},
	}
	got, _ := json.Marshal(req)
	expected, _ := json.Marshal(want)
	if string(got) != string(expected) {
		t.Fatalf("request %s, want %s", got, expected)
	}
}

func TestTheAgentsAnswers(t *testing.T) {
	cases := []struct {
		name      string
		answers   []string
		outcome   agentOutcome
		code      int
		stdout    string
		stderrHas string
	}{
		{"an error with its status", []string{`{"error":"error: no such container\nhint: list them","exit":4}`},
			answered, 4, "", "error: no such container\nhint: list them\n"},
		{"an error without a usable status", []string{`{"error":"error: x","exit":300}`}, answered, 1, "", "error: x\n"},
		{"an error without text", []string{`{"exit":2}`}, answered, 2, "", "error: the node's agent gave no answer\n"},
		{"declined", []string{`{"declined":"another working directory"}`}, declined, 0, "", ""},
		{"no answer", []string{`{"phase":"upload"}`}, answered, 1, "",
			"did not finish the restore: it closed the connection without an answer\nhint: "},
		{"not an object", []string{`[1]`}, answered, 1, "", "did not finish the restore: an answer that is not a JSON object"},
		{"a format the agent could not apply", []string{`{"result":{},"render_error":"error: jsonpath template"}`},
			answered, 1, "", "error: jsonpath template\n"},
		{"an agent from before rendering", []string{`{"result":{"a":1}}`}, answered, 0, `{"a":1}` + "\n", "older"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			sock, _ := fakeAgent(t, t.TempDir(), c.answers...)
			var out, errs bytes.Buffer
			outcome, code := serveByAgent(testClient, sock, []string{"restore", "ref", "new"}, nil, &out, &errs)
			if outcome != c.outcome || code != c.code || out.String() != c.stdout || !strings.Contains(errs.String(), c.stderrHas) {
				t.Fatalf("got %v %d stdout %q stderr %q", outcome, code, out.String(), errs.String())
			}
		})
	}
}

// TestTheLauncherServesOrRunsThePythonClient runs the built launcher as the agent image's ks-agent,
// with a shell standing in for the Python program (it says it ran, and with which socket variable).
func TestTheLauncherServesOrRunsThePythonClient(t *testing.T) {
	dir := t.TempDir()
	c := testClient
	launcher := buildLauncher(t, filepath.Join(dir, "ks-agent"), config{
		Argv:        []string{"/bin/sh", "-c", `echo "python $KUBECTL_SNAPSHOT_AGENT_SOCKET $*"`, "ks-agent"},
		AgentClient: &c,
	})
	run := func(sock string, args ...string) (string, string, int) {
		cmd := exec.Command(launcher, args...)
		cmd.Env = append(os.Environ(), "KUBECTL_SNAPSHOT_AGENT_SOCKET="+sock)
		var out, errs bytes.Buffer
		cmd.Stdout, cmd.Stderr = &out, &errs // not a terminal: the launcher serves what it can
		err := cmd.Run()
		code := 0
		if exit, ok := err.(*exec.ExitError); ok {
			code = exit.ExitCode()
		} else if err != nil {
			t.Fatal(err)
		}
		return out.String(), errs.String(), code
	}
	served, _ := fakeAgent(t, filepath.Join(dir), `{"result":{},"rendered":"c1\trunning (pid 7)\n"}`)
	if out, errs, code := run(served, "restore", "ref", "c1"); out != "c1\trunning (pid 7)\n" || code != 0 {
		t.Errorf("served: %q %q %d", out, errs, code)
	}
	if out, _, _ := run(served, "serve", "--socket", served); out != "python "+served+" serve --socket "+served+"\n" {
		t.Errorf("serve went to %q", out)
	}
	refused := filepath.Join(dir, "refused")
	_ = os.Mkdir(refused, 0o700)
	declining, _ := fakeAgent(t, refused, `{"declined":"other values of PATH"}`)
	if out, _, _ := run(declining, "checkpoint", "c1"); out != "python none checkpoint c1\n" {
		t.Errorf("declined went to %q (want the Python program, standalone)", out)
	}
	gone := filepath.Join(dir, "gone.sock")
	if out, _, _ := run(gone, "checkpoint", "c1"); out != "python "+gone+" checkpoint c1\n" {
		t.Errorf("no agent went to %q", out)
	}
	failing, _ := fakeAgent(t, t.TempDir(), `{"error":"error: boom","exit":3}`)
	if out, errs, code := run(failing, "checkpoint", "c1"); out != "" || errs != "error: boom\n" || code != 3 {
		t.Errorf("error: %q %q %d", out, errs, code)
	}
}

func TestATerminalIsNoPipe(t *testing.T) {
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	defer w.Close()
	if isTerminal(int(w.Fd())) {
		t.Error("a pipe taken for a terminal")
	}
	if tty, err := os.OpenFile("/dev/ptmx", os.O_RDWR|syscall.O_NOCTTY, 0); err == nil {
		defer tty.Close()
		if !isTerminal(int(tty.Fd())) {
			t.Error("a pseudo-terminal not taken for a terminal")
		}
	}
}
