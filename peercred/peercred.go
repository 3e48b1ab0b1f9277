// Package peercred tells which local user is at the other end of a
// connection: the user of the process that listens, for a client, or that
// connected, for a server. On a unix socket the kernel says it
// (SO_PEERCRED); on TCP over loopback, the kernel's socket diagnostics
// (else /proc/net/tcp and tcp6) name the owner of the peer's socket. kvmount uses it to refuse a store that a
// local user put on a port the real one left free (a source's peer_user),
// and to give each local user a quota of the admin endpoint's connections.
package peercred

import (
	"bufio"
	"errors"
	"fmt"
	"net"
	"os"
	"strconv"
	"strings"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// ErrWrongPeer is wrapped by Check's error for a peer that runs as another
// user than the one expected.
var ErrWrongPeer = errors.New("the process at the other end runs as another user than the configured peer_user")

// Check returns nil when the process at the other end of c runs as uid,
// else an error wrapping ErrWrongPeer that says as whom it runs (or that
// it cannot be told).
func Check(c net.Conn, uid int) error {
	got := UID(c)
	switch {
	case got == uid:
		return nil
	case got < 0:
		return fmt.Errorf("%w: %s runs as a user kvmount cannot tell (want uid %d)", ErrWrongPeer, c.RemoteAddr(), uid)
	}
	return fmt.Errorf("%w: %s runs as uid %d, want uid %d", ErrWrongPeer, c.RemoteAddr(), got, uid)
}

// UID returns the uid of the local process at the other end of c: from
// SO_PEERCRED on a unix socket; on TCP over loopback, the owner of the
// peer's socket — the one whose local address is c's remote one, and the
// other way round — as NETLINK_INET_DIAG reports it, else as /proc/net/tcp
// or tcp6 lists it. -1 when it cannot be found.
func UID(c net.Conn) int {
	switch c := c.(type) {
	case *net.UnixConn:
		raw, err := c.SyscallConn()
		if err != nil {
			return -1
		}
		uid := -1
		_ = raw.Control(func(fd uintptr) {
			if cred, err := unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED); err == nil {
				uid = int(cred.Uid)
			}
		})
		return uid
	case *net.TCPConn:
		local, ok1 := c.LocalAddr().(*net.TCPAddr)
		remote, ok2 := c.RemoteAddr().(*net.TCPAddr)
		if !ok1 || !ok2 {
			return -1
		}
		// The kernel's socket diagnostics (NETLINK_INET_DIAG, through
		// github.com/vishvananda/netlink) find the one socket by its
		// addresses; /proc/net lists them all, which a user who opens
		// hundreds of connections makes costly for each.
		if sock, err := netlink.SocketGet(remote, local); err == nil && sock != nil {
			return int(sock.UID)
		}
		for _, table := range []string{"/proc/net/tcp", "/proc/net/tcp6"} {
			if uid := socketOwner(table, remote, local); uid >= 0 {
				return uid
			}
		}
	}
	return -1
}

// socketOwner returns the uid of the socket in the /proc/net table whose
// local address is local and remote address remote, or -1.
func socketOwner(table string, local, remote *net.TCPAddr) int {
	f, err := os.Open(table)
	if err != nil {
		return -1
	}
	defer f.Close()
	wantLocal, wantRemote := procAddrs(local, table), procAddrs(remote, table)
	sc := bufio.NewScanner(f)
	sc.Scan() // the header
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) < 8 || !contains(wantLocal, fields[1]) || !contains(wantRemote, fields[2]) {
			continue
		}
		if uid, err := strconv.Atoi(fields[7]); err == nil {
			return uid
		}
	}
	return -1
}

func contains(ss []string, s string) bool {
	for _, x := range ss {
		if strings.EqualFold(x, s) {
			return true
		}
	}
	return false
}

// procAddrs returns how a /proc/net table writes a: the IP as 32-bit
// words in the kernel's (little-endian) byte order, in hex, a colon, the
// port in hex; in tcp6, an IPv4 address as IPv4-mapped.
func procAddrs(a *net.TCPAddr, table string) []string {
	word := func(b []byte) string { return fmt.Sprintf("%02X%02X%02X%02X", b[3], b[2], b[1], b[0]) }
	port := fmt.Sprintf("%04X", a.Port)
	if strings.HasSuffix(table, "6") {
		ip := a.IP.To16()
		if ip == nil {
			return nil
		}
		return []string{word(ip[0:4]) + word(ip[4:8]) + word(ip[8:12]) + word(ip[12:16]) + ":" + port}
	}
	ip := a.IP.To4()
	if ip == nil {
		return nil
	}
	return []string{word(ip) + ":" + port}
}
