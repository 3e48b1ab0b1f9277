package vault

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"
)

// TestTransportGivesUpOnASilentNode: a request whose answer has not begun
// within headerWait fails, saying why, while a patient one (a
// certificate's issue) waits for its answer; a slow body is not cut.
func TestTransportGivesUpOnASilentNode(t *testing.T) {
	release := make(chan struct{})
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch r.URL.Path {
		case "/v1/secret/data/x", "/v1/pki/issue/web":
			select {
			case <-release:
			case <-r.Context().Done():
				return
			}
		case "/v1/slow-body":
			w.WriteHeader(http.StatusOK)
			w.(http.Flusher).Flush()
			time.Sleep(600 * time.Millisecond)
		}
		io.WriteString(w, "{}")
	}))
	defer srv.Close()
	defer close(release)
	c := &http.Client{Transport: transport{next: http.DefaultTransport.(*http.Transport).Clone(), headerWait: 300 * time.Millisecond}}

	start := time.Now()
	_, err := c.Get(srv.URL + "/v1/secret/data/x")
	if err == nil || !strings.Contains(err.Error(), "no answer within 300ms") {
		t.Fatalf("a silent node: %v; want no answer within 300ms", err)
	}
	if took := time.Since(start); took > 5*time.Second {
		t.Errorf("gave up after %v", took)
	}

	resp, err := c.Get(srv.URL + "/v1/slow-body")
	if err != nil {
		t.Fatal(err)
	}
	if body, err := io.ReadAll(resp.Body); err != nil || string(body) != "{}" {
		t.Errorf("a slow body: %q, %v", body, err)
	}
	resp.Body.Close()

	go func() {
		time.Sleep(time.Second)
		release <- struct{}{}
	}()
	req, err := http.NewRequestWithContext(withPatience(context.Background()), http.MethodPost, srv.URL+"/v1/pki/issue/web", strings.NewReader("{}"))
	if err != nil {
		t.Fatal(err)
	}
	resp, err = c.Do(req)
	if err != nil {
		t.Fatalf("an issue waiting a second for its certificate: %v", err)
	}
	resp.Body.Close()
}
