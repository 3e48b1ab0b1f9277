package projector

import (
	"errors"
	"fmt"
	"os"
	"sync"

	"golang.org/x/sys/unix"
)

// The fsyncs of a version being built, issued together.

// syncBatch fsyncs the files and directories of a version being built
// syncBatchSize at a time, concurrently, and closes the files. Issued one
// after the other, each fsync waits for a journal commit (or, on ext4
// without a journal, a write of the inode's block) of its own; issued
// together, they share them: a one-key write on ext4
// (BenchmarkWriteOneKey/writer-synced) took 1.11–1.39 ms with the
// manifest and the directories fsynced one after the other, after the
// files, and 0.98–1.16 ms with all of them in one batch (BENCHMARKS.md,
// "Put → file on disk"). The batch bounds the open files, and the threads
// blocked in fsync.
type syncBatch struct {
	// files and fds (files as descriptors, with their names for errors)
	// are fsynced and closed; dirs are fsynced only: their owner holds
	// them open.
	files []*os.File
	fds   []queuedFd
	dirs  []queuedDir
	err   error
}

// queuedFd is a file of a syncBatch, as a descriptor, and its name for
// errors.
type queuedFd struct {
	fd   int
	name string
}

// queuedDir is a directory of a syncBatch, and its name for errors.
type queuedDir struct {
	f    *os.File
	name string
}

// syncBatchSize is how many files and directories a batch fsyncs at once.
// Measured on ext4 with 1,000 new mounts of 100 files (BENCHMARKS.md,
// "Restart at scale"): how many mounts are written at once matters, the
// batch hardly (1, 4, 8 and 32 within the noise with 1,000 mounts at
// once); 8 lets 512 mounts be written at once with 4,096 threads in fsync
// at most.
const syncBatchSize = 8

// MaxOpenFiles is how many files one write of a flat payload (no
// subdirectories) holds open at most, beside the writer's own handles on
// its mount directory and the manifest directory: a batch of files being
// fsynced, the new and the current version's directories, and a directory
// being fsynced. A payload with subdirectories holds two more for each.
const MaxOpenFiles = syncBatchSize + 3

// add queues the file f, to be fsynced and closed, fsyncing the batch when
// it is full. It returns the first error of a fsync or close so far.
func (b *syncBatch) add(f *os.File) error {
	b.files = append(b.files, f)
	return b.flushFull()
}

// addFd queues the file fd, named name in errors, to be fsynced and
// closed, as add does.
func (b *syncBatch) addFd(fd int, name string) error {
	b.fds = append(b.fds, queuedFd{fd, name})
	return b.flushFull()
}

// addDir queues the directory d, named name in errors, to be fsynced
// (through syncFile) and left open, fsyncing the batch when it is full. It
// returns the first error of a fsync or close so far.
func (b *syncBatch) addDir(d *os.File, name string) error {
	b.dirs = append(b.dirs, queuedDir{d, name})
	return b.flushFull()
}

func (b *syncBatch) flushFull() error {
	if len(b.files)+len(b.fds)+len(b.dirs) >= syncBatchSize {
		return b.flush()
	}
	return b.err
}

// maxSyncGoroutines bounds the goroutines that fsync for every batch of
// the process together. A batch's last fsync runs on the writer's own
// goroutine, which waits for the batch anyway; the others each on a
// goroutine of their own while one of maxSyncGoroutines is free, else on
// the writer's goroutine too, one after the other. The Go runtime keeps a
// record of every goroutine that ever ran at once for the process's life
// (480 bytes each, in allgs): a cold start of 1,000 mounts, 512 written at
// once with up to eight fsyncs each, left 2,541 of them, 1.2 MB of the
// monitor's live heap at rest (BENCHMARKS.md, "The monitor's collector
// target"). How many mounts are written at once is what makes a cold
// start fast, not how many of one's files are fsynced at once ("Restart
// at scale": batches of 1, 4, 8 and 32 within the noise); a write alone,
// as an update is, still has its batch fsynced together.
const maxSyncGoroutines = 64

// syncSlots holds a token for each goroutine fsyncing for a batch.
var syncSlots = make(chan struct{}, maxSyncGoroutines)

// flush fsyncs every queued file and directory, concurrently, closes the
// files, and returns the first error so far.
func (b *syncBatch) flush() error {
	errs := make([]error, len(b.files)+len(b.fds)+len(b.dirs))
	jobs := make([]func(), 0, len(errs))
	for i, f := range b.files {
		jobs = append(jobs, func() {
			if err := f.Sync(); err != nil {
				errs[i] = fmt.Errorf("atomic writer: %w", err)
			}
			if err := f.Close(); err != nil && errs[i] == nil {
				errs[i] = fmt.Errorf("atomic writer: %w", err)
			}
		})
	}
	for i, q := range b.fds {
		i += len(b.files)
		jobs = append(jobs, func() {
			if err := fsyncFd(q.fd); err != nil {
				errs[i] = fmt.Errorf("atomic writer: fsync %s: %w", q.name, err)
			}
			if err := unix.Close(q.fd); err != nil && errs[i] == nil {
				errs[i] = fmt.Errorf("atomic writer: close %s: %w", q.name, err)
			}
		})
	}
	for i, d := range b.dirs {
		i += len(b.files) + len(b.fds)
		jobs = append(jobs, func() {
			if err := syncFile(d.f); err != nil {
				errs[i] = fmt.Errorf("atomic writer: fsync %s: %w", d.name, err)
			}
		})
	}
	var wg sync.WaitGroup
	var inline []func()
	for i, job := range jobs {
		if i == len(jobs)-1 {
			inline = append(inline, job)
			break
		}
		select {
		case syncSlots <- struct{}{}:
			wg.Go(func() {
				defer func() { <-syncSlots }()
				job()
			})
		default:
			inline = append(inline, job)
		}
	}
	for _, job := range inline {
		job()
	}
	wg.Wait()
	b.files, b.fds, b.dirs = b.files[:0], b.fds[:0], b.dirs[:0]
	if b.err == nil {
		b.err = errors.Join(errs...)
	}
	return b.err
}

// fsyncFd fsyncs the file fd, retrying a call a signal interrupted, as
// os.File.Sync does.
func fsyncFd(fd int) error {
	for {
		if err := unix.Fsync(fd); err != unix.EINTR {
			return err
		}
	}
}

// discard closes the queued files without fsyncing anything: after an
// error, the version will not be switched to.
func (b *syncBatch) discard() {
	for _, f := range b.files {
		_ = f.Close()
	}
	for _, q := range b.fds {
		_ = unix.Close(q.fd)
	}
	b.files, b.fds, b.dirs = nil, nil, nil
}
