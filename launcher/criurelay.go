package main

import (
	"fmt"
	"os"
	"os/signal"
	"strconv"
	"sync"
	"syscall"
	"time"
)

// The pages gate between runc and CRIU (shim/engine/staging.py, "two phases").
//
// A restore whose CRIU images are staged but whose page files are still downloading runs `runc restore`
// at once, with this launcher as runc's CRIU (`runc --criu <launcher>`, KUBECTL_SNAPSHOT_RELAY_CRIU
// naming the CRIU to run). runc starts it as `<launcher> swrk N`: fd N is runc's end of CRIU's RPC
// socket (3 for a version request, after the descriptors runc passes on for a restore). The launcher starts the real CRIU on a socket of its own and passes every message on, both
// ways, descriptors included. CRIU tells runc of every step of a restore on that socket (runc asks for
// it: notify_scripts) and waits for runc's answer; at "post-setup-namespaces" (the container's
// namespaces and mounts are restored, no page file is open yet) the launcher first waits until the
// agent lets go of the gate's pages lock (KUBECTL_SNAPSHOT_PAGES_GATE) and passes the notification on
// only if the agent answered that the page files are complete. Any other answer, no answer (the agent
// died), or the deadline (KUBECTL_SNAPSHOT_PAGES_DEADLINE, POSIX seconds) answers CRIU itself that the
// step failed: CRIU then aborts the restore and kills what it restored so far, so the container is
// never started on half its memory. A step that comes after the memory (post-restore, network-unlock,
// pre-resume, post-resume) before the gate was passed is refused the same way.
//
// Before, CRIU ran this launcher as its action script (a configuration file naming it): CRIU starts an
// action script as a process for every step, seven in a restore, four of them after the page files are
// read, each a fork of CRIU and an exec. The relay is one process for the whole restore.
//
// Anything but a restore (runc first asks CRIU for its version) is not relayed: the launcher execs
// CRIU, which reads the request itself. A restore request without notify_scripts (a runc that does not
// ask for the steps) waits at the gate before CRIU is started at all.

const (
	relayCriuEnv  = "KUBECTL_SNAPSHOT_RELAY_CRIU"
	pagesGateEnv  = "KUBECTL_SNAPSHOT_PAGES_GATE"
	pagesDeadline = "KUBECTL_SNAPSHOT_PAGES_DEADLINE"
	waitAction    = "post-setup-namespaces"
	maxRPCMessage = 1 << 20
	maxOOB        = 4096
	// criu_req_type (CRIU's images/rpc.proto)
	reqRestore = 2
	reqNotify  = 6
	oPath      = 0x200000 // O_PATH (Linux), which package syscall does not name
)

// afterMemory: the steps CRIU notifies once the page files have been read.
var afterMemory = map[string]bool{"post-restore": true, "network-unlock": true, "pre-resume": true, "post-resume": true}

// rpcSocket: runc starts its CRIU as `criu swrk N`, N its RPC socket; -1 for anything else.
func rpcSocket(args []string) int {
	if len(args) < 2 || args[0] != "swrk" {
		return -1
	}
	fd, err := strconv.Atoi(args[1])
	if err != nil || fd < 0 || fd >= 1<<16 || strconv.Itoa(fd) != args[1] {
		return -1
	}
	return fd
}

// isCriuRelay: runc's `criu swrk N`, where the hook set the CRIU to relay to.
func isCriuRelay(args []string, getenv func(string) string) bool {
	return rpcSocket(args) >= 0 && getenv(relayCriuEnv) != ""
}

// --- the few protobuf fields involved ------------------------------------------------------------------

func uvarint(b []byte, pos int) (uint64, int, bool) {
	var v uint64
	for shift := uint(0); shift < 64; shift += 7 {
		if pos >= len(b) {
			return 0, 0, false
		}
		c := b[pos]
		pos++
		v |= uint64(c&0x7f) << shift
		if c < 0x80 {
			return v, pos, true
		}
	}
	return 0, 0, false
}

// field is one field of a protobuf message: its number and wire type, its value (varint) or bytes
// (length-delimited), and the field as encoded.
type field struct {
	num, wire uint64
	value     uint64
	bytes     []byte
	raw       []byte
}

// fields parses a message's top level; false when it is not well-formed.
func fields(b []byte) ([]field, bool) {
	var out []field
	for pos := 0; pos < len(b); {
		start := pos
		key, next, ok := uvarint(b, pos)
		if !ok {
			return nil, false
		}
		pos = next
		f := field{num: key >> 3, wire: key & 7}
		switch key & 7 {
		case 0:
			if f.value, pos, ok = uvarint(b, pos); !ok {
				return nil, false
			}
		case 1:
			pos += 8
		case 2:
			n, next, ok := uvarint(b, pos)
			if !ok || n > uint64(len(b)-next) {
				return nil, false
			}
			f.bytes, pos = b[next:next+int(n)], next+int(n)
		case 5:
			pos += 4
		default:
			return nil, false
		}
		if pos > len(b) {
			return nil, false
		}
		f.raw = b[start:pos]
		out = append(out, f)
	}
	return out, true
}

// last returns the last occurrence of field num (protobuf: the last one wins).
func last(fs []field, num uint64) (field, bool) {
	var found field
	ok := false
	for _, f := range fs {
		if f.num == num {
			found, ok = f, true
		}
	}
	return found, ok
}

// restoreRequest reads a criu_req: whether it is a restore, and whether it asks for the steps
// (criu_opts.notify_scripts, field 12 of field 2).
func restoreRequest(msg []byte) (restore bool, notify bool) {
	fs, ok := fields(msg)
	if !ok {
		return false, false
	}
	if t, ok := last(fs, 1); !ok || t.value != reqRestore {
		return false, false
	}
	opts, ok := last(fs, 2)
	if !ok {
		return true, false
	}
	ofs, ok := fields(opts.bytes)
	if !ok {
		return true, false
	}
	n, ok := last(ofs, 12)
	return true, ok && n.value == 1
}

// notification reads a criu_resp: the step CRIU notifies (criu_notify.script), if it is a notification.
func notification(msg []byte) (string, bool) {
	fs, ok := fields(msg)
	if !ok {
		return "", false
	}
	if t, ok := last(fs, 1); !ok || t.value != reqNotify {
		return "", false
	}
	n, ok := last(fs, 5)
	if !ok {
		return "", true
	}
	nfs, ok := fields(n.bytes)
	if !ok {
		return "", true
	}
	script, _ := last(nfs, 1)
	return string(script.bytes), true
}

func appendVarint(b []byte, v uint64) []byte {
	for v >= 0x80 {
		b = append(b, byte(v)|0x80)
		v >>= 7
	}
	return append(b, byte(v))
}

// peerFdFields: the criu_opts fields CRIU opens as /proc/<its RPC peer>/fd/N (cr-service.c: images_dir_fd,
// work_dir_fd, status_fd). Relayed, CRIU's peer is the relay: it holds those of runc's descriptors itself.
var peerFdFields = map[uint64]bool{1: true, 17: true, 49: true}

// asPeer rewrites a criu_req for a CRIU whose RPC peer is this process instead of `runc` (its pid): each
// descriptor of runc's CRIU opens through /proc is opened here (O_PATH, kept until this process exits)
// and named by its number here; every other field stays as runc encoded it.
func asPeer(msg []byte, runc int) ([]byte, error) {
	fs, ok := fields(msg)
	if !ok {
		return nil, fmt.Errorf("runc's request to CRIU is not a protobuf message")
	}
	out := make([]byte, 0, len(msg)+16)
	for _, f := range fs {
		if f.num != 2 || f.wire != 2 {
			out = append(out, f.raw...)
			continue
		}
		ofs, ok := fields(f.bytes)
		if !ok {
			return nil, fmt.Errorf("runc's options for CRIU are not a protobuf message")
		}
		var opts []byte
		for _, o := range ofs {
			if !peerFdFields[o.num] || o.wire != 0 {
				opts = append(opts, o.raw...)
				continue
			}
			path := fmt.Sprintf("/proc/%d/fd/%d", runc, int32(o.value))
			fd, err := syscall.Open(path, oPath|syscall.O_CLOEXEC, 0)
			if err != nil {
				return nil, fmt.Errorf("runc's descriptor for CRIU %s: %v", path, err)
			}
			opts = appendVarint(appendVarint(opts, o.num<<3), uint64(fd))
		}
		out = appendVarint(appendVarint(out, 2<<3|2), uint64(len(opts)))
		out = append(out, opts...)
	}
	return out, nil
}

// notifyFailed is the criu_req answering a notification that the step failed (notify_success false).
var notifyFailed = []byte{1<<3 | 0, reqNotify, 3<<3 | 0, 0}

// restoreFailed is the criu_resp of a restore that did not run: success false, cr_errmsg.
func restoreFailed(why string) []byte {
	b := []byte{1<<3 | 0, reqRestore, 2<<3 | 0, 0, 9<<3 | 2}
	b = appendVarint(b, uint64(len(why)))
	return append(b, why...)
}

// --- the relay -------------------------------------------------------------------------------------------

func refuse(why string) {
	fmt.Fprintf(os.Stderr, "kubectl-snapshot: refusing to restore: %s\n", why)
}

func retryEINTR(f func() error) error {
	for {
		if err := f(); err != syscall.EINTR {
			return err
		}
	}
}

// recvMsg reads one message (and any descriptors passed with it); n == 0: the peer closed its end.
func recvMsg(fd int, buf, oob []byte, flags int) (n, oobn int, err error) {
	var rflags int
	err = retryEINTR(func() (e error) {
		n, oobn, rflags, _, e = syscall.Recvmsg(fd, buf, oob, flags|syscall.MSG_CMSG_CLOEXEC)
		return e
	})
	if err == nil && rflags&(syscall.MSG_TRUNC|syscall.MSG_CTRUNC) != 0 {
		err = fmt.Errorf("a CRIU RPC message longer than %d bytes", len(buf))
	}
	return n, oobn, err
}

func sendMsg(fd int, msg, oob []byte) error {
	return retryEINTR(func() error { return syscall.Sendmsg(fd, msg, oob, nil, 0) })
}

// closeRights closes the descriptors a message brought into this process (sent on, or not).
func closeRights(oob []byte) {
	msgs, err := syscall.ParseSocketControlMessage(oob)
	if err != nil {
		return
	}
	for _, m := range msgs {
		if fds, err := syscall.ParseUnixRights(&m); err == nil {
			for _, fd := range fds {
				_ = syscall.Close(fd)
			}
		}
	}
}

// inheritedFiles: the descriptors runc gave this process (not close-on-exec), each at its own number
// for CRIU, fd `at` (runc's socket) replaced by `rpc`; closed (-1) in between.
func inheritedFiles(at, rpc int) []uintptr {
	entries, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		fail("reading /proc/self/fd: %v", err)
	}
	var open []int
	top := at
	for _, e := range entries {
		fd, err := strconv.Atoi(e.Name())
		if err != nil || fd == rpc || fd >= 1<<16 {
			continue
		}
		flags, _, errno := syscall.Syscall(syscall.SYS_FCNTL, uintptr(fd), syscall.F_GETFD, 0)
		if errno != 0 || flags&syscall.FD_CLOEXEC != 0 {
			continue // closed since (the listing's own), or this process's own
		}
		open = append(open, fd)
		if fd > top {
			top = fd
		}
	}
	files := make([]uintptr, top+1)
	for i := range files {
		files[i] = ^uintptr(0)
	}
	for _, fd := range open {
		files[fd] = uintptr(fd)
	}
	files[at] = uintptr(rpc)
	return files
}

func relayEnv(env []string) []string {
	for _, key := range []string{relayCriuEnv, pagesGateEnv, pagesDeadline} {
		env = withoutKey(env, key)
	}
	return env
}

// runCriuRelay is runc's CRIU for an early restore; it does not return.
func runCriuRelay(args []string, getenv func(string) string) {
	criu := getenv(relayCriuEnv)
	if len(criu) == 0 || criu[0] != '/' {
		fail("%s=%q is not an absolute path", relayCriuEnv, criu)
	}
	argv := append([]string{criu}, args...)
	env := relayEnv(os.Environ())
	rpcFd := rpcSocket(args)
	_ = syscall.SetNonblock(rpcFd, false)
	buf := make([]byte, maxRPCMessage)
	// runc moves its CRIU into the container's cgroups before it sends the request: CRIU is started
	// after that, so that it (and what it restores) starts there
	n, _, err := recvMsg(rpcFd, buf, nil, syscall.MSG_PEEK)
	if err != nil || n == 0 {
		execCriu(argv, env) // CRIU reports it
	}
	restore, notify := restoreRequest(buf[:n])
	if !restore {
		execCriu(argv, env)
	}
	if !notify { // no step to wait at: the page files first, then CRIU
		if status, why := waitForPages(getenv, time.Now); status != 0 {
			refuse(why)
			_, _, _ = recvMsg(rpcFd, buf, nil, 0)
			_ = sendMsg(rpcFd, restoreFailed("refusing to restore: "+why), nil)
			os.Exit(status)
		}
		execCriu(argv, env)
	}
	peer, err := syscall.GetsockoptUcred(rpcFd, syscall.SOL_SOCKET, syscall.SO_PEERCRED)
	if err != nil {
		fail("runc's socket to CRIU: %v", err)
	}
	if n, _, err = recvMsg(rpcFd, buf, nil, 0); err != nil || n == 0 {
		fail("reading runc's request to CRIU: %v", err)
	}
	request, err := asPeer(buf[:n], int(peer.Pid))
	if err != nil {
		fail("%v", err)
	}
	pair, err := syscall.Socketpair(syscall.AF_UNIX, syscall.SOCK_SEQPACKET|syscall.SOCK_CLOEXEC, 0)
	if err != nil {
		fail("socketpair: %v", err)
	}
	ours, theirs := pair[0], pair[1]
	pid, err := syscall.ForkExec(criu, argv, &syscall.ProcAttr{Env: env, Files: inheritedFiles(rpcFd, theirs)})
	if err != nil {
		fail("exec %s: %v", criu, err)
	}
	_ = syscall.Close(theirs)
	signals := make(chan os.Signal, 4)
	signal.Notify(signals, syscall.SIGTERM, syscall.SIGINT, syscall.SIGHUP, syscall.SIGQUIT)
	go func() {
		for s := range signals {
			_ = syscall.Kill(pid, s.(syscall.Signal))
		}
	}()
	r := &relay{runc: rpcFd, criu: ours, getenv: getenv}
	if err := r.toCriu(request, nil); err != nil {
		_ = syscall.Kill(pid, syscall.SIGKILL)
		fail("passing runc's request to CRIU: %v", err)
	}
	go r.fromRunc(buf)
	done := make(chan struct{})
	go func() { r.fromCriu(); close(done) }()
	var ws syscall.WaitStatus
	_ = retryEINTR(func() error { _, e := syscall.Wait4(pid, &ws, 0, nil); return e })
	// what CRIU wrote before it exited is still passed on; a process it restored holding its end
	// of the socket does not keep this one waiting
	_ = syscall.Shutdown(ours, syscall.SHUT_RD)
	select {
	case <-done:
	case <-time.After(time.Second):
	}
	if ws.Signaled() {
		os.Exit(128 + int(ws.Signal()))
	}
	os.Exit(ws.ExitStatus())
}

func execCriu(argv, env []string) {
	err := syscall.Exec(argv[0], argv, env)
	fail("exec %s: %v", argv[0], err)
}

type relay struct {
	runc, criu int
	getenv     func(string) string
	mu         sync.Mutex // writes to CRIU: runc's, and this relay's own answers
	gated      bool
}

func (r *relay) toCriu(msg, oob []byte) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	return sendMsg(r.criu, msg, oob)
}

// fromRunc passes runc's requests and answers on to CRIU; runc's end closed, CRIU's is shut for writing.
func (r *relay) fromRunc(buf []byte) {
	oob := make([]byte, maxOOB)
	for {
		n, oobn, err := recvMsg(r.runc, buf, oob, 0)
		if err != nil || n == 0 {
			_ = syscall.Shutdown(r.criu, syscall.SHUT_WR)
			return
		}
		err = r.toCriu(buf[:n], oob[:oobn])
		closeRights(oob[:oobn])
		if err != nil {
			return
		}
	}
}

// fromCriu passes CRIU's notifications and its answer on to runc, holding the restore at the gate.
func (r *relay) fromCriu() {
	buf := make([]byte, maxRPCMessage)
	oob := make([]byte, maxOOB)
	for {
		n, oobn, err := recvMsg(r.criu, buf, oob, 0)
		if err != nil || n == 0 {
			return
		}
		msg, rights := buf[:n], oob[:oobn]
		if step, ok := notification(msg); ok {
			if why := r.hold(step); why != "" {
				closeRights(rights)
				refuse(why)
				if r.toCriu(notifyFailed, nil) != nil {
					return
				}
				continue // CRIU aborts the restore, and its answer says so
			}
		}
		err = sendMsg(r.runc, msg, rights)
		closeRights(rights)
		if err != nil {
			return
		}
	}
}

// hold waits at the gate at "post-setup-namespaces"; it returns why the step must fail, or "".
func (r *relay) hold(step string) string {
	switch {
	case step == waitAction && !r.gated:
		if status, why := waitForPages(r.getenv, time.Now); status != 0 {
			return why
		}
		r.gated = true
	case afterMemory[step] && !r.gated:
		return fmt.Sprintf("CRIU reached %q before the page files were complete", step)
	}
	return ""
}
