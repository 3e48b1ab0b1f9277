// Package loadbalancer is a small round-robin TCP load balancer for tests,
// of the kind operators put in front of a Vault cluster: each new
// connection goes to the next backend in turn, and stays there until one
// side closes it. With a health check it sends new connections only to
// backends that pass it (checked twice a second, as a load balancer's
// health check of /v1/sys/health would); without one it is plain round
// robin, which also sends them to a node that is sealed or frozen. It
// counts the HTTP/1.1 requests it forwards (their request lines), for
// tests that measure what clients ask of the backends.
package loadbalancer

import (
	"bytes"
	"io"
	"net"
	"sync"
	"testing"
	"time"
)

// Balancer forwards connections from its own loopback address to its
// backends.
type Balancer struct {
	backends []string
	check    func(backend string) bool
	l        net.Listener

	mu      sync.Mutex
	healthy []bool
	next    int
	// open are the connections to each backend, by client connection.
	open map[net.Conn]int
	// accepted counts the connections accepted; requests are the times
	// of the HTTP/1.1 request lines forwarded.
	accepted int
	requests []time.Time
	wg       sync.WaitGroup
	stop     chan struct{}
}

// checkInterval is how often backends are checked.
const checkInterval = 500 * time.Millisecond

// Start listens on a free loopback port and forwards to backends
// ("host:port"); check, when not nil, is the health check. It is closed
// when the test ends.
func Start(tb testing.TB, backends []string, check func(backend string) bool) *Balancer {
	tb.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		tb.Fatal(err)
	}
	b := &Balancer{backends: backends, check: check, l: l, healthy: make([]bool, len(backends)),
		open: map[net.Conn]int{}, stop: make(chan struct{})}
	for i := range b.healthy {
		b.healthy[i] = true
	}
	if check != nil {
		b.checkAll()
		b.wg.Add(1)
		go b.checkLoop()
	}
	b.wg.Add(1)
	go b.serve()
	tb.Cleanup(b.Close)
	return b
}

// Addr returns the balancer's "host:port".
func (b *Balancer) Addr() string { return b.l.Addr().String() }

// Open returns how many connections are open to each backend.
func (b *Balancer) Open() []int {
	b.mu.Lock()
	defer b.mu.Unlock()
	n := make([]int, len(b.backends))
	for _, i := range b.open {
		n[i]++
	}
	return n
}

// Accepted returns how many connections the balancer accepted.
func (b *Balancer) Accepted() int {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.accepted
}

// Requests returns the times of the HTTP/1.1 requests forwarded so far.
func (b *Balancer) Requests() []time.Time {
	b.mu.Lock()
	defer b.mu.Unlock()
	return append([]time.Time(nil), b.requests...)
}

// requestLine ends every HTTP/1.1 request line; a JSON body cannot hold
// its CR LF unescaped.
var requestLine = []byte(" HTTP/1.1\r\n")

// counter is the client-to-backend half of a connection: it counts the
// request lines that pass, also across two reads.
type counter struct {
	b    *Balancer
	r    io.Reader
	tail []byte
}

func (c *counter) Read(p []byte) (int, error) {
	n, err := c.r.Read(p)
	if n > 0 {
		buf := append(c.tail, p[:n]...)
		if k := bytes.Count(buf, requestLine); k > 0 {
			now := time.Now()
			c.b.mu.Lock()
			for range k {
				c.b.requests = append(c.b.requests, now)
			}
			c.b.mu.Unlock()
		}
		keep := min(len(buf), len(requestLine)-1)
		if i := bytes.LastIndex(buf, requestLine); i >= 0 && len(buf)-(i+len(requestLine)) < keep {
			keep = len(buf) - (i + len(requestLine))
		}
		c.tail = append(c.tail[:0], buf[len(buf)-keep:]...)
	}
	return n, err
}

// Close stops the balancer and closes every connection.
func (b *Balancer) Close() {
	b.mu.Lock()
	select {
	case <-b.stop:
		b.mu.Unlock()
		return
	default:
	}
	close(b.stop)
	b.l.Close()
	for c := range b.open {
		c.Close()
	}
	b.mu.Unlock()
	b.wg.Wait()
}

func (b *Balancer) checkLoop() {
	defer b.wg.Done()
	t := time.NewTicker(checkInterval)
	defer t.Stop()
	for {
		select {
		case <-b.stop:
			return
		case <-t.C:
			b.checkAll()
		}
	}
}

// checkAll checks every backend at once.
func (b *Balancer) checkAll() {
	results := make([]bool, len(b.backends))
	var wg sync.WaitGroup
	for i, backend := range b.backends {
		wg.Add(1)
		go func() {
			defer wg.Done()
			results[i] = b.check(backend)
		}()
	}
	wg.Wait()
	b.mu.Lock()
	copy(b.healthy, results)
	b.mu.Unlock()
}

// pick returns the next healthy backend in turn; when none is healthy,
// the next one.
func (b *Balancer) pick() int {
	b.mu.Lock()
	defer b.mu.Unlock()
	for range b.backends {
		i := b.next
		b.next = (b.next + 1) % len(b.backends)
		if b.healthy[i] {
			return i
		}
	}
	i := b.next
	b.next = (b.next + 1) % len(b.backends)
	return i
}

func (b *Balancer) serve() {
	defer b.wg.Done()
	for {
		c, err := b.l.Accept()
		if err != nil {
			return
		}
		b.mu.Lock()
		b.accepted++
		b.mu.Unlock()
		i := b.pick()
		backend, err := net.DialTimeout("tcp", b.backends[i], time.Second)
		if err != nil {
			c.Close()
			continue
		}
		b.mu.Lock()
		select {
		case <-b.stop:
			b.mu.Unlock()
			c.Close()
			backend.Close()
			return
		default:
		}
		b.open[c] = i
		b.mu.Unlock()
		b.wg.Add(2)
		done := func() {
			c.Close()
			backend.Close()
			b.mu.Lock()
			delete(b.open, c)
			b.mu.Unlock()
		}
		go func() {
			defer b.wg.Done()
			_, _ = io.Copy(backend, &counter{b: b, r: c})
			done()
		}()
		go func() {
			defer b.wg.Done()
			_, _ = io.Copy(c, backend)
			done()
		}()
	}
}
