package admin

import (
	"net"
	"sync"

	"github.com/kvmount/kvmount/peercred"
)

// MaxConnectionsPerUser is how many connections one local user may hold
// open to one endpoint at once, of its MaxConnections: a user who opens
// hundreds of idle connections holds this many, and the others are closed
// as they are accepted, so that they never delay another user's request.
const MaxConnectionsPerUser = 8

// perUserListener accepts at most MaxConnectionsPerUser connections of one
// local user at once (peercred.UID), closing the others as soon as they are
// accepted. Connections whose user cannot be found share one quota.
type perUserListener struct {
	net.Listener
	mu   sync.Mutex
	held map[int]int
}

func limitPerUser(l net.Listener) net.Listener {
	return &perUserListener{Listener: l, held: map[int]int{}}
}

// Accept returns the next connection whose user is within quota.
func (l *perUserListener) Accept() (net.Conn, error) {
	for {
		c, err := l.Listener.Accept()
		if err != nil {
			return nil, err
		}
		uid := peercred.UID(c)
		l.mu.Lock()
		if l.held[uid] >= MaxConnectionsPerUser {
			l.mu.Unlock()
			c.Close()
			continue
		}
		l.held[uid]++
		l.mu.Unlock()
		return &userConn{Conn: c, release: func() {
			l.mu.Lock()
			if l.held[uid]--; l.held[uid] <= 0 {
				delete(l.held, uid)
			}
			l.mu.Unlock()
		}}, nil
	}
}

// userConn gives its user's quota back when closed.
type userConn struct {
	net.Conn
	release func()
	once    sync.Once
}

func (c *userConn) Close() error {
	c.once.Do(c.release)
	return c.Conn.Close()
}
