package main

import (
	"os"
	"path/filepath"
	"regexp"
	"strings"
)

// The runtime wrapper's pass-through, as shim/runtime_wrapper.py's run() does it, for the calls that need
// none of the hook's work. Anything this does not recognise goes to the hook (slower, never wrong).

// runc's global options that take a value (shim/runtime_wrapper.py _GLOBAL_WITH_VALUE).
var globalWithValue = map[string]bool{"--log": true, "--log-format": true, "--root": true, "--criu": true, "--rootless": true}

var runcCandidates = []string{"/usr/sbin/runc", "/usr/bin/runc", "/usr/local/sbin/runc", "/usr/local/bin/runc"}

// A container id the state dir may hold a marker for (shim/engine/staging.py _KEY_RE).
var keyRE = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$`)

const defaultStateDir = "/var/lib/kubectl-snapshot"

func lookup(env []string) func(string) string {
	return func(key string) string {
		v := ""
		for _, kv := range env { // the last one wins, as in the environment the hook would get
			if strings.HasPrefix(kv, key+"=") {
				v = kv[len(key)+1:]
			}
		}
		return v
	}
}

func isExecutable(path string) bool {
	st, err := os.Stat(path)
	return err == nil && st.Mode().IsRegular() && st.Mode().Perm()&0o111 != 0
}

// runcPassthrough returns runc and its arguments (global options first, --criu set to the installed
// CRIU) when the call is one the hook would only pass on, or runc "" when it is done (the start of a
// restored container); ok is false when the hook must see it.
func runcPassthrough(args []string, getenv func(string) string) (runc string, out []string, ok bool) {
	var global []string
	i := 0
	for i < len(args) && strings.HasPrefix(args[i], "-") {
		global = append(global, args[i])
		if globalWithValue[args[i]] && i+1 < len(args) {
			global = append(global, args[i+1])
			i++
		}
		i++
	}
	if i >= len(args) {
		return "", nil, false // no subcommand (--version, --help): rare, the hook handles it
	}
	command, rest := args[i], args[i+1:]
	switch command {
	case "create":
		return "", nil, false // may be a restore
	case "start", "delete":
		if len(rest) == 0 {
			return "", nil, false
		}
		id := rest[len(rest)-1]
		if !keyRE.MatchString(id) || id == "." || id == ".." {
			return "", nil, false // the hook says why
		}
		state := getenv("KUBECTL_SNAPSHOT_STATE_DIR")
		if state == "" {
			state = defaultStateDir
		}
		marker := filepath.Join(state, "restored", id)
		if _, err := os.Lstat(marker); !os.IsNotExist(err) {
			// a restored container: its process already runs, so its start is done here (the marker
			// is used once: a later re-create starts afresh); anything unexpected goes to the hook
			if err != nil || os.Remove(marker) != nil {
				return "", nil, false
			}
			if command == "start" {
				return "", nil, true
			}
		}
	}
	runc = getenv("KUBECTL_SNAPSHOT_RUNC")
	if runc == "" {
		for _, c := range runcCandidates {
			if isExecutable(c) {
				runc = c
				break
			}
		}
	}
	if runc == "" {
		return "", nil, false // the hook reports it
	}
	if criu := getenv("KUBECTL_SNAPSHOT_CRIU"); criu != "" {
		kept := []string{"--criu", criu}
		for j := 0; j < len(global); j++ {
			switch {
			case global[j] == "--criu":
				j++ // and its value
			case strings.HasPrefix(global[j], "--criu="):
			default:
				kept = append(kept, global[j])
			}
		}
		global = kept
	}
	return runc, append(global, args[i:]...), true
}
