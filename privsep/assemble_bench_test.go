package privsep

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"runtime"
	"testing"
)

// BenchmarkAssemble is what the monitor's heap holds for the payloads of
// 1,000 mounts of 100 files of 75 bytes (the sizes of
// BenchmarkScale100kKeys) assembled from the worker's frames, decoded from
// the wire as the monitor decodes them. After a collection, with every
// payload still held: live-MiB (the heap's live objects), inuse-MiB (the
// heap's spans in use: live objects and the free slots among them, which
// the runtime cannot return) and the difference, frag-MiB, each above what
// the heap held before. One round assembles the 1,000 payloads: run it
// with -benchtime 3000x (three rounds; ns/op is then one payload's
// assembly).
func BenchmarkAssemble(b *testing.B) {
	const mounts, files = 1000, 100
	limits := map[string]MountLimits{}
	var wire bytes.Buffer
	enc := NewEncoder(&wire)
	value := bytes.Repeat([]byte("v"), 75)
	for i := range mounts {
		name := fmt.Sprintf("m%04d", i)
		limits[name] = MountLimits{MaxValueSize: 1 << 20, MaxFiles: 1000}
		if err := enc.Encode(&Begin{Mount: name, Revision: "main@1", Files: files}); err != nil {
			b.Fatal(err)
		}
		for k := range files {
			if err := enc.EncodeFile(fmt.Sprintf("key-%03d", k), 0o644, value); err != nil {
				b.Fatal(err)
			}
		}
		if err := enc.Encode(&Commit{}); err != nil {
			b.Fatal(err)
		}
	}
	if err := enc.Flush(); err != nil {
		b.Fatal(err)
	}
	frames := wire.Bytes()
	var live, inuse float64
	rounds := 0
	b.ResetTimer()
	for n := 0; n < b.N; n += mounts {
		b.StopTimer()
		runtime.GC()
		var base runtime.MemStats
		runtime.ReadMemStats(&base)
		b.StartTimer()
		held := make([]*Payload, 0, mounts)
		a := NewAssembler(limits, nil)
		dec := NewDecoder(bytes.NewReader(frames), FromWorker)
		for {
			m, err := dec.Decode()
			if errors.Is(err, io.EOF) {
				break
			}
			if err != nil {
				b.Fatal(err)
			}
			p, err := a.Add(m)
			if err != nil {
				b.Fatal(err)
			}
			if p != nil {
				held = append(held, p)
			}
		}
		b.StopTimer()
		runtime.GC()
		var ms runtime.MemStats
		runtime.ReadMemStats(&ms)
		live += float64(ms.HeapAlloc-base.HeapAlloc) / (1 << 20)
		inuse += float64(ms.HeapInuse-base.HeapInuse) / (1 << 20)
		rounds++
		runtime.KeepAlive(held)
		b.StartTimer()
	}
	b.ReportMetric(live/float64(rounds), "live-MiB")
	b.ReportMetric(inuse/float64(rounds), "inuse-MiB")
	b.ReportMetric((inuse-live)/float64(rounds), "frag-MiB")
}
