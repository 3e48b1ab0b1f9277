package exepages

import (
	"os"
	"reflect"
	"strings"
	"testing"
)

// smaps is /proc/self/smaps of a dynamically linked build (cgo), cut
// down: its header, text, read-only data, the RELRO page the dynamic
// loader wrote to, its data, a heap mapping and a library's text.
const smaps = `00400000-00402000 r--p 00000000 fd:01 5243102                            /usr/bin/kvmount
Size:                  8 kB
Rss:                   8 kB
Anonymous:             0 kB
VmFlags: rd mr mw me dw sd
00402000-00e65000 r-xp 00002000 fd:01 5243102                            /usr/bin/kvmount (deleted)
Size:              10636 kB
Rss:                9164 kB
Pss:                4582 kB
Anonymous:             0 kB
THPeligible:           0
VmFlags: rd ex mr mw me dw sd
00e65000-01a53000 r--p 00a65000 fd:01 5243102                            /usr/bin/kvmount
Size:              12216 kB
Rss:                8504 kB
Anonymous:             0 kB
VmFlags: rd mr mw me dw sd
01a53000-01a54000 r--p 01653000 fd:01 5243102                            /usr/bin/kvmount
Size:                  4 kB
Rss:                   4 kB
Anonymous:             4 kB
VmFlags: rd mr mw me ac sd
01a54000-01afe000 rw-p 01654000 fd:01 5243102                            /usr/bin/kvmount
Size:                680 kB
Rss:                 500 kB
Anonymous:           120 kB
VmFlags: rd wr mr mw me ac sd
02c8e000-02caf000 rw-p 00000000 00:00 0                                  [heap]
Size:                132 kB
Rss:                   8 kB
Anonymous:             8 kB
VmFlags: rd wr mr mw me ac sd
7f0e3c028000-7f0e3c1b0000 r-xp 00028000 fd:01 5250001                    /usr/lib/x86_64-linux-gnu/libc.so.6
Size:               1568 kB
Rss:                 800 kB
Anonymous:             0 kB
VmFlags: rd ex mr mw me sd
7f0e3c1b0000-7f0e3c1c0000 r--s 00000000 fd:01 5243102                    /usr/bin/kvmount
Size:                 64 kB
Rss:                  64 kB
Anonymous:             0 kB
VmFlags: rd mr me ms sd
`

func TestParseSmaps(t *testing.T) {
	got, err := parseSmaps(strings.NewReader(smaps), 0xfd, 0x01, 5243102)
	if err != nil {
		t.Fatal(err)
	}
	// The header, the text and the read-only data: not the RELRO page
	// (a page of its own), the data (writable), the heap, the library (another
	// file) or a shared mapping.
	want := []span{
		{start: 0x400000, end: 0x402000, rss: 8 << 10},
		{start: 0x402000, end: 0xe65000, rss: 9164 << 10},
		{start: 0xe65000, end: 0x1a53000, rss: 8504 << 10},
	}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("parseSmaps = %#v, want %#v", got, want)
	}
	im := &Image{spans: got}
	if im.Size() != 0x1a53000-0x400000 || im.Resident() != (8+9164+8504)<<10 {
		t.Fatalf("Size %d, Resident %d", im.Size(), im.Resident())
	}
	// Another device, the same inode: nothing.
	if other, err := parseSmaps(strings.NewReader(smaps), 0xfd, 0x02, 5243102); err != nil || len(other) != 0 {
		t.Fatalf("another device: %v, %v", other, err)
	}
}

func TestParseSmapsRefusesGarbage(t *testing.T) {
	for _, text := range []string{
		"00400000 r--p 00000000 fd:01 5243102 /x\n",                        // no range
		"00500000-00400000 r--p 00000000 fd:01 5243102 /x\n",               // backwards
		"00400000-00402000 r--p 00000000 fd01 5243102 /x\n",                // device
		"00400000-00402000 r--p 00000000 fd:01 5243102 /x\nRss: 8 pages\n", // unit
		"00400000-00402000 r--p 00000000 fd:01 5243102 /x\nRss: x kB\n",    // number
	} {
		if _, err := parseSmaps(strings.NewReader(text), 0xfd, 0x01, 5243102); err == nil {
			t.Errorf("parseSmaps(%q) = nil error", text)
		}
	}
}

// TestDropUnmapsTheExecutable drops the test binary's own pages: its
// mappings are found, resident, and fewer of their pages are mapped after
// the Drop, while the program goes on running from them.
func TestDropUnmapsTheExecutable(t *testing.T) {
	before, err := Find()
	if err != nil {
		t.Fatal(err)
	}
	defer before.Close()
	if pc := int64(reflect.ValueOf(Find).Pointer()); !holds(before, pc) {
		t.Fatalf("no mapping found holds Find's code at %#x: %#v", pc, before.spans)
	}
	resident, size := before.Resident(), before.Size()
	if resident <= 0 || resident > size {
		t.Fatalf("%d bytes resident of %d", resident, size)
	}
	if err := before.Drop(); err != nil {
		t.Fatal(err)
	}
	after, err := Find()
	if err != nil {
		t.Fatal(err)
	}
	defer after.Close()
	t.Logf("the test binary's pages mapped: %d KiB before the drop, %d KiB after (%d KiB mapped)", resident>>10, after.Resident()>>10, size>>10)
	if after.Resident() >= resident {
		t.Fatalf("%d bytes mapped after the drop, %d before", after.Resident(), resident)
	}
	// A nil image has nothing to drop.
	var none *Image
	if err := none.Drop(); err != nil || none.Size() != 0 || none.Resident() != 0 {
		t.Fatalf("nil image: %v", err)
	}
}

// TestDropKeepsWrittenPages: a page of the executable written since Find
// — as a debugger writes a breakpoint, and the kernel a uprobe, into a
// private copy — keeps its mapping out of a later Drop, which reads smaps
// again: the copy, and the breakpoint in it, stay. The test writes a byte
// of its own code back unchanged through /proc/self/mem, the interface
// debuggers use (proc(5)).
func TestDropKeepsWrittenPages(t *testing.T) {
	im, err := Find()
	if err != nil {
		t.Fatal(err)
	}
	defer im.Close()
	pc := int64(reflect.ValueOf(kilobytes).Pointer())
	if !holds(im, pc) {
		t.Fatalf("no mapping found holds kilobytes' code at %#x", pc)
	}
	mem, err := os.OpenFile("/proc/self/mem", os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer mem.Close()
	b := make([]byte, 1)
	if _, err := mem.ReadAt(b, pc); err != nil {
		t.Fatal(err)
	}
	if _, err := mem.WriteAt(b, pc); err != nil {
		t.Fatal(err)
	}
	if err := im.Drop(); err != nil {
		t.Fatal(err)
	}
	if holds(im, pc) {
		t.Fatal("Drop unmapped the mapping with a written page")
	}
	// The written copy is still there: the mapping still holds a page of
	// its own, where a blind MADV_DONTNEED would have thrown it away.
	again, err := Find()
	if err != nil {
		t.Fatal(err)
	}
	defer again.Close()
	if holds(again, pc) {
		t.Fatal("the written page is gone after Drop")
	}
	if len(again.spans) == 0 {
		t.Fatal("no other mapping of the executable found")
	}
	// Closed, an image drops nothing.
	if err := im.Close(); err != nil {
		t.Fatal(err)
	}
	if err := im.Drop(); err != nil {
		t.Fatalf("Drop after Close: %v", err)
	}
}

// holds reports whether one of im's mappings, as last read, holds addr.
func holds(im *Image, addr int64) bool {
	im.mu.Lock()
	defer im.mu.Unlock()
	for _, s := range im.spans {
		if int64(s.start) <= addr && addr < int64(s.end) {
			return true
		}
	}
	return false
}
