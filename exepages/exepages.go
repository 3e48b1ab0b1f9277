// Package exepages lets a long-running process stop holding the pages of
// its own executable that it mapped once and no longer runs: the start's
// code, every package's initialisation, the configuration's parsing.
//
// A Go binary's text, read-only data and function tables (kvmount's are
// 23 MB) are file pages, mapped from the page cache. The kernel maps more
// of them than the process touches: on a fault it maps the pages around
// the one touched that the page cache holds (fault-around, 64 KiB by
// default), and on Linux 6.18 (measured here) the whole large folio the
// page belongs to (mm/filemap.c, filemap_map_pages) — 2 MiB for the
// folios ext4 holds a file the Go linker has just written in. What is
// mapped counts in the process's RSS and PSS, and stays
// mapped for the process's life. Measured here, a daemon with one small
// mount had about 20 MiB of its binary's pages mapped across its two
// processes at rest, and 12 MiB when each dropped them after its start
// (BENCHMARKS.md, "The executable's pages").
//
// Drop unmaps them (madvise(2) MADV_DONTNEED). The pages stay in the page
// cache, shared with every process that maps them, and the kernel reclaims
// them first when memory is short; the process maps again, through a minor
// fault, what it runs next. For a private mapping that was never written,
// MADV_DONTNEED brings back the file's own content (madvise(2)), which for
// a read-only mapping of the executable is what was there: Drop reads
// /proc/self/smaps again each time and unmaps only such mappings, leaving
// out one that holds a page of its own (a dynamic loader's relocated RELRO
// page, a debugger's breakpoint, a uprobe).
package exepages

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"math"
	"os"
	"strconv"
	"strings"
	"sync"

	"golang.org/x/sys/unix"
)

// Image is the running executable's read-only private mappings. It holds
// /proc/self/smaps open from Find on, and reads it again at every Drop, so
// that what a Drop unmaps is what is clean then. Its methods are safe for
// concurrent use; a nil *Image has no mapping and drops nothing.
type Image struct {
	major, minor uint32
	ino          uint64

	mu    sync.Mutex
	smaps *os.File // /proc/self/smaps, opened by Find; nil once closed
	spans []span   // as the last read of smaps found them
}

// span is one mapping: its addresses [start, end) and the bytes of it
// resident when it was read (smaps' Rss).
type span struct {
	start, end uintptr
	rss        int64
}

// Find returns the mappings of the running executable (the file
// /proc/self/exe names, by device and inode, so a binary replaced on disk
// since the start is still found) that are private, not writable and hold
// no page of their own (smaps' Anonymous is 0), read from
// /proc/self/smaps, which the Image keeps open (close-on-exec) until
// Close. Call it before the process loses access to /proc (Landlock): an
// open descriptor stays readable after. It returns an error when
// /proc/self/exe or /proc/self/smaps cannot be read, or smaps cannot be
// parsed.
func Find() (*Image, error) {
	var st unix.Stat_t
	if err := unix.Stat("/proc/self/exe", &st); err != nil {
		return nil, fmt.Errorf("the executable: %w", err)
	}
	f, err := os.Open("/proc/self/smaps")
	if err != nil {
		return nil, err
	}
	im := &Image{major: unix.Major(st.Dev), minor: unix.Minor(st.Dev), ino: st.Ino, smaps: f}
	im.mu.Lock()
	defer im.mu.Unlock()
	if err := im.read(); err != nil {
		f.Close()
		return nil, err
	}
	return im, nil
}

// read reads smaps again from its start into im.spans. im.mu is held,
// and im.smaps open (Find, and Drop before Close).
func (im *Image) read() error {
	// A section reader reads with pread(2) from offset 0: a seq_file
	// such as smaps starts its text again there.
	spans, err := parseSmaps(io.NewSectionReader(im.smaps, 0, math.MaxInt64), im.major, im.minor, im.ino)
	if err != nil {
		return fmt.Errorf("/proc/self/smaps: %w", err)
	}
	im.spans = spans
	return nil
}

// Size returns the bytes of address space the image's mappings spanned
// at the last read of smaps (Find's or Drop's).
func (im *Image) Size() int64 {
	return im.sum(func(s span) int64 { return int64(s.end - s.start) })
}

// Resident returns the bytes of the image's mappings that were resident
// (smaps' Rss) at the last read of smaps: the pages the process had
// mapped, before Drop's unmapping when Drop read it.
func (im *Image) Resident() int64 {
	return im.sum(func(s span) int64 { return s.rss })
}

// sum adds f over the mappings of the last read of smaps; 0 for a nil
// image.
func (im *Image) sum(f func(span) int64) int64 {
	var n int64
	if im != nil {
		im.mu.Lock()
		defer im.mu.Unlock()
		for _, s := range im.spans {
			n += f(s)
		}
	}
	return n
}

// Drop reads smaps again and unmaps every page of the mappings that are
// still clean from the process's page tables (madvise(2) MADV_DONTNEED);
// the process maps again what it runs next. A mapping that holds a page
// of its own by then is left alone: the kernel writes a uprobe's or a
// debugger's breakpoint into a private copy of the page, which
// MADV_DONTNEED would throw away with the breakpoint. It returns an error,
// and unmaps nothing, when smaps cannot be read again; else the first
// error of madvise, after trying every mapping. A nil image, or one
// closed, drops nothing and returns nil.
func (im *Image) Drop() error {
	if im == nil {
		return nil
	}
	im.mu.Lock()
	defer im.mu.Unlock()
	if im.smaps == nil {
		return nil
	}
	if err := im.read(); err != nil {
		return err
	}
	var errs []error
	for _, s := range im.spans {
		// A raw call: unix.Madvise takes a []byte, which these addresses
		// would need package unsafe to make.
		if _, _, e := unix.Syscall(unix.SYS_MADVISE, s.start, s.end-s.start, unix.MADV_DONTNEED); e != 0 {
			// The size, not the addresses: a log line need not
			// tell where the program's code is.
			errs = append(errs, fmt.Errorf("madvise(MADV_DONTNEED) of a mapping of %d bytes: %w", s.end-s.start, e))
		}
	}
	return errors.Join(errs...)
}

// Close closes the image's smaps; Drop does nothing after. It returns
// close(2)'s error.
func (im *Image) Close() error {
	if im == nil {
		return nil
	}
	im.mu.Lock()
	defer im.mu.Unlock()
	if im.smaps == nil {
		return nil
	}
	err := im.smaps.Close()
	im.smaps = nil
	return err
}

// maxSmapsLine bounds a line of smaps, in bytes: a mapping's header holds
// a path of at most PATH_MAX (4,096) bytes, escaped.
const maxSmapsLine = 64 << 10

// parseSmaps returns the mappings in r, the text of /proc/<pid>/smaps
// (proc(5)), of the file on device major:minor with inode ino that are
// private ('p'), readable and not writable, and whose Anonymous field is
// 0 kB.
func parseSmaps(r io.Reader, major, minor uint32, ino uint64) ([]span, error) {
	var (
		spans []span
		cur   *span // the current mapping, when it is the file's
		anon  bool  // the current mapping holds anonymous pages
	)
	end := func() {
		if cur != nil && !anon {
			spans = append(spans, *cur)
		}
		cur, anon = nil, false
	}
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 0, 4096), maxSmapsLine)
	for sc.Scan() {
		line := sc.Text()
		name, value, isField := strings.Cut(line, ":")
		if isField && !strings.Contains(name, " ") && !strings.Contains(name, "-") {
			// A field of the current mapping: "Rss:   1234 kB".
			if cur == nil {
				continue
			}
			switch name {
			case "Rss":
				kb, err := kilobytes(value)
				if err != nil {
					return nil, fmt.Errorf("%q: %w", line, err)
				}
				cur.rss = kb << 10
			case "Anonymous":
				kb, err := kilobytes(value)
				if err != nil {
					return nil, fmt.Errorf("%q: %w", line, err)
				}
				anon = kb != 0
			}
			continue
		}
		// A mapping's header: "start-end perms offset major:minor inode path".
		end()
		s, ok, err := header(line, major, minor, ino)
		if err != nil {
			return nil, fmt.Errorf("%q: %w", line, err)
		}
		if ok {
			cur = &s
		}
	}
	if err := sc.Err(); err != nil {
		return nil, err
	}
	end()
	return spans, nil
}

// header parses a mapping's header line and reports whether it is a
// private, readable, not writable mapping of the file major:minor, ino.
func header(line string, major, minor uint32, ino uint64) (span, bool, error) {
	f := strings.Fields(line)
	if len(f) < 5 {
		return span{}, false, errors.New("not a mapping's header")
	}
	lo, hi, ok := strings.Cut(f[0], "-")
	if !ok {
		return span{}, false, errors.New("no address range")
	}
	start, err := strconv.ParseUint(lo, 16, 64)
	if err != nil {
		return span{}, false, err
	}
	stop, err := strconv.ParseUint(hi, 16, 64)
	if err != nil || stop < start {
		return span{}, false, fmt.Errorf("address range %q", f[0])
	}
	perms := f[1]
	if len(perms) != 4 || perms[0] != 'r' || perms[1] != '-' || perms[3] != 'p' {
		return span{}, false, nil
	}
	maj, mnr, ok := strings.Cut(f[3], ":")
	if !ok {
		return span{}, false, fmt.Errorf("device %q", f[3])
	}
	dmaj, err1 := strconv.ParseUint(maj, 16, 32)
	dmin, err2 := strconv.ParseUint(mnr, 16, 32)
	inode, err3 := strconv.ParseUint(f[4], 10, 64)
	if err := errors.Join(err1, err2, err3); err != nil {
		return span{}, false, err
	}
	if uint32(dmaj) != major || uint32(dmin) != minor || inode != ino || inode == 0 {
		return span{}, false, nil
	}
	return span{start: uintptr(start), end: uintptr(stop)}, true, nil
}

// kilobytes parses a field's value, "   1234 kB", in KiB.
func kilobytes(v string) (int64, error) {
	n, unit, _ := strings.Cut(strings.TrimSpace(v), " ")
	if unit != "kB" {
		return 0, fmt.Errorf("unit %q, not kB", unit)
	}
	return strconv.ParseInt(n, 10, 64)
}
