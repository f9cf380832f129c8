package main

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"crypto/rand"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"syscall"
	"testing"
	"time"
)

var criuDump = []string{"--create", "--gzip", "--no-unquote", "--no-wildcards", "--one-file-system", "--check-links",
	"--preserve-permissions", "--sparse", "--numeric-owner", "--directory", "/proc/self/fd/0", "."}

func criuRestore(dir string) []string {
	return []string{"--extract", "--gzip", "--no-unquote", "--no-wildcards", "--directory", dir}
}

// tarLaunchers builds the launcher twice: "native" runs /bin/false as its tar (so a call it does not do
// itself fails), "gnu" runs the host's GNU tar.
func tarLaunchers(t *testing.T) (native, gnu string) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root (device nodes, owners, mounts)")
	}
	gnuTar, err := exec.LookPath("tar")
	if err != nil {
		t.Skip("no GNU tar")
	}
	dir := t.TempDir()
	native = buildLauncher(t, filepath.Join(dir, "native"), config{Argv: []string{"/bin/false"}, GzipFilter: true})
	gnu = buildLauncher(t, filepath.Join(dir, "gnu"), config{Argv: []string{gnuTar}, GzipFilter: true})
	return native, gnu
}

func tmpfs(t *testing.T, options string) string {
	t.Helper()
	dir := t.TempDir()
	if err := syscall.Mount("kst-test", dir, "tmpfs", 0, options); err != nil {
		t.Skipf("mount tmpfs: %v", err)
	}
	t.Cleanup(func() { _ = syscall.Unmount(dir, syscall.MNT_DETACH) })
	return dir
}

// dumpTar runs a launcher as CRIU's dump does: the mount open as fd 0, the image as stdout.
func dumpTar(t *testing.T, launcher, dir string, env ...string) ([]byte, error) {
	t.Helper()
	d, err := os.Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	cmd := exec.Command(launcher, criuDump...)
	cmd.Stdin, cmd.Env = d, append(os.Environ(), env...)
	var out, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &stderr
	if err := cmd.Run(); err != nil {
		return nil, fmt.Errorf("%v: %s", err, stderr.String())
	}
	return out.Bytes(), nil
}

func restoreTar(launcher, dir string, archive []byte, env ...string) error {
	cmd := exec.Command(launcher, criuRestore(dir)...)
	cmd.Stdin, cmd.Env = bytes.NewReader(archive), append(os.Environ(), env...)
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("%v: %s", err, out)
	}
	return nil
}

// containerTmpfs fills dir as runc fills a container's /dev, with some of everything done natively.
func containerTmpfs(t *testing.T, dir string) {
	t.Helper()
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	for _, d := range []struct {
		name string
		mode uint32
		uid  int
	}{{"pts", 0o755, 0}, {"shm", 0o1777, 0}, {"mqueue", 0o755, 0}, {"deep", 0o750, 1000}, {"deep/er", 0o2770, 1000}} {
		must(os.Mkdir(filepath.Join(dir, d.name), 0o700))
		must(os.Chmod(filepath.Join(dir, d.name), os.FileMode(d.mode&0o777)|modeBits(d.mode)))
		must(os.Lchown(filepath.Join(dir, d.name), d.uid, 2000))
	}
	for name, dev := range map[string][2]uint32{"null": {1, 3}, "zero": {1, 5}, "tty": {5, 0}, "deep/er/loop7": {7, 7}} {
		must(syscall.Mknod(filepath.Join(dir, name), syscall.S_IFCHR|0o666, mkdev(int64(dev[0]), int64(dev[1]))))
	}
	must(syscall.Mknod(filepath.Join(dir, "blk"), syscall.S_IFBLK|0o640, mkdev(259, 1<<18)))
	must(syscall.Mkfifo(filepath.Join(dir, "deep/fifo"), 0o620))
	for name, target := range map[string]string{"fd": "/proc/self/fd", "ptmx": "pts/ptmx", "deep/up": "../../etc"} {
		must(os.Symlink(target, filepath.Join(dir, name)))
	}
	must(os.Lchown(filepath.Join(dir, "ptmx"), 1000, 1000))
	must(os.WriteFile(filepath.Join(dir, "deep/er/empty"), nil, 0o600))
	must(os.Chmod(filepath.Join(dir, "deep/er/empty"), 0o4755|os.ModeSetuid))
	// modification times, deepest first (creating an entry changes its directory's)
	when := time.Unix(1_700_000_000, 0)
	for _, name := range []string{"deep/er/empty", "deep/er/loop7", "deep/fifo", "deep/er", "deep", "null", "shm", "."} {
		must(os.Chtimes(filepath.Join(dir, name), when, when))
		when = when.Add(time.Hour)
	}
	must(lutimes(filepath.Join(dir, "fd"), time.Unix(1_600_000_000, 0)))
}

func modeBits(m uint32) os.FileMode {
	var out os.FileMode
	if m&0o4000 != 0 {
		out |= os.ModeSetuid
	}
	if m&0o2000 != 0 {
		out |= os.ModeSetgid
	}
	if m&0o1000 != 0 {
		out |= os.ModeSticky
	}
	return out
}

func lutimes(path string, when time.Time) error { // AT_FDCWD
	return setTimes(-100, path, &tar.Header{ModTime: when})
}

// tree lists every entry below dir (and dir itself as "."): kind and mode, owner, device, link target,
// modification time, a file's size.
func tree(t *testing.T, dir string) map[string]string {
	t.Helper()
	out := map[string]string{}
	err := filepath.Walk(dir, func(path string, fi os.FileInfo, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(dir, path)
		st := fi.Sys().(*syscall.Stat_t)
		link := ""
		if fi.Mode()&os.ModeSymlink != 0 {
			link, _ = os.Readlink(path)
		}
		size := st.Size
		if fi.IsDir() {
			size = 0 // a tmpfs directory's size counts its entries
		}
		out[rel] = fmt.Sprintf("mode=%o uid=%d gid=%d rdev=%d,%d link=%q mtime=%d size=%d", st.Mode, st.Uid, st.Gid,
			major(st.Rdev), minor(st.Rdev), link, st.Mtim.Sec, size)
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return out
}

func members(t *testing.T, archive []byte) []string {
	t.Helper()
	zr, err := gzip.NewReader(bytes.NewReader(archive))
	if err != nil {
		t.Fatal(err)
	}
	tr := tar.NewReader(zr)
	var out []string
	for {
		h, err := tr.Next()
		if err == io.EOF {
			sort.Strings(out)
			return out
		}
		if err != nil {
			t.Fatal(err)
		}
		out = append(out, fmt.Sprintf("%s %c mode=%o %d:%d %d,%d %q %d size=%d", h.Name, h.Typeflag, h.Mode&0o7777,
			h.Uid, h.Gid, h.Devmajor, h.Devminor, h.Linkname, h.ModTime.Unix(), h.Size))
	}
}

func diff(t *testing.T, what string, got, want map[string]string) {
	t.Helper()
	for k, v := range want {
		if got[k] != v {
			t.Errorf("%s: %s: got %q, want %q", what, k, got[k], v)
		}
	}
	for k := range got {
		if _, ok := want[k]; !ok {
			t.Errorf("%s: %s: not expected", what, k)
		}
	}
}

// TestTheLauncherArchivesAndExtractsAsGNUTar: the same members as GNU tar's archive of the tree (one
// file system: a mount below is its own entry only), and extracting either archive either way gives
// the tree back as it was.
func TestTheLauncherArchivesAndExtractsAsGNUTar(t *testing.T) {
	native, gnu := tarLaunchers(t)
	src := tmpfs(t, "mode=0755")
	containerTmpfs(t, src)
	below := filepath.Join(src, "shm")
	if err := syscall.Mount("kst-test-shm", below, "tmpfs", 0, "mode=1777"); err != nil {
		t.Fatal(err)
	}
	defer syscall.Unmount(below, syscall.MNT_DETACH)
	if err := os.WriteFile(filepath.Join(below, "data"), []byte("not on this file system"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Chtimes(below, time.Unix(1_650_000_000, 0), time.Unix(1_650_000_000, 0)); err != nil {
		t.Fatal(err)
	}
	mine, err := dumpTar(t, native, src)
	if err != nil {
		t.Fatalf("the launcher did not archive the tree itself: %v", err)
	}
	theirs, err := dumpTar(t, gnu, src, nativeTarEnv+"=0")
	if err != nil {
		t.Fatal(err)
	}
	if m, g := strings.Join(members(t, mine), "\n"), strings.Join(members(t, theirs), "\n"); m != g {
		t.Fatalf("members differ from GNU tar's:\n%s\n--- GNU tar:\n%s", m, g)
	}
	want := tree(t, src)
	delete(want, "shm/data") // another file system
	for _, c := range []struct {
		name     string
		launcher string
		archive  []byte
		env      []string
	}{{"mine, extracted here", native, mine, nil}, {"GNU tar's, extracted here", native, theirs, nil},
		{"mine, extracted by GNU tar", gnu, mine, []string{nativeTarEnv + "=0"}}} {
		dst := tmpfs(t, "mode=0700")
		if err := restoreTar(c.launcher, dst, c.archive, c.env...); err != nil {
			t.Fatalf("%s: %v", c.name, err)
		}
		diff(t, c.name, tree(t, dst), want)
	}
}

// TestTreesWithDataGoToGNUTar: a file with data (or a hard link) is GNU tar's to archive, and an archive
// holding one GNU tar's to extract; the launcher set to a tar that fails shows it did not do them.
func TestTreesWithDataGoToGNUTar(t *testing.T) {
	native, gnu := tarLaunchers(t)
	for name, fill := range map[string]func(dir string) error{
		"data": func(dir string) error { return os.WriteFile(filepath.Join(dir, "f"), []byte("x"), 0o644) },
		"hard link": func(dir string) error {
			if err := os.WriteFile(filepath.Join(dir, "f"), nil, 0o644); err != nil {
				return err
			}
			return os.Link(filepath.Join(dir, "f"), filepath.Join(dir, "g"))
		},
	} {
		src := tmpfs(t, "mode=0755")
		if err := fill(src); err != nil {
			t.Fatal(err)
		}
		if _, err := dumpTar(t, native, src); err == nil {
			t.Errorf("%s: archived without GNU tar", name)
		}
		archive, err := dumpTar(t, gnu, src)
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		dst := tmpfs(t, "mode=0755")
		if err := restoreTar(native, dst, archive); err == nil {
			t.Errorf("%s: extracted without GNU tar", name)
		}
		if err := restoreTar(gnu, dst, archive); err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		diff(t, name, tree(t, dst), tree(t, src))
	}
}

func gz(t *testing.T, headers ...*tar.Header) []byte {
	t.Helper()
	var raw bytes.Buffer
	tw := tar.NewWriter(&raw)
	for _, h := range headers {
		if err := tw.WriteHeader(h); err != nil {
			t.Fatal(err)
		}
		if h.Size > 0 {
			_, _ = tw.Write(bytes.Repeat([]byte("x"), int(h.Size)))
		}
	}
	_ = tw.Close()
	var out bytes.Buffer
	zw := gzip.NewWriter(&out)
	_, _ = zw.Write(raw.Bytes())
	_ = zw.Close()
	return out.Bytes()
}

func dirH(name string) *tar.Header {
	return &tar.Header{Typeflag: tar.TypeDir, Name: name, Mode: 0o755}
}
func linkH(name, to string) *tar.Header {
	return &tar.Header{Typeflag: tar.TypeSymlink, Name: name, Linkname: to, Mode: 0o777}
}
func fileH(name string) *tar.Header {
	return &tar.Header{Typeflag: tar.TypeReg, Name: name, Mode: 0o644}
}

// TestOnlyPlainArchivesAreExtractedHere: every member a new entry of a directory the same archive made
// before it, by a plain name, once; anything else is left to GNU tar (and its own rules).
func TestOnlyPlainArchivesAreExtractedHere(t *testing.T) {
	if _, err := parseTmpfsArchive(gz(t, dirH("./"), dirH("./a/"), fileH("./a/b"), linkH("./c", "/etc"))); err != nil {
		t.Fatalf("a plain archive: %v", err)
	}
	for name, archive := range map[string][]byte{
		"dot-dot":                gz(t, dirH("./"), fileH("./../x")),
		"absolute":               gz(t, dirH("./"), fileH("/etc/passwd")),
		"no ./":                  gz(t, dirH("./"), fileH("a")),
		"a parent's dot-dot":     gz(t, dirH("./"), dirH("./a/"), fileH("./a/../../b")),
		"into a symlink":         gz(t, dirH("./"), linkH("./a", "/etc"), fileH("./a/passwd")),
		"into a missing dir":     gz(t, dirH("./"), fileH("./a/b")),
		"into a file":            gz(t, dirH("./"), fileH("./a"), fileH("./a/b")),
		"twice":                  gz(t, dirH("./"), dirH("./a/"), linkH("./a", "/")),
		"the root later":         gz(t, fileH("./a"), dirH("./")),
		"the root a symlink":     gz(t, linkH("./", "/")),
		"a hard link":            gz(t, dirH("./"), fileH("./a"), &tar.Header{Typeflag: tar.TypeLink, Name: "./b", Linkname: "./a"}),
		"data":                   gz(t, dirH("./"), &tar.Header{Typeflag: tar.TypeReg, Name: "./a", Size: 3, Mode: 0o644}),
		"a PAX record":           gz(t, dirH("./"), &tar.Header{Typeflag: tar.TypeReg, Name: "./a", PAXRecords: map[string]string{"SCHILY.xattr.user.x": "1"}}),
		"a negative owner":       gz(t, dirH("./"), &tar.Header{Typeflag: tar.TypeReg, Name: "./a", Uid: -1, Format: tar.FormatGNU}),
		"an empty component":     gz(t, dirH("./"), dirH("./a/"), fileH("./a//b")),
		"an owner's name":        gz(t, dirH("./"), &tar.Header{Typeflag: tar.TypeReg, Name: "./a", Uname: "root"}),
		"a dot component":        gz(t, dirH("./"), dirH("./a/"), fileH("./a/./b")),
		"not gzip":               []byte("plain"),
		"a truncated tar stream": gz(t, dirH("./"))[:20],
	} {
		if m, err := parseTmpfsArchive(archive); err == nil {
			t.Errorf("%s: accepted %v", name, m)
		}
	}
	many := []*tar.Header{dirH("./")}
	for i := 0; i < tmpfsMaxEntries; i++ {
		many = append(many, fileH(fmt.Sprintf("./f%d", i)))
	}
	if _, err := parseTmpfsArchive(gz(t, many...)); err == nil {
		t.Errorf("%d members accepted", len(many))
	}
	if _, err := parseTmpfsArchive(gz(t, many[:tmpfsMaxEntries]...)); err != nil {
		t.Errorf("%d members: %v", tmpfsMaxEntries, err)
	}
}

// TestALongStreamIsHandedOnWhole: beyond tmpfsMaxArchive the bytes read first come back, then the rest.
func TestALongStreamIsHandedOnWhole(t *testing.T) {
	data := make([]byte, tmpfsMaxArchive+12345)
	_, _ = rand.Read(data)
	_, rest, err := readTmpfsArchive(bytes.NewReader(data))
	if err == nil {
		t.Fatal("accepted")
	}
	back, _ := io.ReadAll(rest)
	if !bytes.Equal(back, data) {
		t.Fatalf("handed on %d bytes, not the stream's %d", len(back), len(data))
	}
	small := gz(t, dirH("./"), fileH("./a/b"))
	_, rest, err = readTmpfsArchive(bytes.NewReader(small))
	if back, _ := io.ReadAll(rest); err == nil || !bytes.Equal(back, small) {
		t.Fatalf("a refused short archive: %v, %d of %d bytes", err, len(back), len(small))
	}
}

// TestOnlyCriusCallsAreDoneHere: the two command lines exactly, and not with the switch at 0.
func TestOnlyCriusCallsAreDoneHere(t *testing.T) {
	env := envOf(map[string]string{})
	if create, dir, ok := criuTarCall(criuDump, env); !ok || !create || dir != "/proc/self/fd/0" {
		t.Errorf("dump: %v %q %v", create, dir, ok)
	}
	if create, dir, ok := criuTarCall(criuRestore("/tmp/.criu.mntns.x/mnt-1"), env); !ok || create || dir != "/tmp/.criu.mntns.x/mnt-1" {
		t.Errorf("restore: %v %q %v", create, dir, ok)
	}
	for _, args := range [][]string{
		criuDump[:len(criuDump)-1], append(append([]string{}, criuDump...), "x"), criuRestore("relative"),
		append(criuRestore("/d"), "--xattrs"), {"--create", "--gzip", "."}, {"--list", "--gzip"},
	} {
		if _, _, ok := criuTarCall(args, env); ok {
			t.Errorf("done here: %v", args)
		}
	}
	if _, _, ok := criuTarCall(criuDump, envOf(map[string]string{nativeTarEnv: "0"})); ok {
		t.Errorf("done here with %s=0", nativeTarEnv)
	}
}

// TestStoredGzipIsGzip: stored blocks at and across the 65,535-byte limit read back by Go and GNU gzip.
func TestStoredGzipIsGzip(t *testing.T) {
	gnuGzip, _ := exec.LookPath("gzip")
	for _, n := range []int{0, 1, 0xffff, 0x10000, 3*0xffff + 7} {
		data := make([]byte, n)
		_, _ = rand.Read(data)
		zr, err := gzip.NewReader(bytes.NewReader(storedGzip(data)))
		if err != nil {
			t.Fatalf("%d bytes: %v", n, err)
		}
		back, err := io.ReadAll(zr)
		if err != nil || !bytes.Equal(back, data) {
			t.Fatalf("%d bytes: read back %d bytes, %v", n, len(back), err)
		}
		if gnuGzip != "" {
			cmd := exec.Command(gnuGzip, "-d", "-c")
			cmd.Stdin = bytes.NewReader(storedGzip(data))
			out, err := cmd.Output()
			if err != nil || !bytes.Equal(out, data) {
				t.Fatalf("%d bytes: gzip -d gave %d bytes, %v", n, len(out), err)
			}
		}
	}
}
