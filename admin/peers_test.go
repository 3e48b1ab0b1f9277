package admin

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kvmount/kvmount/internal/roottest"
)

// TestHelperProcess is the body of roottest.User.Helper's commands.
func TestHelperProcess(t *testing.T) {
	roottest.RunHelper(map[string]func() error{
		// Open $N connections to $ADDR ("unix:/path" or host:port),
		// send nothing, and hold them until killed.
		"hold": func() error {
			n, _ := strconv.Atoi(os.Getenv("N"))
			network, addr := "tcp", os.Getenv("ADDR")
			if path, ok := strings.CutPrefix(addr, "unix:"); ok {
				network, addr = "unix", path
			}
			var conns []net.Conn
			for range n {
				c, err := net.DialTimeout(network, addr, time.Second)
				if err == nil {
					conns = append(conns, c)
				}
			}
			fmt.Println("held", len(conns))
			time.Sleep(time.Hour)
			return nil
		},
	})
}

// TestOneUsersIdleConnectionsDelayNoOne is the second review's fourteenth
// finding: a real unprivileged user holding 300 idle connections to the
// public endpoint made every /readyz of others time out. They now hold
// MaxConnectionsPerUser of them at most; the rest are closed as accepted,
// and another user's request is answered at once — over TCP on loopback
// and over the public unix socket alike.
func TestOneUsersIdleConnectionsDelayNoOne(t *testing.T) {
	u := roottest.NewUser(t)
	base := roottest.TempDir(t)
	sock := filepath.Join(base, "public.sock")
	for _, address := range []string{freeLoopbackAddr(t), "unix:" + sock} {
		t.Run(address, func(t *testing.T) {
			s := New(Options{})
			ctx, cancel := context.WithCancel(context.Background())
			done := make(chan error, 1)
			go func() { done <- s.Run(ctx) }()
			defer func() { cancel(); <-done }()
			s.SetEndpoints(Endpoints{Address: address})
			client, url := &http.Client{Timeout: 3 * time.Second}, "http://"+address+"/healthz"
			path, isUnix := strings.CutPrefix(address, "unix:")
			if isUnix {
				client, url = unixClient(path), "http://kvmount/healthz"
				client.Timeout = 3 * time.Second
			}
			waitCode(t, client, url, http.StatusOK)
			if isUnix {
				// A member of the socket's group, as far as the user goes.
				if err := os.Chmod(path, 0o666); err != nil {
					t.Fatal(err)
				}
			}
			hold := u.Helper(t, "hold", "N=300", "ADDR="+address)
			out, err := hold.StdoutPipe()
			if err != nil {
				t.Fatal(err)
			}
			if err := hold.Start(); err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _ = hold.Process.Kill(); _ = hold.Wait() })
			line := make([]byte, 64)
			n, _ := out.Read(line)
			t.Logf("the user: %s", strings.TrimSpace(string(line[:n])))
			for i := range 5 {
				start := time.Now()
				if code := getURL(client, url); code != http.StatusOK {
					t.Fatalf("request %d while the user holds their connections: %d after %v", i, code, time.Since(start))
				}
				if d := time.Since(start); d > 2*time.Second {
					t.Errorf("request %d took %v while the user holds their connections", i, d)
				}
			}
		})
	}
}

// freeLoopbackAddr returns a loopback address no one listens on now.
func freeLoopbackAddr(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().String()
}
