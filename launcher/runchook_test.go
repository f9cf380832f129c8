package main

import (
	"os"
	"path/filepath"
	"reflect"
	"testing"
)

func TestRuncPassthrough(t *testing.T) {
	state := t.TempDir()
	if err := os.MkdirAll(filepath.Join(state, "restored"), 0o700); err != nil {
		t.Fatal(err)
	}
	marker := filepath.Join(state, "restored", "was-restored")
	mark := func() {
		if err := os.WriteFile(marker, []byte("x"), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	env := map[string]string{
		"KUBECTL_SNAPSHOT_STATE_DIR": state,
		"KUBECTL_SNAPSHOT_CRIU":      "/opt/ks/criu",
		"KUBECTL_SNAPSHOT_RUNC":      "/usr/bin/runc",
	}
	getenv := func(k string) string { return env[k] }
	g := []string{"--root", "/run/runc/k8s.io", "--log", "/x/log.json", "--log-format", "json"}
	cases := []struct {
		name string
		args []string
		want []string // nil: the hook must see the call
	}{
		{"create goes to the hook", append(g, "create", "--bundle", "/b", "c1"), nil},
		{"start with an id the hook must refuse", append(g, "start", "../x"), nil},
		{"start without an id", append(g, "start"), nil},
		{"no subcommand", []string{"--version"}, nil},
		{"start of any other container", append(g, "start", "c1"),
			append([]string{"--criu", "/opt/ks/criu"}, append(g, "start", "c1")...)},
		{"delete --force", append(g, "delete", "--force", "c1"),
			append([]string{"--criu", "/opt/ks/criu"}, append(g, "delete", "--force", "c1")...)},
		{"state", append(g, "state", "c1"), append([]string{"--criu", "/opt/ks/criu"}, append(g, "state", "c1")...)},
		{"a caller's --criu is replaced", []string{"--criu", "/usr/sbin/criu", "--criu=/bin/x", "--root", "/r", "kill", "c1", "9"},
			[]string{"--criu", "/opt/ks/criu", "--root", "/r", "kill", "c1", "9"}},
		{"an option value that looks like a command", []string{"--log", "create", "state", "c1"},
			[]string{"--criu", "/opt/ks/criu", "--log", "create", "state", "c1"}},
	}
	for _, tc := range cases {
		runc, got, ok := runcPassthrough(tc.args, getenv)
		if tc.want == nil {
			if ok {
				t.Errorf("%s: passed through as %v, want the hook", tc.name, got)
			}
			continue
		}
		if !ok || runc != "/usr/bin/runc" || !reflect.DeepEqual(got, tc.want) {
			t.Errorf("%s: got %v %q %v, want /usr/bin/runc %v", tc.name, ok, runc, got, tc.want)
		}
	}
	// a restored container: its start is done (no runc), its marker used once; its delete goes to runc
	mark()
	if runc, got, ok := runcPassthrough(append(g, "start", "was-restored"), getenv); !ok || runc != "" || got != nil {
		t.Errorf("start of a restored container: %v %q %v, want done here", ok, runc, got)
	}
	if _, err := os.Lstat(marker); !os.IsNotExist(err) {
		t.Errorf("the marker is still there after the start: %v", err)
	}
	if runc, _, ok := runcPassthrough(append(g, "start", "was-restored"), getenv); !ok || runc != "/usr/bin/runc" {
		t.Errorf("a second start (re-created container) must go to runc: %v %q", ok, runc)
	}
	mark()
	if runc, got, ok := runcPassthrough(append(g, "delete", "was-restored"), getenv); !ok || runc != "/usr/bin/runc" || got[len(got)-1] != "was-restored" {
		t.Errorf("delete of a restored container: %v %q %v", ok, runc, got)
	}
	if _, err := os.Lstat(marker); !os.IsNotExist(err) {
		t.Errorf("the marker is still there after the delete: %v", err)
	}
	delete(env, "KUBECTL_SNAPSHOT_CRIU")
	if _, got, ok := runcPassthrough([]string{"--criu", "/c", "state", "c1"}, getenv); !ok || !reflect.DeepEqual(got, []string{"--criu", "/c", "state", "c1"}) {
		t.Errorf("without an installed CRIU the caller's options stay: %v %v", ok, got)
	}
}
