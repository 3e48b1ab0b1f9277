package http

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/kvmount/kvmount/internal/sourcetest"
)

// BenchmarkPollNotModified is the cost of one poll whose content did not
// change: a conditional GET answered 304 by a loopback server (both sides
// in this process), for a 1,000-key document.
func BenchmarkPollNotModified(b *testing.B) {
	var doc strings.Builder
	doc.WriteString("{")
	for i := range 1000 {
		if i > 0 {
			doc.WriteString(",")
		}
		fmt.Fprintf(&doc, "%q: %q", fmt.Sprintf("key-%05d", i), "value padded to look like a small config line")
	}
	doc.WriteString("}")
	body := doc.String()
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("ETag", `"v1"`)
		if r.Header.Get("If-None-Match") == `"v1"` {
			w.WriteHeader(http.StatusNotModified)
			return
		}
		io.WriteString(w, body)
	}))
	defer srv.Close()
	src, err := New("bench", &Config{URL: srv.URL, Format: FormatJSON, Timeout: DefaultTimeout, MaxBodySize: DefaultMaxBodySize}, sourcetest.Discard)
	if err != nil {
		b.Fatal(err)
	}
	defer src.Close()
	var v validators
	doc1, v, err := src.fetch(context.Background(), &v)
	if err != nil || doc1 == nil || doc1.entries.Len() != 1000 {
		b.Fatalf("first fetch = %v, %v", doc1, err)
	}
	b.ReportAllocs()
	b.ResetTimer()
	for range b.N {
		doc, next, err := src.fetch(context.Background(), &v)
		if err != nil || doc != nil {
			b.Fatalf("fetch = %v, %v; want a 304", doc, err)
		}
		v = next
	}
}
