package main

// CRIU's tar of a container's tmpfs mounts, done here for the small trees those mounts hold.
//
// CRIU saves and restores the contents of every tmpfs it dumps by running `tar` (criu/mount.c:
// tmpfs_dump, tmpfs_restore): one process per mount, started one after the other, inside the freeze on
// a checkpoint and before the process tree comes back on a restore. A container has several (/dev,
// /dev/shm, /run, the cgroup tmpfs, the masked /proc and /sys directories), and each start of GNU tar
// (the bundle's loader linking it, tar starting, the launcher's gzip pipe) costs a few milliseconds
// of a busy node's CPU. What those mounts hold is almost always directories, device nodes, symlinks,
// fifos and empty files; for such a tree the launcher writes (and reads) GNU tar's archive itself,
// gzip'd as stored blocks, without starting tar. Anything else in the tree (a file with data, a hard
// link, a socket, more than tmpfsMaxEntries entries) and anything else in an archive (any other member
// type, a name that is not plain, an owner's name, a PAX record, more than tmpfsMaxArchive compressed
// bytes) goes to GNU tar, exactly as before: on a checkpoint nothing is written until the whole tree
// has qualified; on a restore the bytes read so far are handed to tar ahead of the rest of the stream.
// KUBECTL_SNAPSHOT_NATIVE_TAR=0 in CRIU's environment sends every call to GNU tar.
//
// An archive is hostile (a snapshot's CRIU images come from a registry): a member is created only as a
// new entry of a directory this extraction created itself, reached from the mount's root one component
// at a time without following symlinks, with a name of plain components (no "..", no "."), each name
// once; the metadata applied is what GNU tar would apply as root (owner, mode, modification time).

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"encoding/binary"
	"fmt"
	"hash/crc32"
	"io"
	"os"
	"slices"
	"strings"
	"syscall"
	"time"
	"unsafe"
)

const (
	tmpfsMaxEntries = 4096    // members of a tree or an archive done here; beyond, GNU tar
	tmpfsMaxArchive = 1 << 20 // compressed bytes of an archive read before deciding
	tmpfsMaxTar     = 8 << 20 // its decompressed bytes (entries without data: headers only)
	nativeTarEnv    = "KUBECTL_SNAPSHOT_NATIVE_TAR"
)

// criuTarCall recognises CRIU 4.x's two tar command lines exactly (argv after "tar"): the dump's,
// which archives the mount open as fd 0, and the restore's into a directory. Nothing else is done here.
func criuTarCall(args []string, getenv func(string) string) (create bool, dir string, ok bool) {
	if getenv(nativeTarEnv) == "0" {
		return false, "", false
	}
	dump := []string{"--create", "--gzip", "--no-unquote", "--no-wildcards", "--one-file-system", "--check-links",
		"--preserve-permissions", "--sparse", "--numeric-owner", "--directory", "/proc/self/fd/0", "."}
	if slices.Equal(args, dump) {
		return true, "/proc/self/fd/0", true
	}
	restore := []string{"--extract", "--gzip", "--no-unquote", "--no-wildcards", "--directory"}
	if len(args) == len(restore)+1 && slices.Equal(args[:len(restore)], restore) && strings.HasPrefix(args[len(restore)], "/") {
		return false, args[len(restore)], true
	}
	return false, "", false
}

// runCriuTar does CRIU's tar call here where the tree or the archive qualifies, else runs GNU tar
// (gzipFilter) on the same input; returns the exit status.
func runCriuTar(create bool, dir string, argv, env []string) int {
	if create {
		archive, err := tmpfsArchive(dir)
		if err != nil {
			return gzipFilter(argv, env, os.Stdin) // not a tree done here: GNU tar archives it
		}
		if _, err := os.Stdout.Write(archive); err != nil {
			fmt.Fprintf(os.Stderr, "kubectl-snapshot launcher: writing the tmpfs archive: %v\n", err)
			return 2
		}
		return 0
	}
	members, rest, err := readTmpfsArchive(os.Stdin)
	if err != nil {
		return gzipFilter(argv, env, rest) // GNU tar reads it all, from the first byte
	}
	if err := extractTmpfs(dir, members); err != nil {
		fmt.Fprintf(os.Stderr, "kubectl-snapshot launcher: extracting the tmpfs archive into %s: %v\n", dir, err)
		return 2
	}
	return 0
}

// --- the archive ----------------------------------------------------------------------------------

func major(dev uint64) int64 { return int64(((dev >> 8) & 0xfff) | ((dev >> 32) &^ 0xfff)) }
func minor(dev uint64) int64 { return int64((dev & 0xff) | ((dev >> 12) &^ 0xff)) }
func mkdev(maj, min int64) int {
	return int((uint64(min) & 0xff) | ((uint64(maj) & 0xfff) << 8) | ((uint64(min) &^ 0xff) << 12) |
		((uint64(maj) &^ 0xfff) << 32))
}

// tmpfsArchive is GNU tar's archive of the tree at dir (as CRIU runs it: one file system, numeric
// owners, whole seconds), gzip'd; an error where the tree holds anything not done here.
func tmpfsArchive(dir string) ([]byte, error) {
	fd, err := syscall.Open(dir, syscall.O_RDONLY|syscall.O_DIRECTORY|syscall.O_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	defer syscall.Close(fd)
	var root syscall.Stat_t
	if err := syscall.Fstat(fd, &root); err != nil {
		return nil, err
	}
	headers := []*tar.Header{header("./", &root, tar.TypeDir, "")}
	if err := walkTmpfs(fd, "./", root.Dev, &headers); err != nil {
		return nil, err
	}
	var raw bytes.Buffer
	tw := tar.NewWriter(&raw)
	for _, h := range headers {
		if err := tw.WriteHeader(h); err != nil {
			return nil, err
		}
	}
	if err := tw.Close(); err != nil {
		return nil, err
	}
	return storedGzip(raw.Bytes()), nil
}

// storedGzip is data as one gzip member of stored (uncompressed) deflate blocks: a few KiB of headers
// need no compressor, whose state (hundreds of KiB at any level) costs a fresh process more than the
// bytes saved; the snapshot's layer compresses the images anyway. Any gzip reader takes it.
func storedGzip(data []byte) []byte {
	sum, size := crc32.ChecksumIEEE(data), uint32(len(data))
	out := make([]byte, 0, 10+len(data)+5*(len(data)/0xffff+1)+8)
	out = append(out, 0x1f, 0x8b, 8, 0, 0, 0, 0, 0, 0, 0xff) // magic, deflate, no flags or mtime, unknown OS
	for first := true; first || len(data) > 0; first = false {
		n := min(len(data), 0xffff)
		final := byte(0)
		if n == len(data) {
			final = 1
		}
		out = append(out, final, byte(n), byte(n>>8), byte(^n), byte(^n>>8))
		out, data = append(out, data[:n]...), data[n:]
	}
	return binary.LittleEndian.AppendUint32(binary.LittleEndian.AppendUint32(out, sum), size)
}

func header(name string, st *syscall.Stat_t, kind byte, link string) *tar.Header {
	h := &tar.Header{
		Typeflag: kind,
		Name:     name,
		Linkname: link,
		Mode:     int64(st.Mode & 0o7777),
		Uid:      int(st.Uid),
		Gid:      int(st.Gid),
		ModTime:  time.Unix(st.Mtim.Sec, 0),
		Format:   tar.FormatGNU,
	}
	if kind == tar.TypeChar || kind == tar.TypeBlock {
		h.Devmajor, h.Devminor = major(st.Rdev), minor(st.Rdev)
	}
	return h
}

var errNotHere = fmt.Errorf("not done in the launcher")

func walkTmpfs(dirfd int, prefix string, dev uint64, out *[]*tar.Header) error {
	names, err := readNames(dirfd)
	if err != nil {
		return err
	}
	for _, name := range names {
		if len(*out) >= tmpfsMaxEntries {
			return errNotHere
		}
		var st syscall.Stat_t
		if err := lstatat(dirfd, name, &st); err != nil {
			return err
		}
		path := prefix + name
		switch st.Mode & syscall.S_IFMT {
		case syscall.S_IFDIR:
			*out = append(*out, header(path+"/", &st, tar.TypeDir, ""))
			if st.Dev != dev {
				continue // --one-file-system: a mount point's own entry, not what is mounted there
			}
			sub, err := syscall.Openat(dirfd, name, syscall.O_RDONLY|syscall.O_DIRECTORY|syscall.O_NOFOLLOW|syscall.O_CLOEXEC, 0)
			if err != nil {
				return err
			}
			err = walkTmpfs(sub, path+"/", dev, out)
			syscall.Close(sub)
			if err != nil {
				return err
			}
		case syscall.S_IFLNK:
			target, err := readlinkat(dirfd, name)
			if err != nil {
				return err
			}
			*out = append(*out, header(path, &st, tar.TypeSymlink, target))
		case syscall.S_IFCHR:
			*out = append(*out, header(path, &st, tar.TypeChar, ""))
		case syscall.S_IFBLK:
			*out = append(*out, header(path, &st, tar.TypeBlock, ""))
		case syscall.S_IFIFO:
			*out = append(*out, header(path, &st, tar.TypeFifo, ""))
		case syscall.S_IFREG:
			if st.Size != 0 || st.Nlink != 1 {
				return errNotHere // data, sparse or not, and hard links: GNU tar's
			}
			*out = append(*out, header(path, &st, tar.TypeReg, ""))
		default:
			return errNotHere // sockets: GNU tar's warning and rules
		}
	}
	return nil
}

func readNames(fd int) ([]string, error) {
	var names []string
	buf := make([]byte, 8192)
	for {
		n, err := syscall.ReadDirent(fd, buf)
		if err != nil {
			return nil, err
		}
		if n <= 0 {
			return names, nil
		}
		_, _, names = syscall.ParseDirent(buf[:n], -1, names)
		if len(names) > tmpfsMaxEntries {
			return nil, errNotHere
		}
	}
}

// member is one entry of an archive read here: its path below the root ("" for the root itself).
type member struct {
	path string
	h    *tar.Header
}

// readTmpfsArchive reads a gzip'd archive of at most tmpfsMaxArchive bytes and returns its members
// where every one is done here; else an error and a reader of the whole stream (what was read first).
func readTmpfsArchive(in io.Reader) ([]member, io.Reader, error) {
	head, err := io.ReadAll(io.LimitReader(in, tmpfsMaxArchive+1))
	rest := io.MultiReader(bytes.NewReader(head), in)
	if err != nil {
		return nil, rest, err
	}
	if len(head) > tmpfsMaxArchive {
		return nil, rest, errNotHere
	}
	members, err := parseTmpfsArchive(head)
	return members, rest, err
}

func parseTmpfsArchive(compressed []byte) ([]member, error) {
	zr, err := gzip.NewReader(bytes.NewReader(compressed))
	if err != nil {
		return nil, err
	}
	raw, err := io.ReadAll(io.LimitReader(zr, tmpfsMaxTar+1))
	if err != nil {
		return nil, err
	}
	if len(raw) > tmpfsMaxTar {
		return nil, errNotHere
	}
	tr := tar.NewReader(bytes.NewReader(raw))
	seen := map[string]byte{"": tar.TypeDir} // the root: what is a directory this extraction made
	var members []member
	for {
		h, err := tr.Next()
		if err == io.EOF {
			return members, nil
		}
		if err != nil {
			return nil, err
		}
		// owner names: GNU tar (CRIU's restore does not pass --numeric-owner) would look them up; CRIU's
		// dumps (--numeric-owner) have none
		if len(members) >= tmpfsMaxEntries || len(h.PAXRecords) > 0 || h.Size != 0 || !ids(h) ||
			h.Uname != "" || h.Gname != "" {
			return nil, errNotHere
		}
		path, ok := plainPath(h.Name)
		if !ok {
			return nil, errNotHere
		}
		switch h.Typeflag {
		case tar.TypeDir, tar.TypeSymlink, tar.TypeChar, tar.TypeBlock, tar.TypeFifo, tar.TypeReg:
		default:
			return nil, errNotHere // hard links, GNU tar's own kinds: GNU tar's rules
		}
		if path == "" {
			if h.Typeflag != tar.TypeDir || len(members) > 0 {
				return nil, errNotHere
			}
		} else {
			if _, dup := seen[path]; dup {
				return nil, errNotHere
			}
			parent := ""
			if i := strings.LastIndexByte(path, '/'); i >= 0 {
				parent = path[:i]
			}
			if kind, ok := seen[parent]; !ok || kind != tar.TypeDir {
				return nil, errNotHere // only into directories this archive made, after them
			}
			seen[path] = h.Typeflag
		}
		members = append(members, member{path, h})
	}
}

// ids: owner and device numbers the system calls take as given (-1 would mean "unchanged" to chown).
func ids(h *tar.Header) bool {
	const max = 1<<32 - 2
	return h.Uid >= 0 && h.Uid <= max && h.Gid >= 0 && h.Gid <= max && h.Devmajor >= 0 && h.Devmajor <= max &&
		h.Devminor >= 0 && h.Devminor <= max
}

// plainPath: "./a/b/" -> "a/b", "./" -> ""; false for anything but "./" followed by plain components.
func plainPath(name string) (string, bool) {
	if name == "./" || name == "." {
		return "", true
	}
	if !strings.HasPrefix(name, "./") {
		return "", false
	}
	p := strings.TrimSuffix(name[2:], "/")
	for _, c := range strings.Split(p, "/") {
		if c == "" || c == "." || c == ".." || strings.IndexByte(c, 0) >= 0 {
			return "", false
		}
	}
	return p, true
}

// --- extracting -----------------------------------------------------------------------------------

const (
	atSymlinkNofollow = 0x100
	utimeOmit         = (1 << 30) - 2
)

// extractTmpfs creates the members below dir (the freshly mounted tmpfs CRIU restores into) and applies
// their owner, mode and modification time; directories' times last, deepest first, as GNU tar does.
func extractTmpfs(dir string, members []member) error {
	root, err := syscall.Open(dir, syscall.O_RDONLY|syscall.O_DIRECTORY|syscall.O_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer syscall.Close(root)
	var dirs []member
	for _, m := range members {
		if err := extractOne(root, m); err != nil {
			return fmt.Errorf("%s: %w", m.h.Name, err)
		}
		if m.h.Typeflag == tar.TypeDir {
			dirs = append(dirs, m)
		}
	}
	for i := len(dirs) - 1; i >= 0; i-- {
		if err := inParent(root, dirs[i].path, func(pfd int, base string) error {
			return setTimes(pfd, base, dirs[i].h)
		}); err != nil {
			return fmt.Errorf("%s: %w", dirs[i].h.Name, err)
		}
	}
	return nil
}

func extractOne(root int, m member) error {
	h := m.h
	return inParent(root, m.path, func(pfd int, base string) error {
		var err error
		switch h.Typeflag {
		case tar.TypeDir:
			if m.path != "" {
				err = syscall.Mkdirat(pfd, base, 0o700)
			}
		case tar.TypeSymlink:
			err = symlinkat(h.Linkname, pfd, base)
		case tar.TypeChar:
			err = syscall.Mknodat(pfd, base, syscall.S_IFCHR|0o600, mkdev(h.Devmajor, h.Devminor))
		case tar.TypeBlock:
			err = syscall.Mknodat(pfd, base, syscall.S_IFBLK|0o600, mkdev(h.Devmajor, h.Devminor))
		case tar.TypeFifo:
			err = syscall.Mknodat(pfd, base, syscall.S_IFIFO|0o600, 0)
		case tar.TypeReg:
			var fd int
			fd, err = syscall.Openat(pfd, base, syscall.O_WRONLY|syscall.O_CREAT|syscall.O_EXCL|syscall.O_NOFOLLOW|syscall.O_CLOEXEC, 0o600)
			if err == nil {
				syscall.Close(fd)
			}
		}
		if err != nil {
			return err
		}
		if err := syscall.Fchownat(pfd, base, h.Uid, h.Gid, atSymlinkNofollow); err != nil {
			return err
		}
		if h.Typeflag == tar.TypeSymlink {
			return setTimes(pfd, base, h)
		}
		if err := syscall.Fchmodat(pfd, base, uint32(h.Mode&0o7777), 0); err != nil {
			return err
		}
		if h.Typeflag == tar.TypeDir {
			return nil // after its contents
		}
		return setTimes(pfd, base, h)
	})
}

// inParent calls f with an open descriptor of path's parent, reached from root one component at a time
// (O_NOFOLLOW: a symlink anywhere on the way fails), and path's last component ("." for the root).
func inParent(root int, path string, f func(pfd int, base string) error) error {
	if path == "" {
		return f(root, ".")
	}
	parts := strings.Split(path, "/")
	pfd := root
	for _, c := range parts[:len(parts)-1] {
		next, err := syscall.Openat(pfd, c, syscall.O_RDONLY|syscall.O_DIRECTORY|syscall.O_NOFOLLOW|syscall.O_CLOEXEC, 0)
		if pfd != root {
			syscall.Close(pfd)
		}
		if err != nil {
			return err
		}
		pfd = next
	}
	err := f(pfd, parts[len(parts)-1])
	if pfd != root {
		syscall.Close(pfd)
	}
	return err
}

// setTimes: the member's modification time (whole seconds, as archived); its access time is left as
// the creation made it.
func setTimes(pfd int, base string, h *tar.Header) error {
	ts := [2]syscall.Timespec{{Nsec: utimeOmit}, {Sec: h.ModTime.Unix()}}
	p, err := syscall.BytePtrFromString(base)
	if err != nil {
		return err
	}
	_, _, e := syscall.Syscall6(syscall.SYS_UTIMENSAT, uintptr(pfd), uintptr(unsafe.Pointer(p)),
		uintptr(unsafe.Pointer(&ts[0])), atSymlinkNofollow, 0, 0)
	if e != 0 {
		return e
	}
	return nil
}

func symlinkat(target string, pfd int, base string) error {
	t, err := syscall.BytePtrFromString(target)
	if err != nil {
		return err
	}
	b, err := syscall.BytePtrFromString(base)
	if err != nil {
		return err
	}
	_, _, e := syscall.Syscall(syscall.SYS_SYMLINKAT, uintptr(unsafe.Pointer(t)), uintptr(pfd), uintptr(unsafe.Pointer(b)))
	if e != 0 {
		return e
	}
	return nil
}

func lstatat(dirfd int, name string, st *syscall.Stat_t) error {
	p, err := syscall.BytePtrFromString(name)
	if err != nil {
		return err
	}
	_, _, e := syscall.Syscall6(syscall.SYS_NEWFSTATAT, uintptr(dirfd), uintptr(unsafe.Pointer(p)),
		uintptr(unsafe.Pointer(st)), atSymlinkNofollow, 0, 0)
	if e != 0 {
		return e
	}
	return nil
}

func readlinkat(dirfd int, name string) (string, error) {
	p, err := syscall.BytePtrFromString(name)
	if err != nil {
		return "", err
	}
	buf := make([]byte, 4096)
	n, _, e := syscall.Syscall6(syscall.SYS_READLINKAT, uintptr(dirfd), uintptr(unsafe.Pointer(p)),
		uintptr(unsafe.Pointer(&buf[0])), uintptr(len(buf)), 0, 0)
	if e != 0 {
		return "", e
	}
	if int(n) >= len(buf) {
		return "", errNotHere
	}
	return string(buf[:n]), nil
}
