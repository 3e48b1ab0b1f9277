package projector

import (
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"testing"

	"golang.org/x/sync/errgroup"
)

// payloadOf returns a payload of n files of size bytes each, in one
// directory (dirs 0) or spread over dirs directories.
func payloadOf(n, size, dirs int) Payload {
	p := make(Payload, n)
	data := make([]byte, size)
	for i := range n {
		name := fmt.Sprintf("key-%05d", i)
		if dirs > 0 {
			name = fmt.Sprintf("dir-%d/%s", i%dirs, name)
		}
		p[name] = File{Data: data, Mode: 0o644, UID: os.Geteuid(), GID: os.Getegid()}
	}
	return p
}

// withChange returns a copy of payload whose file at path holds the
// decimal i instead.
func withChange(payload Payload, path string, i int) Payload {
	next := maps.Clone(payload)
	next[path] = File{Data: []byte(fmt.Sprint(i)), Mode: 0o644, UID: os.Geteuid(), GID: os.Getegid()}
	return next
}

// BenchmarkWriteOneChange measures one write that changes one file of a
// mount of 1,000 files of 1 KiB (unchanged files are hard-linked), flat or
// in ten directories, with and without fsync.
func BenchmarkWriteOneChange(b *testing.B) {
	for _, bc := range []struct {
		dirs int
		sync bool
	}{{0, true}, {0, false}, {10, true}, {10, false}} {
		b.Run(fmt.Sprintf("keys=1000/dirs=%d/sync=%v", bc.dirs, bc.sync), func(b *testing.B) {
			w, err := OpenAtomicWriter(b.TempDir(), WriterOptions{Sync: bc.sync, DirUID: -1, DirGID: -1})
			if err != nil {
				b.Fatal(err)
			}
			defer w.Close()
			payload := payloadOf(1000, 1024, bc.dirs)
			first := payload.Paths()[0]
			if _, err := w.Write(payload); err != nil {
				b.Fatal(err)
			}
			b.ResetTimer()
			for i := range b.N {
				payload = withChange(payload, first, i)
				if _, err := w.Write(payload); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// BenchmarkWriteNewMounts measures the first write of 64 new disk mounts
// of 100 files of 100 bytes each, with their manifests and every fsync,
// 32 at once: a cold start's setups in small (reconcile writes at most 32
// mounts at once). One op is all 64; choose the file system with TMPDIR.
func BenchmarkWriteNewMounts(b *testing.B) {
	const mounts, parallel = 64, 32
	payload := payloadOf(100, 100, 0)
	for b.Loop() {
		b.StopTimer()
		base := b.TempDir()
		dirs := make([]string, mounts)
		for i := range dirs {
			dirs[i] = filepath.Join(base, fmt.Sprintf("m%02d", i))
			for _, d := range []string{dirs[i], dirs[i] + ".manifests"} {
				if err := os.Mkdir(d, 0o755); err != nil {
					b.Fatal(err)
				}
			}
		}
		b.StartTimer()
		var g errgroup.Group
		g.SetLimit(parallel)
		for _, dir := range dirs {
			g.Go(func() error {
				w, err := OpenAtomicWriter(dir, WriterOptions{ManifestDir: dir + ".manifests", Sync: true, DirUID: -1, DirGID: -1})
				if err != nil {
					return err
				}
				defer w.Close()
				_, err = w.Write(payload)
				return err
			})
		}
		if err := g.Wait(); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkWriteNoChange measures a write of an unchanged 1,000-file
// payload: the comparison and the visible-symlink check, no I/O beyond
// one directory read.
func BenchmarkWriteNoChange(b *testing.B) {
	w, err := OpenAtomicWriter(b.TempDir(), WriterOptions{Sync: true, DirUID: -1, DirGID: -1})
	if err != nil {
		b.Fatal(err)
	}
	defer w.Close()
	payload := payloadOf(1000, 1024, 0)
	if _, err := w.Write(payload); err != nil {
		b.Fatal(err)
	}
	b.ResetTimer()
	for range b.N {
		if _, err := w.Write(payload); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkFilesystemOps measures the system calls a write is made of, one
// per iteration, in the test's temporary directory (choose the file system
// with TMPDIR): they set the floor under BenchmarkWriteOneChange.
func BenchmarkFilesystemOps(b *testing.B) {
	dirs := func(b *testing.B) (src, dst string) {
		src, dst = b.TempDir(), b.TempDir()
		for i := range b.N {
			if err := os.WriteFile(fmt.Sprintf("%s/f%d", src, i), nil, 0o644); err != nil {
				b.Fatal(err)
			}
		}
		b.ResetTimer()
		return src, dst
	}
	b.Run("create", func(b *testing.B) {
		_, dst := dirs(b)
		for i := range b.N {
			if err := os.WriteFile(fmt.Sprintf("%s/f%d", dst, i), []byte("value"), 0o644); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("link", func(b *testing.B) {
		src, dst := dirs(b)
		for i := range b.N {
			if err := os.Link(fmt.Sprintf("%s/f%d", src, i), fmt.Sprintf("%s/f%d", dst, i)); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("unlink", func(b *testing.B) {
		src, _ := dirs(b)
		for i := range b.N {
			if err := os.Remove(fmt.Sprintf("%s/f%d", src, i)); err != nil {
				b.Fatal(err)
			}
		}
	})
}

// BenchmarkWriteOneKey measures the atomic writer's share of put → file
// for the smallest mount, one key of 11 bytes changed at each write, without
// fsync (choose the file system with TMPDIR; tmpfs is the medium the floor
// is measured on). "floor" is what daemon/floor_bench_test.go's floor does
// for the same update — a version directory, its one file, a symlink
// renamed over ..data, the replaced version removed — and "writer" the
// AtomicWriter's Write (the replaced version is retired and removed after
// its grace, outside the timed loop's writes when the grace is longer).
// "writer-synced" is the writer as on a disk mount: with a manifest and
// every fsync (WriterOptions.Sync), to run with TMPDIR on a disk.
func BenchmarkWriteOneKey(b *testing.B) {
	file := func(i int) File {
		return File{Data: fmt.Appendf(nil, "update %04d", i%10000), Mode: 0o644, UID: os.Geteuid(), GID: os.Getegid()}
	}
	for _, synced := range []bool{false, true} {
		name := "writer"
		if synced {
			name = "writer-synced"
		}
		b.Run(name, func(b *testing.B) {
			dir := b.TempDir()
			opts := WriterOptions{DirUID: -1, DirGID: -1}
			if synced {
				opts.ManifestDir, opts.Sync = manifestDir(b, dir), true
			}
			w, err := OpenAtomicWriter(dir, opts)
			if err != nil {
				b.Fatal(err)
			}
			defer w.Close()
			i := 0
			for b.Loop() {
				i++
				if _, err := w.Write(Payload{"key-00000": file(i)}); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
	b.Run("floor", func(b *testing.B) {
		dir := b.TempDir()
		old := ""
		i := 0
		for b.Loop() {
			i++
			version := fmt.Sprintf("..v%d", i)
			if err := os.Mkdir(filepath.Join(dir, version), 0o755); err != nil {
				b.Fatal(err)
			}
			if err := os.WriteFile(filepath.Join(dir, version, "key-00000"), file(i).Data, 0o644); err != nil {
				b.Fatal(err)
			}
			if err := os.Symlink(version, filepath.Join(dir, "..data_tmp")); err != nil {
				b.Fatal(err)
			}
			if err := os.Rename(filepath.Join(dir, "..data_tmp"), filepath.Join(dir, "..data")); err != nil {
				b.Fatal(err)
			}
			if old != "" {
				if err := os.RemoveAll(filepath.Join(dir, old)); err != nil {
					b.Fatal(err)
				}
			}
			old = version
		}
	})
}

// BenchmarkPayloadDigest measures Payload.Digest of a mount of 100 files
// of 100 bytes, the size of BenchmarkScale100kKeys' mounts, which the
// reconciler computes once per mount after a restart to find the mounts
// changed while kvmount was down; and the digest of the same payload's
// manifest entries, which every adoption checks its manifest against.
func BenchmarkPayloadDigest(b *testing.B) {
	payload := payloadOf(100, 100, 4)
	b.Run("payload", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			payload.Digest()
		}
	})
	b.Run("manifest", func(b *testing.B) {
		entries := make([]manifestEntry, 0, len(payload))
		for _, p := range payload.Paths() {
			entries = append(entries, entryOf(p, payload[p]))
		}
		b.ReportAllocs()
		for b.Loop() {
			payloadDigest(entries)
		}
	})
}

// BenchmarkWriteForgotten measures one write that changes one file of a
// mount of 1, 100 or 1,000 files of 100 bytes, with the writer's copy of
// the current payload held (held) or forgotten before each write
// (forgotten: the manifest is read again), and the replaced version
// collected after each: what reconcile pays for a payload released
// (release.go). Choose the file system with TMPDIR (/dev/shm for tmpfs).
func BenchmarkWriteForgotten(b *testing.B) {
	for _, n := range []int{1, 100, 1000} {
		for _, forget := range []bool{false, true} {
			name := fmt.Sprintf("files=%d/held", n)
			if forget {
				name = fmt.Sprintf("files=%d/forgotten", n)
			}
			b.Run(name, func(b *testing.B) {
				dir := b.TempDir()
				w, err := OpenAtomicWriter(dir, WriterOptions{ManifestDir: manifestDir(b, dir), DirUID: -1, DirGID: -1})
				if err != nil {
					b.Fatal(err)
				}
				defer w.Close()
				payload := payloadOf(n, 100, 0)
				first := payload.Paths()[0]
				if _, err := w.Write(payload); err != nil {
					b.Fatal(err)
				}
				b.ResetTimer()
				for i := range b.N {
					payload = withChange(payload, first, i)
					if forget {
						w.ForgetPayload()
					}
					if _, err := w.Write(payload); err != nil {
						b.Fatal(err)
					}
					if _, err := w.Collect(w.CollectDue()); err != nil {
						b.Fatal(err)
					}
				}
			})
		}
	}
}
