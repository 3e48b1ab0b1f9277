// Package faultproxy is a loopback TCP proxy for tests that cuts the network
// between kvmount and a store: Cut drops every connection and refuses new
// ones, as a partition would, and Restore lets them through again on the
// same address. Sent counts what clients wrote to the store through it.
package faultproxy

import (
	"fmt"
	"io"
	"net"
	"sync"
	"sync/atomic"
)

// Proxy forwards connections from its own loopback address to a backend.
type Proxy struct {
	addr    string
	backend string

	mu       sync.Mutex
	listener net.Listener
	conns    map[net.Conn]struct{}
	wg       sync.WaitGroup
	// sent counts the bytes forwarded from clients to the backend.
	sent atomic.Int64
}

// Start listens on a free loopback port and forwards to backend
// ("host:port").
func Start(backend string) (*Proxy, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, fmt.Errorf("faultproxy: %w", err)
	}
	p := &Proxy{addr: l.Addr().String(), backend: backend, conns: map[net.Conn]struct{}{}}
	p.serve(l)
	return p, nil
}

// Addr returns the proxy's "host:port".
func (p *Proxy) Addr() string { return p.addr }

// Sent returns how many bytes clients have written to the backend through
// the proxy, over every connection so far.
func (p *Proxy) Sent() int64 { return p.sent.Load() }

// counted is a writer that adds what it writes to n.
type counted struct {
	io.Writer
	n *atomic.Int64
}

func (c counted) Write(b []byte) (int, error) {
	n, err := c.Writer.Write(b)
	c.n.Add(int64(n))
	return n, err
}

// Cut closes the listener and every open connection.
func (p *Proxy) Cut() {
	p.mu.Lock()
	if p.listener != nil {
		p.listener.Close()
		p.listener = nil
	}
	for c := range p.conns {
		c.Close()
	}
	p.mu.Unlock()
	p.wg.Wait()
}

// Restore listens again on the same address.
func (p *Proxy) Restore() error {
	l, err := net.Listen("tcp", p.addr)
	if err != nil {
		return fmt.Errorf("faultproxy: %w", err)
	}
	p.serve(l)
	return nil
}

// Close cuts the proxy for good.
func (p *Proxy) Close() { p.Cut() }

func (p *Proxy) serve(l net.Listener) {
	p.mu.Lock()
	p.listener = l
	p.mu.Unlock()
	p.wg.Add(1)
	go func() {
		defer p.wg.Done()
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			p.forward(c)
		}
	}()
}

// forward pipes c to a new connection to the backend, both ways.
func (p *Proxy) forward(c net.Conn) {
	b, err := net.Dial("tcp", p.backend)
	if err != nil {
		c.Close()
		return
	}
	p.mu.Lock()
	if p.listener == nil {
		p.mu.Unlock()
		c.Close()
		b.Close()
		return
	}
	p.conns[c] = struct{}{}
	p.conns[b] = struct{}{}
	p.mu.Unlock()
	pipe := func(dst, src net.Conn, to io.Writer) {
		defer p.wg.Done()
		_, _ = io.Copy(to, src) // ends when either side closes or Cut runs
		dst.Close()
		src.Close()
		p.mu.Lock()
		delete(p.conns, dst)
		delete(p.conns, src)
		p.mu.Unlock()
	}
	p.wg.Add(2)
	go pipe(b, c, counted{b, &p.sent})
	go pipe(c, b, c)
}
