package main

import (
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
)

// The relay between runc and CRIU, run for real: the built launcher started as runc starts its CRIU
// (`swrk 4`, fd 3 a file runc passes on, fd 4 a SOCK_SEQPACKET socket: runc's order for a restore), this test playing runc on the
// other end, and this test binary playing CRIU (fakeCriu: it answers a version request, or notifies
// the steps of a restore and aborts it when a step fails, as CRIU's send_criu_rpc_script does).

const (
	fakeCriuEnv    = "KS_TEST_FAKE_CRIU"
	fakeStepsEnv   = "KS_TEST_FAKE_CRIU_STEPS"
	fakeReportEnv  = "KS_TEST_FAKE_CRIU_REPORT"
	reqVersion     = 10
	stepWithRights = "orphan-pts-master" // CRIU passes a descriptor with this one
	fakeRPC        = 4
)

func TestMain(m *testing.M) {
	if os.Getenv(fakeCriuEnv) != "" {
		os.Exit(fakeCriu())
	}
	os.Exit(m.Run())
}

func varintField(num, v uint64) []byte { return appendVarint(appendVarint(nil, num<<3), v) }

func bytesField(num uint64, b []byte) []byte {
	return append(appendVarint(appendVarint(nil, num<<3|2), uint64(len(b))), b...)
}

func cat(parts ...[]byte) []byte {
	var out []byte
	for _, p := range parts {
		out = append(out, p...)
	}
	return out
}

// criuReport is what the fake CRIU saw.
type criuReport struct {
	Pid      int      `json:"pid"`
	Request  int      `json:"request"`
	Fd3      string   `json:"fd3"`
	Images   string   `json:"images"` // images_dir_fd, opened as CRIU does: /proc/<its RPC peer>/fd/N
	Failed   string   `json:"failed"` // the step whose notification was answered "failed"
	Started  float64  `json:"started"`
	Answered []string `json:"answered"`
}

func fakeCriu() int {
	rep := criuReport{Pid: os.Getpid(), Started: float64(time.Now().UnixNano()) / 1e9}
	rep.Fd3, _ = os.Readlink("/proc/self/fd/3")
	defer func() {
		b, _ := json.Marshal(rep)
		_ = os.WriteFile(os.Getenv(fakeReportEnv), b, 0o644)
	}()
	buf := make([]byte, 1<<16)
	n, _, err := recvMsg(fakeRPC, buf, nil, 0)
	if err != nil || n == 0 {
		return 2
	}
	fs, _ := fields(buf[:n])
	t, _ := last(fs, 1)
	rep.Request = int(t.value)
	if opts, ok := last(fs, 2); ok {
		ofs, _ := fields(opts.bytes)
		if dir, ok := last(ofs, 1); ok {
			peer, _ := syscall.GetsockoptUcred(fakeRPC, syscall.SOL_SOCKET, syscall.SO_PEERCRED)
			rep.Images, _ = os.Readlink(fmt.Sprintf("/proc/%d/fd/%d", peer.Pid, dir.value))
		}
	}
	if t.value == reqVersion {
		_ = sendMsg(fakeRPC, cat(varintField(1, reqVersion), varintField(2, 1)), nil)
		return 0
	}
	for _, step := range strings.Split(os.Getenv(fakeStepsEnv), ",") {
		var rights []byte
		if step == stepWithRights {
			r, w, _ := os.Pipe()
			_, _ = w.WriteString("pts")
			_ = w.Close()
			rights = syscall.UnixRights(int(r.Fd()))
		}
		note := cat(varintField(1, reqNotify), varintField(2, 1), bytesField(5, bytesField(1, []byte(step))))
		if err := sendMsg(fakeRPC, note, rights); err != nil {
			return 2
		}
		n, _, err := recvMsg(fakeRPC, buf, nil, 0)
		if err != nil || n == 0 {
			return 2
		}
		afs, _ := fields(buf[:n])
		typ, _ := last(afs, 1)
		ok, _ := last(afs, 3)
		if typ.value != reqNotify || ok.value != 1 {
			rep.Failed = step // CRIU: "RPC client reported script error", the restore aborted
			_ = sendMsg(fakeRPC, cat(varintField(1, reqRestore), varintField(2, 0)), nil)
			return 1
		}
		rep.Answered = append(rep.Answered, step)
	}
	_ = sendMsg(fakeRPC, cat(varintField(1, reqRestore), varintField(2, 1)), nil)
	return 0
}

type runcSide struct {
	notes    []string  // the steps runc was told of
	times    []float64 // when
	result   []field   // CRIU's answer to the request
	rights   string    // what came through a descriptor passed with a notification
	status   int       // the launcher's exit status
	launcher int       // its pid
	report   criuReport
}

// asRunc starts the launcher as runc starts CRIU, sends `request` and answers every notification.
func asRunc(t *testing.T, launcher string, request []byte, steps []string, env map[string]string) runcSide {
	t.Helper()
	pair, err := syscall.Socketpair(syscall.AF_UNIX, syscall.SOCK_SEQPACKET|syscall.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	ours, theirs := os.NewFile(uintptr(pair[0]), "runc"), os.NewFile(uintptr(pair[1]), "criu")
	defer ours.Close()
	passed, err := os.Open(os.DevNull)
	if err != nil {
		t.Fatal(err)
	}
	defer passed.Close()
	self, _ := os.Executable()
	report := filepath.Join(t.TempDir(), "report.json")
	cmd := exec.Command(launcher, "swrk", "4")
	cmd.Env = append(os.Environ(), relayCriuEnv+"="+self, fakeCriuEnv+"=1", fakeReportEnv+"="+report,
		fakeStepsEnv+"="+strings.Join(steps, ","))
	for k, v := range env {
		cmd.Env = append(cmd.Env, k+"="+v)
	}
	cmd.ExtraFiles = []*os.File{passed, theirs}
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	theirs.Close()
	out := runcSide{launcher: cmd.Process.Pid}
	fd := int(ours.Fd())
	if err := sendMsg(fd, request, nil); err != nil {
		t.Fatal(err)
	}
	buf, oob := make([]byte, 1<<16), make([]byte, 1024)
	for {
		n, oobn, err := recvMsg(fd, buf, oob, 0)
		if err != nil || n == 0 {
			break
		}
		if step, ok := notification(buf[:n]); ok {
			out.notes = append(out.notes, step)
			out.times = append(out.times, float64(time.Now().UnixNano())/1e9)
			if msgs, err := syscall.ParseSocketControlMessage(oob[:oobn]); err == nil && len(msgs) == 1 {
				if fds, err := syscall.ParseUnixRights(&msgs[0]); err == nil && len(fds) == 1 {
					got := make([]byte, 16)
					k, _ := syscall.Read(fds[0], got)
					out.rights = string(got[:max(k, 0)])
					_ = syscall.Close(fds[0])
				}
			}
			if err := sendMsg(fd, cat(varintField(1, reqNotify), varintField(3, 1)), nil); err != nil {
				t.Fatal(err)
			}
			continue
		}
		out.result, _ = fields(buf[:n])
		break
	}
	_ = cmd.Wait()
	out.status = cmd.ProcessState.ExitCode()
	if raw, err := os.ReadFile(report); err == nil {
		if err := json.Unmarshal(raw, &out.report); err != nil {
			t.Fatal(err)
		}
	} else {
		out.report.Pid = -1 // CRIU never ran
	}
	return out
}

// imagesDir: a directory this process ("runc") holds open, as runc holds the images directory.
var imagesDir = func() *os.File {
	d, err := os.Open(os.TempDir())
	if err != nil {
		panic(err)
	}
	return d
}()

func restoreReq(notify bool) []byte {
	opts := cat(varintField(1, uint64(imagesDir.Fd())), varintField(9, 4), bytesField(10, []byte("restore.log")))
	if notify {
		opts = append(opts, varintField(12, 1)...)
	}
	return cat(varintField(1, reqRestore), bytesField(2, opts))
}

var restoreSteps = []string{"pre-restore", "setup-namespaces", "post-setup-namespaces", "post-restore",
	"network-unlock", "pre-resume", "post-resume"}

func relayLauncher(t *testing.T) string {
	t.Helper()
	return buildLauncher(t, filepath.Join(t.TempDir(), "kubectl-snapshot-runc"), config{Argv: []string{"/bin/false"}})
}

func success(fs []field) bool {
	typ, _ := last(fs, 1)
	ok, _ := last(fs, 2)
	return typ.value == reqRestore && ok.value == 1
}

// opensAfter answers "ready" on the gate and lets go of it after d; the function it returns waits for
// that and says when it happened (POSIX seconds).
func opensAfter(d time.Duration, answer func(string), release func()) func() float64 {
	at := make(chan float64, 1)
	go func() {
		time.Sleep(d)
		answer("ready\n")
		at <- float64(time.Now().UnixNano()) / 1e9
		release()
	}()
	return func() float64 {
		v := <-at
		at <- v
		return v
	}
}

func TestTheRelayHoldsTheRestoreAtTheGate(t *testing.T) {
	launcher := relayLauncher(t)
	path, answer, release := gate(t)
	opened := opensAfter(300*time.Millisecond, answer, release)
	steps := append([]string{stepWithRights}, restoreSteps...)
	got := asRunc(t, launcher, restoreReq(true), steps, map[string]string{pagesGateEnv: path})
	if got.status != 0 || !success(got.result) {
		t.Fatalf("exit %d, answer %v", got.status, got.result)
	}
	if strings.Join(got.notes, ",") != strings.Join(steps, ",") || strings.Join(got.report.Answered, ",") != strings.Join(steps, ",") {
		t.Fatalf("runc was told of %v, CRIU's steps answered %v; want %v", got.notes, got.report.Answered, steps)
	}
	released := opened()
	for i, step := range got.notes {
		before := step == stepWithRights || step == "pre-restore" || step == "setup-namespaces"
		if before != (got.times[i] < released) {
			t.Fatalf("%s reached runc at %.3f, the gate opened at %.3f", step, got.times[i], released)
		}
	}
	if got.rights != "pts" {
		t.Fatalf("the descriptor CRIU passed read %q", got.rights)
	}
	if got.report.Pid == got.launcher || got.report.Request != reqRestore || got.report.Fd3 != os.DevNull ||
		got.report.Images != imagesDir.Name() {
		t.Fatalf("CRIU: %+v (launcher pid %d): want a child of the relay, given the request, runc's fd 3 and "+
			"the images directory %s through its RPC peer", got.report, got.launcher, imagesDir.Name())
	}
}

func TestAFailedStagingFailsTheStepAndCriuAborts(t *testing.T) {
	launcher := relayLauncher(t)
	path, answer, release := gate(t)
	answer("failed\nDigestMismatch: chunk sha256:ab did not match")
	release()
	got := asRunc(t, launcher, restoreReq(true), restoreSteps, map[string]string{pagesGateEnv: path})
	if got.status == 0 || success(got.result) || got.report.Failed != waitAction {
		t.Fatalf("exit %d, answer %v, CRIU %+v: want the restore aborted at %s", got.status, got.result, got.report, waitAction)
	}
	if strings.Join(got.notes, ",") != "pre-restore,setup-namespaces" {
		t.Fatalf("runc was told of %v", got.notes)
	}
}

func TestAStepAfterTheMemoryBeforeTheGateIsRefused(t *testing.T) {
	launcher := relayLauncher(t)
	path, answer, release := gate(t)
	answer("ready\n")
	release()
	for _, step := range []string{"post-restore", "network-unlock", "pre-resume", "post-resume"} {
		got := asRunc(t, launcher, restoreReq(true), []string{"pre-restore", step}, map[string]string{pagesGateEnv: path})
		if got.status == 0 || success(got.result) || got.report.Failed != step {
			t.Fatalf("%s before the gate: exit %d, answer %v, CRIU %+v", step, got.status, got.result, got.report)
		}
	}
}

func TestOnlyARestoreIsRelayed(t *testing.T) {
	launcher := relayLauncher(t)
	path, _, _ := gate(t) // held and never answered: a version request must not wait on it
	got := asRunc(t, launcher, varintField(1, reqVersion), nil, map[string]string{pagesGateEnv: path})
	typ, _ := last(got.result, 1)
	if got.status != 0 || typ.value != reqVersion || got.report.Pid != got.launcher {
		t.Fatalf("exit %d, answer %v, CRIU pid %d (launcher %d): want CRIU exec'd in its place", got.status,
			got.result, got.report.Pid, got.launcher)
	}
}

func TestARestoreWithoutStepsWaitsBeforeCriuStarts(t *testing.T) {
	launcher := relayLauncher(t)
	path, answer, release := gate(t)
	opened := opensAfter(300*time.Millisecond, answer, release)
	got := asRunc(t, launcher, restoreReq(false), nil, map[string]string{pagesGateEnv: path})
	released := opened()
	if got.status != 0 || !success(got.result) || got.report.Pid != got.launcher || got.report.Started < released {
		t.Fatalf("exit %d, answer %v, CRIU %+v, gate opened at %.3f", got.status, got.result, got.report, released)
	}

	path, answer, release = gate(t)
	answer("failed\nthe registry went away")
	release()
	got = asRunc(t, launcher, restoreReq(false), nil, map[string]string{pagesGateEnv: path})
	msg, _ := last(got.result, 9)
	if got.status == 0 || success(got.result) || got.report.Pid != -1 || !strings.Contains(string(msg.bytes), "registry went away") {
		t.Fatalf("exit %d, answer %v (%q), CRIU %+v: want a refusal without CRIU", got.status, got.result, msg.bytes, got.report)
	}
}

func TestOnlyRuncsCriuCallIsRelayed(t *testing.T) {
	with := envOf(map[string]string{relayCriuEnv: "/usr/sbin/criu"})
	for _, args := range [][]string{{"swrk", "3"}, {"swrk", "7"}, {"swrk", "4", "--verbosity=4"}} {
		if !isCriuRelay(args, with) || isCriuRelay(args, envOf(nil)) {
			t.Fatalf("%v", args)
		}
	}
	for _, args := range [][]string{{"swrk"}, {"swrk", "-1"}, {"swrk", "03"}, {"swrk", "x"}, {"restore", "3"}, {"create", "c1"}} {
		if isCriuRelay(args, with) {
			t.Fatalf("%v read as runc's CRIU", args)
		}
	}
}

func TestCriusMessagesAreReadAsProtobuf(t *testing.T) {
	if r, n := restoreRequest(restoreReq(true)); !r || !n {
		t.Fatal("a restore asking for notifications")
	}
	if r, n := restoreRequest(cat(restoreReq(true), bytesField(2, varintField(12, 0)))); !r || n {
		t.Fatal("the last notify_scripts wins")
	}
	if r, _ := restoreRequest(varintField(1, reqVersion)); r {
		t.Fatal("a version request is no restore")
	}
	for _, bad := range [][]byte{{0x08}, {0x12, 0x05, 0x01}, {0x0f}, {0x08, 0x80}} {
		if r, _ := restoreRequest(bad); r {
			t.Fatalf("%x read as a restore", bad)
		}
		if _, ok := notification(bad); ok {
			t.Fatalf("%x read as a notification", bad)
		}
	}
	note := cat(varintField(1, reqNotify), varintField(2, 1), bytesField(5, cat(bytesField(1, []byte(waitAction)), varintField(2, 42))))
	if step, ok := notification(note); !ok || step != waitAction {
		t.Fatalf("notification: %q %v", step, ok)
	}
	// runc's descriptors CRIU opens through /proc: the relay's own in their place, all else as runc wrote it
	req := cat(varintField(1, reqRestore), bytesField(2, cat(varintField(1, uint64(imagesDir.Fd())), varintField(9, 4),
		varintField(17, uint64(imagesDir.Fd())), bytesField(10, []byte("restore.log")), varintField(12, 1))), varintField(4, 0))
	out, err := asPeer(req, os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	fs, _ := fields(out)
	ofs, _ := fields(fs[1].bytes)
	if len(fs) != 3 || string(fs[0].raw) != string(req[:2]) || string(fs[2].raw) != string(varintField(4, 0)) || len(ofs) != 5 {
		t.Fatalf("rewritten: %x", out)
	}
	for i, want := range []uint64{1, 9, 17, 10, 12} {
		if ofs[i].num != want {
			t.Fatalf("option %d: field %d, want %d", i, ofs[i].num, want)
		}
	}
	for _, i := range []int{0, 2} {
		path, _ := os.Readlink(fmt.Sprintf("/proc/self/fd/%d", ofs[i].value))
		if ofs[i].value == uint64(imagesDir.Fd()) || path != imagesDir.Name() {
			t.Fatalf("field %d: fd %d (%s)", ofs[i].num, ofs[i].value, path)
		}
	}
	if _, err := asPeer(cat(varintField(1, reqRestore), bytesField(2, varintField(1, 999))), os.Getpid()); err == nil {
		t.Fatal("a descriptor runc does not have")
	}
	if step, ok := notification(restoreFailed("why")); ok {
		t.Fatalf("a restore's answer read as notification %q", step)
	}
}
