package embedetcd

import (
	"context"
	"net"
	"net/url"
	"path/filepath"
	"testing"
)

// TestStartRetriesATakenPort: the first client port Start picks is taken
// by someone else before etcd binds it, as another test binary might;
// Start must try other ports and serve.
func TestStartRetriesATakenPort(t *testing.T) {
	taken, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer taken.Close()
	calls := 0
	pickURL = func() (url.URL, error) {
		calls++
		if calls == 1 {
			return url.URL{Scheme: "http", Host: taken.Addr().String()}, nil
		}
		return freeURL()
	}
	defer func() { pickURL = freeURL }()
	srv, err := Start(filepath.Join(t.TempDir(), "etcd"), Options{})
	if err != nil {
		t.Fatalf("Start = %v; want it to try other ports", err)
	}
	defer srv.Stop()
	if srv.Endpoint() == "http://"+taken.Addr().String() {
		t.Fatalf("serving on the taken port %s", srv.Endpoint())
	}
	cli, err := srv.Client()
	if err != nil {
		t.Fatal(err)
	}
	defer cli.Close()
	if _, err := cli.Put(context.Background(), "k", "v"); err != nil {
		t.Fatal(err)
	}
	if calls < 4 {
		t.Errorf("%d ports picked; want a second pair after the taken one", calls)
	}
}
