package fsutil

import (
	"fmt"
	"runtime"

	"golang.org/x/sys/unix"
)

// OnThrowawayThread runs f on an OS thread of its own that ends when f
// returns, so that whatever f does to the thread — a mount namespace of
// its own, another file-system identity — dies with it and never reaches
// another goroutine. The thread is never the process's main thread: Go
// does not end that one, and /proc/self shows the main thread's state to
// every thread.
func OnThrowawayThread(f func()) {
	done := make(chan struct{})
	go func() {
		defer close(done)
		runtime.LockOSThread()
		if unix.Gettid() == unix.Getpid() {
			// Holding the main thread keeps the goroutine below off it.
			OnThrowawayThread(f)
			runtime.UnlockOSThread()
			return
		}
		f() // never unlocked: the thread ends with this goroutine
	}()
	<-done
}

// AsFSUser runs f with the file-system user and group ids uid and gid
// (setfsuid(2), setfsgid(2)) and no supplementary group, on a throwaway
// thread (OnThrowawayThread): every permission check of the file-system
// calls f makes is the one the kernel makes for that user — setting the
// file-system uid from 0 to another drops CAP_DAC_OVERRIDE, CAP_FOWNER and
// the other file capabilities of the thread (capabilities(7)) — so f can
// do nothing that user could not. It returns f's error, or one saying the
// ids could not be taken.
func AsFSUser(uid, gid int, f func() error) error {
	var err error
	OnThrowawayThread(func() {
		// Supplementary groups are the process's; drop them for this
		// thread alone with the raw system call (Go's Setgroups would
		// change every thread).
		if _, _, errno := unix.RawSyscall(unix.SYS_SETGROUPS, 0, 0, 0); errno != 0 {
			err = fmt.Errorf("setgroups: %w", errno)
			return
		}
		unix.SetfsgidRetGid(gid)
		unix.SetfsuidRetUid(uid)
		gotGID, _ := unix.SetfsgidRetGid(-1)
		gotUID, _ := unix.SetfsuidRetUid(-1)
		if gotUID != uid || gotGID != gid {
			err = fmt.Errorf("cannot take file-system ids %d:%d (have %d:%d)", uid, gid, gotUID, gotGID)
			return
		}
		err = f()
	})
	return err
}
