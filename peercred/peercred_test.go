package peercred

import (
	"net"
	"os"
	"testing"

	"github.com/vishvananda/netlink"
)

// TestUIDOverLoopbackTCP: both ends of a loopback connection of this
// process are its user's, found by the kernel's socket diagnostics and by
// /proc/net alike. (admin's and source/etcd's tests check real other
// users.)
func TestUIDOverLoopbackTCP(t *testing.T) {
	for _, network := range []string{"tcp4", "tcp6"} {
		addr := map[string]string{"tcp4": "127.0.0.1:0", "tcp6": "[::1]:0"}[network]
		l, err := net.Listen(network, addr)
		if err != nil {
			t.Logf("%s: %v", network, err)
			continue
		}
		defer l.Close()
		client, err := net.Dial(network, l.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		defer client.Close()
		server, err := l.Accept()
		if err != nil {
			t.Fatal(err)
		}
		defer server.Close()
		me := os.Getuid()
		if got := UID(server); got != me {
			t.Errorf("%s: the client's user %d; want %d", network, got, me)
		}
		if got := UID(client); got != me {
			t.Errorf("%s: the server's user %d; want %d", network, got, me)
		}
		local, remote := server.LocalAddr().(*net.TCPAddr), server.RemoteAddr().(*net.TCPAddr)
		sock, err := netlink.SocketGet(remote, local)
		if err != nil || sock == nil || int(sock.UID) != me {
			t.Errorf("%s: socket diagnostics: %+v, %v", network, sock, err)
		}
		table := map[string]string{"tcp4": "/proc/net/tcp", "tcp6": "/proc/net/tcp6"}[network]
		if got := socketOwner(table, remote, local); got != me {
			t.Errorf("%s: %s says %d; want %d", network, table, got, me)
		}
	}
}
