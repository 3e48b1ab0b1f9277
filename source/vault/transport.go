package vault

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptrace"
	"sync"
	"time"

	"github.com/kvmount/kvmount/origin"
	"github.com/kvmount/kvmount/source"
)

// transport is the round tripper of a source's API client. It keeps a
// source from being pinned to one node of an HA cluster behind a load
// balancer, and bounds what a server can make kvmount read:
//
//   - after a 5xx or a 429 answer the connection it came on is closed, so
//     that the next request dials again and a load balancer can send it to
//     another node (a sealed node answers 503 for as long as it is sealed;
//     a node that lost its active role 500). The error is returned as
//     usual, and the caller backs off;
//   - a redirect (a standby's 307 to the active node's api_addr) is not
//     followed: the load balancer in front is the way to the active node,
//     and the address a standby names may be a dead node, another port or
//     a name the worker may not reach. It fails with an error wrapping
//     ErrRedirect, on a closed connection, and is retried through the
//     configured address;
//   - a request whose answer has not begun within headerWait fails, and
//     its connection is closed: Vault computes an answer before it sends
//     it, so a node that holds a request this long is taken for frozen
//     (SIGSTOP, a stalled disk, a standby forwarding to a frozen active
//     node), and the retry dials again. A request whose answer Vault may
//     take seconds to compute (withPatience: a certificate's issue, a
//     dynamic secret's read) waits for the whole timeout instead;
//   - a response whose body passes limit bytes fails with an error
//     wrapping source.ErrOverLimits.
//
// A transport error closes its connection already (net/http).
type transport struct {
	next       http.RoundTripper
	limit      int64
	headerWait time.Duration
}

// errNoAnswer is the cause of a request cancelled for want of an answer.
var errNoAnswer = errors.New("no answer")

// ErrRedirect wraps the error of a request answered with a redirect.
var ErrRedirect = errors.New("redirects are not followed")

// maxErrorBody is the most bytes of a failed response's body kept after
// its connection is closed: Vault's error bodies are a few hundred bytes.
const maxErrorBody = 64 << 10

// RoundTrip sends req, drops the connection of a failed answer, refuses a
// redirect and bounds the response's body.
func (t transport) RoundTrip(req *http.Request) (*http.Response, error) {
	var (
		mu   sync.Mutex
		conn net.Conn
	)
	trace := &httptrace.ClientTrace{GotConn: func(info httptrace.GotConnInfo) {
		mu.Lock()
		conn = info.Conn
		mu.Unlock()
	}}
	ctx, cancel := context.WithCancelCause(httptrace.WithClientTrace(req.Context(), trace))
	if t.headerWait > 0 && !patient(req.Context()) {
		timer := time.AfterFunc(t.headerWait, func() { cancel(errNoAnswer) })
		defer timer.Stop()
	}
	resp, err := t.next.RoundTrip(req.WithContext(ctx))
	if err != nil {
		if errors.Is(context.Cause(ctx), errNoAnswer) {
			err = fmt.Errorf("no answer within %v: the node is taken for frozen and the request retried", t.headerWait)
		}
		cancel(nil)
		return nil, err
	}
	// The request's context lives until its body is closed.
	resp.Body = &cancelOnClose{ReadCloser: resp.Body, cancel: func() { cancel(nil) }}
	mu.Lock()
	used := conn
	mu.Unlock()
	switch code := resp.StatusCode; {
	case code >= 300 && code < 400:
		drop(used, resp)
		resp.Body.Close()
		where := "no location"
		if loc, err := resp.Location(); err == nil {
			where = origin.Of(loc)
		}
		return nil, fmt.Errorf("%d %s (to %s): %w; the request is retried through the configured address", code, http.StatusText(code), where, ErrRedirect)
	case code >= 500 || code == http.StatusTooManyRequests:
		drop(used, resp)
	}
	if t.limit <= 0 {
		return resp, nil
	}
	if resp.ContentLength > t.limit {
		resp.Body.Close()
		return nil, fmt.Errorf("a response of %d bytes, more than max_response_size (%d bytes): %w", resp.ContentLength, t.limit, source.ErrOverLimits)
	}
	resp.Body = source.LimitBody(resp.Body, t.limit)
	return resp, nil
}

// patientKey marks a request's context (withPatience) whose answer may
// take the whole timeout.
type patientKey struct{}

// withPatience returns ctx for a request whose answer Vault may take
// seconds to compute: a certificate's issue (its key generation), a
// dynamic secret's read (a user created in a database). Such a request
// is bounded by the source's timeout alone, not by headerWait, so that it
// is not retried — and its credentials made again — while Vault works.
func withPatience(ctx context.Context) context.Context {
	return context.WithValue(ctx, patientKey{}, true)
}

// patient reports whether ctx is withPatience's.
func patient(ctx context.Context) bool {
	p, _ := ctx.Value(patientKey{}).(bool)
	return p
}

// cancelOnClose is a response body that ends its request's context when
// closed.
type cancelOnClose struct {
	io.ReadCloser
	cancel func()
}

// Close closes the body and ends the request's context.
func (c *cancelOnClose) Close() error {
	err := c.ReadCloser.Close()
	c.cancel()
	return err
}

// drop closes conn, the connection resp came on, before the transport can
// put it back among its idle connections (which it does once the body is
// read to its end), and keeps what the body had already delivered, at
// most maxErrorBody bytes: the server's error messages, for the log.
func drop(conn net.Conn, resp *http.Response) {
	if conn == nil {
		return
	}
	conn.Close()
	body, _ := io.ReadAll(io.LimitReader(resp.Body, maxErrorBody))
	resp.Body.Close()
	resp.Body = io.NopCloser(bytes.NewReader(body))
	resp.ContentLength = int64(len(body))
}
